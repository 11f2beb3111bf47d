"""asap_comm: asynchronous one-sided communication for disaggregated MoE prefill.

OpenSHMEM/NVSHMEM-style primitives (symmetric tensors, put/get, completion
signals, mailboxes) over a CPU shared-memory backend::

    import asap_comm
    with asap_comm.init() as comm:          # RANK/WORLD_SIZE/MASTER_* from torchrun
        x = comm.zeros((1024,), torch.float32)
        sig = comm.signals(1)
        comm.put_signal(x, torch.ones(1024), pe=1, sig=sig, idx=0, value=1)

or, on one host, ``asap_comm.launch(fn, world_size)``. See docs/design.md and the
README for the memory-ordering contract of every call.
"""
from ._native import _C  # noqa: F401  (fails with a build hint if the extension is missing)
from .comm import Communicator, init
from .errors import CommError, LaunchError, OutOfSharedMemory, PeerFailure, TimeoutError
from .launch import launch
from .mailbox import Mailbox, Message
from . import ops  # noqa: F401  registers torch.ops.asap_comm.*

__version__ = "0.1.0"

__all__ = ["init", "launch", "Communicator", "Mailbox", "Message", "CommError", "TimeoutError", "PeerFailure",
           "LaunchError", "OutOfSharedMemory", "__version__"]
