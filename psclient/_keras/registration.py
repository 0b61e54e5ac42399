"""Keras learns psclient's layers when Keras is imported, not only when psclient.layers is.

So `keras.models.load_model("m.keras")` reads a saved DynamicEmbedding in a
process that imported psclient but not psclient.layers (a model server, say),
in whichever order it imported psclient and Keras. Importing psclient still
imports neither Keras nor TensorFlow: a one-shot import hook waits for Keras
(TensorFlow's own import imports it too).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

__all__ = ["register_when_keras_loads"]

_LAYERS = "psclient._keras.dynamic_embedding"  # registers `psclient>DynamicEmbedding` on import
_lock = threading.Lock()


def register_when_keras_loads() -> None:
    with _lock:
        if "keras" in sys.modules:
            _register()
        elif not any(isinstance(finder, _AfterKeras) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterKeras())


def _register() -> None:
    try:
        importlib.import_module(_LAYERS)
    except (ImportError, AttributeError):
        # A Keras psclient cannot use (another backend, an old version), or one imported half-way
        # by a failing import: never break the import that loaded Keras; psclient.layers registers later.
        pass


class _AfterKeras(importlib.abc.MetaPathFinder):
    """Finds `keras` through the other finders and registers psclient's layers once it has run."""

    def __init__(self):
        self.looking = threading.local()

    def find_spec(self, name, path=None, target=None):
        # Every lookup of `keras` (TensorFlow's import asks first, then imports), until it is loaded.
        if name != "keras" or getattr(self.looking, "active", False):
            return None
        self.looking.active = True
        try:
            spec = importlib.util.find_spec(name)  # the other finders' answer
        finally:
            self.looking.active = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader, self)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        with _lock:
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)  # done: Keras is loaded
        _register()

    def __getattr__(self, name):  # the wrapped loader's resources, source, ...
        return getattr(self.loader, name)
