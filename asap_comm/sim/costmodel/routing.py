"""Routing distributions: how a router spreads tokens over the routed experts, and what that costs per rank.

A :class:`Routing` is one of

* ``balanced``: every expert equally likely (DeepSeek-V3's auxiliary-loss-free
  balancing, in expectation). The simulator keeps its exact closed forms for
  it (``rows_per_rank_fraction``, ``_pairs``): the same numbers as before.
* ``zipf:S`` (or ``zipf:S:SEED``): the router prefers expert ``e`` with weight
  ``1 / rank(e)**S`` (``rank`` 1 for the most popular); a token's ``k``
  experts are drawn without replacement in proportion to those weights
  (Plackett-Luce, as a softmax router's top-k of noisy scores behaves). The
  popularity ranks are shuffled over the expert ids with ``SEED`` (default 0),
  so the hot experts do not all sit on expert rank 0.
* ``histogram:PATH`` (or ``histogram:NAME`` for ``routing_data/NAME.json``):
  expert-selection counts measured from a served model (``bench/record_routing.py``
  writes them). Each layer's counts are sorted (hottest first) and turned into
  shares, the shares averaged over the layers (the typical per-layer load
  curve: which expert is hot changes from layer to layer, how hot it is much
  less), mapped onto the target model's ``N`` experts by quantile (the
  cumulative curve interpolated) when the recorded model has another count,
  and shuffled over the expert ids with the seed (``histogram:PATH:SEED``).
  The router's weights are then fitted so the sampled selection frequencies
  match those shares.

**Placement** (what the runtime does, ``asap_comm.moe.plan.expert_placement``):
the ``N`` experts sit on the ranks in contiguous near-equal blocks, the first
``N % R`` ranks one larger. :meth:`Routing.rank_load` gives, for ``R`` ranks:
each rank's experts, their expected (token, expert) pairs per token
(``pair_share``; they sum to ``top_k`` over all experts) and the chance that a
token sends a row to the rank (``row_frac``); :class:`RankLoad` turns them into
integer pairs per local expert and rows for a batch of ``T`` tokens. Skewed
distributions are estimated by sampling ``SAMPLES`` tokens' top-k sets with a
fixed seed (deterministic; about 1% error on a rank's share).

How the simulator uses it (``simulate.py``): the baseline's step waits for its
slowest device, so its experts cost what the hottest device's pairs cost and
its all-to-alls carry the busiest device's rows; ASAP's representative expert
rank becomes the hottest expert rank (every micro-batch waits for the combine
of all the ranks it reached, so the hottest one sets its pace; the cooler
ranks finish earlier), its link receives that rank's rows, and an attention
device's link sends the rows of all ranks together.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["Routing", "RankLoad", "parse_routing", "BALANCED", "block_placement", "known_histograms",
           "routed_cost", "routing_of", "routing_arg", "parse_routing_arg", "HISTOGRAM_FORMAT", "SAMPLES"]

HISTOGRAM_FORMAT = "asap-routing-histogram/1"
SAMPLES = 65536  # tokens sampled to estimate a skewed distribution's per-expert and per-rank shares
_DATA_DIR = Path(__file__).resolve().parents[1] / "routing_data"
_KINDS = ("balanced", "zipf", "histogram")


def known_histograms() -> list[str]:
    """Names of the committed histograms (``histogram:NAME``)."""
    return sorted(p.stem for p in _DATA_DIR.glob("*.json"))


def block_placement(num_experts: int, num_ranks: int) -> list[list[int]]:
    """The experts of each rank: contiguous near-equal blocks, the first ``num_experts % num_ranks`` ranks one
    larger (the runtime's ``expert_placement``). More ranks than experts: the extra ranks hold none."""
    for name, v in (("num_experts", num_experts), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"block_placement: {name}={v!r} must be an int >= 1")
    base, extra = divmod(num_experts, num_ranks)
    out, start = [], 0
    for r in range(num_ranks):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _largest_remainder(values: list, total: int) -> list:
    """Non-negative ints close to ``values`` that sum to ``total`` (largest remainders first, ties by index)."""
    floors = [math.floor(v) for v in values]
    left = total - sum(floors)
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - floors[i]), i))
    for i in order[:max(0, left)]:
        floors[i] += 1
    return floors


