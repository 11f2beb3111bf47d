"""The harness the tests and ``bench/faults.py`` share (installed with the package, so both import it by name,
without ``sys.path`` edits; like ``torch.testing``, nothing else in ``asap_comm`` imports it).

* :mod:`asap_comm.testing.netns`: simulated hosts (network namespaces joined by veth, a private ``/dev/shm``, a
  hostname each) and a group run across them (:func:`~asap_comm.testing.netns.run_across_hosts`, one PE per
  :mod:`asap_comm.testing.worker` process);
* :mod:`asap_comm.testing.faults`: fault recipes (an outsider at the rendezvous store, a rogue network peer, lossy
  links, CPU hogs, a small ``/dev/shm``) and spawned PEs that report what they saw;
* :mod:`asap_comm.testing.service`: the HTTP service started and stopped on this host or under torchrun across
  simulated hosts, HTTP calls from inside a host, a flooding client, and what a service leaves behind (processes,
  shared-memory segments).

It never imports ``models`` (the layering rule of docs/design.md): a caller that needs the reference model builds
it. :mod:`~asap_comm.testing.service` needs ``httpx`` (the ``test`` or ``serve`` extra).
"""
