"""Shared by the serving runtime tests: the tiny model split by role, traces, the reference check."""
import os
import signal

import torch

from asap_comm.serving.runtime import ModelInfo, PromptRequest
from models import preset, random_init

CFG = preset("tiny")
INFO = ModelInfo(CFG.num_hidden_layers, tuple(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers)),
                 CFG.hidden_size, CFG.vocab_size, CFG.n_routed_experts, CFG.num_experts_per_tok,
                 kv_row_width=CFG.kv_lora_rank + CFG.qk_rope_head_dim)


class TinyFactory:
    """Builds each worker's halves of the tiny model (weights seeded per tensor name: shares agree)."""

    def __init__(self, kill_after: "int | None" = None) -> None:
        self.kill_after = kill_after  # the worker holding expert 0 dies after this many expert calls

    def __call__(self, role: str, experts: list):
        if role == "attention":
            return random_init(CFG, seed=0, experts=[])
        model = random_init(CFG, seed=0, experts=experts, attention_side=False)
        if self.kill_after is not None and experts and experts[0] == 0:
            calls, limit, inner = [0], self.kill_after, model.expert

            def expert(layer, e, x, weights=None):
                calls[0] += 1
                if calls[0] > limit:
                    os.kill(os.getpid(), signal.SIGKILL)
                return inner(layer, e, x, weights)

            model.expert = expert
        return model


def make_trace(n: int, seed: int, max_len: int = 40, spread_s: float = 0.2) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        out.append(PromptRequest(i, spread_s * i / n, torch.randint(0, CFG.vocab_size, (length,), generator=g)))
    return out


def check_against_reference(requests, result):
    ref = random_init(CFG, seed=0)
    problems = []
    for r in requests:
        out = ref.prefill(r.token_ids)
        token, hidden = result.outputs[r.request_id]
        if token != int(out.logits[-1].argmax()):
            problems.append(f"request {r.request_id}: first token {token} != {int(out.logits[-1].argmax())}")
        if hidden.dtype != torch.float32 or tuple(hidden.shape) != (CFG.hidden_size,):
            problems.append(f"request {r.request_id}: hidden {hidden.dtype} {tuple(hidden.shape)}")
        elif not torch.allclose(hidden, out.final_hidden[-1], rtol=1e-4, atol=1e-5):
            problems.append(f"request {r.request_id}: hidden differs by {(hidden - out.final_hidden[-1]).abs().max()}")
    return problems
