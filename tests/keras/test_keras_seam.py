"""The Keras seam (psclient/_keras/seam.py): every private Keras name psclient uses is listed,
exists in the installed Keras, and a missing one is a loud error. No cluster.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from _paths import ROOT

keras = pytest.importorskip("keras")

from psclient._keras import install as _install
from psclient._keras import seam

PACKAGE = ROOT / "psclient"
KERAS_DIR = PACKAGE / "_keras"
LISTED_PATHS = {entry.path for entry in seam.KERAS_INTERNALS}
LISTED_NAMES = {entry.last for entry in seam.KERAS_INTERNALS}
# Calls whose second argument is an attribute name: a private name in a string is still used.
NAME_READERS = {"getattr", "hasattr", "setattr", "internal"}


# --------------------------------------------------------- (a) the list is true
@pytest.mark.parametrize("entry", seam.KERAS_INTERNALS, ids=lambda e: f"{e.path}:{e.name or e.kind}")
def test_every_listed_internal_exists_in_the_installed_keras(entry):
    seam.resolve(entry)


def test_listed_instance_attributes_exist_on_instances(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    ema = keras.optimizers.Adam(use_ema=True)
    ema.build(model.trainable_variables)
    adagrad = keras.optimizers.Adagrad()
    adagrad.build(model.trainable_variables)
    adafactor = keras.optimizers.Adafactor()
    adafactor.build(model.trainable_variables)
    instances = {
        "keras.src.backend.tensorflow.core.Variable": model.variables[0],
        "keras.src.trainers.trainer.Trainer": model,
        "keras.src.callbacks.backup_and_restore.BackupAndRestore": backup,
        "keras.src.optimizers.base_optimizer.BaseOptimizer": ema,
        "keras.src.optimizers.adagrad.Adagrad": adagrad,
        "keras.src.optimizers.adafactor.Adafactor": adafactor,
        "keras.src.optimizers.adam.Adam": ema,
    }
    instance_entries = [e for e in seam.KERAS_INTERNALS if e.kind == "instance"]
    assert instance_entries
    for entry in instance_entries:
        owner, name = entry.path.rsplit(".", 1)
        assert isinstance(instances[owner], seam.resolve(entry)), entry
        assert hasattr(instances[owner], name), entry.path
        assert seam.internal(instances[owner], name) is getattr(instances[owner], name)


def test_the_installed_keras_is_in_the_tested_range():
    low, high = seam.KERAS_VERSIONS
    assert low <= seam._version_tuple(keras.__version__) < high, keras.__version__


def test_pyproject_bounds_keras_with_the_tested_range():
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"keras{seam.keras_range()}"' in pyproject


# -------------------------------------------------------- loud when one is gone
def test_a_missing_internal_is_an_error_naming_it_and_the_keras_version(monkeypatch):
    from keras.src.trainers.trainer import Trainer

    monkeypatch.delattr(Trainer, "_symbolic_build")
    with pytest.raises(seam.KerasSeamError, match=(
        rf"needs the Keras internal `keras\.src\.trainers\.trainer\.Trainer\._symbolic_build`, "
        rf"which Keras {keras.__version__} does not have\. psclient is tested with keras>=3\.\d+,<3\.\d+"
    )):
        seam.check()


def test_a_missing_module_is_an_error_naming_it(monkeypatch):
    moved = seam.Internal("keras.src.trainers.data_adapters.moved_away.train_validation_split", "test")
    monkeypatch.setattr(seam, "KERAS_INTERNALS", (*seam.KERAS_INTERNALS, moved))
    with pytest.raises(seam.KerasSeamError, match=r"`keras\.src\.trainers\.data_adapters\.moved_away`"):
        seam.check()


def test_a_missing_instance_attribute_is_an_error_naming_it():
    class Renamed:
        pass

    with pytest.raises(seam.KerasSeamError, match=r"attribute `_compile_metrics` of .*Renamed, which Keras"):
        seam.internal(Renamed(), "_compile_metrics")


def test_a_keras_outside_the_tested_range_warns(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    with pytest.warns(RuntimeWarning, match=r"tested with keras>=3\.\d+,<3\.\d+; this is Keras 3\.99\.0"):
        seam.check()


# ------------------------------------------------ fit's arguments: all handled
def test_fit_arguments_are_exactly_those_of_keras_fit():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    parameters = set(inspect.signature(inspect.unwrap(TensorFlowTrainer.fit)).parameters) - {"self"}
    assert parameters == set(_install.FIT_ARGUMENTS)


def _fit_signature(**extra):
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    signature = inspect.signature(inspect.unwrap(TensorFlowTrainer.fit))
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value) for name, value in extra.items()]
    return signature.replace(parameters=[*signature.parameters.values(), *added])


def test_fit_passes_supported_arguments_with_defaults_filled_in():
    arguments = _install.fit_arguments(_fit_signature(), object(), ("x",), {"epochs": 3, "validation_freq": 2})
    assert set(arguments) == set(_install.FIT_ARGUMENTS)
    assert (arguments["x"], arguments["epochs"], arguments["validation_freq"]) == ("x", 3, 2)
    assert arguments["verbose"] == "auto"


def test_fit_refuses_an_argument_psclient_does_not_forward():
    # A later Keras's new fit argument: given explicitly, refused, not dropped.
    signature = _fit_signature(new_option=None)
    assert _install.fit_arguments(signature, object(), (), {"epochs": 1})["epochs"] == 1  # left out: fine
    with pytest.raises(ValueError, match=(
        r"Invalid argument `new_option` for model\.fit\(\) on a parameter-server cluster\. "
        r"Received: new_option=True\. Expected it left out"
    )):
        _install.fit_arguments(signature, object(), (), {"new_option": True})


def test_fit_refuses_extra_keyword_arguments_too():
    # A Keras whose fit took **kwargs: each one given is checked the same way.
    base = _fit_signature()
    signature = base.replace(parameters=[
        *base.parameters.values(), inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ])
    with pytest.raises(ValueError, match=r"Invalid argument `other`"):
        _install.fit_arguments(signature, object(), (), {"other": 1})


def test_fit_with_an_unknown_keyword_is_pythons_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epochz'"):
        _install.fit_arguments(_fit_signature(), object(), (), {"epochz": 1})


# ---------------------------------------------- (b) nothing private unlisted
class _Scan(ast.NodeVisitor):
    """Private Keras names one module of psclient uses."""

    def __init__(self, defined: set[str]):
        self.defined = defined  # private names psclient itself defines
        self.imports: list[tuple[int, str]] = []
        self.private: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}  # local name -> keras.src path
        self.classes: list[tuple[bool, set[str]]] = []  # (derives from a foreign class, its own self._names)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.startswith("keras.src"):
                self.imports.append((node.lineno, alias.name))
                self.aliases[(alias.asname or alias.name).split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node):
        if (node.module or "").startswith("keras.src"):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                self.imports.append((node.lineno, path))
                self.aliases[alias.asname or alias.name] = path

    def visit_ClassDef(self, node):
        foreign = any(not (isinstance(b, ast.Name) and b.id in self.defined_classes) for b in node.bases)
        own = {
            t.attr for n in ast.walk(node) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
        if foreign:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and _is_private(item.name):
                    self.private.append((item.lineno, item.name))  # overrides a Keras method
        self.classes.append((foreign, own))
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            self.imports.append((node.lineno, f"{self.aliases[node.value.id]}.{node.attr}"))
        elif _is_private(node.attr):
            self._private(node.lineno, node.attr, isinstance(node.value, ast.Name) and node.value.id == "self")
        self.generic_visit(node)

    def visit_Call(self, node):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in NAME_READERS and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            attribute = node.args[1].value
            if isinstance(attribute, str) and (_is_private(attribute) or name == "internal"):
                self._private(node.lineno, attribute, False)
        self.generic_visit(node)

    def _private(self, lineno, name, on_self):
        if on_self and self.classes:
            foreign, own = self.classes[-1]
            if foreign and name not in own:
                self.private.append((lineno, name))  # a Keras base class's attribute
            return
        if name not in self.defined or name in LISTED_NAMES:
            self.private.append((lineno, name))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _definitions(trees) -> tuple[set[str], set[str]]:
    """Private names psclient defines (functions, classes, attributes it assigns), and its class names."""
    names, classes = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    classes.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return {n for n in names if _is_private(n)}, classes


def _scan(path: pathlib.Path, defined, classes) -> _Scan:
    scan = _Scan(defined)
    scan.defined_classes = classes
    scan.visit(ast.parse(path.read_text(), str(path)))
    return scan


def _parsed(paths):
    return [ast.parse(p.read_text(), str(p)) for p in paths]


def test_keras_internals_are_imported_only_by_the_keras_integration():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if KERAS_DIR in path.parents:
            continue
        scan = _scan(path, set(), set())
        outside += [f"{path.relative_to(PACKAGE.parent)}:{line} {name}" for line, name in scan.imports]
    assert not outside, "keras.src outside psclient/_keras:\n" + "\n".join(outside)


def test_every_private_keras_name_psclient_uses_is_listed():
    paths = sorted(KERAS_DIR.glob("*.py"))
    # psclient's own private names: the whole package's, except these modules' Keras-derived classes.
    defined, classes = _definitions(_parsed(sorted(PACKAGE.rglob("*.py"))))
    unlisted, used = [], set()
    for path in paths:
        scan = _scan(path, defined, classes)
        for line, name in scan.imports:
            used.add(name)
            if not any(listed == name or listed.startswith(name + ".") for listed in LISTED_PATHS):
                unlisted.append(f"{path.name}:{line} {name}")
        for line, name in scan.private:
            used.add(name)
            if name not in LISTED_NAMES:
                unlisted.append(f"{path.name}:{line} .{name}")
    assert not unlisted, "private Keras names used but not in seam.KERAS_INTERNALS:\n" + "\n".join(unlisted)


def test_every_listed_name_is_used():
    # Nothing stale in the list: each name appears in psclient/_keras (the list
    # itself aside) as an attribute, an import, a method, or a string (patched
    # method names, reads through seam.internal).
    words = set()
    for tree in _parsed(sorted(p for p in KERAS_DIR.glob("*.py") if p.name != "seam.py")):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, ast.alias):
                words.add(node.name.split(".")[-1])
            elif isinstance(node, ast.FunctionDef):
                words.add(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.add(node.value)
    stale = sorted(LISTED_NAMES - words)
    assert not stale, f"listed in seam.KERAS_INTERNALS but not used: {stale}"
