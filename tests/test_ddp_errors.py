"""Bad input gets a clear error on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _models import Branchy, build, global_batch, loss_fn
from dptrain import DistributedDataParallel, ReplicaMismatchError, UnusedParametersError
from dptrain.testing import RankFailedError, run_on_ranks


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the test inspects what every rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _wrap_frozen(rank: int, world_size: int) -> str | None:
    model = nn.Linear(3, 3).requires_grad_(False)
    return _error_of(lambda: DistributedDataParallel(model))


def test_a_model_with_nothing_to_train_is_refused_on_every_rank() -> None:
    for error in run_on_ranks(_wrap_frozen, 2):
        assert error and error.startswith("NothingToTrainError") and "no parameters that require a gradient" in error


def _wrap_mismatched(rank: int, world_size: int) -> str | None:
    hidden = 13 if rank == 1 else 12
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    return _error_of(lambda: DistributedDataParallel(model))


def test_parameters_of_mismatched_shapes_are_named_on_every_rank() -> None:
    errors = run_on_ranks(_wrap_mismatched, 3)
    for error in errors:
        assert error is not None and error.startswith(ReplicaMismatchError.__name__)
        assert "'0.weight'" in error and "(12, 4) on rank 0 vs (13, 4)" in error and "rank 1" in error
    assert len(set(errors)) == 1, "every rank should report the same mismatch"


def _wrap_with_bucket_cap(rank: int, world_size: int, cap: float) -> str | None:
    return _error_of(lambda: DistributedDataParallel(nn.Linear(3, 3), bucket_cap_mb=cap))


@pytest.mark.parametrize("cap", [0, -1.5])
def test_non_positive_bucket_cap_is_refused_on_every_rank(cap: float) -> None:
    for error in run_on_ranks(_wrap_with_bucket_cap, 2, cap):
        assert error and error.startswith("ValueError") and f"bucket_cap_mb must be > 0, got {cap}" in error


def test_uninitialised_process_group_is_explained() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"not initialised: call torch.distributed.init_process_group"):
        DistributedDataParallel(nn.Linear(3, 3))


def test_torch_arguments_dptrain_does_not_implement_say_what_to_do() -> None:
    with pytest.raises(TypeError, match="does not support torch's 'device_mesh': pass process_group="):
        DistributedDataParallel(nn.Linear(3, 3), device_mesh=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'bukcet_cap_mb'"):
        DistributedDataParallel(nn.Linear(3, 3), bukcet_cap_mb=4)


def _backward_with_unused(rank: int, world_size: int, unused_on: str) -> str | None:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy(), bucket_cap_mb=0.0004)
    x, y = global_batch("branchy", 0, 4)
    use_branch = unused_on == "one_rank" and rank != 0
    error = _error_of(lambda: loss_fn("branchy", ddp(x, use_branch=use_branch), y).backward())
    if error is None:
        # Ranks that saw no problem carry on; they must not hang in the next step.
        loss_fn("branchy", ddp(x, use_branch=True), y).backward()
    return error


def test_unused_parameters_are_named_on_every_rank_without_a_hang() -> None:
    for error in run_on_ranks(_backward_with_unused, 3, "all_ranks"):
        assert error and error.startswith(UnusedParametersError.__name__)
        assert "branch.weight, branch.bias" in error and "find_unused_parameters=True" in error


def test_unused_parameters_on_one_rank_fail_the_job_instead_of_hanging() -> None:
    # Rank 0 alone skips the branch: it raises, the others' next collective then fails
    # because rank 0 left, and the harness reports rank 0's error first.
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(_backward_with_unused_then_exit, 2, timeout=60)
    message = str(failure.value)
    assert message.startswith("rank 0 of 2 failed first") and "branch.weight" in message


def _backward_with_unused_then_exit(rank: int, world_size: int) -> None:
    error = _backward_with_unused(rank, world_size, "one_rank")
    if error:
        raise RuntimeError(error)


def _double_backward(rank: int, world_size: int) -> str | None:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(build("mlp"))
    x, y = global_batch("mlp", 0, 4)
    loss = loss_fn("mlp", ddp(x), y)
    loss.backward(retain_graph=True)
    return _error_of(lambda: loss.backward())


def test_a_second_backward_through_one_forward_is_refused() -> None:
    for error in run_on_ranks(_double_backward, 2):
        assert error and "already reduced" in error and "no_sync" in error


def _hook_after_forward(rank: int, world_size: int) -> str | None:
    ddp = DistributedDataParallel(build("mlp"))
    ddp(global_batch("mlp", 0, 4)[0])
    return _error_of(lambda: ddp.register_comm_hook(None, lambda state, bucket: None))


def test_comm_hook_must_be_registered_before_the_first_forward() -> None:
    for error in run_on_ranks(_hook_after_forward, 2):
        assert error and "before the first forward" in error


def _dynamic_graph_with_bucket_views(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(build("ckpt_reentrant"), bucket_cap_mb=0.0004, gradient_as_bucket_view=True,
                                  find_unused_parameters=True)
    x, y = global_batch("ckpt_reentrant", 0, 4)
    outcomes = []
    for segments in (2, 2, 3):  # the third step uses a new block and gives `shared` an extra piece
        outcomes.append(_error_of(lambda s=segments: loss_fn("mlp", ddp(x, segments=s), y).backward()))
    return outcomes


def test_a_changed_graph_with_bucket_views_is_refused_not_silently_wrong() -> None:
    for outcomes in run_on_ranks(_dynamic_graph_with_bucket_views, 2):
        assert outcomes[:2] == [None, None]
        error = outcomes[2]
        assert error and ("'private.2." in error or "'shared." in error), error
        assert "received gradient piece" in error and "gradient_as_bucket_view=False" in error


def _ddp_with_algorithm(rank: int, world_size: int, algorithms: list[str]) -> str:
    try:
        DistributedDataParallel(build("mlp"), algorithm=algorithms[rank])
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_an_unknown_or_mismatched_algorithm_is_refused_at_construction() -> None:
    for error in run_on_ranks(_ddp_with_algorithm, 2, ["trees", "trees"], timeout=60):
        assert "unknown algorithm 'trees' (did you mean 'tree'?)" in error
    for error in run_on_ranks(_ddp_with_algorithm, 2, ["ring", "tree"], timeout=60):
        assert "ReplicaMismatchError" in error and "option algorithm='ring' (nodes None) on rank 0 vs 'tree'" in error
