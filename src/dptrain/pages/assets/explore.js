// dptrain explore: the planner's memory grid, the simulator's DDP timeline and the all-reduce cost model, live.
// The numbers come from Python (dptrain/pages/explore_data.py); this file only adds them up and replays
// the simulator's DDP loop with the chosen link. window.dptrainExplore exposes the three computations so the
// tests can compare them with the Python functions at grid points.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("explore-data").textContent);
  const GiB = 2 ** 30;
  const $ = (id) => document.getElementById(id);
  const byName = (name) => D.models.find((m) => m.name === name);
  const dpIndex = (n) => { const i = D.dp.indexOf(n); if (i < 0) throw new Error("DP degree " + n + " is not on the grid " + D.dp); return i; };
  // one unit everywhere, binary as a device's memory is: the planner's GiB (dptrain plan, planner/devices.py)
  const fmtBytes = (b) => b == null ? "n/a" : b >= 2 ** 40 ? (b / 2 ** 40).toFixed(2) + " TiB" : b >= GiB ? (b / GiB).toFixed(2) + " GiB" : b >= 2 ** 20 ? (b / 2 ** 20).toFixed(1) + " MiB" : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B";
  // a rate with SI prefixes from a million, commas below: "3.16 M", "524,288"
  const fmtRate = (x) => x >= 1e9 ? (x / 1e9).toFixed(2) + " G" : x >= 1e6 ? (x / 1e6).toFixed(2) + " M" : Math.round(x).toLocaleString("en-US");
  const fmtTime = (s) => s >= 1 ? s.toFixed(2) + " s" : s >= 1e-3 ? (s * 1e3).toFixed(2) + " ms" : (s * 1e6).toFixed(1) + " µs";
  const fmtCount = (n) => n >= 1e9 ? (n / 1e9).toFixed(2) + "B" : n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e3 ? (n / 1e3).toFixed(1) + "K" : String(n);
  // the strategies, their labels, the hybrid ones and the baseline are the registry's, through explore_data.py
  const label = (s) => D.labels[s];
  const plotConfig = { displaylogo: false, responsive: true };
  // plotly's toolbar stands upright in a right margin of its own, clear of the titles and legends
  const MODEBAR_MARGIN = 40;
  const frame = (layout) => Object.assign({ modebar: { orientation: "v" } }, layout,
    { margin: Object.assign({ t: 30, b: 40, l: 60 }, layout.margin, { r: MODEBAR_MARGIN }) });
  const axisTitle = (text) => ({ text });

  // ------------------------------------------------------------------ memory: the planner's rows, added up

  function memory(model, strategy, precision, optimizer, dp, microBatch, checkpointed) {
    const m = byName(model);
    const cell = m.memory.states[strategy][precision][optimizer][dpIndex(dp)];
    if (cell == null) return null; // a hybrid strategy on one host
    const compute = m.memory.compute[strategy + "/" + precision];
    const acts = m.memory.activations[String(microBatch)][compute];
    const activations = checkpointed ? acts[1] : acts[0];
    const [parameters, gradients, optimizerState, buffers, commBuffers, sent] = cell;
    const total = activations == null || commBuffers == null ? null
      : parameters + gradients + optimizerState + buffers + activations + commBuffers;
    return { parameters, gradients, optimizer: optimizerState, buffers, comm_buffers: commBuffers, activations,
             total, model_states: parameters + gradients + optimizerState, sent };
  }

  // ------------------------------------------------------------- links and the α-β-γ model's coefficients

  function network(net) {
    if (typeof net !== "string") return net;
    const n = D.networks[net];
    if (!n) throw new Error("unknown network " + net);
    return n;
  }

  // coef: [node rounds, bytes, bytes half duplex, bytes reduced, net rounds, ...]; flat algorithms run on
  // one tier, "net", which is the host's link while the ranks fit on one host (as the simulator maps it).
  function predict(coef, links) {
    let t = 0;
    for (const [k, link] of [[0, links.node], [4, links.net]]) {
      if (!coef[k]) continue;
      t += coef[k] * link.alpha + (link.duplex ? coef[k + 1] : coef[k + 2]) / link.beta + coef[k + 3] * link.gamma;
    }
    return t;
  }

  function flatLinks(net, ranks) {
    const hosts = Math.ceil(ranks / net.per_node);
    return { node: net.node, net: hosts > 1 ? net.net : net.node };
  }

  // ------------------------------------------------------- scaling: simulate_step's DDP loop, bucket by bucket

  function step(model, cap, dp, net, opts) {
    const o = Object.assign({ overlap: true, compression: 1, microBatch: 1, flops: 400e12 }, opts || {});
    const m = byName(model);
    const n = network(net);
    const sc = m.scaling;
    const buckets = sc.buckets[String(cap)];
    if (!buckets) throw new Error("bucket cap " + cap + " is not on the grid " + D.bucket_caps);
    const F = sc.flops_per_sample * o.microBatch / o.flops, B = 2 * F, O = 0;
    const links = flatLinks(n, dp), i = dpIndex(dp);
    let launched = 0, free = 0, comm = 0;
    for (const [numel, ready] of buckets) {
      launched = Math.max(launched, F + B * (o.overlap ? ready : 1));
      const key = Math.ceil(numel / o.compression) + ":" + sc.itemsize;
      const duration = dp === 1 ? 0 : predict(D.costs[key][i], links);
      const start = Math.max(launched, free);
      free = start + duration;
      comm += duration;
    }
    const stepS = Math.max(F + B, free) + O;
    const samples = dp * o.microBatch;
    return { step_s: stepS, compute_s: F + B + O, exposed_s: stepS - (F + B + O), comm_s: comm,
             forward_s: F, backward_s: B, buckets: buckets.length, samples_per_s: samples / stepS,
             tokens_per_s: samples * m.tokens_per_sample / stepS };
  }

  // --------------------------------------------------------------------- all-reduce: collective_cost's numbers

  function collective(algorithm, nbytes, n, net) {
    const nw = network(net);
    const s = D.all_reduce.sizes.indexOf(nbytes);
    if (s < 0) throw new Error("message size " + nbytes + " is not on the grid");
    const cell = D.all_reduce.cells[algorithm][s][dpIndex(n)];
    if (cell == null) return { rounds: 0, bytes_per_rank: 0, time_s: 0 };
    const links = algorithm === "hierarchical" ? { node: nw.node, net: nw.net } : flatLinks(nw, n);
    return { rounds: cell[0], bytes_per_rank: cell[1], time_s: predict(cell.slice(2), links) };
  }

  // ------------------------------------------------------ fits: the planner's rule (planner/devices.py fits)

  function usable(deviceBytes, headroom) { return Math.floor(deviceBytes * (1 - headroom)); }
  function fits(total, deviceBytes, headroom) { return total <= usable(deviceBytes, headroom); }

  window.dptrainExplore = { memory, step, collective, usable, fits, data: D };

  // =============================================================================== the page

  function fill(select, values, label, chosen) {
    select.innerHTML = "";
    for (const v of values) {
      const opt = document.createElement("option");
      opt.value = String(v);
      opt.textContent = label ? label(v) : String(v);
      if (String(v) === String(chosen)) opt.selected = true;
      select.appendChild(opt);
    }
  }
  const modelLabel = (name) => { const m = byName(name); return m.label + " (" + fmtCount(m.params) + ")"; };
  const netNames = Object.keys(D.networks).concat(["custom"]);
  const netLabel = (k) => k === "custom" ? "α and bandwidth by hand" : k + (k === "loopback" ? " (measured gloo loopback)" : "");

  function chosenNetwork(prefix) {
    const name = $(prefix + "-net").value;
    const custom = $(prefix + "-custom");
    custom.style.display = name === "custom" ? "" : "none";
    if (name !== "custom") return D.networks[name];
    const link = { alpha: Number($(prefix + "-alpha").value) * 1e-6, beta: Number($(prefix + "-gbit").value) * 1e9 / 8,
                   gamma: 0, duplex: true };
    return { node: link, net: link, per_node: Math.max(1, Number($(prefix + "-pernode").value)) };
  }

  // ---------------------------------------------------------------------------------- memory panel

  const PARTS = [["parameters", "parameters", "#3b6fd8"], ["gradients", "gradients", "#44a37a"],
                 ["optimizer", "optimizer state", "#e3a33b"], ["activations", "activations", "#c8553d"],
                 ["other", "buffers + communication buffers", "#8b8f9a"]];

  function memoryInputs() {
    const name = $("mem-device").value;
    const preset = D.devices.find((d) => d.name === name);
    const deviceBytes = preset ? preset.bytes : Math.max(0, Number($("mem-device-gib").value)) * GiB;
    const headroom = Math.min(0.99, Math.max(0, Number($("mem-headroom").value) / 100));
    return { model: $("mem-model").value, dp: D.dp[Number($("mem-dp").value)], strategy: $("mem-strategy").value,
             precision: $("mem-precision").value, optimizer: $("mem-optimizer").value,
             microBatch: Number($("mem-mb").value), checkpointed: $("mem-ckpt").checked,
             deviceLabel: preset ? preset.label : "your device", deviceBytes, headroom,
             device: usable(deviceBytes, headroom) / GiB };  // what a total may reach, in GiB
  }

  function drawMemory() {
    const q = memoryInputs();
    $("mem-dp-out").textContent = q.dp;
    $("mem-device-gib").style.display = $("mem-device").value === "custom" ? "" : "none";
    const rows = D.strategies.map((s) => memory(q.model, s, q.precision, q.optimizer, q.dp, q.microBatch, q.checkpointed));
    const x = D.strategies.map(label);
    const traces = PARTS.map(([key, name, color]) => ({
      type: "bar", name, x, marker: { color, opacity: D.strategies.map((s) => s === q.strategy ? 1 : 0.45) },
      y: rows.map((r) => r == null ? null : (key === "other" ? r.buffers + (r.comm_buffers || 0) : r[key] || 0) / GiB),
      hovertemplate: "%{x}: " + name + " %{y:.2f} GiB<extra></extra>" }));
    const tallest = Math.max(0, ...rows.map((r) => r == null ? 0 : (r.total != null ? r.total : r.model_states) / GiB));
    const offScale = q.device > 3 * tallest;  // a small model: draw the bars, say where the device's line is
    const line = offScale ? [] : [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: q.device, y1: q.device, line: { dash: "dash", color: "#b00" } }];
    // a strategy without a bar (a hybrid one on one host) says why in its place
    const absent = D.strategies.filter((s, i) => rows[i] == null).map((s) => ({
      x: label(s), xref: "x", y: 0.03, yref: "paper", yanchor: "bottom", showarrow: false,
      text: label(s) + " needs DP ≥ " + 2 * D.hybrid[s].shard + "<br>(2 hosts of " + D.hybrid[s].shard + ")",
      font: { size: 11, color: "#555" } }));
    const usableText = "usable: " + q.device.toFixed(2) + " GiB (" + (100 * q.headroom).toFixed(0) + "% headroom)";
    Plotly.react("mem-bars", traces, frame({
      barmode: "stack", height: 360, legend: { orientation: "h", y: -0.15 },
      yaxis: Object.assign({ title: axisTitle("GiB per rank (rank 0)") }, offScale ? { range: [0, 1.15 * tallest] } : {}),
      title: { text: "memory per rank at DP " + q.dp, font: { size: 14 } }, shapes: line,
      annotations: [{ xref: "paper", x: 1, y: offScale ? 1.15 * tallest : q.device, text: usableText + (offScale ? " (above the scale)" : ""),
                      showarrow: false, xanchor: "right", yanchor: offScale ? "top" : "bottom", font: { color: "#b00" } }].concat(absent) }), plotConfig);
    const lines = D.strategies.map((s) => ({ type: "scatter", mode: "lines+markers", name: label(s), x: D.dp,
      y: D.dp.map((n) => { const r = memory(q.model, s, q.precision, q.optimizer, n, q.microBatch, q.checkpointed);
                           return r == null || r.total == null ? null : r.total / GiB; }),
      line: { width: s === q.strategy ? 3.5 : 1.5 } }));
    Plotly.react("mem-lines", lines, frame({
      height: 360, title: { text: "total per rank against DP", font: { size: 14 } },
      xaxis: { type: "log", title: axisTitle("DP degree"), tickvals: D.dp }, yaxis: { type: "log", title: axisTitle("GiB per rank") },
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: q.device, y1: q.device, line: { dash: "dash", color: "#b00" } }],
      legend: { orientation: "h", y: -0.3 } }), plotConfig);
    const r = memory(q.model, q.strategy, q.precision, q.optimizer, q.dp, q.microBatch, q.checkpointed);
    const base = memory(q.model, D.baseline, q.precision, q.optimizer, q.dp, q.microBatch, q.checkpointed);
    const out = $("mem-readout");
    if (r == null) {
      const shard = D.hybrid[q.strategy].shard;
      out.innerHTML = label(q.strategy) + " shards over hosts of " + shard + " ranks and replicates across hosts: it needs more than " +
        shard + " ranks. Move DP above " + shard + ".";
      return;
    }
    const budget = " " + fmtBytes(usable(q.deviceBytes, q.headroom)) + " (" + q.deviceLabel + ": " + fmtBytes(q.deviceBytes) +
      " less " + (100 * q.headroom).toFixed(0) + "% headroom for the CUDA context, NCCL's buffers and fragmentation)";
    const fit = r.total == null ? "" : fits(r.total, q.deviceBytes, q.headroom) ? " <b class=fits>fits</b> in" + budget
      : " <b class=nofit>does not fit</b> in" + budget;
    out.innerHTML = "<b>" + label(q.strategy) + "</b> at DP <b>" + q.dp + "</b>: model states <b id=mem-states>" +
      fmtBytes(r.model_states) + "</b> (parameters " + fmtBytes(r.parameters) + ", gradients " + fmtBytes(r.gradients) +
      ", optimizer " + fmtBytes(r.optimizer) + "), activations " + fmtBytes(r.activations) + ", total <b id=mem-total>" +
      fmtBytes(r.total) + "</b> per rank;" + fit + ". Sends <b>" + fmtBytes(r.sent) + "</b> per step per rank (" + label(D.baseline) + ": " +
      fmtBytes(base.sent) + ").";
    $("mem-model-note").textContent = byName(q.model).note + "; " + fmtCount(byName(q.model).params) + " parameters.";
  }

  // --------------------------------------------------------------------------------- scaling panel

  function scalingInputs() {
    return { model: $("sc-model").value, dp: D.dp[Number($("sc-dp").value)], cap: $("sc-cap").value,
             net: chosenNetwork("sc"), overlap: $("sc-overlap").checked, compression: Number($("sc-compression").value),
             microBatch: Math.max(1, Number($("sc-mb").value)), flops: Math.max(1e-3, Number($("sc-tflops").value)) * 1e12,
             gradAcc: Math.max(1, Number($("sc-acc").value)) };
  }

  function drawScaling() {
    const q = scalingInputs();
    $("sc-dp-out").textContent = q.dp;
    const opts = { overlap: q.overlap, compression: q.compression, microBatch: q.microBatch, flops: q.flops };
    const all = D.dp.map((n) => step(q.model, q.cap, n, q.net, opts));
    const base = all[0];
    const eff = all.map((r) => 100 * base.step_s / r.step_s);
    const layout = (title, ytitle, ylog) => frame({ height: 300, showlegend: false,
      title: { text: title, font: { size: 14 } }, xaxis: { type: "log", title: axisTitle("DP degree"), tickvals: D.dp },
      yaxis: { title: axisTitle(ytitle), type: ylog ? "log" : "linear", rangemode: "tozero" } });
    const mark = (ys) => ({ type: "scatter", mode: "markers", x: [q.dp], y: [ys[dpIndex(q.dp)]], marker: { size: 12, color: "#b00" }, hoverinfo: "skip" });
    const tokens = byName(q.model).tokens_per_sample > 1;  // a token model; otherwise throughput is in samples
    const unit = tokens ? "tokens" : "samples";
    const tps = all.map((r) => tokens ? r.tokens_per_s : r.samples_per_s);
    Plotly.react("sc-throughput", [
      { type: "scatter", mode: "lines", x: D.dp, y: D.dp.map((n) => tps[0] * n), line: { dash: "dot", color: "#999" }, name: "linear" },
      { type: "scatter", mode: "lines+markers", x: D.dp, y: tps, name: "predicted", hovertemplate: "DP %{x}: %{y:.3s} " + unit + "/s<extra></extra>" },
      mark(tps)], layout("throughput (" + unit + "/s)", unit + " / s", true), plotConfig);
    Plotly.react("sc-efficiency", [{ type: "scatter", mode: "lines+markers", x: D.dp, y: eff,
      hovertemplate: "DP %{x}: %{y:.1f}%<extra></extra>" }, mark(eff)], layout("scaling efficiency", "% of linear", false), plotConfig);
    const exposed = all.map((r) => r.exposed_s * 1e3);
    Plotly.react("sc-exposed", [{ type: "bar", x: D.dp, y: exposed, hovertemplate: "DP %{x}: %{y:.2f} ms<extra></extra>" },
      mark(exposed)], layout("exposed communication per step", "ms per step", false), plotConfig);
    const r = all[dpIndex(q.dp)];
    const tokensGlobal = q.microBatch * q.dp * q.gradAcc * byName(q.model).tokens_per_sample;
    $("sc-readout").innerHTML = "DP <b>" + q.dp + "</b>: step <b id=sc-step>" + fmtTime(r.step_s) + "</b> (compute " +
      fmtTime(r.compute_s) + ", all-reduce busy " + fmtTime(r.comm_s) + ", exposed <b id=sc-exposed-out>" + fmtTime(r.exposed_s) +
      "</b>), " + r.buckets + " buckets; efficiency <b id=sc-eff>" + eff[dpIndex(q.dp)].toFixed(1) + "%</b>; <b id=sc-tps>" +
      fmtRate(tps[dpIndex(q.dp)]) + " " + unit + "/s</b>.";
    $("sc-batch").innerHTML = "global batch = micro-batch " + q.microBatch + " × DP " + q.dp + " × accumulation " + q.gradAcc +
      " = <b>" + q.microBatch * q.dp * q.gradAcc + "</b> samples" + (tokens ? " = <b id=sc-tokens>" + tokensGlobal.toLocaleString("en-US") +
      "</b> tokens (× " + byName(q.model).tokens_per_sample + " tokens per sample)" : "");
  }

  // ------------------------------------------------------------------------------ all-reduce panel

  const ALG_LABEL = { ring: "ring", tree: "tree (binomial)", naive: "naive (all-to-all)", hierarchical: "hierarchical (tree in host, ring across)" };

  function drawCollectives() {
    const size = D.all_reduce.sizes[Number($("ar-size").value)];
    const sizes = D.dp.filter((n) => n > 1);
    const n = sizes[Number($("ar-n").value)];
    $("ar-size-out").textContent = fmtBytes(size);
    $("ar-n-out").textContent = n;
    const net = chosenNetwork("ar");
    const algs = Object.keys(D.all_reduce.cells);
    const rows = algs.map((a) => [a, collective(a, size, n, net)]);
    const best = Math.min(...rows.map(([, r]) => r.time_s));
    $("ar-table").innerHTML = "<tr><th>algorithm</th><th>rounds</th><th>bytes sent (busiest rank)</th><th>predicted time</th><th>algorithm bandwidth</th></tr>" +
      rows.map(([a, r]) => "<tr" + (r.time_s === best ? " class=best" : "") + "><td>" + ALG_LABEL[a] + "</td><td>" + r.rounds +
        "</td><td>" + fmtBytes(r.bytes_per_rank) + "</td><td data-alg=" + a + ">" + fmtTime(r.time_s) + "</td><td>" +
        fmtBytes(size / r.time_s) + "/s</td></tr>").join("");
    Plotly.react("ar-chart", algs.map((a) => ({ type: "scatter", mode: "lines+markers", name: ALG_LABEL[a], x: sizes,
      y: sizes.map((k) => collective(a, size, k, net).time_s * 1e3), hovertemplate: a + ", %{x} ranks: %{y:.3f} ms<extra></extra>" })),
      frame({ height: 340, title: { text: "all-reduce of " + fmtBytes(size) + ": predicted time", font: { size: 14 } },
        xaxis: { type: "log", title: axisTitle("ranks"), tickvals: sizes }, yaxis: { type: "log", title: axisTitle("predicted time (ms)") },
        legend: { orientation: "h", y: -0.3 },
        shapes: [{ type: "line", x0: n, x1: n, yref: "paper", y0: 0, y1: 1, line: { dash: "dot", color: "#b00" } }] }), plotConfig);
  }

  // ---------------------------------------------------------------------- the ring, step by step

  const ring = { n: 4, t: 0, timer: null };

  function ringState(n, t) {
    // count[r][c]: how many ranks' gradients chunk c of rank r holds. Reduce-scatter step s: rank r sends
    // chunk (r - s) mod n to r + 1, which adds it; all-gather step s: rank r sends chunk (r + 1 - s) mod n,
    // which the next rank copies. After 2(n - 1) steps every rank holds every chunk's full sum.
    const count = Array.from({ length: n }, () => Array(n).fill(1));
    let sends = [];
    for (let k = 0; k < t; k++) {
      const rs = k < n - 1, s = rs ? k : k - (n - 1);
      sends = [];
      const next = count.map((row) => row.slice());
      for (let r = 0; r < n; r++) {
        const c = ((rs ? r - s : r + 1 - s) % n + n) % n, dst = (r + 1) % n;
        next[dst][c] = rs ? count[dst][c] + count[r][c] : count[r][c];
        sends.push([r, dst, c]);
      }
      for (let r = 0; r < n; r++) count[r] = next[r];
    }
    return { count, sends };
  }

  function drawRing() {
    const n = ring.n, steps = 2 * (n - 1), t = ring.t;
    const { count, sends } = ringState(n, t);
    const W = 520, H = 300, cx = 150, cy = 150, R = 105;
    const pos = (r) => [cx + R * Math.sin(2 * Math.PI * r / n), cy - R * Math.cos(2 * Math.PI * r / n)];
    let svg = '<svg viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H + '" role="img" aria-label="ring all-reduce">' +
      '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse">' +
      '<path d="M0,0 L10,5 L0,10 z" fill="#b00"/></marker></defs>';
    for (const [src, dst, c] of sends) {
      const [x1, y1] = pos(src), [x2, y2] = pos(dst);
      svg += '<line x1="' + (x1 + (x2 - x1) * 0.25) + '" y1="' + (y1 + (y2 - y1) * 0.25) + '" x2="' + (x1 + (x2 - x1) * 0.75) +
        '" y2="' + (y1 + (y2 - y1) * 0.75) + '" stroke="#b00" stroke-width="2" marker-end="url(#arrow)"/>' +
        '<text x="' + ((x1 + x2) / 2 + 6) + '" y="' + ((y1 + y2) / 2) + '" font-size="11" fill="#b00">c' + c + "</text>";
    }
    for (let r = 0; r < n; r++) {
      const [x, y] = pos(r);
      svg += '<circle cx="' + x + '" cy="' + y + '" r="16" fill="#fff" stroke="#1d2330"/><text x="' + x + '" y="' + (y + 4) +
        '" font-size="12" text-anchor="middle">' + r + "</text>";
    }
    const cell = 22;
    svg += '<text x="300" y="30" font-size="12">chunk: ' + Array.from({ length: n }, (_, c) => "c" + c).join("  ") + "</text>";
    for (let r = 0; r < n; r++) {
      svg += '<text x="300" y="' + (56 + r * (cell + 6)) + '" font-size="12">rank ' + r + "</text>";
      for (let c = 0; c < n; c++) {
        const k = count[r][c], x = 350 + c * (cell + 4), y = 40 + r * (cell + 6);
        const shade = Math.round(235 - 170 * (k - 1) / Math.max(1, n - 1));
        svg += '<rect x="' + x + '" y="' + y + '" width="' + cell + '" height="' + cell + '" fill="rgb(' + shade + "," + shade +
          ',255)" stroke="#999"><title>rank ' + r + ", chunk " + c + ": sum of " + k + " ranks</title></rect>" +
          '<text x="' + (x + cell / 2) + '" y="' + (y + 15) + '" font-size="11" text-anchor="middle">' + k + "</text>";
      }
    }
    svg += "</svg>";
    $("ring-svg").innerHTML = svg;
    const phase = t === 0 ? "start: every rank holds its own gradient, in " + n + " chunks"
      : t <= n - 1 ? "reduce-scatter, step " + t + " of " + (n - 1) + ": each rank sends one chunk to the next, which adds it"
      : "all-gather, step " + (t - n + 1) + " of " + (n - 1) + ": each rank passes a finished chunk on";
    const done = t === steps ? " Done: every rank holds the sum of all " + n + " gradients, identical everywhere." : "";
    $("ring-phase").textContent = "step " + t + " of " + steps + " — " + phase + "." + done +
      " Each rank sends 2(n−1)/n = " + (2 * (n - 1) / n).toFixed(2) + " × the gradient in all, whatever n.";
  }

  function ringControls() {
    $("ring-n").addEventListener("input", () => { ring.n = Number($("ring-n").value); ring.t = 0; $("ring-n-out").textContent = ring.n; drawRing(); });
    $("ring-step").addEventListener("click", () => { ring.t = Math.min(ring.t + 1, 2 * (ring.n - 1)); drawRing(); });
    $("ring-reset").addEventListener("click", () => { ring.t = 0; drawRing(); });
    $("ring-play").addEventListener("click", () => {
      if (ring.timer) { clearInterval(ring.timer); ring.timer = null; $("ring-play").textContent = "play"; return; }
      if (ring.t >= 2 * (ring.n - 1)) ring.t = 0;
      $("ring-play").textContent = "pause";
      ring.timer = setInterval(() => {
        ring.t += 1; drawRing();
        if (ring.t >= 2 * (ring.n - 1)) { clearInterval(ring.timer); ring.timer = null; $("ring-play").textContent = "play"; }
      }, 900);
    });
  }

  // ------------------------------------------------------------------------------------- wiring

  function init() {
    const names = D.models.map((m) => m.name);
    const start = names.includes("7b") ? "7b" : names[names.length - 1];
    fill($("mem-model"), names, modelLabel, start);
    fill($("sc-model"), names, modelLabel, names.includes("gpt2-124m") ? "gpt2-124m" : names[0]);
    fill($("mem-strategy"), D.strategies, label, D.first);
    fill($("mem-precision"), D.precisions, null, "bf16");
    fill($("mem-optimizer"), D.optimizers, null, "adamw");
    fill($("mem-mb"), D.micro_batches, null, D.micro_batches[0]);
    fill($("mem-device"), D.devices.map((d) => d.name).concat(["custom"]),
         (name) => { const d = D.devices.find((x) => x.name === name); return d ? d.label + ": " + fmtBytes(d.bytes) : "your own (GiB)"; },
         D.devices[0].name);
    $("mem-headroom").value = String(Math.round(100 * D.headroom));
    fill($("sc-cap"), D.bucket_caps, (c) => c === 0 ? "none: one all-reduce per parameter" : c + " MiB", 25);
    fill($("sc-compression"), D.compression, (c) => c === 1 ? "none" : c + "× fewer bytes", 1);
    for (const p of ["sc", "ar"]) fill($(p + "-net"), netNames, netLabel, "nvlink4+ib-ndr");
    for (const id of ["mem-dp", "sc-dp"]) { $(id).max = D.dp.length - 1; $(id).value = dpIndex(8); }
    $("ar-size").max = D.all_reduce.sizes.length - 1;
    $("ar-size").value = D.all_reduce.sizes.indexOf(64 * 1024 * 1024) >= 0 ? D.all_reduce.sizes.indexOf(64 * 1024 * 1024) : 0;
    const arSizes = D.dp.filter((n) => n > 1);
    $("ar-n").max = arSizes.length - 1;
    $("ar-n").value = Math.max(0, arSizes.indexOf(8));
    const on = (ids, draw) => { for (const id of ids) { $(id).addEventListener("input", draw); $(id).addEventListener("change", draw); } };
    on(["mem-model", "mem-dp", "mem-strategy", "mem-precision", "mem-optimizer", "mem-mb", "mem-ckpt", "mem-device", "mem-device-gib", "mem-headroom"], drawMemory);
    on(["sc-model", "sc-dp", "sc-cap", "sc-net", "sc-alpha", "sc-gbit", "sc-pernode", "sc-overlap", "sc-compression", "sc-mb", "sc-tflops", "sc-acc"], drawScaling);
    on(["ar-size", "ar-n", "ar-net", "ar-alpha", "ar-gbit", "ar-pernode"], drawCollectives);
    ringControls();
    drawMemory(); drawScaling(); drawCollectives(); drawRing();
    document.body.dataset.ready = "1";
  }

  init();
})();
