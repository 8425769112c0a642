"""What a run tells its user: rank-0 console (progress bar or log lines), per-rank log
files, and the end-of-run summary.

Every rank logs to ``logs/rank<r>.log``; only rank 0 writes to the terminal, as with
torchrun and Accelerate. With ``log.progress = "auto"`` rank 0 shows a tqdm bar when its
output is a terminal and plain lines otherwise (CI logs, ``| tee``), so logs never fill
with carriage returns.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from dptrain.live.records import live_rows
from dptrain.runner.facts import RunFacts
from dptrain.runner.metrics import format_line, has_tokens, run_comm_per_step, run_sync_steps
from dptrain.strategies import REGISTRY
from dptrain.utils.atomic import write_text_atomic
from dptrain.utils.files import open_file

__all__ = ["RunLog", "summarize", "step_breakdown", "print_summary", "summary_rows", "truncate_metrics", "sync_rows",
           "strategy_line"]


class RunLog:
    def __init__(self, log_path: Path, rank: int, progress: str, total_steps: int, start_step: int,
                 stream: TextIO = sys.stdout):
        self.rank = rank
        self.total_steps = total_steps
        self._file = open_file(log_path, "a")  # line-buffered, never through a link
        self._stream = stream
        use_bar = progress == "bar" or (progress == "auto" and stream.isatty())
        self._bar = None
        if rank == 0 and use_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=stream, smoothing=0.1)

    def info(self, message: str, console: bool = True) -> None:
        """A line in this rank's log file, and on rank 0 also on the console."""
        self._file.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        if console and self.rank == 0:
            if self._bar is not None:
                self._bar.write(message, file=self._stream)
            else:
                print(message, file=self._stream, flush=True)

    def step_done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def train_record(self, rec: dict, previous_step: int | None = None) -> None:
        """A record's line; ``previous_step``: the previous record's (:func:`~dptrain.runner.metrics.format_line`)."""
        line = format_line(rec, self.total_steps, previous_step)
        if self._bar is not None:
            self._file.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            rate = ({"tok_s": f"{rec['tokens_per_s']:.0f}"} if has_tokens(rec.get("tokens_per_s"), rec["samples_per_s"])
                    else {"samples_s": f"{rec['samples_per_s']:.0f}"})
            self._bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.1e}", **rate,
                                  comm=f"{rec['exposed_comm_ms']:.0f}ms", refresh=False)
        else:
            self.info(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._file.close()


def truncate_metrics(path: Path, step: int) -> str | None:
    """Drop records after ``step`` (logged before a crash, then replayed by the resumed run), and any line that
    is not a whole record: a crash (or a full disk) cuts the line being written, which must never block a
    resume. Returns a note saying what was dropped that was not a record, or None."""
    try:
        with open_file(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    keep, torn = [], []
    for number, line in enumerate(lines, start=1):
        record = _record(line)
        if record is None:
            torn += [number] if line.strip() else []
        elif record["step"] <= step:
            keep.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in keep))
    if not torn:
        return None
    where = "its last line" if torn == [len(lines)] else f"line(s) {', '.join(map(str, torn[:5]))}"
    return (f"note: {path}: {where} held no whole record (cut short by a crash or a full disk) and "
            f"{'was' if len(torn) == 1 else 'were'} dropped")


