"""`psclient demo` end to end: a real cluster, model.fit, the sidecar evaluator in its own process."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from _paths import ROOT_STR

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_demo_trains_evaluates_and_prints_where_everything_is(tmp_path, capsys):
    pytest.importorskip("sklearn")
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "psclient", "demo", "--workdir", str(tmp_path), "--epochs", "4"],
                            capture_output=True, text=True, timeout=280, cwd=ROOT_STR, env=env)
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\npsclient demo --epochs 4 took {elapsed:.1f} s")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert "accept unauthenticated RPCs" in out
    assert "Epoch 4/4" in out  # Keras's own progress lines.
    accuracy = float(re.search(r"^test accuracy: (\d\.\d+)", out, re.M).group(1))
    assert accuracy > 0.85, out
    checkpoints, logs = tmp_path / "checkpoints", tmp_path / "tensorboard"
    assert f"checkpoints:      {checkpoints}" in out and f"TensorBoard logs: {logs}" in out
    assert sorted(p for p in os.listdir(checkpoints) if p.endswith(".h5"))[-1] == "epoch-04.weights.h5"
    assert json.loads((checkpoints / "psclient-final.json").read_text())["checkpoint"] == "epoch-04.weights.h5"
    records = [json.loads(line) for line in (logs / "evaluations.jsonl").read_text().splitlines()]
    assert records[-1]["checkpoint"] == "epoch-04.weights.h5"
    assert records[-1]["metrics"]["accuracy"] == pytest.approx(accuracy, abs=6e-5)  # Same weights, same data (printed to 4 places).
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logs))
    assert "evaluator | psclient evaluate: stopping after" in out
    assert (tmp_path / "best.keras").exists()
