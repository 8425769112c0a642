"""Streaming DiLoCo's fragments: which trained parameters sync together.

Streaming DiLoCo (Douillard et al. 2025) splits the model into P fragments and syncs one
fragment at a time, so a sync point sends 1/P of the model. The paper's fragments are
groups of transformer blocks: *strided* (fragment p holds blocks p, p + P, p + 2P, ...;
its default, every fragment then spans the depth) or *sequential* (consecutive blocks, as
torchtitan's pipeline-stage splitter cuts them).

The blocks of a model are found, not named: among the ``nn.ModuleList`` (and
``Sequential``) modules with at least P members holding trained parameters, the one
holding the most of them whose members are all of one class (GPT's ``blocks``, a Hugging
Face model's ``layers`` or ``h``; the inner list of ``Sequential(embedding,
Sequential(*blocks), head)``, not the outer one), or failing that the one holding the
most. Each block goes to its fragment by the pattern;
every other parameter (embeddings, final norm, head) then goes, largest first, to the
fragment holding the fewest elements so far, so the fragments' sizes stay close. A model
without such a list is split parameter by parameter the same way (largest first, to the
lightest fragment). ``fragment_of`` (a function from a parameter's name to its fragment)
overrides both rules for a model whose structure the user knows better.

The assignment depends on the model's structure (and ``fragment_of``'s answers) only; every
rank computes its own, and the ranks compare them once (:mod:`dptrain.diloco.streaming`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["PATTERNS", "split_fragments"]

PATTERNS = ("strided", "sequential")


def split_fragments(module: nn.Module, params: list[nn.Parameter], count: int, pattern: str = "strided",
                    fragment_of: Callable[[str], int] | None = None) -> list[list[int]]:
    """Indices into ``params`` (the trained parameters, in ``module.parameters()`` order) of each of ``count``
    fragments, each in ascending order; every index in exactly one fragment, no fragment empty."""
    if pattern not in PATTERNS:
        raise ValueError(f"DiLoCo's fragment_pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    index = {id(p): i for i, p in enumerate(params)}
    names = {id(p): name for name, p in module.named_parameters() if id(p) in index}
    if count == 1:
        return [list(range(len(params)))]
    if fragment_of is not None:
        fragments = _by_function(params, names, count, fragment_of)
    else:
        fragments = [[] for _ in range(count)]
        sizes = [0] * count
        blocks = _blocks(module, index, count)
        placed: set[int] = set()
        for b, block in enumerate(blocks):
            f = b % count if pattern == "strided" else b * count // len(blocks)
            for p in block.parameters():
                if id(p) in index and index[id(p)] not in placed:
                    placed.add(index[id(p)])
                    fragments[f].append(index[id(p)])
                    sizes[f] += p.numel()
        rest = sorted((i for i in range(len(params)) if i not in placed), key=lambda i: (-params[i].numel(), i))
        for i in rest:
            f = min(range(count), key=lambda f: (sizes[f], f))
            fragments[f].append(i)
            sizes[f] += params[i].numel()
    empty = [f for f, members in enumerate(fragments) if not members]
    if empty:
        raise ValueError(f"DiLoCo's {count} fragments: fragment(s) {empty} would hold no parameter (the model has "
                         f"{len(params)} trained parameter(s)); set diloco.fragments to at most the model's blocks")
    return [sorted(members) for members in fragments]


def _blocks(module: nn.Module, index: dict[int, int], count: int) -> list[nn.Module]:
    """The blocks (the module docstring's rule): the members holding trained parameters of the chosen list."""
    best: list[nn.Module] = []
    best_key = (False, 0, 0)
    for child in module.modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)):
            continue
        members = [m for m in child if any(id(p) in index for p in m.parameters())]  # a block holds trained ones
        size = sum(p.numel() for p in child.parameters() if id(p) in index)
        # the blocks: members of one class (an outer Sequential of embedding, blocks and head holds more, in
        # members of different classes), then the most parameters
        key = (len({type(m) for m in members}) == 1, size, len(members))
        if len(members) >= count and key > best_key:
            best, best_key = members, key
    return best


def _by_function(params: list[nn.Parameter], names: dict[int, str], count: int,
                 fragment_of: Callable[[str], int]) -> list[list[int]]:
    fragments: list[list[int]] = [[] for _ in range(count)]
    for i, p in enumerate(params):
        name = names.get(id(p), str(i))
        f = fragment_of(name)
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < count:
            raise ValueError(f"DiLoCo's fragment_of({name!r}) gave {f!r}: a fragment index in 0..{count - 1} "
                             f"(diloco.fragments = {count})")
        fragments[f].append(i)
    return fragments
