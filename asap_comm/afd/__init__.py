"""asap_comm.afd: attention-FFN disaggregation behind vLLM afd-plugin's connector contract.

``AsapAFDConnector`` has the method names and payloads of afd-plugin's ``AFDConnectorBase`` (lifecycle
``init_afd_connector`` / ``close`` / ``is_initialized``; attention side ``send_attn_output`` then
``recv_ffn_output``; FFN side ``recv_attn_output`` then ``send_ffn_output``; no control plane) over
``asap_comm.moe``'s barrier-free dispatch and combine. The records of its data path are in ``metadata``.
How the plugin would name it, what it computes and what was and was not run: docs/afd.md.
"""
from .connector import CONNECTOR_NAME, AsapAFDConnector, AsapExtraInfo
from .metadata import AFDA2FTransferPayload, AFDTransferContext, AFDTransferMetadata, AsapTransferState

__all__ = ["AsapAFDConnector", "AsapExtraInfo", "CONNECTOR_NAME", "AFDTransferMetadata", "AFDTransferContext",
           "AFDA2FTransferPayload", "AsapTransferState"]
