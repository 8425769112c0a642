"""The collectives, with a choice of algorithm: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``.

Each function takes ``algorithm=``:

- ``"native"`` (default): the backend's own collective (gloo, NCCL), the fast path;
- ``"ring"``: bandwidth-optimal, 2(n-1) rounds (:mod:`dptrain.comm.ring`);
- ``"tree"``: binomial tree, 2 ceil(log2 n) rounds of full-size messages (:mod:`dptrain.comm.tree`);
- ``"naive"``: everyone sends everything to everyone, then sums locally (:mod:`dptrain.comm.naive`);
- ``"hierarchical"``: tree inside each node, ring across node leaders, tree back down
  (:mod:`dptrain.comm.hierarchical`); needs ``nodes=``, ranks per node or a grouping.

All but ``native`` are built on the backend's point-to-point operations, so they run
wherever ``torch.distributed`` runs, across machines included. Tensors may have any
shape, length (0, shorter than the world size, not divisible by it) and dtype among
fp32/fp64/fp16/bf16 and the integer types; integer sums are exact, fp16/bf16 are summed
in fp32 where an algorithm adds locally. ``reduce_scatter`` and ``all_gather`` split a
flat tensor into the shards of :func:`~dptrain.comm.topology.shard_bounds` (the first
``numel % world_size`` shards one element longer). A non-contiguous tensor is
communicated through a contiguous copy and written back.

``async_op=True`` returns a :class:`~dptrain.comm.work.Work` whose ``wait()``
returns the result; otherwise the call blocks and returns None. Its ``completed_at``
is exact for dptrain's algorithms, and for ``native`` with ``timed=True`` (the default:
a callback on the backend's future; the DDP engine turns it off unless it records
spans). ``traffic=`` counts
the bytes this rank sends (not for ``native``, whose traffic is the backend's own).

Before communicating, ranks agree (``validate=True``, one tiny all-gather): every rank
checks its own arguments, then all compare collective, algorithm, op, dtype, length,
device and grouping, and *every* rank raises the same :class:`CollectiveMismatchError`
naming the ranks and values that differ (a mismatch would otherwise abort gloo or
hang). Callers whose arguments agree by construction (the DDP engine's buckets) pass
``validate=False`` and save the round trip; every rank must pass the same ``validate``.
"""

from __future__ import annotations

import difflib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dptrain.comm import hierarchical, naive, ring, tree
from dptrain.comm.compat import all_gather_single, reduce_scatter_single
from dptrain.comm.cost import collective_cost
from dptrain.comm.progress import progress_thread
from dptrain.comm.topology import Range, Team, node_groups, shard_bounds
from dptrain.comm.wire import Traffic, Wire
from dptrain.comm.work import Work

__all__ = ["ALGORITHMS", "check_algorithm", "check_all_reduce", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
           "native_scatter_is_all_reduce",
           "CollectiveMismatchError", "sent_bytes"]

