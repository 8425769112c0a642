"""CPU ports of torch's DDP tests that need GPUs only to place their models (issue 41).

torch's harness (``torch.testing._internal.distributed.distributed_test``, 2.13) runs these
only with two CUDA devices. Here each one runs on 2 gloo ranks, twice per rank: once with
torch's ``DistributedDataParallel`` and once with dptrain's, from the same initial replicas
(rank-dependent, so both wrappers' construction broadcasts are exercised) and the same
per-rank data. Every step's gradients and parameters, every output type and every
exception are recorded, and the two records must be equal.

Equal means bitwise: with 2 ranks both engines compute (g0 + g1) scaled by 1/2 elementwise
(a division by 2 is exact, and a two-operand sum does not depend on order), and the comm
hooks are torch's own functions called on the same buckets' contents. Any difference is a
difference in what was reduced, not rounding.

One spawn per group (all of a group's cases run in it; pytest then reports each case); the
harness is tests/_ddp_ports.py.
This file: uneven inputs and ``join`` (``_run_uneven_inputs_test`` and its siblings),
``static_graph``, ``find_unused_parameters``. tests/test_ddp_ports_hooks.py: comm hooks and
SyncBatchNorm. docs/ddp.md lists which torch test each case ports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from _ddp_ports import (
    TINY_BUCKETS,
    BatchNormNet,
    Record,
    check_case,
    group_results,
    raised,
    rank_input,
    sgd_step,
    snapshot,
)

# ------------------------------------------------------------------ models (torch's, smaller)

class Task(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x


class UnusedParamModule(nn.Module):
    """t0 is unused on ``unused_params_rank``."""

    def __init__(self, unused_params_rank: int):
        super().__init__()
        self.t0, self.t1 = Task(), Task()
        self.unused_params_rank = unused_params_rank

    def forward(self, x, rank):
        return self.t1(self.t0(x)) if rank != self.unused_params_rank else self.t1(x)


class ModelWithComm(nn.Module):
    """A collective inside forward (test_ddp_uneven_inputs_stop_iteration_sync_bn)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 40, bias=False)

    def forward(self, x):
        x = self.lin(x)
        dist.all_reduce(x)
        return x


# ------------------------------------------------------------------ uneven inputs and join

# name: (model, input shape, forward takes the rank, hook)
UNEVEN_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool, str | None]] = {
    "batch_norm_net": (BatchNormNet, (2, 2), False, None),
    "conv_model": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU()),
                   (1, 1, 10, 10), False, None),
    "small_model": (lambda: nn.Linear(32, 32, bias=False), (1, 32), False, None),
    "unjoined_rank_with_unused_params_model": (lambda: UnusedParamModule(1), (1, 2), True, None),
    "joined_rank_with_unused_params_model": (lambda: UnusedParamModule(0), (1, 2), True, None),
    "small_model_allreduce_hook": (lambda: nn.Linear(32, 32, bias=False), (1, 32), False, "allreduce"),
    "small_model_power_sgd_hook": (lambda: nn.Linear(32, 32, bias=False), (1, 32), False, "powerSGD"),
}
# rank 0's and rank 1's number of iterations: torch's baselines 0 and 5 with offsets 3 and 10
MAPPINGS = {"0-3": (0, 3), "5-8": (5, 8), "5-15": (5, 15)}


def _uneven_hook(name: str | None):
    if name == "allreduce":
        return None, default_hooks.allreduce_hook
    # torch's: PowerSGD from the first iteration, no warm start or error feedback
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1,
                                        warm_start=False, use_error_feedback=False)
    return state, powerSGD_hook.powerSGD_hook


