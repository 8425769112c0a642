"""Where a worker stands, from torchrun's or Slurm's environment."""

import os

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
