"""`strategy.stats()` beside a hung ps and a lost one: it returns, the shards it cannot read marked.

The DynamicEmbedding tables' counts are read on the ps tasks. Read plainly, `stats()` waited as
long as a ps hung (until it resumed) or was being recovered (until its recovery settled: 77 s in
a seeded chaos plan, docs/chaos.md), and a monitoring thread calling it hung with it. Now it waits
at most `hang_timeout` for a ps that does not answer and not at all for a recovery.

On the session's shared 1-worker, 2-ps cluster (every task runs again when a test ends).
"""

import threading

import numpy as np
import pytest

import psclient
from _polling import wait_for
from _stopped import stopped

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900),
              pytest.mark.usefixtures("restore_shared_clusters")]

HANG_TIMEOUT = 3.0
#: Generous: a stats() that returns at all while the ps is stopped shows it did not wait for it.
RETURN_LIMIT_S = 120.0
KEYS = np.arange(64, dtype="int64")[:, None]


def _stats_in_a_thread(strategy) -> dict:
    """`strategy.stats()` on a thread of its own (a monitoring thread's call), within RETURN_LIMIT_S."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(strategy.stats()), name="monitor", daemon=True)
    thread.start()
    thread.join(RETURN_LIMIT_S)
    assert not thread.is_alive(), "stats() did not return while a ps hung"
    return out


def test_stats_beside_a_hung_ps_and_a_lost_one_returns_with_those_shards_marked(one_worker_two_ps, tmp_path):
    cluster = one_worker_two_ps
    strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=HANG_TIMEOUT,
                                                checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        with strategy.scope():
            ids = keras.Input([1], dtype="int64")
            rows = psclient.layers.DynamicEmbedding(4, capacity=1000, name="watched")(ids)
            model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
            model.compile("sgd", "mse")
        model.fit(KEYS, np.zeros((len(KEYS), 1), "float32"), batch_size=16, epochs=1, verbose=0)  # rows on both ps
        before = strategy.stats()["dynamic_embeddings"]["watched"]
        assert [entry["ps"] for entry in before] == [0, 1] and sum(e["rows"] for e in before) == len(KEYS)
        assert strategy.stats()["embedding_stats_waiting"] is False

        with stopped(cluster, "ps", 1, watchdog_s=300):
            hung = _stats_in_a_thread(strategy)
            assert cluster.pid("ps", 1) and hung["embedding_stats_waiting"] is True
            entries = hung["dynamic_embeddings"]["watched"]
            assert entries[0] == before[0], entries  # the ps that answers is read
            assert entries[1]["available"] is False and entries[1]["waiting"] is True, entries
            assert "does not answer" in entries[1]["error"]
            assert hung["workers"][0]["up"] is True  # the rest of stats() as ever
        wait_for(lambda: strategy.stats()["embedding_stats_waiting"] is False, RETURN_LIMIT_S,
                 "the read to end once the ps answers")
        assert strategy.stats()["dynamic_embeddings"]["watched"] == before

        strategy.save_checkpoint()
        cluster.kill("ps", 1)
        cluster.restart("ps", 1)
        # The restarted ps holds none of the table: stats() (or the probes) report it to the
        # recovery, which restores it from the checkpoint; stats() does not wait for that.
        lost = _stats_in_a_thread(strategy)["dynamic_embeddings"]["watched"]
        assert lost[0] == before[0], lost
        assert lost[1]["available"] is False and lost[1]["recovering"] is True, lost
        wait_for(lambda: strategy.stats(read_ps=False)["ps"][1]["recoveries"] == 1, RETURN_LIMIT_S,
                 "ps 1 to be recovered")
        assert strategy.stats()["dynamic_embeddings"]["watched"] == before
    finally:
        strategy.shutdown()
    assert not any(t.name == "psclient-table-stats" for t in threading.enumerate())
