"""The cases of issue 45 (trust, second pass), run against one checkout: what each does, in one line each.

    python docs/repro/trust_cases.py --src /path/to/checkout --work /tmp/trust [--cases lock-exec,symlink-lock,...]

Every case runs ``python -m dptrain.cli`` from ``--src``'s ``src/`` (PYTHONPATH), in a directory of its own
under ``--work``, on the tiny GPT of ``docs/repro/tiny_hang.toml``, and prints ``case: outcome``. Run it on
the commit before the change and after (docs/reliability.md, "Trust, second pass", shows both). Some cases
need root (a tmpfs for the full disk, a read-only bind mount); they say so where they cannot run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CFG = HERE / "tiny_hang.toml"


class Case:
    def __init__(self, src: Path, work: Path):
        self.src, self.work = src, work
        self.env = dict(os.environ, PYTHONPATH=str(src / "src"))
        self.env.pop("DPTRAIN_FAULT", None)

    def cli(self, *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
        return subprocess.run([sys.executable, "-m", "dptrain.cli", *args], cwd=cwd or self.work, text=True,
                              capture_output=True, timeout=timeout, env=dict(self.env, **(env or {})))

    def start(self, *args: str, cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "dptrain.cli", *args], cwd=cwd or self.work, env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finished_run(self, name: str, *extra: str) -> Path:
        run = self.work / name
        done = self.cli("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(run), "--set", "train.steps=20",
                        "--set", "checkpoint.every=10", *extra)
        assert done.returncode == 0, done.stderr
        return run

    def resume(self, run: Path, *extra: str, timeout: float = 300):
        return self.cli("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(run), "--set", "train.steps=30",
                        "--set", "checkpoint.every=10", *extra, timeout=timeout)


def first_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    error = next((line for line in lines if line.startswith("error")), lines[-1] if lines else "")
    tb = " (with a traceback)" if "Traceback" in proc.stderr else ""
    return f"exit {proc.returncode}{tb}: {error[:160]}"


def job_pids(cwd: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if os.readlink(proc / "cwd") != str(cwd) or "State:\tZ" in (proc / "status").read_text():
                continue
            argv = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"dptrain" in argv or b"forkserver" in argv or b"torch.distributed.run" in argv:
            pids.append(int(proc.name))
    return pids


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "gone"


# ----------------------------------------------------------------------------------------------- the cases

def killed_launcher(c: Case, how: list[str]) -> str:
    """1: kill -9 of dptrain run after it trains; the same command again at once."""
    cwd = c.work / ("kill-" + how[0].strip("-"))
    cwd.mkdir()
    args = ["run", "--config", str(CFG), "--nproc", "2", "--run-dir", "R", "--set", "train.steps=6000",
            "--set", "checkpoint.every=300", *how]
    first = c.start(*args, cwd=cwd)
    while not (cwd / "R" / "metrics.jsonl").exists() and first.poll() is None:
        time.sleep(0.2)
    time.sleep(3)
    first.kill()
    first.wait()
    second = c.start(*args, "--set", "train.steps=40", cwd=cwd)
    time.sleep(8)
    alive = [p for p in job_pids(cwd) if p != second.pid]
    try:
        second.wait(timeout=120)
    except subprocess.TimeoutExpired:
        second.kill()
    err = second.stderr.read()
    for pid in job_pids(cwd):
        os.kill(pid, signal.SIGKILL)
    verdict = "refused" if second.returncode == 2 else f"ran (exit {second.returncode})"
    return (f"second run {verdict}; processes of the first still running 8 s after the kill: {len(alive)}"
            + (f"; {err.strip().splitlines()[-1][:120]}" if second.returncode == 2 and err.strip() else ""))


def symlink(c: Case, name: str) -> str:
    """2: a link planted where the run writes, then the run resumed."""
    run = c.finished_run("link-" + name.replace("/", "-"))
    victim = c.work / f"victim-{name.replace('/', '-')}"
    victim.write_text("precious\n")
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)
    done = c.resume(run)
    text = victim.read_text()
    return f"{first_error(done) if done.returncode else 'exit 0'}; victim: " + (
        "intact" if text == "precious\n" else f"{len(text)} B now ({text[:20]!r}...)")


def long_eval(c: Case) -> str:
    """3: one evaluation longer than timeout + roll call + 3 s (the issue's command)."""
    done = c.cli("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(c.work / "eval"), "--set", "train.steps=4",
                 "--set", "gpt.n_embd=256", "--set", "gpt.n_layer=4", "--set", "gpt.n_head=4", "--set",
                 "gpt.block_size=64", "--set", "gpt.corpus_bytes=4000000", "--set", "log.eval_every=2", "--set",
                 "log.eval_batches=100000", timeout=900)
    return first_error(done) if done.returncode else "exit 0: trained and evaluated"


def long_accumulation(c: Case) -> str:
    """3: one optimizer step of 1,024 micro-steps longer than the watchdog's wait."""
    done = c.cli("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(c.work / "accum"), "--set",
                 "train.steps=2", "--set", "train.global_batch_size=4096", "--set", "train.micro_batch_size=1",
                 "--set", "gpt.n_embd=128", "--set", "gpt.block_size=64", "--set", "gpt.corpus_bytes=4000000",
                 timeout=900)
    return first_error(done) if done.returncode else "exit 0"


def full_disk(c: Case) -> str:
    """4: the run directory's file system fills while the run trains."""
    mount = c.work / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)]).returncode:
        return "not run (mounting a tmpfs needs root)"
    try:
        job = c.start("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(mount / "R"), "--set",
                      "train.steps=600", "--set", "log.every=1000")
        while not (mount / "R" / "logs" / "rank1.heartbeat").exists() and job.poll() is None:
            time.sleep(0.2)
        time.sleep(2)
        with open(mount / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        job.wait(timeout=300)
        err = job.stderr.read()
        said = [line for line in err.splitlines() if "SIGSTOP" in line or "is full" in line] or \
            [line for line in err.splitlines() if line.startswith("error")]
        return f"exit {job.returncode}: " + " / ".join(s.strip()[:110] for s in said[:2])
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def torn_metrics(c: Case) -> str:
    """5: a partial last line in metrics.jsonl, then a resume."""
    run = c.finished_run("torn")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 25, "lo')
    done = c.resume(run)
    return first_error(done) if done.returncode else "exit 0: resumed (" + (
        "with a note" if "no whole record" in done.stdout + done.stderr else "silently") + ")"


def stray_checkpoint(c: Case, kind: str) -> str:
    """6: a stray checkpoints/step_99999999, then a resume with keep_last 1."""
    run = c.finished_run("stray-" + kind.replace(" ", "-"))
    root = run / "checkpoints"
    name = "step_" + "\u0669" * 8 if kind == "unicode digits" else "step_99999999"
    if kind in ("copy", "unicode digits"):
        shutil.copytree(root / "step_00000020", root / name)
    elif kind == "symlink":
        (root / name).symlink_to(root / "step_00000020")
    else:
        (root / name).write_text("x")
    done = c.resume(run, "--set", "checkpoint.keep_last=1")
    out = done.stdout + done.stderr
    at = next((line.split("resumed from ")[1][:60] for line in out.splitlines() if "resumed from" in line), "-")
    kept = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    return f"{first_error(done) if done.returncode else 'exit 0'}; resumed from {at}; checkpoints/ now {kept}"


def lock_file_removed(c: Case) -> str:
    """7: rm R/.lock while a run trains, then a second run on R."""
    cwd = c.work / "rmlock"
    cwd.mkdir()
    first = c.start("run", "--config", str(CFG), "--nproc", "2", "--run-dir", "R", "--set", "train.steps=4000",
                    cwd=cwd)
    while not (cwd / "R" / "metrics.jsonl").exists() and first.poll() is None:
        time.sleep(0.2)
    (cwd / "R" / ".lock").unlink()
    second = c.start("run", "--config", str(CFG), "--nproc", "2", "--run-dir", "R", "--set", "train.steps=4000",
                     cwd=cwd)
    try:
        second.wait(timeout=15)
        verdict = f"second run exit {second.returncode}: {second.stderr.read().strip()[:120]}"
    except subprocess.TimeoutExpired:
        verdict = "second run started beside the first"
    for proc in (first, second):
        proc.kill()
    for pid in job_pids(cwd):
        os.kill(pid, signal.SIGKILL)
    return verdict


def nested_launch(c: Case) -> str:
    """7: a script under dptrain launch that starts python -m dptrain.run on the launch's own run directory."""
    cwd = c.work / "nested"
    cwd.mkdir()
    script = cwd / "sweep.py"
    script.write_text(f"import subprocess, sys\nr = subprocess.run([sys.executable, '-m', 'dptrain.run', '--config', "
                      f"{str(CFG)!r}, '--run-dir', 'R', '--set', 'train.steps=4'])\nprint('nested exit', r.returncode)\n")
    done = c.cli("launch", "--nproc", "1", "--run-dir", "R", str(script), cwd=cwd)
    nested = next((line for line in done.stdout.splitlines() if line.startswith("nested exit")), "?")
    wrote = sorted(p.name for p in (cwd / "R").iterdir())
    return f"{nested}; the launch's run directory holds {wrote}"


def meta_names(c: Case, name: str) -> str:
    """8: meta.json naming a file outside the checkpoint (or a FIFO, /dev/zero), then a resume."""
    run = c.finished_run("meta-" + name.strip("/").replace("/", "-"))
    ckpt = run / "checkpoints" / "step_00000020"
    target = name
    if name == "FIFO":
        os.mkfifo(c.work / "fifo")
        target = str(c.work / "fifo")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][target] = "0" * 64
    (ckpt / "meta.json").write_text(json.dumps(meta))
    t0 = time.monotonic()
    try:
        done = c.resume(run, timeout=60)
    except subprocess.TimeoutExpired:
        return "blocked: killed after 60 s"
    return f"{first_error(done)} ({time.monotonic() - t0:.1f} s)"