ALGORITHMS = ("native", "ring", "tree", "naive", "hierarchical")
_FLAT = {"ring": ring, "tree": tree, "naive": naive}
_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
_OPS = ("sum", "avg")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with arguments that cannot work together (raised on every rank)."""


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "native",
               group: dist.ProcessGroup | None = None, async_op: bool = False,
               nodes: int | Sequence[Sequence[int]] | None = None, traffic: Traffic | None = None,
               validate: bool = True, timed: bool = True) -> Work | None:
    """Sum (``op="sum"``) or average (``"avg"``) ``tensor`` over the group, in place."""
    call, op = _checked_all_reduce(tensor, op, algorithm, group, nodes, traffic, validate, timed)
    x = _flat(tensor)

    def run() -> None:
        if algorithm == "hierarchical":
            hierarchical.all_reduce(call.wire, call.nodes, call.rank, x)
        else:
            _FLAT[algorithm].all_reduce(call.wire, call.team, x)

    def finish() -> torch.Tensor:
        if op == "avg":
            x.div_(call.world_size)
        return _write_back(tensor, x)

    return call.launch(async_op, x.numel(), run, finish,
                       native=lambda: dist.all_reduce(x, group=call.group, async_op=True))


def check_all_reduce(tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "native",
                     group: dist.ProcessGroup | None = None, nodes: int | Sequence[Sequence[int]] | None = None,
                     validate: bool = True, problem: str | None = None) -> tuple[dist.ProcessGroup, int, str]:
    """The checks :func:`all_reduce` makes before it communicates (with ``validate``, the ranks' agreement too),
    for a caller that prepares an all-reduce once (:class:`~dptrain.comm.persistent.PersistentAllReduce`);
    ``problem``: the caller's own objection to ``tensor``, raised as the others are. Returns (the group, its size,
    the op's name)."""
    call, op = _checked_all_reduce(tensor, op, algorithm, group, nodes, None, validate, True, problem)
    return call.group, call.world_size, op


def _checked_all_reduce(tensor: torch.Tensor, op: str, algorithm: str, group: dist.ProcessGroup | None,
                        nodes: int | Sequence[Sequence[int]] | None, traffic: Traffic | None, validate: bool,
                        timed: bool, problem: str | None = None) -> tuple[_Call, str]:
    call = _Call.start("all_reduce", algorithm, group, nodes, traffic, timed)
    op = _op_name(op)
    call.agree(validate, tensor, op, problem=_op_problem(op, tensor) or _tensor_problem(call, "tensor", tensor)
               or problem)
    return call, op


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", *, algorithm: str = "native",
                   group: dist.ProcessGroup | None = None, async_op: bool = False,
                   nodes: int | Sequence[Sequence[int]] | None = None, traffic: Traffic | None = None,
                   validate: bool = True, consume_input: bool = False) -> Work | None:
    """Sum (or average) ``input`` over the group; ``output`` receives this rank's shard of it.

    ``input`` is read, never written: the algorithms work on a copy. With
    ``consume_input=True`` the caller hands ``input`` over as the working buffer instead
    (its contents afterwards are unspecified) and saves that full-size copy; ``output``
    may then be ``input``'s own shard, as in NCCL's in-place reduce-scatter. gloo's
    reduce-scatter is itself a copy of the input all-reduced (``ProcessGroupGloo::
    reduce_scatter_tensor_coalesced``), so on gloo a consumed input is all-reduced in
    place: the same bytes on the wire, one full-size buffer fewer.
    """
    call = _Call.start("reduce_scatter", algorithm, group, nodes, traffic)
    op = _op_name(op)
    shards = shard_bounds(input.numel(), call.world_size)
    a, b = shards[call.rank]
    call.agree(validate, input, op, problem=(
        _op_problem(op, input) or _tensor_problem(call, "input", input)
        or _tensor_problem(call, "output", output) or _dtype_problem(output, input)
        or _size_problem("output", output, b - a, input.numel(), call)))
    flat_in = input.detach().reshape(-1)  # a view when contiguous (else a private copy)
    out = _flat(output)

    def copy_out(x: torch.Tensor) -> None:
        if out.data_ptr() != x[a:b].data_ptr():  # output may be the consumed input's own shard
            out.copy_(x[a:b])

    def run() -> None:  # on the progress thread: the working copy lives in its workspace
        if consume_input:
            x = flat_in
        else:
            x = call.wire.scratch(flat_in.numel(), flat_in.dtype, flat_in.device, slot=2)
            x.copy_(flat_in)
        if algorithm == "hierarchical":
            hierarchical.reduce_scatter(call.wire, call.nodes, call.rank, x, shards)
        else:
            _FLAT[algorithm].reduce_scatter(call.wire, call.team, x, [[s] for s in shards])
        copy_out(x)

    def finish() -> torch.Tensor:
        if op == "avg":
            out.div_(call.world_size)
        return _write_back(output, out)

    def native() -> dist.Work | Work:
        if not _scatter_as_all_reduce(flat_in.numel(), call.group, flat_in.device, consume_input):
            return reduce_scatter_single(out, flat_in.contiguous(), group=call.group, async_op=True)
        x = flat_in if consume_input else flat_in.clone()
        work = Work(backend_work=dist.all_reduce(x, group=call.group, async_op=True), timed=call.timed)
        return work.then(lambda: copy_out(x))

    return call.launch(async_op, flat_in.numel(), run, finish, native=native, alone=lambda: copy_out(flat_in))


