"""asap_comm.serving.metrics: percentiles, run summaries, SLO-compliant throughput,
Chrome trace timelines. Cheapest tier: pure functions on hand-computed examples."""
import json
import math
import random

import numpy as np
import pytest

from asap_comm.serving import (ChromeTrace, RequestRecord, RunSummary, percentile, served_fraction,
                               slo_compliant_throughput, summarize_run, sustains_slo)

SUMMARY_KEYS = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s", "slo_attainment",
                "num_requests", "num_failed", "served_fraction"}


# --------------------------------------------------------------------------- percentile

def test_percentile_hand_computed_and_matches_numpy():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # h = 3.6 -> 40 + 0.6 * 10
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 1001):
        vals = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="finite"):
        percentile([1.0, math.nan], 50)


# --------------------------------------------------------------------------- records and run summary

def test_request_record_properties():
    r = RequestRecord(7, arrival_s=1.0, prompt_len=10)
    assert not r.ok and r.ttft_s is None and r.queue_s is None  # not finished yet
    r.start_s, r.done_s = 1.25, 3.0
    assert r.ok and r.ttft_s == 2.0 and r.queue_s == 0.25
    r.error = "expert rank 2 died"
    assert not r.ok and r.ttft_s is None


def _records():
    # ttft: 1.0, 2.0, 3.0, 4.0 (ok), one failed, one never finished
    recs = [RequestRecord(i, arrival_s=float(i), prompt_len=100 * (i + 1), start_s=float(i),
                          done_s=float(i) + ttft) for i, ttft in enumerate([1.0, 2.0, 3.0, 4.0])]
    recs.append(RequestRecord(4, arrival_s=4.0, prompt_len=1000, start_s=4.5, error="prompt too long"))
    recs.append(RequestRecord(5, arrival_s=5.0, prompt_len=50))
    return recs


def test_summarize_run_hand_computed():
    s = summarize_run(_records(), slo_ttft_s=2.0)
    d = s.as_dict()
    assert set(d) == SUMMARY_KEYS
    assert d["ttft_p50_s"] == pytest.approx(2.5)
    assert d["ttft_p90_s"] == pytest.approx(3.7)    # h = 2.7 over [1, 2, 3, 4]
    assert d["ttft_p99_s"] == pytest.approx(3.97)
    # prompt tokens of the successful ones (100+200+300+400) over last done (3+4=7) - first arrival (0)
    assert d["throughput_tokens_per_s"] == pytest.approx(1000 / 7)
    assert d["slo_attainment"] == pytest.approx(2 / 6)  # ttft 1.0 and 2.0 (inclusive) of all 6 requests
    assert (d["num_requests"], d["num_failed"]) == (6, 2)
    # served over offered tokens/s: offered 2050 tokens over the arrivals' span (0 to 5 s); served 1000 over the
    # first arrival to the last first token (7 s) less one SLO (2 s), never shorter than the span: 5 s
    assert d["served_fraction"] == pytest.approx((1000 / 5) / (2050 / 5))
    # a tighter SLO: the drain past it (7 - 1 = 6 s) lengthens the window
    assert summarize_run(_records(), slo_ttft_s=1.0).served_fraction == pytest.approx((1000 / 6) / (2050 / 5))
    json.dumps(d, allow_nan=False)  # summary.json-ready


def test_served_fraction_counts_a_backlog_past_one_slo():
    """A mode that keeps up (each request done 0.5 s after it arrives, SLO 1 s) reads 1.0; one that meets the SLO
    for 90% of the requests but leaves the last tenth queued until 100 s after the arrivals end reads the
    arrivals' span over the window: 9 / (109 - 1)."""
    arrivals = [float(i) for i in range(10)]  # one request a second, 0..9 s
    keep_up = [RequestRecord(i, t, 100, t, t + 0.5) for i, t in enumerate(arrivals)]
    assert summarize_run(keep_up, 1.0).served_fraction == pytest.approx(1.0)
    backlog = keep_up[:9] + [RequestRecord(9, 9.0, 100, 9.0, 109.0)]
    s = summarize_run(backlog, 1.0)
    assert s.slo_attainment == pytest.approx(0.9) and s.served_fraction == pytest.approx(9 / 108)
    assert slo_compliant_throughput([s.as_dict() | {"offered_tokens_per_s": 100.0}]) is None
    assert slo_compliant_throughput([summarize_run(keep_up, 1.0).as_dict() | {"offered_tokens_per_s": 100.0}]) \
        == 100.0


def test_summarize_run_edge_cases():
    all_failed = [RequestRecord(0, 0.0, 10, error="bad token id"), RequestRecord(1, 1.0, 10, error="x")]
    s = summarize_run(all_failed, slo_ttft_s=1.0)
    assert s == RunSummary(None, None, None, 0.0, 0.0, 2, 2, 0.0)
    json.dumps(s.as_dict(), allow_nan=False)
    one = summarize_run([RequestRecord(0, 2.0, 64, 2.0, 2.5)], slo_ttft_s=0.5)
    assert (one.ttft_p50_s, one.ttft_p99_s, one.slo_attainment) == (0.5, 0.5, 1.0)
    assert one.throughput_tokens_per_s == pytest.approx(128.0)
    with pytest.raises(ValueError, match="no records"):
        summarize_run([], 1.0)
    with pytest.raises(ValueError, match="slo_ttft_s=0"):
        summarize_run(all_failed, 0)
    with pytest.raises(ValueError, match="request 3 has done_s=0.5 before arrival_s=1.0"):
        summarize_run([RequestRecord(3, 1.0, 5, done_s=0.5)], 1.0)


