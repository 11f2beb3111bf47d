"""asap_comm.sim: a discrete-event simulator of the prefill runtime (see docs/design.md, "asap_comm.sim")."""
