"""The event simulation and both modes.

* :mod:`.engine`: the discrete-event engine: a clock, an event heap, ranks and shared hosts.
* :mod:`.simulate`: :func:`~.simulate.simulate`, one simulated run of ASAP (``"async"``) or the baseline
  (``"sync"``), and :class:`~.common.Parallelism`.
* :mod:`.common`: what both modes share: parallelism, the memoised costs, the front end.
* :mod:`.async_mode`: ASAP simulated: attention ranks with micro-batches, expert batching.
* :mod:`.sync_mode`: the synchronous DP+EP baseline simulated: lock-step steps, all-to-alls.
* :mod:`.lane`: ASAP's long-prompt lane and token-balanced micro-batch pairs.
* :mod:`.sweep`: load sweeps: the TTFT SLO, SLO-compliant throughput, best-of-a-list searches.
"""
