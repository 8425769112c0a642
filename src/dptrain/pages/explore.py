"""``dptrain explore``: one HTML page where the planner and the cost model answer as sliders move.

Three panels, after the three simulations of the data-parallelism chapter the docs
build on: memory per rank under DDP, ZeRO-1/2/3 and HSDP (the planner), throughput and
scaling efficiency against the DP degree on a network (the simulator's DDP timeline),
and the all-reduce algorithms side by side (the α-β-γ cost model), with the ring's
reduce-scatter and all-gather drawn step by step. Each panel says what to notice,
links to the page of the docs that explains it, and turns the chapter's quiz
questions into things to try. The numbers are computed in Python over a grid
(:mod:`dptrain.pages.explore_data`) and embedded; the page adds them up.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

import dptrain
from dptrain.config import RunConfig
from dptrain.pages.explore_data import (
    DP_DEGREES,
    MICRO_BATCHES,
    PRESET_MODELS,
    config_target,
    explore_data,
    preset_target,
)
from dptrain.pages.html import asset, document, json_script, write_page

__all__ = ["build_explore", "write_explore", "TRY_THIS"]

# The chapter's nine questions, each answered by moving something on the page.
TRY_THIS = {
    "scaling": [
        ("Data parallelism speeds up training by...", "Move <i>DP degree</i> from 1 to 8 with the micro-batch fixed: "
         "each rank's step barely changes, the samples per step grow 8×, and so does throughput."),
        ("Why bucket gradients instead of all-reducing each parameter?", "Set <i>bucket</i> to <i>none</i> and then to "
         "25 MiB at DP 64 on eth-10: every all-reduce pays the latency α once per round, so hundreds of small ones "
         "cost far more than a few large ones."),
        ("With DP=16, micro-batch=2, grad_acc=4, seq_len=4096, what is the global batch in tokens?",
         "Pick the 7B class (4096 tokens per sample), micro-batch 2, accumulation 4, DP 16 and read the batch line."),
        ("At very high DP degrees, what limits further scaling?", "Move DP to 512 and 1024 on eth-100: the ring's "
         "2(n−1) rounds each pay α, and the bytes no longer fall per rank, so exposed communication grows while "
         "compute per rank stays the same. Turn <i>overlap</i> off to see what hiding it behind backward buys."),
    ],
    "memory": [
        ("What does ZeRO Stage 1 shard across GPUs?", "Switch between DDP and ZeRO-1: only the optimizer-state bar shrinks."),
        ("With ZeRO-3 and DP=8, how much model-state memory does each GPU hold for a 7B model?",
         "Pick the 7B class, ZeRO-3, fp32, AdamW, DP 8 and read <i>model states</i>: about 16Ψ/8 bytes."),
        ("ZeRO-3 achieves near-perfect memory scaling. What is the cost?", "Read <i>sends per step</i> for ZeRO-3 "
         "against DDP's in fp32: the parameters are gathered in forward and again in backward, 1.5× DDP's traffic "
         "(in bf16 the gathers carry half the bytes)."),
        ("When would you choose ZeRO-3 over basic data parallelism?", "Pick the 70B class with activation "
         "checkpointing: no DP degree makes DDP fit on an H100 (every rank holds everything), while ZeRO-3 fits from "
         "DP 32."),
    ],
    "allreduce": [
        ("What does all-reduce guarantee after it completes?", "Play the ring: after 2(n−1) steps every rank holds the "
         "same sum, chunk for chunk."),
    ],
}


def _docs_link(page: str, text: str) -> str:
    """A link to ``docs/<page>`` of this checkout when it has one, else the page named in plain text."""
    docs = Path(dptrain.__file__).resolve().parents[2] / "docs" / page
    if docs.exists():
        return f'<a href="{docs.as_uri()}">{html.escape(text)}</a>'
    return f"{html.escape(text)} (docs/{page} in dptrain's repository)"


def _try(panel: str) -> str:
    return "".join(f'<div class="try"><b>Try this.</b> {html.escape(q)} {a}</div>' for q, a in TRY_THIS[panel])


def _hybrids(data: dict) -> str:
    """What each of the page's hybrid strategies is, in the registry's words (``HSDP is ZeRO-3 sharded over ...``)."""
    labels = data["labels"]
    return " ".join(f'{labels[name]} is {labels[h["of"]]} sharded over hosts of {h["shard"]} and replicated across '
                    "them." for name, h in data["hybrid"].items())


def _custom(prefix: str) -> str:
    return (f'<span id="{prefix}-custom" style="display:none" class="controls">'
            f'<label>latency α (µs)<input id="{prefix}-alpha" type="number" value="10" min="0" step="any"></label>'
            f'<label>bandwidth (Gbit/s)<input id="{prefix}-gbit" type="number" value="100" min="0.001" step="any"></label>'
            f'<label>ranks per host<input id="{prefix}-pernode" type="number" value="8" min="1"></label></span>')


def _body(data: dict) -> str:
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data["notes"])
    return f"""
