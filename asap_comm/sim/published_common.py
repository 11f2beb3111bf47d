"""What ``published.py`` and ``published_afd.py`` share: the published deployments and figures as the simulator
runs them, and the afd-plugin study's settings."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ..serving.protocol import RuntimeConfig
from ..serving.traces import Request, load_trace
from .simulate import Parallelism
from .validate_common import mooncake_path

__all__ = ["Deployment", "Figure", "SLO_S", "SLO_TARGET", "MAX_MODEL_LEN", "BATCHED", "SCREENING",
           "afd_screening_window"]

SLO_S = 50.0  # the afd-plugin study's SLO: TTFT p99 <= 50 s
SLO_TARGET = 0.99
MAX_MODEL_LEN = 70000  # the study's max model length (both systems)
BATCHED = 65536  # the study's max-num-batched-tokens (both systems): a 63.8k prompt runs in one step
# the screening window of the published capacity search (plan section 6.2)
SCREENING = {"requests": 128, "tokens": 1340915, "median": 6702.5, "p95": 32629.15, "max": 63417, "span_s": 33.0,
             "burst_requests": 20, "burst_tokens": 253833}


@dataclass(frozen=True)
class Deployment:
    """A published deployment as the simulator runs it."""

    name: str
    mode: str  # "sync" (the baseline) or "async" (attention-FFN disaggregation / ASAP)
    dies: int
    split: str  # in the publication's words
    stack: str  # "cloudmatrix-infer" (the profile itself) or a key of the profile's "stacks" block
    sync_ranks: int = 1
    sync_tp: int = 1
    attention_ranks: int = 1
    attention_tp: int = 1
    expert_ranks: int = 1
    chunk_len: int = BATCHED
    token_budget: int = BATCHED
    sync_overlap: bool = False
    dtype: str = "W8A8 (INT8 weights and activations in the GEMMs)"
    model: str = "DeepSeek-V3.2, 61 layers (simulated with deepseek-v3 shapes)"
    note: str = ""
    shapes: "str | None" = None  # a file of models/published (its stem); None: the regime's --model
    max_model_len: int = MAX_MODEL_LEN

    def cfg(self, token_budget: "int | None" = None) -> RuntimeConfig:
        return RuntimeConfig(num_attention_ranks=self.attention_ranks, num_expert_ranks=self.expert_ranks,
                             token_budget=token_budget or self.token_budget, chunk_len=self.chunk_len,
                             max_prompt_len=max(self.max_model_len, self.chunk_len), expert_token_budget=65536)

    def par(self) -> Parallelism:
        return Parallelism(attention_tp=self.attention_tp, sync_tp=self.sync_tp, sync_overlap=self.sync_overlap)

    def describe(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Figure:
    """One published number and how it is simulated."""

    key: str
    label: str
    kind: str  # solo_ttft | fixed_batch | loaded_ttft | capacity | capacity_ratio | throughput_per_npu
    value: float
    unit: str
    deployment: str  # a key of DEPLOYMENTS ("afd-*" for the ratio: both)
    source: str
    params: dict = field(default_factory=dict)
    fitted: bool = False  # used to set a calibrated value (else held out)
    quick: bool = False  # in the cheap subset (--configs quick)


def afd_screening_window(n: int = 128) -> list:
    """The contiguous ``n``-request window of the shared Mooncake trace (prompts clipped at the study's longest,
    63,778 tokens) nearest the published screening window (plan section 6.2 and report section 1.3: 1,340,915
    tokens over 128 requests, median 6,702.5, a 33.0-s base span, and one same-timestamp burst of 20 requests
    and 253,833 tokens; totals scaled to ``n``): the sum of the relative distances of those five statistics is
    smallest. Arrivals as in the file (bursts kept), from 0. The published workload takes its arrival shape and
    target lengths from this trace, and the 128-request window found (from request 5,803: 1,376,027 tokens,
    median 6,712.5, span 33.0 s, a burst of 20 requests and 252,026 tokens) is very likely the same region."""
    path = mooncake_path()
    if path is None:
        raise FileNotFoundError("validate --regime published: the Mooncake trace is not in $ASAP_TRACES_DIR; "
                                "unset it")
    trace = load_trace(path, max_prompt_len=None)
    if len(trace) <= n:
        raise ValueError(f"afd_screening_window: n={n} must be below the trace's {len(trace)} requests")
    lens = [min(r.prompt_len, 63778) for r in trace]
    scale = n / SCREENING["requests"]
    best, best_i = None, 0
    for i in range(len(trace) - n):
        w = lens[i:i + n]
        bursts: dict = {}
        for j in range(i, i + n):
            b = bursts.setdefault(trace[j].arrival_s, [0, 0])
            b[0] += 1
            b[1] += lens[j]
        count, tokens = max(bursts.values(), key=lambda b: b[1])
        span = trace[i + n - 1].arrival_s - trace[i].arrival_s
        score = (abs(sum(w) / (SCREENING["tokens"] * scale) - 1) + abs(statistics.median(w) / SCREENING["median"] - 1)
                 + abs(tokens / min(SCREENING["burst_tokens"], SCREENING["tokens"] * scale) - 1)
                 + abs(count / min(SCREENING["burst_requests"], n) - 1) + abs(span / (SCREENING["span_s"] * scale) - 1))
        if best is None or score < best:
            best, best_i = score, i
    t0 = trace[best_i].arrival_s
    return [Request(j, trace[best_i + j].arrival_s - t0, lens[best_i + j]) for j in range(n)]
