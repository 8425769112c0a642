"""``dptrain consolidate``: one safetensors file of a checkpoint's full weights, written by one process.

A zero2 checkpoint saved on 2 ranks, and a ddp one, each with the ``meta.json`` a run
writes, are consolidated through the click command (``CliRunner``) and compared with the
model's full weights gathered by the ranks that saved them; the model is the tiny GPT,
whose tied output projection must come out under both its names. Paths that hold no
checkpoint exit 2 with what to give instead. Damaged checkpoints and crafted metadata:
tests/test_checkpoint_safety.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from _models import build, global_batch, loss_fn
from dptrain.checkpoint.files import save_checkpoint, staging_dir
from dptrain.checkpoint.replicated import replicated_state
from dptrain.cli.checkpoint import consolidate
from dptrain.optim.build import build_optimizer, decays
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO
from dptrain.zero.checkpoint import save_sharded

META = {"identity": {}, "identity_hash": "", "global_batch_size": 4}


def zero2_checkpoint(run_dir: Path, step: int = 2) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory's checkpoint ``step`` of ZeRO-2 on 2 ranks, as dptrain run writes it; (its path, full weights)."""
    staged = staging_dir(run_dir, step)
    gathered = run_on_ranks(_zero2_checkpoint, 2, str(staged), timeout=60)[0]
    return save_checkpoint(run_dir, step, {"trainer.pt": {"step": step}}, dict(META, format="sharded"),
                           staged=True), gathered


def _zero2_checkpoint(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    """Two AdamW steps of ZeRO-2, saved as dptrain run saves (``<staging dir>/sharded``); the full weights."""
    torch.manual_seed(0)
    model = ZeRO(build("gpt"), stage=2, bucket_cap_mb=0.001, split_by=decays)
    optimizer = build_optimizer(model, "adamw", 0.01, 0.1, (0.9, 0.95), 0.0)
    for step in range(2):
        x, y = global_batch("gpt", step, 2 * world_size)
        loss_fn("gpt", model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    save_sharded(Path(path) / "sharded", model, optimizer)
    return model.gathered_state()


def _consolidate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(consolidate, list(args))
    return result.exit_code, result.output


@pytest.mark.timeout(60)
def test_a_zero2_checkpoint_of_2_ranks_becomes_the_models_full_weights(tmp_path: Path) -> None:
    checkpoint, gathered = zero2_checkpoint(tmp_path / "run")
    out = tmp_path / "out" / "model.safetensors"
    code, output = _consolidate(str(checkpoint), "-o", str(out))
    assert code == 0, output
    reference = build("gpt")
    assert f"{out}: {len(reference.state_dict())} tensors" in output and str(checkpoint) in output
    weights = load_file(out)
    assert set(weights) == set(reference.state_dict())  # every name, lm_head.weight (tied to wte) included
    for name, tensor in gathered.items():
        assert torch.equal(weights[name], tensor), name
    assert torch.equal(weights["lm_head.weight"], gathered["wte.weight"])
    assert reference.load_state_dict(weights) is not None  # strict: loads as it is
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary left

    # the run directory names its newest checkpoint, sharded/ its checkpoint; --optimizer adds the state
    code, output = _consolidate(str(tmp_path / "run"), "-o", str(out), "--optimizer")
    assert code == 0, output
    state = load_file(out)
    for name, p in reference.named_parameters():
        assert state[f"optim.state.{name}.exp_avg"].shape == p.shape and state[f"optim.state.{name}.step"] == 2
    with safe_open(out, "pt") as f:
        groups = json.loads(f.metadata()["optim.param_groups"])
    assert groups["wte.weight.weight_decay"] == 0.1 and groups["ln_f.bias.weight_decay"] == 0.0
    code, _ = _consolidate(str(checkpoint / "sharded"), "-o", str(out))
    assert code == 0 and set(load_file(out)) == set(reference.state_dict())


def test_a_ddp_checkpoint_is_consolidated_too(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("gpt")
    optimizer = build_optimizer(model, "adamw", 0.01, 0.1, (0.9, 0.95), 0.0)
    x, y = global_batch("gpt", 0, 4)
    loss_fn("gpt", model(x), y).backward()
    optimizer.step()
    model_state, optim_state = replicated_state(model, optimizer)
    checkpoint = save_checkpoint(tmp_path, 1, {"model.pt": model_state, "optimizer.pt": optim_state,
                                               "trainer.pt": {"step": 1}}, META)
    code, output = _consolidate(str(checkpoint), "-o", str(tmp_path / "w.safetensors"), "--optimizer")
    assert code == 0, output
    weights = load_file(tmp_path / "w.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    assert torch.equal(weights["optim.state.wte.weight.exp_avg"], optimizer.state[model.wte.weight]["exp_avg"])


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "absent", "does not exist"),
    (lambda p: p, "is not a dptrain checkpoint: it has no model.pt (ddp), no sharded/ (zero1-3)"),
    (lambda p: (p / "sharded").mkdir() or p / "sharded", "has no meta.json, so it is incomplete"),
])
def test_a_path_that_is_no_checkpoint_exits_2_and_says_what_to_give(tmp_path: Path, make, message) -> None:
    code, output = _consolidate(str(make(tmp_path)), "-o", str(tmp_path / "w.safetensors"))
    assert code == 2 and message in output and output.startswith("error: "), output
    assert not (tmp_path / "w.safetensors").exists()
