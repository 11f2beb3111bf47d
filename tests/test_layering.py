"""The layout rules of docs/design.md, checked on the source tree: no import cycle among `asap_comm`'s modules
(imports inside functions included), `asap_comm` never imports `models`, the simulator grouped by concern (no module
directly under `asap_comm/sim/` but its command line, and its subpackages import one another in one direction), and
the choice between shared memory and the network is made in the transports only. A module's size is left to its
cohesion: no line count is checked."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "asap_comm"
SIM = PKG / "sim"
# asap_comm.sim's subpackages, lowest first: each may import only those before it
SIM_LAYERS = ["costmodel", "core", "studies", "emulate", "calibrate"]


def _modules() -> "dict[str, tuple[Path, bool]]":
    """Dotted module name -> (file, is a package's __init__)."""
    mods = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    mods["asap_comm._C"] = (None, False)  # the extension module: a leaf
    return mods


def _imports(name: str, path: Path, is_pkg: bool, mods) -> "set[str]":
    """Every module `name` imports, at module level or inside functions; `from pkg import sub` counts as an
    import of `pkg.sub` when `sub` is a module. Targets outside the tree are kept as written."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            inner = t
            while inner and inner not in mods and inner.startswith("asap_comm"):
                inner = inner.rpartition(".")[0]
            out.add(inner or t)
    out.discard(name)
    return out


def _cycles(edges: "dict[str, set[str]]") -> "list[list[str]]":
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, found, n = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _graph():
    mods = _modules()
    return {m: _imports(m, p, pkg, mods) if p else set() for m, (p, pkg) in mods.items()}


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_asap_comm():
    edges = _graph()
    assert len(edges) > 30, sorted(edges)  # the walk found the package
    inner = {m: {t for t in ts if t in edges} for m, ts in edges.items()}
    assert _cycles(inner) == []


def test_asap_comm_never_imports_models():
    bad = {m: sorted(t for t in ts if re.match(r"^(asap_)?models(\.|$)", t)) for m, ts in _graph().items()}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_simulator_is_grouped_by_concern():
    """Directly under asap_comm/sim/ only the package, its ``python -m`` entry and the command line; every other
    module sits in a subpackage named for its concern."""
    top = sorted(p.name for p in SIM.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py"], top
    subs = sorted(p.parent.name for p in SIM.glob("*/__init__.py"))
    assert subs == sorted(SIM_LAYERS), subs


def test_the_simulators_subpackages_import_downward_only():
    """asap_comm.sim's subpackages in the order of docs/simulator.md's layout: each imports only those before it
    (a graph of modules without cycles can still tie two subpackages both ways; this rules that out)."""
    order = SIM_LAYERS
    up = []
    for m, ts in _graph().items():
        if m.startswith("asap_comm.sim.") and m.count(".") >= 3:
            src = m.split(".")[2]
            for t in ts:
                if t.startswith("asap_comm.sim.") and t.count(".") >= 3:
                    dst = t.split(".")[2]
                    if order.index(dst) > order.index(src):
                        up.append(f"{m} -> {t}")
    assert up == []


def test_shared_memory_or_network_is_decided_in_the_transports_only():
    """No `_remote` table and no branch on `is_remote` outside asap_comm/transport/ (the public
    `Communicator.is_remote` itself is the one definition allowed)."""
    hits = []
    for p in PKG.rglob("*.py"):
        if "transport" in p.relative_to(PKG).parts:
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b_remote\b|\.is_remote\(", code) and "def is_remote" not in code \
                    and '"is_remote"' not in code:
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []
