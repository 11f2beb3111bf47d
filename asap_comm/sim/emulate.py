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
  attention-side stages take the cost model's per-device time of a ``tp``-way
  shard plus the group's all-reduces (``CostModel.attention_s(..., tp=)``,
  ``tp_all_reduce_s``; MLPs at ``1/tp`` of the work and the profile's TP
  efficiency), and a baseline worker's routed experts are spread over its
  ``expert_devices`` devices (EP over every device). Context parallelism is
  not emulated: the runtime splits long prompts into chunks on one rank.
* **Overruns are reported.** An overrun is a held call whose real compute took
  longer than its modelled (dilated) time: the dilation is too small for this
  host. Every wrapped model counts calls, overruns, modelled and real seconds
  in a small memory-mapped file under ``stats_dir`` (it survives the worker's
  ``os._exit``); :func:`read_stats` sums them per process.

The serving runtime never imports this module: it calls ``model_factory(role,
experts)`` and, if the returned object has them, ``hold_collective`` and
``hold_transfer``. Wrap any model factory from the outside::

    from asap_comm.sim.emulate import EmulatedFactory
    emu = EmulatedFactory(factory, "ascend-910c-cm384", "deepseek-v3", time_scale=4.0, token_scale=128,
                          stats_dir="runs/emu-stats")
    run_async(emu, info, requests, cfg)      # or run_sync(emu, ...)
    read_stats("runs/emu-stats")             # overruns per process
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

from .costs import CostModel, Profile
from .shapes import ModelShapes
from .simulate import rows_per_rank_fraction

__all__ = ["EmulatedFactory", "EmulatedModel", "read_stats", "overrun_summary", "collective_summary", "STAT_FIELDS"]

STAT_FIELDS = ("calls", "overruns", "modelled_s", "real_s", "overrun_s", "held_s")
_FMT = "<" + "d" * len(STAT_FIELDS)
_SIZE = struct.calcsize(_FMT)


class _Stats:
    """Counters of one wrapped model in a memory-mapped file (updated in place, readable after any exit)."""

    def __init__(self, path: "Path | None") -> None:
        self.values = [0.0] * len(STAT_FIELDS)
        self._mm = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, _SIZE)
                self._mm = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)

    def add(self, modelled: float, real: float, held: float) -> None:
        v = self.values
        v[0] += 1
        v[2] += modelled
        v[3] += real
        v[5] += held
        if real > modelled:
            v[1] += 1
            v[4] += real - modelled
        if self._mm is not None:
            struct.pack_into(_FMT, self._mm, 0, *v)


class _CollectiveLog:
    """(modelled, real) seconds of every held collective, appended to a file (one write per collective)."""

    def __init__(self, path: "Path | None") -> None:
        self._fd = None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def add(self, modelled: float, real: float) -> None:
        if self._fd is not None:
            os.write(self._fd, struct.pack("<dd", modelled, real))


