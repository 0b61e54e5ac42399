"""A coordinator process for tests/data/test_data_ledger_restart.py: one epoch of a
ShardedDataset through a ShardFeed, with strategy checkpoints, counting on the
ps how often each record id was trained.

    python _ledger_restart_child.py CLUSTER_JSON CHECKPOINT_DIR first|again|other|fit-first|fit-again

`first` starts in an empty checkpoint directory and prints one JSON line per
finished shard (the test SIGKILLs it mid-epoch). `again` calls
`strategy.restore()`, prints the ledger it got back, resumes the epoch and
prints the counts. `other` restores with other shards and prints the refusal.
`fit-first` and `fit-again` do the same through `model.fit(ShardedDataset)`
(a model whose train step counts the ids it trains), one line per Keras step.
"""

import json
import sys

import tensorflow as tf

import psclient

N, SHARD, BATCH = 480, 40, 4


def connect(cluster_file: str, checkpoint_dir: str):
    with open(cluster_file) as f:
        jobs = json.load(f)
    return psclient.ParameterServerStrategy(
        psclient.Cluster({"worker": jobs["worker"], "ps": jobs["ps"]}), checkpoint_dir=checkpoint_dir,
        checkpoint_every=2, hang_timeout=30, connect_timeout=120)


def work(x):
    """Some compute per batch, so that shards last long enough to be cut off."""
    for _ in range(20):
        x = tf.linalg.matmul(x, x) / 256.0
    return x


def main(cluster_file: str, checkpoint_dir: str, mode: str) -> None:
    if mode.startswith("fit-"):
        fit_main(cluster_file, checkpoint_dir, mode)
        return
    strategy = connect(cluster_file, checkpoint_dir)
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64), name="counts")
    # `other`: as many shards, other bounds (a changed data set): the restore must refuse its ledger.
    shards = psclient.data.range_shards(N + SHARD, SHARD)[1:] if mode == "other" else psclient.data.range_shards(N, SHARD)
    data = psclient.data.ShardedDataset(
        shards, lambda s: tf.data.Dataset.range(s.start, s.end).batch(BATCH), seed=7)
    feed = psclient.data.ShardFeed(strategy, data)

    def step(ids):
        with tf.control_dependencies([work(tf.random.uniform([256, 256]))]):
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

    def on_shard_done(item, result):
        finished.append(item.slot)
        emit(event="shard", slot=item.slot, batches=int(result["batches"]))
        if mode == "first" and len(finished) == 3:
            # Besides checkpoint_every's (taken on the recovery thread's next round, which a
            # fast epoch can outrun): one the test can count on, with shards done and in flight.
            emit(event="saved", path=strategy.save_checkpoint())

    stats = feed.run_epoch(run_shard, epoch, on_shard_done=on_shard_done)
    emit(event="done", stats=stats, counts=counts.numpy().tolist())
    strategy.shutdown()


def fit_main(cluster_file: str, checkpoint_dir: str, mode: str) -> None:
    import keras

    from psclient._keras.sharded_fit import active_feed

    strategy = connect(cluster_file, checkpoint_dir)
    with strategy.scope():
        counts = tf.Variable(tf.zeros([N], tf.int64), name="counts")

        class Counting(keras.Model):
            """Linear regression whose train step counts, on the ps, the record ids it trains."""

            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(1)

            def build(self, input_shape):
                self.dense.build(input_shape)

            def call(self, x):
                return self.dense(x)

            def train_step(self, data):
                x, _ = data
                ids = tf.cast(x[:, 0], tf.int64)
                with tf.control_dependencies([work(tf.random.uniform([256, 256]))]):
                    counts.scatter_add(tf.IndexedSlices(tf.ones_like(ids), ids))
                return super().train_step(data)

        model = Counting()
        model.build((None, 1))
        model.compile("sgd", "mse")
        model.optimizer.build(model.trainable_variables)  # before restore(): restored with the rest

    def id_dataset(shard):
        ids = tf.data.Dataset.range(shard.start, shard.end)
        return ids.map(lambda i: (tf.cast([i], tf.float32), tf.cast([i % 3], tf.float32))).batch(BATCH)

    data = psclient.data.ShardedDataset(psclient.data.range_shards(N, SHARD), id_dataset, seed=7)
    if mode == "fit-again":
        emit(event="restored", ledgers=strategy.restore()["data_ledgers"])

    class Report(keras.callbacks.Callback):
        saved = False

        def on_train_begin(self, logs=None):
            state = active_feed(self.model).ledger.state()  # the restored ledger, if any
            emit(event="begin", epoch=state["epoch"], done=state["done"], positions=state["positions"])

        def on_train_batch_end(self, batch, logs=None):
            done = active_feed(self.model).stats()["done"]
            emit(event="step", step=batch, done=done)
            if mode == "fit-first" and done >= 3 and not self.saved:
                self.saved = True  # one checkpoint the test can count on, shards done and in flight
                emit(event="saved", path=strategy.save_checkpoint())

        def on_train_end(self, logs=None):
            emit(event="done", stats=active_feed(self.model).stats(), counts=counts.numpy().tolist())

    model.fit(data, epochs=1, verbose=0, callbacks=[Report()])
    strategy.shutdown()


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
