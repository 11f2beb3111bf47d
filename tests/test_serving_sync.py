"""The synchronous DP+EP baseline (asap_comm.serving.sync.run_sync): every request's first
token and final hidden state equal the single-process reference forward; bad requests are
rejected; round-robin placement works; a request's chunks never run out of order. (A killed worker: the
parametrized test in test_serving_runtime.py.)"""
import pytest
import torch

from asap_comm.moe import MoEPlan
from asap_comm.serving.runtime import PromptRequest, RuntimeConfig
from asap_comm.serving.sync import rank_of_expert, run_sync

from serving_utils import CFG, INFO, TinyFactory, check_against_reference, make_trace


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    # 3 workers (= A + E), load-aware placement, prompts up to 40 tokens in 16-token chunks
    RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1, token_budget=32, chunk_len=16, max_prompt_len=64,
                  timeout_s=120),
    # round-robin placement (uneven), no splitting, a smaller budget
    RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1, token_budget=24, chunk_len=16, max_prompt_len=64,
                  load_aware=False, timeout_s=120),
    # the collectives over asap_comm shared memory instead of gloo
    RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1, token_budget=32, chunk_len=16, max_prompt_len=64,
                  timeout_s=120, sync_collectives="shm"),
], ids=["load-aware", "round-robin", "shm-collectives"])
def test_sync_runtime_matches_reference_and_rejects_bad_requests(cfg):
    requests = make_trace(20, seed=1, spread_s=0.2)
    bad = [PromptRequest(100, 0.05, torch.tensor([], dtype=torch.int64)),
           PromptRequest(101, 0.06, torch.tensor([3, CFG.vocab_size])),
           PromptRequest(102, 0.07, torch.zeros(cfg.max_prompt_len + 1, dtype=torch.int64))]
    result = run_sync(TinyFactory(), INFO, requests + bad, cfg)
    assert result.mode == "sync"
    assert check_against_reference(requests, result) == []
    errors = {rec.request_id: rec.error for rec in result.records if rec.error}
    assert set(errors) == {100, 101, 102}
    assert all(e.startswith("rejected: ") for e in errors.values())
    assert "empty prompt" in errors[100] and "out of the vocabulary" in errors[101] and "longer than" in errors[102]
    assert [rec.request_id for rec in result.records] == [r.request_id for r in requests + bad]
    ok = [rec for rec in result.records if rec.ok]
    assert len(ok) == len(requests)
    assert all(rec.arrival_s <= rec.start_s <= rec.done_s and rec.ttft_s > 0 for rec in ok)
    assert set(result.outputs) == {r.request_id for r in requests}
    # the timeline: every worker, the all-to-alls, dummy batches joining them; starts from 0
    assert {s[0] for s in result.spans} == {0, 1, 2}
    assert any("dispatch a2a" in s[2] for s in result.spans) and any("combine a2a" in s[2] for s in result.spans)
    assert min(s[3] for s in result.spans) == 0.0 and all(s[4] >= 0 for s in result.spans)


def test_experts_split_like_moe_plan():
    for n, w in ((8, 3), (8, 4), (7, 2), (3, 3), (2, 5)):
        owners = rank_of_expert(n, w)
        assert owners.tolist() == sorted(owners.tolist()) and len(owners) == n
        plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=w, num_experts=n, hidden=8, dtype=torch.float32,
                       max_tokens=4, top_k=1) if n >= w else None
        if plan is not None:
            assert torch.equal(owners, plan.rank_of_expert)
