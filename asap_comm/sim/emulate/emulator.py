"""Emulated accelerators: the real runtime, with every rank's compute held for a modelled device's time.

On this host five or more processes share two cores, so a rank stalled at a
barrier hands its core to whoever computes: the idle silicon that ASAP removes
does not exist here, and real runs of both modes measure about the same. An
emulated run gives every rank what a deployment has, a dedicated device:

* **Each stage is held for its modelled time.** A stage call (embedding, the
  attention of a chunk, the router, one routed expert's batch, the shared
  experts, a dense MLP, the head) still computes the real model's result, so
  correctness stays checked; then it *sleeps* (never spins: a waiting device
  costs no CPU) until the time the cost model gives for that work has passed.
  The work is what a chosen model's shapes (``emulate_model``, e.g.
  ``deepseek-v3``) would cost on a chosen hardware profile (e.g.
  ``ascend-910c-cm384``), times the dilation ``time_scale``.
* **The served model stands for the emulated one.** The real model (``tiny``,
  ``small``: cheap on a CPU) runs the requests; the emulated model's work is
  derived from what the real one does:

  - tokens: ``token_scale`` emulated tokens per real token (a real 100-token
    prompt is charged as a ``100 * token_scale``-token prompt, its cached
    context likewise), so production prompt lengths cost what they cost
    while the CPU computes short ones;
  - layers: each real dense (MoE) layer stands for
    ``emulated dense (MoE) layers / real dense (MoE) layers`` layers;
  - experts: a real routed-expert call with ``r`` rows stands for
    ``r * token_scale * k_emu / k_real`` (token, expert) pairs spread over the
    emulated experts it represents (this rank's share of the emulated model's
    experts), each costed with the emulated expert's shapes;
  - dispatched rows (ASAP's one-sided transfers, the baseline's all-to-alls):
    real rows times ``token_scale`` times the ratio of the chance that a
    token reaches a given rank in the emulated model and in the real one
    (``rows_per_rank_fraction``).
* **The baseline's collectives are held too** (``hold_collective``): each
  all-to-all and all-reduce of ``run_sync`` lasts at least the profile's
  modelled time, so gloo on this host never makes the baseline *faster* than
  the model says; if gloo is *slower*, the overrun is counted and reported.
* **ASAP's transfers are held** (``hold_transfer``): an expert rank holds the
  modelled dispatch and combine transfer time of each batch after computing it
  and before returning it (one port, latency plus all bytes). A device would
  overlap that DMA with compute, so this is conservative for ASAP.
* **Groups of devices** (``attention_tp``, ``expert_devices``): a rank may stand
  for a tensor-parallel group, as production attention DP groups are: its
  attention takes the cost model's per-device time of a ``tp``-way shard plus
  the layer's reduce-scatter and all-gather (``CostModel.attention_s(...,
  tp=)``, ``tp_all_reduce_s``); after the reduce-scatter each device holds
  ``1/tp`` of the tokens, so the router, shared experts and dense MLP cost
  one device's share of the tokens, with no further collective (as the
  simulator charges them); a baseline worker's routed experts are spread over
  its ``expert_devices`` devices (EP over every device).
* **Context parallelism** (the baseline's, ``RuntimeConfig.cp_threshold``):
  ``run_sync`` shares a long prompt's chunks among several DP groups in one
  step (its scheduling is real, see ``asap_comm.serving.sync``); the owner
  computes each shared chunk (the served model is small and its KV cache
  stays whole), and every group's device holds its share: the owner through
  ``attention_stage(..., cp_groups=g)``, the others through
  ``hold_cp_share``, each with the cost model's KV exchange
  (``CostModel.cp_exchange_s``); ``cp_step`` makes the owner's MLP stages and
  dispatched rows count only its share, the others' dispatches their shares.
* **Routing skew** (``routing=``, ``routing.py``): the served model's router
  picks real experts; an expert rank's emulated pairs and dispatched rows are
  scaled by its share of the emulated distribution over the mean rank's (a
  baseline worker of several devices: its hottest device's pairs), so a hot
  rank holds longer; a model without experts (the baseline's collectives)
  scales its rows by the hottest device's, as an all-to-all lasts as long as
  its busiest device.
* **Overruns are reported.** An overrun is a held call whose real compute took
  longer than its modelled (dilated) time: the dilation is too small for this
  host. Every wrapped model counts calls, overruns, modelled and real seconds
  in a small memory-mapped file under ``stats_dir`` (it survives the worker's
  ``os._exit``); :func:`read_stats` sums them per process.

The serving runtime never imports this module: it calls ``model_factory(role,
experts)`` and the hooks of ``asap_comm.serving.hooks``, which
:class:`EmulatedModel` (``ModelHooks``: ``hold_collective``, ``hold_transfer``,
``cp_step``, ``hold_cp_share``) and :class:`EmulatedFactory` (``FactoryHooks``:
``emulates_context_parallelism``) implement. Wrap any model factory from the outside::

    from asap_comm.sim.emulate.emulator import EmulatedFactory
    emu = EmulatedFactory(factory, "ascend-910c-cm384", "deepseek-v3", time_scale=4.0, token_scale=128,
                          stats_dir="runs/emu-stats")
    run_async(emu, info, requests, cfg)      # or run_sync(emu, ...)
    read_stats("runs/emu-stats")             # overruns per process
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ...serving.hooks import FactoryHooks, ModelHooks
from ..core.common import rows_per_rank_fraction
from ..costmodel.costs import CostModel
from ..costmodel.hardware import Profile
from ..costmodel.routing import emulated_scales, parse_routing, rank_of_experts
from ..costmodel.shapes import ModelShapes
from .stats import _CollectiveLog, _Stats

# the dilation the example and validate --regime emulated use by default (wall seconds per modelled second): at
# afd-plugin's 32 dies (2 attention + 4 expert processes, or 4 baseline workers, on 2 cores) 0.25 overran 5.1-5.6%
# of the held calls, 0.35 3.0-3.8%
DEFAULT_TIME_SCALE = 0.35

__all__ = ["DEFAULT_TIME_SCALE", "EmulatedFactory", "EmulatedModel", "simulate_emulated", "layer_weights",
           "rows_per_real_row"]

def layer_weights(real: ModelShapes, emu: ModelShapes) -> tuple[float, float]:
    """How many emulated layers one real (dense, MoE) layer stands for."""
    real_dense = sum(1 for m in real.moe_layers if not m)
    emu_dense = sum(1 for m in emu.moe_layers if not m)
    return (emu_dense / real_dense if real_dense else 0.0), emu.num_moe_layers / max(1, real.num_moe_layers)


def rows_per_real_row(real: ModelShapes, emu: ModelShapes, token_scale: float, num_expert_ranks: int) -> float:
    """Emulated rows dispatched to one expert rank per real row: the token scale times the ratio of the chance
    that a token reaches a given rank in the emulated model and in the real one."""
    r_real = rows_per_rank_fraction(real.num_experts, real.top_k, max(1, real.num_experts // num_expert_ranks))
    r_emu = rows_per_rank_fraction(emu.num_experts, emu.top_k, max(1, emu.num_experts // num_expert_ranks))
    return token_scale * r_emu / r_real


# simulate_emulated(host_overhead=)'s keys (wall seconds) -> the CostModel.runtime factors they set (model seconds)
HOST_OVERHEAD_KEYS = {"async_job_s": "async_job_overhead_s", "expert_job_s": "async_expert_job_overhead_s",
                      "async_layer_s": "async_layer_overhead_s", "sync_layer_s": "sync_layer_overhead_s"}


def simulate_emulated(factory: "EmulatedFactory", mode: str, trace, cfg, *, spans: bool = False,
                      host_overhead: "dict | None" = None, expert_skew: float = 1.0):
    """The simulator's prediction of an emulated run, in the run's own units.

    ``factory``: the :class:`EmulatedFactory` the run uses (its profile, emulated model, dilation, token scale
    and device groups); ``mode``: ``"async"`` or ``"sync"``; ``trace``: the run's requests
    (``asap_comm.serving.Request``: real prompt tokens, wall-clock arrivals); ``cfg``: the run's
    ``RuntimeConfig`` (real tokens; for ``"sync"`` its ``A + E`` workers are the DP groups, as ``run_sync``
    runs them). The simulator then runs what the emulated run holds: the served model's layer structure, each
    layer standing for its share of the emulated model's layers (``simulate(..., layers=)``); prompts, chunks
    and budgets times the token scale; the expert rank's row budget times the emulated rows per real row; the
    profile's device time, dilated; an expert rank's transfers held after its compute, as the emulator holds them
    (``Parallelism.serial_expert_transfers``). Returns a ``SimResult`` whose records are in wall-clock seconds and real
    tokens, so ``summarize_run`` compares them with the run's. What the simulator does not model here: the
    runtime's own overheads between stages, unless ``host_overhead`` gives them, in wall seconds on this host
    (``fit.fit_host_overhead``; each key optional): ``async_job_s``, busy time of every ASAP attention-rank
    job; ``expert_job_s``, busy time of every ASAP expert-rank batch; ``async_layer_s``, latency added to every
    ASAP micro-batch's expert round trip; ``sync_layer_s``, time added to every MoE layer of the baseline's
    lock-step (``CostModel.runtime``'s ``async_job_overhead_s``, ``async_expert_job_overhead_s``,
    ``async_layer_overhead_s``, ``sync_layer_overhead_s``, divided by the dilation); nor the served model's routing,
    unless ``expert_skew`` gives it: the slowest expert process's (or baseline worker's) expert work over the mean's,
    which every dispatch waits for (the served model's router is not DeepSeek-V3's balanced one; each emulated rank
    holds for the rows it really receives), charged on ASAP's expert batches and the baseline's expert stage
    (``CostModel.runtime``'s ``expert_skew``).
    """
    import dataclasses

    from ...serving.traces import Request
    from ..core.simulate import Parallelism, simulate

    if not isinstance(factory, EmulatedFactory):
        raise TypeError(f"simulate_emulated: factory must be an EmulatedFactory, got {type(factory).__name__}")
    if mode not in ("async", "sync"):
        raise ValueError(f"simulate_emulated: mode must be 'async' or 'sync', got {mode!r}")
    S, K = factory.token_scale, factory.time_scale
    cost = factory.cost()
    if host_overhead:
        unknown = set(host_overhead) - set(HOST_OVERHEAD_KEYS)
        bad = {k: v for k, v in host_overhead.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or not v >= 0}
        if unknown or bad:
            raise ValueError(f"simulate_emulated: host_overhead={host_overhead!r} takes "
                             f"{', '.join(HOST_OVERHEAD_KEYS)}, wall seconds >= 0")
        cost.runtime = {**cost.runtime, **{HOST_OVERHEAD_KEYS[k]: v / K for k, v in host_overhead.items()}}
    if isinstance(expert_skew, bool) or not isinstance(expert_skew, (int, float)) or not 1.0 <= expert_skew < 100:
        raise ValueError(f"simulate_emulated: expert_skew={expert_skew!r} must be a number in [1, 100): the slowest "
                         "expert rank's work over the mean's")
    cost.runtime = {**cost.runtime, "expert_skew": float(expert_skew)}
    real, emu = factory.real_shapes, cost.shapes
    dense_w, moe_w = layer_weights(real, emu)
    layers = [(bool(m), moe_w if m else dense_w) for m in real.moe_layers]
    layers = [(m, w) for m, w in layers if w > 0] or [(False, 1.0)]
    tokens = {r.request_id: r.prompt_len for r in trace}
    reqs = [Request(r.request_id, r.arrival_s / K, int(round(r.prompt_len * S))) for r in trace]
    if mode == "async":  # an expert rank standing for expert_devices dies: the simulator runs the dies
        # the emulated expert rank holds its transfers after computing (hold_transfer): the simulator does too
        par, ranks = Parallelism(attention_tp=factory.attention_tp, serial_expert_transfers=True), None
        cfg = dataclasses.replace(cfg, num_expert_ranks=cfg.num_expert_ranks * factory.expert_devices)
        row_scale = rows_per_real_row(real, emu, S, cfg.num_expert_ranks)
    else:
        if factory.expert_devices != factory.attention_tp:
            raise ValueError(f"simulate_emulated: the simulated baseline spreads EP over every device of its "
                             f"groups (expert_devices == attention_tp); this factory has expert_devices="
                             f"{factory.expert_devices}, attention_tp={factory.attention_tp}")
        ranks = cfg.num_attention_ranks + cfg.num_expert_ranks
        cp = None if cfg.cp_threshold is None else int(round(cfg.cp_threshold * S))
        par = Parallelism(sync_tp=factory.attention_tp, cp_threshold=cp)
        row_scale = rows_per_real_row(real, emu, S, ranks)
    scaled = dataclasses.replace(
        cfg, token_budget=int(round(cfg.token_budget * S)), max_prompt_len=int(round(cfg.max_prompt_len * S)),
        chunk_len=None if cfg.chunk_len is None else int(round(cfg.chunk_len * S)),
        expert_token_budget=max(1, int(round(cfg.expert_token_budget * row_scale))),
        expert_deadline_s=cfg.expert_deadline_s / K,
        lane_wait_s=None if cfg.lane_wait_s is None else cfg.lane_wait_s / K,
        cp_threshold=None if cfg.cp_threshold is None else int(round(cfg.cp_threshold * S)),
        lane_threshold=None if cfg.lane_threshold is None else int(round(cfg.lane_threshold * S)),
        lane_tokens=None if cfg.lane_tokens is None else int(round(cfg.lane_tokens * S)),
        placer_linear_weight=None if cfg.placer_linear_weight is None else cfg.placer_linear_weight * S)
    res = simulate(mode, reqs, cost, emu, scaled, sync_ranks=ranks, spans=spans, par=par, layers=layers,
                   routing=factory.routing)

    def wall(t):
        return None if t is None else t * K

    records = [dataclasses.replace(r, arrival_s=r.arrival_s * K, start_s=wall(r.start_s), done_s=wall(r.done_s),
                                   prompt_len=tokens[r.request_id]) for r in res.records]
    ranks_out = [dict(x, busy_s=x["busy_s"] * K, idle_s=x["idle_s"] * K) for x in res.ranks]
    return dataclasses.replace(res, records=records, ranks=ranks_out, makespan_s=res.makespan_s * K,
                               spans=[(n, lb, st * K, d * K) for n, lb, st, d in res.spans])


def _real_shapes(inner) -> ModelShapes:
    describe = getattr(inner, "describe", None)
    if describe is None:
        raise ValueError("EmulatedFactory: the wrapped factory has no describe() with an 'hf_config'; pass "
                         "real_shapes=ModelShapes(...) of the model it serves")
    d = describe()
    if not isinstance(d, dict) or "hf_config" not in d:
        raise ValueError("EmulatedFactory: the wrapped factory's describe() has no 'hf_config'; pass real_shapes=")
    return ModelShapes.from_hf_config(d["hf_config"], name="served")


class EmulatedFactory(FactoryHooks):
    """A model factory whose models hold every stage for a modelled device's time (see the module docstring).

    ``inner``: the real factory (``inner(role, experts)`` -> stage model);
    ``profile``/``emulate_model``: a hardware profile and model shapes
    (names or paths, as ``CostModel.load`` takes them); ``time_scale``: the
    dilation (wall seconds per modelled second); ``token_scale``: emulated
    tokens per real token; ``num_expert_ranks``/``num_ranks``: how the
    emulated model's experts are spread (for the per-rank share and the
    fan-out of dispatched rows; ``num_ranks`` defaults to ``num_expert_ranks``);
    ``stats_dir``: where the overrun counters go (None: not recorded); ``weights``: ``"bf16"``/``"int8"``
    overrides the profile's weight dtype (``asap_comm.sim.costmodel.memory.with_weights``); ``check_memory``: refuse
    (``ValueError`` naming ``memory``) when the emulated model's routed experts do not fit on the
    ``num_expert_ranks * expert_devices`` devices (off by default: the tests' small deployments are not
    meant to fit; ``examples/prefill.py`` checks its whole deployment and turns it on); ``routing``: the
    emulated model's routing (``routing.py`` spec or ``Routing``; default balanced).
    Picklable: the cost model is built in each worker.
    """

    # run_sync's context parallelism is emulated: its models have cp_step / hold_cp_share / attention_stage(cp_groups=)
    emulates_context_parallelism = True

    def __init__(self, inner, profile: str, emulate_model: str, *, time_scale: float = 1.0, token_scale: int = 1,
                 num_expert_ranks: int = 1, stats_dir: "str | Path | None" = None,
                 real_shapes: "ModelShapes | None" = None, attention_tp: int = 1, expert_devices: int = 1,
                 weights: "str | None" = None, check_memory: bool = False, routing=None) -> None:
        if not callable(inner):
            raise TypeError(f"EmulatedFactory: inner must be a model factory (callable), got {type(inner).__name__}")
        for nm, v in (("time_scale", time_scale), ("token_scale", token_scale)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"EmulatedFactory: {nm}={v!r} must be a number > 0")
        if isinstance(num_expert_ranks, bool) or not isinstance(num_expert_ranks, int) or num_expert_ranks < 1:
            raise ValueError(f"EmulatedFactory: num_expert_ranks={num_expert_ranks!r} must be an int >= 1")
        self.inner, self.profile_name, self.model_name = inner, str(profile), str(emulate_model)
        self.time_scale, self.token_scale = float(time_scale), float(token_scale)
        self.num_expert_ranks = num_expert_ranks
        for nm, v in (("attention_tp", attention_tp), ("expert_devices", expert_devices)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EmulatedFactory: {nm}={v!r} must be an int >= 1")
        self.attention_tp, self.expert_devices = attention_tp, expert_devices
        self.stats_dir = None if stats_dir is None else str(stats_dir)
        self.real_shapes = real_shapes if real_shapes is not None else _real_shapes(inner)
        if num_expert_ranks > self.real_shapes.num_experts:
            raise ValueError(f"EmulatedFactory: num_expert_ranks={num_expert_ranks} is more than the served model's "
                             f"{self.real_shapes.num_experts} experts: some ranks would hold none and the emulated "
                             "experts would not all be charged; serve a model with more experts, or use fewer expert "
                             "ranks (for the baseline: larger --sync-tp groups)")
        self.weights, self.check_memory = weights, bool(check_memory)
        self.routing = parse_routing(routing)  # the emulated model's routing (routing.py; balanced by default)
        cost = self.cost()  # fail here, in the caller, on an unknown profile or model (or --weights)
        if self.check_memory:  # the least a deployment needs: its routed experts fit (asap_comm.sim.costmodel.memory)
            from ..costmodel.memory import check_expert_devices

            check_expert_devices(cost, self.num_expert_ranks * self.expert_devices, "EmulatedFactory")
        self._made = 0

    def cost(self) -> CostModel:
        from ..costmodel.memory import with_weights

        return CostModel(with_weights(Profile.load(self.profile_name), self.weights), ModelShapes.load(self.model_name))

    def placer_linear_weight(self) -> float:
        """The runtime placer's linear weight for this emulation, in served (real) tokens: the emulated model's
        (``CostModel.placer_linear_weight`` on this factory's attention groups) over the token scale (a real token
        stands for ``token_scale`` emulated ones: its pairs scale with the square, its linear work linearly).
        Callers set it as ``RuntimeConfig.placer_linear_weight``."""
        return self.cost().placer_linear_weight(self.attention_tp) / self.token_scale

    def with_stats_dir(self, stats_dir: "str | Path") -> "EmulatedFactory":
        """The same emulation, recording its counters under ``stats_dir`` (one directory per run)."""
        return EmulatedFactory(self.inner, self.profile_name, self.model_name, time_scale=self.time_scale,
                               token_scale=self.token_scale, num_expert_ranks=self.num_expert_ranks,
                               stats_dir=stats_dir, real_shapes=self.real_shapes, attention_tp=self.attention_tp,
                               expert_devices=self.expert_devices, weights=self.weights,
                               check_memory=self.check_memory, routing=self.routing)

    def __call__(self, role: str, experts: list):
        model = self.inner(role, experts)
        path = None
        if self.stats_dir is not None:
            Path(self.stats_dir).mkdir(parents=True, exist_ok=True)
            self._made += 1
            path = Path(self.stats_dir) / f"{role}-{os.getpid()}-{self._made}.stat"
        emu = EmulatedModel(model, self.cost(), self.real_shapes, role, len(experts), self.time_scale,
                            self.token_scale, self.num_expert_ranks, _Stats(path), attention_tp=self.attention_tp,
                            expert_devices=self.expert_devices,
                            routing=None if self.routing.balanced else (self.routing, rank_of_experts(
                                experts, self.real_shapes.num_experts, self.num_expert_ranks)))
        if path is not None:
            emu.collectives = _CollectiveLog(path.with_suffix(".coll"))
        return emu

    def __getattr__(self, name: str) -> Any:  # config(), full(), describe() ... of the real factory
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe_emulation(self) -> dict:
        return {"profile": self.profile_name, "model": self.model_name, "time_scale": self.time_scale,
                "token_scale": self.token_scale, "num_expert_ranks": self.num_expert_ranks,
                "attention_tp": self.attention_tp, "expert_devices": self.expert_devices,
                "served_model": self.real_shapes.name, "weights": self.weights,
                "check_memory": self.check_memory, "routing": self.routing.spec}

    def __repr__(self) -> str:
        return (f"EmulatedFactory({self.inner!r}, {self.profile_name!r}, {self.model_name!r}, "
                f"time_scale={self.time_scale:g}, token_scale={self.token_scale:g})")


class EmulatedModel(ModelHooks):
    """A stage model whose calls are held for the modelled time (see the module docstring)."""

    def __init__(self, inner, cost: CostModel, real: ModelShapes, role: str, num_local_experts: int,
                 time_scale: float, token_scale: float, num_expert_ranks: int, stats: _Stats, *,
                 attention_tp: int = 1, expert_devices: int = 1, routing=None) -> None:
        self.inner, self.cost, self.role, self.stats = inner, cost, role, stats
        from ...moe.plan import expert_placement  # torch: a model is built where it runs (emulate imports no torch)

        self._route_ranks = max(1, int(num_expert_ranks))  # the served experts' ranks, for _count_route
        self._rank_of_expert = expert_placement(max(1, real.num_experts), self._route_ranks)
        # A rank may be a group of devices: attention-side work runs tensor-parallel on attention_tp devices
        # (per-device time from the cost model, plus the group's all-reduces); a rank's routed experts are
        # spread over expert_devices devices (EP over every device of a baseline group).
        self.tp, self.expert_devices = attention_tp, expert_devices
        self.collectives = _CollectiveLog(None)
        self.time_scale, self.S = time_scale, token_scale
        emu = cost.shapes
        # layer weights: how many emulated layers one real dense / MoE layer stands for
        self._dense_weight, self._moe_weight = layer_weights(real, emu)
        self._moe = real.moe_layers
        # experts: the emulated model's experts spread evenly over the num_expert_ranks ranks, as a deployment
        # places them, whatever the served model's split (8 served experts over 6 ranks give some ranks 2 and
        # some 1): this rank stands for N_emu / num_expert_ranks emulated experts, and each real (token, expert)
        # pair / dispatched row it receives for the emulated pairs / rows that its share of the tokens brings
        if num_local_experts:
            self._emu_local = max(1.0, emu.num_experts / num_expert_ranks)
            self._experts_per_real = self._emu_local / num_local_experts
            real_pairs = real.top_k * num_local_experts / real.num_experts  # per token
            emu_pairs = emu.top_k * self._emu_local / emu.num_experts
            self._pairs_per_real_row = token_scale * emu_pairs / real_pairs
            r_real = rows_per_rank_fraction(real.num_experts, real.top_k, num_local_experts)
            r_emu = rows_per_rank_fraction(emu.num_experts, emu.top_k, max(1, round(self._emu_local)))
            self._rows_per_real_row = token_scale * r_emu / r_real
            # an ASAP expert rank standing for expert_devices dies: the rows of one die (its share of the experts)
            r_die = rows_per_rank_fraction(emu.num_experts, emu.top_k, max(1, round(self._emu_local / expert_devices)))
            self._die_rows_per_real_row = token_scale * r_die / r_real
        else:
            self._emu_local = self._experts_per_real = 0.0
            self._pairs_per_real_row = token_scale * emu.top_k / real.top_k
            self._rows_per_real_row = rows_per_real_row(real, emu, token_scale, num_expert_ranks)
        # context parallelism (run_sync, cfg.cp_threshold): this step's token adjustments (see cp_step)
        self._cp_mlp = self._cp_rows = 0
        local = max(1, real.num_experts // num_expert_ranks)
        self._real_rows_per_token = num_expert_ranks * rows_per_rank_fraction(real.num_experts, real.top_k, local)
        if routing is not None:  # (Routing, this rank's index or None): a skewed emulated routing (routing.py)
            f_pairs, f_rows = emulated_scales(routing[0], emu.num_experts, emu.top_k, num_expert_ranks,
                                              expert_devices, routing[1])
            self._pairs_per_real_row *= f_pairs
            self._rows_per_real_row *= f_rows

    # ------------------------------------------------------------------ holding
    def _hold(self, t0: float, modelled_s: float) -> None:
        target = modelled_s * self.time_scale
        real = time.monotonic() - t0
        if real < target:
            time.sleep(target - real)
        self.stats.add(target, real, max(target, real))

    def _layer_weight(self, layer: int) -> float:
        return self._moe_weight if self._moe[layer] else self._dense_weight

    def _tokens(self, n: int) -> int:
        return int(round(n * self.S))

    # ------------------------------------------------------------------ stages
    def embed(self, token_ids):
        t0 = time.monotonic()
        out = self.inner.embed(token_ids)
        self._hold(t0, self.cost.embed_s(self._tokens(int(token_ids.shape[0]))))
        return out

    def attention_stage(self, layer: int, hidden, cache=None, cp_groups: int = 1):
        """The real attention stage, held for its modelled time; ``cp_groups > 1``: the chunk is shared by that
        many groups (run_sync's emulated context parallelism) and this group holds its share."""
        t0 = time.monotonic()
        cached = 0 if cache is None else int(cache.length(layer))
        out = self.inner.attention_stage(layer, hidden, cache)
        n = int(hidden.shape[0])
        self._hold(t0, self._layer_weight(layer) * self._attention_s(n, cached, cp_groups, -(-n // cp_groups)))
        return out

    def _attention_s(self, new: int, cached: int, groups: int, share: int) -> float:
        """Modelled seconds of one (real) layer's attention of ``new`` tokens after ``cached`` (real tokens), or of
        one group's ``share`` tokens of it when ``groups`` share it: attention, TP all-reduce, CP exchange."""
        T, C = self._tokens(new), self._tokens(cached)
        if groups > 1:
            s = self.cost.attention_s([(T, C, groups)], tp=self.tp) + self.cost.cp_exchange_s(T, C, groups, self.tp)
        else:
            s = self.cost.attention_s([(T, C)], tp=self.tp) if self.tp > 1 else self.cost.attention_s([(T, C)])
        return s + self.cost.tp_all_reduce_s(self._tokens(share), self.tp)

    # ------------------------------------------------------------------ context parallelism (run_sync's hooks)
    def cp_step(self, mlp_tokens: int, dispatch_tokens: int) -> None:
        """At the start of each step of a run with context parallelism: this step's MLP stages stand for
        ``mlp_tokens`` more (or, negative, fewer) real tokens than they compute (the owner of a shared chunk
        computes all of it but holds only its share), and its dispatched rows for ``dispatch_tokens`` more
        tokens' rows (its shares of others' chunks, less the owner's excess)."""
        self._cp_mlp, self._cp_rows = int(mlp_tokens), int(dispatch_tokens)

    def hold_cp_share(self, layer: int, length: int, start: int, groups: int, tokens: int) -> None:
        """Hold this group's share (``tokens`` of the ``length``-token chunk at ``start``, shared by ``groups``)
        of another group's chunk for one layer: attention share with its KV exchange and TP all-reduce, then the
        share's MLP stages (router + shared experts, or the dense MLP). Nothing is computed here."""
        t0 = time.monotonic()
        s = self._attention_s(length, start, groups, tokens)
        n = self._per_device(self._tokens(tokens))
        if self._moe[layer]:
            s += self.cost.router_s(n) + self.cost.shared_experts_s(n)
        else:
            s += self.cost.dense_mlp_s(n)
        self._hold(t0, self._layer_weight(layer) * s)

    def route(self, layer: int, mlp_input):
        t0 = time.monotonic()
        out = self.inner.route(layer, mlp_input)
        n = self._tokens(max(0, int(mlp_input.shape[0]) + self._cp_mlp))
        self._hold(t0, self._layer_weight(layer) * self.cost.router_s(self._per_device(n)))
        self._count_route(getattr(out, "topk_ids", None))  # after the hold: host time, not the device's
        return out

    def _count_route(self, topk_ids) -> None:
        """Record how unevenly this router call loads the expert-holding ranks (``num_expert_ranks`` of them, the
        runtime's contiguous placement of the served model's experts): the rows its tokens send to the most loaded
        rank and to the mean rank. The emulated ranks hold for the rows they really get, so a served router that
        is not balanced makes every dispatch wait for its hottest rank (``fit.py`` reads it)."""
        import torch

        if topk_ids is None or not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or not topk_ids.numel():
            return
        R = self._route_ranks
        ranks = self._rank_of_expert[topk_ids.long().clamp(0, self._rank_of_expert.numel() - 1)]
        hit = torch.zeros(topk_ids.shape[0], R, dtype=torch.bool)
        hit.scatter_(1, ranks, True)
        rows = hit.sum(0)
        self.stats.route(float(rows.max()), float(rows.sum()) / R)

    def _per_device(self, tokens: int) -> int:
        """Tokens of one device of the group after the attention's reduce-scatter (all of them when tp=1)."""
        return -(-tokens // self.tp)

    def _mlp_stage(self, name: str, layer: int, mlp_input, single_device_s):
        """Runs the real MLP stage ``name``, then holds it for ``single_device_s`` of one device's tokens: after the
        attention's reduce-scatter each device of the group holds ``1/tp`` of the tokens (sequence-parallel) and
        runs the MLP on them whole, with no further collective (the layer's reduce-scatter and all-gather are
        charged with its attention, ``tp_all_reduce_s``), as the simulator charges it in both modes."""
        t0 = time.monotonic()
        out = getattr(self.inner, name)(layer, mlp_input)
        n = self._tokens(max(0, int(mlp_input.shape[0]) + self._cp_mlp))
        self._hold(t0, self._layer_weight(layer) * single_device_s(self._per_device(n)))
        return out

    def shared_experts(self, layer: int, mlp_input):
        return self._mlp_stage("shared_experts", layer, mlp_input, self.cost.shared_experts_s)

    def dense_mlp(self, layer: int, mlp_input):
        return self._mlp_stage("dense_mlp", layer, mlp_input, self.cost.dense_mlp_s)

    def expert(self, layer: int, expert: int, x, weights=None):
        t0 = time.monotonic()
        out = self.inner.expert(layer, expert, x, weights)
        self._hold(t0, self._layer_weight(layer) * self.expert_work_s(int(x.shape[0])))
        return out

    def expert_work_s(self, rows: int) -> float:
        """Modelled seconds of one real expert call on ``rows`` rows (one emulated layer)."""
        if rows <= 0 or self._experts_per_real <= 0:
            return 0.0
        n = self._experts_per_real
        per = max(1, int(round(rows * self._pairs_per_real_row / n)))
        return n * self.cost.expert_s(per) / self.expert_devices  # the rank's devices compute its experts at once

    def lm_head_logits(self, normed):
        t0 = time.monotonic()
        out = self.inner.lm_head_logits(normed)
        self._hold(t0, self.cost.head_s(int(normed.shape[0])))
        return out

    # ------------------------------------------------------------------ communication (serving.hooks.ModelHooks)
    def emulated_rows(self, rows: int) -> int:
        """Emulated dispatched rows for ``rows`` real rows."""
        return int(round(rows * self._rows_per_real_row))

    def hold_collective(self, kind: str, rows: int, ranks: int, started: float, layer: "int | None" = None) -> None:
        """After a baseline collective that started at ``started`` (``time.monotonic()``): hold until its modelled
        time. ``kind``: ``"dispatch"``/``"combine"`` (all_to_all, the busiest of this rank's sent/received
        ``rows``), ``"counts"`` (the row counts' all_to_all, no payload), ``"counts+dispatch"`` (both in one
        exchange) or ``"all_reduce"``."""
        devices = ranks * self.expert_devices  # EP over every device of the groups
        if kind in ("dispatch", "combine", "counts", "counts+dispatch"):
            if self._cp_rows and kind != "counts":  # context parallelism: this group's share of the rows
                rows = max(0, rows + round(self._cp_rows * self._real_rows_per_token))
            emu_rows = 0 if kind == "counts" else self.emulated_rows(rows)
            # the group's rows leave through its devices' links in parallel
            per_device = -(-emu_rows // self.expert_devices)
            s = self.cost.all_to_all_s(per_device, devices, combine=kind == "combine")
            if kind == "counts+dispatch":  # one exchange carrying the counts with the rows
                s += self.cost.all_to_all_s(0, devices)
        elif kind == "all_reduce":
            s = self.cost.all_reduce_s(devices)
        else:
            raise ValueError(f"hold_collective: kind={kind!r} must be dispatch, combine, counts, counts+dispatch or "
                             "all_reduce")
        if layer is not None and kind != "all_reduce":
            s *= self._layer_weight(layer)
        # Not a stage: its real time includes waiting for the other workers, which is no overrun. The
        # transport's own time is judged across workers (collective_summary).
        target = s * self.time_scale
        real = time.monotonic() - started
        if real < target:
            time.sleep(target - real)
        if kind != "all_reduce":  # the per-step heartbeat also runs while idle: not judged (see the README)
            self.collectives.add(target, real)

    def hold_transfer(self, rows: int, started: float, layer: "int | None" = None) -> None:
        """On an expert rank, after computing a batch of ``rows`` rows: hold for the batch's modelled dispatch and
        combine transfers (one link: latency plus all bytes), counted from ``started``. A rank standing for
        ``expert_devices`` dies: one die's rows (the dies' links work in parallel)."""
        emu_rows = (self.emulated_rows(rows) if self.expert_devices == 1
                    else int(round(rows * self._die_rows_per_real_row)))
        s = self.cost.dispatch_s(emu_rows) + self.cost.combine_s(emu_rows)
        if layer is not None:
            s *= self._layer_weight(layer)
        self._hold(started, s)

    def hold_kv_put(self, tokens: int, started: float, layer: int) -> None:
        """An attention rank's long-prompt lane (serving/lane.py), after putting one layer's KV latents of ``tokens``
        real tokens to one rank: hold for the p2p transfer of their emulated latents (one link)."""
        s, p = self.cost.shapes, self.cost.profile.p2p
        nbytes = self._tokens(tokens) * (s.kv_lora_rank + s.qk_rope) * self.cost.a
        self._hold(started, self._layer_weight(layer) * (p["latency_s"] + nbytes * p["s_per_byte"]))

    def __getattr__(self, name: str) -> Any:  # new_cache, final_norm, config, ... of the real model
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
