"""What an expert failover costs in time (docs/failover.md "The simulator's model"): how long a spare expert die
takes to serve a dead expert rank's experts.

``time to replace = detect_s + load_s``, where ``load_s = startup_s + expert_rank_bytes / checkpoint_read``:

* ``detect_s`` (:data:`DETECT_S`, 10 ms): the runtime's front end reads the expert PEs' states at most every 10 ms
  (``serving.failover``'s ``every_s``) and then sends ``TAKEOVER`` and ``ROUTE`` (messages: microseconds).
* ``expert_rank_bytes``: the routed experts one expert rank holds, ``ceil(N / E)`` experts x every MoE layer x
  ``3 * hidden * moe_inter`` weights x the profile's weight bytes (the same figure as ``memory.py``'s "routed
  experts" of an expert die).
* ``checkpoint_read`` (:data:`CHECKPOINT_READ_GBPS`, 5 GB/s per die, unless the profile's ``failover`` block gives
  ``checkpoint_read_gbps``): an assumption, not a measurement: one local NVMe drive's sequential read (PCIe Gen4
  x4: about 7 GB/s on the data sheet, 5 sustained) bounds it, since the host-to-device copy after it (PCIe Gen4/5
  x16, 25 to 50 GB/s) is faster. A checkpoint already in the host's page cache loads at the copy's rate instead.
* ``startup_s`` (:data:`SPARE_STARTUP_S`, 2 s, or the profile's ``failover.spare_startup_s``): building the expert
  modules and opening the checkpoint's shards; also an assumption (the spare's process and buffers exist from the
  group's start, docs/failover.md).
"""
from __future__ import annotations

import math

from .hardware import Profile

__all__ = ["DETECT_S", "CHECKPOINT_READ_GBPS", "SPARE_STARTUP_S", "expert_rank_bytes", "failover_params",
           "spare_load_s"]

GB = 1e9
DETECT_S = 0.01  # the front end's look at the expert PEs' states, at most every 10 ms (serving.failover)
CHECKPOINT_READ_GBPS = 5.0  # GB/s per die: one NVMe drive's sustained sequential read (module docstring)
SPARE_STARTUP_S = 2.0  # s: building the expert modules, opening the checkpoint (module docstring)


def expert_rank_bytes(profile: Profile, shapes, expert_ranks: int) -> float:
    """Bytes of the routed experts one of ``expert_ranks`` expert ranks holds (what a spare reads)."""
    if isinstance(expert_ranks, bool) or not isinstance(expert_ranks, int) or expert_ranks < 1:
        raise ValueError(f"expert_rank_bytes: expert_ranks={expert_ranks!r} must be an int >= 1")
    per_expert_layer = 3 * shapes.hidden * shapes.moe_inter
    return (math.ceil(shapes.num_experts / expert_ranks) * shapes.num_moe_layers * per_expert_layer
            * profile.dtype["weight_bytes"])


def failover_params(profile: Profile) -> dict:
    """``{"checkpoint_read_gbps", "spare_startup_s", "source"}``: the profile's ``failover`` block over the
    defaults."""
    block = profile.data.get("failover") or {}
    if not isinstance(block, dict):
        raise ValueError(f"Profile {profile.path}: field 'failover' must be an object")
    out = {"checkpoint_read_gbps": CHECKPOINT_READ_GBPS, "spare_startup_s": SPARE_STARTUP_S,
           "source": "default (asap_comm.sim.costmodel.failover: assumed, not measured)"}
    for key, positive in (("checkpoint_read_gbps", True), ("spare_startup_s", False)):
        if key in block:
            v = block[key]
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or not (v > 0 if positive else v >= 0)):
                raise ValueError(f"Profile {profile.path}: field 'failover.{key}'={v!r} must be a number "
                                 f"{'> 0' if positive else '>= 0'}")
            out[key] = float(v)
            out["source"] = str(block.get("source", f"profile {profile.name}"))
    return out


def spare_load_s(profile: Profile, shapes, expert_ranks: int) -> float:
    """Seconds a spare takes to load one expert rank's experts (``startup_s + bytes / checkpoint_read``)."""
    p = failover_params(profile)
    return p["spare_startup_s"] + expert_rank_bytes(profile, shapes, expert_ranks) / (p["checkpoint_read_gbps"] * GB)
