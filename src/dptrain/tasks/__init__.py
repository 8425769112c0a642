"""What ``dptrain run`` trains: a built-in task, or the user's data and model (``tasks/user.py``)."""

from __future__ import annotations

from dptrain.config import ConfigError, RunConfig
from dptrain.tasks.base import Task, architecture, collate, load_factory
from dptrain.tasks.chargpt import CharGPTTask
from dptrain.tasks.classifier import ClassifierTask
from dptrain.tasks.user import factory_task, run_name, token_task

__all__ = ["Task", "build_task", "load_factory", "collate", "architecture", "run_name"]


def build_task(cfg: RunConfig) -> Task:
    """The task a config describes, its arguments unpacked from the config."""
    source = cfg.data.source
    if source in ("tokens", "text", "hf"):
        return token_task(cfg)
    if source == "factory":
        return factory_task(cfg)
    if cfg.hf.path:
        raise ConfigError(f"hf.path trains a Hugging Face model on your data: set data.source (tokens, text, hf or "
                          f"factory); the built-in {cfg.task.name} task's batches are its own")
    factory = load_factory(cfg.task.model) if cfg.task.model else None
    if cfg.task.name == "chargpt":
        g = cfg.gpt
        if g.vocab_size not in (0, 256):
            raise ConfigError(f"gpt.vocab_size {g.vocab_size}: the built-in chargpt task's tokens are bytes "
                              "(vocabulary 256); other vocabularies come with data.source tokens, text or hf")
        model_kwargs = cfg.task.model_args if factory else dict(
            block_size=g.block_size, n_layer=g.n_layer, n_head=g.n_head, n_embd=g.n_embd, dropout=g.dropout)
        return CharGPTTask(g.corpus_bytes, g.val_fraction, g.block_size, model_kwargs, factory)
    c = cfg.classifier
    return ClassifierTask(c.features, c.classes, c.hidden, c.depth, c.samples, c.noise, cfg.train.seed,
                          cfg.task.model_args, factory)