def refused_trainer(c: Case) -> str:
    """9: a trainer.pt that weights_only refuses (checksum rewritten to match)."""
    run = c.finished_run("trainer")
    ckpt = run / "checkpoints" / "step_00000020"
    code = ("import torch, collections; torch.save({'step': 20, 'rng': collections.OrderedDict(a=slice(1))}, "
            f"{str(ckpt / 'trainer.pt')!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["trainer.pt"] = hashlib.sha256((ckpt / "trainer.pt").read_bytes()).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps(meta))
    before = sorted(p.name for p in (run / "logs").iterdir())
    done = c.resume(run)
    after = sorted(p.name for p in (run / "logs").iterdir())
    return f"{first_error(done)}; logs/ {'unchanged' if before == after else 'written'}"


def omp(c: Case, value: str) -> str:
    """9: OMP_NUM_THREADS set to what torch tolerates but is no count."""
    done = c.cli("run", "--config", str(CFG), "--nproc", "2", "--run-dir", str(c.work / f"omp{value or 'empty'}"),
                 "--set", "train.steps=4", env={"OMP_NUM_THREADS": value})
    return first_error(done) if done.returncode else "exit 0" + (
        " with a warning" if "OMP_NUM_THREADS" in done.stderr else "")


def read_only(c: Case) -> str:
    """9: an existing run directory on a read-only mount."""
    run = c.finished_run("readonly")
    if subprocess.run(["mount", "--bind", "-o", "ro", str(run), str(run)]).returncode:
        return "not run (a read-only bind mount needs root)"
    try:
        done = c.resume(run)
        return f"{first_error(done)}; {len(done.stderr.splitlines())} lines"
    finally:
        subprocess.run(["umount", "-l", str(run)])


def deep_toml(c: Case) -> str:
    """10: a TOML nested 10,000 deep."""
    (c.work / "deep.toml").write_text("x = " + "[" * 10000 + "]" * 10000)
    return first_error(c.cli("run", "--config", "deep.toml"))


def huge_config(c: Case) -> str:
    """10: a 50 MB config whose one value the run does not use (so a warning echoes it)."""
    (c.work / "huge.toml").write_text('[data]\ntext = ["' + "x" * (50 << 20) + '"]\n')
    done = c.cli("run", "--config", "huge.toml", "--run-dir", str(c.work / "huge"), "--set", "train.steps=2")
    config = c.work / "huge" / "config.toml"
    copied = f"; config.toml {config.stat().st_size:,} bytes" if config.exists() else "; nothing written"
    return f"{first_error(done) if done.returncode else 'exit 0'}; stderr {len(done.stderr):,} bytes{copied}"


def stranger_store(c: Case) -> str:
    """10: the store's port taken by another process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(c.env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        done = subprocess.run([sys.executable, "-m", "dptrain.run", "--config", str(CFG), "--run-dir",
                               str(c.work / "port"), "--set", "train.steps=2"], env=env, capture_output=True,
                              text=True, timeout=120, cwd=c.work)
    return first_error(done)


def torchrun_stop(c: Case) -> str:
    """10: rank 1 stopped (SIGSTOP) under plain torchrun: how long until the job ends."""
    run = c.work / "R"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "dptrain.run", "--config", str(CFG), "--run-dir", str(run)], cwd=c.work, env=c.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    beat = run / "logs" / "rank1.heartbeat"
    while job.poll() is None:
        try:
            record = json.loads(beat.read_text())
            if record.get("step", 0) >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(record["pid"], signal.SIGSTOP)
    try:
        code = job.wait(timeout=180)
    except subprocess.TimeoutExpired:
        job.kill()
        return "still running 180 s after the SIGSTOP"
    return f"exit {code}, {time.monotonic() - t0:.1f} s after the SIGSTOP (distributed.timeout_s 10, roll call 1 s)"


CASES = {
    "lock-exec": lambda c: killed_launcher(c, ["--start-method", "exec"]),
    "lock-restarts": lambda c: killed_launcher(c, ["--max-restarts", "1"]),
    "symlink-lock": lambda c: symlink(c, ".lock"),
    "symlink-log": lambda c: symlink(c, "logs/rank0.log"),
    "symlink-console": lambda c: symlink(c, "logs/rank1.console"),
    "long-eval": long_eval,
    "long-accumulation": long_accumulation,
    "full-disk": full_disk,
    "torn-metrics": torn_metrics,
    "stray-copy": lambda c: stray_checkpoint(c, "copy"),
    "stray-symlink": lambda c: stray_checkpoint(c, "symlink"),
    "stray-file": lambda c: stray_checkpoint(c, "file"),
    "stray-unicode": lambda c: stray_checkpoint(c, "unicode digits"),
    "rm-lock": lock_file_removed,
    "nested-launch": nested_launch,
    "meta-absolute": lambda c: meta_names(c, "/etc/hostname"),
    "meta-dotdot": lambda c: meta_names(c, "../../../../etc/hostname"),
    "meta-dev-zero": lambda c: meta_names(c, "/dev/zero"),
    "meta-fifo": lambda c: meta_names(c, "FIFO"),
    "trainer-refused": refused_trainer,
    "omp-abc": lambda c: omp(c, "abc"),
    "omp-empty": lambda c: omp(c, ""),
    "read-only": read_only,
    "deep-toml": deep_toml,
    "huge-config": huge_config,
    "store-port": stranger_store,
    "torchrun-stop": torchrun_stop,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="the checkout to run (its src/ goes on PYTHONPATH)")
    parser.add_argument("--work", type=Path, required=True, help="a scratch directory (emptied first)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names; default: all")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    for name in args.cases.split(","):
        work = args.work / name
        work.mkdir(parents=True)
        t0 = time.monotonic()
        try:
            outcome = CASES[name](Case(args.src.resolve(), work))
        except Exception as e:  # noqa: BLE001 - a case that could not be run says so, and the rest go on
            outcome = f"could not run: {type(e).__name__}: {e}"
        print(f"{name}: {outcome}  [{time.monotonic() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
