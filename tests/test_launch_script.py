"""``dptrain launch``: a user's own script on N workers (issue 26).

A plain torch DDP script (nothing from dptrain in it) trains on 2 ranks; a failing rank
is reported first, with its traceback, and the job ends instead of hanging; a restart
under ``--max-restarts``; ``-m`` modules; Slurm's variables; bad input exits 2 with
nothing written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dptrain.cli.launch import launch
from dptrain.launch.elastic import Nodes, slurm_nodes, torchrun_command
from dptrain.launch.script import torchrun_env_from_slurm

pytestmark = pytest.mark.slow  # fresh interpreters: torchrun's, or exec workers

# Ordinary torch DDP, as users write it: env:// rendezvous from torchrun's variables.
PLAIN_DDP = textwrap.dedent('''
    import argparse, atexit, os
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)           # each rank its own batches
    for step in range(args.steps):
        if rank == args.fail_rank and step == 1:
            raise ValueError(f"bad batch on rank {rank} at step {step}")
        loss = model(torch.randn(8, 4, generator=data)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
    out = os.path.join(os.environ["DPTRAIN_RUN_DIR"], f"params{rank}")
    torch.save({"params": model.module.state_dict(), "steps": args.steps, "name": __name__}, out + ".pt")
    log = open(out + ".log", "w")                        # never closed: flushed as the interpreter would
    log.write(f"rank {rank} trained {args.steps} steps")
    atexit.register(print, f"rank {rank}: atexit handler ran")
    dist.destroy_process_group()                         # the bare call: the worker must still end cleanly
''')


def _launch(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain.cli", "launch", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(150)
def test_a_plain_torch_ddp_script_trains_on_two_workers(tmp_path):
    (tmp_path / "train.py").write_text(PLAIN_DDP)
    proc = _launch(["--nproc", "2", "--run-dir", "run", "train.py", "--steps", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: atexit handler ran" in proc.stdout
    assert "rank 1: atexit handler ran" in (tmp_path / "run" / "logs" / "rank1.console").read_text()
    assert [(tmp_path / "run" / f"params{r}.log").read_text() for r in range(2)] == [
        "rank 0 trained 4 steps", "rank 1 trained 4 steps"]
    saved = [torch.load(tmp_path / "run" / f"params{r}.pt") for r in range(2)]
    assert all(s["steps"] == 4 and s["name"] == "__main__" for s in saved)  # its arguments, run as __main__
    for name, value in saved[0]["params"].items():  # different data, all-reduced gradients: the same replica
        assert torch.equal(value, saved[1]["params"][name]), name
    assert not torch.equal(saved[0]["params"]["weight"], _initial_weight())  # and it trained


def _initial_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).weight.detach()


@pytest.mark.timeout(150)
def test_the_rank_that_failed_first_is_reported_first_and_the_job_ends(tmp_path):
    (tmp_path / "train.py").write_text(PLAIN_DDP)
    proc = _launch(["--nproc", "2", "--run-dir", "run", "train.py", "--fail-rank", "1", "--steps", "50"],
                   tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    assert "error: rank 1 failed first:" in err, err
    cause = err.index("ValueError: bad batch on rank 1 at step 1")
    assert err.index('File "train.py"') < cause  # the script's own frames, not the runner's
    assert "runpy" not in err and "dptrain/launch/script.py" not in err
    assert cause < err.index("(rank 0 also failed:")  # rank 0 only lost its peer: listed after
    record = json.loads((tmp_path / "run" / "logs" / "rank1.error.json").read_text())
    assert record["summary"] == "ValueError: bad batch on rank 1 at step 1"
    assert "ValueError: bad batch" in (tmp_path / "run" / "logs" / "rank1.console").read_text()


FLAKY = textwrap.dedent('''
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if dist.get_rank() == 1 and attempt == 0:
        raise RuntimeError("rank 1 fails on the first attempt only")
    dist.barrier()
    print(f"rank {dist.get_rank()} finished on attempt {attempt}")
    dist.destroy_process_group()
''')


@pytest.mark.timeout(150)
def test_max_restarts_restarts_every_worker_under_torchrun(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    proc = _launch(["--nproc", "2", "--max-restarts", "1", "flaky.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"rank (\d) finished on attempt (\d)", proc.stdout)) == [("0", "1"), ("1", "1")]
    assert "rank 1 fails on the first attempt only" in proc.stderr  # torchrun shows the first attempt's failure
    assert (tmp_path / "runs" / "flaky" / "logs").is_dir()  # the default run directory


@pytest.mark.timeout(120)
def test_a_module_runs_as_python_m_would_with_forked_workers(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "job.py").write_text(textwrap.dedent('''
        import os, sys
        assert __name__ == "__main__"
        rank = os.environ["RANK"]
        with open(os.path.join(os.environ["DPTRAIN_RUN_DIR"], f"argv{rank}.json"), "w") as f:
            f.write(repr([sys.argv[1:], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]]))
        sys.exit(0)
    '''))
    proc = _launch(["--nproc", "2", "--start-method", "forkserver", "-m", "mypkg.job", "--x", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        seen = (tmp_path / "runs" / "job" / f"argv{rank}.json").read_text()
        assert seen == repr([["--x", "1"], "2", str(rank)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["nothere.py"], "no script 'nothere.py'"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    (["--nproc", "0", "train.py"], "--nproc must be at least 1, got 0"),
    (["--max-restarts", "-1", "train.py"], "--max-restarts must be >= 0, got -1"),
    (["--nnodes", "2", "train.py"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohostport", "train.py"], "is not HOST:PORT"),
    (["--node-rank", "1", "train.py"], "--rdzv-endpoint and --node-rank go with --nnodes N"),
    (["--slurm-step", "train.py"], "this Slurm step runs 8 tasks on 2 node(s)"),
    (["--nproc", "2", "--ranks", "2", "train.py"], "--ranks '2': ranks run from 0 to 1 with --nproc 2; [2] is outside"),
    (["--ranks", "zero", "train.py"], "--ranks takes 'all' or a comma-separated list of ranks"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    if args[0] == "--slurm-step":  # started by srun once per device, not once per node
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
        monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
        args = args[1:]
    result = CliRunner().invoke(launch, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no run directory


def test_one_launch_per_slurm_node_becomes_a_torchrun_rendezvous():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "4242"}
    nodes = slurm_nodes(env)
    assert nodes == Nodes(2, "gpu03:24242", "slurm-4242", 1)
    command = torchrun_command(8, 0, ["train.py", "--lr", "1"], "dptrain.launch.script", nodes)
    assert command[command.index("--nnodes=2"):] == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu03:24242", "--rdzv-id=slurm-4242",
        "--node-rank=1", "--nproc-per-node=8", "--max-restarts=0", "--monitor-interval=0.5",
        "-m", "dptrain.launch.script", "train.py", "--lr", "1"]
    assert slurm_nodes({"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu03"}) is None  # one node: local


def test_a_worker_started_by_srun_gets_torchrun_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    assert torchrun_env_from_slurm(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                            "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu03",
                                            "MASTER_PORT": "24242"}
    assert torchrun_env_from_slurm({**env, "RANK": "5"}) == {}  # torchrun's own variables win


TALKER = textwrap.dedent("""
    import os, sys
    rank = os.environ["RANK"]
    print(f"out of {rank}", flush=True)
    print(f"err of {rank}", file=sys.stderr, flush=True)
    sys.stdout.write(f"no newline at the end of {rank}")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["exec", "forkserver"])
