"""asap_comm.sim: a discrete-event simulator of the prefill runtime (see docs/design.md, "asap_comm.sim").

Grouped by concern; imports flow down this list (tests/test_layering.py holds it):

* :mod:`.costmodel`: the modelled system: hardware profiles, operator costs, model shapes, per-die memory,
  expert routing (data: ``profiles/``, ``models/``, ``routing_data/`` beside it).
* :mod:`.core`: the discrete-event engine, both simulated modes (``simulate``), the long-prompt lane, and load
  sweeps (SLO-compliant throughput).
* :mod:`.studies`: the studies built on the core (headline, scaling, plan, skew, barrier, lane) and their figures.
* :mod:`.emulate`: the real runtime on emulated accelerators (held for the cost model's time), and the prefill
  job built on it (``examples/prefill.py``'s library).
* :mod:`.calibrate`: holding the simulator to reality: this host's profile, and the three validation regimes
  (this host, emulated accelerators, published measurements).
* :mod:`.cli`: ``python -m asap_comm.sim COMMAND``.
"""