<header class="page"><h1>dptrain explore</h1>
<p>Data parallelism's memory, scaling and collectives, computed by dptrain's planner, simulator and cost model.
Move anything: every number on this page is theirs (1 GiB = 2<sup>30</sup> bytes, as <code>dptrain plan</code>
counts and as a device's memory is).</p></header>
<main>
<section class="panel" id="memory">
<h2>ZeRO memory per rank</h2>
<p class="notice">Notice how ZeRO-1 already cuts optimizer memory, ZeRO-2 gradients, and ZeRO-3 divides everything
by the DP degree, while activations stay per rank whatever the stage. {_docs_link("zero.md", "ZeRO stages")} ·
{_docs_link("planner.md", "how the planner counts")}</p>
<div class="controls">
<label>model<select id="mem-model"></select></label>
<label>DP degree <output id="mem-dp-out"></output><input id="mem-dp" type="range" min="0" step="1"></label>
<label>strategy<select id="mem-strategy"></select></label>
<label>precision<select id="mem-precision"></select></label>
<label>optimizer<select id="mem-optimizer"></select></label>
<label>micro-batch (samples)<select id="mem-mb"></select></label>
<label><span><input id="mem-ckpt" type="checkbox"> activation checkpointing</span></label>
<label>device memory<select id="mem-device"></select>
<input id="mem-device-gib" type="number" value="48" min="1" step="any" style="display:none"></label>
<label>headroom (%)<input id="mem-headroom" type="number" min="0" max="90" step="1"></label>
</div>
<p class="small" id="mem-model-note"></p>
<div class="readout" id="mem-readout"></div>
<div style="display:flex;flex-wrap:wrap;gap:12px"><div id="mem-bars" style="flex:1 1 480px"></div>
<div id="mem-lines" style="flex:1 1 480px"></div></div>
<p class="small">Rank 0's bytes (it holds the largest shards). Parameters, gradients and optimizer state are exact, from
the engines' own layout code; activations from a traced forward of one micro-batch; communication buffers are those
alive in backward. {_hybrids(data)} A total fits
when it is at most the device's memory less the headroom, kept for what the plan does not count (the CUDA context,
NCCL's buffers, the allocator's fragmentation), as <code>dptrain plan --device-memory --headroom</code> decides.</p>
{_try("memory")}
</section>

