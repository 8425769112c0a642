"""Reading a run's config strictly: TOML file, then ``--set key=value`` overrides.

Strict means: an unknown key is an error that says which key, where, and what was
probably meant ("did you mean 'train.lr'?"); a value of the wrong type or outside its
choices is an error naming both; a malformed file is an error with its line. Nothing
falls back to a default behind the user's back. All errors are :class:`ConfigError`,
which the CLI turns into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from dptrain.config.errors import ConfigError
from dptrain.config.renamed import move_renamed, renamed_key
from dptrain.config.schema import ADDED_LATER, NOT_IDENTITY, RunConfig, section_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "load_config", "build", "to_dict", "to_toml", "identity", "identity_hash",
           "normalize_identity", "unused_fields", "unused_settings"]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                notes: list[str] | None = None) -> RunConfig:
    """The config in ``path`` (defaults if None) with ``overrides`` ("a.b=value") applied.

    Keys that moved (``config.renamed``: ``ddp.strategy`` is ``distributed.strategy``) are read at their new
    place; a deprecation line for each is appended to ``notes`` (the command line prints them once)."""
    notes = [] if notes is None else notes
    data = _read_toml(Path(path)) if path is not None else {}
    notes += move_renamed(data, str(path)) if path is not None else []
    config = build(RunConfig, data, "", str(path) if path is not None else "the defaults")
    for text in overrides:  # one at a time, so an error names the override that caused it
        key, value = parse_override(text)
        key, note = renamed_key(key, f"--set {text}")
        notes += [note] if note else []
        _set_dotted(data, key, value, f"--set {text}")
        config = build(RunConfig, data, "", f"--set {text}")
    return config


CONFIG_LIMIT = 1 << 20  # bytes: a run config is a few KB; a larger file is not one (and would be echoed and copied)


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path``; a ConfigError naming the file and the fix for a missing, unreadable, oversized
    or bad one."""
    if path.is_dir():
        tomls = sorted(p.name for p in path.glob("*.toml"))[:3]
        raise ConfigError(f"config file {path} is a directory; --config takes a TOML file"
                          + (f", e.g. {path / tomls[0]} (it holds {', '.join(tomls)})" if tomls else ""))
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_LIMIT + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    if len(raw) > CONFIG_LIMIT:
        raise ConfigError(f"config file {path} is over {CONFIG_LIMIT >> 20} MiB; a run config is a few KB of TOML "
                          "(docs/run.md): is it the right file?")
    try:
        text = raw.decode("utf-8")  # TOML is UTF-8
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}, byte {e.start:,}: "
                          f"{raw[e.start:e.start + 1]!r}); TOML files are UTF-8: save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests arrays or tables too deeply to read (thousands of levels); a run config "
                          "has two") from None


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 3e-4)``; values use TOML syntax, bare words are strings."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. --set train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw.strip()
    return key.strip(), value


def _set_dotted(data: dict, key: str, value: Any, source: str) -> None:
    *sections, leaf = key.split(".")
    node = data
    for name in sections:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {name!r} is a value, not a section")
        node = child
    node[leaf] = value