def all_gather(output: torch.Tensor, input: torch.Tensor, *, algorithm: str = "native",
               group: dist.ProcessGroup | None = None, async_op: bool = False,
               nodes: int | Sequence[Sequence[int]] | None = None, traffic: Traffic | None = None,
               validate: bool = True) -> Work | None:
    """Gather every rank's shard ``input`` into ``output``, rank r's at ``shard_range(numel, n, r)``."""
    call = _Call.start("all_gather", algorithm, group, nodes, traffic)
    shards = shard_bounds(output.numel(), call.world_size)
    a, b = shards[call.rank]
    call.agree(validate, output, "sum", problem=(
        _tensor_problem(call, "output", output) or _tensor_problem(call, "input", input)
        or _dtype_problem(output, input) or _size_problem("input", input, b - a, output.numel(), call)))
    x = _flat(output)
    x[a:b].copy_(input.detach().reshape(-1))

    def run() -> None:
        if algorithm == "hierarchical":
            hierarchical.all_gather(call.wire, call.nodes, call.rank, x, shards)
        else:
            _FLAT[algorithm].all_gather(call.wire, call.team, x, [[s] for s in shards])

    # Only the backend's all-gather needs equal shards: pad for it alone.
    padded = _Padded(x, shards) if algorithm == "native" and x.numel() % call.world_size else None

    def finish() -> torch.Tensor:
        if padded is not None:
            padded.unpack()
        return _write_back(output, x)

    def native() -> dist.Work:
        if padded is not None:
            return all_gather_single(padded.gathered, padded.mine(call.rank), group=call.group,
                                          async_op=True)
        return all_gather_single(x, x[a:b].clone(), group=call.group, async_op=True)

    return call.launch(async_op, x.numel(), run, finish, native=native)


def broadcast(tensor: torch.Tensor, src: int = 0, *, algorithm: str = "native",
              group: dist.ProcessGroup | None = None, async_op: bool = False,
              nodes: int | Sequence[Sequence[int]] | None = None, traffic: Traffic | None = None,
              validate: bool = True) -> Work | None:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
    call = _Call.start("broadcast", algorithm, group, nodes, traffic)
    src_problem = None if 0 <= src < call.world_size else (
        f"src={src} is not a rank of this group of {call.world_size}; pass 0..{call.world_size - 1}")
    call.agree(validate, tensor, "sum", src=src,
               problem=src_problem or _tensor_problem(call, "tensor", tensor))
    x = _flat(tensor)

    def run() -> None:
        if algorithm == "hierarchical":
            hierarchical.broadcast(call.wire, call.nodes, call.rank, x, src)
        else:
            _FLAT[algorithm].broadcast(call.wire, call.team, x, src)

    return call.launch(async_op, x.numel(), run, lambda: _write_back(tensor, x),
                       native=lambda: dist.broadcast(x, group=call.group, group_src=src, async_op=True))


# ------------------------------------------------------------------ one call's context


@dataclass
class _Call:
    kind: str
    algorithm: str
    group: dist.ProcessGroup
    world_size: int
    rank: int
    nodes: list[tuple[int, ...]] | None
    setup_problem: str | None  # an unknown algorithm, or nodes= that do not fit
    wire: Wire
    timed: bool  # native: stamp completed_at with a callback on the backend's future

    @classmethod
    def start(cls, kind: str, algorithm: str, group: dist.ProcessGroup | None,
              nodes: int | Sequence[Sequence[int]] | None, traffic: Traffic | None, timed: bool = True) -> _Call:
        group = group if group is not None else dist.group.WORLD
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups, problem = None, None
        try:
            groups = check_algorithm(algorithm, nodes, world_size)
        except ValueError as error:
            problem = str(error)
        return cls(kind, algorithm, group, world_size, rank, groups, problem, Wire(group, traffic), timed)

    @property
    def team(self) -> Team:
        return Team(tuple(range(self.world_size)), self.rank)

    def agree(self, validate: bool, tensor: torch.Tensor, op: str, *, problem: str | None,
              src: int = 0) -> None:
        """Check this rank's arguments and, with ``validate``, that every rank's agree."""
        problem = self.setup_problem or problem
        if validate and self.world_size > 1:
            _agree_across_ranks(self, tensor, op, src, problem)
        if problem:
            raise ValueError(f"{self.kind} on rank {self.rank}: {problem}")

    def launch(self, async_op: bool, numel: int, run: Callable[[], None], finish: Callable[[], torch.Tensor],
               native: Callable[[], dist.Work | Work], alone: Callable[[], object] | None = None) -> Work | None:
        """Start the collective: ``alone`` runs instead when there is nothing to communicate.

        ``native`` returns the backend's work, or a :class:`Work` with steps of its own
        that run before ``finish``.
        """
        if self.world_size == 1 or numel == 0:
            if alone is not None:
                alone()
            work = Work.completed(finish)
        elif self.algorithm == "native":
            started = native()
            work = started if isinstance(started, Work) else Work(backend_work=started, timed=self.timed)
            work.then(finish)
        else:
            thread = progress_thread(self.group)
            self.wire.workspace = thread.workspace
            work = thread.submit(run, finish)
        if async_op:
            return work
        work.wait()
        return None


