"""asap_comm.sim: a discrete-event simulator of the prefill runtime (see DESIGN.md, "asap_comm.sim")."""
