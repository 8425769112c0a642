"""``dptrain launch`` takes torchrun's flags: a torchrun command line with ``torchrun`` replaced by ``dptrain launch``.

In process: each flag, in each spelling, reaches the launcher as the settings it names
(``_start`` is replaced by a recorder: nothing starts), and each refused one is one line,
exit 2, naming it. Against torchrun itself (fresh interpreters, slow): one script records
its environment and argv under torchrun and under ``dptrain launch`` with the same flags,
and the two agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import dptrain.cli.launch as cli_launch
from dptrain.launch.elastic import Nodes, torchrun_command
from dptrain.launch.local import free_port
from dptrain.launch.script import MASTER_ADDR_ENV, MASTER_PORT_ENV, torchrun_env_from_local
from dptrain.launch.torchrun_flags import TorchrunFlagError, nnodes_count, nproc_per_node, split_torchrun_flags

SLURM = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_NODEID",
         "SLURM_JOB_ID")


@pytest.fixture
def started(tmp_path, monkeypatch):
    """``dptrain launch ARGS`` in process, in tmp_path with a train.py; returns (result, what _start was given)."""
    monkeypatch.chdir(tmp_path)
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    seen = {}

    def record(nproc, worker_args, run_dir, max_restarts, nodes, env, timeout_s, start_method, shown, lock_fd,
               torchrun):
        seen.update(nproc=nproc, worker_args=worker_args, run_dir=run_dir, max_restarts=max_restarts, nodes=nodes,
                    start_method=start_method, shown=shown, torchrun=torchrun,
                    env={**env, **({} if max_restarts or nodes else cli_launch._torchrun_env(torchrun))})
        return 0

    monkeypatch.setattr(cli_launch, "_start", record)

    def run(*args: str):
        result = CliRunner().invoke(cli_launch.launch, list(args))
        return result, seen
    return run


@pytest.mark.parametrize("args, nproc", [
    (["--nproc-per-node", "2"], 2), (["--nproc_per_node", "3"], 3), (["--nproc_per_node=4"], 4),
    (["--nproc-per-node=2"], 2), (["--nproc", "2"], 2),
    (["--nproc-per-node", "cpu"], len(os.sched_getaffinity(0))),
])
def test_nproc_per_node_is_nproc(started, args, nproc):
    result, seen = started(*args, "train.py", "--lr", "1")
    assert result.exit_code == 0, result.output
    assert seen["nproc"] == nproc and seen["nodes"] is None and seen["max_restarts"] == 0
    assert seen["worker_args"] == ["train.py", "--lr", "1"]


def test_nproc_per_node_by_device():
    import torch

    cores = len(os.sched_getaffinity(0))
    assert nproc_per_node("auto") == (torch.accelerator.device_count() if torch.accelerator.is_available() else cores)
    if torch.cuda.is_available():
        assert nproc_per_node("gpu") == torch.cuda.device_count()
    else:
        with pytest.raises(TorchrunFlagError, match="--nproc-per-node gpu: this machine has no GPU"):
            nproc_per_node("gpu")
    with pytest.raises(TorchrunFlagError, match="--nproc-per-node 'two' is not a number"):
        nproc_per_node("two")
    assert nnodes_count("3") == 3 and nnodes_count("2:2") == 2
    with pytest.raises(TorchrunFlagError, match="--nproc-per-node needs a value"):
        split_torchrun_flags(["--nproc_per_node"], {})


def test_the_scripts_own_options_stay_the_scripts(started):
    args = ["--nproc_per_node", "5", "--tee", "1", "--no-python", "-m", "x", "--", "y"]
    result, seen = started("--nproc_per_node=2", "train.py", *args)
    assert result.exit_code == 0, result.output
    assert seen["nproc"] == 2 and seen["worker_args"] == ["train.py", *args]


def test_one_machine_runs_under_the_local_launcher(started, tmp_path):
    result, seen = started("--nnodes", "1:1", "--node_rank", "0", "--nproc-per-node", "2", "--max_restarts", "0",
                           "--run_path", "--log_dir", "logs_here", "--start_method", "spawn", "train.py")
    assert result.exit_code == 0, result.output
    assert (seen["nodes"], seen["nproc"], seen["start_method"]) == (None, 2, "exec")
    assert seen["run_dir"] == tmp_path / "logs_here"
    env = seen["env"]
    assert (env["ROLE_NAME"], env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_RESTART_COUNT"],
            env["TORCHELASTIC_MAX_RESTARTS"]) == ("default", "none", "0", "0")
    assert MASTER_ADDR_ENV not in env and MASTER_PORT_ENV not in env


def test_standalone_ignores_the_rendezvous_flags_as_torchrun_does(started):
    result, seen = started("--standalone", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv_id", "j",
                           "--nproc_per_node", "2", "train.py")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] is None
    assert "--standalone: --rdzv-backend and --rdzv-id ignored" in result.output
    assert len(seen["env"]["TORCHELASTIC_RUN_ID"]) == 36  # a fresh uuid, as torchrun's


def test_master_addr_and_port_are_the_static_rendezvous(started):
    result, seen = started("--master_addr", "127.0.0.1", "--master-port=29555", "--nproc-per-node", "2",
                           "--rdzv-id", "job1", "--role", "trainer", "train.py")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] is None
    env = seen["env"]
    assert (env[MASTER_ADDR_ENV], env[MASTER_PORT_ENV]) == ("127.0.0.1", "29555")
    assert (env["TORCHELASTIC_RUN_ID"], env["ROLE_NAME"]) == ("job1", "trainer")
    # with restarts, torchrun's agent runs them, meeting where torchrun would
    result, seen = started("--master-addr", "127.0.0.1", "--master_port", "29555", "--max-restarts", "1",
                           "train.py")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] == Nodes(1, "127.0.0.1:29555", "dptrain", None, "static")
    result, seen = started("--master-addr", "node0", "--nnodes", "2", "--node-rank", "1", "--rdzv_id", "j",
                           "train.py")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] == Nodes(2, "node0:29500", "j", 1, "static")


def test_a_rendezvous_endpoint_goes_to_torchrun_agent(started):
    # torchtitan's run_train.sh, less its own options
    result, seen = started("--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                           "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "json.tool")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] == Nodes(1, "localhost:0", "dptrain", None, "c10d")
    assert seen["shown"] == frozenset({0}) and seen["worker_args"] == ["-m", "json.tool"]
    assert seen["torchrun"].agent_args == ("--role=rank",)
    result, seen = started("--nnodes=2:2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "job1", "--max_restarts=2",
                           "--rdzv_conf", "join_timeout=5", "--local_addr", "10.0.0.2", "--monitor_interval", "1",
                           "--module", "json.tool")
    assert result.exit_code == 0, result.output
    assert seen["nodes"] == Nodes(2, "h:29400", "job1", None, "c10d") and seen["max_restarts"] == 2
    assert seen["torchrun"].agent_args == ("--rdzv-conf=join_timeout=5", "--local-addr=10.0.0.2",
                                           "--monitor-interval=1.0")


@pytest.mark.parametrize("args, shown", [
    (["--tee", "3"], {0, 1}), (["-t", "3"], {0, 1}), (["-t3"], {0, 1}), (["--tee=0:3,1:0"], {0, 1}),
    (["--redirects", "3"], set()), (["-r", "0:3"], {1}), (["-r3", "--tee", "1:3"], {1}),
    (["--tee", "3", "--local_ranks_filter", "1"], {1}), (["--tee", "0"], {0, 1}), ([], None),
])
def test_tee_and_redirects_choose_the_terminal_ranks(started, args, shown):
    result, seen = started("--nproc-per-node", "2", *args, "train.py")
    assert result.exit_code == 0, result.output
    assert seen["shown"] == (None if shown is None else frozenset(shown))


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "1:4"], "--nnodes 1:4: dptrain launch runs a fixed number of machines"),
    (["--nnodes", "x"], "--nnodes 'x' is not N or MIN:MAX"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: etcd's rendezvous is not supported"),
    (["--rdzv_backend=etcd-v2"], "--rdzv-backend etcd-v2: etcd's rendezvous is not supported"),
    (["--rdzv-backend", "zk"], "--rdzv-backend zk: no rendezvous backend dptrain launch knows"),
    (["--no-python"], "--no-python is torchrun's, and dptrain launch does not support it"),
    (["--no_python"], "--no-python is torchrun's, and dptrain launch does not support it"),
    (["--numa-binding", "node"], "--numa-binding is torchrun's"),
    (["--virtual_local_rank"], "--virtual-local-rank is torchrun's"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not a number of workers"),
    (["--nproc-pernode", "2"], "no option --nproc-pernode (options go before the script"),
    (["--tee", "1"], "--tee 1: dptrain launch keeps a rank's stdout and stderr together"),
    (["-r", "0:2"], "--redirects 0:2: dptrain launch keeps"),
    (["--tee", "all"], "--tee 'all' is not torchrun's form"),
    (["--tee", "3", "--ranks", "all"], "--ranks and torchrun's --tee/--redirects/--local-ranks-filter"),
    (["--log-dir", "a", "--run-dir", "b"], "--log-dir and --run-dir both say where the logs go"),
    (["--master-port", "http"], "--master-port 'http' is not a TCP port"),
    (["--monitor-interval", "0"], "--monitor-interval '0' is not a positive number of seconds"),
    (["--standalone", "--nnodes", "2"], "--standalone runs one machine, but --nnodes 2"),
    (["--node-rank", "1", "--nnodes", "1"], "--node-rank 1 with one machine"),
    (["--standalone=1"], "--standalone=1: --standalone is a flag and takes no value"),
    (["--nproc-per-node", "1", "--nproc_per_node", "2"], "--nproc-per-node is given twice"),
    (["--start-method", "fork", "--start-method", "exec"], "--start-method is given twice"),
])
def test_a_refused_flag_is_one_line_exit_2(started, tmp_path, args, message):
    result, seen = started(*args, "train.py")
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.output.startswith("error: ") and not seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no run directory


def test_torchrun_agent_gets_the_flags_it_runs():
    command = torchrun_command(2, 1, ["train.py"], "dptrain.launch.script", Nodes(1, "h:1", "j", 0, "static"),
                               frozenset(), ("--role=r",))
    i = command.index("--nnodes=1")
    assert command[i:] == ["--nnodes=1", "--rdzv-backend=static", "--rdzv-endpoint=h:1", "--rdzv-id=j",
                           "--node-rank=0", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
                           "--redirects=3", "--role=r", "-m", "dptrain.launch.script", "train.py"]


def test_a_local_worker_completes_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", MASTER_ADDR_ENV: "10.0.0.1", MASTER_PORT_ENV: "29555"}
    assert torchrun_env_from_local(env) == {"ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
                                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"}
    assert env == {"RANK": "1", "WORLD_SIZE": "2"}  # the launcher's names leave the script's environment


# What torchrun's workers see: the script writes it, once per rank, to $ENV_OUT/rank<r>.json.
ENV_DUMP = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"]
    seen = {k: os.environ.get(k) for k in keys}
    seen["argv"] = sys.argv[1:]
    with open(os.path.join(os.environ["ENV_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
""")
SAME = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "argv"]


