"""The papercuts a new user hits first (issue 26): help that does not import torch, benchmarks
with their own --help, plan and simulate headers, samples/s for non-token tasks, the loss plot."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dptrain

_NO_TORCH = """
import sys
from dptrain.cli import main
try:
    main({args!r}, prog_name="dptrain")
except SystemExit as e:
    assert e.code in (0, None), e.code
assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'dptrain')))
"""


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["plan", "--help"], ["simulate", "--help"],
                                  ["bench", "--help"], ["explore", "--help"], ["prepare-data", "--help"],
                                  ["launch", "--help"], ["consolidate", "--help"]])
def test_help_does_not_import_torch(args):
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH.format(args=args)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: dptrain" in proc.stdout


def test_every_exported_name_still_imports_from_the_package():
    for name in dptrain.__all__:
        assert getattr(dptrain, name) is not None, name
    from dptrain import DDP, DistributedDataParallel

    assert DDP is DistributedDataParallel
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dptrain.nope  # noqa: B018


# --- dptrain bench NAME: each benchmark a click command with its own options -------------------------------------

# Every benchmark command line in docs/ and README.md, as written there (continuation lines joined).
DOCUMENTED_BENCH = [
    "dptrain bench async --steps 100 --rounds 2",
    'dptrain bench async --steps 100 --rounds 5 --variants DDP "PS async" "PS async, 2 servers" '
    "--out bench_results/async_servers.json",
    "dptrain bench async --workers 4 --steps 100 --rounds 1",
    'dptrain bench async --variants DDP "PS async" "PS async, look-ahead"',
    "dptrain bench cluster",
    "dptrain bench cluster-zero",
    "dptrain bench comm --world-size 2",
    "dptrain bench comm --world-size 4 --nodes 2 --max-size 4M --reps 8",
    "dptrain bench compression --steps 150",
    'dptrain bench compression --steps 600 --variants none "powersgd r4"',
    'dptrain bench compression --steps 150 --variants "powersgd r4" --set compression.powersgd_rank=8',
    'dptrain bench compression --steps 150 --variants none "topk 1%" "topk 1%+EF" --set train.optimizer=sgd '
    "--set train.lr=0.5 --set train.weight_decay=0",
    'dptrain bench compression --steps 150 --variants "topk 1%" "topk 1%+EF" --set compression.topk_fraction=0.1',
    "dptrain bench compression --steps 150 --out bench_results/compression_remedies_adamw.json --variants none "
    '"topk 1%+EF" "topk 1%+EF +warmup" "topk 1%+EF +clip" "topk 1%+EF +warmup +clip" "powersgd r4" '
    '"powersgd r4 +30 uncompressed" "powersgd r4 +r16 for 50" "powersgd r4 +30 uncompressed +r16 for 50"',
    "dptrain bench compression --steps 150 --out bench_results/compression_remedies_adamw_r8.json --variants none "
    '"powersgd r8 +30 uncompressed +r16 for 50"',
    "dptrain bench compression --steps 150 --out bench_results/compression_remedies_sgd.json --set "
    "train.optimizer=sgd --set train.lr=0.5 --set train.weight_decay=0 --variants none "
    '"topk 1%" "topk 1%+EF" "topk 1%+EF +warmup" "topk 1%+EF +clip" "topk 1% +MC" "topk 1% +MC (no masking)" '
    '"topk 1% DGC (+MC +clip +warmup)" "powersgd r4" "powersgd r4 +MC"',
    "dptrain bench compression-link --rate 1 --rounds 8",
    "dptrain bench ddp --model small-params --width 64 --depth 200 --micro-batch 8 --caps 25 --views --rounds 30 "
    "--steps 5",
    "dptrain bench ddp --caps 1 25 --rounds 10 --check-every",
    "dptrain bench faults",
    "dptrain bench gpu --rounds 15",
    "dptrain bench loader --rounds 5",
    "dptrain bench loader --rounds 5 --cold",
    "dptrain bench plan --world-size 2",
    "dptrain bench run-overhead --rounds 12",
    "dptrain bench zero --world-size 2",
    "python -m dptrain.bench.allocator --trials 6",
    "python -m dptrain.bench.cluster --rates 1 5 --buckets 1 4 25",
    "python -m dptrain.bench.cluster_zero --rate 1 --rounds 3",
    "python -m dptrain.bench.compression",
    "python -m dptrain.bench.compression_link",
    "python -m dptrain.bench.ddp --caps 25 --views --rounds 20",
    "python -m dptrain.bench.ddp --views --rounds 30",
    "python -m dptrain.bench.plan",
    "python -m dptrain.bench.plan --world-size 4 --strategies zero3 --shard-size 2",
    "python -m dptrain.bench.run_overhead --rounds 12",
    "python -m dptrain.bench.zero",
]


def _bench_command(line: str):
    """The click command a documented line runs, and its arguments."""
    import importlib
    import shlex

    from dptrain.cli.bench_group import BENCHMARKS

    words = shlex.split(line)
    if words[:2] == ["dptrain", "bench"]:
        return importlib.import_module(BENCHMARKS[words[2]]).main, words[3:]
    assert words[:2] == ["python", "-m"], line
    return importlib.import_module(words[2]).main, words[3:]


@pytest.mark.parametrize("line", DOCUMENTED_BENCH)
def test_every_documented_bench_command_line_still_parses(line):
    command, args = _bench_command(line)
    ctx = command.make_context("bench", args)  # parses and converts every value; runs nothing
    if "--caps 1 25" in line:
        assert ctx.params["caps"] == (1.0, 25.0)
    if '"PS async, 2 servers"' in line:
        assert ctx.params["variants"] == ("DDP", "PS async", "PS async, 2 servers")
        assert ctx.params["out"].name == "async_servers.json" and ctx.params["rounds"] == 5
    if "--rates 1 5 --buckets 1 4 25" in line:
        assert ctx.params["rates"] == (1.0, 5.0) and ctx.params["buckets"] == (1.0, 4.0, 25.0)


def test_bench_help_lists_every_benchmark_on_one_line():
    from click.testing import CliRunner

    from dptrain.cli import main
    from dptrain.cli.bench_group import BENCHMARKS

    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    listed = result.output.split("Benchmarks:\n")[1].splitlines()
    assert [line.split()[0] for line in listed] == sorted(BENCHMARKS)
    assert "ddp               dptrain's DDP against torch's DDP" in result.output


@pytest.mark.parametrize("name", ["ddp", "zero", "comm", "async", "compression", "plan", "cluster", "cluster-zero",
                                  "compression-link", "gpu", "faults", "loader", "allocator", "run-overhead"])
def test_each_benchmark_shows_its_own_options_with_help(name):
    import click
    from click.testing import CliRunner

    from dptrain.cli import main

    result = CliRunner().invoke(main, ["bench", name, "--help"])
    assert result.exit_code == 0, result.output
    assert f"Usage: main bench {name} [OPTIONS]" in result.output and "[default: " in result.output
    command = _bench_command(f"dptrain bench {name}")[0]
    undocumented = [p.name for p in command.params if isinstance(p, click.Option) and not p.help]
    assert undocumented == []


def test_python_m_runs_the_same_benchmark_command():
    proc = subprocess.run([sys.executable, "-m", "dptrain.bench.ddp", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: python -m dptrain.bench.ddp [OPTIONS]" in proc.stdout and "--caps FLOAT [...]" in proc.stdout


def test_variadic_options_take_values_up_to_the_next_option():
    import click

    from dptrain.cli.bench_group import spread_variadic

    flags = {"--caps"}
    assert spread_variadic(["--caps", "1", "25", "--rounds", "2"], flags) == \
        ["--caps", "1", "--caps", "25", "--rounds", "2"]
    assert spread_variadic(["--caps=1", "4", "--views"], flags) == ["--caps=1", "--caps", "4", "--views"]
    assert spread_variadic(["--caps", "-1.5", "2"], flags) == ["--caps", "-1.5", "--caps", "2"]
    for args in (["--caps", "--rounds", "2"], ["--rounds", "2", "--caps"]):
        with pytest.raises(click.UsageError, match="--caps needs at least one value"):
            spread_variadic(args, flags)


def test_a_benchmark_runs_for_real_through_the_group(tmp_path):
    from click.testing import CliRunner

    from dptrain.cli import main

    out = tmp_path / "ddp.json"
    result = CliRunner().invoke(main, ["bench", "ddp", "--width", "16", "--depth", "2", "--micro-batch", "4",
                                       "--caps", "1", "25", "--rounds", "1", "--steps", "1", "--warmup", "1",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    import json

    caps = {row.split("/")[-1] for row in json.loads(out.read_text())["step_times_s"]}
    assert caps >= {"1", "25"}, caps


# --- every option of every command says what it does --------------------------------------------------------------

def test_every_cli_option_has_help():
    import click

    from dptrain.cli import main

    missing = [(name, p.opts[0]) for name, command in main.commands.items() if not isinstance(command, click.Group)
               for p in command.params if isinstance(p, click.Option) and not p.help]
    assert missing == []


# --- plan and simulate: which model, one batch rule, skipped world sizes, the measured-CPU warning -----------------

TINY = ["--set", "gpt.n_layer=1", "--set", "gpt.n_embd=16", "--set", "gpt.n_head=2", "--set", "gpt.block_size=8",
        "--set", "gpt.corpus_bytes=20000"]


def _invoke(*args: str):
    from click.testing import CliRunner

    from dptrain.cli import main

    return CliRunner().invoke(main, list(args))


def test_plan_names_the_model_states_the_batch_rule_and_skips_a_world_size_it_cannot_split():
    result = _invoke("plan", *TINY, "--world-sizes", "1,3,4", "--strategies", "ddp", "--precisions", "fp32")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "model: task chargpt: a GPT of 1 blocks, width 16, 8 tokens per sample"
    assert lines[1].startswith("batch rule: the global batch stays 32 samples per step as N grows")
    assert "| ddp | 1 | fp32 | 32 |" in result.output and "| ddp | 4 | fp32 | 8 |" in result.output
    assert "| ddp | 3 |" not in result.output
    skip = next(line for line in lines if "N=3 skipped" in line)
    assert "global batch 32 is not divisible" in skip and "--set train.global_batch_size" in skip
    help_text = _invoke("plan", "--help").output
    assert "Batch rule (plan and simulate)" in help_text and "global batch" in help_text


def test_plan_with_no_world_size_left_is_an_error():
    result = _invoke("plan", *TINY, "--world-sizes", "3,5", "--strategies", "ddp", "--precisions", "fp32")
    assert result.exit_code == 2
    assert "no world size left to plan" in result.stderr and "N=5 skipped" in result.stderr


def test_simulate_follows_the_same_batch_rule_as_plan():
    flops = ["--profile", "flops", "--device-flops", "1e12", "--networks", "eth-10"]
    result = _invoke("simulate", *TINY, *flops, "--world-sizes", "1,2,3")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].startswith("batch rule: the global batch stays 32 samples per step")
    assert "| eth-10 | 1 | 32 |" in result.output and "| eth-10 | 2 | 16 |" in result.output
    assert "N=3 skipped: global batch 32 is not divisible" in result.output
    assert "warning" not in result.stderr  # a FLOPs profile on a GPU preset: nothing to warn about
    weak = _invoke("simulate", *TINY, *flops, "--world-sizes", "1,2,3", "--micro-batch", "4")
    assert weak.exit_code == 0, weak.output
    assert "batch rule: the micro-batch stays 4 samples per rank" in weak.output
    assert all(f"| eth-10 | {n} | 4 |" in weak.output for n in (1, 2, 3))
    assert "Batch rule (plan and simulate)" in _invoke("simulate", "--help").output


def test_simulate_warns_when_this_cpu_is_replayed_over_gpu_links():
    measured = _invoke("simulate", *TINY, "--networks", "loopback,nvlink4+ib-ndr", "--world-sizes", "1,2")
    assert measured.exit_code == 0, measured.output
    warning = next(line for line in measured.stderr.splitlines() if line.startswith("warning:"))
    assert "nvlink4+ib-ndr" in warning and "--profile flops --device-flops" in warning
    assert "loopback" not in warning
    local = _invoke("simulate", *TINY, "--networks", "loopback", "--world-sizes", "1,2")
    assert local.exit_code == 0 and "warning" not in local.stderr


# --- a task without tokens reports samples/s only -----------------------------------------------------------------

def _train_record(samples_per_s: float, tokens_per_sample: int) -> dict:
    return dict(kind="train", step=5, loss=0.7, lr=1e-3, grad_norm=0.5, skipped_steps=0, samples_per_s=samples_per_s,
                tokens_per_s=samples_per_s * tokens_per_sample, step_ms=10.0, compute_ms=8.0, exposed_comm_ms=2.0,
                comm_busy_ms=3.0, overlap_pct=50.0, comm_bytes_per_step=2**20, comm_compressed_bytes_per_step=0,
                comm_sent_bytes_per_step=2**20, peak_rss_mb=[100.0], peak_tensor_mb=[None])


def test_console_line_shows_tokens_only_for_a_task_with_tokens():
    from dptrain.runner.metrics import format_line

    classifier = format_line(_train_record(3200.0, 1), 10)
    assert "3200 samples/s" in classifier and "tok/s" not in classifier
    gpt = format_line(_train_record(3200.0, 64), 10)
    assert "204.8k tok/s 3200 samples/s" in gpt


@pytest.mark.parametrize("tokens_per_sample", [1, 64])
def test_run_summary_shows_tokens_only_for_a_task_with_tokens(tmp_path, tokens_per_sample):
    import io

    from dptrain.runner.report import RunLog, print_summary

    summary = dict(run_dir="runs/x", task="classifier", parameters=1000, world_size=2, device="cpu", backend="gloo",
                   global_batch_size=32, micro_batch_size=16, grad_accum_steps=1, lr_rule="2e-3", start_step=0,
                   steps=10, wall_s=3.0, final_train_loss=0.5, median_step_ms=10.0, median_compute_ms=8.0,
                   median_exposed_comm_ms=2.0, median_samples_per_s=3200.0,
                   median_tokens_per_s=3200.0 * tokens_per_sample, comm_bytes_per_step=2**20,
                   median_overlap_pct=50.0, peak_rss_mb_per_rank=[100.0], peak_tensor_mb_per_rank=[None],
                   skipped_steps=0, files={})
    out = io.StringIO()
    log = RunLog(tmp_path / "log.txt", 0, "lines", 10, 0, stream=out)
    print_summary(summary, log)
    log.close()
    throughput = next(line for line in out.getvalue().splitlines() if "throughput" in line)
    if tokens_per_sample == 1:
        assert throughput.split()[-3:] == ["3,200.0", "samples/s", "(median)"] and "tokens/s" not in throughput
    else:
        assert "204,800 tokens/s, 3,200.0 samples/s (median)" in throughput


# --- loss.png: log scale over a decade, validation accuracy; the plots' command line --------------------------------

def _metrics(run_dir, losses, accuracy: bool):
    import json

    records = [_train_record(100.0, 1) | {"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
    records.append({"kind": "eval", "step": len(losses), "val_loss": losses[-1] * 1.1}
                   | ({"val_accuracy": 0.9} if accuracy else {}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "eval"]


def test_loss_plot_is_logarithmic_over_a_decade_and_shows_validation_accuracy(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from dptrain.pages.plots import _draw_loss, plot_run, spans_a_decade

    assert spans_a_decade([5.0, 0.4]) and not spans_a_decade([2.3, 0.5]) and not spans_a_decade([])
    train, evals = _metrics(tmp_path, [5.0, 1.0, 0.2], accuracy=True)
    fig, ax = plt.subplots()
    _draw_loss(ax, train, evals)
    assert ax.get_yscale() == "log"
    twins = [a for a in fig.axes if a is not ax]
    assert len(twins) == 1 and twins[0].get_ylabel() == "validation accuracy (%)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "train loss (mean over ranks)", "validation loss", "validation accuracy"]
    plt.close(fig)
    flat, flat_evals = _metrics(tmp_path, [2.3, 1.9, 1.5], accuracy=False)
    fig, ax = plt.subplots()
    _draw_loss(ax, flat, flat_evals)
    assert ax.get_yscale() == "linear" and fig.axes == [ax]
    plt.close(fig)
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["loss.png", "throughput.png"] and all(p.stat().st_size for p in written)


def test_plots_command_without_a_run_dir_prints_usage_and_exits_2(tmp_path):
    for args in ([], [str(tmp_path / "missing")]):
        proc = subprocess.run([sys.executable, "-m", "dptrain.pages.plots", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("usage: python -m dptrain.pages.plots RUN_DIR")
        assert "Traceback" not in proc.stderr


def test_the_summary_lists_a_directory_a_backend_wrote_as_one_entry(tmp_path):
    from dptrain.runner.report import _listing

    for rel in ("wandb/offline-run-1/files/config.yaml", "wandb/offline-run-1/run-1.wandb", "tensorboard/events.1",
                "checkpoints/step_00000010/model.pt", "checkpoints/step_00000010/meta.json", "logs/rank0.log",
                "logs/rank1.log", "hf/config.json", "report.html", ".hidden/x"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("12345")
    listing = _listing(tmp_path)
    assert list(listing) == ["checkpoints/step_00000010/", "hf/", "logs/rank0.log", "logs/rank1.log", "report.html",
                             "tensorboard/", "wandb/"]
    assert listing["wandb/"] == 10 and listing["checkpoints/step_00000010/"] == 10
