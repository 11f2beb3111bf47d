"""The records that travel through an afd-plugin-shaped connector's data path, with the field names of vLLM
afd-plugin's ``afd_plugin/connectors/metadata.py`` (``AFDTransferMetadata``, ``AFDTransferContext``,
``AFDA2FTransferPayload``), so that an engine written against that contract reads them unchanged.

The connector reads a context it is given by attribute only (``context.metadata.layer_idx``, ``.stage_idx``,
``.seq_lens``; it sets ``context.states``), so the plugin's own classes work as well as these. These exist so
that the connector runs, and is tested, without vLLM installed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AFDTransferMetadata", "AFDTransferContext", "AFDA2FTransferPayload", "AsapTransferState"]


@dataclass
class AFDTransferMetadata:
    """One attention/FFN exchange: the model layer, the stage (micro-batch, ``ubatch_idx``) and the token
    counts; ``total_tokens`` (their sum) is the leading dimension of the tensors that go with it."""

    layer_idx: int
    stage_idx: int
    seq_lens: list

    def __post_init__(self) -> None:
        if not self.seq_lens or any(int(n) <= 0 for n in self.seq_lens):
            raise ValueError(f"AFDTransferMetadata: seq_lens={self.seq_lens!r} must be a non-empty list of "
                             "positive token counts")

    @property
    def total_tokens(self) -> int:
        return sum(int(n) for n in self.seq_lens)

    @classmethod
    def create_attention_metadata(cls, *, layer_idx: int, stage_idx: int, seq_len: int) -> "AFDTransferMetadata":
        return cls(layer_idx, stage_idx, [seq_len])

    def validate_tensor_shape(self, shape: tuple) -> bool:
        return len(shape) > 0 and shape[0] == self.total_tokens


@dataclass
class AFDTransferContext:
    """What a data-path call carries: the metadata, and the connector's own state for the exchange (``None``
    until the connector sets it)."""

    metadata: AFDTransferMetadata
    states: Any = None


@dataclass
class AFDA2FTransferPayload:
    """What ``recv_attn_output`` returns on the FFN side: the rows and the context to hand back to
    ``send_ffn_output``."""

    hidden_states: torch.Tensor
    context: AFDTransferContext
    router_logits: "torch.Tensor | None" = None


@dataclass(eq=False)
class AsapTransferState:
    """``context.states`` of an exchange through ``AsapAFDConnector``.

    On the FFN side (set by ``recv_attn_output``): ``topk_ids [n, k]`` int32 of the received rows, global
    expert ids with -1 for the choices another FFN rank holds; ``topk_weights [n, k]`` float32; ``source``: the
    attention replica (role rank) the rows came from; ``batch``: the underlying ``asap_comm.moe.ExpertBatch``.
    On the attention side (set by ``send_attn_output``): ``handle``, the in-flight ``DispatchHandle``.
    """

    topk_ids: "torch.Tensor | None" = None
    topk_weights: "torch.Tensor | None" = None
    source: int = -1
    batch: Any = None
    handle: Any = None
    extra: dict = field(default_factory=dict)
