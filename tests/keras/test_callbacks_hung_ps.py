"""`psclient.ModelCheckpoint` and `psclient.BackupAndRestore` in `fit` with a ps that hangs at a save
(SIGSTOPped, a real `LocalCluster`): each save is given up after hang_timeout and noted
(`failed_saves`), training goes on once the ps answers, and the save is made again. (Each raised out
of `fit`, ending the training.) `ServingExport`'s case: tests/serving/test_serving_hung_ps.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from _two_shard_model import fit_with_a_ps_stopped, two_shard_strategy_and_model

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HANG_TIMEOUT = 3.0
LIMIT = 120.0


@pytest.mark.parametrize("hung", [0, 1])
def test_checkpoint_callbacks_go_on_past_a_ps_hung_at_a_save(one_worker_two_ps, restore_shared_clusters, tmp_path,
                                                             hung):
    """ps:1 holds the optimizer's step count (read first, bounded since); ps:0 does not (the snapshot
    gives up)."""
    cluster = one_worker_two_ps
    strategy, model, x, y = two_shard_strategy_and_model(cluster, HANG_TIMEOUT)
    checkpoint = psclient.ModelCheckpoint(tmp_path / "ckpts", max_to_keep=10)
    backup = psclient.BackupAndRestore(str(tmp_path / "backup"))
    try:
        fit_with_a_ps_stopped(cluster, model, x, y, hung, [checkpoint, backup],
                              lambda: checkpoint.failed_saves and backup.failed_saves, LIMIT)
        for failures in (checkpoint.failed_saves, backup.failed_saves):
            assert [f["task"] for f in failures] == [f"ps:{hung}"], failures
            assert f"hang_timeout={HANG_TIMEOUT:g}" in failures[0]["error"] or "no answer within" in failures[0]["error"]
        # Epoch 1's checkpoint given up, made again at the next batch's end; then epochs 2 and 3.
        assert len(checkpoint.saved) == 3, checkpoint.saved
        weights = [w.numpy() for w in model.weights]
        restored = psclient.ModelCheckpoint(tmp_path / "ckpts").restore(model)
        assert restored["path"] == checkpoint.saved[-1], restored
        for before, after in zip(weights, model.weights):
            np.testing.assert_array_equal(before, after.numpy())
    finally:
        strategy.shutdown()
