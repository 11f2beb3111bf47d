"""The studies built on the simulator, each a ``python -m asap_comm.sim`` command, and their figures.

* :mod:`.grids`: the headline's runtime settings, traces and deployment grids (and the packaged Mooncake trace).
* :mod:`.headline`: ``headline``: best ASAP against best synchronous deployment on the same hardware.
* :mod:`.search_space`: the best-against-best search at one cluster size (``scaling``, ``plan``).
* :mod:`.scaling`: ``scaling``: where ASAP starts to win, at each cluster size.
* :mod:`.plan`: ``plan``: which mode and deployment at one size, trace and SLO.
* :mod:`.skew`: ``skew``: both modes across routing skews.
* :mod:`.barrier`: ``barrier``: the baseline's per-layer barrier against the expected-max model.
* :mod:`.lane_study`: ``lane-study``: the design study of the long-prompt lane.
* :mod:`.figures`: each study's figures from its result JSON (``replot``).
* :mod:`.plots`: the plotting of simulated, emulated and measured runs.
"""