def build(cls: type, data: dict, prefix: str, source: str) -> Any:
    """An instance of dataclass ``cls`` from ``data``, refusing unknown keys and bad values."""
    known = section_fields(cls)
    hints = _type_hints(cls)
    values = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown key {dotted!r} in {source}{_did_you_mean(key, prefix, known)}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted!r} in {source} must be a section ([{dotted}]), got {value!r}")
            values[key] = build(kind, value, f"{dotted}.", source)
        else:
            values[key] = _check_value(dotted, value, kind, known[key].metadata.get("choices"), source)
    return cls(**values)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, resolved once per config class: a run's config is built once per ``--set``
    (so that an error names the override), in the launcher and again in every worker; resolving every section's
    string annotations each time was most of that work."""
    return typing.get_type_hints(cls)


def _check_value(dotted: str, value: Any, kind: Any, choices: tuple | None, source: str) -> Any:
    args = typing.get_args(kind)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), kind) if args else kind
    if optional and isinstance(value, str) and value.lower() == "none":
        return None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list),
        dict: isinstance(value, dict),
    }.get(typing.get_origin(base) or base, True)
    if not ok:
        expected = getattr(base, "__name__", str(base)) + (" or none" if optional else "")
        raise ConfigError(f"{dotted!r} in {source} must be {expected}, got {shown(value)} ({type(value).__name__})")
    if base is float and not math.isfinite(value):
        raise ConfigError(f"{dotted!r} in {source} must be a finite number, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{dotted!r} in {source} must be one of {', '.join(map(str, choices))}; got {shown(value)}"
                          f"{_closest(str(value)[:100], [str(c) for c in choices])}")
    return float(value) if base is float else value


# Names users bring from other tools, mapped to ours.
_ALIASES = {"learning_rate": "lr", "max_lr": "lr", "batch_size": "global_batch_size",
            "micro_batch": "micro_batch_size", "max_steps": "steps", "iters": "steps",
            "max_iters": "steps", "gradient_accumulation_steps": "grad_accum_steps",
            "accumulation_steps": "grad_accum_steps", "max_grad_norm": "grad_clip", "clip_grad": "grad_clip",
            "warmup": "warmup_steps", "warmup_iters": "warmup_steps", "dtype": "precision",
            "mixed_precision": "precision", "optim": "optimizer", "wd": "weight_decay"}


def _did_you_mean(key: str, prefix: str, known: dict) -> str:
    if _ALIASES.get(key) in known:
        return f"; did you mean {prefix + _ALIASES[key]!r}?"
    lowered = {name.lower(): name for name in known}  # Train.LR, global_Batch_Size
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix + lowered[close[0]]!r}?"
    alias = difflib.get_close_matches(key, list(_ALIASES), n=1, cutoff=0.75)
    if alias and _ALIASES[alias[0]] in known:
        return f"; did you mean {prefix + _ALIASES[alias[0]]!r}?"
    elsewhere = [f"{section}.{key}" for section, cls in _SECTIONS.items() if key in section_fields(cls)]
    if elsewhere:
        return f"; did you mean {elsewhere[0]!r}?"
    return f" (known keys here: {', '.join(sorted(known))})"


def _closest(value: str, options: list[str]) -> str:
    """``; did you mean 'ring'?`` for the option closest to ``value``, case ignored (``RING``), or ''."""
    lowered = {option.lower(): option for option in options}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.5)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


_SECTIONS = {name: typing.get_type_hints(RunConfig)[name] for name in section_fields(RunConfig)
             if dataclasses.is_dataclass(typing.get_type_hints(RunConfig)[name])}


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that ``load_config`` reads back to an equal config.

    Written by ``tomli_w``, so any key or value the config holds is quoted and escaped as
    TOML needs (``task.model_args`` may have keys with spaces, dots or quotes). For people
    to read, each section is one ``[section]`` with its fields in the schema's order, and
    a dict-valued field follows as its own ``[section.field]`` table. TOML has no null: a
    field that is None is written as the comment ``# key: none``, and reads back as its
    default, which for every optional field is None (``tests/test_config_roundtrip.py``).
    """
    data = to_dict(cfg)
    top = {key: value for key, value in data.items() if key not in _SECTIONS and value is not None}
    parts = [tomli_w.dumps(top)] if top else []
    parts += [_toml_section(name, values) for name, values in data.items() if name in _SECTIONS]
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def _toml_section(name: str, values: dict[str, Any]) -> str:
    """``[name]``, its fields in order (None as a comment), then its dict-valued fields as sub-tables."""
    lines = [tomli_w.dumps({name: {}}).rstrip("\n")]  # the header, quoted by tomli_w if it must be
    for key, value in values.items():
        if value is None:
            lines.append(f"# {key}: none")
        elif not isinstance(value, dict):
            lines.append(tomli_w.dumps({key: value}).rstrip("\n"))
    tables = {key: value for key, value in values.items() if isinstance(value, dict)}
    if tables:
        lines += ["", tomli_w.dumps({name: tables}).rstrip("\n")]
    return "\n".join(lines)


def identity(cfg: RunConfig) -> dict[str, Any]:
    """The fields that decide what each step computes, flattened to dotted keys.

    A checkpoint may be resumed only by a config with the same identity; fields in
    ``schema.NOT_IDENTITY`` (step count, logging, micro-batch split, DDP tuning) may change,
    and so may the fields this run does not read (:func:`unused_fields`: ``[gpt]`` for the
    classifier, the built-in model's shape under ``task.model``), which are left out.
    Fields in ``schema.ADDED_LATER`` are left out while they hold their default, so that
    checkpoints written before they existed keep their identity.
    """
    return normalize_identity(_flat_identity(cfg))


