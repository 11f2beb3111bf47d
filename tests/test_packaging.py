"""What a non-editable install ships: every package directory of the source tree is listed in pyproject.toml's
``[tool.setuptools] packages`` (a missing one installs without error and fails only at import), and the data the
code reads at run time (the packaged traces, the simulator's profiles and models) is matched by package-data."""
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setuptools():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_directory_is_listed():
    cfg = _setuptools()
    dirs = {name: Path(d) for name, d in cfg.get("package-dir", {}).items()}
    found = set()
    for top in ("asap_comm", "models"):
        for init in sorted((REPO / top).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO)
            parts = list(rel.parts)
            for name, d in dirs.items():  # models/ installs as asap_models
                if parts[:len(d.parts)] == list(d.parts):
                    parts = [name] + parts[len(d.parts):]
            found.add(".".join(parts))
    assert found == set(cfg["packages"]), (f"pyproject.toml packages: missing {sorted(found - set(cfg['packages']))}, "
                                           f"not in the tree {sorted(set(cfg['packages']) - found)}")


def test_package_data_matches_the_files_the_code_reads():
    data = _setuptools()["package-data"]
    for pkg, sub in (("asap_comm", "data/traces"), ("asap_comm.sim", "profiles"), ("asap_comm.sim", "models"),
                     ("asap_comm.sim", "routing_data")):
        base = REPO / pkg.replace(".", "/")
        files = [f for f in (base / sub).rglob("*") if f.is_file() and f.suffix != ".py" and "__pycache__" not in f.parts]
        assert files, f"{base / sub} holds no data files"
        for f in files:
            rel = f.relative_to(base)
            assert any(rel.match(pat) for pat in data[pkg]), f"{pkg}: {rel} is not matched by package-data {data[pkg]}"
