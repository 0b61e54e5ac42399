"""examples/ctr_dynamic.py: its generator (no cluster) and a tiny run of the whole example on a real
LocalCluster(2 workers, 2 ps), which must print both models' AUCs and the dynamic tables' stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _examples import load_example
from _paths import ROOT_STR

_EXAMPLE = os.path.join(ROOT_STR, "examples", "ctr_dynamic.py")


def _example():
    return load_example("ctr_dynamic.py")


def test_stream_draws_drifting_head_ids_and_one_off_ids():
    ctr = _example()
    stream = ctr.Stream(seed=3, window=200, drift=1.0, total=20_000, tail=0.25)
    ids, dense, clicks, logit = stream.sample(0, 4_000, seed=1)
    assert ids.shape == (4_000, len(ctr.FIELDS)) and dense.shape == (4_000, ctr.DENSE)
    offset = (np.arange(len(ctr.FIELDS)) + 1) * 10**12
    one_off = ids - offset >= 5 * 10**11
    assert abs(one_off.mean() - 0.25) < 0.03
    # One-off ids are never repeated; head ids are (a window of 200 ids per field).
    assert len(np.unique(ids[one_off])) == one_off.sum()
    assert len(np.unique(ids[~one_off])) < 0.2 * (~one_off).sum()
    head = ids[:, 0][~one_off[:, 0]] - offset[0]
    assert head.min() >= 0 and head.max() < 200 + 4_000 * 200 // 20_000
    # The clicks follow the logit the generator reports.
    assert ctr.auc(clicks, logit) > 0.7
    # Same seed, same draw; a key's weight is fixed wherever it appears.
    again = stream.sample(0, 4_000, seed=1)
    np.testing.assert_array_equal(again[0], ids)
    np.testing.assert_allclose(stream.weight(0, ids[:5, 0]), stream.weight(0, ids[:5, 0].copy()))


def test_paired_difference_of_equal_scores_is_zero_and_of_better_scores_positive():
    ctr = _example()
    rng = np.random.default_rng(0)
    labels = (rng.random(2_000) < 0.3).astype("float32")
    good, noise = labels + rng.normal(0, 1.0, 2_000), rng.normal(0, 1.0, 2_000)
    assert ctr.paired_difference(labels, good, good, rounds=20) == (0.0, 0.0)
    difference, error = ctr.paired_difference(labels, good, noise, rounds=50)
    assert difference == pytest.approx(ctr.auc(labels, good) - ctr.auc(labels, noise))
    assert difference > 5 * error > 0


@pytest.mark.long
@pytest.mark.timeout(300)
def test_tiny_run_prints_aucs_and_table_stats(tmp_path):
    rows = 150
    out = tmp_path / "summary.json"
    argv = [sys.executable, _EXAMPLE, "--segments", "1", "--examples-per-segment", "1500", "--test-examples", "600",
            "--window", "100", "--rows", str(rows), "--batch-size", "128", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT_STR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT_STR)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("part 0: AUC dynamic") for line in lines)
    assert any(line.startswith("pooled over") for line in lines)
    summary = json.loads(out.read_text())
    for part in summary["segments"]:
        for kind in ("dynamic", "hashing", "true_model"):
            assert 0.0 < part[f"{kind}_auc"] < 1.0
        for field in ("user", "item", "query"):
            # The capacity holds; a one-off id never gets a row (min_frequency=2), so rows < tracked keys.
            assert 0 < part[f"{field}_rows"] <= rows
            assert part[f"{field}_rows"] < part[f"{field}_tracked_keys"]
            assert part[f"{field}_admissions"] - part[f"{field}_evictions"] <= part[f"{field}_rows"] + 5
    assert set(summary["pooled_auc_after_first_part"]) == {"dynamic", "hashing", "true"}
    assert summary["dynamic_minus_hashing_se"] > 0