def test_ranks_shows_each_chosen_ranks_lines_prefixed_and_keeps_every_console(tmp_path, start_method):
    (tmp_path / "talk.py").write_text(TALKER)
    done = _launch(["--nproc", "3", "--ranks", "0,2", "--start-method", start_method, "--run-dir", "run", "talk.py"],
                   tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 2):
        assert f"[rank {rank}] out of {rank}\n" in done.stdout
        assert f"[rank {rank}] err of {rank}\n" in done.stderr
        assert f"[rank {rank}] no newline at the end of {rank}\n" in done.stdout
    assert "of 1" not in done.stdout + done.stderr  # not chosen: its file only
    for rank in range(3):
        console = (tmp_path / "run" / "logs" / f"rank{rank}.console").read_text()
        assert f"out of {rank}" in console and f"err of {rank}" in console


@pytest.mark.timeout(120)
def test_by_default_rank_0_is_shown_as_it_is(tmp_path):
    (tmp_path / "talk.py").write_text(TALKER)
    done = _launch(["--nproc", "2", "--run-dir", "run", "talk.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "out of 0\n" in done.stdout and "[rank" not in done.stdout + done.stderr and "of 1" not in done.stdout


def test_ranks_under_torchrun_uses_its_tee_and_filter():
    command = torchrun_command(4, 1, ["talk.py"], "dptrain.launch.script", shown=frozenset({0, 3}))
    assert "--tee=3" in command and "--local-ranks-filter=0,3" in command
    assert command.index("--tee=3") < command.index("dptrain.launch.script")  # torchrun's option, not the script's