def _scatter_as_all_reduce(numel: int, group: dist.ProcessGroup, device: torch.device, consume_input: bool) -> bool:
    return native_scatter_is_all_reduce(_device_backend(group, device), numel, dist.get_world_size(group),
                                        consume_input)


def native_scatter_is_all_reduce(backend: str, numel: int, world_size: int, consume_input: bool = True) -> bool:
    """Whether a native reduce-scatter of ``numel`` elements is issued as an all-reduce (and a copy-out).

    The backend's reduce-scatter wants equal shards; and gloo's is an all-reduce of a
    copy anyway, so a consumed input is all-reduced in place. (The simulator asks this too.)
    """
    return numel % world_size != 0 or (consume_input and backend == "gloo")


def sent_bytes(kind: str, numel: int, itemsize: int, *, algorithm: str = "native",
               group: dist.ProcessGroup | None = None, nodes: int | Sequence[Sequence[int]] | None = None,
               device: torch.device | None = None, consume_input: bool = False) -> int:
    """The bytes this rank sends for one ``kind`` collective of ``numel`` elements, by the cost model.

    For dptrain's own algorithms this is what their :class:`Traffic` counters measure
    (the tests check the two agree exactly). For ``native``, the backend's traffic is
    not observable: it is modelled as a ring (gloo's all-reduce is one, NCCL's too at
    these sizes), and a reduce-scatter the backend runs as an all-reduce
    (:func:`_scatter_as_all_reduce`) counts as one.
    """
    group = group if group is not None else dist.group.WORLD
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if kind == "reduce_scatter" and algorithm == "native" and _scatter_as_all_reduce(
            numel, group, device or torch.device("cpu"), consume_input):
        kind = "all_reduce"
    if algorithm == "hierarchical":
        nodes = check_algorithm(algorithm, nodes, world_size)
    return collective_cost(kind, algorithm, numel, itemsize, world_size, nodes=nodes).bytes_sent[rank]


# ------------------------------------------------------------------ argument checks


def check_algorithm(algorithm: str, nodes: int | Sequence[Sequence[int]] | None,
                    world_size: int) -> list[tuple[int, ...]] | None:
    """Raise ValueError unless ``algorithm`` (and, for hierarchical, ``nodes``) can run on ``world_size``.

    Returns the node groups for ``hierarchical`` (None otherwise). For callers that pick
    an algorithm once (the DDP engine, the trainer's config) and for every call here.
    """
    problem = _algorithm_problem(algorithm)
    if problem:
        raise ValueError(problem)
    if algorithm == "hierarchical":
        if nodes is None:
            raise ValueError("algorithm='hierarchical' needs nodes=: the ranks per node (LOCAL_WORLD_SIZE "
                             "under torchrun) or an explicit grouping")
        return node_groups(world_size, nodes)
    return None


def _op_name(op: str | dist.ReduceOp) -> str:
    if isinstance(op, str):
        return op.lower()
    return {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}.get(op, str(op))


