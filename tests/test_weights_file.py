"""One rule for the weights file, whatever the strategy: ``model.safetensors`` holds the model's state dict.

Every key of ``model.state_dict()``, a tied parameter under each of its names
(:mod:`dptrain.utils.weights_file`), so ``model.load_state_dict(load_file(path))`` loads it
with ``strict=True``. Issue 46: the built-in GPT ties ``wte`` and ``lm_head``; ddp wrote
``lm_head.weight`` only (safetensors' ``save_model`` keeps the alphabetically first name),
zero2 ``wte.weight`` only, and ``dptrain consolidate`` both, so none of the run's files
loaded strictly and the two outputs disagreed. Here the tiny GPT trains 2 steps under ddp,
zero2 and zero3 on 2 workers, and each run's final checkpoint is consolidated.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from _cli import TINY_GPT_SETTINGS, dptrain, tiny_gpt_config
from dptrain.cli.checkpoint import consolidate
from dptrain.models.gpt import GPT


def _fresh_gpt() -> GPT:  # TINY_GPT_SETTINGS' model, as the chargpt task builds it
    return GPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.timeout(240)
def test_every_strategy_and_consolidate_write_the_models_state_dict_that_loads_strictly(tmp_path):
    config = str(tiny_gpt_config(tmp_path))
    settings = [arg for setting in TINY_GPT_SETTINGS for arg in ("--set", setting)]
    files = {}
    for strategy in ("ddp", "zero2", "zero3"):
        run = tmp_path / strategy
        proc = dptrain("run", "--nproc", "2", "--config", config, *settings, "--set", "train.steps=2",
                       "--set", "checkpoint.every=2", "--set", "log.eval_every=0", "--set",
                       f'distributed.strategy="{strategy}"', "--run-dir", str(run), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        files[strategy] = load_file(run / "model.safetensors")
        result = CliRunner().invoke(consolidate, [str(run), "-o", str(tmp_path / f"{strategy}.safetensors")])
        assert result.exit_code == 0, result.output
        files[f"{strategy} consolidated"] = load_file(tmp_path / f"{strategy}.safetensors")

    names = set(_fresh_gpt().state_dict())
    assert {"wte.weight", "lm_head.weight"} <= names
    for which, weights in files.items():
        assert set(weights) == names, (which, set(weights) ^ names)
        assert torch.equal(weights["wte.weight"], weights["lm_head.weight"]), which
        model = _fresh_gpt()
        model.load_state_dict(weights, strict=True)
        assert model.wte.weight is model.lm_head.weight  # still tied: both names loaded into one parameter
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, weights[name]), (which, name)
    for strategy in ("ddp", "zero2", "zero3"):  # the last checkpoint holds the final weights
        for name, tensor in files[strategy].items():
            assert torch.equal(tensor, files[f"{strategy} consolidated"][name]), (strategy, name)