def _record(line: str) -> dict | None:
    """One metrics record, or None for a line that is not one (torn, or not JSON)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def summarize(run_dir: Path, facts: RunFacts | dict[str, Any], train: list[dict], evals: list[dict]) -> dict[str, Any]:
    """The run's headline numbers: medians over this session's logged steps after the first.

    A resumed run's ``metrics.jsonl`` also holds the earlier sessions' records (perhaps on
    another world size); loss comes from the last record, speed and memory from this session,
    the bytes per step from the whole run (:func:`~dptrain.runner.metrics.run_comm_per_step`:
    what a strategy that meets every H steps sent, over all the steps). Each median is taken on
    its own (of values that are each the largest over the ranks), so they need not add up;
    ``step_breakdown`` is one record's step time in parts that do. The strategy's own rows
    (``strategy_rows``) are the facts' (the parameter server's) and, for a strategy that meets
    every few steps, :func:`sync_rows`.
    """
    info = facts.to_summary() if isinstance(facts, RunFacts) else dict(facts)  # a dict: the fields already
    session = [r for r in train if r["step"] > info["start_step"]] or train
    steady = session[1:] if len(session) > 1 else session
    med = (lambda key: statistics.median(r[key] for r in steady) if steady else None)
    summary = dict(info)
    if train:
        comm = run_comm_per_step(train)
        summary.update({
            "final_train_loss": train[-1]["loss"],
            "median_tokens_per_s": med("tokens_per_s"),
            "median_samples_per_s": med("samples_per_s"),
            "median_step_ms": med("step_ms"),
            "median_compute_ms": med("compute_ms"),
            "median_exposed_comm_ms": med("exposed_comm_ms"),
            "median_comm_busy_ms": med("comm_busy_ms"),
            # the DDP engine's (metrics.py): the cost model's floor on the exposed time
            "median_tail_comm_ms": statistics.median(r.get("tail_comm_ms", 0.0) for r in steady) if steady else None,
            "median_overlap_pct": med("overlap_pct"),
            "comm_bytes_per_step": comm["comm_bytes_per_step"],  # over the whole run, per step
            "comm_compressed_bytes_per_step": comm["comm_compressed_bytes_per_step"],
            "comm_sent_bytes_per_step": comm["comm_sent_bytes_per_step"],
            "comm_steps": comm["steps"],
            "peak_rss_mb_per_rank": _peak_per_rank(session, "peak_rss_mb"),
            "peak_tensor_mb_per_rank": _peak_per_rank(session, "peak_tensor_mb"),
            "skipped_steps": train[-1]["skipped_steps"],
            "step_breakdown": step_breakdown(steady),
        })
    per_rank = [r["compute_ms_per_rank"] for r in steady if "compute_ms_per_rank" in r]
    if per_rank and len(per_rank[0]) > 1:
        summary["stragglers"] = straggler_report(per_rank)
    summary["strategy_rows"] = [*summary.get("strategy_rows", []), *sync_rows(train, summary)]
    if evals:
        summary.update({k: v for k, v in evals[-1].items() if k.startswith("val_")})
    summary["files"] = _listing(run_dir)
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    summary["files"]["summary.json"] = (run_dir / "summary.json").stat().st_size
    return summary


def step_breakdown(records: list[dict]) -> dict[str, Any] | None:
    """The median logged record's step time in two parts that add up, and its exposed communication apart.

    In a record ``step_ms``, ``compute_ms`` and ``exposed_comm_ms`` are each the largest over
    the ranks (of each rank's mean since the previous record): the slowest rank computes
    longest, a faster rank waits longest, so compute + exposed may exceed the step. What adds
    up is the step = the slowest rank's compute + the rest of its step (communication its
    compute did not hide, loading the batch, the hooks); every rank's step contains its own
    compute, so the rest is never negative. The record is the median by ``step_ms`` (the
    lower one of an even count), so the three figures come from one record.
    """
    if not records:
        return None
    record = sorted(records, key=lambda r: r["step_ms"])[(len(records) - 1) // 2]
    per_rank = record.get("compute_ms_per_rank") or []
    return {"step": record["step"], "of": len(records), "step_ms": record["step_ms"],
            "compute_ms": record["compute_ms"], "rest_ms": record["step_ms"] - record["compute_ms"],
            "slowest_rank": max(range(len(per_rank)), key=per_rank.__getitem__) if len(per_rank) > 1 else None,
            "exposed_comm_ms": record["exposed_comm_ms"], "tail_comm_ms": record.get("tail_comm_ms", 0.0)}


def _peak_per_rank(session: list[dict], key: str) -> list[float | None]:
    """Each rank's largest value of ``key`` over the session's records (None where none was measured)."""
    ranks = range(len(session[-1][key]))
    return [max((r[key][i] for r in session if r[key][i] is not None), default=None) for i in ranks]


def _memory(summary: dict) -> str:
    """Each rank's peak resident set, and its peak of live tensors (what ``dptrain plan`` predicts) if measured."""
    rss = "/".join(f"{m:.0f}" for m in summary["peak_rss_mb_per_rank"])
    tensors = summary["peak_tensor_mb_per_rank"]
    if any(m is None for m in tensors):
        return f"{rss} MiB resident ({_whose(summary, len(tensors))})"
    return (f"{rss} MiB resident, " + "/".join(f"{m:.1f}" for m in tensors) + " MiB live tensors "
            f"({_whose(summary, len(tensors))})")


