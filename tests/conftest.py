"""The test session's setup: one fork server with everything a rank imports, and a resolver timeout.

Every multi-process test (``dptrain.testing.run_on_ranks``) and every ``dptrain run`` a
test makes in process (``tests/_cli.py``) forks its ranks from one server per pytest
process. A rank unpickles its function by module name, so it imports the test module,
and with it pytest (50 ms): preloaded here, that is paid once per session instead of once
per rank per test.

A ``dptrain run`` rendezvous through a ``TCPStore``, and both ends of every connection
look the peer's address up in the DNS. The machines this suite runs on leave some of
those queries unanswered (1 in 27), and the C library waits 5 s before asking again:
a run stalled 5 s now and then. One second is enough to know (``RES_OPTIONS`` is the C
library's resolver setting; docs/testing.md has the measurements).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import sys

import pytest

from dptrain.launch.workers import fork_server_preload

os.environ.setdefault("RES_OPTIONS", "timeout:1")  # before any lookup here or in a process started from here


def pytest_configure(config) -> None:
    # transformers (the hf extra, which the test extra installs) costs a rank 1.7 s to import
    hf = ["transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        fork_server_preload(["pytest", "_models", "_cli", *hf]))
    multiprocessing.forkserver.ensure_running()


# ----------------------------------------------------------------------------- tiers
#
# What each kind of test costs, measured on every run and printed at the end: a test's
# tier is the most expensive thing it did. New processes are seen by Python's audit
# hook on subprocess.Popen (torchrun, `python -m dptrain.cli`, exec workers, the
# cluster's `ip`); ranks and in-process `dptrain` commands by wrapping the one function
# each goes through.

TIERS = {"process": "one process", "ranks": "ranks (run_on_ranks)", "cli": "dptrain commands, in process",
         "fresh": "new processes (torchrun, fresh CLI, clusters)"}
_ORDER = list(TIERS)
_current: dict = {"kinds": None}
_seconds: dict = {}


def _saw(kind: str) -> None:
    if _current["kinds"] is not None:
        _current["kinds"].add(kind)


def _audit(event: str, args) -> None:
    if event == "subprocess.Popen":
        _saw("fresh")


def _wrap(module, name: str, kind: str) -> None:
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        _saw(kind)
        return inner(*args, **kwargs)
    setattr(module, name, wrapper)


def pytest_sessionstart(session) -> None:
    import sys

    import dptrain.bench.runs
    import dptrain.testing

    sys.addaudithook(_audit)
    _wrap(dptrain.testing, "_collect", "ranks")
    _wrap(dptrain.bench.runs, "_exit_code", "cli")


def pytest_runtest_setup(item) -> None:
    _current["kinds"] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown":  # the test is over: its tier, in its report (and --junitxml's properties)
        tier = max(_current["kinds"] or (), key=_ORDER.index, default="process")
        _current["kinds"] = None
        item.user_properties.append(("tier", tier))
        _seconds.setdefault(item.nodeid, [None, 0.0])[0] = tier
    return (yield)


def pytest_runtest_logreport(report) -> None:
    # under pytest-xdist this runs in the controller too, which learns the tier from the teardown's report
    entry = _seconds.setdefault(report.nodeid, [None, 0.0])
    entry[1] += report.duration
    tier = dict(report.user_properties).get("tier")
    if tier is not None:
        entry[0] = tier


def pytest_terminal_summary(terminalreporter) -> None:
    totals = {t: [0, 0.0] for t in TIERS}
    for tier, seconds in _seconds.values():
        if tier is not None:
            totals[tier][0] += 1
            totals[tier][1] += seconds
    if not any(n for n, _ in totals.values()):
        return
    terminalreporter.section("time per test tier (docs/testing.md)")
    for tier, (n, seconds) in totals.items():
        terminalreporter.write_line(f"{TIERS[tier]:48s} {n:4d} tests {seconds:8.1f} s")


# ----------------------------------------------------------------------------- the checkout's runs/ and data/
#
# A newcomer runs the README's first command (which leaves runs/ and data/ in the checkout) and
# then its test command in the same checkout: a test that resolves a default path against the
# working directory would read the newcomer's run, or write into it. Python's audit hook sees
# every open, listing, directory creation, rename and removal this process makes; one under the
# checkout's runs/ or data/ fails the test that made it, naming the path. What a process the test
# started wrote there (a fresh interpreter, a launcher's workers) is caught by comparing the two
# trees' files before and after the test.

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GUARDED = tuple(os.path.join(_CHECKOUT, name) for name in ("runs", "data"))
_touched: list[str] = []
_watching = [True]  # off while the fixture itself lists the trees
_EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree",
           "os.chmod", "os.symlink"}


def _guard(event: str, args) -> None:
    if event not in _EVENTS or not args or not _watching[0]:
        return
    path = args[0]
    if isinstance(path, int) or path is None:
        return
    try:
        full = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    if any(full == root or full.startswith(root + os.sep) for root in _GUARDED):
        _touched.append(f"{event} {full}")


sys.addaudithook(_guard)


def _files() -> set[tuple[str, int, int]]:
    """(path, size, mtime) of every file under the checkout's runs/ and data/."""
    watching, _watching[0] = _watching[0], False
    try:
        out = set()
        for root in _GUARDED:
            for folder, _, names in os.walk(root):
                for name in names:
                    path = os.path.join(folder, name)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    out.add((path, st.st_size, st.st_mtime_ns))
        return out
    finally:
        _watching[0] = watching


@pytest.fixture(autouse=True)
def _leave_the_checkouts_runs_alone():
    """Fails a test that read or wrote the checkout's runs/ or data/ (resolve its paths under tmp_path)."""
    del _touched[:]
    before = _files()
    yield
    _touched.extend(f"changed {path}" for path, _, _ in sorted(_files() ^ before))
    if _touched:
        seen = sorted(set(_touched))
        del _touched[:]
        pytest.fail(f"this test touched the checkout's runs/ or data/ ({'; '.join(seen[:3])}): tests never read or "
                    "write them (a newcomer's first run lives there); give it a run_dir / data.dir under tmp_path",
                    pytrace=False)
