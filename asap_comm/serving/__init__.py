"""asap_comm.serving: the disaggregated prefill runtime's load and measurement side.

``run_async`` (the asynchronous disaggregated runtime, ``runtime.py``) and
``run_sync`` (the synchronous DP+EP baseline, ``sync.py``) share one front
end, one worker side and one group entry point; they differ in their workers
and their MoE exchange. The modules, bottom up:

* ``protocol``: the shared types and the chunk, result, cancel and stop
  messages (also used by the simulator); ``policies``: the scheduling
  decisions the runtime and the simulator share (placement, long-prompt
  chunking, micro-batching, expert-side batching); ``patience``: waits that
  outlast a slow peer, and ``DeathWatch``; ``hooks``: what an emulated device
  adds to a model (``ModelHooks``, ``FactoryHooks``);
* ``exchange``: the MoE exchange interface (``send`` -> handle, ``ready``,
  ``receive``) with ``AsyncExchange`` (``asap_comm.moe``) and
  ``CollectiveExchange`` (the baseline's all-to-alls, gloo or shared memory);
* ``worker``: the worker side of the chunk protocol and the per-layer loop;
  ``async_ranks``: ASAP's attention and expert ranks; ``sync_worker``: the
  baseline's worker; ``frontend``: admission, placement and the trace replay;
* ``model_api``: the model contract (``ModelFactory``, ``AttentionStage``,
  ``ExpertStage``) as ``typing.Protocol``s;
* ``group``: ``GroupSpec``, the group's allocation order
  (``open_channels``) and ``group_main(comm, spec)`` for every PE of either
  mode; ``runtime`` / ``sync``: ``run_async`` / ``run_sync`` on this host.

``traces``: requests (synthetic Poisson/Gamma arrivals and length
distributions; the Mooncake JSONL and Azure CSV public traces). ``metrics``:
per-request records, run summaries (TTFT percentiles, throughput, SLO
attainment), SLO-compliant throughput of a sweep, Chrome trace timelines.
The HTTP service is ``server`` (with ``client`` for load).

Layering: this package never imports ``models``; ``asap_comm`` itself does not
import this package (``import asap_comm.serving`` explicitly).
"""
from .metrics import (MIN_SERVED, ChromeTrace, RequestRecord, RunSummary, percentile, served_at_load,
                      served_fraction, slo_compliant_throughput, summarize_run, sustains_slo, throughput_ratio,
                      withheld_reason)
from .protocol import ModelInfo, PromptRequest, RunResult, RuntimeConfig
from .model_api import AttentionStage, DescribedModelFactory, ExpertStage, LaneStage, ModelFactory
from .runtime import run_async
from .sync import run_sync
from .policies import Chunk, ExpertBatcher, MicroBatcher, Placer, attention_cost, split_prompt
from .traces import (EmpiricalLengths, FixedLengths, LengthDistribution, LogNormalLengths, Request, TraceError,
                     TraceSummary, UniformLengths, gamma_arrivals, load_azure, load_mooncake, load_trace,
                     poisson_arrivals, scale_trace, summarize_trace, synthetic_trace)

__all__ = [
    "run_async", "run_sync", "RuntimeConfig", "ModelInfo", "PromptRequest", "RunResult",
    "ModelFactory", "DescribedModelFactory", "AttentionStage", "LaneStage", "ExpertStage",
    "Request", "TraceError", "poisson_arrivals", "gamma_arrivals", "LengthDistribution", "FixedLengths",
    "UniformLengths", "LogNormalLengths", "EmpiricalLengths", "synthetic_trace", "load_mooncake", "load_azure",
    "load_trace", "scale_trace", "TraceSummary", "summarize_trace",
    "attention_cost", "Chunk", "split_prompt", "Placer", "MicroBatcher", "ExpertBatcher",
    "percentile", "RequestRecord", "RunSummary", "summarize_run", "slo_compliant_throughput", "served_at_load",
    "MIN_SERVED", "served_fraction", "sustains_slo", "withheld_reason", "throughput_ratio", "ChromeTrace",
]
