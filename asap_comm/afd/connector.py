"""``AsapAFDConnector``: vLLM afd-plugin's connector contract over ``asap_comm.moe`` (docs/afd.md).

The method names, arguments and payloads are those of afd-plugin's ``AFDConnectorBase``
(``afd_plugin/connectors/base.py``) as its asynchronous connector uses them; the data path is
``asap_comm.moe``'s barrier-free dispatch and combine, over shared memory on one host and UCX across hosts.

Ranks: one group of ``A + F`` PEs ordered ``[attention 0..A-1, FFN 0..F-1]`` (an attention replica's PE is
its role rank, an FFN rank's is ``A + role rank``), the routed experts placed over the FFN ranks in contiguous
blocks (``asap_comm.moe.expert_placement``). Each attention replica runs at its own pace: nothing it does waits
for another replica, only for the FFN ranks that hold its tokens' experts. Each stage (``ubatch_idx``) of a
replica has its own slot, so stage 1's tokens are out while stage 0's are computed (ping-pong).

There is no control plane (``control_plane = None``): the token counts, the layer, the stage and the routing
travel with the rows, as in the plugin's asynchronous connector.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..moe import AttentionEnd, ExpertEnd, MoEPlan
from .metadata import AFDA2FTransferPayload, AFDTransferContext, AFDTransferMetadata, AsapTransferState

__all__ = ["AsapAFDConnector", "AsapExtraInfo", "CONNECTOR_NAME"]

CONNECTOR_NAME = "AsapAFDConnector"  # the name afd-plugin's registry and ``--additional-config`` would use
_EXTRA_FIELDS = ("num_ubatches", "timeout_s", "max_tokens")


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` or ``obj[name]`` (a vLLM config object, or plain mappings in tests)."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _positive_int(fn: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{fn}: {name}={v!r} must be an int >= 1")
    return v


@dataclass(frozen=True)
class AsapExtraInfo:
    """``connector_extra_config`` of ``AsapAFDConnector``: ``num_ubatches`` stages each attention replica may
    have in flight (its slots; default 2, ping-pong), ``timeout_s`` the bound of every wait (default 60),
    ``max_tokens`` the most tokens of one stage (default: the scheduler's ``max_num_batched_tokens``)."""

    num_ubatches: int = 2
    timeout_s: float = 60.0
    max_tokens: "int | None" = None

    @classmethod
    def from_mapping(cls, raw: "Mapping[str, Any] | None") -> "AsapExtraInfo":
        fn = "AsapAFDConnector.parse_extra_config"
        raw = {} if raw is None else raw
        if not isinstance(raw, Mapping):
            raise TypeError(f"{fn}: connector_extra_config must be a mapping, got {type(raw).__name__}")
        unknown = sorted(str(k) for k in raw if k not in _EXTRA_FIELDS)
        if unknown:
            raise ValueError(f"{fn}: unknown connector_extra_config field(s) {unknown}; known: {list(_EXTRA_FIELDS)}")
        timeout = raw.get("timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"{fn}: timeout_s={timeout!r} must be a number > 0")
        max_tokens = raw.get("max_tokens")
        return cls(_positive_int(fn, "num_ubatches", raw.get("num_ubatches", 2)), float(timeout),
                   None if max_tokens is None else _positive_int(fn, "max_tokens", max_tokens))

    def to_mapping(self) -> dict:
        return {"num_ubatches": self.num_ubatches, "timeout_s": self.timeout_s, "max_tokens": self.max_tokens}


def _dtype(fn: str, v: Any) -> torch.dtype:
    if v is None:
        return torch.float32
    if isinstance(v, torch.dtype):
        return v
    dt = getattr(torch, str(v), None) if isinstance(v, str) else None
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"{fn}: model_config.dtype={v!r} is not a floating torch dtype")
    return dt


class AsapAFDConnector:
    """afd-plugin's connector contract over ``asap_comm.moe`` (module docstring; docs/afd.md).

    ``AsapAFDConnector(rank, local_rank, vllm_config, afd_config, role_rank)`` as the plugin's factory
    constructs connectors. Read (by attribute or key): ``afd_config.role`` (``"attention"`` or ``"ffn"``),
    ``.num_attention_ranks``, ``.num_ffn_ranks``, ``.host``, ``.port``;
    ``vllm_config.model_config.hf_config.hidden_size``, ``.n_routed_experts`` (or ``.num_experts``),
    ``.num_experts_per_tok``; ``vllm_config.model_config.dtype``;
    ``vllm_config.scheduler_config.max_num_batched_tokens``; ``vllm_config.additional_config["afd"]
    ["connector_extra_config"]`` (:class:`AsapExtraInfo`). ``comm``: join an ``asap_comm`` group the engine
    already has (``A + F`` PEs or more, ordered as above) instead of forming one at ``host:port``.
    """

    control_plane = None  # asynchronous: counts, layer, stage and routing travel with the rows

    @classmethod
    def parse_extra_config(cls, raw: "Mapping[str, Any] | None") -> AsapExtraInfo:
        return AsapExtraInfo.from_mapping(raw)

    def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any, role_rank: int, *,
                 comm=None) -> None:
        fn = "AsapAFDConnector"
        self.rank, self.local_rank, self.role_rank = rank, local_rank, role_rank
        self.vllm_config, self.afd_config = vllm_config, afd_config
        afd_raw = _get(_get(vllm_config, "additional_config"), "afd")
        self.extra_info = self.parse_extra_config(_get(afd_raw, "connector_extra_config"))
        self.role = _get(afd_config, "role")
        if self.role not in ("attention", "ffn"):
            raise ValueError(f"{fn}: afd_config.role={self.role!r} must be 'attention' or 'ffn'")
        self.attn_size = _positive_int(fn, "num_attention_ranks", _get(afd_config, "num_attention_ranks", 1))
        self.ffn_size = _positive_int(fn, "num_ffn_ranks", _get(afd_config, "num_ffn_ranks", 1))
        size = self.attn_size if self.role == "attention" else self.ffn_size
        if isinstance(role_rank, bool) or not isinstance(role_rank, int) or not 0 <= role_rank < size:
            raise ValueError(f"{fn}: role_rank={role_rank!r} is out of range [0, {size}) for role {self.role!r}")
        self.world_rank = role_rank if self.role == "attention" else self.attn_size + role_rank
        model = _get(vllm_config, "model_config")
        hf = _get(model, "hf_config")
        experts = _get(hf, "n_routed_experts", _get(hf, "num_experts"))
        max_tokens = self.extra_info.max_tokens or _get(_get(vllm_config, "scheduler_config"),
                                                        "max_num_batched_tokens")
        for name, v in (("hf_config.hidden_size", _get(hf, "hidden_size")), ("hf_config.n_routed_experts", experts),
                        ("hf_config.num_experts_per_tok", _get(hf, "num_experts_per_tok")),
                        ("scheduler_config.max_num_batched_tokens (or connector_extra_config max_tokens)",
                         max_tokens)):
            _positive_int(fn, name, v)
        self.plan = MoEPlan(num_attention_ranks=self.attn_size, num_expert_ranks=self.ffn_size,
                            num_experts=experts, hidden=_get(hf, "hidden_size"),
                            dtype=_dtype(fn, _get(model, "dtype")), max_tokens=max_tokens,
                            top_k=_get(hf, "num_experts_per_tok"), max_inflight=self.extra_info.num_ubatches)
        self.comm = comm
        self._own_comm = comm is None
        self._end: "AttentionEnd | ExpertEnd | None" = None
        self._pending: dict[int, deque] = {}  # attention side: stage -> contexts sent, not yet received

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_initialized(self) -> bool:
        return self._end is not None

    @property
    def local_experts(self) -> list:
        """Global ids of the routed experts this FFN rank holds (empty on an attention replica)."""
        return self.plan.local_experts(self.world_rank)

    def init_afd_connector(self) -> None:
        """Join the group and allocate the exchange's buffers: collective over every attention replica and FFN
        rank, once (idempotent). Forms the group at ``afd_config.host:port`` unless a ``comm`` was given (across
        hosts every process needs the same ``ASAP_GROUP_SECRET``)."""
        if self._end is not None:
            return
        if self.comm is None:
            import asap_comm

            self.comm = asap_comm.init(self.world_rank, self.plan.world_size,
                                       master_addr=str(_get(self.afd_config, "host", "127.0.0.1")),
                                       master_port=int(_get(self.afd_config, "port")),
                                       timeout=self.extra_info.timeout_s)
        if self.comm.rank != self.world_rank or self.comm.world_size < self.plan.world_size:
            raise ValueError(f"AsapAFDConnector.init_afd_connector: {self.role} role rank {self.role_rank} must be "
                             f"PE {self.world_rank} of a group of at least {self.plan.world_size}; the communicator "
                             f"is PE {self.comm.rank} of {self.comm.world_size}")
        self._end = (AttentionEnd if self.role == "attention" else ExpertEnd)(self.comm, self.plan)

    def close(self) -> None:
        """An attention replica tells every FFN rank it sends no more (an FFN rank's ``recv_attn_output``
        returns None once every replica has closed); then the group is left if this connector formed it.
        Idempotent; stages still in flight are dropped."""
        if self._end is not None and self.role == "attention":
            self._end.finish()
        self._end = None
        self._pending.clear()
        if self._own_comm and self.comm is not None:
            self.comm.close()
            self.comm = None

    def _require(self, fn: str, role: str):
        if self._end is None:
            raise RuntimeError(f"AsapAFDConnector.{fn}: the connector is not initialized (call init_afd_connector)")
        if self.role != role:
            raise RuntimeError(f"AsapAFDConnector.{fn} is a call of the {role} side; this connector is {self.role}")
        return self._end

    # ------------------------------------------------------------------ attention side
    def send_attn_output(self, hidden_states: torch.Tensor, context, **kwargs: Any) -> None:
        """Send one stage's hidden states ``[T, H]`` (``T == context.metadata.total_tokens``) of layer
        ``context.metadata.layer_idx`` with its routing, ``topk_ids`` and ``topk_weights`` ``[T, k]`` (keyword
        arguments, global expert ids), to the FFN ranks holding those experts. Returns at once (never waits);
        ``recv_ffn_output(ref, ubatch_idx=context.metadata.stage_idx)`` returns the result."""
        fn = "AsapAFDConnector.send_attn_output"
        att = self._require("send_attn_output", "attention")
        meta = context.metadata
        topk_ids, topk_weights = kwargs.get("topk_ids"), kwargs.get("topk_weights")
        if topk_ids is None or topk_weights is None:
            raise ValueError(f"{fn}: topk_ids and topk_weights are required keyword arguments (the routing is "
                             "computed on the attention side)")
        if not isinstance(hidden_states, torch.Tensor) or not meta.validate_tensor_shape(tuple(hidden_states.shape)):
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(f"{fn}: hidden_states {shape} does not match the metadata's {meta.total_tokens} tokens")
        stage, S = meta.stage_idx, self.plan.max_inflight
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < S:
            raise ValueError(f"{fn}: stage_idx={stage!r} is out of range [0, num_ubatches={S})")
        layer = meta.layer_idx
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{fn}: layer_idx={layer!r} must be an int >= 0")
        if hidden_states.dtype != self.plan.dtype:
            raise ValueError(f"{fn}: hidden_states dtype {hidden_states.dtype} != the model dtype {self.plan.dtype}")
        # the stage travels in the layer word: layer * S + stage (the FFN side splits it back)
        handle = att.dispatch_send(hidden_states, topk_ids, topk_weights, layer * S + stage)
        context.states = AsapTransferState(handle=handle)
        self._pending.setdefault(stage, deque()).append(context)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """The FFN output of stage ``ubatch_idx``'s oldest ``send_attn_output`` (FIFO per stage): ``[T, H]``, for
        each token the sum of its ``k`` routed experts' outputs times their weights. Waits for that stage only
        (bounded: ``timeout`` keyword, default ``timeout_s``). ``ref_tensor`` gives the dtype and the hidden size
        (checked); it is not written. ``context=`` names the exchange explicitly instead of the FIFO."""
        fn = "AsapAFDConnector.recv_ffn_output"
        att = self._require("recv_ffn_output", "attention")
        queue = self._pending.get(ubatch_idx)
        context = kwargs.get("context")
        if not queue or (context is not None and context not in queue):
            raise RuntimeError(f"{fn}: no send_attn_output of stage {ubatch_idx} is waiting for its FFN output")
        if context is None:
            context = queue[0]
        if ref_tensor.shape[-1] != self.plan.hidden:
            raise ValueError(f"{fn}: ref_tensor {tuple(ref_tensor.shape)} is not [..., hidden={self.plan.hidden}]")
        out = att.combine_recv(context.states.handle, kwargs.get("timeout"))
        queue.remove(context)
        return out if out.dtype == ref_tensor.dtype else out.to(ref_tensor.dtype)

    # ------------------------------------------------------------------ FFN side
    def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any) -> "AFDA2FTransferPayload | None":
        """The next rows any attention replica sent, any layer, any stage (arrival order; bounded wait:
        ``timeout`` keyword, default ``timeout_s``, then ``asap_comm.TimeoutError``). ``hidden_states [n, H]``:
        the tokens with at least one of their experts on this rank; ``context.metadata``: ``layer_idx``,
        ``stage_idx`` (the sender's stage; ``ubatch_idx`` does not filter), ``seq_lens == [n]``;
        ``context.states`` an :class:`AsapTransferState` with the routing. None once every replica has closed."""
        ex = self._require("recv_attn_output", "ffn")
        b = ex.dispatch_recv(kwargs.get("timeout"))
        if b is None:
            return None
        S = self.plan.max_inflight
        meta = AFDTransferMetadata(layer_idx=b.layer // S, stage_idx=b.layer % S, seq_lens=[b.num_rows])
        state = AsapTransferState(topk_ids=b.expert_ids, topk_weights=b.weights, source=b.sources[0], batch=b)
        return AFDA2FTransferPayload(b.tokens, AFDTransferContext(meta, state))

    def ffn_output_buffer(self, context) -> torch.Tensor:
        """Optional: ``[n, H]`` where to compute the FFN output so that ``send_ffn_output`` need not copy it (on
        one host, a view of the replica's own receive area)."""
        ex = self._require("ffn_output_buffer", "ffn")
        return ex.output_buffer(context.states.batch)

    def send_ffn_output(self, ffn_output: torch.Tensor, context, **kwargs: Any) -> None:
        """Return the FFN output of a ``recv_attn_output`` payload: ``[n, H]``, for each received row the sum over
        this rank's experts ``e`` among its ``topk_ids`` of ``topk_weights * expert_e(row)`` (what
        ``asap_comm.moe.apply_experts`` computes from ``context.states.batch``). Never waits."""
        ex = self._require("send_ffn_output", "ffn")
        state = context.states
        if not isinstance(state, AsapTransferState) or state.batch is None:
            raise ValueError("AsapAFDConnector.send_ffn_output: context is not one recv_attn_output returned")
        ex.combine_send(state.batch, ffn_output)
        state.batch = None  # its rows are returned; its views must not be used again
