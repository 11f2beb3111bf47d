"""Moved to :mod:`asap_comm.serving.server.schemas` (the ``/v1/completions`` request schema, its validation and
the parse process); this name stays for the imports that use it."""
from .server.schemas import *  # noqa: F401,F403
from .server.schemas import __all__  # noqa: F401
