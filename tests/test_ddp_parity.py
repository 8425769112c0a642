"""Parity: N ranks with micro-batch b step exactly like one process on the N*b global batch.

Each rank trains the DDP model and, beside it, a single-process reference on the whole
global batch; parameters are compared after every step (FSDP's test pattern). Replicas
are initialised from different seeds on purpose: construction must broadcast rank 0's.

Two references are used:
- "full": one forward/backward of the whole global batch. Exact for models whose loss
  over a batch is the mean of per-sample losses.
- "per_replica": the global batch run as N separate micro-batches whose losses are
  averaged. Needed where a replica's computation depends on its own micro-batch as a
  whole (BatchNorm normalises with micro-batch statistics; data-parallel BatchNorm is
  not SyncBatchNorm) or differs by rank (a branch used on one rank only). Running
  statistics follow DDP's rule: rank 0's are broadcast before the next forward.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import pytest
import torch

from _models import build, flat_state, global_batch, loss_fn, make_optimizer, max_relative_diff
from dptrain import DistributedDataParallel, NaiveDataParallel
from dptrain.testing import run_on_ranks

MICRO = 4
STEPS = 6
TOLERANCE = 1e-5
# Adam's first step moves an element by lr * g / (|g| + eps): at a gradient near eps (a sum
# that cancels) a rounding difference d moves it by up to lr * d / (4 eps). Measured: 3 ranks'
# sum against one batch's gives 1.58e-7 against 1.56e-7 for one element of
# checkpoint_reentrant_dynamic's inp.weight, 1.3e-5 of the parameter's scale after Adam on
# one CPU (<1e-5 on another); every other case stays below 1.4e-6. A missing or wrong
# reduction moves Adam's parameters by a good part of lr, far above this bound.
ADAM_TOLERANCE = 1e-4
TINY_BUCKETS = 0.0004  # MiB: a few hundred bytes, so tiny models still get several buckets


@dataclass(frozen=True)
class Case:
    model: str
    ddp: dict = field(default_factory=dict)
    reference: str = "full"            # "full" or "per_replica"
    branch: str = "always"             # branchy only: "always", "odd_steps", "one_rank", "never", "no_sync_only"
    dynamic_segments: bool = False     # checkpointed only: 2 segments on even steps, 3 on odd
    accum: int = 1                     # micro-steps per optimizer step (no_sync for all but last)
    set_to_none: bool = True           # zero_grad(set_to_none=...): False keeps .grad tensors alive
    wrapper: str = "ddp"               # "ddp" or "naive"


CASES = {
    "mlp": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS}),
    "mlp_default_buckets": Case("mlp"),
    "mlp_grad_as_bucket_view": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "gradient_as_bucket_view": True}),
    # .grad stays a view of the bucket between steps: gradients accumulate in place.
    "mlp_grad_as_bucket_view_kept": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "gradient_as_bucket_view": True},
                                         accum=2, set_to_none=False),
    "mlp_grads_kept": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS}, accum=2, set_to_none=False),
    "batchnorm": Case("bn", {"bucket_cap_mb": TINY_BUCKETS}, reference="per_replica"),
    "tied_weights": Case("tied", {"bucket_cap_mb": TINY_BUCKETS}),
    "unused_on_some_steps": Case("branchy", {"bucket_cap_mb": TINY_BUCKETS, "find_unused_parameters": True},
                                 branch="odd_steps"),
    "unused_on_some_ranks": Case("branchy", {"bucket_cap_mb": TINY_BUCKETS, "find_unused_parameters": True},
                                 reference="per_replica", branch="one_rank"),
    "static_graph_unused": Case("branchy", {"bucket_cap_mb": TINY_BUCKETS, "static_graph": True}, branch="never"),
    "checkpoint_reentrant": Case("ckpt_reentrant", {"bucket_cap_mb": TINY_BUCKETS}),
    "checkpoint_reentrant_view": Case("ckpt_reentrant", {"bucket_cap_mb": TINY_BUCKETS,
                                                         "gradient_as_bucket_view": True}),
    "checkpoint_reentrant_find_unused": Case("ckpt_reentrant", {"bucket_cap_mb": TINY_BUCKETS,
                                                                "find_unused_parameters": True}),
    "checkpoint_nonreentrant": Case("ckpt_nonreentrant", {"bucket_cap_mb": TINY_BUCKETS}),
    # The shared weight's gradient arrives in 2 pieces on even steps and 3 on odd ones:
    # the extra piece comes after the bucket was launched and is reduced again, exactly.
    "checkpoint_reentrant_dynamic": Case("ckpt_reentrant", {"bucket_cap_mb": TINY_BUCKETS,
                                                            "find_unused_parameters": True},
                                         dynamic_segments=True),
    "no_sync_accumulation": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS}, accum=3),
    # The branch runs only in the no_sync micro-step: it is used, by every rank, since the last sync.
    "no_sync_only_branch": Case("branchy", {"bucket_cap_mb": TINY_BUCKETS, "find_unused_parameters": True},
                                reference="per_replica", accum=2, branch="no_sync_only"),
    "no_sync_accumulation_batchnorm": Case("bn", {"bucket_cap_mb": TINY_BUCKETS}, reference="per_replica",
                                           accum=2),
    # Buckets all-reduced by dptrain's own algorithms (dptrain.comm) instead of the backend's.
    "algorithm_ring": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "ring"}),
    "algorithm_tree": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "tree"}),
    "algorithm_naive": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "naive"}),
    "algorithm_hierarchical": Case("mlp", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "hierarchical",
                                           "nodes": "two_per_node"}),
    "algorithm_ring_unused_on_some_ranks": Case("branchy", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "ring",
                                                            "find_unused_parameters": True},
                                                reference="per_replica", branch="one_rank"),
    "algorithm_tree_checkpoint_dynamic": Case("ckpt_reentrant", {"bucket_cap_mb": TINY_BUCKETS, "algorithm": "tree",
                                                                 "find_unused_parameters": True},
                                              dynamic_segments=True),
    "naive": Case("mlp", wrapper="naive"),
    "naive_unused_on_some_ranks": Case("branchy", reference="per_replica", branch="one_rank", wrapper="naive"),
}


def _forward_kwargs(case: Case, step: int, replica: int, world_size: int, micro: int = 0) -> dict:
    if case.dynamic_segments:
        return {"segments": 2 + step % 2}
    if case.model != "branchy":
        return {}
    use = {"always": True, "never": False, "odd_steps": step % 2 == 1,
           "one_rank": replica == step % world_size, "no_sync_only": micro < case.accum - 1}[case.branch]
    return {"use_branch": use}


def _micro_slice(case: Case, k: int, replica: int, world_size: int) -> slice:
    # Micro-step k of replica r takes rows [(k * N + r) * b, ... + b) of the global batch.
    start = (k * world_size + replica) * MICRO
    return slice(start, start + MICRO)


def _wrap(case: Case, module: torch.nn.Module, world_size: int):
    if case.wrapper == "naive":
        return NaiveDataParallel(module)
    kwargs = dict(case.ddp)
    if kwargs.get("nodes") == "two_per_node":
        kwargs["nodes"] = 2 if world_size % 2 == 0 else 1
    return DistributedDataParallel(module, **kwargs)


def _dp_step(case, model, opt, x, y, rank, world_size, step) -> None:
    opt.zero_grad(set_to_none=case.set_to_none)
    for k in range(case.accum):
        rows = _micro_slice(case, k, rank, world_size)
        sync = contextlib.nullcontext() if k == case.accum - 1 else model.no_sync()
        with sync:
            out = model(x[rows], **_forward_kwargs(case, step, rank, world_size, k))
            (loss_fn(case.model, out, y[rows]) / case.accum).backward()
    opt.step()


def _reference_step(case, reference, opt, x, y, world_size, step) -> None:
    opt.zero_grad(set_to_none=True)
    if case.reference == "full":
        out = reference(x, **_forward_kwargs(case, step, 0, world_size))
        loss_fn(case.model, out, y).backward()
        opt.step()
        return
    # Per replica. Buffers follow DDP's rule: every replica starts the step from rank 0's
    # buffers (broadcast before the step's first forward), updates its own during the
    # step's micro-steps, and rank 0's are the ones the next step starts from.
    replica_buffers = [[b.clone() for b in reference.buffers()]] * world_size
    for k in range(case.accum):
        for replica in range(world_size):
            _load_buffers(reference, replica_buffers[replica])
            rows = _micro_slice(case, k, replica, world_size)
            out = reference(x[rows], **_forward_kwargs(case, step, replica, world_size, k))
            (loss_fn(case.model, out, y[rows]) / (case.accum * world_size)).backward()
            replica_buffers[replica] = [b.clone() for b in reference.buffers()]
    _load_buffers(reference, replica_buffers[0])
    opt.step()


def _load_buffers(module, values) -> None:
    with torch.no_grad():
        for b, v in zip(module.buffers(), values, strict=True):
            b.copy_(v)


def _run_case(rank: int, world_size: int, case: Case) -> dict:
    errors, states = {}, {}
    for opt_kind in ("sgd", "adam"):
        torch.manual_seed(0)
        reference = build(case.model)
        torch.manual_seed(0 if rank == 0 else 100 + rank)  # others differ: DDP must broadcast rank 0's
        local = build(case.model)
        model = _wrap(case, local, world_size)
        opt = make_optimizer(opt_kind, model.parameters())
        ref_opt = make_optimizer(opt_kind, reference.parameters())
        errors[opt_kind] = []
        for step in range(STEPS):
            x, y = global_batch(case.model, step, MICRO * world_size * case.accum)
            _dp_step(case, model, opt, x, y, rank, world_size, step)
            _reference_step(case, reference, ref_opt, x, y, world_size, step)
            errors[opt_kind].append(max_relative_diff(local, reference))
            if rank == 0:
                errors[opt_kind][-1] = max(errors[opt_kind][-1], _buffer_diff(local, reference))
        with torch.no_grad():  # an eval forward re-broadcasts buffers: replicas now identical
            model(global_batch(case.model, 0, MICRO)[0], **_forward_kwargs(case, 0, rank, world_size))
        states[opt_kind] = flat_state(local)
    return {"errors": errors, "states": states}


def _buffer_diff(model, reference) -> float:
    worst = 0.0
    for b, r in zip(model.buffers(), reference.buffers(), strict=True):
        if b.is_floating_point():
            worst = max(worst, ((b - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
        elif not torch.equal(b, r):
            worst = float("inf")
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_single_process(name: str, world_size: int) -> None:
    case = CASES[name]
    results = run_on_ranks(_run_case, world_size, case)
    for rank, result in enumerate(results):
        for opt_kind, per_step in result["errors"].items():
            assert max(per_step) <= (ADAM_TOLERANCE if opt_kind == "adam" else TOLERANCE), (
                f"{name}, world {world_size}, rank {rank}, {opt_kind}: relative difference from the "
                f"single-process reference per step = {per_step}")
    for opt_kind in ("sgd", "adam"):
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result["states"][opt_kind], results[0]["states"][opt_kind]), (
                f"{name}, {opt_kind}: rank {rank}'s parameters or buffers differ from rank 0's")


def _bucketed_vs_naive(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(7 + rank)
    a = build("mlp")
    b = copy.deepcopy(a)
    bucketed = DistributedDataParallel(a, bucket_cap_mb=TINY_BUCKETS)
    naive = NaiveDataParallel(b)
    opt_a, opt_b = make_optimizer("adam", a.parameters()), make_optimizer("adam", b.parameters())
    diffs = []
    for step in range(STEPS):
        x, y = global_batch("mlp", step, MICRO * world_size)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        for model, opt in ((bucketed, opt_a), (naive, opt_b)):
            opt.zero_grad()
            loss_fn("mlp", model(x[rows]), y[rows]).backward()
            opt.step()
        diffs.append(max_relative_diff(a, b))
    return diffs


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_equals_naive(world_size: int) -> None:
    for rank, diffs in enumerate(run_on_ranks(_bucketed_vs_naive, world_size)):
        assert max(diffs) <= TOLERANCE, f"rank {rank}: bucketed vs naive per step {diffs}"


def _fill_per_parameter(bucket, divisor, as_view: bool, filled=frozenset()) -> None:
    """The oracle for ``Bucket.fill``: each gradient into its slice on its own, divided by ``divisor``.

    A missing gradient is zeros; one that already is its slice is divided in place; another is multiplied
    by 1 / divisor into the slice (one pass, as torch's reducer does) and, with bucket views, re-pointed at it.
    """
    for position, (param, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
        grad = param.grad
        if position in filled:
            continue
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            if divisor is not None:
                view.div_(divisor)
        else:
            if divisor is not None:
                torch.mul(grad, 1.0 / divisor, out=view)
            else:
                view.copy_(grad)
            if as_view:
                param.grad = view


def _write_back_per_parameter(bucket, used, as_view: bool) -> None:
    """The oracle for ``Bucket.write_back``: each used parameter's gradient from its slice on its own."""
    for i, param, view in zip(bucket.param_indices, bucket.params, bucket.views, strict=True):
        if used is not True and not used[i]:
            continue
        if as_view:
            param.grad = view
        elif param.grad is None:
            param.grad = view.clone()
        else:
            param.grad.copy_(view)


def _per_parameter(ddp: DistributedDataParallel) -> None:
    """Make every bucket of ``ddp`` copy gradients in and out one parameter at a time (the test's oracle)."""
    import types

    for bucket in ddp.reducer.buckets:
        bucket.fill = types.MethodType(_fill_per_parameter, bucket)
        bucket.write_back = types.MethodType(_write_back_per_parameter, bucket)


def _batched_against_per_parameter(rank: int, world_size: int, name: str, as_view: bool, set_to_none: bool,
                                   eager_numel: int) -> int:
    """Two replicas, one filling buckets with one batched copy, one parameter by parameter: gradients compared
    bitwise after every backward. Returns how many gradients were compared."""
    import dptrain.ddp.reducer

    dptrain.ddp.reducer.EAGER_NUMEL = eager_numel  # this rank's process only: gradients this large copied on arrival
    torch.manual_seed(0)
    model = build(name)
    engines = []
    for batched in (True, False):
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=TINY_BUCKETS, gradient_as_bucket_view=as_view,
                                      find_unused_parameters=name == "branchy")
        if not batched:
            _per_parameter(ddp)
        engines.append((ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)))
    compared = 0
    for step in range(STEPS):
        x, y = global_batch(name, step, MICRO * world_size)
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        for ddp, opt in engines:
            opt.zero_grad(set_to_none=set_to_none)
            kwargs = {"use_branch": (step + rank) % 2 == 0} if name == "branchy" else {}
            loss_fn(name, ddp(x, **kwargs), y).backward()
        for (n, a), (_, b) in zip(engines[0][0].module.named_parameters(), engines[1][0].module.named_parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), (n, step)
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), (n, step)
                compared += 1
        for _, opt in engines:
            opt.step()
    return compared


@pytest.mark.parametrize("name,as_view,set_to_none,eager_numel", [
    ("gpt", False, True, 1 << 16), ("gpt", True, False, 1 << 16), ("gpt", True, True, 1 << 16),
    ("branchy", False, True, 1 << 16), ("tied", True, False, 1 << 16),
    ("gpt", False, True, 16), ("gpt", True, False, 16), ("branchy", False, True, 16)])
def test_the_batched_bucket_copy_is_bitwise_the_per_parameter_copy(name: str, as_view: bool, set_to_none: bool,
                                                                     eager_numel: int) -> None:
    """Three ranks (a divisor of 1/3 is not exact), tiny buckets, bucket views or not, gradients kept between steps
    (divided in place in the slice) or set to None (copied in), unused parameters (zeros); every gradient batched
    (these models' are all below EAGER_NUMEL), or those of 16 elements and more copied as they arrive."""
    compared = run_on_ranks(_batched_against_per_parameter, 3, name, as_view, set_to_none, eager_numel, timeout=120)
    assert all(n > 0 for n in compared)
