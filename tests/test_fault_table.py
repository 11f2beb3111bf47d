"""The fault table in docs/reliability.md is bench/faults.py's own output, committed with the commit that produced
it (docs/results/faults/faults.md and faults.json): every row the script defines, each passed, no wrong answer."""
import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "faults"


def _rows_defined() -> list:
    tree = ast.parse((REPO / "bench" / "faults.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RUN_ORDER" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError("bench/faults.py defines no RUN_ORDER")


def test_the_docs_table_is_the_committed_run_of_every_row():
    table = (RESULTS / "faults.md").read_text().rstrip("\n")
    assert table in (REPO / "docs" / "reliability.md").read_text(), "docs/reliability.md is not faults.md's table"
    run = json.loads((RESULTS / "faults.json").read_text())
    assert sorted(r["name"] for r in run["rows"]) == sorted(_rows_defined())
    assert run["meta"]["mode"] == "full" and run["meta"]["commit"] in table
    assert all(r["pass"] == "PASS" and r["wrong"] == 0 for r in run["rows"]), [r["name"] for r in run["rows"]
                                                                               if r["pass"] != "PASS"]
