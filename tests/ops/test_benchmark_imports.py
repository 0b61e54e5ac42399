"""Every name a benchmark or example imports from psclient exists.

Benchmarks reach into private modules (they measure the parts), and they
run by hand, not in the suite: a renamed function would only show when
someone next runs them. The imports are read from the source (also those
inside functions), so nothing here starts a cluster.
"""

import ast
import importlib

import pytest

from _paths import ROOT

SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])


def psclient_imports(path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "psclient":
            for alias in node.names:
                yield node.module, alias.name, node.lineno


@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_the_names_it_imports_from_psclient_exist(path):
    missing = []
    for module, name, line in psclient_imports(path):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"{path.name} imports names psclient no longer has: {missing}"


def test_scripts_are_found():
    assert len(SCRIPTS) > 10
