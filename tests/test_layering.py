"""The import direction: actors/ and learner/ never import each other, and shared/ imports neither.

Both processes agree through shared/ only (config, wire, rollout schema, keys, policies, envs), so a
change on one side cannot reach into the other. Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"actors": {"learner"}, "learner": {"actors"}, "shared": {"actors", "learner"}}


def imported_packages(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in `path`, a module of `package` (relative imports
    stay inside it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for line, name in imported_packages(path, package) if name in FORBIDDEN[package]]
    assert wrong == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\ndef f():\n    from learner.buffer import CircularBuffer\n    import actors.actor\n"
                     "    from . import keys\n")
    assert imported_packages(probe, "shared") == [(1, "torch"), (3, "learner"), (4, "actors"), (5, "shared")]


@pytest.mark.parametrize("module", ["actors", "learner"])
def test_every_process_entry_point_prints_its_help(module):
    """--help of each process's entry point (an argparse help with a bare % once raised TypeError)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
