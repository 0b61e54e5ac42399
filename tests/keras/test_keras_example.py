"""examples/keras_fit.py trains to its target accuracy, offline."""

import os
import re
import subprocess
import sys

import pytest

from _paths import ROOT_STR

_EXAMPLE = os.path.join(ROOT_STR, "examples", "keras_fit.py")


def _run(args, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT_STR)
    return subprocess.run(
        [sys.executable, _EXAMPLE, "--verbose", "0", "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=400, env=env,
    )


@pytest.mark.long
@pytest.mark.timeout(450)
def test_keras_fit_example_reaches_95_percent_on_digits(tmp_path):
    result = _run([], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy (\d\.\d+) \(evaluated on the cluster", result.stdout).group(1))
    assert accuracy >= 0.95
    assert (tmp_path / "best.keras").exists()
    assert "reloaded, run in this process" in result.stdout


@pytest.mark.long
@pytest.mark.timeout(450)
def test_keras_fit_example_mnist_path_with_mock_data(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    # The example runs in a subprocess: mock the data there, through a wrapper.
    wrapper = tmp_path / "run_mocked.py"
    wrapper.write_text(
        "import runpy, sys\n"
        "import tensorflow_datasets as tfds\n"
        "with tfds.testing.mock_data(num_examples=256):\n"
        f"    sys.argv = [{_EXAMPLE!r}] + sys.argv[1:]\n"
        f"    runpy.run_path({_EXAMPLE!r}, run_name='__main__')\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT_STR)
    result = subprocess.run(
        [sys.executable, str(wrapper), "--data", "mnist", "--epochs", "1", "--target", "0",
         "--verbose", "0", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"test accuracy \d\.\d+ \(evaluated on the cluster", result.stdout)
