"""The asynchronous disaggregated runtime: every request's first token and final hidden
state equal the single-process reference forward; bad requests are rejected; a killed
worker fails the requests it held instead of hanging, in this runtime and in the baseline (run_sync)."""
import glob

import pytest
import torch

from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async
from asap_comm.serving.sync import run_sync

from serving_utils import CFG, INFO, TinyFactory, check_against_reference, make_trace

pytestmark = pytest.mark.slow  # a serving group (A + E + 1 processes) per test


@pytest.mark.parametrize("cfg", [
    # all four optimizations on; prompts up to 40 tokens in 16-token chunks
    RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=64),
    # ablation: round-robin placement (uneven), no splitting, one micro-batch in flight, no expert batching
    RuntimeConfig(num_attention_ranks=3, num_expert_ranks=1, token_budget=24, chunk_len=16, max_prompt_len=64,
                  load_aware=False, ping_pong=False, expert_batching=False, barrier_free=False),
    # ablation of (1) alone: every MoE layer step is a barrier across the attention ranks
    RuntimeConfig(num_attention_ranks=3, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=64,
                  barrier_free=False),
], ids=["all-on", "all-off", "lockstep"])
def test_async_runtime_matches_reference_and_rejects_bad_requests(cfg):
    requests = make_trace(18, seed=1, spread_s=0.3)
    bad = [PromptRequest(100, 0.05, torch.tensor([], dtype=torch.int64)),
           PromptRequest(101, 0.06, torch.tensor([3, CFG.vocab_size])),
           PromptRequest(102, 0.07, torch.zeros(cfg.max_prompt_len + 1, dtype=torch.int64))]
    result = run_async(TinyFactory(), INFO, requests + bad, cfg)
    assert check_against_reference(requests, result) == []
    errors = {rec.request_id: rec.error for rec in result.records if rec.error}
    assert set(errors) == {100, 101, 102}
    assert "empty prompt" in errors[100] and "out of the vocabulary" in errors[101] and "longer than" in errors[102]
    ok = [rec for rec in result.records if rec.ok]
    assert len(ok) == len(requests) and all(rec.ttft_s > 0 for rec in ok)
    assert result.spans, "no timeline spans recorded"
    barriers = [sp for sp in result.spans if sp[2].startswith("barrier")]
    assert bool(barriers) == (not cfg.barrier_free), "barrier spans iff optimization (1) is off"


# the same failure on both runtimes: ASAP (A=2, E=2: the expert rank holding expert 0 dies) and the baseline
# (3 workers: the one holding expert 0 dies)
KILLED_WORKER_RUNS = {
    "async": (run_async, RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=32, chunk_len=16,
                                       max_prompt_len=64, timeout_s=60)),
    "sync": (run_sync, RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1, token_budget=32, chunk_len=16,
                                     max_prompt_len=64, timeout_s=60)),
}


@pytest.mark.parametrize("mode", sorted(KILLED_WORKER_RUNS))
def test_killed_worker_fails_its_requests_without_hanging(mode):
    run, cfg = KILLED_WORKER_RUNS[mode]
    before = set(glob.glob("/dev/shm/asap-*"))
    requests = make_trace(30, seed=2, spread_s=1.0)
    result = run(TinyFactory(kill_after=20), INFO, requests, cfg)
    failed = [rec for rec in result.records if not rec.ok]
    assert failed, "no request failed although a worker died"
    errors = {rec.error for rec in failed}
    assert all("fail" in e or "abort" in e or "not admitted" in e for e in errors), errors
    # no hang: the run ended on the death it saw (a dead PE or a killed rank named), not on launch's 60-s bound
    assert any("died" in e or "SIGKILL" in e for e in errors), errors
    assert not any("did not finish within" in e for e in errors), errors
    assert check_against_reference([r for r in requests if r.request_id in result.outputs], result) == []
    assert set(glob.glob("/dev/shm/asap-*")) - before == set()