def _whose(summary: dict, measured: int) -> str:
    """Whose memory the records hold: every rank's; or, under live recovery (its replicas share no process group
    to gather it in), replica 0's, which keeps the records, with every replica's resident peak from its live log."""
    live = summary.get("live") or {}
    if not live or measured >= summary.get("world_size", measured):
        return "rank 0" if measured == 1 else f"ranks 0-{measured - 1}"
    by_replica = ", ".join(f"{r}: {'?' if m is None else f'{m:.0f}'}"
                           for r, m in enumerate(live.get("peak_rss_mb_by_replica") or []))
    others = f"; peak resident by replica, from logs/live<r>.jsonl: {by_replica} MiB" if by_replica else ""
    return (f"replica 0 of {summary['world_size']}, which keeps the records: the replicas of a live run share no "
            f"process group to gather theirs in{others}")


def straggler_report(per_rank: list[list[float]]) -> dict[str, Any]:
    """From each logged record's per-rank compute ms (measured before the collective): every rank's median, the
    slowest rank, and how much slower it is than the median of the others."""
    medians = [statistics.median(row[i] for row in per_rank) for i in range(len(per_rank[0]))]
    slowest = max(range(len(medians)), key=medians.__getitem__)
    others = statistics.median(m for i, m in enumerate(medians) if i != slowest)
    return {"compute_ms_per_rank": medians, "slowest_rank": slowest,
            "slowdown": medians[slowest] / others if others > 0 else float("inf")}


def _listing(run_dir: Path) -> dict[str, int]:
    """Files in the run directory with their sizes. A checkpoint counts as one entry, and so does every other
    directory but ``logs/``: the Hugging Face export, a logging backend's (``wandb/``, ``tensorboard/``...)."""
    listing: dict[str, int] = {}
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if rel.parts[0] == "checkpoints" and len(rel.parts) > 2:
            key = f"{rel.parts[0]}/{rel.parts[1]}/"
        elif rel.parts[0] != "logs" and len(rel.parts) > 1:
            key = f"{rel.parts[0]}/"
        else:
            key = str(rel)
        listing[key] = listing.get(key, 0) + path.stat().st_size
    return listing


