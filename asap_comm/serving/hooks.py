"""The hooks a served model may offer the runtime beyond its stage methods: an explicit interface.

A real model (``models.DeepseekV3``'s stage methods, built by a plug-in's
factory) needs none of them. An emulated device (``asap_comm.sim.emulate.emulator``)
holds the runtime's communication for its modelled time and emulates the
baseline's context parallelism; its model and factory subclass these classes,
and the runtime calls the hooks through :func:`model_hooks` /
:func:`emulates_context_parallelism`, whatever the model:

* :class:`ModelHooks` (a model): ``hold_transfer`` (an async expert rank,
  after computing a batch), ``hold_collective`` (a baseline worker, after each
  collective) and ``hold_kv_put`` (an async attention rank, after a
  long-prompt lane's KV put) hold for the modelled time and do nothing by
  default;
  ``cp_step`` and ``hold_cp_share`` (with ``attention_stage(...,
  cp_groups=)``) are the baseline's emulated context parallelism, called only
  on a factory that :func:`emulates_context_parallelism`.
* :class:`FactoryHooks` (a model factory): ``emulates_context_parallelism``,
  False by default; ``run_sync`` refuses ``cp_threshold`` without it.
"""
from __future__ import annotations

__all__ = ["ModelHooks", "FactoryHooks", "model_hooks", "emulates_context_parallelism"]


class ModelHooks:
    """Optional hooks of a stage model; the defaults are a real device's (hold nothing)."""

    def hold_transfer(self, rows: int, started: float, layer: "int | None" = None) -> None:
        """Async expert rank, after computing a batch of ``rows`` rows at ``started`` (``time.monotonic()``):
        hold for the batch's dispatch and combine transfers."""

    def hold_kv_put(self, tokens: int, started: float, layer: int) -> None:
        """Async attention rank (the long-prompt lane, ``lane.py``), after putting one layer's KV latents of
        ``tokens`` tokens to one other rank at ``started``: hold for the put's modelled transfer."""

    def hold_collective(self, kind: str, rows: int, ranks: int, started: float, layer: "int | None" = None) -> None:
        """Baseline worker, after a collective of ``ranks`` workers that started at ``started``: ``kind`` is
        ``"counts"``, ``"dispatch"``, ``"counts+dispatch"``, ``"combine"`` or ``"all_reduce"``; ``rows`` the
        busiest of this worker's sent / received rows."""

    def cp_step(self, mlp_tokens: int, dispatch_tokens: int) -> None:
        """Baseline step with context parallelism: the tokens this worker's MLP stages and dispatched rows gain
        (negative: lose) against what it computes for real."""
        raise NotImplementedError(f"{type(self).__name__}: cp_step needs a model that emulates context parallelism")

    def hold_cp_share(self, layer: int, length: int, start: int, groups: int, tokens: int) -> None:
        """Baseline step with context parallelism: hold this worker's share (``tokens``) of another worker's shared
        chunk (``length`` tokens from ``start``, over ``groups`` workers) at ``layer``."""
        raise NotImplementedError(f"{type(self).__name__}: hold_cp_share needs a model that emulates context "
                                  "parallelism")


class FactoryHooks:
    """Optional properties of a model factory; the defaults are a real model's."""

    emulates_context_parallelism: bool = False


_NO_HOOKS = ModelHooks()


def model_hooks(model) -> ModelHooks:
    """``model`` itself if it implements :class:`ModelHooks`, else the defaults."""
    return model if isinstance(model, ModelHooks) else _NO_HOOKS


def emulates_context_parallelism(factory) -> bool:
    """Whether ``factory``'s models emulate the baseline's context parallelism (see :class:`FactoryHooks`)."""
    return isinstance(factory, FactoryHooks) and bool(factory.emulates_context_parallelism)
