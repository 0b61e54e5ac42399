"""The layout's rules, checked on every run (no cluster, no TensorFlow import).

The layer and purity contracts live in pyproject.toml ([tool.importlinter]);
this runs them, and adds what import-linter does not check: no import cycle
among psclient's modules, function-level imports included, and the size
limit on modules.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (test extra) is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "psclient"
MAX_MODULE_LINES = 600


def test_import_contracts_hold():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_import_cycles():
    graph = grimp.build_graph("psclient")
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported == "psclient" or importer == "psclient":
                continue  # the public facade imports everything; nothing imports it back at import time
            chain = graph.find_shortest_chain(importer=imported, imported=importer)
            if chain:
                cycles.append(" -> ".join((importer,) + tuple(chain)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_modules_stay_small():
    too_big = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_big, f"modules over {MAX_MODULE_LINES} lines: {too_big}"