def uneven_inputs(rank: int, world_size: int, ddp, model_name: str, sync_interval: int, throw: bool,
                  mapping: str) -> Record:
    """torch's _run_uneven_inputs_test: rank r runs MAPPINGS[mapping][r] iterations under ``net.join``."""
    build, shape, takes_rank, hook = UNEVEN_MODELS[model_name]
    torch.manual_seed(rank)
    # PowerSGD runs one bucket: with several in flight gloo's callbacks can deadlock (docs/ddp.md)
    net = ddp(build(), bucket_cap_mb=25 if hook == "powerSGD" else TINY_BUCKETS,
              find_unused_parameters="unused_params" in model_name)
    if hook is not None:
        net.register_comm_hook(*_uneven_hook(hook))
    record: Record = snapshot("init", net.module, "value")
    iters = MAPPINGS[mapping][rank]
    try:
        with net.join(throw_on_early_termination=throw):
            for i in range(iters):
                with contextlib.nullcontext() if i % sync_interval == 0 else net.no_sync():
                    x = rank_input(rank, i, *shape)
                    out = net(x, rank) if takes_rank else net(x)
                    out.sum().backward()
                    # A parameter no active rank used after a rank joined: torch's gradient is zeros or None depending on
                    # the joined rank's stale used-parameter map (uninitialised if it never ran), dptrain's None
                    # (docs/ddp.md). Either leaves the parameter as it is; the parameters are compared exactly.
                    record += snapshot(f"iter {i}", net.module, none_as_zero="unused_params" in model_name)
                    sgd_step(net.module)
    except RuntimeError as exc:
        if not throw:
            raise
        record.append(raised(exc))
    return record + snapshot("after join", net.module, "value")


