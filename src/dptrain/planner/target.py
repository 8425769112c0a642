"""What the planner plans: the model a config names, built on fake tensors, and samples shaped like its data's.

``dptrain run`` needs the data to train; a plan needs only the model and the shape of
one sample. For a Hugging Face model (``hf.path``) both come from the model's
``config.json``: the architecture, and samples of ``data.block_size`` tokens (0: the
model's context, capped at 1,024 as ``dptrain run`` caps it), so ``dptrain plan --set
hf.path=DIR`` plans with no ``data.source``, no token files and no tokenizer. The
built-in tasks, the built-in GPT on token files (whose vocabulary may come from the
data) and a data factory's batches are planned from the run's own task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import Dataset

from dptrain.config import ConfigError, RunConfig
from dptrain.tasks import Task, architecture, build_task
from dptrain.tasks.user import DEFAULT_HF_CONTEXT, ProtocolTask

__all__ = ["PlanTarget", "plan_task", "plan_target"]


@dataclass
class PlanTarget:
    """The task to plan, its model built under ``mode`` (no storage), and what the plan's heading says of it."""

    task: Task
    model: nn.Module
    mode: FakeTensorMode
    parameters: int
    tokens_per_sample: int
    notes: list[str] = field(default_factory=list)  # how the sample length was chosen, what the run will need

    def heading(self) -> str:
        """The parameter count and the sample's length, for the plan's first lines."""
        tokens = (f"tokens per sample: {self.tokens_per_sample:,}" if self.tokens_per_sample > 1
                  else "a sample is one input, not tokens")
        return f"parameters: {self.parameters:,}; {tokens}"


class _Windows(Dataset):
    """Token windows of ``block_size`` zeros: the shape of ``TokenWindows``' samples, without a file."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(self.block_size, dtype=torch.long)
        return x, x


def plan_task(cfg: RunConfig, notes: list[str] | None = None) -> Task:
    """The task to plan ``cfg`` by: a Hugging Face model from its config alone, else the run's own task.

    ``notes`` gets a line when the sample length is capped below the model's context, and
    when ``dptrain run`` will need a data source the plan did not.
    """
    notes = [] if notes is None else notes
    if cfg.hf.path and cfg.data.source != "factory":
        return _hf_task(cfg, notes)
    return build_task(cfg)


def _hf_task(cfg: RunConfig, notes: list[str]) -> ProtocolTask:
    from dptrain.models import hf

    config = hf.load_config(cfg.hf.path)
    context = hf.context_length(config)
    block = cfg.data.block_size or min(context or DEFAULT_HF_CONTEXT, DEFAULT_HF_CONTEXT)
    if context and block > context:
        raise ConfigError(f"data.block_size {block} is longer than the model's context ({context} positions); "
                          f"use data.block_size <= {context}")
    if not cfg.data.block_size and context > block:
        notes.append(f"samples of {block:,} tokens: data.block_size = 0 takes the model's context ({context:,} "
                     f"positions) capped at {DEFAULT_HF_CONTEXT:,}; set data.block_size = {context} to plan "
                     "full-length samples")
    if cfg.data.source == "task":
        notes.append("planned from the model's config.json alone; dptrain run also needs your data for it "
                     "(data.source tokens, text, hf or factory: docs/your-data.md)")
    path = cfg.hf.path
    windows = _Windows(block)
    return ProtocolTask(Path(path).name or "hf", windows, windows, lambda: hf.causal_lm(path, weights=False),
                        tokens_per_sample=block, about=f"windows of {block} tokens")


def plan_target(cfg: RunConfig) -> PlanTarget:
    """:func:`plan_task`'s task with its model built under a fake tensor mode, counted."""
    notes: list[str] = []
    task = plan_task(cfg, notes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            model = architecture(task)
    except Exception as e:  # the user's factory may fail in any way
        raise ConfigError(f"the model factory failed while building the model to plan: {type(e).__name__}: {e}") \
            from None
    parameters = sum(p.numel() for p in model.parameters())  # a tied weight once, as it is stored
    return PlanTarget(task, model, mode, parameters, int(getattr(task, "tokens_per_sample", 1)), notes)
