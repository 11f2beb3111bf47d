"""``python -m asap_comm.serving.server``: the service's command line (:func:`.cli.main`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
