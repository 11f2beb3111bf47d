"""The simulator's answers stay the same: every request's TTFT of the committed regression fixture
(``tests/fixtures/sim_regression.json``, built by ``tests/fixtures/make_sim_regression.py`` from the engine of the
commit it names) within 0.5% relative, and the same requests failed.

The fixture holds its own profiles, model configs, runtime settings and requests, so only the simulator itself
can move it: a change of its speed must not, a deliberate change of what it models regenerates the fixture."""
import dataclasses
import functools
import json
from pathlib import Path

import pytest

from asap_comm.serving.protocol import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.shapes import ModelShapes

FIXTURE = Path(__file__).parent / "fixtures" / "sim_regression.json"
DATA = json.loads(FIXTURE.read_text())
TOL = DATA["tolerance_rel"]


@functools.lru_cache(maxsize=None)
def _cost(profile: str, model: str) -> CostModel:
    return CostModel(Profile(DATA["profiles"][profile], profile),
                     ModelShapes.from_hf_config(DATA["models"][model], name=model))


def test_fixture_covers_the_issue_scope():
    """16 to 384 dies, both modes, both chunk sizes, the lane, CP thresholds, a shared-CPU host."""
    cases = DATA["cases"]
    assert {c["mode"] for c in cases} == {"async", "sync"}
    dies = {c["cfg"]["num_attention_ranks"] * c["par"]["attention_tp"] + c["cfg"]["num_expert_ranks"]
            if c["mode"] == "async" else c["sync_ranks"] * c["par"]["sync_tp"] for c in cases}
    assert min(dies) <= 16 and max(dies) == 384
    assert {2048, 16384} <= {c["cfg"]["chunk_len"] for c in cases}
    assert any(c["lane"].get("opened") for c in cases if c["mode"] == "async")
    assert any(c["par"]["cp_threshold"] for c in cases if c["mode"] == "sync")
    assert FIXTURE.stat().st_size < 2_000_000


@pytest.mark.parametrize("case", DATA["cases"], ids=[c["name"] for c in DATA["cases"]])
def test_every_ttft_matches_the_fixture(case):
    cost = _cost(case["profile"], case["model"])
    trace = [Request(rid, arrival, n) for rid, arrival, n in case["requests"]]
    cfg = RuntimeConfig(**case["cfg"])
    par = Parallelism(**case["par"])
    # the fixture's configuration, every field added since at its default (spare_expert_ranks: the simulator has none)
    assert {k: v for k, v in dataclasses.asdict(cfg).items() if k in case["cfg"]} == case["cfg"]
    assert all(v == getattr(RuntimeConfig(), k) for k, v in dataclasses.asdict(cfg).items() if k not in case["cfg"])
    res = simulate(case["mode"], trace, cost, cost.shapes, cfg, sync_ranks=case["sync_ranks"], par=par,
                   routing=case["routing"], slo_s=case["slo_s"])
    got = [r.ttft_s for r in res.records]
    assert [r.request_id for r in res.records] == [r[0] for r in case["requests"]]
    assert {str(r.request_id): r.error for r in res.records if r.error is not None} == case["errors"]
    bad = [(rid, want, have) for (rid, _a, _n), want, have in zip(case["requests"], case["ttft_s"], got)
           if (want is None) != (have is None) or (want is not None and abs(have - want) > TOL * abs(want) + 1e-12)]
    assert not bad, (f"{case['name']}: {len(bad)} of {len(got)} TTFTs differ by more than {TOL:.1%} from the "
                     f"fixture (generated from {DATA['generated_from']}); first (request, fixture, now): {bad[:5]}")
    assert res.lane == case["lane"]
