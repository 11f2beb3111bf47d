"""The modelled system: what each operation costs on a hardware profile, for a model's shapes.

* :mod:`.hardware`: hardware profiles (``asap_comm/sim/profiles/*.json``), parsed and validated.
* :mod:`.costs`: per-operation cost models (:class:`~.costs.CostModel`) over a profile and a model's shapes.
* :mod:`.shapes`: model shapes (``asap_comm/sim/models/*.json``, Hugging Face ``config.json`` form).
* :mod:`.memory`: per-die memory of a deployment: does the model fit on its dies?
* :mod:`.routing`: expert-routing distributions (balanced, Zipf, recorded histograms in ``routing_data/``).
"""
