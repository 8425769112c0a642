"""Where a worker stands, from torchrun's or Slurm's environment; what a worker imports."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dptrain.launch.rendezvous import (
    choose_backend,
    detect_worker_env,
    first_slurm_host,
    init_distributed,
    leave_process_groups,
)
from dptrain.launch.workers import PRELOAD
from dptrain.testing import run_on_ranks
from dptrain.utils.collector import collector_paused, freeze_at_exit


def test_torchrun_environment():
    env = detect_worker_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                             "MASTER_ADDR": "node0", "MASTER_PORT": "29400"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("node0", 29400, "torchrun")


def test_slurm_environment():
    env = detect_worker_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                             "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
                             "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (9, 16, 1, 8)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 123456 % 20000 and env.launcher == "slurm"


def test_single_process_default():
    env = detect_worker_env({})
    assert (env.rank, env.world_size, env.launcher, env.master_addr) == (0, 1, "single", "127.0.0.1")


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[03-05,09],cpu1", "gpu03"), ("node7", "node7"), ("a[1,4]", "a1"), ("rack1-n[010-012]", "rack1-n010"),
    ("x1,x2", "x1"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_auto_backend_is_the_same_on_every_rank_of_a_node() -> None:
    """auto is NCCL only when every local rank has a GPU; otherwise every rank takes gloo."""
    assert choose_backend("auto", 1, 0) == "gloo"
    assert choose_backend("auto", 2, 2) == "nccl"
    assert choose_backend("auto", 1, 8) == "nccl"
    with pytest.warns(UserWarning, match="2 ranks on this node but 1 CUDA device"):
        assert choose_backend("auto", 2, 1) == "gloo"
    assert choose_backend("nccl", 2, 1) == "nccl"  # asked for explicitly: NCCL's own error names it
    assert choose_backend("gloo", 1, 1) == "gloo"


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_leaving_frees_the_backend_threads_that_a_cycle_still_holds():
    # A finished run's engine holds its group in a reference cycle. If the group's gloo threads
    # outlive the run to the interpreter's exit, one releasing a tensor there aborts the process.
    torch.ones(1).add_(1)  # the intra-op pool, if any, starts before the baseline
    before = _native_threads()
    init_distributed(detect_worker_env({}), "gloo", timeout_s=30)
    x = torch.ones(3)
    dist.all_reduce(x)
    cycle = {"group": dist.group.WORLD, "tensor": x}
    cycle["self"] = cycle
    del cycle, x
    assert _native_threads() > before  # gloo's threads: the check below can fail
    leave_process_groups()
    assert not dist.is_initialized()
    assert _native_threads() == before


def test_a_worker_imports_the_checkpoint_layouts_only_when_it_saves_and_the_fork_server_has_them() -> None:
    """``import dptrain.run`` (a launcher's, an exec worker's) leaves torch.distributed.checkpoint (0.6 s) to the
    first save or resume; a forked worker finds it in the fork server, which imports PRELOAD. An exec worker
    (``python -m dptrain.run``) freezes what it imported before it starts, with the collector still running, and
    imported alone it freezes nothing (a test suite imports it)."""
    code = ("import contextlib, gc, importlib, io, runpy, sys, dptrain.run; dcp = 'torch.distributed.checkpoint'; "
            "print(dcp in sys.modules, gc.get_freeze_count()); sys.argv = ['dptrain.run', '--help']\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    runpy.run_module('dptrain.run', run_name='__main__')\n"
            "print(gc.get_freeze_count() > 100_000, gc.isenabled())\n"
            f"[importlib.import_module(m) for m in {PRELOAD!r}]; print(dcp in sys.modules, "
            "'torch.distributed.checkpoint.state_dict' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0", "True", "True", "True", "True"], out.stdout + out.stderr


def test_the_command_freezes_at_exit_once_however_often_it_runs(monkeypatch) -> None:
    """What the ``dptrain`` command calls so that its exit walks none of torch's objects (dptrain.utils.collector)
    registers ``gc.freeze`` with atexit once, however many commands a process (a test suite) runs: checked on a
    stand-in for atexit's registry, as documented (``unregister`` removes every registration of the function).
    What the freeze saves is measured by docs/repro/exit_cost.py, not here."""
    import gc
    import types

    import dptrain.utils.collector as collector

    registry: list = []
    fake = types.SimpleNamespace(register=registry.append,
                                 unregister=lambda f: registry.__setitem__(slice(None), [g for g in registry if g != f]))
    monkeypatch.setattr(collector, "atexit", fake)
    freeze_at_exit()
    freeze_at_exit()
    assert registry == [gc.freeze]


def _collector(rank: int, world_size: int) -> tuple[bool, int]:
    import gc

    return gc.isenabled(), gc.get_freeze_count()


def test_a_forked_rank_collects_its_own_garbage_and_never_walks_what_the_server_preloaded() -> None:
    """The fork server preloads with the collector paused (dptrain.launch.paused, first) and freezes what it imported
    (dptrain.launch.frozen, last), which starts the collector again: a worker left without one would never free a
    reference cycle."""
    for enabled, frozen in run_on_ranks(_collector, 2):
        assert enabled and frozen > 100_000, (enabled, frozen)


def test_the_collector_paused_is_restored_as_it_was_even_after_an_error() -> None:
    import gc

    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        assert not gc.isenabled()
        raise KeyError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()


def test_a_worker_ends_with_its_code_after_its_threads_handlers_and_files_but_without_the_teardown(tmp_path) -> None:
    """``exit_worker`` (the end of ``python -m dptrain.run`` and the probes' workers): a non-daemon thread still
    writing is waited for, an atexit handler runs, a file left open unflushed is flushed, the exit code is the
    worker's; and nothing of the interpreter's teardown runs (an object's ``__del__`` at exit does not)."""
    out, torn = tmp_path / "out.txt", tmp_path / "torn"
    code = (f"import atexit, os, threading, time\nfrom dptrain.utils.worker_exit import exit_worker\n"
            f"f = open({str(out)!r}, 'w', buffering=1 << 20)\n"
            "def late():\n    time.sleep(0.2); f.write('thread\\n')\n"
            "threading.Thread(target=late).start()\n"
            "atexit.register(lambda: f.write('atexit\\n'))\n"
            f"class Torn:\n    def __del__(self, mk=os.open, path={str(torn)!r}): mk(path, os.O_CREAT | os.O_WRONLY)\n"
            "kept = Torn()\nf.write('main\\n')\nexit_worker(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert out.read_text().split() == ["main", "thread", "atexit"]
    assert not torn.exists()  # an exit with the teardown (sys.exit) makes it
