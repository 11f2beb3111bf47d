"""The API tables match the code: every call that the "API (the names are the contract)" tables write with
its arguments (``asap_comm.init(...)``, ``comm.put(...)``, ``box.send(...)``), in the README (one line per call)
and in docs/api.md (the full table), has exactly the live signature (parameter names, order, kinds, and the
defaults as written), and every schema of docs/api.md's torch-ops table is the registered one. Adding, removing
or renaming a parameter without updating the docs fails here."""
import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import asap_comm

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
API_DOC = REPO / "docs" / "api.md"
OWNERS = {"asap_comm": asap_comm, "comm": asap_comm.Communicator, "box": asap_comm.Mailbox}
CALL = re.compile(r"`((asap_comm|comm|box)\.(\w+)\(([^`]*)\))`")


def _section(title: str, page: Path = API_DOC) -> list:
    """The table rows (lines starting with ``|``) of ``page`` under the heading ``title``, up to the next heading."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and title in line)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
    return rows


def _documented_calls(page: Path) -> list:
    """``(written, owner, name, args)`` for each call in the first column of ``page``'s API table."""
    calls = []
    for row in _section("API (the names are the contract)", page):
        first_cell = row.split(" | ")[0]
        calls += [(m[1], m[2], m[3], m[4]) for m in CALL.finditer(first_cell)]
    return calls


README_CALLS = _documented_calls(README)
CALLS = _documented_calls(API_DOC) + README_CALLS


def _written_params(args: str) -> list:
    """``[(name, kind, default expression or None)]`` of an argument list as the docs write it."""
    fn = ast.parse(f"def f({args}): pass").body[0].args
    out = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in fn.posonlyargs + fn.args]
    defaults = [None] * (len(out) - len(fn.defaults)) + [ast.unparse(d) for d in fn.defaults]
    params = [(name, kind, d) for (name, kind), d in zip(out, defaults)]
    if fn.vararg:
        params.append((fn.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        params.append((a.arg, inspect.Parameter.KEYWORD_ONLY, None if d is None else ast.unparse(d)))
    if fn.kwarg:
        params.append((fn.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return params


def _live_params(obj) -> list:
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


CORE = {("asap_comm", "init"), ("asap_comm", "launch"), ("comm", "put"), ("comm", "put_signal"),
        ("comm", "signal_wait_until"), ("comm", "mailbox"), ("box", "send"), ("box", "recv")}


@pytest.mark.parametrize("page", [README, API_DOC], ids=["README", "api.md"])
def test_the_table_lists_the_core_calls(page):
    names = {(owner, name) for _, owner, name, _ in _documented_calls(page)}
    assert CORE <= names, f"{page.name} lacks {CORE - names}"


IDS = [("api.md:" if i < len(CALLS) - len(README_CALLS) else "README:") + c[0].split("(")[0]
       for i, c in enumerate(CALLS)]


@pytest.mark.parametrize("written, owner, name, args", CALLS, ids=IDS)
def test_documented_signature_is_the_live_one(written, owner, name, args):
    live = _live_params(getattr(OWNERS[owner], name))
    doc = _written_params(args)
    live_kinds = [(p.name, p.POSITIONAL_OR_KEYWORD if p.kind == p.POSITIONAL_ONLY else p.kind) for p in live]
    assert [(n, k) for n, k, _ in doc] == live_kinds, f"the docs write {written}; the code has {[str(p) for p in live]}"
    for (pname, _, default), p in zip(doc, live):
        if default is None:
            assert p.default is p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD), \
                f"{written}: {pname} has the default {p.default!r} in the code, none in the docs"
        else:
            assert p.default is not p.empty, f"{written}: {pname}={default} in the docs, no default in the code"
            assert eval(default, {"torch": torch}) == p.default, \
                f"{written}: {pname}={default} in the docs, {p.default!r} in the code"


def _documented_schemas() -> dict:
    out = {}
    for row in _section("torch ops and `torch.compile`"):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        m = re.fullmatch(r"`(\w+)`", cells[0])
        if m and len(cells) > 1:
            out[m[1]] = re.match(r"`([^`]*)`", cells[1])[1]
    return out


SCHEMAS = _documented_schemas()


def test_the_torch_ops_table_lists_every_op():
    assert set(SCHEMAS) == {"put", "get", "put_signal", "signal_op", "signal_wait_until", "signal_wait_read"}


@pytest.mark.parametrize("op", sorted(SCHEMAS))
def test_documented_torch_op_schema_is_the_registered_one(op):
    live = str(getattr(torch.ops.asap_comm, op).default._schema)
    assert live == "asap_comm::" + SCHEMAS[op]