def _start_both(flags: list[str], tmp_path: Path, name: str, ports: tuple[int, int]):
    """torchrun and dptrain launch on the same command line (``{port}``: a free port each), started side by side."""
    env = {k: v for k, v in os.environ.items() if k not in SLURM}
    procs = {}
    for launcher, port in zip(("torchrun", "dptrain"), ports, strict=True):
        out = tmp_path / name / launcher
        out.mkdir(parents=True)
        line = [f.replace("{port}", str(port)).replace("{logs}", str(out / "logs")) for f in flags]
        head = ["torch.distributed.run"] if launcher == "torchrun" else ["dptrain.cli", "launch"]
        procs[launcher] = subprocess.Popen([sys.executable, "-m", *head, *line, "envdump.py", "--x", "1"],
                                           cwd=tmp_path, env=dict(env, ENV_OUT=str(out)), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
    return procs


def _seen(tmp_path: Path, name: str, launcher: str) -> list[dict]:
    return [json.loads((tmp_path / name / launcher / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_see_what_torchrun_workers_see(tmp_path):
    (tmp_path / "envdump.py").write_text(ENV_DUMP)
    lines = {
        "standalone": ["--standalone", "--nproc_per_node", "2", "--max_restarts", "0", "--log-dir", "{logs}"],
        "rendezvous": ["--nnodes", "1", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       "127.0.0.1:{port}", "--rdzv-id", "job1", "--max-restarts", "1", "--nproc_per_node=2",
                       "--log_dir={logs}", "--tee", "3"],
        "static": ["--master-addr", "127.0.0.1", "--master_port", "{port}", "--nnodes", "1", "--nproc-per-node",
                   "2", "--role", "trainer", "-r", "3", "--log-dir", "{logs}"],
    }
    for name, flags in lines.items():
        ports = (free_port(), free_port())
        procs = _start_both(flags, tmp_path, name, ports)
        for launcher, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"{launcher} {name}:\n{out}"
        torchrun, ours = _seen(tmp_path, name, "torchrun"), _seen(tmp_path, name, "dptrain")
        for rank in range(2):
            assert {k: ours[rank][k] for k in SAME} == {k: torchrun[rank][k] for k in SAME}, (name, rank)
            assert ours[rank]["argv"] == ["--x", "1"]
            for seen in (torchrun, ours):  # the rendezvous: set, and the same on every rank
                assert seen[rank]["MASTER_ADDR"] and seen[rank]["MASTER_PORT"].isdigit()
                assert (seen[rank]["MASTER_PORT"], seen[rank]["TORCHELASTIC_RUN_ID"]) == \
                    (seen[0]["MASTER_PORT"], seen[0]["TORCHELASTIC_RUN_ID"])
        if name == "static":  # where --master-addr and --master-port say, on both
            for seen, port in zip((torchrun, ours), ports, strict=True):
                assert (seen[0]["MASTER_ADDR"], seen[0]["MASTER_PORT"]) == ("127.0.0.1", str(port))
            assert ours[0]["ROLE_NAME"] == "trainer"
        if name != "standalone":  # a uuid otherwise, a new one each run
            assert ours[0]["TORCHELASTIC_RUN_ID"] == torchrun[0]["TORCHELASTIC_RUN_ID"]
    assert (tmp_path / "static" / "dptrain" / "logs" / "logs" / "rank0.console").is_file()  # -r 3: in the log