# --------------------------------------------------------------------------- SLO-compliant throughput

def _sustained(pts):
    """(load, attainment) pairs as points of a mode that serves every load in full."""
    return [(load, att, 1.0) for load, att in pts]


def test_slo_compliant_throughput_prefix_convention():
    pts = _sustained([(4.0, 0.95), (1.0, 1.0), (2.0, 0.97), (3.0, 0.90), (5.0, 0.5)])  # any order; 0.90 passes
    assert slo_compliant_throughput(pts) == 4.0
    # a noisy pass above the first failure does not count
    assert slo_compliant_throughput(_sustained([(1, 1.0), (2, 0.85), (3, 0.95)])) == 1.0
    # everything passes: the highest tested load (a lower bound of the true value)
    assert slo_compliant_throughput(_sustained([(1, 1.0), (8, 0.99)])) == 8.0
    # the lowest load already fails
    assert slo_compliant_throughput(_sustained([(1, 0.5), (2, 0.95)])) is None
    # repeated loads pass only if every repetition passes
    assert slo_compliant_throughput(_sustained([(1, 1.0), (2, 0.95), (2, 0.80), (3, 0.99)])) == 1.0
    # the target is configurable
    assert slo_compliant_throughput(pts, target=0.99) == 1.0
    assert slo_compliant_throughput(pts, target=0.5) == 5.0


