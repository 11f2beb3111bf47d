"""Holding the simulator to reality: this host's profile, and the three validation regimes.

* :mod:`.host`: ``calibrate``: time this host's real operators and transfers, fit the ``local`` profile.
* :mod:`.insitu`: the ``local`` profile's runtime factors, from the operators as the runtime runs them.
* :mod:`.probe`: a quick probe of this host against a fitted profile, before the profile is trusted.
* :mod:`.validate`: ``validate``: the real runtime on this host against the simulator (and the regimes' CLI).
* :mod:`.emulated`: ``validate --regime emulated``: the real runtime on emulated accelerators against the simulator.
* :mod:`.published`: ``validate --regime published``: the simulator against published measurements.
* :mod:`.published_afd`: the published deployments and figures as simulated, and afd-plugin's async cells.
* :mod:`.target`: what the regimes share: the error target and the validation traces.
"""