@dataclass(frozen=True)
class RankLoad:
    """One routing distribution on one placement (see the module docstring). ``experts[r]``: the experts of rank
    ``r``; ``pair_share[r][i]``: expected (token, expert) pairs per token of its ``i``-th expert;
    ``row_frac[r]``: chance that a token sends a row to rank ``r``; ``hot``: the rank with the most pairs."""

    experts: tuple
    pair_share: tuple
    row_frac: tuple
    top_k: int

    @property
    def hot(self) -> int:
        sums = [sum(s) for s in self.pair_share]
        return max(range(len(sums)), key=lambda r: (sums[r], -r))

    @property
    def rows_per_token(self) -> float:
        """Rows a token sends, over all ranks (the ranks its ``k`` experts live on)."""
        return sum(self.row_frac)

    def pairs(self, tokens: int, rank: "int | None" = None) -> list:
        """(token, expert) pairs per local expert of ``rank`` (default: the hot rank) for ``tokens`` tokens,
        summing to the rounded expected total."""
        r = self.hot if rank is None else rank
        share = self.pair_share[r]
        if not share:
            return [0]
        return _largest_remainder([tokens * q for q in share], round(tokens * sum(share)))

    def rows(self, tokens: int, rank: "int | None" = None) -> int:
        """Rows ``tokens`` tokens send to ``rank`` (default: the hot rank); at least 1 if any token is sent."""
        r = self.hot if rank is None else rank
        return max(1, round(tokens * self.row_frac[r])) if tokens and self.row_frac[r] > 0 else 0

    def describe(self) -> dict:
        """Summary numbers: the hot rank, its pairs and rows over the mean rank's, the hottest expert over the
        mean expert."""
        R = len(self.pair_share)
        sums = [sum(s) for s in self.pair_share]
        flat = [q for s in self.pair_share for q in s]
        mean_q = self.top_k / len(flat) if flat else 0.0
        h = self.hot
        return {"ranks": R, "hot_rank": h, "hot_rank_pairs_over_mean": sums[h] / (sum(sums) / R) if sum(sums) else 1.0,
                "hot_rank_rows_over_mean": (self.row_frac[h] / (sum(self.row_frac) / R)) if sum(self.row_frac) else 1.0,
                "hot_expert_over_mean": max(flat) / mean_q if mean_q else 1.0,
                "rows_per_token": self.rows_per_token}


