"""The README's two set-up commands: inside the fenced block after the ``<!-- ci:commands`` marker (so they render
as code, not headings), each a fresh venv that installs torch==2.13.0 first, and the test command the very one that
``.ci/run`` runs."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _block() -> list:
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- ci:commands"))
    assert start < 5, "the two commands must be among the README's first lines"
    assert lines[start + 1].startswith("```"), "the commands must sit in a fenced block right after the marker"
    end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("```"))
    return lines[start + 2:end]


def test_the_two_commands_are_fenced_and_install_torch_first():
    block = _block()
    heads = [i for i, line in enumerate(block) if line.startswith("# ")]
    assert [block[i].split(":")[0] for i in heads] == ["# Main job", "# Tests"]
    for i in heads:
        cmd = block[i + 1]
        assert cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && ")
    assert block[heads[1] + 1].endswith("python -m pytest -q")
    assert re.search(r"pip install -e \"\.\[examples\]\" && python examples/prefill\.py$", block[heads[0] + 1])


def test_ci_runs_the_readme_test_command_verbatim():
    script = (REPO / ".ci" / "run").read_text()
    expected = re.search(r"^expected='(.*)'$", script, re.M).group(1)
    block = _block()
    assert block[block.index("# Tests") + 1] == expected
    assert script.rstrip().splitlines()[-1] == expected, ".ci/run must run exactly that command, nothing weaker"
    # .ci/run's own extraction (awk over the marker's block) finds the same line
    awk = re.search(r"cmd=\$\(awk '(.*)' README\.md\)", script).group(1)
    found = subprocess.run(["awk", awk, "README.md"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert found.stdout.strip() == expected
