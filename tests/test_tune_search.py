"""dptrain tune's search logic on fake measurements: pruning, ranking, failing trials, the exhaustive mode.

No timing is asserted: the "measurements" are given numbers, so what is checked is
which candidates the search runs, in what order, and what it chooses and reports.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dptrain.planner.calibration import Calibration, CalibrationError, ProbeRun, fit_overheads, unidentified
from dptrain.planner.simulate import Overheads
from dptrain.tune.machine import _run
from dptrain.tune.search import Measured, TrialFailed, search
from dptrain.tune.space import candidates
from dptrain.tune.trials import read_steps

TRUE = {"a": 1.0, "b": 0.8, "c": 1.2, "d": 0.9, "e": 2.0}  # measured step times of five candidates


def _measure(log: list[str], failing: set[str] = frozenset(), true: dict[str, float] = TRUE):
    def measure(c: str) -> Measured:
        log.append(c)
        if c in failing:
            raise TrialFailed("exit 1: RuntimeError: boom")
        return Measured(true[c], 10.0)

    return measure


def test_the_search_runs_only_the_predicted_best_and_chooses_by_measurement() -> None:
    predicted = {"a": 0.5, "b": 0.9, "c": 0.7, "d": 2.0, "e": 3.0}  # b is truly fastest but predicted third
    log: list[str] = []
    res = search(list(TRUE), predicted.__getitem__, _measure(log), trials=3)
    assert sorted(log) == ["a", "b", "c"]  # the three predicted best, each once
    assert res.best.candidate == "b" and res.trials == 3
    assert [r.candidate for r in res.rows] == ["a", "c", "b", "d", "e"]  # predicted order
    assert res.predicted_best.candidate == "a"
    assert [r.status for r in res.rows] == ["measured"] * 3 + ["ranked"] * 2


def test_a_candidate_over_the_memory_budget_is_never_run_or_chosen() -> None:
    predicted = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    memory = {"a": 100, "b": 10, "c": 10, "d": 10, "e": 10}
    log: list[str] = []
    res = search(list(TRUE), predicted.__getitem__, _measure(log), memory.__getitem__, budget_bytes=50, trials=2)
    assert "a" not in log and sorted(log) == ["b", "c"]
    row_a = next(r for r in res.rows if r.candidate == "a")
    assert row_a.status == "does not fit" and res.rows[-1] is row_a
    assert res.best.candidate == "b"


def test_a_failing_trial_is_reported_and_the_next_candidate_takes_its_place() -> None:
    predicted = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    log: list[str] = []
    res = search(list(TRUE), predicted.__getitem__, _measure(log, failing={"a"}), trials=2)
    assert log == ["a", "b", "c"]  # a failed, c replaced it
    statuses = {r.candidate: r.status for r in res.rows}
    assert statuses["a"].startswith("failed: exit 1") and statuses["c"] == "measured"
    assert res.best.candidate == "b" and res.trials == 3
    assert next(r for r in res.rows if r.candidate == "a").measured_s is None


def test_failures_are_replaced_at_most_up_to_twice_the_trials_then_the_search_ends_without_a_winner() -> None:
    predicted = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    log: list[str] = []
    res = search(list(TRUE), predicted.__getitem__, _measure(log, failing=set(TRUE)), trials=2)
    assert log == ["a", "b", "c", "d"] and res.best is None


def test_a_candidate_the_simulator_cannot_predict_ranks_last_with_the_reason() -> None:
    def predict(c: str) -> float:
        if c == "a":
            raise ValueError("shard size 3 does not divide 4 ranks")
        return {"b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}[c]

    res = search(list(TRUE), predict, _measure([]), trials=1)
    assert res.rows[-1].candidate == "a" and "shard size 3" in res.rows[-1].status


def test_the_exhaustive_mode_measures_every_candidate_that_fits_interleaved_over_rounds() -> None:
    predicted = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    memory = {"a": 1, "b": 1, "c": 1, "d": 1, "e": 99}
    log: list[str] = []
    seen: list[tuple[int, int]] = []
    res = search(list(TRUE), predicted.__getitem__, _measure(log), memory.__getitem__, 50, exhaustive=True, rounds=2,
                 progress=lambda row, done, total: seen.append((done, total)))
    assert log == ["a", "b", "c", "d", "b", "c", "d", "a"]  # round 2 starts one further on
    assert seen[-1] == (8, 8) and res.best.candidate == "b" and res.trials == 4
    assert all(len(r.measured) == 2 for r in res.rows if r.candidate != "e")


def test_the_stopping_rule_reruns_the_candidates_the_best_cannot_be_told_from_within_the_budget() -> None:
    predicted = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    noisy = {"a": [1.00, 1.10, 0.98], "b": [1.02, 0.95, 0.97], "c": [1.5, 1.52]}
    log: list[str] = []

    def measure_from(runs: dict[str, list[float]]):
        def measure(c: str) -> Measured:
            log.append(c)
            return Measured(runs[c][log.count(c) - 1])
        return measure

    seen: list[tuple[int, int]] = []
    res = search(list(TRUE), predicted.__getitem__, measure_from(noisy), trials=3, rounds=1, max_rounds=3,
                 progress=lambda row, done, total: seen.append((done, total)))
    # round 1: each once; round 2: every one again (one run has no deviation); round 3: b and a, 0.065 apart with
    # deviations 0.035 and 0.05, again; c (0.01) stands apart
    assert log == ["a", "b", "c", "b", "c", "a", "b", "a"] and seen[-1] == (8, 8)
    rows = {r.candidate: r for r in res.rows}
    assert res.best.candidate == "b" and len(rows["b"].measured) == 3 and len(rows["c"].measured) == 2
    assert rows["c"].spread == pytest.approx(0.02 / 1.51) and rows["d"].spread is None
    assert rows["a"].deviation == pytest.approx(0.02) and rows["b"].deviation == pytest.approx(0.02)
    # more runs can tell apart what two could not (a range would only widen): stopped after the third round
    log.clear()
    wide = {"a": [1.0, 1.2, 1.0, 1.0, 1.0], "b": [1.1, 0.9, 0.9, 0.9, 0.9], "c": [2.0, 2.0]}
    res = search(list(TRUE), predicted.__getitem__, measure_from(wide), trials=3, rounds=2, max_rounds=5)
    assert sorted(log) == ["a", "a", "a", "b", "b", "b", "c", "c"] and res.best.candidate == "b"
    # runs that stand apart stop the rule at once; the default budget (max_rounds = rounds) never starts it
    log.clear()
    search(list(TRUE), predicted.__getitem__, measure_from({"a": [1.0, 1.01], "b": [0.8, 0.81], "c": [1.2, 1.21]}),
           trials=3, rounds=2, max_rounds=5)
    assert sorted(log) == ["a", "a", "b", "b", "c", "c"]
    log.clear()
    search(list(TRUE), predicted.__getitem__, _measure(log), trials=3)
    assert len(log) == 3


def test_the_search_refuses_repeated_candidates_and_nonsense_budgets() -> None:
    with pytest.raises(ValueError, match="repeat"):
        search(["a", "a"], lambda c: 1.0, _measure([]))
    with pytest.raises(ValueError, match="at least 1"):
        search(["a"], lambda c: 1.0, _measure([]), trials=0)
    with pytest.raises(ValueError, match="max_rounds at least rounds"):
        search(["a"], lambda c: 1.0, _measure([]), rounds=3, max_rounds=2)


def test_the_space_keeps_the_global_batch_and_gives_each_strategy_its_options() -> None:
    space = candidates(4, 32, ["ddp", "zero1", "zero3"], buckets=[1.0, 25.0], codecs=["none", "bf16"])
    assert all(4 * c.micro_batch * c.accum == 32 for c in space)
    assert {c.micro_batch for c in space} == {1, 2, 4, 8}
    per_micro = [c for c in space if c.micro_batch == 8]
    labels = [c.label for c in per_micro]
    assert labels == ["ddp 8x1 1MiB", "ddp 8x1 1MiB bf16", "ddp 8x1 25MiB", "ddp 8x1 25MiB bf16",
                      "zero1 8x1 1MiB", "zero1/hybrid2 8x1 1MiB", "zero1 8x1 25MiB", "zero1/hybrid2 8x1 25MiB",
                      "zero3 8x1", "zero3/hybrid2 8x1"]
    assert per_micro[-1].overrides() == ['distributed.strategy="zero3"', "train.micro_batch_size=8",
                                         "train.grad_accum_steps=1", "zero.shard_size=2"]
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        candidates(3, 32, ["ddp"])
    with pytest.raises(ValueError, match=r"micro-batches \[3\] do not divide"):
        candidates(2, 32, ["ddp"], micro_batches=[3])
    with pytest.raises(ValueError, match="keep the loss"):
        candidates(2, 32, ["ddp"], codecs=["topk"])


def _probes(true: Overheads, count: int, seed: int = 0, unprobed: tuple[int, ...] = ()) -> list[ProbeRun]:
    rng = np.random.default_rng(seed)
    probes = []
    for i in range(count):
        accum = float(rng.integers(0, 3))
        features = [1.0, float(rng.integers(0, 30)), float(rng.integers(0, 30)), float(rng.integers(0, 40)),
                    float(rng.uniform(0, 5e7)), float(rng.uniform(0, 9e7)), float(rng.uniform(1e6, 3e7)),
                    float(rng.uniform(0.01, 0.3)), accum, accum * float(rng.uniform(1e6, 3e7))]
        coded = float(rng.integers(0, 2)) * float(rng.integers(1, 30))  # buckets a codec reduces, or none
        features += [coded, coded * float(rng.uniform(2e5, 3e6))]
        features.append(float(rng.integers(0, 2)) * float(rng.uniform(0.01, 0.5)))  # hybrid's turns on one link
        for k in unprobed:
            features[k] = 0.0
        timeline = float(rng.uniform(0.02, 0.2))
        extra = sum(k * x for k, x in zip(true.terms(), features, strict=True))
        probes.append(ProbeRun(f"p{i}", timeline + extra, timeline, tuple(features)))
    return probes


def test_the_overheads_fit_recovers_known_terms_and_never_goes_negative() -> None:
    true = Overheads(2e-3, 5e-4, 3e-4, 1e-3, 1e-9, 0.0, 3e-10, 0.15, 4e-3, 2e-10, 2e-4, 4e-10, 0.6)
    probes = _probes(true, 24)
    assert unidentified(probes) == []
    fitted = fit_overheads(probes)
    assert fitted.terms() == pytest.approx(true.terms(), rel=1e-6, abs=1e-12)
    # residuals that a term could only explain with a negative value leave it at zero
    fast = [ProbeRun("p", 0.9 * p.timeline_s, p.timeline_s, p.features) for p in probes]
    assert fit_overheads(fast).terms() == (0.0,) * 13


def test_a_term_the_probes_cannot_tell_apart_is_named_and_held_at_zero_not_fitted_to_noise() -> None:
    true = Overheads(2e-3, 5e-4, 3e-4, 1e-3, 1e-9, 0.0, 3e-10, 0.15, 4e-3, 2e-10, 2e-4, 4e-10, 0.6)
    # no probe accumulates or runs a codec: those four terms are not exercised; the rest are still recovered
    probes = _probes(true, 24, unprobed=(8, 9, 10, 11))
    unprobed = ["per_micro_step_s", "micro_step_s_per_byte", "per_coded_bucket_s", "coded_s_per_byte"]
    assert unidentified(probes) == unprobed
    fitted = fit_overheads(probes)
    assert fitted.per_micro_step_s == 0.0 and fitted.micro_step_s_per_byte == 0.0
    assert fitted.per_zero_bucket_s == pytest.approx(3e-4, rel=1e-6)
    # a feature that is an earlier one's multiple, or nearly (1% off): the first is fitted, the second named
    for wobble in (0.0, 0.01):
        twins = [ProbeRun(p.label, p.measured_s, p.timeline_s,
                          (*p.features[:3], 2 * p.features[2] * (1 + wobble * (-1) ** i), *p.features[4:]))
                 for i, p in enumerate(probes)]
        assert unidentified(twins) == ["per_zero_unit_s", *unprobed]
        assert fit_overheads(twins).per_zero_unit_s == 0.0 and fit_overheads(twins).per_zero_bucket_s > 0


def test_a_calibration_round_trips_and_a_damaged_one_is_named(tmp_path) -> None:
    from dptrain.comm.cost import Link

    cal = Calibration("the emulated cluster", "2026-11-28", 2, 2, "gloo", True, Link(1e-3, 1e9), Link(2e-4, 1.2e8),
                      Overheads(1e-3, 2e-4, 0.0, 3e-4, 4e-10, 5e-10, 6e-10, 0.1),
                      [ProbeRun("ddp", 0.1, 0.08, (1.0, 2.0, 0.0, 0.0, 1e6, 0.0, 1e6, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0))])
    path = tmp_path / "calibration.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back == cal and back.network().per_node == 2 and back.network().shared_net
    assert back.residuals()[0]["fitted_s"] == pytest.approx(0.08 + 1e-3 + 4e-4 + 4e-4 + 6e-4 + 5e-3)
    d = json.loads(path.read_text())
    d["overheads"]["per_step_s"] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match="per_step_s = -1"):
        Calibration.load(path)
    d["overheads"]["per_step_s"] = 1e-3
    d["probes"][0]["features"] = d["probes"][0]["features"][:10]  # a probe of fewer terms
    path.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match="damaged.*10 features, not 13"):
        Calibration.load(path)
    path.write_text('{"version": 2}')  # ten terms, before the codec's: not read as if it had thirteen
    with pytest.raises(CalibrationError, match="version 2.*measure a new one"):
        Calibration.load(path)
    path.write_text('{"version": 99}')
    with pytest.raises(CalibrationError, match="version 99"):
        Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="cannot read"):
        Calibration.load(path)


def test_a_trial_reads_the_steps_after_the_warmup_and_survives_a_torn_last_line(tmp_path) -> None:
    lines = [json.dumps({"kind": "train", "step": s, "step_ms": ms, "peak_tensor_mb": [None, None] if s == 1 else
                         [50.0, 60.0 + s]}) for s, ms in ((1, 900.0), (2, 100.0), (3, 120.0), (4, 110.0))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')
    m = read_steps(tmp_path, warmup=1)
    assert m.step_s == pytest.approx(0.110) and m.peak_mb == 64.0
    with pytest.raises(TrialFailed, match="no step after the 4 warm-up steps"):
        read_steps(tmp_path, warmup=4)


def test_a_job_past_its_timeout_is_stopped_and_reported_as_hung() -> None:
    code, _ = _run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1.0)
    assert code == 124
    code, tail = _run([sys.executable, "-c", "import sys; sys.exit('the last words')"], timeout=30)
    assert code == 1 and tail == "the last words"
    summary = "dptrain.run FAILED\\n---\\nRoot Cause:\\n  exitcode  : -6\\n  traceback : Signal 6 (SIGABRT)\\n====\\n"
    code, tail = _run([sys.executable, "-c", f"import sys; sys.stderr.write('{summary}'); sys.exit(1)"], timeout=30)
    assert code == 1 and tail.splitlines()[-1] == "  traceback : Signal 6 (SIGABRT)"  # torchrun's rules left out
    worker = ("[rank3]: [rank3]: Traceback (most recent call last):\\n[rank3]: [rank3]:   File x, line 1\\n"
              "[rank3]: [rank3]: torch.distributed.DistNetworkError: Failed to recv\\n" + summary.replace("-6", "1"))
    code, tail = _run([sys.executable, "-c", f"import sys; sys.stderr.write('{worker}'); sys.exit(1)"], timeout=30)
    assert tail.splitlines()[-1] == "[rank3]: torch.distributed.DistNetworkError: Failed to recv"  # the worker's


def test_a_failed_job_keeps_its_whole_error_output_and_the_trial_names_where(tmp_path) -> None:
    from _tune_machine import TestMachine
    from dptrain.tune.machine import where_kept
    from dptrain.tune.trials import run_trial

    lines = "".join(f"line {i}\\n" for i in range(40))
    code, tail = _run([sys.executable, "-c", f"import sys; sys.stderr.write('{lines}'); sys.exit(3)"], timeout=30,
                      errors=tmp_path / "failed.txt")
    assert code == 3 and tail == "line 37\nline 38\nline 39"
    assert (tmp_path / "failed.txt").read_text().splitlines() == [f"line {i}" for i in range(40)]
    code, _ = _run([sys.executable, "-c", "import sys, time; sys.stderr.write('waiting'); sys.stderr.flush(); "
                    "time.sleep(30)"], timeout=2.0, errors=tmp_path / "hung.txt")
    assert code == 124 and (tmp_path / "hung.txt").read_text() == "waiting"
    code, _ = _run([sys.executable, "-c", "import sys; sys.stderr.write('fine')"], timeout=30, errors=tmp_path / "ok.txt")
    assert code == 0 and not (tmp_path / "ok.txt").exists() and where_kept(tmp_path / "ok.txt") == ""

    def failing(args):  # as a machine that keeps the output would: the file is the trial's
        (tmp_path / "trial" / "job-errors.txt").write_text("Traceback ...\nValueError: broke\n")
        return 1, "ValueError: broke"

    with pytest.raises(TrialFailed, match=r"exit 1: ValueError: broke \(all its error output: .*trial/job-errors.txt\)"):
        run_trial(TestMachine(failing), None, ["gpt.n_layer=1"], tmp_path / "trial", 3, 1, 60)


def test_dptrain_tune_refuses_bad_input_with_one_line_and_exit_2(tmp_path) -> None:
    from dptrain.bench.runs import run_cli

    def tune(*args: str) -> subprocess.CompletedProcess:
        return run_cli(["tune", *args], cwd=tmp_path)

    for args, message in ((["--nproc", "2", "--cluster", "2x2"], "one of --nproc"),
                          (["--cluster", "2by2"], "HOSTSxPER_HOST"),
                          (["--nproc", "3", "--global-batch", "32"], "cannot be split over 3 ranks"),
                          (["--nproc", "2", "--strategies", "gossip"], "not modelled by the simulator"),
                          (["--nproc", "2", "--out", "."], "exists")):
        done = tune(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr


def test_a_calibration_that_fails_on_the_machine_ends_dptrain_tune_with_one_line_and_exit_1(tmp_path, monkeypatch,
                                                                                           capsys) -> None:
    import dptrain.tune.calibrate as calibrate_module
    from _tune_machine import TestMachine
    from dptrain.cli.tune import _run
    from dptrain.tune.tuner import TuneOptions

    def failing(*args, **kwargs):
        raise TrialFailed("the probe job stopped in probe3: exit 1: RuntimeError: gloo broke (all its error output: "
                          "x/job-errors.txt)")

    monkeypatch.setattr(calibrate_module, "calibrate", failing)
    space = candidates(2, 32, ["ddp"], None, [25.0], None, ["none"])
    with pytest.raises(SystemExit) as stopped:
        _run(TestMachine(lambda args: (0, "")), None, [], space, None, tmp_path / "out", {}, TuneOptions(), {})
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "Traceback" not in err
    assert "the calibration failed: the probe job stopped in probe3: exit 1: RuntimeError: gloo broke" in err
    assert f"kept in {tmp_path / 'out' / 'calibration'}" in err

    # given a calibration, the model's own profile job is the one that can fail outside the trials' rows
    import dptrain.tune.tuner as tuner_module
    from dptrain.comm.cost import Link

    def profile_failed(*args, **kwargs):
        raise TrialFailed("the probe -m dptrain.tune.compute_probe exited with 1: MemoryError: x")

    monkeypatch.setattr(tuner_module, "tune", profile_failed)
    given = Calibration("a test machine", "2026-12-07", 1, 2, "gloo", False, Link(1e-4, 1e9), Link(1e-4, 1e9))
    with pytest.raises(SystemExit) as stopped:
        _run(TestMachine(lambda args: (0, "")), None, [], space, given, tmp_path / "out2", {}, TuneOptions(), {})
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "Traceback" not in err
    assert "compute_probe exited with 1: MemoryError: x" in err and f"kept in {tmp_path / 'out2'}" in err


def test_the_probes_run_hybrid_sharding_wherever_the_cluster_allows_a_shard_group_of_several_hosts_or_one() -> None:
    from dptrain.tune.calibrate import probe_variants

    def hybrid(world: int, per_host: int, setting: str = "zero.shard_size=") -> set[str]:
        return {o for variant, overrides in probe_variants(world, per_host).items() if "/hybrid" in variant
                for o in overrides if o.startswith(setting)}

    assert hybrid(4, 2) == {"zero.shard_size=2"}  # a shard group per host
    assert hybrid(8, 4) == {"zero.shard_size=4"}
    assert hybrid(4, 1) == hybrid(8, 1) == {"zero.shard_size=2"}  # one rank per host: pairs across hosts
    assert hybrid(2, 1) == hybrid(3, 1) == hybrid(4, 4) == set()  # no replicate group of 2, or no second host
    # across hosts, bucketed hybrid sharding at many buckets too, where its two groups' turns on one link add up
    assert hybrid(4, 1, "ddp.bucket_cap_mb=") == {"ddp.bucket_cap_mb=25", "ddp.bucket_cap_mb=0.25"}
    assert hybrid(4, 2, "ddp.bucket_cap_mb=") == {"ddp.bucket_cap_mb=25"}