def print_summary(summary: dict[str, Any], log: RunLog) -> None:
    rows = [("run directory", summary["run_dir"]), *summary_rows(summary)]
    width = max(len(k) for k, _ in rows)
    lines = ["", "run summary"] + [f"  {k:<{width}}  {v}" for k, v in rows] + ["files written"]
    lines += [f"  {name:<40} {_size(size)}" for name, size in summary["files"].items()]
    log.info("\n".join(lines))


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The run summary's (label, value) rows, as the console prints them and report.html shows them."""
    rows = [("task", f"{summary['task']} ({summary['parameters']:,} parameters)"),
            ("workers", f"{summary['world_size']} x {summary['device']} ({summary['backend']})"),
            *([("strategy", strategy_line(summary["strategy"]))] if summary.get("strategy") else []),
            ("batch", f"global {summary['global_batch_size']} = micro {summary['micro_batch_size']} x "
                      f"{summary.get('data_ranks') or summary['world_size']} ranks x "
                      f"{summary['grad_accum_steps']} accum"),
            ("learning rate", summary["lr_rule"]),
            ("steps", (f"{summary['start_step']} -> {summary['steps']}" if summary["start_step"]
                       else str(summary["steps"]))
             + (f" (after {summary['restarts']} restart(s), "
                + ("healed by a peer)" if summary.get("live") else "resumed from the newest checkpoint)")
                if summary.get("restarts") else "")),
            ("wall time", f"{summary['wall_s']:.1f} s")]
    if "final_train_loss" in summary:
        rows += [("final train loss", f"{summary['final_train_loss']:.4f}")]
    if "val_loss" in summary:
        acc = f", accuracy {100 * summary['val_accuracy']:.1f}%" if "val_accuracy" in summary else ""
        rows += [("validation loss", f"{summary['val_loss']:.4f}{acc}")]
    if summary.get("median_step_ms") is not None:
        tokens = (f"{summary['median_tokens_per_s']:,.0f} tokens/s, "
                  if has_tokens(summary.get("median_tokens_per_s"), summary["median_samples_per_s"]) else "")
        rows += [("throughput", f"{tokens}{summary['median_samples_per_s']:,.1f} samples/s (median)"),
                 *_step_time_rows(summary),
                 ("communication", f"{summary['comm_bytes_per_step'] / 2**20:.2f} MiB/step per rank{_over(summary)}"
                                   f"{_sent(summary)}, {_busy(summary)}{summary['median_overlap_pct']:.0f}% "
                                   "overlapped with computation"),
                 ("peak memory", _memory(summary))]
        if summary["skipped_steps"]:
            rows += [("skipped steps", f"{summary['skipped_steps']} (non-finite gradients)")]
    if summary.get("stragglers"):
        st = summary["stragglers"]
        rows += [("stragglers", f"slowest rank {st['slowest_rank']}, {st['slowdown']:.2f}x the others' compute; "
                                "median compute ms per rank (before the collective): "
                                + ", ".join(f"{i}: {m:.1f}" for i, m in enumerate(st["compute_ms_per_rank"])))]
    rows += [tuple(row) for row in summary.get("strategy_rows", [])]  # the strategy's own lines
    rows += live_rows(summary.get("live") or {})
    return rows


def strategy_line(name: str) -> str:
    """The strategy as the run names it: its registry entry's name and one-line summary."""
    entry = REGISTRY.get(name)
    return f"{name}: {entry.summary}" if entry is not None else name


def sync_rows(train: list[dict], summary: dict[str, Any]) -> list[list[str]]:
    """The summary's rows of a strategy that meets every few steps, from the fields its records share
    (:mod:`dptrain.runner.metrics`): its period H, the meetings it took and where, and its bytes per step over the
    run against DDP's (an all-reduce of the gradients every step). None for a strategy without such fields."""
    synced = [r for r in train if "sync_period" in r]
    if not synced or "comm_bytes_per_step" not in summary:
        return []
    last = synced[-1]
    name = last["sync_name"]
    parts = last.get("sync_fragments", 1)
    period = (f"H = {last['sync_period']} steps from one {name} to the next" if parts == 1 else
              f"one of the model's {parts} fragments every {last['sync_period']} steps, each fragment every H = "
              f"{parts * last['sync_period']}")
    rows = [["period", period], [f"{name}s", _syncs_taken(last, run_sync_steps(train), summary)]]
    if last.get("sync_peak_sent_bytes"):
        rows.append(["peak per sync", f"{last['sync_peak_sent_bytes'] / 2**20:.3f} MiB sent per rank at the largest "
                                      f"{name}"])
    if last.get("gradient_bytes"):
        rows.append(["bytes vs DDP", _against_ddp(last, summary)])
    return rows


def _syncs_taken(last: dict, steps: list[int], summary: dict[str, Any]) -> str:
    """How many meetings the logged steps hold, at which steps, and the one that closes an incomplete last round."""
    at = ", ".join(map(str, steps)) if len(steps) <= 8 else f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
    text = f"{last['syncs']} in steps 1-{last['step']}" + (f" (at step{'s' if len(steps) > 1 else ''} {at})"
                                                           if steps else "")
    since = last["steps_since_sync"]
    if since and last["step"] == summary["steps"]:
        text += (f"; then 1 more at the end, closing the last round's {since} step(s) (its bytes are not in the "
                 "bytes per step: it follows the last record)")
    return text