def collective_summary(stats_dir: "str | Path") -> dict:
    """Is the host's transport slower than the modelled collectives?

    Every baseline worker joins every collective in the same order, so the
    k-th record of each worker is the same collective. Its real duration on
    the worker that arrived last (the shortest) is the transport's own time;
    the collective is *late* when that exceeds its modelled time (the largest
    of the workers', whose rows differ). Returns ``{"collectives", "late",
    "late_fraction", "late_s" (the summed excess), "median_transport_s",
    "median_modelled_s"}``.
    """
    logs = []
    for f in sorted(Path(stats_dir).glob("*.coll")):
        raw = f.read_bytes()
        n = len(raw) // 16
        if n:  # a model that joined no collective (an expert-side model) writes nothing
            logs.append([struct.unpack_from("<dd", raw, 16 * i) for i in range(n)])
    if not logs:
        return {"collectives": 0, "late": 0, "late_fraction": 0.0, "late_s": 0.0, "median_transport_s": None,
                "median_modelled_s": None}
    n = min(len(x) for x in logs)
    late, late_s, transport, modelled = 0, 0.0, [], []
    for i in range(n):
        m = max(log[i][0] for log in logs)
        r = min(log[i][1] for log in logs)
        transport.append(r)
        modelled.append(m)
        if r > m:
            late += 1
            late_s += r - m
    transport.sort()
    modelled.sort()
    return {"collectives": n, "late": late, "late_fraction": late / n if n else 0.0, "late_s": late_s,
            "median_transport_s": transport[n // 2] if n else None,
            "median_modelled_s": modelled[n // 2] if n else None}


def read_stats(stats_dir: "str | Path") -> list[dict]:
    """Every wrapped model's counters under ``stats_dir``, summed per process:
    ``[{"role", "pid", "calls", "overruns", "overrun_fraction", "modelled_s", "real_s", "overrun_s", "held_s"}]``."""
    per_pid: dict = {}
    for f in sorted(Path(stats_dir).glob("*.stat")):
        role, pid, _n = f.stem.rsplit("-", 2)
        raw = f.read_bytes()
        if len(raw) != _SIZE:
            continue
        vals = dict(zip(STAT_FIELDS, struct.unpack(_FMT, raw)))
        entry = per_pid.setdefault(int(pid), {"roles": set(), **{k: 0.0 for k in STAT_FIELDS}})
        entry["roles"].add(role)
        for k in STAT_FIELDS:
            entry[k] += vals[k]
    out = []
    for pid, e in sorted(per_pid.items()):
        calls = int(e["calls"])
        out.append({"role": "+".join(sorted(e["roles"])), "pid": pid, "calls": calls, "overruns": int(e["overruns"]),
                    "overrun_fraction": e["overruns"] / calls if calls else 0.0,
                    **{k: e[k] for k in ("modelled_s", "real_s", "overrun_s", "held_s")}})
    return out


def overrun_summary(stats: list[dict]) -> dict:
    """``{"overrun_fraction": all ranks' overruns / calls, "max_rank_overrun_fraction", "per_rank": stats}``."""
    calls = sum(s["calls"] for s in stats)
    over = sum(s["overruns"] for s in stats)
    return {"overrun_fraction": over / calls if calls else 0.0,
            "max_rank_overrun_fraction": max((s["overrun_fraction"] for s in stats), default=0.0),
            "calls": calls, "overruns": over, "per_rank": stats}


def _real_shapes(inner) -> ModelShapes:
    describe = getattr(inner, "describe", None)
    if describe is None:
        raise ValueError("EmulatedFactory: the wrapped factory has no describe() with an 'hf_config'; pass "
                         "real_shapes=ModelShapes(...) of the model it serves")
    d = describe()
    if not isinstance(d, dict) or "hf_config" not in d:
        raise ValueError("EmulatedFactory: the wrapped factory's describe() has no 'hf_config'; pass real_shapes=")
    return ModelShapes.from_hf_config(d["hf_config"], name="served")


class EmulatedFactory:
    """A model factory whose models hold every stage for a modelled device's time (see the module docstring).

    ``inner``: the real factory (``inner(role, experts)`` -> stage model);
    ``profile``/``emulate_model``: a hardware profile and model shapes
    (names or paths, as ``CostModel.load`` takes them); ``time_scale``: the
    dilation (wall seconds per modelled second); ``token_scale``: emulated
    tokens per real token; ``num_expert_ranks``/``num_ranks``: how the
    emulated model's experts are spread (for the per-rank share and the
    fan-out of dispatched rows; ``num_ranks`` defaults to ``num_expert_ranks``);
    ``stats_dir``: where the overrun counters go (None: not recorded).
    Picklable: the cost model is built in each worker.
    """

    def __init__(self, inner, profile: str, emulate_model: str, *, time_scale: float = 1.0, token_scale: int = 1,
                 num_expert_ranks: int = 1, stats_dir: "str | Path | None" = None,
                 real_shapes: "ModelShapes | None" = None, attention_tp: int = 1, expert_devices: int = 1) -> None:
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
        self.cost()  # fail here, in the caller, on an unknown profile or model
        self._made = 0

    def cost(self) -> CostModel:
        return CostModel(Profile.load(self.profile_name), ModelShapes.load(self.model_name))

    def with_stats_dir(self, stats_dir: "str | Path") -> "EmulatedFactory":
        """The same emulation, recording its counters under ``stats_dir`` (one directory per run)."""
        return EmulatedFactory(self.inner, self.profile_name, self.model_name, time_scale=self.time_scale,
                               token_scale=self.token_scale, num_expert_ranks=self.num_expert_ranks,
                               stats_dir=stats_dir, real_shapes=self.real_shapes, attention_tp=self.attention_tp,
                               expert_devices=self.expert_devices)

    def __call__(self, role: str, experts: list):
        model = self.inner(role, experts)
        path = None
        if self.stats_dir is not None:
            Path(self.stats_dir).mkdir(parents=True, exist_ok=True)
            self._made += 1
            path = Path(self.stats_dir) / f"{role}-{os.getpid()}-{self._made}.stat"
        emu = EmulatedModel(model, self.cost(), self.real_shapes, role, len(experts), self.time_scale,
                            self.token_scale, self.num_expert_ranks, _Stats(path), attention_tp=self.attention_tp,
                            expert_devices=self.expert_devices)
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
                "served_model": self.real_shapes.name}

    def __repr__(self) -> str:
        return (f"EmulatedFactory({self.inner!r}, {self.profile_name!r}, {self.model_name!r}, "
                f"time_scale={self.time_scale:g}, token_scale={self.token_scale:g})")


class EmulatedModel:
    """A stage model whose calls are held for the modelled time (see the module docstring)."""

    def __init__(self, inner, cost: CostModel, real: ModelShapes, role: str, num_local_experts: int,
                 time_scale: float, token_scale: float, num_expert_ranks: int, stats: _Stats, *,
                 attention_tp: int = 1, expert_devices: int = 1) -> None:
        self.inner, self.cost, self.role, self.stats = inner, cost, role, stats
        # A rank may be a group of devices: attention-side work runs tensor-parallel on attention_tp devices
        # (per-device time from the cost model, plus the group's all-reduces); a rank's routed experts are
        # spread over expert_devices devices (EP over every device of a baseline group).
        self.tp, self.expert_devices = attention_tp, expert_devices
        self._tp_eff = cost.tp_eff(attention_tp) if attention_tp > 1 else 1.0
        self.collectives = _CollectiveLog(None)
        self.time_scale, self.S = time_scale, token_scale
        emu = cost.shapes
        # layer weights: how many emulated layers one real dense / MoE layer stands for
        real_dense = sum(1 for m in real.moe_layers if not m)
        emu_dense = sum(1 for m in emu.moe_layers if not m)
        self._moe_weight = emu.num_moe_layers / max(1, real.num_moe_layers)
        self._dense_weight = emu_dense / real_dense if real_dense else 0.0
        self._moe = real.moe_layers
        # experts: this rank's share of the emulated model's experts, and rows per real row
        share = num_local_experts / real.num_experts if real.num_experts else 0.0
        self._emu_local = max(1.0, share * emu.num_experts) if num_local_experts else 0.0
        self._experts_per_real = self._emu_local / num_local_experts if num_local_experts else 0.0
        self._pairs_per_real_row = token_scale * emu.top_k / real.top_k
        # dispatched rows: chance a token reaches one expert rank, emulated over real
        r_real = rows_per_rank_fraction(real.num_experts, real.top_k, max(1, real.num_experts // num_expert_ranks))
        r_emu = rows_per_rank_fraction(emu.num_experts, emu.top_k, max(1, emu.num_experts // num_expert_ranks))
        self._rows_per_real_row = token_scale * r_emu / r_real

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

    def attention_stage(self, layer: int, hidden, cache=None):
        t0 = time.monotonic()
        cached = 0 if cache is None else int(cache.length(layer))
        out = self.inner.attention_stage(layer, hidden, cache)
        chunk = (self._tokens(int(hidden.shape[0])), self._tokens(cached))
        if self.tp > 1:
            s = self.cost.attention_s([chunk], tp=self.tp) + self.cost.tp_all_reduce_s(chunk[0], self.tp)
        else:
            s = self.cost.attention_s([chunk])
        self._hold(t0, self._layer_weight(layer) * s)
        return out

    def route(self, layer: int, mlp_input):
        t0 = time.monotonic()
        out = self.inner.route(layer, mlp_input)
        self._hold(t0, self._layer_weight(layer) * self.cost.router_s(self._tokens(int(mlp_input.shape[0]))))
        return out

    def _tp_mlp(self, single_device_s: float, tokens: int) -> float:
        """An MLP split tensor-parallel over the group: 1/tp of the work at the TP efficiency, plus its all-reduce."""
        if self.tp == 1:
            return single_device_s
        return single_device_s / (self.tp * self._tp_eff) + self.cost.tp_all_reduce_s(tokens, self.tp)

    def _mlp_stage(self, name: str, layer: int, mlp_input, single_device_s):
        """Runs the real MLP stage ``name``, then holds it for ``single_device_s(tokens)`` split over the group."""
        t0 = time.monotonic()
        out = getattr(self.inner, name)(layer, mlp_input)
        n = self._tokens(int(mlp_input.shape[0]))
        self._hold(t0, self._layer_weight(layer) * self._tp_mlp(single_device_s(n), n))
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

    # ------------------------------------------------------------------ communication (serving's optional hooks)
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
        combine transfers (one link: latency plus all bytes), counted from ``started``."""
        emu_rows = self.emulated_rows(rows)
        s = self.cost.dispatch_s(emu_rows) + self.cost.combine_s(emu_rows)
        if layer is not None:
            s *= self._layer_weight(layer)
        self._hold(started, s)

    def __getattr__(self, name: str) -> Any:  # new_cache, final_norm, config, ... of the real model
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