def normalize_identity(flat: dict[str, Any]) -> dict[str, Any]:
    """An identity (a checkpoint's stored one, too) as :func:`identity` computes it now.

    Checkpoints written before unused fields were left out stored them; leaving them out
    of the stored identity as well (``verify_checkpoint``) lets those checkpoints resume.
    """
    defaults = _flat_identity(RunConfig())
    unused = unused_fields(flat)
    return {k: v for k, v in flat.items()
            if k not in unused and not (k.startswith(ADDED_LATER) and v == defaults.get(k))}


# Which fields the run's data and model read (tasks/__init__.py, tasks/user.py): the built-in GPT's and
# MLP's shapes, the built-in tasks' data. Leaving one out of the identity lets it change between a
# checkpoint and its resumption, so a field is listed here only where no code path reads it.
_GPT_SHAPE = ("gpt.n_layer", "gpt.n_head", "gpt.n_embd", "gpt.dropout")
_GPT = (*_GPT_SHAPE, "gpt.block_size", "gpt.vocab_size", "gpt.corpus_bytes", "gpt.val_fraction")
_CLASSIFIER = ("classifier.features", "classifier.classes", "classifier.hidden", "classifier.depth",
               "classifier.samples", "classifier.noise")


def unused_fields(flat: dict[str, Any]) -> set[str]:
    """The dotted fields of an identity (or of a whole flattened config) that the run it describes never reads."""
    defaults = _flat_identity(RunConfig())
    name, source, model, hf = (flat.get(k, defaults[k]) for k in ("task.name", "data.source", "task.model",
                                                                   "hf.path"))
    own_model = bool(model or hf)
    builtin_gpt = not own_model and (source in ("tokens", "text", "hf") or name == "chargpt")
    builtin_mlp = not own_model and name == "classifier" and source in ("task", "factory")
    unused = set() if model and not hf else {"task.model_args"}
    if name == "classifier" and source == "task" or source == "factory" and not builtin_gpt:
        unused |= set(_GPT)
    elif not builtin_gpt:
        unused |= set(_GPT_SHAPE)
    if not (source == "task" and name == "chargpt"):
        unused |= {"gpt.corpus_bytes", "gpt.val_fraction"}
    if not (name == "classifier" and source == "task"):
        unused |= {"classifier.samples", "classifier.noise"}
        if not builtin_mlp:
            unused |= {"classifier.features", "classifier.classes"}
    if not builtin_mlp:
        unused |= {"classifier.hidden", "classifier.depth"}
    return unused


def shown(value: Any, text=repr, limit: int = 80) -> str:
    """``value`` for a message: its repr (or ``text(value)``), cut to about ``limit`` characters."""
    out = text(value)
    return out if len(out) <= limit else f"{out[:limit]}... ({len(out):,} characters)"


def unused_settings(cfg: RunConfig) -> str | None:
    """One line naming the fields set away from their defaults that this run never reads; None if there are none."""
    flat, defaults = _flat_identity(cfg), _flat_identity(RunConfig())
    unused = unused_fields(flat)
    settings = [f"{k}={shown(v, json.dumps)}" for k, v in flat.items() if k in unused and v != defaults[k]]
    if not settings:
        return None
    why = ("hf.path builds the model" if cfg.hf.path else f"task.model {cfg.task.model!r} builds the model from "
           "task.model_args" if cfg.task.model else f"the task is {cfg.task.name!r}")
    if cfg.data.source != "task":
        why += f" on data.source {cfg.data.source!r}"
    one = len(settings) == 1
    return (f"{', '.join(settings)} {'is' if one else 'are'} not used by this run ({why}), so "
            f"{'it changes' if one else 'they change'} nothing; remove {'it' if one else 'them'} from the config")


def _flat_identity(cfg: RunConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = prefix + key
            if dotted in NOT_IDENTITY:
                continue
            if isinstance(value, dict) and dotted in _SECTIONS:
                walk(value, dotted + ".")
            else:
                flat[dotted] = value

    walk(to_dict(cfg), "")
    return flat


def identity_hash(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