def join_disable(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_uneven_input_join_disable: even inputs under ``join(enable=False)``."""
    torch.manual_seed(rank)
    net = ddp(nn.Linear(1, 1))
    record: Record = snapshot("init", net.module, "value")
    with net.join(enable=False):
        for i in range(5):
            net(torch.ones(1) * rank).sum().backward()
            record += snapshot(f"iter {i}", net.module)
            sgd_step(net.module)
    return record + snapshot("end", net.module, "value")


def grad_div_uneven_inputs(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_grad_div_uneven_inputs: divide by the active ranks, then by the initial world size."""
    torch.manual_seed(rank)
    net = ddp(nn.Linear(5, 5, bias=False), bucket_cap_mb=1)
    inp = torch.ones(1, 5) * 50
    record: Record = snapshot("init", net.module, "value")
    for divide_by_initial in (False, True):
        with net.join(divide_by_initial_world_size=divide_by_initial):
            for i in range(3 + 2 * (rank > 0)):
                net(inp * (rank + 1)).sum().backward()
                record += snapshot(f"{divide_by_initial} iter {i}", net.module)
                sgd_step(net.module, lr=0.001)
    return record + snapshot("end", net.module, "value")


def join_model_equivalence(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_join_model_equivalence: rank r runs 2 (r + 1) SGD steps under ``join``."""
    torch.manual_seed(0)
    model = nn.Linear(10, 10, bias=False)
    inp = rank_input(0, 0, 3, 10)
    net = ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.03 * world_size)
    record: Record = snapshot("init", net.module, "value")
    with net.join():
        for i in range(2 * (rank + 1)):
            opt.zero_grad()
            net(inp).sum().backward()
            record += snapshot(f"iter {i}", model)
            opt.step()
            record += snapshot(f"iter {i}", model, "value")
    return record + snapshot("end", model, "value")


def join_exception(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_uneven_input_exception: an exception in forward leaves ``join`` as itself."""

    class ExceptionModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.param = nn.Parameter(torch.ones(1))

        def forward(self, _):
            raise ValueError("Intentional error")

    net = ddp(ExceptionModule())
    try:
        with net.join():
            net(torch.ones(1)).sum().backward()
    except ValueError as exc:
        return [raised(exc)]
    return [("raised", None)]


def stop_iteration_with_comm(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_uneven_inputs_stop_iteration_sync_bn, its model with a collective in forward (the SyncBatchNorm
    model needs CUDA, tests/test_ddp_ports_hooks.py): ``throw_on_early_termination`` stops every rank at rank 1's 5th."""
    torch.manual_seed(rank)
    model = ddp(ModelWithComm())
    record: Record = snapshot("init", model.module, "value")
    n = 0
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(10 if rank == 0 else 5):
                model(rank_input(rank, n, 10, 2)).sum().backward()
                record += snapshot(f"iter {n}", model.module)
                sgd_step(model.module, lr=1e-3)
                n += 1
    except RuntimeError as exc:
        record.append(raised(exc))
    return record + [("iterations", n)] + snapshot("end", model.module, "value")


# ------------------------------------------------------------------ static_graph and find_unused_parameters

class NestedOutputModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 1, bias=False)

    def forward(self, inp, output_type):
        if output_type == "tuple":
            return self.lin(inp), (self.lin(inp), self.lin(inp))
        if output_type == "list":
            return [self.lin(inp), [self.lin(inp), self.lin(inp)]]
        return {"a": self.lin(inp), "b": {"c": self.lin(inp)}}


def _nested_sum(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.sum()
    values = out.values() if isinstance(out, dict) else out
    return sum(_nested_sum(v) for v in values)


def static_graph_nested_types(rank: int, world_size: int, ddp, output_type: str) -> Record:
    """test_ddp_static_graph_nested_types: nested tuple/list/dict outputs with ``static_graph=True``."""
    torch.manual_seed(rank)
    net = ddp(NestedOutputModule(), static_graph=True)
    record: Record = snapshot("init", net.module, "value")
    for i in range(6):
        out = net(rank_input(rank, i, 10, 16), output_type=output_type)
        record.append((f"iter {i} output type", type(out).__name__))
        _nested_sum(out).backward()
        record += snapshot(f"iter {i}", net.module)
        sgd_step(net.module, lr=0.01)
    return record + snapshot("end", net.module, "value")


def static_graph_multi_forward(rank: int, world_size: int, ddp) -> Record:
    """test_static_graph_multi_forward: two forwards, one backward, ``static_graph=True``."""
    torch.manual_seed(42 << 1337 % (rank + 1))
    net = ddp(nn.Sequential(nn.Linear(10, 10), nn.ReLU()), static_graph=True)
    record: Record = snapshot("init", net.module, "value")
    for i in range(3):
        net.zero_grad()
        x = rank_input(rank, i, 2, 10)
        (net(x).sum() + net(x).sum()).backward()
        record += snapshot(f"iter {i}", net.module)
        sgd_step(net.module)
    return record + snapshot("end", net.module, "value")


def shared_grad_acc_unused(rank: int, world_size: int, ddp, static: bool) -> Record:
    """test_ddp_shared_grad_acc_unused_params: an unused parameter registered under two names."""

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 5, bias=False)
            self.bias = nn.Parameter(torch.zeros(5))
            self.net1.bias = self.bias  # net1, bias and net1.bias unused; two names, one parameter
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(x).sum()

    torch.manual_seed(rank)
    net = ddp(ToyModel(), find_unused_parameters=True, static_graph=static)
    record: Record = snapshot("init", net.module, "value")
    for i in range(6):
        (net(rank_input(rank, i, 20, 10)) / 10).backward()
        record += snapshot(f"iter {i}", net.module)
        sgd_step(net.module)
    return record + snapshot("end", net.module, "value")


def different_graph_across_ranks(rank: int, world_size: int, ddp, static: bool) -> Record:
    """test_different_graph_across_ranks: lin2 used on rank 0 only, gradients as bucket views, never stepped
    (gradients accumulate over the 10 iterations)."""

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1 = nn.Linear(10, 10, bias=False)
            self.lin2 = nn.Linear(10, 10, bias=False)

        def forward(self, x):
            return self.lin2(F.relu(self.lin1(x))) if rank == 0 else F.relu(self.lin1(x))

    torch.manual_seed(31415)
    net = ddp(ToyModel(), find_unused_parameters=not static, static_graph=static, gradient_as_bucket_view=True)
    x = torch.randn(20, 10)
    record: Record = snapshot("init", net.module, "value")
    for i in range(10):
        net(x).sum().backward()
        record += snapshot(f"iter {i}", net.module)
    sgd_step(net.module)
    return snapshot("init", net.module, "value") + record + snapshot("end", net.module, "value")


def undefined_grad_unused(rank: int, world_size: int, ddp) -> Record:
    """test_undefined_grad_parity_unused_parameters: a backward whose output gradient is undefined."""
    torch.manual_seed(0)
    net = ddp(nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 4)), find_unused_parameters=True)
    torch._C._functions.UndefinedGrad()(net(torch.ones(1, 2)).sum()).backward()  # as torch's test does
    return snapshot("after", net.module)


