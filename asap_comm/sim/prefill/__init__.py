"""The prefill job as a library: ASAP against the synchronous DP+EP baseline on real processes of this host
(optionally on emulated accelerators), every output checked against the reference forward.

* :mod:`.deploy`: the job's command line (the runtime's flags from ``serving.runtime_args``, plus the load, the
  SLO, emulation and the baseline's deployment), the ``--emulate`` presets, each mode's ``RuntimeConfig``, the
  emulated devices and their memory.
* :mod:`.job`: the load, the reference outputs, the automatic SLO (``serving.slo.auto_slo`` on measured unloaded
  TTFTs), one load or a sweep, ``summary.json`` / ``ttft.png`` / ``timeline_<mode>.json``.

``examples/prefill.py`` is its command line; the benchmarks that reuse its deployment import it. The model
comes in as a factory (``serving.plugins.load_model_factory``): ``asap_comm`` never imports a model package.
"""
