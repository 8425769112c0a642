"""The Hugging Face export (``hf/``): the model's own inference settings, and a word on impossible token ids.

Issue 46: ``causal_lm`` turns ``use_cache`` off for training, and the export wrote that to
``hf/config.json`` (and to ``generation_config.json``), so ``generate()`` on the trained
model ran without a KV cache; a bos or eos id outside the vocabulary passed in silence;
and a run's ``model.safetensors`` that holds both names of a tied weight (the rule of
tests/test_weights_file.py) did not load. A tiny GPT-2 directory, no run, nothing downloaded.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dptrain.models.hf import ExportWarning, causal_lm, save_pretrained_from  # noqa: E402
from dptrain.runner.outputs import save_weights  # noqa: E402


def _gpt2_dir(root, name, **config):
    kwargs = dict(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1)
    transformers.GPT2Config(**{**kwargs, **config}).save_pretrained(root / name)
    return root / name


def _trained_weights(path, out):
    """The architecture at ``path`` with changed weights, written as a run writes ``model.safetensors``."""
    model = causal_lm(path, weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_weights(model, out)
    return model


def _export(weights, path, out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_pretrained_from(weights, path, out)
    return [str(w.message) for w in caught if issubclass(w.category, ExportWarning)]


def test_the_export_keeps_the_kv_cache_and_the_trained_tied_weights(tmp_path):
    path = _gpt2_dir(tmp_path, "gpt2")
    trained = _trained_weights(path, tmp_path / "model.safetensors")
    assert trained.config.use_cache is False  # off for training
    assert _export(tmp_path / "model.safetensors", path, tmp_path / "hf") == []
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True  # the directory's own
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()).get("use_cache", True) is True
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.use_cache and model.transformer.wte.weight is model.lm_head.weight
    for name, tensor in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    out = model.generate(torch.tensor([[2, 3]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=1)
    assert out.past_key_values is not None  # generated with the KV cache

    # a directory that turned the cache off keeps it off; weights saved with one name per tied tensor still load
    off = _gpt2_dir(tmp_path, "gpt2-no-cache", use_cache=False)
    from safetensors.torch import save_model
    save_model(trained, str(tmp_path / "one_name.safetensors"))
    assert _export(tmp_path / "one_name.safetensors", off, tmp_path / "hf-off") == []
    assert json.loads((tmp_path / "hf-off" / "config.json").read_text())["use_cache"] is False


def test_bos_and_eos_ids_outside_the_vocabulary_are_named_at_export(tmp_path):
    path = _gpt2_dir(tmp_path, "gpt2", bos_token_id=50256, eos_token_id=[1, 50256])  # GPT-2's, on 64 ids
    _trained_weights(path, tmp_path / "model.safetensors")
    problems = _export(tmp_path / "model.safetensors", path, tmp_path / "hf")
    assert len(problems) == 2, problems
    assert problems[0].startswith("bos_token_id 50256 lies outside the vocabulary (vocab_size 64)")
    assert problems[1].startswith("eos_token_id [1, 50256] lies outside the vocabulary (vocab_size 64): the model "
                                  "can never produce it")
    assert f"Set it in {path / 'config.json'}" in problems[1] and "an id below 64" in problems[1]


def test_a_run_logs_what_the_export_warns_of(tmp_path):
    from types import SimpleNamespace

    from dptrain.runner.outputs import save_hf_model

    path = _gpt2_dir(tmp_path, "gpt2", eos_token_id=64)
    _trained_weights(path, tmp_path / "model.safetensors")
    lines = []
    cfg = SimpleNamespace(hf=SimpleNamespace(path=str(path)), data=SimpleNamespace(source="tokens", dir=str(tmp_path),
                                                                                  tokenizer=None))
    save_hf_model(cfg, tmp_path, SimpleNamespace(info=lines.append))
    assert lines[0].startswith("warning: eos_token_id 64 lies outside the vocabulary (vocab_size 64)"), lines
    assert lines[1].startswith("Hugging Face model: ") and (tmp_path / "hf" / "config.json").is_file()