@dataclass(frozen=True)
class Routing:
    """A routing distribution: ``kind`` balanced / zipf / histogram, ``param`` (S, or the histogram's path),
    ``seed`` (where the hot experts land). Build one with :func:`parse_routing`."""

    kind: str = "balanced"
    param: "float | str | None" = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Routing: kind={self.kind!r} must be one of {', '.join(_KINDS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Routing: seed={self.seed!r} must be an int")
        if self.kind == "zipf" and (isinstance(self.param, bool) or not isinstance(self.param, (int, float))
                                    or not math.isfinite(self.param) or self.param < 0):
            raise ValueError(f"Routing: zipf parameter S={self.param!r} must be a finite number >= 0")

    @property
    def balanced(self) -> bool:
        return self.kind == "balanced"

    @property
    def spec(self) -> str:
        if self.balanced:
            return "balanced"
        tail = f":{self.seed}" if self.seed else ""
        return f"{self.kind}:{self.param:g}{tail}" if self.kind == "zipf" else f"histogram:{self.param}{tail}"

    def describe(self, num_experts: "int | None" = None, top_k: "int | None" = None) -> dict:
        d = {"spec": self.spec, "kind": self.kind, "seed": self.seed}
        if self.kind == "zipf":
            d["s"] = float(self.param)
        if self.kind == "histogram":
            d["path"] = str(self.param)
            d["recorded"] = _load_histogram(str(self.param))[2]
        if num_experts and top_k:
            q = self.expert_share(num_experts, top_k)
            d["hot_expert_over_mean"] = max(q) / (top_k / num_experts)
        return d

    def expert_share(self, num_experts: int, top_k: int) -> list:
        """Expected (token, expert) pairs per token of each expert (they sum to ``top_k``)."""
        _check_nk(num_experts, top_k)
        if self.balanced:
            return [top_k / num_experts] * num_experts
        return list(_sampled(self, num_experts, top_k)[0])

    def rank_load(self, num_experts: int, top_k: int, num_ranks: int) -> RankLoad:
        """Per-rank shares on ``num_ranks`` ranks (contiguous blocks, :func:`block_placement`)."""
        _check_nk(num_experts, top_k)
        blocks = block_placement(num_experts, num_ranks)
        if self.balanced:
            share = tuple(tuple(top_k / num_experts for _ in b) for b in blocks)
            # core.common.rows_per_rank_fraction: 1 - C(N - L, k) / C(N, k)
            frac = tuple(1.0 - math.comb(num_experts - len(b), top_k) / math.comb(num_experts, top_k) for b in blocks)
        else:
            q, rank_frac = _sampled(self, num_experts, top_k)
            share = tuple(tuple(q[e] for e in b) for b in blocks)
            frac = rank_frac(num_ranks)
        return RankLoad(tuple(tuple(b) for b in blocks), share, frac, top_k)


BALANCED = Routing()


def _check_nk(num_experts, top_k) -> None:
    for name, v in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Routing: {name}={v!r} must be an int >= 1")
    if top_k > num_experts:
        raise ValueError(f"Routing: top_k={top_k} is more than num_experts={num_experts}")


def parse_routing(spec) -> Routing:
    """``balanced``, ``zipf:S[:SEED]`` or ``histogram:PATH|NAME[:SEED]`` (a :class:`Routing` passes through)."""
    if isinstance(spec, Routing):
        return spec
    if spec is None:
        return BALANCED
    if not isinstance(spec, str):
        raise ValueError(f"--routing {spec!r} must be a string: balanced, zipf:S or histogram:PATH")
    s = spec.strip()
    if s == "balanced":
        return BALANCED
    kind, _, rest = s.partition(":")
    if kind == "zipf":
        parts = rest.split(":")
        try:
            S = float(parts[0])
            seed = int(parts[1]) if len(parts) == 2 else 0
            if len(parts) > 2:
                raise ValueError
        except ValueError:
            raise ValueError(f"--routing {spec!r}: expected zipf:S or zipf:S:SEED with S a number >= 0 and SEED "
                             "an int") from None
        if not (math.isfinite(S) and S >= 0):
            raise ValueError(f"--routing {spec!r}: the Zipf parameter S={S:g} must be a finite number >= 0")
        return Routing("zipf", S, seed)
    if kind == "histogram":
        if not rest:
            raise ValueError(f"--routing {spec!r}: expected histogram:PATH (a JSON of expert-selection counts) "
                             f"or histogram:NAME ({', '.join(known_histograms()) or 'none committed'})")
        path, seed = rest, 0
        head, sep, tail = rest.rpartition(":")
        if sep and tail.isdigit():
            path, seed = head, int(tail)
        _load_histogram(_resolve(path))  # fail here, naming the file, on a missing or bad one
        return Routing("histogram", path, seed)
    raise ValueError(f"--routing {spec!r}: must be balanced, zipf:S[:SEED] or histogram:PATH[:SEED]")


def _resolve(path: str) -> str:
    p = Path(path)
    if not p.exists() and (_DATA_DIR / f"{path}.json").exists():
        p = _DATA_DIR / f"{path}.json"
    return str(p)


@lru_cache(maxsize=16)
def _load_histogram(path: str) -> tuple:
    """(sorted mean per-layer share curve, num_experts, recording description) of a histogram file."""
    p = Path(_resolve(path))
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--routing histogram:{path}: no such file (committed: "
                         f"{', '.join(known_histograms()) or 'none'})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--routing histogram:{path}: cannot read {p}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != HISTOGRAM_FORMAT:
        raise ValueError(f"--routing histogram:{path}: {p} is not a routing histogram "
                         f"(its 'format' must be {HISTOGRAM_FORMAT!r})")
    n, layers = data.get("num_experts"), data.get("layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(layers, dict) or not layers:
        raise ValueError(f"--routing histogram:{path}: {p} needs 'num_experts' (an int >= 1) and 'layers' "
                         "({layer: [count per expert]}, not empty)")
    curves = []
    for layer, counts in layers.items():
        if (not isinstance(counts, list) or len(counts) != n
                or any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 for c in counts)):
            raise ValueError(f"--routing histogram:{path}: layer {layer} must have {n} non-negative counts, "
                             f"got {counts!r}")
        tot = sum(counts)
        if tot > 0:
            curves.append(sorted((c / tot for c in counts), reverse=True))
    if not curves:
        raise ValueError(f"--routing histogram:{path}: every layer's counts are zero")
    mean = tuple(sum(c[i] for c in curves) / len(curves) for i in range(n))
    recorded = {k: data[k] for k in ("model", "recorded_with", "prompts", "seed", "tokens", "top_k", "note")
                if k in data}
    return mean, n, recorded


def _map_curve(curve: tuple, n: int) -> list:
    """A sorted share curve of ``len(curve)`` experts as one of ``n`` experts (cumulative curve, interpolated)."""
    m = len(curve)
    if m == n:
        return list(curve)
    cum = [0.0]
    for c in curve:
        cum.append(cum[-1] + c)

    def at(x: float) -> float:  # the cumulative share of the first x * m experts
        pos = x * m
        i = min(m - 1, int(pos))
        return cum[i] + (pos - i) * curve[i]

    return [at((j + 1) / n) - at(j / n) for j in range(n)]


def _cap(shares: list, top_k: int) -> list:
    """Selection frequencies ``top_k * shares`` capped at 1 (an expert is picked at most once per token), the
    excess spread over the others in proportion."""
    q = [top_k * s for s in shares]
    for _ in range(len(q)):
        over = [i for i, v in enumerate(q) if v > 1.0]
        if not over:
            break
        excess = sum(q[i] - 1.0 for i in over)
        for i in over:
            q[i] = 1.0
        free = [i for i, v in enumerate(q) if v < 1.0]
        room = sum(q[i] for i in free)
        for i in free:
            q[i] += excess * q[i] / room
    return q


def _topk_sets(weights, top_k: int, seed: int):
    """``SAMPLES`` tokens' top-k expert sets drawn without replacement in proportion to ``weights`` (the Gumbel
    top-k trick), ``[SAMPLES, top_k]`` int array."""
    import numpy as np
    rng = np.random.default_rng(seed)
    logw = np.log(np.maximum(np.asarray(weights, dtype=np.float64), 1e-300))
    out = np.empty((SAMPLES, top_k), dtype=np.int32)
    step = 8192
    for i in range(0, SAMPLES, step):
        keys = logw + rng.gumbel(size=(min(step, SAMPLES - i), len(logw)))
        out[i:i + step] = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return out


@lru_cache(maxsize=32)
def _sampled(routing: Routing, num_experts: int, top_k: int) -> tuple:
    """(pairs per token of each expert, ``rank_frac(num_ranks)``) of a skewed distribution, from sampled tokens."""
    import numpy as np
    order = list(range(num_experts))
    random.Random(routing.seed).shuffle(order)  # order[i]: the expert id of popularity rank i + 1
    if routing.kind == "zipf":
        w = [0.0] * num_experts
        for i, e in enumerate(order):
            w[e] = 1.0 / (i + 1) ** float(routing.param)
        sets = _topk_sets(w, top_k, routing.seed)
    else:  # histogram: fit the router's weights so the sampled frequencies match the measured ones
        curve, _n, _rec = _load_histogram(str(routing.param))
        target_sorted = _cap(_map_curve(curve, num_experts), top_k)
        target = np.zeros(num_experts)
        for i, e in enumerate(order):
            target[e] = target_sorted[i]
        w = np.maximum(target, 1e-12)
        for _ in range(6):
            sets = _topk_sets(w, top_k, routing.seed)
            got = np.bincount(sets.ravel(), minlength=num_experts) / SAMPLES
            w = w * np.where(got > 0, target / np.maximum(got, 1e-12), 2.0)
            w = np.maximum(w / w.sum(), 1e-12)
        sets = _topk_sets(w, top_k, routing.seed)
    q = tuple(float(x) for x in np.bincount(sets.ravel(), minlength=num_experts) / SAMPLES)

    @lru_cache(maxsize=16)
    def rank_frac(num_ranks: int) -> tuple:
        owner = np.empty(num_experts, dtype=np.int32)
        for r, b in enumerate(block_placement(num_experts, num_ranks)):
            owner[b] = r
        ranks = owner[sets]  # [SAMPLES, k]: the rank of each choice
        hit = np.zeros((SAMPLES, num_ranks), dtype=bool)
        hit[np.arange(SAMPLES)[:, None], ranks] = True
        return tuple(float(x) for x in hit.mean(axis=0))

    return q, rank_frac


# ----------------------------------------------------------------------------- the cost model carries it
def routed_cost(cost, routing):
    """``cost`` (a ``CostModel``) with a routing distribution attached: every ``simulate`` call on it (and the
    study helpers that pass it along) charges that routing. ``balanced`` returns ``cost`` unchanged."""
    import copy
    r = parse_routing(routing)
    if r.balanced and getattr(cost, "routing", None) is None:
        return cost
    out = copy.copy(cost)
    out.routing = None if r.balanced else r
    return out


def routing_of(cost) -> Routing:
    """The routing a cost model carries (balanced when none)."""
    r = getattr(cost, "routing", None)
    return BALANCED if r is None else r


# ----------------------------------------------------------------------------- command line
def routing_arg(p) -> None:
    """Adds ``--routing`` to an argparse parser (``sim run``, ``sim headline``, ``sim skew``)."""
    p.add_argument("--routing", default="balanced", metavar="balanced|zipf:S|histogram:PATH",
                   help="how the router spreads tokens over the experts (asap_comm/sim/costmodel/routing.py): balanced "
                        "(default), zipf:S[:SEED] (popularity 1/rank^S, hot experts placed by SEED), or "
                        "histogram:PATH|NAME[:SEED] (measured expert-selection counts)")


def parse_routing_arg(p, value: str) -> Routing:
    """``--routing``'s value parsed, or ``p.error`` naming it."""
    try:
        return parse_routing(value)
    except ValueError as e:
        p.error(str(e))


# ----------------------------------------------------------------------------- the emulator's scales
def rank_of_experts(experts, num_experts: int, num_ranks: int) -> "int | None":
    """Which of ``num_ranks`` ranks holds exactly ``experts`` under the runtime's placement (None: no rank does,
    e.g. an attention model with no experts)."""
    want = sorted(int(e) for e in experts)
    if not want:
        return None
    blocks = block_placement(num_experts, num_ranks)
    return blocks.index(want) if want in blocks else None


def emulated_scales(routing, num_experts: int, top_k: int, num_ranks: int, devices_per_rank: int,
                    rank: "int | None") -> tuple:
    """(pairs factor, rows factor) of an emulated rank under ``routing``: its (hottest device's) (token, expert)
    pairs and its dispatched rows over the mean rank's, for the emulated model's ``num_experts`` experts on
    ``num_ranks`` ranks of ``devices_per_rank`` devices each (placed contiguously over all the devices).
    ``rank`` None (a model with no experts, which holds the baseline's all-to-alls): (1, the hottest device's
    rows over the mean), since an all-to-all lasts as long as its busiest device. Balanced: (1, 1)."""
    r = parse_routing(routing)
    if r.balanced:
        return 1.0, 1.0
    devices = num_ranks * devices_per_rank
    dev = r.rank_load(num_experts, top_k, devices)
    mean_pairs = top_k / devices
    mean_rows = dev.rows_per_token / devices
    if rank is None:
        return 1.0, max(dev.row_frac) / mean_rows
    mine = range(rank * devices_per_rank, (rank + 1) * devices_per_rank)
    pairs = max(sum(dev.pair_share[d]) for d in mine) / mean_pairs
    ranks = r.rank_load(num_experts, top_k, num_ranks)
    rows = ranks.row_frac[rank] / (ranks.rows_per_token / num_ranks)
    return pairs, rows
