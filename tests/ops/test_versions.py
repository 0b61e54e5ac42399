"""The dependency range in pyproject.toml is the one psclient is tested with."""

import re
import warnings

import pytest
import tensorflow as tf

from psclient._coordinator import connection
from psclient._keras import seam

from _paths import ROOT


def _oldest_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / "oldest.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_pyproject_bounds_tensorflow_with_the_tested_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"tensorflow{connection.tensorflow_range()}"' in pyproject


def test_the_installed_tensorflow_is_in_the_tested_range():
    major, minor = map(int, re.match(r"(\d+)\.(\d+)", tf.__version__).groups())
    low, high = connection.TF_VERSIONS
    assert low <= (major, minor) < high, tf.__version__


def test_the_oldest_pins_are_the_lower_bounds():
    # `nox -s oldest` installs these; they must be the releases the ranges start at.
    pins = _oldest_pins()
    assert set(pins) == {"tensorflow", "keras"}
    assert tuple(map(int, pins["tensorflow"].split(".")[:2])) == connection.TF_VERSIONS[0]
    assert tuple(map(int, pins["keras"].split(".")[:2])) == seam.KERAS_VERSIONS[0]


def test_ci_runs_the_oldest_session_after_the_suite():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "nox -s oldest" in ci
    assert ci.index("python -m pytest -q") < ci.index("nox -s oldest")


@pytest.mark.parametrize("version, warns", [("2.15.1", True), ("2.22.0", True), ("2.16.0", False), ("2.21.0", False)])
def test_a_tensorflow_outside_the_range_gets_one_warning(monkeypatch, version, warns):
    monkeypatch.setattr(connection, "_version_checked", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        connection.check_tensorflow_version(version)
        connection.check_tensorflow_version(version)  # once per process, not per connect
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if warns:
        assert len(messages) == 1, messages
        assert f"tensorflow{connection.tensorflow_range()}" in messages[0]
        assert f"this is TensorFlow {version}" in messages[0]
    else:
        assert messages == []


def test_the_install_page_gives_every_dependency_by_hand():
    """docs/install.md's `tensorflow-cpu` recipe installs psclient without its dependencies and
    names them itself: each of pyproject.toml's, with the same bound (tensorflow as tensorflow-cpu)."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    recipe = next(line for line in (ROOT / "docs" / "install.md").read_text().splitlines()
                  if line.startswith('pip install "tensorflow-cpu'))
    for dependency in dependencies:
        assert f'"{dependency.replace("tensorflow", "tensorflow-cpu", 1)}"' in recipe, (dependency, recipe)
