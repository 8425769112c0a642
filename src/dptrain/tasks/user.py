"""The user's data with a model: token files for a language model, or datasets from a factory.

``data.source`` picks the data: ``tokens`` (a token directory), ``text`` and ``hf``
(prepared into one, ``data/prepare.py``) or ``factory`` (the user's Datasets). The model
is, in this order: ``hf.path`` (a Hugging Face causal LM), ``task.model`` (the user's
factory), or the built-in model of ``task.name`` (the GPT sized by ``[gpt]``, or the
classifier's MLP). Every one is trained through the loss protocol (``protocol.py``), so
what works for one model works for all: every strategy, mixed precision, checkpoints,
evaluation, the planner.

Token data is checked before a worker starts: the files (present, not empty, whole
tokens), the largest token id of each file against the model's vocabulary, and the
context length against the model's. The built-in GPT's vocabulary comes from
``gpt.vocab_size``, else the directory's meta.json, else nanoGPT's meta.pkl (read as
plain data, ``data/pickle_meta.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from dptrain.config import ConfigError, RunConfig
from dptrain.config.factory import load_factory
from dptrain.data.factory import user_datasets
from dptrain.data.pickle_meta import META_PKL, pkl_vocab_size
from dptrain.data.prepare import Recipe, prepare_command, prepared
from dptrain.data.tokens import DTYPES, SPLITS, TokenFiles, TokenWindows, open_token_dir
from dptrain.models.gpt import GPT
from dptrain.models.mlp import MLPClassifier
from dptrain.tasks.protocol import protocol_eval_sums, protocol_loss

__all__ = ["ProtocolTask", "token_task", "factory_task", "token_files", "run_name", "DataNotPrepared"]

MAX_VOCAB = 1 << 32  # token ids are uint32 at most (data/tokens.py)

DEFAULT_HF_CONTEXT = 1024


@dataclass
class ProtocolTask:
    """Datasets and a model builder, trained through the loss protocol."""

    name: str
    train_set: Dataset
    val_set: Dataset
    build: Callable[[], nn.Module]
    tokens_per_sample: int = 1
    collate_fn: Callable | None = None
    about: str = ""  # what a sample is, for messages about the data's size
    data_files: dict[str, tuple[Path, int]] = field(default_factory=dict)  # name -> (path, bytes per token)
    notes: list[str] = field(default_factory=list)  # for the run's first lines (e.g. where the vocabulary came from)

    def build_model(self) -> nn.Module:
        return self.build()

    def build_architecture(self) -> nn.Module:
        """The model without pretrained weights (a builder's ``architecture``, when it has one)."""
        return getattr(self.build, "architecture", self.build)()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return protocol_loss(model, batch)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, float]:
        return protocol_eval_sums(model, batch)


def run_name(cfg: RunConfig) -> str:
    """What ``runs/<name>`` is called: the task, or the token directory, or the data factory's module."""
    d = cfg.data
    if d.source == "task":
        return cfg.task.name
    if d.source == "factory":
        return d.factory.partition(":")[0].rsplit(".", 1)[-1] or "custom"
    directory = d.dir or (Recipe.from_config(d).out if d.source in ("text", "hf") else "")
    return Path(directory).name or "lm"


def token_files(cfg: RunConfig) -> TokenFiles:
    """The token directory ``[data]`` names, checked; text and hf sources must have been prepared already."""
    d = cfg.data
    if d.source == "tokens":
        return open_token_dir(d.dir, d.dtype)
    recipe = Recipe.from_config(d)
    files = prepared(recipe)
    if files is None:
        raise DataNotPrepared(recipe)
    return files


class DataNotPrepared(ConfigError):
    """Text or hf data whose token directory does not exist yet; `dptrain run` prepares it, a worker cannot."""

    def __init__(self, recipe: Recipe):
        super().__init__(f"data.source = {recipe.source!r}: {recipe.out} has not been prepared yet; `dptrain run` "
                         f"prepares it before it starts the workers, or prepare it once with: "
                         f"{prepare_command(recipe)}")
        self.recipe = recipe


def token_task(cfg: RunConfig) -> ProtocolTask:
    """A language model on a token directory: windows of ``block_size + 1`` tokens."""
    d, t = cfg.data, cfg.train
    files = token_files(cfg)
    notes: list[str] = []
    build, vocab, context, block = _lm_model(cfg, files, notes)
    if context and block > context:
        raise ConfigError(f"data.block_size {block} is longer than the model's context ({context} positions); "
                          f"use data.block_size <= {context}")
    if vocab:
        files.check_vocab(vocab)
    train = TokenWindows(files.path(SPLITS[0]), files.dtype, block, d.sampling, seed=t.seed)
    val = TokenWindows(files.path(SPLITS[1]), files.dtype, block, "sequential")
    if len(val) == 0:
        raise ConfigError(f"{files.path(SPLITS[1])} has {val.num_tokens:,} tokens, fewer than one window of "
                          f"{block + 1} (block_size + 1): give more validation data or a shorter block_size")
    about = f"windows of {block} + 1 tokens from the {train.num_tokens:,} tokens of {files.path(SPLITS[0])}"
    itemsize = np.dtype(DTYPES[files.dtype]).itemsize
    return ProtocolTask(run_name(cfg), train, val, build, tokens_per_sample=block, about=about,
                        data_files={s: (files.path(s), itemsize) for s in SPLITS}, notes=notes)


