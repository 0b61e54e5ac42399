"""The layout's rules, checked on every run (no cluster; TensorFlow only in subprocesses).

The layer and purity contracts live in pyproject.toml ([tool.importlinter]);
this runs them, and adds what import-linter does not check: no import cycle
among psclient's modules, function-level imports included, and the size
limit on modules.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from _paths import ROOT

grimp = pytest.importorskip("grimp", reason="import-linter (test extra) is not installed")

PACKAGE = ROOT / "psclient"
MAX_MODULE_LINES = 500


def _lint_imports() -> subprocess.CompletedProcess:
    # tests/ on the path: the contract type of tests/import_contracts.py.
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )


def test_import_contracts_hold():
    result = _lint_imports()
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


def _function_level_tensorflow_imports() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m == "tensorflow" or m.startswith("tensorflow.") for m in modules):
                found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    return found


def test_tensorflow_is_imported_at_module_top():
    # The few exceptions, each for a reason given in a comment above it.
    allowed = {
        "psclient/_cluster/spec.py",  # Cluster is pure Python: `import psclient` stays cheap
        "psclient/_cluster/server.py",  # serve sets GRPC_FAIL_FAST and blocks Keras's import first
        "psclient/_demo.py",  # the sidecar evaluator's TF import overlaps the demo's
    }
    found = _function_level_tensorflow_imports()
    assert set(found) <= allowed, {k: v for k, v in found.items() if k not in allowed}
    for name, lines in found.items():
        source = (ROOT / name).read_text().splitlines()
        for line in lines:
            assert "not at the top" in source[line - 2], f"{name}:{line}: say why TF is imported here"


def test_import_psclient_loads_neither_tensorflow_nor_keras():
    code = ("import sys, psclient; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_public_names_load_on_first_use():
    code = ("import sys, psclient; psclient.ParameterServerStrategy; psclient.CheckpointWriteError; "
            "print('tensorflow' in sys.modules, sorted(set(psclient.__all__) - set(dir(psclient))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True []", result.stdout


def test_public_submodules_load_on_first_use():
    """`psclient.serving.load(...)` after `import psclient` alone, as `psclient.layers` and `psclient.data`."""
    code = ("import psclient; "
            "print(psclient.serving.load.__module__, psclient.layers.__name__, psclient.data.__name__, "
            "{'serving', 'layers', 'data'} <= set(dir(psclient)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "psclient.serving psclient.layers psclient.data True", result.stdout