def control_flow_across_ranks(rank: int, world_size: int, ddp, same: bool) -> Record:
    """test_ddp_control_flow_same_across_ranks / _different_across_ranks: a layer used on some iterations only
    (on all ranks alike, or on one rank), ``find_unused_parameters=True``."""

    class ControlFlowToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1 = nn.Linear(10, 10, bias=False)
            self.lin2 = nn.Linear(10, 10, bias=False)

        def forward(self, x, use):
            return self.lin2(F.relu(self.lin1(x))) if use else F.relu(self.lin1(x))

    torch.manual_seed(rank)
    net = ddp(ControlFlowToyModel(), find_unused_parameters=True)
    record: Record = snapshot("init", net.module, "value")
    for i in range(8):
        use = i % 2 == 0 if same else (i + rank) % 2 == 0
        net(rank_input(rank, i, 20, 10), use).sum().backward()
        record += snapshot(f"iter {i}", net.module)
        sgd_step(net.module, lr=0.01)
    return record + snapshot("end", net.module, "value")


def unused_without_find_unused(rank: int, world_size: int, ddp) -> Record:
    """test_ddp_unused_params_rebuild_buckets_exception: a parameter without gradient and
    ``find_unused_parameters=False`` is a RuntimeError (torch's at the next forward, dptrain's at the end of the
    backward; only the type is compared, docs/ddp.md's error table)."""

    class TwoLinLayerNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(10, 10, bias=False)
            self.b = nn.Linear(10, 10, bias=False)

        def forward(self, x):
            return self.a(x)

    net = ddp(TwoLinLayerNet())
    try:
        for i in range(2):
            net(rank_input(rank, i, 2, 10)).sum().backward()
    except RuntimeError:
        return [("raised", "RuntimeError")]
    return [("raised", None)]


def _cases() -> dict[str, Callable[..., Record]]:
    import functools

    cases: dict[str, Callable[..., Record]] = {}
    for index, model in enumerate(UNEVEN_MODELS):
        # torch runs every mapping with every variant; here the no_sync and throw variants run a subset (time)
        for variant, sync_interval, throw, mappings in (("sync", 1, False, MAPPINGS), ("no_sync", index + 2, False, ["5-15"]),
                                                        ("throw", 1, True, ["0-3", "5-8"])):
            for mapping in mappings:
                cases[f"uneven-{model}-{variant}-{mapping}"] = functools.partial(
                    uneven_inputs, model_name=model, sync_interval=sync_interval, throw=throw, mapping=mapping)
    cases.update({
        "join_disable": join_disable,
        "grad_div_uneven_inputs": grad_div_uneven_inputs,
        "join_model_equivalence": join_model_equivalence,
        "stop_iteration_with_comm": stop_iteration_with_comm,
        "static_graph_multi_forward": static_graph_multi_forward,
        "shared_grad_acc_unused_static": functools.partial(shared_grad_acc_unused, static=True),
        "shared_grad_acc_unused_dynamic": functools.partial(shared_grad_acc_unused, static=False),
        "different_graph_across_ranks_find_unused": functools.partial(different_graph_across_ranks, static=False),
        "different_graph_across_ranks_static": functools.partial(different_graph_across_ranks, static=True),
        "control_flow_same_across_ranks": functools.partial(control_flow_across_ranks, same=True),
        "control_flow_different_across_ranks": functools.partial(control_flow_across_ranks, same=False),
    })
    for output_type in ("tuple", "list", "dict"):
        cases[f"static_graph_nested_{output_type}"] = functools.partial(static_graph_nested_types,
                                                                        output_type=output_type)
    return cases


CASES = _cases()
# Cases that record no training, only an exception or one backward's gradients
NOT_TRAINING = {"undefined_grad_unused": undefined_grad_unused, "join_exception": join_exception,
                "unused_without_find_unused": unused_without_find_unused}
CASES.update(NOT_TRAINING)
NOT_TRAINING.update({n: CASES[n] for n in CASES if n.endswith("-throw-0-3")})  # rank 0 has no input: none trains


@pytest.mark.parametrize("name", list(CASES))
def test_port_matches_torchs_ddp(request, name: str) -> None:
    check_case(group_results(request, "test_ddp_ports", list(CASES)), name, expect_moved=name not in NOT_TRAINING)
