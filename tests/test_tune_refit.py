"""refit: an earlier calibration's probe runs fitted again by today's simulator, nothing measured again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _tune_machine import TestMachine
from dptrain.comm.cost import Link
from dptrain.planner.network import Network
from dptrain.planner.simulate import ComputeProfile, Overheads
from dptrain.tune.calibrate import PROBE_MODELS, probe_bases, probe_timelines, refit


def _profile(i: int, micro: int) -> dict:
    return {str(micro): {"forward_s": 0.01 * (i + 1), "backward_s": 0.02 * (i + 1), "optimizer_s": 0.002,
                         "ready": {}, "source": "a test"}}


def test_refit_carries_the_measured_steps_and_fits_the_terms_again(tmp_path) -> None:
    link = Link(1e-4, 1e9)
    profiles = {i: _profile(i, micro) for i, (_, micro) in enumerate(PROBE_MODELS)}
    # the earlier calibration numbered its probe models the other way round: each profile is found by its model
    earlier_order = list(reversed(PROBE_MODELS))
    for j, (_, base, _, _) in enumerate(probe_bases(tmp_path / "calibration", 2, earlier_order)):
        base.with_name("profile.json").write_text(json.dumps(profiles[len(PROBE_MODELS) - 1 - j]))
    network = Network("test", link, link, 1, "a test", backend="gloo")
    runs = probe_timelines(probe_bases(tmp_path / "now", 2), 2, 1, network, lambda i, base, micro: ComputeProfile(
        **{**profiles[i][str(micro)], "ready": {}}))
    # an earlier calibration (another version) whose runs lacked the codec probes: each measured 2 ms over its timeline
    earlier = [{"label": label, "measured_s": t.step_s + 2e-3, "timeline_s": 0.0, "features": [1.0] * 7}
               for label, _, _, t in runs if "bf16" not in label]
    raw = {"version": 1, "where": "a test machine", "taken": "2026-12-01", "hosts": 2, "per_host": 1,
           "backend": "gloo", "shared_net": False, "inside": vars(link), "across": vars(link), "probes": earlier}
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    cal = refit(tmp_path / "calibration.json", tmp_path / "work", log=lambda line: None)
    assert [p.label for p in cal.probes] == [e["label"] for e in earlier]
    assert all(len(p.features) == len(Overheads.names()) for p in cal.probes)
    assert [p.measured_s for p in cal.probes] == [e["measured_s"] for e in earlier]
    assert cal.overheads.per_step_s == pytest.approx(2e-3) and sum(cal.overheads.terms()) == pytest.approx(2e-3)
    assert {"per_coded_bucket_s", "coded_s_per_byte"} <= set(cal.unidentified())  # no codec probe in those runs


def _fake_links_and_profiles(monkeypatch, calibrate_module) -> None:
    """The calibration's links faked (what its job wrote is fitted as one known link), and its compute profiles
    (:func:`_profile_job`): only its probe runs are the test's."""
    link = Link(1e-4, 1e9)
    monkeypatch.setattr(calibrate_module, "fit_probe", lambda probe, kinds: link)


PROFILE_JOBS: list[list[str]] = []


