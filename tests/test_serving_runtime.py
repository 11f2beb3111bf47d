"""The asynchronous disaggregated runtime: every request's first token and final hidden
state equal the single-process reference forward; bad requests are rejected; a killed
expert worker fails the requests it held instead of hanging."""
import glob
import os
import signal
import time

import pytest
import torch

from asap_comm.serving.runtime import ModelInfo, PromptRequest, RuntimeConfig, run_async
from models import preset, random_init

CFG = preset("tiny")
INFO = ModelInfo(CFG.num_hidden_layers, tuple(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers)),
                 CFG.hidden_size, CFG.vocab_size, CFG.n_routed_experts, CFG.num_experts_per_tok)


class TinyFactory:
    """Builds each worker's share of the tiny model (weights seeded per tensor name: shares agree)."""

    def __init__(self, kill_expert_pe_after: "int | None" = None) -> None:
        self.kill_after = kill_expert_pe_after

    def __call__(self, role: str, experts: list):
        if role == "attention":
            return random_init(CFG, seed=0, experts=[])
        model = random_init(CFG, seed=0, experts=experts, attention_side=False)
        if self.kill_after is not None and experts and experts[0] == 0:  # the first expert rank dies
            calls, limit, inner = [0], self.kill_after, model.expert

            def expert(layer, e, x, weights=None):
                calls[0] += 1
                if calls[0] > limit:
                    os.kill(os.getpid(), signal.SIGKILL)
                return inner(layer, e, x, weights)

            model.expert = expert
        return model


def _trace(n: int, seed: int, max_len: int = 40, spread_s: float = 0.3) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        out.append(PromptRequest(i, spread_s * i / n, torch.randint(0, CFG.vocab_size, (length,), generator=g)))
    return out


def _check_against_reference(requests, result):
    ref = random_init(CFG, seed=0)
    problems = []
    for r in requests:
        out = ref.prefill(r.token_ids)
        token, hidden = result.outputs[r.request_id]
        if token != int(out.logits[-1].argmax()):
            problems.append(f"request {r.request_id}: first token {token} != {int(out.logits[-1].argmax())}")
        if not torch.allclose(hidden, out.final_hidden[-1], rtol=1e-4, atol=1e-5):
            problems.append(f"request {r.request_id}: hidden differs by {(hidden - out.final_hidden[-1]).abs().max()}")
    return problems


@pytest.mark.parametrize("cfg", [
    # all four optimizations on; prompts up to 40 tokens in 16-token chunks
    RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=64),
    # ablation: round-robin placement (uneven), no splitting, one micro-batch in flight, no expert batching
    RuntimeConfig(num_attention_ranks=3, num_expert_ranks=1, token_budget=24, chunk_len=16, max_prompt_len=64,
                  load_aware=False, ping_pong=False, expert_batching=False),
], ids=["all-on", "all-off"])
def test_async_runtime_matches_reference_and_rejects_bad_requests(cfg):
    requests = _trace(18, seed=1)
    bad = [PromptRequest(100, 0.05, torch.tensor([], dtype=torch.int64)),
           PromptRequest(101, 0.06, torch.tensor([3, CFG.vocab_size])),
           PromptRequest(102, 0.07, torch.zeros(cfg.max_prompt_len + 1, dtype=torch.int64))]
    result = run_async(TinyFactory(), INFO, requests + bad, cfg)
    assert _check_against_reference(requests, result) == []
    errors = {rec.request_id: rec.error for rec in result.records if rec.error}
    assert set(errors) == {100, 101, 102}
    assert "empty prompt" in errors[100] and "out of the vocabulary" in errors[101] and "longer than" in errors[102]
    ok = [rec for rec in result.records if rec.ok]
    assert len(ok) == len(requests) and all(rec.ttft_s > 0 for rec in ok)
    assert result.spans, "no timeline spans recorded"


def test_killed_expert_worker_fails_its_requests_without_hanging():
    before = set(glob.glob("/dev/shm/asap-*"))
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=64,
                        timeout_s=60)
    requests = _trace(30, seed=2, spread_s=1.0)
    t0 = time.monotonic()
    result = run_async(TinyFactory(kill_expert_pe_after=20), INFO, requests, cfg)
    took = time.monotonic() - t0
    failed = [rec for rec in result.records if not rec.ok]
    assert failed, "no request failed although an expert worker died"
    assert all("fail" in rec.error or "abort" in rec.error or "not admitted" in rec.error for rec in failed), \
        {rec.error for rec in failed}
    assert took < 30, f"the run took {took:.1f} s after a worker died"
    assert set(glob.glob("/dev/shm/asap-*")) - before == set()
