"""The guard of tests/conftest.py: a test that reads or writes the checkout's runs/ or data/ fails, naming the path."""

import os

import conftest


def test_an_open_under_the_checkouts_runs_is_caught_and_one_elsewhere_is_not(tmp_path) -> None:
    inside = os.path.join(conftest._CHECKOUT, "runs", "chargpt", "checkpoints")
    conftest._guard("os.listdir", (inside,))
    conftest._guard("open", (str(tmp_path / "runs" / "x"), "r", 0))
    conftest._guard("open", (os.path.join(conftest._CHECKOUT, "data", "train.bin"), "rb", 0))
    caught, conftest._touched[:] = list(conftest._touched), []  # this test's own touches are not a failure
    assert caught == [f"os.listdir {inside}", f"open {os.path.join(conftest._CHECKOUT, 'data', 'train.bin')}"]


def test_a_file_another_process_wrote_there_is_seen_by_the_trees_listing(tmp_path) -> None:
    runs = os.path.join(conftest._CHECKOUT, "runs")
    before = conftest._files()
    probe = os.path.join(runs, f".guard-probe-{os.getpid()}")
    conftest._watching[0] = False  # written here as a launcher's worker would write it: unseen by the hook
    try:
        os.makedirs(runs, exist_ok=True)
        with open(probe, "w") as f:
            f.write("x")
        assert {p for p, _, _ in conftest._files() ^ before} == {probe}
    finally:
        os.remove(probe)
        conftest._watching[0] = True
    assert conftest._files() == before
