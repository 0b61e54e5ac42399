"""Load a script under examples/ as a module, so tests can call its pieces without running it."""

from __future__ import annotations

import importlib.util
import os

from _paths import ROOT_STR


def example_path(name: str) -> str:
    return os.path.join(ROOT_STR, "examples", name)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), example_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
