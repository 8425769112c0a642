"""Hugging Face ``transformers`` causal language models from a directory on this machine.

A directory with a ``config.json`` is an architecture; with weights beside it
(``model.safetensors``, sharded safetensors with their index, or ``pytorch_model.bin``,
as ``save_pretrained`` writes them) it is a model to fine-tune. The class comes from the
config (``AutoModelForCausalLM``). The hub is never contacted: ``local_files_only``,
and ``HF_HUB_OFFLINE`` set for the process, so a missing file is an error here rather
than a download attempt (compute nodes often have no network, and this machine none).

Parameters are kept in fp32 whatever dtype the weights were saved in: mixed precision
is autocast's job (``train.precision``), with fp32 master weights. ``use_cache`` is
turned off: training does not reuse attention keys and values, and keeping them costs
memory; the export (:func:`save_pretrained_from`) restores the directory's own value, so
``generate()`` on the trained model keeps its KV cache. A transformer's decoder layers
are the first ``ModuleList`` of the model, which is what ZeRO-3 makes its units of by
default (``[zero] unit_classes``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

from dptrain.config import ConfigError
from dptrain.config.extras import require

__all__ = ["load_config", "causal_lm", "has_weights", "check_weights", "context_length", "save_pretrained_from",
           "load_weights_file", "token_id_problems", "ExportWarning"]

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    transformers = require("transformers", "hf.path (a Hugging Face model)")
    transformers.utils.logging.disable_progress_bar()
    return transformers


def has_weights(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in WEIGHTS)


def check_weights(path: str | Path) -> None:
    """A ConfigError naming the file unless each safetensors weights file in ``path`` has a header safetensors
    accepts (its size within the file, every tensor's bytes inside it): checked before launch, memory-mapped,
    where loading would otherwise fail in every worker after the run directory is written."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"hf.path {path}: {file.name} is not a readable safetensors file ({e}); it is "
                              "truncated or damaged: copy it again from where it was saved") from None


def load_config(path: str | Path):
    """The model directory's config, or a ConfigError saying what is wrong with the directory."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"hf.path {root} is not a directory: it must be a Hugging Face model directory (what "
                          "save_pretrained writes) on this machine; nothing is downloaded")
    if not (root / "config.json").is_file():
        raise ConfigError(f"hf.path {root} has no config.json: a Hugging Face model directory needs one (what "
                          "save_pretrained or config.save_pretrained writes)")
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, KeyError... for configs it cannot read
        raise ConfigError(f"hf.path {root}: config.json does not load ({type(e).__name__}: {e})") from None


def context_length(config) -> int:
    """The longest sequence the config's position embeddings take (0 if the config does not say)."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def causal_lm(path: str | Path, from_scratch: bool = False, weights: bool = True) -> nn.Module:
    """The directory's causal LM: its weights when it has them (unless ``from_scratch``), else freshly initialised.

    ``weights=False`` builds the architecture only, in torch's default dtype (planning, and checks
    on the meta device or under fake tensors, where the planner sets the dtype it plans for).
    """
    config = load_config(path)
    transformers = _transformers()
    config.use_cache = False
    try:
        if weights and not from_scratch and has_weights(path):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), config=config, local_files_only=True)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        raise ConfigError(f"hf.path {path}: {type(config).__name__} is not a causal language model transformers "
                          f"knows ({e}); dptrain trains AutoModelForCausalLM models") from None
    except OSError as e:  # a weights file that does not load
        raise ConfigError(f"hf.path {path}: the weights do not load ({e})") from None
    if weights and any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        model = model.float()  # fp32 master weights; autocast computes in bf16/fp16
    return model


class ExportWarning(UserWarning):
    """Something about an exported model its user should know (token ids outside the vocabulary)."""


def save_pretrained_from(weights: str | Path, path: str | Path, out: str | Path, tokenizer: str | None = None) -> Path:
    """A ``from_pretrained``-ready directory at ``out``: ``path``'s architecture with the trained ``weights``.

    ``weights`` is the run's ``model.safetensors`` (the model's state dict, tied weights
    under each name; a file with one name per tied weight, as dptrain wrote them before,
    loads too): the model is rebuilt from ``path``'s config, the weights loaded strictly up
    to tied names (:func:`load_weights_file`), what training changed in the config put back
    (``use_cache``, turned off by :func:`causal_lm`; the generation config: ``path``'s own
    ``generation_config.json``, else the one its config implies), and the directory written
    with ``save_pretrained`` (config, safetensors, generation config; Hugging Face's rule
    for tied weights: the copies in ``_tied_weights_keys`` are left out and
    ``from_pretrained`` ties them back), plus ``tokenizer`` (a tokenizer.json) when the data
    was tokenized with one. Written beside ``out`` and renamed into place: never
    half-written. A bos or eos token id outside the vocabulary is an :class:`ExportWarning`.
    """
    import shutil

    from dptrain.utils.atomic import replacing_dir

    original = load_config(path)
    model = causal_lm(path, weights=False)
    load_weights_file(model, weights, f"{path}'s architecture")
    _restore_inference_settings(model, original, Path(path))
    for problem in token_id_problems(model.config, getattr(model, "generation_config", None), Path(path)):
        warnings.warn(problem, ExportWarning, stacklevel=2)
    out = Path(out)
    with replacing_dir(out, replace=True) as staging:
        model.save_pretrained(str(staging), safe_serialization=True)
        if tokenizer and tokenizer != "bytes":
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
    return out


def load_weights_file(model: nn.Module, weights: str | Path, what: str = "the model") -> None:
    """Load a safetensors state dict into ``model``, strictly except for tied names the file holds under another name.

    Raises a ValueError naming the missing and unexpected keys.
    """
    from safetensors.torch import load_file

    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[name]) for name in state if name in params}
    missing = [name for name in missing if not (name in params and id(params[name]) in loaded)]  # tied: loaded
    if missing or unexpected:
        raise ValueError(f"{weights} does not match {what}: missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}")


def _restore_inference_settings(model: nn.Module, original, path: Path) -> None:
    """Put back what :func:`causal_lm` changed for training: ``use_cache``, and the generation config."""
    if hasattr(original, "use_cache"):
        model.config.use_cache = original.use_cache
    if getattr(model, "generation_config", None) is None:
        return  # a model that does not generate
    transformers = _transformers()
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(path), local_files_only=True)
    else:  # what from_pretrained derives from the config, from the config as the directory has it
        model.generation_config = transformers.GenerationConfig.from_model_config(original)


def token_id_problems(config, generation_config=None, path: Path | None = None) -> list[str]:
    """The bos and eos token ids of ``config`` (and ``generation_config``) outside ``[0, vocab_size)``, as sentences."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return []
    where = f"{path / 'config.json'} (and generation_config.json, if any)" if path is not None else "the config"
    effect = {"bos_token_id": "generate() without a prompt starts from it, and the embedding has no row for it",
              "eos_token_id": "the model can never produce it, so generate() never stops before max_length"}
    problems = []
    for source in (config, generation_config):
        for name, why in effect.items():
            value = getattr(source, name, None) if source is not None else None
            ids = list(value) if isinstance(value, (list, tuple)) else [value]
            bad = [i for i in ids if isinstance(i, int) and not 0 <= i < vocab]
            if bad:
                problems.append(f"{name} {value} lies outside the vocabulary (vocab_size {vocab}): {why}. Set it "
                                f"in {where} to an id below {vocab}, the tokenizer's id for that token")
    return list(dict.fromkeys(problems))
