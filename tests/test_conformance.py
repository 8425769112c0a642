"""The conformance matrix (tests/_matrix.py): every registered strategy on every surface, with every model kind.

One test per strategy and surface; each runs all of that surface's model kinds in the same
processes (two ranks: a rank costs milliseconds from the fork server, a model kind a few
hundred) and checks every obligation of every cell, so that a failure lists each cell and
obligation that failed at once. A new registry entry joins by being registered.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import dptrain as dp
from _cli import TINY_GPT_SETTINGS, dptrain
from _matrix import MODEL_KINDS, OBLIGATIONS, SURFACES, build, dataset, loss_of, refusal, strategies
from dptrain.testing import run_on_ranks

pytest.importorskip("transformers")

STEPS_PER_EPOCH, EPOCHS = 4, 3  # 64 samples, batch 4 per rank, 2 ranks, 2 micro-steps per optimizer step


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def _same_on_every_rank(value: str) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len(set(values)) == 1


def _bare_loss(kind: str, state: dict | None) -> float:
    """The loss over the whole data set of a fresh model holding ``state`` (or its initial weights), in eval mode."""
    model = build(kind)
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    x, y = dataset(kind).tensors
    with torch.no_grad():
        return float(loss_of(kind, model, x, y))


def _check(results: dict, name: str, ok: bool, detail: str = "") -> None:
    results[name] = (bool(ok), detail)


def _common(kind: str, handle, module, bare_keys: list[str], results: dict) -> dict:
    """The obligations both user APIs share, after training: ``handle`` is what the user holds."""
    full = dp.get_state_dict(handle)
    dp.set_state_dict(handle, full)  # loads back: the same state
    _check(results, "full state", list(full) == bare_keys and _digest(dp.get_state_dict(handle)) == _digest(full),
           f"keys {list(full)[:3]} vs {bare_keys[:3]}, or set_state_dict did not give it back")
    _check(results, "trains", _bare_loss(kind, full) < _bare_loss(kind, None) - 0.05,
           f"{_bare_loss(kind, None):.3f} -> {_bare_loss(kind, full):.3f}")
    try:  # the usual way: rank 0 saves model.module.state_dict()
        own = module.state_dict()
        usual = list(own) == bare_keys and _digest(own) == _digest(full)
        detail = f"model.module.state_dict() has {len(own)} keys, differs from the full state"
    except RuntimeError as e:
        usual, detail = "dptrain.get_state_dict" in str(e) and "\n" not in str(e), str(e)
    if dist.get_rank() == 0:
        _check(results, "usual save", usual, detail)
    _check(results, "same weights", _same_on_every_rank(_digest(full)), "get_state_dict differs between ranks")
    counted = sum(p.numel() for p in module.parameters())
    _check(results, "module", counted == sum(p.numel() for p in build(kind).parameters())
           and next(module.parameters()).device.type == "cpu", f"{counted} parameters visible")
    if kind == "hf":
        _check(results, "module", module.num_parameters() == build(kind).num_parameters()
               and module.dtype == torch.float32 and module.device.type == "cpu",
               "transformers' num_parameters(), dtype or device")
    return full


def _evaluates(kind: str, model, full: dict, results: dict) -> None:
    """A forward without gradients through the surface's model equals the exported weights' loss."""
    x, y = dataset(kind).tensors
    model.eval()
    with torch.no_grad():
        got = float(loss_of(kind, model, x, y))
    model.train()
    want = _bare_loss(kind, full)
    _check(results, "evaluates", abs(got - want) <= 1e-4 * max(1.0, abs(want)), f"{got:.6f} vs {want:.6f}")


def _prepare_cell(strategy: str, kind: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    results: dict = {}
    bare = build(kind)
    bare_keys = list(bare.state_dict())
    loader = torch.utils.data.DataLoader(dataset(kind), batch_size=4, shuffle=True)
    model, optimizer, loader = dp.prepare(bare, torch.optim.AdamW(bare.parameters(), lr=1e-2), loader,
                                          strategy=strategy, grad_accum_steps=2)
    for _ in range(EPOCHS):
        for x, y in loader:
            loss_of(kind, model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    dp.end_training(model)
    full = _common(kind, model, model.module, bare_keys, results)
    _evaluates(kind, model, full, results)
    theirs = get_model_state_dict(model)
    helpers = isinstance(model, torch.nn.parallel.DistributedDataParallel) and list(theirs) == bare_keys \
        and _digest(theirs) == _digest(full)
    set_model_state_dict(model, build(kind).state_dict())  # torch's helper loads the bare model's keys
    helpers = helpers and _digest(dp.get_state_dict(model)) == _digest(build(kind).state_dict())
    _check(results, "torch helpers", helpers, f"isinstance DDP {isinstance(model, torch.nn.parallel.DistributedDataParallel)}, keys {list(theirs)[:2]}")
    # resume: the full state saved by both ranks loads into the same strategy on one rank (and on two again)
    alone = dist.new_group([0])
    again = build(kind)
    if dist.get_rank() == 0:
        one = dp.prepare(again, torch.optim.AdamW(again.parameters()), strategy=strategy, process_group=alone)[0]
        dp.set_state_dict(one, full)
        _check(results, "resume", _digest(dp.get_state_dict(one)) == _digest(full), "1 rank")
    dist.barrier()
    return results


def _engine_cell(strategy: str, kind: str) -> dict:
    results: dict = {}
    bare = build(kind)
    bare_keys = list(bare.state_dict())
    plan = dp.BatchPlan.resolve(dist.get_world_size(), global_batch_size=16, micro_batch_size=4)
    engine = dp.Engine(bare, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), plan, strategy=strategy)
    batches = engine.loader(dataset(kind)).micro_batches()
    for _ in range(STEPS_PER_EPOCH * EPOCHS):
        for x, y in engine.micro_steps(batches):
            engine.backward(loss_of(kind, engine.model, x, y))
        engine.step()
    dp.end_training(engine)
    _check(results, "module", dp.unwrap_model(engine) is bare, "unwrap_model(engine) is not the model")
    full = _common(kind, engine, bare, bare_keys, results)
    with engine.model.evaluating() as module:
        _evaluates(kind, module, full, results)
    return results


def _user_api(rank: int, world_size: int, strategy: str, surface: str) -> dict:
    cell = _prepare_cell if surface == "prepare" else _engine_cell
    out = {}
    for kind in MODEL_KINDS:
        out[kind] = cell(strategy, kind)
    return out


def _zero_hf(rank: int, world_size: int, stage: int) -> tuple:
    """A Hugging Face model under ZeRO asked what transformers asks (device, dtype, parameter count, train()/eval())
    after a step, and saved the usual way."""
    bare = build("hf")
    count = bare.num_parameters()
    model = dp.ZeRO(bare, stage=stage)
    x, _ = dataset("hf").tensors
    loss_of("hf", model, x[:4], None).backward()
    model.module.eval()
    model.module.train()
    try:
        saved = f"{len(model.module.state_dict())} keys"
    except RuntimeError as e:
        saved = str(e)
    return model.module.device.type, model.module.dtype, model.module.num_parameters() == count, saved


@pytest.mark.parametrize("stage", [1, 3])
def test_a_hugging_face_model_under_zero_answers_transformers_and_refuses_an_empty_save(stage: int) -> None:
    """transformers reads model.device (next(parameters())) in train() and generate(): under ZeRO the module had no
    parameters left (StopIteration), and its state_dict() was silently empty."""
    for device, dtype, same_count, saved in run_on_ranks(_zero_hf, 2, stage, timeout=90):
        assert (device, dtype, same_count) == ("cpu", torch.float32, True)
        assert "dptrain.get_state_dict(model) on every rank" in saved and "\n" not in saved, saved


def _refused(rank: int, world_size: int, strategy: str, surface: str) -> str:
    try:
        if surface == "prepare":
            dp.prepare(build("plain"), strategy=strategy)
        else:
            dp.Engine(build("plain"), lambda m: None, dp.BatchPlan.resolve(world_size, 8), strategy=strategy)
    except ValueError as e:
        return str(e)
    return ""


def _failures(by_kind: dict, surface: str, rank: int) -> list[str]:
    wanted = {name for name, (where, _) in OBLIGATIONS.items() if surface in where}
    bad = []
    for kind, results in by_kind.items():
        missing = wanted - set(results) - ({"resume", "usual save"} if rank else set())
        bad += [f"{kind}: {name} was not checked" for name in sorted(missing)]
        bad += [f"{kind}: {name}: {detail}" for name, (ok, detail) in results.items() if not ok]
    return bad


@pytest.mark.parametrize("surface", ["prepare", "Engine"])
@pytest.mark.parametrize("strategy", strategies())
def test_user_api_cells(strategy: str, surface: str) -> None:
    reason = refusal(strategy, surface)
    if reason is not None:  # refused before anything is built, in one line naming why
        for message in run_on_ranks(_refused, 2, strategy, surface, timeout=60):
            assert strategy in message and reason in message and "\n" not in message, message
        return
    results = run_on_ranks(_user_api, 2, strategy, surface, timeout=150)
    bad = _failures(results[0], surface, 0) + [f"rank 1: {b}" for b in _failures(results[1], surface, 1)]
    assert not bad, f"{strategy} via {SURFACES[surface]}:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------- dptrain run

RUN_KINDS = {  # the model kinds as dptrain run takes them; {root} is the test's shared directory
    "gpt": ["task.name=chargpt", *TINY_GPT_SETTINGS],
    "hf": ["hf.path={root}/gpt2", "data.source=text", 'data.text=["{root}/corpus.txt"]', "data.block_size=16",
           "data.dir={root}/text"],
    "plain": ["task.name=classifier", "task.model=_user_models:with_buffers", "classifier.samples=512"],
}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """A 2-layer, 48-wide GPT-2 and a small text corpus, shared by every strategy's runs."""
    import transformers

    root = tmp_path_factory.mktemp("conformance")
    transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=48, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0).save_pretrained(root / "gpt2")
    (root / "corpus.txt").write_text(Path(torch.__file__).with_name("functional.py").read_text()[:60_000])
    return root