<section class="panel" id="scaling">
<h2>DP scaling</h2>
<p class="notice">Watch total throughput grow with DP while efficiency falls as the all-reduce outgrows what backward can
hide. {_docs_link("simulator.md", "how the simulator works")} · {_docs_link("ddp.md", "buckets and overlap")}</p>
<div class="controls">
<label>model<select id="sc-model"></select></label>
<label>DP degree <output id="sc-dp-out"></output><input id="sc-dp" type="range" min="0" step="1"></label>
<label>network<select id="sc-net"></select></label>{_custom("sc")}
<label>bucket<select id="sc-cap"></select></label>
<label><span><input id="sc-overlap" type="checkbox" checked> overlap with backward</span></label>
<label>compression<select id="sc-compression"></select></label>
<label>micro-batch (samples per rank)<input id="sc-mb" type="number" value="8" min="1" max="4096"></label>
<label>device TFLOP/s achieved<input id="sc-tflops" type="number" value="400" min="0.001" step="any"></label>
<label>accumulation steps<input id="sc-acc" type="number" value="1" min="1"></label>
</div>
<div class="readout" id="sc-readout"></div><div class="readout" id="sc-batch"></div>
<div style="display:flex;flex-wrap:wrap;gap:12px"><div id="sc-throughput" style="flex:1 1 330px"></div>
<div id="sc-efficiency" style="flex:1 1 330px"></div><div id="sc-exposed" style="flex:1 1 330px"></div></div>
<p class="small">Weak scaling, DDP in fp32: each rank keeps its micro-batch. Compute comes from the model's FLOPs at the
device rate (backward twice forward; gradients ready in reverse order of registration); each bucket's all-reduce starts
when it is ready and the link is free and costs the ring's α-β time; the network's in-host link serves up to a host's
ranks, its between-host link beyond. Compression divides the bytes sent; encoding and decoding are not charged.</p>
{_try("scaling")}
</section>

<section class="panel" id="allreduce">
<h2>All-reduce algorithms</h2>
<p class="notice">Notice that the ring's bytes per rank stay near 2× the message at any size of world while its
rounds grow with it; trees trade bytes for rounds, so small messages prefer them and large ones the ring.
{_docs_link("collectives.md", "the algorithms and their cost model")}</p>
<div class="controls">
<label>message <output id="ar-size-out"></output><input id="ar-size" type="range" min="0" step="1"></label>
<label>ranks <output id="ar-n-out"></output><input id="ar-n" type="range" min="0" step="1"></label>
<label>network<select id="ar-net"></select></label>{_custom("ar")}
</div>
<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start">
<table class="data" id="ar-table"></table><div id="ar-chart" style="flex:1 1 460px"></div></div>
<p class="small">Hierarchical: a tree inside each host of {data["all_reduce"]["per_node"]} ranks, a ring across the
hosts' leaders. Flat algorithms use the in-host link while the ranks fit in one host.</p>
<h3>The ring, step by step</h3>
<div class="controls"><label>ranks <output id="ring-n-out">4</output><input id="ring-n" type="range" min="2" max="8" value="4"></label>
<button id="ring-step">step</button><button id="ring-play">play</button><button id="ring-reset">reset</button></div>
<p id="ring-phase" class="readout"></p><div id="ring-svg"></div>
{_try("allreduce")}
</section>
{f'<section class="panel"><h2>Notes</h2><ul>{notes}</ul></section>' if notes else ""}
<p class="small">Written by <code>dptrain explore</code> (dptrain {html.escape(dptrain.__version__)}).</p>
</main>"""


def build_explore(cfg: RunConfig | None = None, models: list[str] | None = None, dp: tuple[int, ...] = DP_DEGREES,
                  micro_batches: tuple[int, ...] = MICRO_BATCHES, progress: Callable[[str], None] = lambda s: None
                  ) -> str:
    """The page's HTML for ``models`` (``"config"``: ``cfg``'s model; default: it and every preset)."""
    cfg = cfg if cfg is not None else RunConfig()
    names = models if models is not None else ["config", *PRESET_MODELS]
    targets = [config_target(cfg) if name == "config" else preset_target(name) for name in names]
    data = explore_data(targets, dp, micro_batches, progress)
    return document("dptrain explore", json_script("explore-data", data) + _body(data),
                    styles=asset("explore.css"), scripts=(asset("explore.js"),))


def write_explore(path: Path, **kwargs) -> Path:
    return write_page(path, build_explore(**kwargs))
