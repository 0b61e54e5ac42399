"""A coordinator process for tests/test_data_ledger_restart.py: one epoch of a
ShardedDataset through a ShardFeed, with strategy checkpoints, counting on the
ps how often each record id was trained.

    python _ledger_restart_child.py CLUSTER_JSON CHECKPOINT_DIR first|again|other

`first` starts in an empty checkpoint directory and prints one JSON line per
finished shard (the test SIGKILLs it mid-epoch). `again` calls
`strategy.restore()`, prints the ledger it got back, resumes the epoch and
prints the counts. `other` restores with other shards and prints the refusal.
"""

import json
import sys

import tensorflow as tf

import psclient

N, SHARD, BATCH = 480, 40, 4


def main(cluster_file: str, checkpoint_dir: str, mode: str) -> None:
    with open(cluster_file) as f:
        jobs = json.load(f)
    strategy = psclient.ParameterServerStrategy(
        psclient.Cluster({"worker": jobs["worker"], "ps": jobs["ps"]}), checkpoint_dir=checkpoint_dir,
        checkpoint_every=2, hang_timeout=30, connect_timeout=120)
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64), name="counts")
    # `other`: as many shards, other bounds (a changed data set): the restore must refuse its ledger.
    shards = psclient.data.range_shards(N + SHARD, SHARD)[1:] if mode == "other" else psclient.data.range_shards(N, SHARD)
    data = psclient.data.ShardedDataset(
        shards, lambda s: tf.data.Dataset.range(s.start, s.end).batch(BATCH), seed=7)
    feed = psclient.data.ShardFeed(strategy, data)

    def step(ids):
        x = tf.random.uniform([256, 256])
        for _ in range(20):  # some work: shards last long enough to be cut off
            x = tf.linalg.matmul(x, x) / 256.0
        with tf.control_dependencies([x]):
            counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))

    run_shard = feed.shard_function(step)
    epoch = 0
    if mode == "other":
        try:
            strategy.restore()
        except psclient.data.LedgerMismatchError as error:
            emit(event="refused", error=type(error).__name__, message=str(error))
        strategy.shutdown()
        return
    if mode == "again":
        restored = strategy.restore()
        state = feed.ledger.state()
        emit(event="restored", ledgers=restored["data_ledgers"], epoch=state["epoch"], done=state["done"],
             cut_off=sorted(feed.ledger.cut_off()), positions=state["positions"], resume=feed.resume_epoch())
        epoch = feed.resume_epoch() or 0
    finished = []

    def on_shard_done(work, result):
        finished.append(work.slot)
        emit(event="shard", slot=work.slot, batches=int(result["batches"]))
        if mode == "first" and len(finished) == 3:
            # Besides checkpoint_every's (taken on the recovery thread's next round, which a
            # fast epoch can outrun): one the test can count on, with shards done and in flight.
            emit(event="saved", path=strategy.save_checkpoint())

    stats = feed.run_epoch(run_shard, epoch, on_shard_done=on_shard_done)
    emit(event="done", stats=stats, counts=counts.numpy().tolist())
    strategy.shutdown()


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