def _run(root: Path, run_dir: Path, kind: str, strategy: str, nproc: int, steps: int):
    settings = [s.format(root=root) for s in RUN_KINDS[kind]]
    settings += [f"train.steps={steps}", "train.global_batch_size=12", "train.lr=1e-2", "train.warmup_steps=0", "checkpoint.every=0", "log.every=1", "log.eval_every=0",
                 "log.eval_batches=1", "log.plots=false", "log.progress=lines"]  # the last step checkpoints, evaluates
    return dptrain("run", "--nproc", str(nproc), "--strategy", strategy, "--run-dir", str(run_dir),
                   *[a for s in settings for a in ("--set", s)], cwd=root)


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def _run_cell(root: Path, run_dir: Path, kind: str, strategy: str, steps: int) -> list[str]:
    """One run of ``kind`` on two ranks; the failed obligations, each a line."""
    proc = _run(root, run_dir, kind, strategy, 2, steps)
    if proc.returncode != 0:
        return [f"{kind}: the run failed (exit {proc.returncode}): {proc.stderr[-800:]}"]
    bad = []
    train = _records(run_dir, "train")
    if not train[-1]["loss"] < train[0]["loss"]:
        bad.append(f"{kind}: trains: loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if not (summary.get("val_loss") is not None and torch.isfinite(torch.tensor(summary["val_loss"]))):
        bad.append(f"{kind}: evaluates: no final validation loss in summary.json")
    exported = load_file(run_dir / "model.safetensors")
    consolidated = run_dir / "consolidated.safetensors"
    done = dptrain("consolidate", str(run_dir), "-o", str(consolidated), cwd=root)
    if done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "model.safetensors" in done.stderr:
        pass  # refused in one line, saying why and where the weights are
    elif done.returncode != 0:
        bad.append(f"{kind}: exported: dptrain consolidate failed: {done.stderr[-300:]}")
    elif _digest(load_file(consolidated)) != _digest(exported) and "end of training:" not in proc.stdout:
        bad.append(f"{kind}: exported: model.safetensors differs from dptrain consolidate of the last checkpoint, "
                   "and the run did not say why")
    sent = sum(r["comm_bytes_per_step"] * (r["step"] - p["step"]) for p, r in zip([{"step": 0}, *train[:-1]], train, strict=True))
    if abs(summary["comm_bytes_per_step"] - sent / train[-1]["step"]) > 1e-6 * max(1.0, sent):
        bad.append(f"{kind}: report: {summary['comm_bytes_per_step']:.0f} bytes/step in the summary, the records "
                   f"sent {sent / train[-1]['step']:.0f} per step over the run")
    if summary.get("strategy") != strategy or not re.search(rf"^\s+strategy\s+{strategy}: ", proc.stdout, re.M):
        bad.append(f"{kind}: report: the summary does not name strategy {strategy}")
    return bad


def _resumes(root: Path, run_dir: Path, strategy: str) -> list[str]:
    """The gpt run continued on another number of ranks: it picks up where it stopped, or is refused before training
    in one line (exit 2). (On the same number, bit for bit: tests/test_strategy_resume.py, test_cli_run.py,
    test_localsgd_diloco_run.py, test_ps_restart.py, each strategy's own.)"""
    bad = []
    for nproc, steps in ((3, 8),):
        start = json.loads((run_dir / "summary.json").read_text())["steps"]
        proc = _run(root, run_dir, "gpt", strategy, nproc, steps)
        if proc.returncode == 2 and proc.stderr.strip().count("\n") == 0:
            continue  # refused, saying why
        summary = json.loads((run_dir / "summary.json").read_text())
        if proc.returncode != 0 or summary["start_step"] != start or summary["steps"] != steps:
            bad.append(f"gpt: resume on {nproc} ranks: exit {proc.returncode}, start {summary['start_step']} "
                       f"(expected {start}): {proc.stderr[-400:]}")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", strategies())
def test_run_cells(strategy: str, run_root: Path, tmp_path: Path) -> None:
    bad = []
    for kind in RUN_KINDS:
        bad += _run_cell(run_root, tmp_path / kind, kind, strategy, 6)
    bad += _resumes(run_root, tmp_path / "gpt", strategy)
    assert not bad, f"{strategy} via {SURFACES['run']}:\n  " + "\n  ".join(bad)
