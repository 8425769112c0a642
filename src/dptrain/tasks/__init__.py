"""Built-in training tasks, and the factory hook for bringing your own model."""

from __future__ import annotations

from dptrain.config import RunConfig
from dptrain.tasks.base import Task, load_factory
from dptrain.tasks.chargpt import CharGPTTask
from dptrain.tasks.classifier import ClassifierTask

__all__ = ["Task", "build_task", "load_factory"]


def build_task(cfg: RunConfig) -> Task:
    """The task a config names, its arguments unpacked from the config."""
    factory = load_factory(cfg.task.model) if cfg.task.model else None
    if cfg.task.name == "chargpt":
        g = cfg.gpt
        model_kwargs = cfg.task.model_args if factory else dict(
            block_size=g.block_size, n_layer=g.n_layer, n_head=g.n_head, n_embd=g.n_embd, dropout=g.dropout)
        return CharGPTTask(g.corpus_bytes, g.val_fraction, g.block_size, model_kwargs, factory)
    c = cfg.classifier
    return ClassifierTask(c.features, c.classes, c.hidden, c.depth, c.samples, c.noise, cfg.train.seed,
                          cfg.task.model_args, factory)