def test_a_load_counts_only_where_the_mode_sustains_it():
    """The README's sim run case: a mode that meets p90 at every load but served 9% of what was offered (its
    longest tenth queued without bound) has no SLO-compliant throughput; served >= 0.9 of offered is the bar."""
    assert slo_compliant_throughput([(1.0, 0.95, 0.09), (2.0, 0.93, 0.05)]) is None
    # meets the SLO everywhere; sustained up to 2, not at 3: 2 (the walk up stops at the first unsustained load)
    pts = [(1.0, 1.0, 1.0), (2.0, 0.97, 0.91), (3.0, 0.95, 0.6), (4.0, 0.95, 0.95)]
    assert slo_compliant_throughput(pts) == 2.0
    assert slo_compliant_throughput(pts, min_served=0.5) == 4.0  # the bar is a parameter
    assert slo_compliant_throughput([(1.0, 1.0, 0.9)]) == 1.0  # 0.9 itself passes (>=)
    # repetitions at one load: every one must be sustained
    assert slo_compliant_throughput([(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (2.0, 1.0, 0.7)]) == 1.0
    # run summaries as points: offered_tokens_per_s is the load, served = throughput / offered
    runs = [{"offered_tokens_per_s": 100.0, "slo_attainment": 1.0, "served_fraction": 0.99},
            {"offered_tokens_per_s": 200.0, "slo_attainment": 0.95, "served_fraction": 0.6}]
    assert slo_compliant_throughput(runs) == 100.0
    assert served_fraction(runs[1]) == 0.6
    assert sustains_slo(0.95, 0.95) and not sustains_slo(0.95, 0.89) and not sustains_slo(0.89, 1.0)


def test_a_withheld_figure_says_why_and_the_ratio_is_none():
    from asap_comm.serving import throughput_ratio, withheld_reason

    asap = [(1.0, 0.95, 0.09), (2.0, 0.93, 0.05)]
    base = [(1.0, 1.0, 1.0), (2.0, 0.95, 0.98)]
    assert withheld_reason(asap) == "sustains no tested load (served 9% of offered at the lowest)"
    assert withheld_reason(base) is None
    assert "meets the SLO at no tested load (attainment 0.50 < 0.90" in withheld_reason([(1.0, 0.5, 1.0)])
    ratio, why = throughput_ratio(slo_compliant_throughput(asap), slo_compliant_throughput(base),
                                  points=(asap, base))
    assert ratio is None and why == ("ratio withheld: ASAP sustains no tested load (served 9% of offered at the "
                                     "lowest)")
    assert throughput_ratio(3.0, 2.0) == (1.5, None)
    assert throughput_ratio(3.0, None, names=("x", "y"))[1] == "ratio withheld: y has no SLO-compliant load"


def test_slo_compliant_throughput_errors():
    with pytest.raises(ValueError, match="no points"):
        slo_compliant_throughput([])
    with pytest.raises(ValueError, match="target=0"):
        slo_compliant_throughput([(1, 1.0, 1.0)], target=0)
    with pytest.raises(ValueError, match="attainment 1.5 at load 2"):
        slo_compliant_throughput([(2, 1.5, 1.0)])
    with pytest.raises(ValueError, match="offered load -1"):
        slo_compliant_throughput([(-1, 1.0, 1.0)])
    # the served fraction cannot be left out by accident: a pair, a None fraction, a summary without throughput
    with pytest.raises(ValueError, match="served_fraction"):
        slo_compliant_throughput([(1, 1.0)])
    with pytest.raises(ValueError, match="served_fraction"):
        slo_compliant_throughput([(1, 1.0, None)])
    with pytest.raises(ValueError, match="served_fraction"):
        slo_compliant_throughput([{"offered_tokens_per_s": 1.0, "slo_attainment": 1.0,
                                   "throughput_tokens_per_s": 1.0}])
    with pytest.raises(ValueError, match="min_served"):
        slo_compliant_throughput([(1, 1.0, 1.0)], min_served=1.5)


# --------------------------------------------------------------------------- Chrome trace

def test_chrome_trace_round_trip(tmp_path):
    tl = ChromeTrace()
    tl.name_process(0, "attention 0", sort_index=0)
    tl.name_process(2, "expert 0")
    tl.name_track(0, 1, "comm")
    tl.complete("layer 1 attn", pid=0, tid=0, start_s=0.001, dur_s=0.0025, args={"tokens": 512, "mb": 0})
    tl.complete("dispatch", pid=0, tid=1, start_s=0.0035, dur_s=0.0, cat="comm")
    tl.complete("experts L1", pid=2, tid=0, start_s=0.004, dur_s=0.002)
    path = tl.write(tmp_path / "timeline.json")
    assert path == tmp_path / "timeline.json" and not (tmp_path / "timeline.json.tmp").exists()
    data = json.loads(path.read_text())
    assert set(data) == {"traceEvents", "displayTimeUnit"}
    evs = data["traceEvents"]
    spans = [e for e in evs if e["ph"] == "X"]
    meta = [e for e in evs if e["ph"] == "M"]
    assert len(spans) == 3 and len(meta) == 4
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["dur"] >= 0
    first = spans[0]
    assert first["name"] == "layer 1 attn" and first["args"] == {"tokens": 512, "mb": 0}
    assert first["ts"] == pytest.approx(1000.0) and first["dur"] == pytest.approx(2500.0)  # microseconds
    assert spans[1]["cat"] == "comm" and "args" not in spans[1]
    names = {(e["pid"], e["tid"], e["name"]): e["args"] for e in meta}
    assert names[(0, 0, "process_name")] == {"name": "attention 0"}
    assert names[(0, 0, "process_sort_index")] == {"sort_index": 0}
    assert names[(0, 1, "thread_name")] == {"name": "comm"}
    assert names[(2, 0, "process_name")] == {"name": "expert 0"}


def test_chrome_trace_rejects_bad_spans(tmp_path):
    tl = ChromeTrace()
    with pytest.raises(ValueError, match="'x' has start_s=0.0, dur_s=-1.0"):
        tl.complete("x", 0, 0, 0.0, -1.0)
    with pytest.raises(ValueError, match="finite"):
        tl.complete("x", 0, 0, math.inf, 1.0)
    tl.complete("y", 0, 0, 0.0, 1.0, args={"v": math.nan})
    with pytest.raises(ValueError):  # NaN is not JSON: refused at write time, not in the viewer
        tl.write(tmp_path / "t.json")


def test_served_at_load_reports_what_the_compliant_load_served():
    """served_at_load: the median served tokens/s, served fraction and p99 of the runs at exactly that offered load;
    None without a load or a run there (a mode that met p90 while serving half its offered load shows it)."""
    from asap_comm.serving import served_at_load

    runs = [{"offered_tokens_per_s": 100.0, "throughput_tokens_per_s": 99.0, "ttft_p99_s": 1.0},
            {"offered_tokens_per_s": 200.0, "throughput_tokens_per_s": 100.0, "ttft_p99_s": 30.0},
            {"offered_tokens_per_s": 200.0, "throughput_tokens_per_s": 120.0, "ttft_p99_s": 40.0},
            {"offered_tokens_per_s": 200.0, "throughput_tokens_per_s": 140.0, "ttft_p99_s": None}]
    at = served_at_load(runs, 200.0)
    assert at == {"offered_tokens_per_s": 200.0, "served_tokens_per_s": 120.0, "served_fraction": 0.6,
                  "ttft_p99_s": 35.0, "runs": 3}
    assert served_at_load(runs, 100.0)["served_fraction"] == pytest.approx(0.99)
    assert served_at_load(runs, None) is None and served_at_load(runs, 150.0) is None
    assert served_at_load([], 100.0) is None
    # runs that report the long-prompt lane's counts (LaneCounts.as_dict): summed there, the longest wait kept
    lane = {"opened": 3, "waited": 2, "gave_up": 1, "wait_s_mean": 0.5, "wait_s_max": 2.0}
    laned = [dict(r, lane=dict(lane, wait_s_max=w)) for r, w in zip(runs[1:3], (2.0, 3.5))]
    assert served_at_load(laned, 200.0)["lane"] == {"opened": 6, "waited": 4, "gave_up": 2, "wait_s_max": 3.5}
    assert "lane" not in served_at_load(runs, 200.0)
