"""The compute-profile job (``python -m dptrain.tune.compute_probe``): one model, or several in one job; and the
calibration's one job (``python -m dptrain.tune.calibration_job``): the links, then the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _cli import TINY_GPT_SETTINGS
from dptrain.testing import run_on_ranks
from dptrain.tune.calibration_job import measure
from dptrain.tune.compute_probe import parse_probes, profile_model
from dptrain.tune.link_probe import SIZES
from dptrain.tune.trials import write_config


def test_the_command_line_takes_one_model_or_several_and_refuses_half_a_request() -> None:
    assert parse_probes(["a.json", "--config", "a.toml", "--micro-batches", "8,4"]) == ([("a.json", "a.toml", [8, 4])],
                                                                                        6)
    assert parse_probes(["--probe", "a.json", "a.toml", "4", "--probe", "b.json", "b.toml", "12,2", "--steps", "3"]) \
        == ([("a.json", "a.toml", [4]), ("b.json", "b.toml", [12, 2])], 3)
    for argv in ([], ["a.json", "--config", "a.toml"], ["--probe", "a.json", "a.toml", "four"]):
        with pytest.raises(SystemExit) as e:
            parse_probes(argv)
        assert e.value.code == 2, argv


def _profile_two(rank: int, world_size: int, probes: list[tuple[str, str, list[int]]]) -> None:
    for out, config, micro_batches in probes:
        profile_model(out, config, micro_batches, steps=2)


def test_one_job_profiles_each_model_into_its_own_file(tmp_path: Path) -> None:
    """Two models of different depths, one after the other on the same 2 ranks: each file holds its own model's
    profile (the deeper model's gradients are more) at each of its micro-batch sizes."""
    small = write_config(tmp_path / "small.toml", None, [*TINY_GPT_SETTINGS, "train.global_batch_size=4"])
    large = write_config(tmp_path / "large.toml", None, [*TINY_GPT_SETTINGS, "gpt.n_layer=3",
                                                         "train.global_batch_size=4"])
    probes = [(str(tmp_path / "small.json"), str(small), [2, 1]), (str(tmp_path / "large.json"), str(large), [2])]
    run_on_ranks(_profile_two, 2, probes, timeout=120)
    small_p, large_p = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("small", "large"))
    assert set(small_p) == {"2", "1"} and set(large_p) == {"2"}
    for p in (*small_p.values(), *large_p.values()):
        assert p["forward_s"] > 0 and p["backward_s"] > 0 and p["ready"] and "2 ranks" in p["source"]
    assert len(large_p["2"]["ready"]) > len(small_p["2"]["ready"]) == len(small_p["1"]["ready"])


def _calibration_job(rank: int, world_size: int, links: str, probes: list[tuple[str, str, list[int]]]) -> None:
    measure(links, None, probes, steps=2)


def test_the_calibrations_one_job_times_the_links_then_profiles_each_model(tmp_path: Path) -> None:
    """One process group: the link probe's medians over both ranks (every size of each collective), then the model's
    profile, each in its own file, as the two jobs of their own wrote them."""
    model = write_config(tmp_path / "model.toml", None, [*TINY_GPT_SETTINGS, "train.global_batch_size=4"])
    links, out = tmp_path / "links.json", tmp_path / "model.json"
    run_on_ranks(_calibration_job, 2, str(links), [(str(out), str(model), [2])], timeout=120)
    timed = json.loads(links.read_text())
    assert timed["world_size"] == 2
    assert {int(n) for n in timed["seconds"]["all_reduce"]} == set(SIZES)
    assert all(s > 0 for kind in timed["seconds"].values() for s in kind.values())
    profile = json.loads(out.read_text())["2"]
    assert profile["forward_s"] > 0 and profile["backward_s"] > 0 and "2 ranks" in profile["source"]


class _SlowClock:
    """A clock whose every reading is one second after the last: each timed collective lasts exactly 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def _probe_with_a_slow_rank(rank: int, world_size: int, out: str) -> None:
    import types

    import dptrain.tune.link_probe as link_probe
    if rank == 1:  # this rank reads each collective at 1 s; rank 0 at its real milliseconds
        link_probe.time = types.SimpleNamespace(perf_counter=_SlowClock().perf_counter)
    link_probe.time_links(out, reps=3)


def test_the_link_probe_writes_the_slowest_ranks_times_not_rank_zeros(tmp_path: Path) -> None:
    """A ring's ranks finish at different times and a step waits for the last: rank 0 writes, for every size of
    each collective, the time of the rank that read it slowest (here rank 1's 1 s, not its own milliseconds)."""
    out = tmp_path / "links.json"
    run_on_ranks(_probe_with_a_slow_rank, 2, str(out), timeout=120)
    timed = json.loads(out.read_text())
    assert timed["timed"] == "slowest rank"
    assert [s for kind in timed["seconds"].values() for s in kind.values()] == [1.0] * (2 * len(SIZES))
