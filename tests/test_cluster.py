"""dptrain cluster: setup, a real two-host rendezvous through rate-limited links, teardown (root only)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from dptrain.cli import main
from dptrain.cluster import Network, NetworkError, check_root, run_on_cluster
from dptrain.cluster.netns import PREFIX, namespaces


def _root_reason() -> str | None:
    try:
        check_root()
    except NetworkError as e:
        return str(e)
    return None


needs_root = pytest.mark.skipif(_root_reason() is not None, reason=f"needs root: {_root_reason()}")


def test_bad_network_arguments_are_refused_before_anything_is_created() -> None:
    with pytest.raises(ValueError, match="link rate must be > 0"):
        Network(2, rate_mbit=0)
    with pytest.raises(ValueError, match="at least one host"):
        Network(0, rate_mbit=100)


@needs_root
def test_up_creates_limited_links_and_down_removes_everything() -> None:
    net = Network(3, rate_mbit=50)
    with net:
        assert {net.switch, net.host(0), net.host(1), net.host(2)} <= set(namespaces())
        qdisc = subprocess.run(["ip", "netns", "exec", net.host(1), "tc", "qdisc", "show", "dev", net.interface(1)],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
        addrs = subprocess.run(["ip", "-n", net.host(2), "-4", "addr"], capture_output=True, text=True).stdout
        assert "10.213.0.3/24" in addrs
    assert not [n for n in namespaces() if n.startswith(f"{PREFIX}{net.tag}")]


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(180)
def test_two_hosts_rendezvous_and_all_reduce(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        out = os.path.join(sys.argv[1], f"host{os.environ['DPTRAIN_CLUSTER_HOST']}")
        open(out, "w").write(f"{dist.get_world_size()} {x.item()}")
        dist.destroy_process_group()
    """))
    with Network(2, rate_mbit=100) as net:
        code = run_on_cluster(net, 1, [str(script), str(tmp_path)], timeout=150, env={"OMP_NUM_THREADS": "1"})
    assert code == 0
    assert (tmp_path / "host0").read_text() == (tmp_path / "host1").read_text() == "2 3.0"


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(180)
def test_a_failing_job_ends_the_others_and_tears_down(tmp_path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['DPTRAIN_CLUSTER_HOST'] == '1': sys.exit(3)\n"
                      "time.sleep(600)\n")
    with Network(2, rate_mbit=100) as net:
        code = run_on_cluster(net, 1, [str(script)], timeout=150)
        tag = net.tag
    assert code != 0
    assert not [n for n in namespaces() if n.startswith(f"{PREFIX}{tag}")]


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(180)
def test_a_live_job_restarts_the_failed_worker_alone(tmp_path) -> None:
    """live_restarts: the live store on host 0, each host's worker under a torchrun of its own; host 1's worker
    fails in its first life and is restarted alone while host 0's waits for it through the store."""
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent("""
        import os, sys, datetime, torch.distributed as dist
        host, port = os.environ["DPTRAIN_LIVE_STORE"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
        replica, life = os.environ["DPTRAIN_REPLICA_ID"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        store.add(f"lives/{replica}", 1)
        if replica == "1" and life == "0":
            sys.exit(5)
        store.wait([f"done/{1 - int(replica)}"] if replica == "0" else [])
        store.set(f"done/{replica}", "1")
        lives = store.add(f"lives/{replica}", 0)
        open(os.path.join(sys.argv[1], f"replica{replica}"), "w").write(f"{os.environ['DPTRAIN_REPLICAS']} {lives}")
    """))
    with Network(2, rate_mbit=100) as net:
        code = run_on_cluster(net, 1, [str(script), str(tmp_path)], timeout=150, env={"OMP_NUM_THREADS": "1"},
                              live_restarts=1)
    assert code == 0
    assert (tmp_path / "replica0").read_text() == "2 1" and (tmp_path / "replica1").read_text() == "2 2"


def test_cluster_command_without_a_job_or_without_root() -> None:
    out = CliRunner().invoke(main, ["cluster", "--hosts", "2"])
    assert out.exit_code == 2
    reason = _root_reason()
    assert (reason in out.output) if reason else ("give the job to run" in out.output)


@pytest.mark.skipif(_root_reason() is None, reason="checks the message where root or iproute2 is missing")
def test_cluster_command_says_what_is_missing() -> None:
    out = subprocess.run([sys.executable, "-c", "from dptrain.cli import main; main()", "cluster", "--", "x.py"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "dptrain cluster needs" in out.stderr


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(300)
def test_compression_link_benchmark_runs_every_variant_on_the_cluster() -> None:
    from dptrain.bench.compression_link import VARIANTS, run, table

    result = run(1.0, rounds=1, steps=1, warmup=2, n_embd=32, n_layer=1, block_size=16, micro_batch=1, timeout=240)
    assert set(result["median_step_s"]) == set(VARIANTS)
    assert all(t > 0 for t in result["median_step_s"].values())
    sent = result["bytes_per_step"]
    sent_bytes = [sent[f"dptrain/{codec}"]["sent_bytes"] for codec in ("powersgd", "int8", "fp16")]
    assert sent_bytes == sorted(sent_bytes) and len(set(sent_bytes)) == 3
    assert "torch/powerSGD_hook" in table(result)
    assert all(result["spans_s"]["dptrain/int8"][kind] > 0 for kind in ("encode", "communicate", "decode"))
