"""``dptrain bench ddp-timeline``'s arithmetic: spans per variant, slowest rank, the Chrome trace (no timings)."""

from dptrain.bench.ddp_timeline import VARIANTS, chrome_trace, summarise


def _step(t0: float, comm: list) -> dict:
    # forward 10 ms, backward's computation 20 ms, a wait of 5 ms, the optimizer 2 ms
    return {"start": t0, "forward_end": t0 + 0.010, "first_grad": t0 + 0.015, "last_grad": t0 + 0.030,
            "backward_end": t0 + 0.035,
            "end": t0 + 0.037, "comm": comm}


def _rank(slower: float) -> dict:
    steps = {v: [_step(1.0, [[1.02, 1.03 + slower], [1.025, 1.034]] if v != "no_comm" else [])] for v in VARIANTS}
    return {"steps": steps, "isolated": {v: [0.004, 0.006] for v in VARIANTS[1:]},
            "buckets": {v: [10, 20] for v in VARIANTS[1:]}}


def test_spans_are_the_slowest_ranks_in_ms():
    rows = summarise([_rank(0.0), _rank(0.002)])
    assert set(rows) == set(VARIANTS)
    row = rows["torch_ddp"]
    assert round(row["forward"], 6) == 10.0 and round(row["backward compute"], 6) == 20.0
    assert round(row["wait after backward"], 6) == 5.0 and round(row["optimizer"], 6) == 2.0
    assert round(row["comm busy"], 6) == 14.0  # the union of 20-32 ms and 25-34 ms, the slower rank's
    assert round(row["isolated all-reduces"], 6) == 10.0
    assert "comm busy" not in rows["no_comm"]
    # the first all-reduce started 10 ms into backward's 20 ms of computation; both started before it ended
    assert round(row["first all-reduce, % of backward"], 6) == 50.0
    assert round(row["first gradient, % of backward"], 6) == 25.0
    assert row["all-reduces started in backward"] == 2 and row["all-reduces"] == 2


def test_the_trace_has_a_process_per_variant_and_compute_and_comm_rows_per_rank():
    trace = chrome_trace([_rank(0.0), _rank(0.0)])["traceEvents"]
    assert {e["pid"] for e in trace} == set(VARIANTS)
    assert {e["tid"] for e in trace} == {"rank 0 compute", "rank 1 compute", "rank 0 comm", "rank 1 comm",
                                         "rank 0 gradients", "rank 1 gradients"}
    forward = next(e for e in trace if e["name"] == "forward" and e["pid"] == "torch_ddp")
    assert forward["ts"] == 0.0 and round(forward["dur"], 3) == 10_000.0  # microseconds from the first step
    assert sum(e["name"].startswith("all-reduce") for e in trace) == 2 * 2 * (len(VARIANTS) - 1)
