"""``dptrain explore``: the page's numbers are the planner's, the simulator's and the cost model's; it works offline.

One page is built for the module (the built-in run's model and GPT-2 small, DP 1-16,
micro-batches 1 and 2) and opened once in headless Chromium. The page's own functions
(``window.dptrainExplore``: the arithmetic its panels draw) are evaluated at grid points
and compared with the Python functions, called here independently: ``plan_config`` (what
``dptrain plan`` prints) for the config's model, ``plan_row`` on a freshly traced GPT-2
for the preset, ``simulate_config`` and ``simulate_step`` (``dptrain simulate``) for
scaling, and ``collective_cost`` for the all-reduce table.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from _browser import open_page, plot_layout_problems
from _cli import dptrain
from dptrain.comm.cost import Link, collective_cost
from dptrain.config import RunConfig
from dptrain.config.loader import load_config
from dptrain.models.gpt import GPT, Block
from dptrain.pages.explore import build_explore
from dptrain.pages.explore_data import PRESET_MODELS, optimizer_config
from dptrain.planner import Setup, plan_row
from dptrain.planner.activations import trace_activations
from dptrain.planner.devices import DEFAULT_HEADROOM, DEVICES, fits, usable_bytes
from dptrain.planner.from_config import optimizer_for, plan_config, setup_for, simulate_config
from dptrain.planner.network import PRESETS, Network
from dptrain.planner.simulate import flops_profile, simulate_step

DP = (1, 2, 4, 8, 16)
MICRO = (1, 2)
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "images"


@pytest.fixture(scope="module")
def page_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("explore") / "explore.html"
    path.write_text(build_explore(models=["config", "gpt2-124m"], dp=DP, micro_batches=MICRO))
    return path


@pytest.fixture(scope="module")
def page(page_file):
    with open_page(page_file) as (pg, console):
        pg.wait_for_selector("body[data-ready='1']", timeout=30_000)
        yield pg, console


def _js(page, expression: str):
    return page.evaluate(expression)


# ------------------------------------------------------------------------------------------ memory


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_config_model_memory_equals_dptrain_plan(page, strategy) -> None:
    pg, _ = page
    for precision in ("fp32", "bf16"):
        for opt in ("adamw", "sgd"):
            for n in (1, 4, 16):
                if strategy == "hsdp" and n <= 8:
                    assert _js(pg, f"dptrainExplore.memory('config','hsdp','{precision}','{opt}',{n},1,false)") is None
                    continue
                for mb in MICRO:
                    cfg = optimizer_config(load_config(None, [f"train.micro_batch_size={mb}",
                                                              "train.grad_accum_steps=1"]), opt)
                    if strategy == "hsdp":
                        cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, shard_size=8))
                    [row] = plan_config(cfg, [n], ["zero3" if strategy == "hsdp" else strategy], [precision])
                    for ckpt in (False, True):
                        got = _js(pg, f"dptrainExplore.memory('config','{strategy}','{precision}','{opt}',{n},{mb},"
                                      f"{str(ckpt).lower()})")
                        where = (strategy, precision, opt, n, mb, ckpt)
                        assert got["total"] == row.total(checkpointed=ckpt), where
                        assert got["parameters"] == row.states.parameters, where
                        assert got["optimizer"] == row.states.optimizer, where
                        assert got["sent"] == row.traffic.total, where


@pytest.mark.timeout(120)
def test_preset_memory_equals_the_planner_on_a_freshly_traced_gpt2(page) -> None:
    pg, _ = page
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kwargs = PRESET_MODELS["gpt2-124m"][1]
    with mode:
        model = GPT(**kwargs)
        x = torch.zeros(2, 1024, dtype=torch.long)

        def loss(m, batch):
            logits = m(batch[0])
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), batch[1].view(-1))

        acts = trace_activations(model, (x, x), loss, (Block,))  # fp32, micro-batch 2
    cfg = RunConfig()
    for strategy in ("ddp", "zero1", "zero3"):
        for n in (2, 16):
            setup = setup_for(cfg, model, strategy, n, "fp32")
            row = plan_row(model, setup, acts, optimizer=lambda params: optimizer_for(cfg, params))
            for ckpt in (False, True):
                got = _js(pg, f"dptrainExplore.memory('gpt2-124m','{strategy}','fp32','adamw',{n},2,"
                              f"{str(ckpt).lower()})")
                assert got["total"] == row.total(checkpointed=ckpt), (strategy, n, ckpt)
    assert _js(pg, "dptrainExplore.data.models[1].params") == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------- scaling


def _network_js(net: Network) -> str:
    def link(lk: Link) -> str:
        return f"{{alpha:{lk.alpha!r},beta:{lk.beta!r},gamma:{lk.gamma!r},duplex:{str(lk.duplex).lower()}}}"

    return f"{{node:{link(net.node)},net:{link(net.net)},per_node:{net.per_node}}}"


@pytest.mark.timeout(120)
def test_config_model_scaling_equals_dptrain_simulate(page) -> None:
    pg, _ = page
    hand = Network("by hand", Link(20e-6, 3e9), Link(20e-6, 3e9), 2, "typed in")
    nets = [PRESETS["eth-10"], PRESETS["nvlink4+ib-ndr"], PRESETS["loopback"], hand]
    for cap in (0.0, 25.0):
        for overlap in (True, False):
            for ratio in (1, 4):
                cfg = load_config(None, [f"ddp.bucket_cap_mb={cap or 1e-9}"])
                result = simulate_config(cfg, list(DP), "ddp", nets, "native", "flops", micro_batch=2,
                                         device_flops=3e12, overlap=overlap, compression=ratio)
                for net in nets:
                    js_net = f"'{net.name}'" if net.name in PRESETS else _network_js(net)
                    for n in DP:
                        want = result["predictions"][(net.name, n)]
                        got = _js(pg, f"dptrainExplore.step('config','{cap:g}',{n},{js_net},{{overlap:"
                                      f"{str(overlap).lower()},compression:{ratio},microBatch:2,flops:3e12}})")
                        where = (cap, overlap, ratio, net.name, n)
                        assert got["step_s"] == pytest.approx(want.step_s, rel=1e-9, abs=1e-15), where
                        assert got["exposed_s"] == pytest.approx(want.exposed_s, rel=1e-9, abs=1e-12), where
                        assert got["comm_s"] == pytest.approx(want.comm_s, rel=1e-9, abs=1e-15), where


@pytest.mark.timeout(120)
def test_preset_scaling_equals_simulate_step_on_gpt2(page) -> None:
    pg, _ = page
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = GPT(**PRESET_MODELS["gpt2-124m"][1])
        x = torch.zeros(8, 1024, dtype=torch.long)

        def loss(m, batch):
            logits = m(batch[0])
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), batch[1].view(-1))

        profile = flops_profile(model, (x, x), loss, 400e12)
    for name in ("eth-100", "nvlink4+ib-ndr"):
        for n in (1, 8, 16):
            want = simulate_step(model, Setup("ddp", n, bucket_cap_mb=5.0), profile, PRESETS[name], "ring")
            got = _js(pg, f"dptrainExplore.step('gpt2-124m','5',{n},'{name}',{{microBatch:8,flops:400e12}})")
            assert got["step_s"] == pytest.approx(want.step_s, rel=1e-9), (name, n)
            assert got["tokens_per_s"] == pytest.approx(n * 8 * 1024 / want.step_s, rel=1e-9)


# -------------------------------------------------------------------------------------- all-reduce


def test_all_reduce_table_equals_the_cost_model(page) -> None:
    pg, _ = page
    sizes = _js(pg, "dptrainExplore.data.all_reduce.sizes")
    for algorithm in ("ring", "tree", "naive", "hierarchical"):
        for size in (sizes[0], sizes[5], sizes[-1]):
            for n in (2, 8, 16):
                for name in ("eth-10", "loopback"):
                    net = PRESETS[name]
                    cost = collective_cost("all_reduce", algorithm, size // 4, 4, n,
                                           nodes=min(8, n) if algorithm == "hierarchical" else None)
                    links = {"node": net.node, "net": net.net} if algorithm == "hierarchical" else \
                        {"net": net.net if -(-n // net.per_node) > 1 else net.node}
                    got = _js(pg, f"dptrainExplore.collective('{algorithm}',{size},{n},'{name}')")
                    assert got["rounds"] == len(cost.rounds)
                    assert got["bytes_per_rank"] == max(cost.bytes_sent)
                    assert got["time_s"] == pytest.approx(cost.predict(links), rel=1e-9), (algorithm, size, n, name)


# ------------------------------------------------------------------------------------ the page itself


@pytest.mark.timeout(120)
def test_page_loads_offline_answers_its_controls_and_draws(page, tmp_path) -> None:
    pg, console = page
    assert pg.locator(".js-plotly-plot").count() == 6  # two memory charts, three scaling, one all-reduce
    total = pg.text_content("#mem-total")
    pg.fill("#mem-dp", "4")  # a range input: DP 16
    pg.dispatch_event("#mem-dp", "input")
    assert pg.text_content("#mem-dp-out") == "16"
    assert pg.text_content("#mem-total") != total
    pg.select_option("#mem-strategy", "zero3")
    assert "ZeRO-3" in pg.text_content("#mem-readout")
    step = pg.text_content("#sc-step")
    pg.select_option("#sc-net", "eth-10")
    pg.fill("#sc-dp", "4")
    pg.dispatch_event("#sc-dp", "input")
    assert pg.text_content("#sc-step") != step
    pg.select_option("#sc-net", "custom")
    assert pg.is_visible("#sc-alpha")
    pg.fill("#sc-gbit", "1")
    pg.dispatch_event("#sc-gbit", "input")
    assert pg.text_content("#sc-step") != step
    phase = pg.text_content("#ring-phase")
    for _ in range(6):  # 4 ranks: 2(n-1) steps to the end
        pg.click("#ring-step")
    assert pg.text_content("#ring-phase") != phase and "every rank holds the sum" in pg.text_content("#ring-phase")
    assert console.problems() == []
    # DPTRAIN_UPDATE_SCREENSHOTS=1 refreshes the docs' picture; otherwise the tree is left as it is
    target = SCREENSHOTS if os.environ.get("DPTRAIN_UPDATE_SCREENSHOTS") else tmp_path
    pg.screenshot(path=str(target / "explore.png"), full_page=True)
    for panel in ("memory", "scaling", "allreduce"):
        pg.locator(f"#{panel}").screenshot(path=str(target / f"explore_{panel}.png"))
    assert (target / "explore.png").stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_memory_bars_say_where_hsdp_does_not_apply(page) -> None:
    """HSDP (ZeRO-3 over hosts of 8) has no bar at DP 8: the chart says why in its place; at DP 16 it is drawn."""
    pg, console = page
    hsdp = "document.getElementById('mem-bars').data.map((t) => t.y[t.x.indexOf('HSDP')])"
    notes = "document.getElementById('mem-bars').layout.annotations.map((a) => a.text)"
    for index, dp, drawn in ((3, "8", False), (4, "16", True)):
        pg.fill("#mem-dp", str(index))
        pg.dispatch_event("#mem-dp", "input")
        assert pg.text_content("#mem-dp-out") == dp
        heights = _js(pg, hsdp)
        why = [t for t in _js(pg, notes) if "HSDP needs" in t]
        if drawn:
            assert why == [] and all(h is not None for h in heights) and sum(heights) > 0
        else:
            assert why == ["HSDP needs DP ≥ 16<br>(2 hosts of 8)"] and all(h is None for h in heights)
            drawn_text = " ".join(pg.locator("#mem-bars .annotation").all_text_contents())
            assert "HSDP needs DP ≥ 16" in drawn_text  # drawn, not only in the layout
    assert console.problems() == []


def test_explore_command_writes_the_page_and_refuses_unknown_models(tmp_path) -> None:
    out = tmp_path / "page.html"
    r = dptrain("explore", "--models", "config", "--micro-batches", "1", "-o", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "dptrainExplore" in text and "<script src=" not in text and "<link " not in text  # nothing fetched
    r = dptrain("explore", "--models", "config,llama", "-o", str(tmp_path / "x.html"), cwd=tmp_path)
    assert r.returncode == 2 and "llama" in r.stderr
    assert not (tmp_path / "x.html").exists()


# ------------------------------------------------------------------------- units, devices, the plots' frames


@pytest.mark.timeout(120)
def test_the_device_menu_is_the_planners_in_gib_and_fits_keeps_its_headroom(page) -> None:
    pg, console = page
    assert _js(pg, "dptrainExplore.data.devices") == [{"name": d.name, "label": d.label, "bytes": d.bytes}
                                                      for d in DEVICES.values()]
    assert _js(pg, "dptrainExplore.data.headroom") == DEFAULT_HEADROOM
    h100 = DEVICES["h100"].bytes
    edge = usable_bytes(h100, DEFAULT_HEADROOM)
    for total in (edge - 1, edge, edge + 1, h100 - 1, h100):  # above the usable part and below the device: no
        assert _js(pg, f"dptrainExplore.fits({total}, {h100}, {DEFAULT_HEADROOM})") == fits(total, h100,
                                                                                          DEFAULT_HEADROOM), total
    pg.select_option("#mem-device", "h100")
    readout = pg.text_content("#mem-readout")
    assert f"{edge / 2**30:.2f} GiB (H100 80GB: 79.65 GiB less 10% headroom" in readout and " GB" not in readout
    pg.fill("#mem-headroom", "0")
    pg.dispatch_event("#mem-headroom", "input")
    assert "79.65 GiB (H100 80GB: 79.65 GiB less 0% headroom" in pg.text_content("#mem-readout")
    pg.fill("#mem-headroom", "10")
    pg.dispatch_event("#mem-headroom", "input")
    assert console.problems() == []


@pytest.mark.timeout(120)
def test_plots_keep_the_toolbar_clear_and_name_their_units_and_rates_read_plainly(page) -> None:
    pg, console = page
    assert plot_layout_problems(pg) == []
    assert _js(pg, "document.getElementById('ar-chart').layout.yaxis.title.text") == "predicted time (ms)"
    rate = pg.text_content("#sc-tps")  # "48.41 M tokens/s" or "524,288 tokens/s", never "4.841e+7"
    assert re.fullmatch(r"(\d+\.\d\d [MG]|[\d,]+) tokens/s", rate), rate
    assert console.problems() == []
