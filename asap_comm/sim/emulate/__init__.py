"""The real runtime on emulated accelerators, and the prefill job built on it.

* :mod:`.emulator`: :class:`~.emulator.EmulatedFactory`: wraps a model factory from outside (``serving`` never
  imports ``sim``) so that every stage computes its real result, then holds its rank for the time the cost model
  gives on a chosen profile and model; :func:`~.emulator.simulate_emulated`, the simulator of such a run.
* :mod:`.stats`: the emulator's counters (held calls that overran, collectives).
* :mod:`.fit`: the emulation's host overhead and served routing, fitted from an unloaded probe.
* :mod:`.deploy`: the prefill job's command line and deployment (the ``--emulate`` presets, each mode's
  ``RuntimeConfig``, the emulated devices and their memory).
* :mod:`.job`: the prefill job: ASAP against the synchronous baseline on real processes of this host (optionally
  emulated), every output checked against the reference forward; ``examples/prefill.py`` is its command line.
"""
