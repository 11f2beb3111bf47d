"""``python -m asap_comm.sim COMMAND ...``: the simulator's command line (:mod:`asap_comm.sim.cli`)."""
import sys

from .cli import main

sys.exit(main())
