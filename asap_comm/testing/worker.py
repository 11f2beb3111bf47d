"""One PE of a multi-host test (started by :func:`asap_comm.testing.netns.run_across_hosts` on a simulated host).

    python -m asap_comm.testing.worker module:function OUT_DIR

Joins the group with ``asap_comm.init()`` from the torchrun-style environment
the harness sets, runs ``function(comm, *args)`` (args pickled in
OUT_DIR/args.pkl), and pickles the result to OUT_DIR/result-<rank>.pkl. On an
exception the traceback goes to stdout and the exit status is 1.
"""
import importlib
import os
import pickle
import sys
import traceback


def main() -> int:
    import faulthandler

    if os.environ.get("ASAP_TEST_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["ASAP_TEST_DUMP_AFTER"]), exit=False)
    target, out = sys.argv[1], sys.argv[2]
    mod, _, name = target.partition(":")
    fn = importlib.import_module(mod)
    for part in name.split("."):
        fn = getattr(fn, part)
    with open(os.path.join(out, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    import torch

    import asap_comm

    torch.set_num_threads(1)
    backend = os.environ.get("ASAP_TEST_BACKEND")
    try:
        comm = asap_comm.init(timeout=float(os.environ.get("ASAP_TEST_COMM_TIMEOUT", "30")),
                              backend=backend or "auto")
    except Exception as e:
        if backend is None:
            raise
        _write(out, int(os.environ["RANK"]), ("init_error", type(e).__name__, str(e)))
        return 0
    try:
        result = fn(comm, *args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # no goodbye: peers see this PE die, as they would in production
    comm.close()
    _write(out, comm.rank, result)
    return 0


def _write(out: str, rank: int, result) -> None:
    tmp = os.path.join(out, f".result-{rank}.pkl")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out, f"result-{rank}.pkl"))


if __name__ == "__main__":
    sys.exit(main())
