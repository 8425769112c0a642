"""What a finished run was: :class:`RunFacts`, the record rank 0's loop returns and the summary and pages read.

Every strategy's run is described by the same fields; where one has more to say (the
parameter server's roles and its servers' reports), it says it in ``layout`` (how the
ranks were used, one line), ``strategy_rows`` (its own lines of the summary) and
``strategy_report`` (its raw report, kept in ``summary.json`` under the strategy's name).
A strategy that meets every few steps (local SGD, DiLoCo) says it in its metrics records
instead, and the summary adds its rows from them (:func:`dptrain.runner.report.sync_rows`:
its period, its meetings, its bytes against DDP's). Nothing that reads the record asks which
strategy wrote it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RunFacts"]


@dataclass(frozen=True)
class RunFacts:
    run_dir: str
    task: str
    parameters: int
    world_size: int
    device: str
    backend: str
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    lr_rule: str
    peak_lr: float
    start_step: int
    steps: int
    restarts: int
    wall_s: float
    strategy: str = ""
    data_ranks: int | None = None  # the ranks that took data, where not every rank did (parameter servers)
    layout: str = ""  # how the ranks were used, where "N rank(s)" does not say it
    strategy_rows: tuple[tuple[str, str], ...] = ()  # the strategy's own lines of the summary
    strategy_report: dict[str, Any] = field(default_factory=dict)  # kept in summary.json under the strategy's name
    live: dict[str, Any] = field(default_factory=dict)  # live recovery's totals (dptrain.live.records), if it ran

    def to_summary(self) -> dict[str, Any]:
        """The fields as ``summary.json`` keeps them: the strategy's report under its name."""
        out = asdict(self)
        report = out.pop("strategy_report")
        out["strategy_rows"] = [list(row) for row in self.strategy_rows]
        if report:
            out[self.strategy] = report
        return out
