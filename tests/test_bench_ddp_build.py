"""``dptrain bench ddp --reverse-build``: the variants built last to first (which is built first places its memory)."""

import pytest

from dptrain.testing import run_on_ranks


def _built(rank: int, world_size: int, reverse: bool) -> list[str]:
    import dptrain.bench.ddp as bench

    seen, wrap = [], bench._wrap
    bench._wrap = lambda variant, module, last: (seen.append(variant), wrap(variant, module, last))[1]
    args = dict(variants=["no_comm", "torch_ddp/25", "dptrain_ddp/25"], width=8, depth=1, micro_batch=2, rounds=1,
                steps=1, warmup=0, model="mlp", reverse_build=reverse)
    out = bench._bench_rank(rank, world_size, args)
    assert set(out["times"]) == set(args["variants"])  # every variant still timed, under its own name
    return seen


@pytest.mark.parametrize("reverse", [False, True], ids=["listed", "reversed"])
def test_the_variants_are_built_in_the_order_asked(reverse: bool) -> None:
    listed = ["no_comm", "torch_ddp/25", "dptrain_ddp/25"]
    assert run_on_ranks(_built, 1, reverse)[0] == (listed[::-1] if reverse else listed)