def _profile_job(args: list[str]) -> tuple[int, str]:
    """The one measuring job of a calibration, as a fake: its links' files written, every ``--probe OUT CONFIG
    MICROS`` given a profile."""
    assert args[:2] == ["-m", "dptrain.tune.calibration_job"], f"every other job of this test is a fake's: {args}"
    PROFILE_JOBS.append(args)
    for flag in ("--links", "--links-within"):
        if flag in args:
            Path(args[args.index(flag) + 1]).write_text("{}")
    probes = [args[i + 1:i + 4] for i, a in enumerate(args) if a == "--probe"]
    for out, config, micros in probes:
        assert Path(config).is_file()
        profile = {"forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.002, "ready": {}, "source": "a test"}
        Path(out).write_text(json.dumps({m: profile for m in micros.split(",")}))
    return 0, ""


@pytest.mark.parametrize("one_job", [True, False], ids=["a job per round", "a job per probe"])
def test_a_probe_whose_runs_disagree_runs_again_and_its_median_is_the_undisturbed_runs(tmp_path, monkeypatch,
                                                                                       one_job) -> None:
    import dptrain.tune.calibrate as calibrate_module
    from dptrain.tune.trials import Measured

    runs: dict[str, list[float]] = {}
    jobs: list[int] = []

    def trial(trial_dir):
        label = trial_dir.name.rsplit("-r", 1)[0]
        runs.setdefault(label, []).append(0.1)
        disturbed = label == "2x128_ddp_25MiB" and len(runs[label]) == 2  # another job beside its second run
        if label == "6x320_zero3":  # never settles: 0.1, 0.2, 0.3, 0.4 (stops at the cap)
            return Measured(0.1 * len(runs[label]))
        return Measured(0.19 if disturbed else 0.1)

    def probe_job(machine, probes, steps, warmup, timeout, again):  # one job per round
        assert again == 0  # two rounds: the reruns are rounds of their own
        jobs.append(len(probes))
        return [[trial(trial_dir)] for trial_dir, _, _ in probes]

    def trial_job(machine, base, variant, trial_dir, steps, warmup, timeout):  # one job per probe
        jobs.append(1)
        return trial(trial_dir)

    _fake_links_and_profiles(monkeypatch, calibrate_module)
    monkeypatch.setattr(calibrate_module, "run_probes", probe_job)
    monkeypatch.setattr(calibrate_module, "run_trial", trial_job)
    profile_jobs = len(PROFILE_JOBS)
    cal = calibrate_module.calibrate(TestMachine(_profile_job, one_job), tmp_path, rounds=2, log=lambda line: None)
    if one_job:  # both rounds, then the unsettled, then the cap
        assert jobs[2:] == [2, 1] and jobs[0] == jobs[1] == len(runs)
    else:
        assert jobs == [1] * sum(map(len, runs.values()))
    assert {label: len(r) for label, r in runs.items() if len(r) != 2} == {"2x128_ddp_25MiB": 3, "6x320_zero3": 4}
    assert {p.label: p.measured_s for p in cal.probes}["2x128 ddp 25MiB"] == 0.1
    # every probe model's compute profile from one job (one start, not one per model)
    assert len(PROFILE_JOBS) == profile_jobs + 1 and PROFILE_JOBS[-1].count("--probe") == len(PROBE_MODELS)


def test_one_round_runs_again_a_probe_whose_own_steps_vary_and_takes_the_calibrations_length(tmp_path,
                                                                                          monkeypatch) -> None:
    """The default calibration: one run of each probe, ``PROBE_STEPS`` steps, ``PROBE_WARMUP`` untimed; a run whose
    timed steps vary by over ``PROBE_SPREAD`` runs again, and then as the rounds of a longer calibration do (until
    its runs agree), up to ``PROBE_EXTRA`` more times, in the round's one job; the median of its runs counts. (The
    job's own loop is tests/test_tune_probe_runs.py's; here a fake job runs it by the same rule.)"""
    import dptrain.tune.calibrate as calibrate_module
    from dptrain.tune.probe_length import PROBE_SPREAD, unsettled
    from dptrain.tune.trials import Measured

    runs: dict[str, list[float]] = {}
    lengths, jobs = set(), []

    def one(label: str) -> Measured:
        runs.setdefault(label, []).append(0.1)
        first = len(runs[label]) == 1
        if label == "2x128_ddp_25MiB":  # its first run's steps were disturbed: 0.3 s, varying by 20%
            return Measured(0.3, spread=0.2) if first else Measured(0.1, spread=0.01)
        if label == "6x320_zero3":  # never steady, its runs never agree: stops at the cap
            return Measured(0.1 * len(runs[label]), spread=0.2)
        return Measured(0.1, spread=PROBE_SPREAD * 0.9)

    def probe_job(machine, probes, steps, warmup, timeout, again):
        lengths.add((steps, warmup))
        jobs.append(len(probes))
        out = []
        for trial_dir, _, _ in probes:
            got = [one(trial_dir.name.rsplit("-r", 1)[0])]
            while len(got) <= again and unsettled(got, 1):  # the job's loop, by the calibration's rule
                got.append(one(trial_dir.name.rsplit("-r", 1)[0]))
            out.append(got)
        return out

    _fake_links_and_profiles(monkeypatch, calibrate_module)
    monkeypatch.setattr(calibrate_module, "run_probes", probe_job)
    tuned = (tmp_path / "model.toml", [2, 4, 2], tmp_path / "profiles.json")  # the tuned model's, asked beside
    tuned[0].write_text("")
    before = len(PROFILE_JOBS)
    cal = calibrate_module.calibrate(TestMachine(_profile_job, True), tmp_path, log=lambda line: None,
                                     models=[tuned])
    # the links, every probe model and the tuned model at each of its sizes, largest first: one job
    assert len(PROFILE_JOBS) == before + 1 and PROFILE_JOBS[-1].count("--probe") == len(PROBE_MODELS) + 1
    assert PROFILE_JOBS[-1][-4:] == ["--probe", str(tuned[2]), str(tuned[0]), "4,2"]
    assert set(calibrate_module.read_profiles(tuned[2])) == {4, 2}
    assert calibrate_module.PROBE_ROUNDS == 1 and jobs == [len(runs)]  # the reruns in the round's one job
    assert lengths == {(calibrate_module.PROBE_STEPS, calibrate_module.PROBE_WARMUP)}
    assert {label: len(r) for label, r in runs.items() if len(r) != 1} == {
        "2x128_ddp_25MiB": 3, "6x320_zero3": 1 + calibrate_module.PROBE_EXTRA}  # 0.3 and 0.1 disagree: a third
    assert {p.label: p.measured_s for p in cal.probes}["2x128 ddp 25MiB"] == pytest.approx(0.1)


def test_refit_without_the_probe_profiles_names_what_is_missing(tmp_path) -> None:
    """A calibration.json copied without its calibration/ directory: one error naming the directory, not 'no probe'."""
    raw = {"version": 5, "where": "a test machine", "taken": "2026-12-01", "hosts": 2, "per_host": 1,
           "backend": "gloo", "shared_net": False, "inside": vars(Link(1e-4, 1e9)), "across": vars(Link(1e-4, 1e9)),
           "probes": [{"label": "2x128 ddp 25MiB", "measured_s": 0.1, "timeline_s": 0.0, "features": [1.0] * 13}]}
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"calibration holds no probe model .*probe\*/model.toml"):
        refit(tmp_path / "calibration.json", tmp_path / "work", log=lambda line: None)
