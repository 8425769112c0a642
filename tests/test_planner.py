"""The planner: its pure math against the ZeRO formulas, and its bytes against live tensors, exactly."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.cli import main
from dptrain.models import GPT, MLPClassifier
from dptrain.models.gpt import Block
from dptrain.planner import Setup, model_states, plan_row, step_traffic, trace_activations, units
from dptrain.planner.from_config import flat_model
from dptrain.testing import run_on_ranks
from dptrain.zero import MixedPrecision, ZeRO
from dptrain.zero.memory import state_bytes, storage_bytes, zero_formula

# ---------------------------------------------------------------- pure math, no process group


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_adam_states_are_the_zero_formulas(stage: int, world_size: int) -> None:
    # One unit of Ψ = 1024 x 1000 parameters (divisible by every N): the paper's 16Ψ,
    # (8 + 8/N)Ψ, (4 + 12/N)Ψ, 16Ψ/N, plus the one 4-byte 'step' tensor Adam keeps per tensor.
    psi = 1024 * 1000
    setup = Setup(["ddp", "zero1", "zero2", "zero3"][stage], world_size, gradient_as_bucket_view=True)
    got = model_states(flat_model(psi), setup)
    assert got.total == zero_formula(stage, psi, world_size) + 4


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_states_are_the_mixed_precision_formulas(stage: int, reduce_dtype: torch.dtype) -> None:
    psi, n = 1024 * 1000, 4
    got = model_states(flat_model(psi), Setup(f"zero{stage}", n, "bf16", reduce_dtype=reduce_dtype))
    want = zero_formula(stage, psi, n, param_bytes=2, reduce_bytes=reduce_dtype.itemsize)
    assert got.total == want + 4
    if stage == 3:
        assert got.total == 16 * psi / n + 4  # the seed's 16Ψ/N: nothing is replicated


def test_ddp_keeps_bucket_buffers_unless_gradients_are_views_of_them() -> None:
    psi = 1000
    apart = model_states(flat_model(psi), Setup("ddp", 2))
    views = model_states(flat_model(psi), Setup("ddp", 2, gradient_as_bucket_view=True))
    assert apart.gradients == 2 * views.gradients == 8 * psi


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_traffic_is_the_all_reduce_volume_and_stage3_half_again(world_size: int) -> None:
    # Every layer a stage-3 unit that reshards: two all-gathers and a reduce-scatter per step.
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).to("meta")
    psi = sum(p.numel() for p in model.parameters())
    n = world_size
    ddp = step_traffic(model, Setup("ddp", n))
    assert ddp.total == pytest.approx(2 * (n - 1) / n * 4 * psi, rel=1e-3)  # chunks rounded per bucket
    for stage in (1, 2):
        assert step_traffic(model, Setup(f"zero{stage}", n)).total == pytest.approx(ddp.total, rel=1e-3)
    zero3 = step_traffic(model, Setup("zero3", n, unit_classes=(nn.Linear,)))
    assert zero3.total == pytest.approx(1.5 * ddp.total, rel=1e-3)
    assert step_traffic(model, Setup("ddp", 1)).total == 0


def test_units_follow_the_engines_grouping() -> None:
    model = GPT(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=32).to("meta")
    zero3 = units(model, Setup("zero3", 2, unit_classes=(Block,)))
    assert [u.resharded for u in zero3] == [True, True, True, False]  # three blocks, then the root
    assert sum(u.numel for u in zero3) == sum(p.numel() for p in model.parameters())


def _mlp_loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def test_activation_trace_on_meta_equals_the_trace_on_cpu_and_checkpointing_saves() -> None:
    torch.manual_seed(0)
    real = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(3)])
    batch = (torch.randn(5, 16), torch.randn(5, 16))
    on_cpu = trace_activations(real, batch, _mlp_loss, (nn.Sequential,))
    meta = real.to("meta")
    on_meta = trace_activations(meta, tuple(t.to("meta") for t in batch), _mlp_loss, (nn.Sequential,))
    assert on_meta == on_cpu
    # per block: its input (5x16), tanh's output (5x32; the second Linear's input too): 320 + 640 B
    assert on_cpu.saved == 3 * (320 + 640) + 320 + 320  # + the output and the target, saved by the loss
    assert on_cpu.units == 3
    assert on_cpu.checkpointed == 640 + 3 * 320 + (320 + 640)  # outside + three inputs + one block's own


# ---------------------------------------------------------------- against live tensors


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=40)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLPClassifier(features=13, classes=5, hidden=37, depth=3)


def _batch(name: str):
    if name == "gpt":
        x = torch.randint(0, 256, (2, 16))
        return x, x
    return torch.randn(4, 13), torch.randint(0, 5, (4,))


def _loss(name: str, out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.size(-1)).float(), y.reshape(-1))


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)}


def _measured(rank: int, world_size: int, name: str, strategy: str, precision: str, opt: str,
              shard_size: int | None = None) -> dict:
    model = {"gpt": _gpt, "mlp": _mlp}[name]()
    if strategy.startswith("ddp"):
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=strategy == "ddp_views")
    else:
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
        kw = {"unit_classes": (Block,)} if strategy == "zero3" and name == "gpt" else {}
        wrapped = ZeRO(model, stage=int(strategy[-1]), mixed_precision=mp, shard_size=shard_size, **kw)
    optimizer = OPTIMIZERS[opt](list(wrapped.parameters()))
    x, y = _batch(name)
    _loss(name, wrapped(x), y).backward()
    optimizer.step()
    if strategy.startswith("ddp"):
        seen: set = set()
        params = list(wrapped.module.parameters())
        grads = [p.grad for p in params] + [b.buffer for b in wrapped.reducer.buckets]
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"parameters": storage_bytes(params, seen), "gradients": storage_bytes(grads, seen),
                "optimizer": storage_bytes(state, seen)}
    return state_bytes(wrapped, optimizer)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name,strategy,precision,opt", [
    ("gpt", "ddp", "fp32", "adamw"), ("gpt", "ddp_views", "fp32", "sgd"), ("mlp", "ddp", "fp32", "adamw"),
    ("gpt", "zero1", "fp32", "adamw"), ("gpt", "zero2", "fp32", "adamw"), ("gpt", "zero3", "fp32", "adamw"),
    ("mlp", "zero1", "fp32", "sgd"), ("mlp", "zero3", "fp32", "adamw"),
    ("gpt", "zero1", "bf16", "adamw"), ("gpt", "zero2", "bf16", "adamw"), ("gpt", "zero3", "bf16", "adamw"),
])
def test_planned_model_states_equal_the_live_tensors_exactly(name, strategy, precision, opt, world_size) -> None:
    per_rank = run_on_ranks(_measured, world_size, name, strategy, precision, opt, timeout=120)
    with torch.device("meta"):
        model = {"gpt": _gpt, "mlp": _mlp}[name]()
    kw = {"unit_classes": (Block,)} if strategy == "zero3" and name == "gpt" else {}
    setup = Setup(strategy.removesuffix("_views"), world_size, precision,
                  gradient_as_bucket_view=strategy == "ddp_views", **kw)
    for rank, measured in enumerate(per_rank):
        planned = model_states(model, setup, rank, OPTIMIZERS[opt])
        assert (planned.parameters, planned.gradients, planned.optimizer) == (
            measured["parameters"], measured["gradients"], measured["optimizer"]), (rank, planned, measured)


@pytest.mark.parametrize("strategy,precision", [("zero3", "fp32"), ("zero1", "fp32"), ("zero3", "bf16")])
def test_planned_hybrid_sharding_states_equal_the_live_tensors_exactly(strategy: str, precision: str) -> None:
    per_rank = run_on_ranks(_measured, 4, "gpt", strategy, precision, "adamw", 2, timeout=120)
    with torch.device("meta"):
        model = _gpt()
    kw = {"unit_classes": (Block,)} if strategy == "zero3" else {}
    setup = Setup(strategy, 4, precision, shard_size=2, **kw)
    for rank, measured in enumerate(per_rank):
        planned = model_states(model, setup, rank, OPTIMIZERS["adamw"])
        assert (planned.parameters, planned.gradients, planned.optimizer) == (
            measured["parameters"], measured["gradients"], measured["optimizer"]), (rank, planned, measured)
    assert per_rank[0] == per_rank[2] and per_rank[1] == per_rank[3]  # replicas hold the same shards


def test_hybrid_sharding_plans_zero_over_the_shard_group_and_one_shard_across() -> None:
    psi, n, k = 1024 * 1000, 8, 2
    hybrid = model_states(flat_model(psi), Setup("zero3", n, shard_size=k))
    assert hybrid.total == zero_formula(3, psi, k) + 4  # 16Ψ/k: memory of ZeRO-3 over the shard group
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).to("meta")
    psi = sum(p.numel() for p in model.parameters())
    traffic = step_traffic(model, Setup("zero3", n, unit_classes=(nn.Linear,), shard_size=k))
    within = step_traffic(model, Setup("zero3", k, unit_classes=(nn.Linear,)))
    replicas = n // k
    # ring all-reduce of each shard (Ψ/k of 4 bytes) over the n/k replicas: 2 (R - 1) / R of it
    assert traffic.across_groups == pytest.approx(2 * (replicas - 1) / replicas * 4 * psi / k, rel=1e-3)
    assert traffic.total == within.total + traffic.across_groups
    with pytest.raises(ValueError, match="shard_size=3 does not divide the world size 8"):
        Setup("zero3", n, shard_size=3)
    with pytest.raises(ValueError, match="shard_size 2 .hybrid sharding. needs a ZeRO strategy"):
        Setup("ddp", n, shard_size=2)


# ---------------------------------------------------------------- the command


def test_plan_command_writes_table_json_and_plot(tmp_path) -> None:
    out = CliRunner().invoke(main, ["plan", "--params", "1e6", "--world-sizes", "1,4", "--precisions", "fp32",
                                    "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"),
                                    "--device-memory", "1"])
    assert out.exit_code == 0, out.output
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert len(rows) == 8
    zero3_n4 = next(r for r in rows if r["strategy"] == "zero3" and r["world_size"] == 4)
    assert zero3_n4["model_state_bytes"] == 16 * 10**6 / 4 + 4
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "| zero3 | 4 | fp32 |" in out.output


@pytest.mark.parametrize("args,message", [
    (["--world-sizes", "0"], "--world-sizes must be positive"),
    (["--strategies", "zero4"], "zero4"),
    (["--params", "0"], "--params must be a positive count"),
    (["--set", "train.global_batch_size=2", "--world-sizes", "4"], "global"),
])
def test_plan_command_refuses_bad_input(args, message) -> None:
    out = CliRunner().invoke(main, ["plan", *args])
    assert out.exit_code == 2, out.output
    assert message in out.output


def test_plan_row_of_a_model_adds_activations_and_buffers() -> None:
    model = _gpt().to("meta")
    x = torch.randint(0, 256, (2, 16), device="meta")
    acts = trace_activations(model, (x, x), lambda m, b: _loss("gpt", m(b[0]), b[1]), (Block,))
    row = plan_row(model, Setup("zero3", 2, unit_classes=(Block,)), acts, micro_batch=2)
    assert row.total() == row.states.total + row.states.buffers + acts.saved + row.comm_buffers
    assert row.total(checkpointed=True) < row.total()


def test_plan_benchmark_measures_the_engine_it_plans() -> None:
    from dptrain.bench.plan import run, table

    result = run(world_size=2, strategies=["zero2"], precisions=["fp32"], steps=2)
    row = result["rows"][0]
    assert row["planned_model_states"] == row["measured_model_states_rank0"]
    assert row["measured_peak"] > row["planned_model_states"]  # activations come on top
    assert "| zero2 | fp32 | 2 | 16 |" in table(result)


def test_plan_names_a_failing_factory() -> None:
    out = CliRunner().invoke(main, ["plan", "--set", "task.name=classifier", "--set", "task.model=_user_models:broken",
                                    "--world-sizes", "2"])
    assert out.exit_code == 2, out.output
    assert "the model factory failed" in out.output and "no weights in this factory" in out.output


def test_plan_says_what_it_could_not_estimate_instead_of_a_wrong_number(tmp_path) -> None:
    out = CliRunner().invoke(main, ["plan", "--set", "task.name=classifier", "--set",
                                    "task.model=_user_models:data_dependent", "--world-sizes", "2",
                                    "--precisions", "fp32", "--strategies", "ddp", "--json", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    row = next(line for line in out.output.splitlines() if line.startswith("| ddp | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[8] == "n/a" and cells[11] == "n/a"  # activations and total
    assert "could not trace the forward" in out.output
    planned = json.loads((tmp_path / "p.json").read_text())
    assert planned["rows"][0]["parameters_bytes"] == 2 * 4 * (16 * 8 + 8)  # model states are still planned
    assert planned["rows"][0]["total_bytes"] is None
    assert "could not trace" in planned["notes"][0]


# ---------------------------------------------------------------- planning without data, fitting with headroom


def test_a_hugging_face_model_plans_from_its_config_alone(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from dptrain.models.hf import causal_lm

    transformers.GPT2Config(vocab_size=256, n_positions=2048, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0).save_pretrained(tmp_path / "gpt2")
    args = ["plan", "--set", f"hf.path={tmp_path / 'gpt2'}", "--set", "train.global_batch_size=2", "--world-sizes",
            "2", "--precisions", "fp32", "--strategies", "ddp,zero3", "--json", str(tmp_path / "p.json")]
    out = CliRunner().invoke(main, args)  # no data.source, no token files: the model's config.json is enough
    assert out.exit_code == 0, out.output
    numel = sum(p.numel() for p in causal_lm(tmp_path / "gpt2", weights=False).parameters())
    assert f"parameters: {numel:,}; tokens per sample: 1,024" in out.output
    assert "data.block_size = 0 takes the model's context (2,048 positions) capped at 1,024" in out.output
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    assert rows["ddp"]["parameters_bytes"] == 4 * numel and rows["ddp"]["activation_bytes"] > 0
    longer = CliRunner().invoke(main, [*args[:5], "--set", "data.block_size=2048", *args[5:]])
    assert "tokens per sample: 2,048" in longer.output and "capped" not in longer.output
    assert json.loads((tmp_path / "p.json").read_text())["rows"][0]["activation_bytes"] > rows["ddp"]["activation_bytes"]
    too_long = CliRunner().invoke(main, [*args[:5], "--set", "data.block_size=4096", *args[5:]])
    assert too_long.exit_code == 2 and "longer than the model's context (2048 positions)" in too_long.output


def test_the_plan_heading_gives_the_parameter_count_and_tokens_per_sample() -> None:
    out = CliRunner().invoke(main, ["plan", "--set", "gpt.n_layer=1", "--set", "gpt.n_embd=16", "--set", "gpt.n_head=2",
                                    "--set", "gpt.block_size=8", "--world-sizes", "1", "--precisions", "fp32",
                                    "--strategies", "ddp"])
    assert out.exit_code == 0, out.output
    numel = sum(p.numel() for p in GPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16).parameters())
    assert f"parameters: {numel:,}; tokens per sample: 8" in out.output.splitlines()[2]


def test_fits_keeps_a_stated_headroom_of_the_device(tmp_path) -> None:
    from dptrain.planner.devices import DEVICES

    states = 16 * 10**6 + 4  # --params 1e6, fp32 AdamW, DDP at N=1 (gradients as bucket views: off)
    gib = (states / 0.95) / 2**30  # room for the states with 5% to spare: fits without headroom, not with 10%
    base = ["plan", "--params", "1e6", "--world-sizes", "1", "--precisions", "fp32", "--strategies", "zero1",
            "--device-memory", f"{gib!r}"]
    out = CliRunner().invoke(main, [*base, "--json", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    assert "| zero1 | 1 | fp32 | - |" in out.output and out.output.count("| no? |") == 1
    assert "less a 10% headroom" in out.output and "CUDA context" in out.output
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["headroom"] == 0.1 and plan["rows"][0]["fits"] is False
    assert plan["rows"][0]["model_state_bytes"] == states
    assert "| yes? |" in CliRunner().invoke(main, [*base, "--headroom", "0"]).output
    named = CliRunner().invoke(main, [*base[:-1], "h100"])
    assert f"({DEVICES['h100'].gib:.2f} less 10%)" in named.output == named.output and "79.65" in named.output
    for bad in (["--headroom", "1"], ["--device-memory", "h1000"], ["--device-memory", "nan"]):
        refused = CliRunner().invoke(main, [*base, *bad])
        assert refused.exit_code == 2 and ("--headroom" in refused.output or "h100 (79.65 GiB)" in refused.output)


def test_a_bare_count_plans_zero3_traffic_as_a_transformers_blocks(tmp_path) -> None:
    # One tensor that ZeRO-3 reshards: gathered in forward and again in backward, 3/2 of DDP's bytes (it was one
    # unit kept gathered, as a model's root: 1x, the "43.9 GiB for a 65.0 GiB model" of issue 46)
    out = CliRunner().invoke(main, ["plan", "--params", "1e6", "--world-sizes", "4", "--precisions", "fp32,bf16",
                                    "--json", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    rows = {(r["strategy"], r["precision"]): r for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    ddp = rows["ddp", "fp32"]["sent_bytes_per_step"]
    assert rows["zero3", "fp32"]["sent_bytes_per_step"] == pytest.approx(1.5 * ddp, rel=1e-6)
    assert rows["zero2", "fp32"]["sent_bytes_per_step"] == pytest.approx(ddp, rel=1e-6)
    # bf16: fp32 reduce-scatter, two bf16 gathers
    assert rows["zero3", "bf16"]["sent_bytes_per_step"] == pytest.approx(ddp, rel=1e-6)
