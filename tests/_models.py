"""Tiny models covering what data parallelism must get right, and their data.

Each model exercises one hazard: BatchNorm buffers, tied weights, parameters unused on
some steps (or some ranks), and activation checkpointing where a weight is shared
between two checkpointed segments (its gradient arrives twice under reentrant
checkpointing).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptrain.models.gpt import GPT

IN, HIDDEN, OUT, VOCAB = 6, 12, 3, 11


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                    nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, x):
        return self.layers(x)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its true gradient is exactly zero, so what is left is
        # rounding noise, which Adam would amplify into full-size steps of random sign.
        self.fc1 = nn.Linear(IN, HIDDEN, bias=False)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (as in GPT-2)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.embed(tokens)))  # (B, T, H)
        return h @ self.embed.weight.t()  # (B, T, V)


class Branchy(nn.Module):
    """A trunk, plus a branch that only some forwards use."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.branch = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x, use_branch: bool = True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class Checkpointed(nn.Module):
    """Checkpointed segments that all apply ``shared``, each with a private block.

    ``segments`` (all 3 by default) may change from step to step: then the number of
    gradient pieces ``shared`` receives under reentrant checkpointing changes too, and
    private blocks go unused.
    """

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(IN, HIDDEN)
        self.shared = nn.Linear(HIDDEN, HIDDEN)
        self.private = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.head = nn.Linear(HIDDEN, OUT)

    def _segment(self, h, i):
        return torch.tanh(self.private[i](torch.tanh(self.shared(h))))

    def forward(self, x, segments: int = 3):
        h = self.inp(x)
        for i in range(segments):
            h = checkpoint(self._segment, h, i, use_reentrant=self.use_reentrant)
        return self.head(h)


class Regrouped(nn.Module):
    """Three private blocks split into 2 or 3 reentrant-checkpointed groups, each group
    starting with ``shared``: every parameter is always used, but ``shared``'s gradient
    arrives in as many pieces as there are groups, which the caller chooses per step."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.shared = nn.Linear(HIDDEN, HIDDEN)
        self.private = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.head = nn.Linear(HIDDEN, OUT)

    def _group(self, h, blocks):
        h = torch.tanh(self.shared(h))
        for i in blocks:
            h = torch.tanh(self.private[i](h))
        return h

    def forward(self, x, groups: int = 3):
        h = self.inp(x)
        for blocks in ([[0, 1], [2]] if groups == 2 else [[0], [1], [2]]):
            h = checkpoint(self._group, h, blocks, use_reentrant=True)
        return self.head(h)


class Layer(nn.Module):
    """One block of :class:`Stack`: stage 3's unit class in the tests."""

    def __init__(self, width: int = HIDDEN):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h):
        return h + torch.tanh(self.norm(self.fc(h)))


class Stack(nn.Module):
    """An input layer, three :class:`Layer` blocks and a head (4 + 3 x 4 parameters).

    663 elements at the default width 12; 757 (a prime) at width 13, where the root unit
    (133) is not divisible by 2, 3 or 4 and the blocks (208) not by 3.
    """

    def __init__(self, width: int = HIDDEN):
        super().__init__()
        self.inp = nn.Linear(IN, width)
        self.layers = nn.ModuleList([Layer(width) for _ in range(3)])
        self.head = nn.Linear(width, OUT)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(name: str) -> nn.Module:
    builders = {
        "stack": Stack,
        "stack13": lambda: Stack(13),
        "gpt": lambda: GPT(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8),
        "mlp": MLP,
        "bn": BatchNormNet,
        "tied": TiedLM,
        "branchy": Branchy,
        "ckpt_reentrant": lambda: Checkpointed(use_reentrant=True),
        "ckpt_nonreentrant": lambda: Checkpointed(use_reentrant=False),
        "regrouped": Regrouped,
    }
    return builders[name]()


def global_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, identical on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in ("tied", "gpt"):
        tokens = torch.randint(0, VOCAB, (size, 5), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name in ("tied", "gpt"):
        return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def max_relative_diff(model: nn.Module, reference: nn.Module) -> float:
    """max over parameters of max|p - p_ref| / max|p_ref|."""
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        scale = q.detach().abs().max().clamp_min(1e-12)
        worst = max(worst, ((p.detach() - q.detach()).abs().max() / scale).item())
    return worst


def flat_state(model: nn.Module) -> torch.Tensor:
    """All parameters and floating buffers, flattened, for cross-rank identity checks."""
    tensors = [p.detach().reshape(-1) for p in model.parameters()]
    tensors += [b.detach().reshape(-1).float() for b in model.buffers()]
    return torch.cat(tensors)
