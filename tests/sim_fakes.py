"""One fake cost model for the simulator tests: round numbers, so expected times can be written down by hand.

``ToyCost`` answers every question ``asap_comm.sim.core.simulate`` asks a cost model (``CostModel``'s methods),
tensor- and context-parallel aware, with the link latency ``LINK``. ``SHAPES`` and ``CFG`` are the small model
and runtime configuration the hand-computed cases use. ``sim_cli`` runs ``python -m asap_comm.sim ARGV`` in this
process.
"""
from types import SimpleNamespace

from asap_comm.serving.runtime import RuntimeConfig

LINK = 20e-6  # s: the latency of every dispatch, combine and all-to-all step


class ToyCost:
    """Round numbers, TP- and CP-aware. ``combine_row_s``: seconds per combined row (the combine's rows can cost
    more than the dispatch's, 1e-9 s a row, so a test can tell the two apart). ``calls`` records every
    ``all_to_all_s`` call as ``(rows, ranks, combine)``."""
    name, cores = "toy", None

    def __init__(self, combine_row_s: float = 1e-9):
        self.combine_row_s = combine_row_s
        self.calls = []

    def attention_s(self, chunks, tp=1):
        t = 0.0
        for c in chunks:  # (T, C) or (T, C, cp groups)
            T, C, g = (c[0], c[1], c[2] if len(c) > 2 else 1)
            t += (1e-6 * T + 1e-9 * (T * C + T * (T + 1) / 2)) / g
        return t / tp

    def tp_all_reduce_s(self, tokens, tp): return 0.0 if tp == 1 else 3e-6 * tp + 1e-9 * tokens
    def cp_exchange_s(self, T, C, g, tp=1): return 0.0 if g == 1 else 7e-6
    def router_s(self, t): return 1e-7 * t
    def shared_experts_s(self, t): return 5e-7 * t
    def dense_mlp_s(self, t): return 1e-6 * t
    def embed_s(self, t): return 1e-8 * t
    def head_s(self, n): return 1e-5 * n
    def expert_s(self, rows): return 0.0 if rows == 0 else 1e-5 + 2e-6 * rows
    def experts_s(self, rows): return 5e-6 + sum(self.expert_s(r) for r in rows)
    def dispatch_s(self, rows): return LINK + 1e-9 * rows
    def combine_s(self, rows): return LINK + self.combine_row_s * rows

    def all_to_all_s(self, rows, ranks, combine=False):
        self.calls.append((rows, ranks, combine))
        return 2 * LINK * ranks + (self.combine_row_s if combine else 1e-9) * rows

    def all_reduce_s(self, ranks): return LINK * ranks
    def message_s(self, nbytes): return 5e-6


# 4 experts, top-2, hidden 8, 4 heads; layer 0 dense, layers 1 and 2 MoE
SHAPES = SimpleNamespace(num_experts=4, top_k=2, hidden=8, heads=4, moe_layers=(False, True, True))
CFG = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=64, chunk_len=64, max_prompt_len=64,
                    expert_batching=False)


def sim_cli(argv, capsys) -> tuple:
    """Run ``python -m asap_comm.sim ARGV`` in this process: (exit code, stdout, stderr)."""
    from asap_comm.sim.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err
