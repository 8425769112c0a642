"""A calibration round's probes in one job (dptrain.tune.probe_runs): each run whole, each in a group of its own."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from _cli import TINY_GPT_SETTINGS
from _tune_machine import TestMachine
from dptrain.tune.trials import read_steps, trial_overrides, write_config


def test_a_probe_job_runs_each_probe_whole_in_a_process_group_of_its_own(tmp_path, monkeypatch) -> None:
    from dptrain.tune import probe_runs

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    groups = []
    real = probe_runs.init_distributed

    def init(env, backend, timeout_s, store=None):
        assert not dist.is_initialized()  # the previous run's group was destroyed first
        device = real(env, backend, timeout_s, store=store)
        groups.append(dist.group.WORLD)
        return device

    answers, judged = iter([True, False, True]), []

    def unsettled(runs, rounds):  # rank 0's judgement, in the plan's order: ddp unsettled twice, zero3 settled
        judged.append((len(runs), rounds))
        return next(answers)

    monkeypatch.setattr(probe_runs, "init_distributed", init)
    monkeypatch.setattr(probe_runs, "unsettled", unsettled)
    plan, dirs = [], {}
    for strategy in ("ddp", "zero3"):
        overrides = [*TINY_GPT_SETTINGS, "train.global_batch_size=2", f'distributed.strategy="{strategy}"',
                     *trial_overrides(3)]
        dirs[strategy] = [tmp_path / f"{strategy}-r{r}" for r in range(3)]
        configs = [write_config(d / "config.toml", None, overrides) for d in dirs[strategy]]
        plan.append({"config": str(configs[0]), "run_dir": str(dirs[strategy][0] / "run"), "warmup": 1,
                     "again": [{"config": str(c), "run_dir": str(d / "run")}
                               for c, d in zip(configs[1:], dirs[strategy][1:], strict=True)]})
    (tmp_path / "plan.json").write_text(json.dumps(plan))

    assert probe_runs.main([str(tmp_path / "plan.json")]) == 0
    assert not dist.is_initialized()
    # both run, then the unsettled one again, twice (its runs left), each in a group of its own
    assert judged == [(1, 1), (1, 1), (2, 1)] and len(groups) == 4 and len({id(g) for g in groups}) == 4
    for d in [*dirs["ddp"], dirs["zero3"][0]]:  # each run logged its steps after the warm-up, as a trial's are read
        assert read_steps(d / "run", 1).step_s > 0
    assert not any((d / "run").exists() for d in dirs["zero3"][1:])


def _fake(code: int, write) -> TestMachine:
    """A machine whose job writes what ``write(plan)`` makes of the plan and exits with ``code``."""

    def run(args):
        write(json.loads(Path(args[-1]).read_text()))
        return code, "Traceback ...\nRuntimeError: the second probe broke"

    return TestMachine(run)


def _metrics(run_dir: str, steps: int) -> None:
    Path(run_dir).mkdir(parents=True)
    Path(run_dir, "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s, "step_ms": 10.0}) + "\n" for s in range(1, steps + 1)))


def test_a_failed_probe_job_names_the_probe_it_stopped_in_and_a_hung_one_its_time(tmp_path) -> None:
    import pytest

    from dptrain.tune.probe_runs import run_probes
    from dptrain.tune.search import TrialFailed

    probes = [(tmp_path / f"probe{i}", None, [*TINY_GPT_SETTINGS]) for i in range(3)]
    def weights(run_dir: str) -> None:
        Path(run_dir, "model.safetensors").write_bytes(b"weights")

    broke = _fake(1, lambda plan: (_metrics(plan[0]["run_dir"], 5), _metrics(plan[1]["run_dir"], 3),
                                   weights(plan[0]["run_dir"]), weights(plan[1]["run_dir"])))
    with pytest.raises(TrialFailed, match=r"stopped in .*probe1.*exit 1: RuntimeError: the second probe broke"):
        run_probes(broke, probes, 5, 2, 60)
    # the finished run pruned as a measured one is; the one it stopped in left whole, to be looked at
    assert not (tmp_path / "probe0" / "run" / "model.safetensors").exists()
    assert (tmp_path / "probe0" / "run" / "metrics.jsonl").exists()
    assert (tmp_path / "probe1" / "run" / "model.safetensors").exists()
    hung = _fake(124, lambda plan: None)
    with pytest.raises(TrialFailed, match=r"stopped in .*again0.*after 180 s \(60 s for each of the 3 runs"):
        run_probes(hung, [(tmp_path / f"again{i}", None, []) for i in range(3)], 5, 2, 60)
    done = _fake(0, lambda plan: [_metrics(p["run_dir"], 5) for p in plan])
    assert [[m.step_s for m in runs] for runs in run_probes(done, [(tmp_path / f"ok{i}", None, []) for i in range(2)],
                                                            5, 2, 60)] == [[0.01], [0.01]]
    # a probe run again in the job: each of its runs read, in order (its later directories named on from -r0)
    again = _fake(0, lambda plan: [_metrics(r, 5) for r in (plan[0]["run_dir"], plan[0]["again"][0]["run_dir"])])
    runs = run_probes(again, [(tmp_path / "twice-r0", None, [])], 5, 2, 60, again=2)
    assert [len(r) for r in runs] == [2] and (tmp_path / "twice-r1" / "run").is_dir()
    assert not (tmp_path / "twice-r2" / "run").exists()


def test_a_probe_plan_that_cannot_run_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys) -> None:
    from dptrain.tune import probe_runs

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = write_config(tmp_path / "config.toml", None, [*TINY_GPT_SETTINGS])
    bad = tmp_path / "config_bad.toml"
    bad.write_text(config.read_text().replace("[train]", "[train]\nsteps = -3", 1))
    for plan in ([], [{"config": str(bad), "run_dir": str(tmp_path / "run")}], {"config": "x"}):
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        assert probe_runs.main([str(tmp_path / "plan.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_leaving_the_process_groups_stops_the_progress_threads_and_lets_their_groups_go() -> None:
    import gc
    import threading
    import weakref

    from dptrain.comm.progress import progress_thread, stop_progress_threads

    class Group:  # what the registry keys a thread by: the group object
        pass

    group = Group()
    thread = progress_thread(group)
    name = f"dptrain-comm-{id(group):x}"
    assert progress_thread(group) is thread and any(t.name == name for t in threading.enumerate())
    ref = weakref.ref(group)
    stop_progress_threads()
    del group
    gc.collect()
    assert ref() is None  # the registry no longer holds it
    for t in threading.enumerate():
        if t.name == name:
            t.join(timeout=5)
            assert not t.is_alive()


def test_rank_0_answers_which_probes_run_again_and_leaves_only_after_every_rank_has_read_it(tmp_path) -> None:
    import threading
    import time

    from dptrain.tune.probe_runs import _again, _Probe

    _metrics(str(tmp_path / "run"), 6)  # a steady run: nothing to run again
    plans, done = [_Probe(None, [None], 2)], [[tmp_path / "run"]]
    store = dist.HashStore()
    answers, asked, answered = {}, {}, {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        asked[r] = time.perf_counter()
        answers[r] = _again(store, r, 3, 1, [0], plans, done)
        answered[r] = time.perf_counter()

    late = [threading.Thread(target=rank, args=(r, 0.3 * r)) for r in (1, 2)]
    for t in late:
        t.start()
    rank(0, 0.0)  # [Note: rank 0 leaves last]: it serves the store where torchrun's agents do not
    for t in late:
        t.join()
    assert answers == {0: [], 1: [], 2: []}
    assert answered[0] > asked[2]  # not before the last rank had even asked (without the wait: 0.6 s before)