def _lm_model(cfg: RunConfig, files: TokenFiles, notes: list[str]) -> tuple[Callable[[], nn.Module], int, int, int]:
    """(model builder, its vocabulary size, its context length, the sample length); 0 where not known.

    ``notes`` gets a line when the vocabulary size comes from nanoGPT's meta.pkl."""
    g, d = cfg.gpt, cfg.data
    if cfg.hf.path:
        from dptrain.models import hf

        config = hf.load_config(cfg.hf.path)
        context = hf.context_length(config)
        block = d.block_size or min(context or DEFAULT_HF_CONTEXT, DEFAULT_HF_CONTEXT)
        return _named_model(cfg), int(config.vocab_size), context, block
    block = d.block_size or g.block_size
    if cfg.task.model:
        return _named_model(cfg), 0, 0, block
    if cfg.task.name != "chargpt":
        raise ConfigError(f"token data trains a language model: task.name {cfg.task.name!r} has none; use "
                          "task.name = \"chargpt\" (the built-in GPT), hf.path or task.model")
    vocab = g.vocab_size or files.vocab_size
    if not vocab and not files.meta:  # nanoGPT's directory: its meta.pkl, read as plain data
        vocab = pkl_vocab_size(files.dir)
        if vocab:
            notes.append(f"note: vocabulary size {vocab:,} read from {files.dir / META_PKL} (nanoGPT's; plain data "
                         "only, nothing in it run); set gpt.vocab_size to choose another")
    if not vocab:
        raise ConfigError(f"{files.dir} has no meta.json (or nanoGPT meta.pkl) saying its vocabulary size: set "
                          "gpt.vocab_size (nanoGPT's GPT-2 tokens: 50304)")
    if vocab > MAX_VOCAB:  # an embedding that large is no model: torch would fail in C++ allocating it
        where = ("gpt.vocab_size" if g.vocab_size else f"{files.dir / 'meta.json'}" if files.vocab_size
                 else f"{files.dir / META_PKL}")
        raise ConfigError(f"the vocabulary size {vocab:,} ({where}) is more ids than token files can hold (uint32: "
                          f"{MAX_VOCAB:,}); correct it, or set gpt.vocab_size")
    return _builtin_gpt(cfg, vocab, block), vocab, block, block


def _builtin_gpt(cfg: RunConfig, vocab: int, block: int) -> Callable[[], nn.Module]:
    """The built-in GPT sized by ``[gpt]``, with this vocabulary and context."""
    g = cfg.gpt
    return lambda: GPT(vocab_size=vocab, block_size=block, n_layer=g.n_layer, n_head=g.n_head, n_embd=g.n_embd,
                       dropout=g.dropout)


def factory_task(cfg: RunConfig) -> ProtocolTask:
    """The user's datasets, with ``hf.path``, ``task.model`` or ``task.name``'s built-in model."""
    train, val, collate = user_datasets(cfg.data.factory, cfg.data.factory_args)
    if cfg.hf.path:
        from dptrain.models import hf

        hf.load_config(cfg.hf.path)  # checked now, not in every worker at step 1
    build = _named_model(cfg)
    if build is None and cfg.task.name == "classifier":
        c = cfg.classifier
        build = lambda: MLPClassifier(features=c.features, classes=c.classes, hidden=c.hidden, depth=c.depth)  # noqa: E731
    elif build is None:
        if not cfg.gpt.vocab_size:
            raise ConfigError("the built-in GPT on your datasets needs gpt.vocab_size (or set task.model or hf.path)")
        build = _builtin_gpt(cfg, cfg.gpt.vocab_size, cfg.gpt.block_size)
    return ProtocolTask(run_name(cfg), train, val, build, tokens_per_sample=int(getattr(train, "tokens_per_sample", 1)),
                        collate_fn=collate, about=f"samples of data.factory {cfg.data.factory!r}")


def _named_model(cfg: RunConfig) -> Callable[[], nn.Module] | None:
    """The builder of the model the config names (``hf.path``, else ``task.model``'s factory); None: neither."""
    if cfg.hf.path:
        return _HFBuild(cfg.hf.path, cfg.hf.from_scratch)
    if cfg.task.model:
        factory = load_factory(cfg.task.model)
        return lambda: factory(**cfg.task.model_args)
    return None


@dataclass(frozen=True)
class _HFBuild:
    """Builds the Hugging Face model of ``hf.path``; ``architecture`` without loading weights."""

    path: str
    from_scratch: bool

    def __call__(self) -> nn.Module:
        from dptrain.models import hf

        return hf.causal_lm(self.path, self.from_scratch)

    def architecture(self) -> nn.Module:
        """The model without its weights (validation, planning); the weights' files are checked to load."""
        from dptrain.models import hf

        model = hf.causal_lm(self.path, weights=False)
        if not self.from_scratch:
            hf.check_weights(self.path)
        return model