def _against_ddp(last: dict, summary: dict[str, Any]) -> str:
    """The run's bytes per step against DDP's: its all-reduce of the gradients, every step, said how it is counted."""
    ddp, ddp_sent = last["gradient_bytes"], last.get("gradient_sent_bytes")
    run, sent = summary["comm_bytes_per_step"], summary.get("comm_sent_bytes_per_step")
    by_sent = sent is not None and bool(ddp_sent)  # what goes on the wire, where both are counted
    mine, theirs, what = (sent, ddp_sent, "sent") if by_sent else (run, ddp, "reduced")
    ratio = f"{mine / theirs:.3g}x DDP's" + (f", {theirs / mine:.1f}x fewer" if mine else "")
    per_param = ddp / summary["parameters"] if summary.get("parameters") else 0
    how = (f"{summary['parameters']:,} parameters x {per_param:g} bytes" if per_param == int(per_param) and per_param
           else "the trainable parameters' bytes")
    return (f"{mine / 2**20:.3f} MiB/step {what} per rank over the run's {summary.get('comm_steps', '?')} steps, "
            f"against DDP's {theirs / 2**20:.3f} MiB/step: {ratio} (DDP all-reduces the gradients every step: "
            f"{how} = {ddp / 2**20:.2f} MiB, {(ddp_sent or ddp) / 2**20:.2f} MiB sent per rank)")


def _over(summary: dict[str, Any]) -> str:
    """Over which steps the bytes per step are the mean (a summary.json written before it was recorded: none)."""
    return f" over the run's {summary['comm_steps']} steps" if summary.get("comm_steps") else ""


def _sent(summary: dict[str, Any]) -> str:
    """The bytes sent, where they differ from those reduced (compression, or a ring on more than 2 ranks)."""
    sent, raw = summary.get("comm_sent_bytes_per_step"), f"{summary['comm_bytes_per_step'] / 2**20:.2f}"
    return f" ({sent / 2**20:.2f} MiB sent)" if sent and f"{sent / 2**20:.2f}" != raw else ""


def _busy(summary: dict[str, Any]) -> str:
    """The collectives' busy time (a summary.json written before it was recorded has none)."""
    busy = summary.get("median_comm_busy_ms")
    return f"busy {busy:.1f} ms, " if busy is not None else ""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _step_time_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The step time in parts that add up, from one record (:func:`step_breakdown`), each part named; a
    summary.json written before the breakdown was recorded gives its medians, saying what they are."""
    b = summary.get("step_breakdown")
    if b is None:
        return [("step time", f"{summary['median_step_ms']:.1f} ms, compute {summary['median_compute_ms']:.1f} ms, "
                              f"exposed comm {summary['median_exposed_comm_ms']:.1f} ms{_hideable(summary)} "
                              "(medians over the logged steps, each the largest over the ranks: they need not add up)")]
    rank = f" (rank {b['slowest_rank']})" if b["slowest_rank"] is not None else ""
    return [("step time", f"{b['step_ms']:.1f} ms = compute {b['compute_ms']:.1f} ms + rest {b['rest_ms']:.1f} ms "
                          f"(step {b['step']}, the median of {b['of']} logged steps; compute: the slowest rank's "
                          f"forward, backward and optimizer{rank}; rest: the remainder of the step, communication "
                          "that compute did not hide, loading the batch, the hooks)"),
            ("exposed comm", f"{b['exposed_comm_ms']:.1f} ms at step {b['step']}: the longest wait for "
                             "communication on any rank, a faster rank's wait for the slowest included"
                             f"{_hideable(summary)}")]


def _hideable(summary: dict) -> str:
    """What of the exposed communication the cost model says could have been hidden (DDP's buckets)."""
    b = summary.get("step_breakdown")
    exposed, tail = ((b["exposed_comm_ms"], b.get("tail_comm_ms") or 0.0) if b is not None else
                     (summary["median_exposed_comm_ms"], summary.get("median_tail_comm_ms") or 0.0))
    if not tail or exposed <= 0:
        return ""
    return (f" (by the cost model {min(tail, exposed):.1f} ms of it unavoidable, the reductions started after "
            f"backward; {max(0.0, exposed - tail):.1f} ms could be hidden)")
