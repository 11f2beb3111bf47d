"""The figures (asap_comm.sim.studies.plots, sim.figures, serving.plotting, the load client's CDF), built from small
synthetic study results and checked on the matplotlib objects: the plotted percentile is the study's, axis
labels match the series, the title states what was run and fits inside the figure, no probe load is on the
axes, tick labels are plain, the SLO and the sustained-load cut are drawn."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("matplotlib")

from asap_comm.serving import plotting  # noqa: E402
from asap_comm.sim.studies import figures, plots  # noqa: E402

SLO = 10.0


@pytest.fixture
def captured(monkeypatch):
    """Every figure the plots would save, by file name (not written: rendering PNGs is the slow part;
    ``test_replot_...`` writes them)."""
    figs = {}

    def save(fig, path, dpi=120):
        figs[path.name] = fig
        return [path.name]

    monkeypatch.setattr(plots, "save", save)
    yield figs
    for fig in figs.values():
        plotting.pyplot().close(fig)


def _run(mode, load, att, served, p50, p90, p99, n=200):
    return {"mode": mode, "offered_tokens_per_s": load, "rate_req_s": load / 1000.0, "slo_attainment": att,
            "served_fraction": served, "throughput_tokens_per_s": served * load, "num_requests": n,
            "num_failed": 0, "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99}


def _runs():
    """ASAP passes up to 4,000 tok/s at p99 (8,000 is not sustained); the baseline's 2,000 meets the SLO for 98%
    of requests: enough at p90, not at p99. Both have a probe at 0.001 tok/s that passes."""
    return [_run("async", 0.001, 1.0, 1.0, 0.5, 1.0, 2.0), _run("async", 1000, 1.0, 1.0, 1, 2, 3),
            _run("async", 2000, 0.995, 1.0, 1.5, 3, 6), _run("async", 4000, 0.99, 0.95, 2, 5, 9),
            _run("async", 8000, 0.5, 0.6, 8, 20, 40),
            _run("sync", 0.001, 1.0, 1.0, 0.4, 0.9, 1.5), _run("sync", 1000, 1.0, 1.0, 1, 2.5, 4),
            _run("sync", 2000, 0.98, 0.97, 2, 6, 12), _run("sync", 4000, 0.7, 0.8, 5, 15, 30)]


def _headline(percentile=99.0, with_p99=True):
    def pt(m, f, p50, p90, p99):
        d = {"ttft_p50_s": p50, "ttft_p90_s": p90, "slo_attainment": 1.0}
        if with_p99:
            d["ttft_p99_s"] = p99
        return d
    load = [{"load_fraction_of_baseline_slo_rate": f, "rate_req_s": f * 2.0,
             "async": pt("async", f, 1, 2 * f, 4 * f), "sync": pt("sync", f, 1, 3 * f, 10 * f)}
            for f in (0.25, 0.5, 1.0)]
    res = {"profile": "ascend-910c-cm384", "devices": 64, "trace": "mooncake file, first 600 requests",
           "slo_s": SLO, "slo_percentile": percentile, "runs": _runs(), "load_sensitivity": load,
           "skew_sensitivity": [{"sigma": 0.0, "ratio": 1.1, "slo_s": 9.0}, {"sigma": 1.0, "ratio": None, "slo_s": 11.0}],
           "sweep": {"sync": {"slo_compliant_rate_req_s": 2.0}},
           "best": {"async": {"label": "ASAP 6 x TP8 + 16", "slo_compliant_throughput": 4000.0},
                    "sync": {"label": "DP+EP 8 x TP8", "slo_compliant_throughput": 1000.0}}}
    return {"config": {"model": "deepseek-v3", "num_requests_sensitivity": 200},
            "profiles": {"ascend-910c-cm384": res}}


def _draw(fig):
    if not hasattr(fig.canvas, "get_renderer"):  # a closed figure keeps a bare canvas: give it one that renders
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _inside(fig, text) -> bool:
    r = _draw(fig)
    bb, fb = text.get_window_extent(r), fig.bbox
    return bb.x0 >= fb.x0 - 0.5 and bb.x1 <= fb.x1 + 0.5 and bb.y0 >= fb.y0 - 0.5 and bb.y1 <= fb.y1 + 0.5


def _labels(ax, which="x") -> list:
    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    fmt = axis.get_major_formatter()
    return [fmt(v) for v in axis.get_majorticklocs() if lo <= v <= hi]


def _plain(ax, which="x", at_least=2):
    labels = [x for x in _labels(ax, which) if x]
    assert len(labels) >= at_least, labels
    for x in labels:
        assert not any(s in x for s in ("$", "^", "e+", "e-", "\\times")), labels
    axis = ax.xaxis if which == "x" else ax.yaxis
    assert axis.get_offset_text().get_text() == ""


def _legend(ax) -> str:
    return " ".join(" ".join(t.get_text() for t in ax.get_legend().get_texts()).split())


def _flat(text) -> str:
    return " ".join(text.get_text().split())


def _xs(ax) -> list:
    """The x data of the lines drawn in data coordinates (not axhline's axes fractions)."""
    return [x for ln in ax.get_lines() if ln.get_transform() is ax.transData for x in ln.get_xdata()]


def test_headline_p99_plots_p99_with_the_slo_the_cut_and_no_probe(tmp_path, captured):
    d = _headline()
    made, skipped = figures.headline_figures(tmp_path, d["profiles"]["ascend-910c-cm384"], d["config"])
    assert {"slo_throughput_ascend-910c-cm384.png", "ttft_ascend-910c-cm384.png", "ratio_vs_skew_ascend-910c-cm384.png",
            "ratio_vs_load_ascend-910c-cm384.png"} <= set(made)
    assert [n for n, _ in skipped] == ["utilisation_ascend-910c-cm384.png"]  # no spans in a JSON

    fig = captured["slo_throughput_ascend-910c-cm384.png"]
    ax, bx = fig.axes[:2]
    # the TTFT panel plots p99, the study's percentile, at the shown loads
    assert "p99" in bx.get_ylabel()
    series = [ln for ln in bx.get_lines() if ln.get_label().endswith("TTFT p99")]
    assert len(series) == 2 and not any("p90" in ln.get_label() for ln in bx.get_lines())
    a = next(ln for ln in series if ln.get_label().startswith("ASAP"))
    assert list(a.get_ydata()) == [3, 6, 9, 40]
    # the SLO (horizontal at 10 s) and the sustained-load cut (served = 0.9 x offered) are drawn
    assert any(list(ln.get_ydata()) == [SLO, SLO] and "SLO" in ln.get_label() for ln in bx.get_lines())
    cut = [ln for ln in ax.get_lines() if "sustained-load cut" in ln.get_label()]
    assert cut and all(math.isclose(y, 0.9 * x) for x, y in zip(cut[0].get_xdata(), cut[0].get_ydata()))
    # each mode's SLO-compliant throughput at p99: ASAP 4,000; the baseline 1,000 (its 2,000 fails at p99)
    vlines = {ln.get_color(): ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--"
              and len(set(ln.get_xdata())) == 1}
    assert sorted(vlines.values()) == [1000, 4000]
    legend = _legend(ax)
    assert "SLO-compliant throughput 4,000" in legend and "SLO-compliant throughput 1,000" in legend
    # the probe at 0.001 tok/s is off the axes, and said so
    for axis in (ax, bx):
        assert min(_xs(axis)) >= 500 and axis.get_xlim()[0] > 1
    assert "probe at 0.001" in fig._supxlabel.get_text()
    # the title states the run and fits; ticks are plain
    title = fig._suptitle.get_text().replace("\n", " ").replace("  ", " ")
    for fact in ("simulated", "ascend-910c-cm384", "64 dies", "deepseek-v3", "mooncake", "prompt tokens/s",
                 "99% of requests", "10 s"):
        assert fact in title, fact
    assert _inside(fig, fig._suptitle) and _inside(fig, fig._supxlabel)
    _plain(bx, "x")
    _plain(bx, "y")
    _plain(ax, "y")


def test_headline_ratio_axes_match_their_series(tmp_path, captured):
    d = _headline()
    figures.headline_figures(tmp_path, d["profiles"]["ascend-910c-cm384"], d["config"])
    fig = captured["ratio_vs_load_ascend-910c-cm384.png"]
    ax = fig.axes[0]
    (series,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("TTFT")]
    assert series.get_label() == "TTFT p99, baseline / ASAP"
    assert "TTFT p99, baseline / ASAP" in ax.get_ylabel()
    assert list(series.get_ydata()) == pytest.approx([10 / 4] * 3)  # sync p99 / async p99, not p90
    assert _inside(fig, fig._suptitle)
    skew = captured["ratio_vs_skew_ascend-910c-cm384.png"]
    ax = skew.axes[0]
    assert "best ASAP / best baseline" in ax.get_ylabel()
    assert "withheld at 1" in skew._supxlabel.get_text()  # sigma 1.0's ratio is withheld, not drawn
    assert "synthetic log-normal" in skew._suptitle.get_text().replace("\n", " ").replace("  ", " ")


def test_a_p90_study_plots_p90_and_a_p99_json_without_p99_loads_is_listed(tmp_path, captured):
    d = _headline(percentile=90.0)
    figures.headline_figures(tmp_path, d["profiles"]["ascend-910c-cm384"], d["config"])
    bx = captured["slo_throughput_ascend-910c-cm384.png"].axes[1]
    assert "p90" in bx.get_ylabel() and all("p99" not in ln.get_label() for ln in bx.get_lines())
    # at p90 the baseline's 2,000 (98% within the SLO) counts
    ax = captured["slo_throughput_ascend-910c-cm384.png"].axes[0]
    assert "SLO-compliant throughput 2,000" in _legend(ax)
    d = _headline(with_p99=False)
    (tmp_path / "old").mkdir()
    made, skipped = figures.headline_figures(tmp_path / "old", d["profiles"]["ascend-910c-cm384"], d["config"])
    assert "ratio_vs_load_ascend-910c-cm384.png" not in made
    assert any(n == "ratio_vs_load_ascend-910c-cm384.png" and "ttft_p99_s" in why for n, why in skipped)


def test_emulated_example_title_names_the_emulated_dies_and_token_scale(tmp_path, captured):
    runs = [{k: v for k, v in r.items() if k != "served_fraction"} for r in _runs() if r["offered_tokens_per_s"] > 1]
    summary = {"config": {"model": "tiny", "modes": "async,sync", "trace": "mooncake", "num_requests": 240,
                          "attention_ranks": 2, "expert_ranks": 4, "attention_tp": 8, "expert_dies": 4, "sync_tp": 8,
                          "sync_ranks": None, "emulate": "ascend-910c-cm384", "emulate_model": "deepseek-v3",
                          "token_scale": 128, "time_scale": 0.35, "length_scale": 1 / 128},
               "slo": {"ttft_s": SLO}, "runs": runs, "async": {"slo_compliant_throughput": 8000.0},
               "sync": {"slo_compliant_throughput": 2000.0}}
    made, _ = figures.example_figures(tmp_path, summary)
    assert made == ["slo_throughput.png", "ttft.png"]
    fig = captured["slo_throughput.png"]
    title = fig._suptitle.get_text().replace("\n", " ").replace("  ", " ")
    for fact in ("emulated ascend-910c-cm384 dies", "16 attention", "16 expert", "baseline 32", "128 emulated tokens",
                 "deepseek-v3", "served: tiny", "mooncake", "240 requests", "tokens/s", "90% of requests"):
        assert fact in title, fact
    assert _inside(fig, fig._suptitle)
    assert "p90" in fig.axes[1].get_ylabel()  # the example's SLO is at p90
    # a result file stating other cuts than the sustained-load rule gives is flagged under the figure
    assert "the result file states 8,000" in fig._supxlabel.get_text()
    assert "(x128 emulated)" in fig.axes[1].get_xlabel()


def test_a_served_fraction_missing_from_old_results_is_rebuilt_exactly():
    """The window of serving.served_fraction, rebuilt from a run's numbers (no failures): same value."""
    from asap_comm.serving.metrics import RequestRecord, summarize_run

    recs = []
    for i in range(50):  # arrivals 1 s apart (rate 1/s), each takes 3 s more than the one before it to start
        r = RequestRecord(request_id=i, arrival_s=float(i), prompt_len=100)
        r.start_s, r.done_s = i + 0.1, i + 0.3 + 0.05 * i * i
        recs.append(r)
    s = summarize_run(recs, 2.0).as_dict()
    run = dict(s, rate_req_s=1.0, offered_tokens_per_s=100.0)
    own = s.pop("served_fraction")
    assert own < 0.9
    served, how = plots._served(dict(run, served_fraction=None), 2.0)
    assert how == "rebuilt" and served == pytest.approx(own, rel=1e-9)


def test_probe_loads_and_plain_numbers():
    assert plotting.probe_loads([1e-3, 1000, 2000, 4000]) == {1e-3}
    assert plotting.probe_loads([1e-4, 1e-3, 1000]) == {1e-4, 1e-3}
    assert plotting.probe_loads([250, 1000, 4000]) == set()  # a search's 4x steps are loads, not probes
    assert [plotting.plain_number(v) for v in (0.05, 2, 1.5, 20000, 0)] == ["0.05", "2", "1.5", "20,000", "0"]


def test_a_long_title_fits_a_small_figure():
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
    ax.plot([1, 2], [1, 2])
    t = plotting.fit_title(fig, ["a very long line of facts " * 12, "another-unbreakable-" * 3 + " and words"])
    assert _inside(fig, t) and t.get_text().count("\n") >= 3
    plt.close(fig)


def test_client_cdf_has_plain_ticks_and_a_fitted_title(tmp_path, monkeypatch):
    from asap_comm.serving import client

    figs = []
    real = plotting.save
    monkeypatch.setattr(plotting, "save", lambda fig, path, dpi=120: (figs.append(fig), real(fig, path, dpi))[1])
    runs = {"4 req/s": [{"ttft_s": 0.3 + 0.01 * i, "status": 200} for i in range(50)] + [{"status": 503}]}
    client.plot_cdf(tmp_path / "ttft_cdf.png", runs, 0.6, title=["measured: the service at http://127.0.0.1:8000, "
                                                                 "model small; trace synthetic, 51 requests per run"])
    assert (tmp_path / "ttft_cdf.png").is_file()
    (fig,) = figs
    _plain(fig.axes[0], "x", at_least=3)  # a TTFT range under a decade: one tick was all a log axis gave
    assert "model small" in fig._suptitle.get_text().replace("\n", " ").replace("  ", " ") and _inside(fig, fig._suptitle)


def test_replot_redraws_from_json_and_lists_what_it_cannot(tmp_path, capsys):
    from asap_comm.sim.cli import main

    (tmp_path / "summary.json").write_text(json.dumps(_headline()))
    assert main(["replot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "slo_throughput_ascend-910c-cm384.png" in out and "skipped utilisation_ascend-910c-cm384.png" in out
    assert (tmp_path / "slo_throughput_ascend-910c-cm384.png").stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    assert main(["replot", str(tmp_path / "empty")]) == 2
    assert "no summary.json or barrier.json" in capsys.readouterr().err


def test_rerun_rebuilds_the_winners_and_refuses_a_json_it_does_not_reproduce():
    """replot --rerun-points: the winners rebuilt from their describe() records, checked against the JSON's
    numbers at the base load before anything is drawn from a re-run."""
    from asap_comm.sim.core.simulate import Parallelism
    from asap_comm.sim.core.sweep import Deployment, run_point
    from asap_comm.sim.costmodel.costs import CostModel
    from asap_comm.sim.costmodel.shapes import ModelShapes
    from asap_comm.sim.studies.grids import headline_config, mooncake_trace

    slo, n, rate = 15.0, 30, 0.3
    a = Deployment("async", dataclasses.replace(headline_config(6, 16, 8192, 8192, 16384, 0.0005, 262144),
                                                lane_wait_s=2.0 * slo), Parallelism(attention_tp=8))
    s = Deployment("sync", headline_config(chunk=8192, budget=16384),
                   Parallelism(sync_tp=8, cp_threshold=4096, sync_overlap=True), sync_ranks=8)
    config = {"model": "deepseek-v3", "num_requests": n, "runtime": {"long_prompt_lane": True},
              "grid": {"lane_wait_slo": [None, 1.0, 2.0]}}
    res = {"profile": "ascend-910c-cm384", "slo_s": slo, "trace": mooncake_trace(n)[1],
           "best": {"async": a.describe(), "sync": s.describe()},
           "async": {"rate_req_s": rate, "ttft_p99_s": 1.0}, "sync": {"rate_req_s": rate},
           "load_sensitivity": [{"rate_req_s": rate / 2, "async": {}, "sync": {}}]}
    data = {"config": config, "routing": {"spec": "balanced"}, "weights": None}
    for m, d in (("async", a), ("sync", s)):
        assert figures._deployment(d.describe(), res, config) == d
    with pytest.raises(ValueError, match="changed since the study ran"):
        figures.rerun_headline(data, res)
    cost, shapes = CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.load("deepseek-v3")
    trace = mooncake_trace(n)[0]
    want = run_point("async", trace, rate, cost, shapes, a.cfg, slo, par=a.par)[0]
    res["async"] = {"rate_req_s": rate, **{k: want[k] for k in ("ttft_p99_s", "slo_attainment")}}
    timelines, rows = figures.rerun_headline(data, res)
    assert set(timelines) == {"async", "sync"} and all(timelines.values())
    assert set(rows[0]["async"]) >= {"ttft_p99_s"} and rows[0]["sync"]["ttft_p99_s"] > 0


def test_a_baseline_only_example_says_so():
    c = {"model": "tiny", "modes": "sync", "trace": "mooncake", "num_requests": 240, "attention_ranks": 2,
         "expert_ranks": 4, "attention_tp": 8, "expert_dies": 4, "sync_tp": 8, "sync_ranks": None,
         "emulate": "ascend-910c-cm384", "emulate_model": "deepseek-v3", "token_scale": 128, "time_scale": 0.35}
    facts = figures.example_facts({"config": c, "slo": {"ttft_s": 3.4}, "runs": []})
    assert "baseline only" in facts.what and "ASAP" not in facts.hardware and "baseline 32" in facts.hardware
