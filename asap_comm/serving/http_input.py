"""Moved to :mod:`asap_comm.serving.server.request` (the HTTP service's request side); this name stays for
the imports that use it."""
from .server.request import *  # noqa: F401,F403
from .server.request import __all__, _Deadline  # noqa: F401
