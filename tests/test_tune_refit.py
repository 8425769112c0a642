"""refit: an earlier calibration's probe runs fitted again by today's simulator, nothing measured again."""

from __future__ import annotations

import json

import pytest

from dptrain.comm.cost import Link
from dptrain.planner.network import Network
from dptrain.planner.simulate import ComputeProfile, Overheads
from dptrain.tune.calibrate import PROBE_MODELS, probe_timelines, refit


def _profile(i: int, micro: int) -> dict:
    return {str(micro): {"forward_s": 0.01 * (i + 1), "backward_s": 0.02 * (i + 1), "optimizer_s": 0.002,
                         "ready": {}, "source": "a test"}}


def test_refit_carries_the_measured_steps_and_fits_the_terms_again(tmp_path) -> None:
    link = Link(1e-4, 1e9)
    profiles = {i: _profile(i, micro) for i, (_, micro) in enumerate(PROBE_MODELS)}
    for i, p in profiles.items():
        (tmp_path / "calibration" / f"probe{i}").mkdir(parents=True)
        (tmp_path / "calibration" / f"probe{i}" / "profile.json").write_text(json.dumps(p))
    network = Network("test", link, link, 1, "a test", backend="gloo")
    runs = probe_timelines(tmp_path / "now", 2, 1, network, lambda i, base, micro: ComputeProfile(
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
