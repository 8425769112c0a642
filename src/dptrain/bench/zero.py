"""Benchmark: dptrain's ZeRO against torch's FSDP2 and ZeroRedundancyOptimizer, in one interleaved run.

Every variant trains the same GPT (:mod:`dptrain.models.gpt`, seeded, fp32) on the same
data with the same AdamW:

- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel``, the unsharded reference;
- ``torch_zero_opt``: torch's DDP + ``ZeroRedundancyOptimizer(AdamW)``: ZeRO stage 1 in torch;
- ``dptrain_zero1``, ``dptrain_zero2``: ``dptrain.ZeRO(model, stage=1|2)``;
- ``torch_fsdp2``: ``fully_shard`` (FSDP2) on each ``Block``, then on the root,
  ``reshard_after_forward=True``;
- ``dptrain_zero3``: ``dptrain.ZeRO(model, stage=3, unit_classes=(Block,))``: the same units.

Both torch DDP variants use ``gradient_as_bucket_view=True`` (torch's memory-saving
setting: no second copy of the gradients in the buckets); every other option is each
engine's default (25 MiB buckets for DDP and ZeRO stages 1-2, prefetching in both
stage-3 engines).

**Step time.** All variants live in one process group. Each round runs a few steps of
every variant in an order shuffled anew each round (the same on every rank); a step's
time is the slowest rank's, after a barrier. The dptrain/torch ratio of a pair is taken
per round and summarised by its median and a bootstrap 90% interval over rounds.

**Memory**, measured per variant in a process group of its own (fresh worker processes,
so one variant's peak cannot hide another's): the model is built, wrapped, and trained
for ``--memory-steps`` steps. Reported per rank, the largest rank's:

- *state*: bytes of parameters, gradients and optimizer state held after an optimizer
  step, counted from live tensors (each storage once; FSDP2's DTensors by their local
  shards), and every tensor storage the garbage collector can see minus those alive
  before the model was built (whatever an engine keeps beyond those three shows here);
- *peak*: the process's peak resident memory during the steps minus its resident memory
  right before the model was built. The peak is reset after building, through Linux's
  ``/proc/self/clear_refs``, so the cost of construction (the full model exists on every
  rank before it is sharded) is reported apart; without it, ``getrusage``'s
  ``ru_maxrss`` gives the peak since the process started. For resident memory to follow
  the tensors, the memory workers give every allocation of 64 KiB or more its own
  ``mmap`` (returned to the OS when freed): with
  :func:`dptrain.allocator.tune_cpu_allocator`, which the timing workers use, the process
  keeps what it frees and its resident memory grows with fragmentation from step to
  step, whatever the engine. On CUDA: ``torch.cuda.max_memory_allocated``.

    python -m dptrain.bench.zero --world-size 2 --rounds 20
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F

from dptrain.bench.stats import paired_ratios
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.models.gpt import GPT, Block
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO
from dptrain.zero.memory import live_tensor_bytes, local_tensor, state_bytes, storage_bytes, zero_formula

VARIANTS = ("torch_ddp", "torch_zero_opt", "dptrain_zero1", "dptrain_zero2", "torch_fsdp2", "dptrain_zero3")
# Each dptrain variant and the torch engine it is measured against.
PAIRS = {"dptrain_zero1": "torch_zero_opt", "dptrain_zero2": "torch_zero_opt", "dptrain_zero3": "torch_fsdp2"}
# The ZeRO paper's stage for each variant's per-rank formula (torch_zero_opt shards like stage 1).
STAGES = {"torch_ddp": 0, "torch_zero_opt": 1, "dptrain_zero1": 1, "dptrain_zero2": 2, "torch_fsdp2": 3,
          "dptrain_zero3": 3}
VOCAB = 256
MiB = 2**20


def build_model(args: dict) -> GPT:
    torch.manual_seed(0)  # the same weights in every variant and every process
    return GPT(vocab_size=VOCAB, block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
               n_embd=args["n_embd"])


def wrap(variant: str, model: GPT, lr: float, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The variant's wrapped model and its AdamW (created after wrapping: sharded engines give it shards)."""
    if variant == "torch_fsdp2":
        # FSDP2's default mesh is on CUDA whenever CUDA exists: name the device.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if variant.startswith("dptrain_zero"):
        stage = int(variant[-1])
        wrapped = ZeRO(model, stage=stage, unit_classes=(Block,) if stage == 3 else (), device=device)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=lr)
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if variant == "torch_zero_opt":
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=lr)


