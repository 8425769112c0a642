"""The command line on CUDA: ``dptrain run --nproc 1``, checkpoints across devices, ``dptrain launch`` (issue 39).

One rank on one GPU (tests/_gpu.py). A run's numbers are not compared with torch here:
the engine's parity with torch's DDP is tests/test_gpu.py's; these check that the runner,
the checkpoint files and the launcher work on CUDA with NCCL. Several ranks over NCCL
need several GPUs and are not exercised. Skipped without CUDA;
``DPTRAIN_GPU_CHECK_DRY=1`` runs them on the CPU with gloo.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _cli import TINY_GPT_SETTINGS, dptrain
from _gpu import BACKEND, DEVICE_TYPE, DRY, needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]

OTHER = "gloo" if BACKEND == "nccl" else BACKEND  # the CPU leg of a cross-device resume
QUICK = ["log.progress=lines", "log.plots=false", "log.eval_every=0", "log.every=1"]


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _run(tmp_path: Path, run_dir: str, settings: list[str], backend: str = BACKEND) -> dict:
    """``dptrain run --nproc 1`` with ``distributed.backend`` named (nccl: fail rather than fall back to gloo); its summary."""
    proc = dptrain("run", "--nproc", "1", *_sets([*QUICK, f"distributed.backend={backend}", *settings]), "--run-dir",
                   str(tmp_path / run_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / run_dir / "summary.json").read_text())


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


@pytest.mark.parametrize("settings", [[], ["distributed.strategy=zero3"], ["train.precision=bf16"]],
                         ids=["default", "zero3", "bf16"])
def test_dptrain_run_nproc_1_trains_on_the_device(tmp_path: Path, settings: list[str]) -> None:
    """The default task (the character GPT; its tiny sizes in the dry run), 20 steps."""
    size = TINY_GPT_SETTINGS if DRY else []
    summary = _run(tmp_path, "run", [*size, "train.steps=20", "checkpoint.every=0", *settings])
    assert (summary["device"], summary["backend"]) == (DEVICE_TYPE, BACKEND), summary
    losses = [loss for _, loss in _losses(tmp_path / "run")]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu_and_back(tmp_path: Path) -> None:
    """6 steps straight on the device; 3 on the device resumed to 6 on the CPU (gloo); 3 on the CPU resumed to 6
    on the device. The losses agree with the straight run's to the devices' rounding (exactly in the dry run)."""
    common = ["task.name=classifier", "checkpoint.every=3"]
    _run(tmp_path, "straight", [*common, "train.steps=6"])
    for name, first, second in (("gpu_then_cpu", BACKEND, OTHER), ("cpu_then_gpu", OTHER, BACKEND)):
        _run(tmp_path, name, [*common, "train.steps=3"], backend=first)
        summary = _run(tmp_path, name, [*common, "train.steps=6"], backend=second)
        assert summary["start_step"] == 3 and summary["backend"] == second, summary
        want, got = _losses(tmp_path / "straight"), _losses(tmp_path / name)
        assert [s for s, _ in got] == [s for s, _ in want] and len(got) == 6, (want, got)
        for (_, a), (_, b) in zip(want, got, strict=True):
            assert math.isclose(a, b, rel_tol=0 if DRY else 1e-3), (name, want, got)


# A plain torch DDP script, as users write it: env:// rendezvous from torchrun's variables, the GPU by LOCAL_RANK.
PLAIN_CUDA_DDP = textwrap.dedent('''
    import os
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = os.environ.get("DPTRAIN_GPU_CHECK_DRY") != "1"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for step in range(3):
        loss = model(torch.randn(8, 4, generator=data).to(device)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
    torch.save({"backend": dist.get_backend(), "device": model.module.weight.device.type,
                "weight": model.module.weight.detach().cpu()}, os.path.join(os.environ["DPTRAIN_RUN_DIR"], "out.pt"))
    dist.destroy_process_group()
''')


def _reference_weight() -> torch.Tensor:
    """The script's training without DDP, on the CPU: one rank's mean is its own gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        loss = model(torch.randn(8, 4, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.weight.detach()


@pytest.mark.slow  # torchrun's fresh interpreters
@pytest.mark.timeout(150)
def test_dptrain_launch_runs_a_plain_cuda_ddp_script(tmp_path: Path) -> None:
    """``dptrain launch --nproc 1 train.py``: torch's own DDP on the GPU with NCCL; its weights against the same
    training without DDP."""
    (tmp_path / "train.py").write_text(PLAIN_CUDA_DDP)
    proc = subprocess.run([sys.executable, "-m", "dptrain.cli", "launch", "--nproc", "1", "--run-dir", "run",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = torch.load(tmp_path / "run" / "out.pt")
    assert (out["backend"], out["device"]) == (BACKEND, DEVICE_TYPE), out
    torch.testing.assert_close(out["weight"], _reference_weight(), rtol=1e-5, atol=1e-6)