def _algorithm_problem(algorithm: str) -> str | None:
    if algorithm in ALGORITHMS:
        return None
    close = difflib.get_close_matches(str(algorithm), ALGORITHMS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown algorithm {algorithm!r}{hint}; choose one of {', '.join(ALGORITHMS)}"


def _op_problem(op: str, tensor: torch.Tensor) -> str | None:
    if op not in _OPS:
        return f"unsupported op {op!r}; choose 'sum' or 'avg'"
    if op == "avg" and not tensor.is_floating_point():
        return (f"op='avg' of a {tensor.dtype} tensor is not an integer; "
                "reduce with op='sum' and divide, or pass a floating-point tensor")
    return None


def _tensor_problem(call: _Call, name: str, tensor: torch.Tensor) -> str | None:
    if tensor.dtype not in _DTYPES:
        return (f"{name} has dtype {tensor.dtype}; supported: "
                + ", ".join(str(d).removeprefix("torch.") for d in _DTYPES))
    backend = dist.get_backend(call.group)
    want = "cuda" if backend == "nccl" else "cpu"
    if tensor.device.type != want and not (call.algorithm == "native" and tensor.device.type == "cuda"):
        return (f"{name} is on {tensor.device}, but the group's backend is {backend}, which needs "
                f"{want} tensors; move it with .to({want!r}) or use a process group for its device")
    return None


def _dtype_problem(output: torch.Tensor, input: torch.Tensor) -> str | None:
    if output.dtype != input.dtype:
        return f"output dtype {output.dtype} != input dtype {input.dtype}; pass tensors of one dtype"
    return None


def _size_problem(name: str, tensor: torch.Tensor, want: int, numel: int, call: _Call) -> str | None:
    if tensor.numel() == want:
        return None
    return (f"{name} has {tensor.numel()} elements, but rank {call.rank}'s shard of a {numel}-element "
            f"tensor over {call.world_size} ranks has {want} (dptrain.comm.shard_range({numel}, "
            f"{call.world_size}, {call.rank}))")


_FIELDS = ("collective", "algorithm", "op", "dtype", "length", "device", "src", "nodes", "arguments")


def _header(call: _Call, tensor: torch.Tensor, op: str, src: int, problem: str | None) -> list[int]:
    nodes = zlib.crc32(repr(call.nodes).encode())
    algorithm = ALGORITHMS.index(call.algorithm) if call.algorithm in ALGORITHMS else -1
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    return [_KINDS.index(call.kind), algorithm, _OPS.index(op) if op in _OPS else -1, dtype,
            tensor.numel(), ("cpu", "cuda").index(tensor.device.type) if tensor.device.type in ("cpu", "cuda")
            else -1, src, nodes, int(problem is not None)]


def _agree_across_ranks(call: _Call, tensor: torch.Tensor, op: str, src: int, problem: str | None) -> None:
    """All-gather every rank's header; raise the same error on every rank if they differ."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(call.group) == "nccl" \
        else torch.device("cpu")
    mine = torch.tensor(_header(call, tensor, op, src, problem), dtype=torch.int64, device=device)
    rows = torch.empty(call.world_size * len(_FIELDS), dtype=torch.int64, device=device)
    all_gather_single(rows, mine, group=call.group)
    rows = rows.view(call.world_size, len(_FIELDS)).cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row[-1]]
    if problem is not None:
        return  # this rank raises its own, more precise error
    if bad:
        raise CollectiveMismatchError(
            f"{call.kind} on rank {call.rank}: rank(s) {bad} passed invalid arguments (their own error "
            "names the problem); no rank communicated")
    for i, field in enumerate(_FIELDS[:-1]):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_decode(field, v)}" for r, v in enumerate(values))
            raise CollectiveMismatchError(
                f"{call.kind} on rank {call.rank}: ranks disagree on the {field} ({shown}); every rank "
                f"must call the same collective with the same {field}")


def _decode(field: str, value: int) -> str:
    tables = {"collective": _KINDS, "algorithm": ALGORITHMS, "op": _OPS,
              "dtype": [str(d).removeprefix("torch.") for d in _DTYPES], "device": ("cpu", "cuda")}
    table = tables.get(field)
    if table is None:
        return str(value)
    return table[value] if 0 <= value < len(table) else "?"


# ------------------------------------------------------------------ buffers


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor`` if it is contiguous, else a flat contiguous copy."""
    t = tensor.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _device_backend(group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend ``group`` uses for tensors on ``device`` ("gloo", "nccl", ...)."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:  # one backend for every device
        return backend
    by_device = dict(part.split(":", 1) for part in backend.split(","))
    return by_device.get(device.type, backend)


def _write_back(tensor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Copy the result into ``tensor`` when ``x`` was a copy of it (non-contiguous input)."""
    if x.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(x.view(tensor.shape))
    return tensor


class _Padded:
    """Equal-size shards for the backend's all-gather of a length the world size does not divide."""

    def __init__(self, x: torch.Tensor, shards: list[Range]):
        self.x, self.shards = x, shards
        self.width = max(b - a for a, b in shards)
        self.gathered = x.new_zeros(len(shards) * self.width)

    def mine(self, rank: int) -> torch.Tensor:
        a, b = self.shards[rank]
        out = self.x.new_zeros(self.width)
        out[:b - a] = self.x[a:b]
        return out

    def unpack(self) -> None:
        for r, (a, b) in enumerate(self.shards):
            self.x[a:b] = self.gathered[r * self.width:r * self.width + b - a]