def _batch(rank: int, args: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)  # each rank its own micro-batch, the same for every variant
    tokens = torch.randint(0, VOCAB, (args["micro_batch"], args["block_size"] + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs and next-token targets


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, ...]:
    """One step: (seconds in zero_grad + forward + backward, seconds in the optimizer, loss)."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    _sync(x.device)
    mid = time.perf_counter()
    opt.step()
    _sync(x.device)
    return mid - start, time.perf_counter() - mid, loss.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_device(rank: int, device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


# --------------------------------------------------------------------- step time


def _time_rank(rank: int, world_size: int, args: dict) -> dict:
    device = _rank_device(rank, args["device"])
    variants = args["variants"]
    engines = {v: wrap(v, build_model(args).to(device), args["lr"], device) for v in variants}
    x, y = _batch(rank, args, device)
    # Warm-up (first steps allocate optimizer state, torch DDP rebuilds its buckets); its
    # losses show that every variant trains the same model.
    losses = {v: [_step(*engines[v], x, y)[2] for _ in range(args["warmup"])] for v in variants}
    times: dict[str, list[list[tuple[float, float]]]] = {v: [] for v in variants}  # [round][step]
    for round_index in range(args["rounds"]):
        order = list(variants)
        random.Random(round_index).shuffle(order)  # same seed, same order on every rank
        for variant in order:
            times[variant].append([])
            for _ in range(args["steps"]):
                dist.barrier()
                times[variant][-1].append(_step(*engines[variant], x, y)[:2])
    return {"times": times, "losses": losses}


# --------------------------------------------------------------------- memory


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state held by this rank, by category, each storage once."""
    if isinstance(model, ZeRO):
        return state_bytes(model, opt)
    # ZeroRedundancyOptimizer keeps the state of this rank's partition in its local optimizer.
    state = getattr(opt, "optim", opt).state
    seen: set = set()
    params = list(model.parameters())
    return {"parameters": storage_bytes([local_tensor(p) for p in params], seen),
            "gradients": storage_bytes([local_tensor(p.grad) for p in params], seen),
            "optimizer": storage_bytes([local_tensor(v) for s in state.values() for v in s.values()
                                        if torch.is_tensor(v)], seen)}


class _ProcessMemory:
    """This process's memory now and its peak since :meth:`reset_peak`, in bytes.

    CPU: resident memory from ``/proc/self/status`` (VmRSS, VmHWM); writing 5 to
    ``/proc/self/clear_refs`` resets VmHWM (Linux >= 4.0). Where that is not possible,
    ``ru_maxrss``: the peak since the process started, which cannot be reset. CUDA: the
    caching allocator's allocated bytes and their peak.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = "cuda.max_memory_allocated" if device.type == "cuda" else "VmHWM after clear_refs"

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._proc_status("VmRSS") if self.method.startswith("VmHWM") else self._maxrss()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss (not resettable)"

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._proc_status("VmHWM") if self.method.startswith("VmHWM") else self._maxrss()

    @staticmethod
    def _proc_status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
        return int(line.split()[1]) * 1024  # kB

    @staticmethod
    def _maxrss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def allocator_follows_tensors() -> bool:
    """Serve every allocation of 64 KiB or more from its own ``mmap``, unmapped when freed (glibc only).

    The opposite of :func:`dptrain.allocator.tune_cpu_allocator`: slower (every large
    tensor page-faults in afresh), but resident memory is then what the live tensors
    use, not what the allocator kept. A fixed threshold also stops glibc from raising it
    as large blocks are freed. For the memory workers only.
    """
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt if path else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    return mallopt(m_mmap_threshold, 64 << 10) == 1 and mallopt(m_trim_threshold, 128 << 10) == 1


def _memory_rank(rank: int, world_size: int, args: dict, variant: str) -> dict:
    per_tensor_mmap = allocator_follows_tensors()
    device = _rank_device(rank, args["device"])
    x, y = _batch(rank, args, device)
    meter = _ProcessMemory(device)
    live_before = live_tensor_bytes() if device.type == "cpu" else meter.now()
    meter.reset_peak()
    before = meter.now()
    model, opt = wrap(variant, build_model(args).to(device), args["lr"], device)
    build_peak = meter.peak() - before
    meter.reset_peak()
    for _ in range(args["memory_steps"]):
        _step(model, opt, x, y)
    method = meter.method + (", per-tensor mmap" if per_tensor_mmap and device.type == "cpu" else "")
    out = {"peak": meter.peak() - before, "build_peak": build_peak, "peak_method": method}
    out["live"] = (live_tensor_bytes(settle_s=0.1) if device.type == "cpu" else meter.now()) - live_before
    out.update(_state_bytes(model, opt))
    return out


# --------------------------------------------------------------------- the run


def _commit() -> str | None:
    """The checkout's commit, "+dirty" if it has changes: the engines under test change between runs."""
    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty=+dirty"], capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return rev.stdout.strip() or None


def run(world_size: int, n_layer: int, n_embd: int, n_head: int, block_size: int, micro_batch: int,
        rounds: int, steps: int, warmup: int, memory_steps: int, threads: int, device: str,
        variants: tuple[str, ...] = VARIANTS, lr: float = 1e-4) -> dict:
    args = dict(variants=list(variants), n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size,
                micro_batch=micro_batch, rounds=rounds, steps=steps, warmup=warmup, memory_steps=memory_steps,
                lr=lr, device=device)
    backend = "nccl" if device == "cuda" else "gloo"
    launch = dict(timeout=7200, threads_per_rank=threads, backend=backend)
    memory = {v: run_on_ranks(_memory_rank, world_size, args, v, **launch, tune_allocator=False) for v in variants}
    per_rank = run_on_ranks(_time_rank, world_size, args, **launch)
    numel = sum(p.numel() for p in build_model(args).parameters())
    return {
        "config": dict(world_size=world_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=VOCAB,
                       block_size=block_size, micro_batch=micro_batch, params=numel, rounds=rounds,
                       steps_per_round=steps, warmup=warmup, memory_steps=memory_steps, threads_per_rank=threads,
                       device=device, backend=backend, torch=torch.__version__, cpus=os.cpu_count(),
                       machine=platform.machine(), commit=_commit()),
        **_summarise_times(per_rank, list(variants), rounds, steps),
        "memory": _summarise_memory(memory, numel, world_size),
        "warmup_losses": per_rank[0]["losses"],
    }


def _summarise_times(per_rank: list[dict], variants: list[str], rounds: int, steps: int) -> dict:
    # A step (and each of its phases) takes as long as its slowest rank.
    phases = {v: [[[max(r["times"][v][k][i][j] for r in per_rank) for i in range(steps)] for k in range(rounds)]
                  for j in (0, 1)] for v in variants}
    step = {v: [[a + b for a, b in zip(*rnd, strict=True)] for rnd in zip(*phases[v], strict=True)] for v in variants}

    def median(per_round: list[list[float]]) -> float:
        return statistics.median(t for rnd in per_round for t in rnd)

    ratios = {ours: paired_ratios(step[ours], step[theirs]) for ours, theirs in PAIRS.items()
              if ours in variants and theirs in variants}
    return {"median_step_s": {v: median(step[v]) for v in variants},
            "median_fwd_bwd_s": {v: median(phases[v][0]) for v in variants},
            "median_optimizer_s": {v: median(phases[v][1]) for v in variants},
            "ratios": ratios, "step_times_s": step}


def _summarise_memory(memory: dict[str, list[dict]], numel: int, world_size: int) -> dict:
    out = {}
    for variant, ranks in memory.items():
        row = {key: max(r[key] for r in ranks) for key in ("parameters", "gradients", "optimizer", "live", "peak",
                                                           "build_peak")}
        row["formula"] = zero_formula(STAGES[variant], numel, world_size)
        row["peak_method"] = ranks[0]["peak_method"]
        row["per_rank"] = ranks
        out[variant] = row
    return out


# --------------------------------------------------------------------- report


def to_markdown(result: dict) -> str:
    cfg, med, mem = result["config"], result["median_step_s"], result["memory"]
    ref = "torch_ddp" if "torch_ddp" in med else next(iter(med))
    lines = [f"{cfg['params'] / 1e6:.1f}M-parameter GPT ({cfg['n_layer']} blocks, n_embd {cfg['n_embd']}, "
             f"{cfg['n_head']} heads, vocab {cfg['vocab']}), micro-batch {cfg['micro_batch']} x "
             f"{cfg['block_size']} tokens per rank, AdamW, fp32, world size {cfg['world_size']}, "
             f"{cfg['backend']} on {cfg['device']}, {cfg['threads_per_rank']} thread per rank; median of "
             f"{cfg['rounds']} rounds x {cfg['steps_per_round']} steps, torch {cfg['torch']}, dptrain "
             f"{cfg.get('commit') or '(commit unknown)'}.", "",
             f"| variant | step (ms) | fwd+bwd (ms) | optimizer (ms) | vs {ref} |", "|---|---:|---:|---:|---:|"]
    for v, seconds in med.items():
        lines.append(f"| {v} | {seconds * 1e3:.1f} | {result['median_fwd_bwd_s'][v] * 1e3:.1f} | "
                     f"{result['median_optimizer_s'][v] * 1e3:.1f} | {seconds / med[ref]:.2f}x |")
    method = next(iter(mem.values()))["peak_method"]
    lines += ["", f"Memory per rank (MiB, the larger rank), {cfg['memory_steps']} steps in a process group of its "
              f"own per variant; peak: {method}, minus the memory before the model was built.", "",
              "| variant | parameters | gradients | optimizer | all live tensors | ZeRO formula | peak in steps "
              "| peak in build |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v, row in mem.items():
        cells = [row[k] / MiB for k in ("parameters", "gradients", "optimizer", "live", "formula", "peak",
                                        "build_peak")]
        lines.append(f"| {v} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    lines += ["", "| dptrain / torch | step time: median of per-round ratios [90% interval] | all live tensors "
              "| peak in steps |", "|---|---:|---:|---:|"]
    for ours, ratio in result["ratios"].items():
        theirs = PAIRS[ours]
        low, high = ratio["ci90"]
        live, peak = (mem[ours][k] / mem[theirs][k] for k in ("live", "peak"))
        lines.append(f"| {ours} / {theirs} | {ratio['median']:.3f} [{low:.3f}, {high:.3f}] | {live:.3f} | "
                     f"{peak:.3f} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine, or GPUs with cuda)")
@click.option("--n-layer", type=int, default=6, help="the GPT's blocks")
@click.option("--n-embd", type=int, default=320, help="the GPT's width")
@click.option("--n-head", type=int, default=5, help="attention heads")
@click.option("--block-size", type=int, default=32, help="tokens per sequence")
@click.option("--micro-batch", type=int, default=2, help="sequences per rank per step")
@click.option("--rounds", type=int, default=20, help="rounds; each runs every variant in a shuffled order")
@click.option("--steps", type=int, default=2, help="steps per variant per round")
@click.option("--warmup", type=int, default=3, help="untimed steps per variant before the rounds")
@click.option("--memory-steps", type=int, default=3, help="steps in each variant's memory run")
@click.option("--threads", type=int, default=1, help="torch threads per rank")
@click.option("--device", type=click.Choice(("cpu", "cuda")), default=lambda: "cuda" if torch.cuda.is_available()
              else "cpu", show_default="cuda if available, else cpu", help="cuda needs --world-size GPUs (one per "
              "rank, nccl)")
@click.option("--variants", cls=Variadic, type=click.Choice(VARIANTS), default=VARIANTS, help="the variants to run")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/zero.json"),
              help="the JSON result (raw step times, per-rank memory) to write")
def main(world_size: int, n_layer: int, n_embd: int, n_head: int, block_size: int, micro_batch: int, rounds: int,
         steps: int, warmup: int, memory_steps: int, threads: int, device: str, variants: tuple[str, ...],
         out: Path) -> None:
    result = run(world_size, n_layer, n_embd, n_head, block_size, micro_batch, rounds, steps,
                 warmup, memory_steps, threads, device, tuple(variants))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(to_markdown(result))
    print(f"\nraw step times and per-rank memory: {out}")


if __name__ == "__main__":
    main()
