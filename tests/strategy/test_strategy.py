"""ParameterServerStrategy on a real LocalCluster (2 workers, 1 ps)."""

import collections
import concurrent.futures
import gc
import threading
import time
import warnings

import numpy as np
import pytest
import tensorflow as tf
from _threads import cluster_owned


pytestmark = pytest.mark.cluster


def test_variables_in_scope_live_on_ps(strategy):
    with strategy.scope():
        v = tf.Variable(tf.ones([3, 4]), name="on_ps")
    assert "/job:ps/" in v.device
    names = [p["name"] for p in strategy.placement()["variables"]]
    assert "on_ps:0" in names
    assert strategy.placement()["bytes_per_ps"][0] >= 48


def test_nothing_is_split_with_one_ps_task(strategy):
    """The default ("auto") splits over ps tasks; with one there is nothing to split over."""
    assert strategy.num_ps == 1 and strategy.variable_partitioner is None
    with strategy.scope():
        big = tf.Variable(tf.zeros([1000, 100]), name="big_whole")  # 400 KB
    assert isinstance(big, tf.Variable) and "/job:ps/replica:0/task:0/" in big.device
    entry = next(p for p in strategy.placement()["variables"] if p["name"] == "big_whole:0")
    assert entry["part"] is None and entry["nbytes"] == 400_000


def test_the_strategy_exposes_its_config(strategy):
    import psclient

    assert strategy.config == psclient.StrategyConfig()  # the fixture's: every default
    assert strategy.config.pipeline_depth == strategy.pipeline_depth
    assert strategy.config.variable_partitioner == "auto" and strategy.variable_partitioner is None


def test_schedule_returns_numpy_nested_outputs(strategy):
    with strategy.scope():
        counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(x):
        counter.assign_add(1)
        return {"double": x * 2.0, "pair": (tf.reduce_sum(x), counter.read_value())}

    out = strategy.schedule(step, args=(tf.constant([1.0, 2.0]),)).result(timeout=60)
    assert isinstance(out["double"], np.ndarray)
    np.testing.assert_allclose(out["double"], [2.0, 4.0])
    assert float(out["pair"][0]) == 3.0
    assert int(out["pair"][1]) == 1


def test_traced_once_for_all_workers(strategy):
    with strategy.scope():
        total = tf.Variable(0.0)

    @tf.function
    def add(x):
        total.assign_add(x)
        return x

    futures = [strategy.schedule(add, args=(tf.constant(1.0),)) for _ in range(60)]
    strategy.join()
    assert all(f.done() for f in futures)
    assert total.numpy() == 60.0
    assert add.experimental_get_tracing_count() == 1
    # Both workers took part.
    done = [w["done"] for w in strategy.stats()["workers"]]
    assert all(d > 0 for d in done), done


def test_plain_python_callable_is_wrapped_once(strategy):
    def plain(x):
        return x + 1

    for _ in range(3):
        assert strategy.schedule(plain, args=(tf.constant(1),)).result(60) == 2
    wrapped = strategy._tracer._wrapped[plain][None]  # white-box: the cached tf.function
    assert wrapped.experimental_get_tracing_count() == 1


def test_repeated_arguments_reuse_the_trace_and_new_ones_still_give_right_results(strategy):
    # The trace of a call is cached by the identity of its arguments; every
    # other argument must still be traced and called by what it holds.
    calls = []

    @tf.function
    def scale(x, factor, items=()):
        calls.append(1)  # counts traces (Python side effect runs only when tracing)
        return x * factor + sum(items)

    dataset = strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(1000))
    iterator = iter(dataset)

    @tf.function
    def take(it, factor):
        return next(it) * factor

    ten = tf.constant(10, tf.int64)
    taken = [strategy.schedule(take, args=(iterator, ten)) for _ in range(40)]
    strategy.join()
    # Each worker reads its own copy of range(1000) in order, so the values
    # (x10) are two prefixes of 0, 1, 2, ...: no element skipped or read twice
    # by one worker, whichever trace its call went through.
    seen = collections.Counter(int(f.result()) for f in taken)
    assert all(v % 10 == 0 for v in seen) and sum(seen.values()) == 40
    assert max(seen.values()) <= 2
    assert all(seen[10 * i] >= seen[10 * (i + 1)] for i in range(40))
    assert take.experimental_get_tracing_count() == 1

    x = tf.constant([1.0, 2.0])
    # `items` is left to its Python default (a traced function takes it explicitly).
    assert list(strategy.schedule(scale, args=(x, 2.0)).result(60)) == [2.0, 4.0]
    assert list(strategy.schedule(scale, args=(x, 3.0)).result(60)) == [3.0, 6.0]  # a new scalar
    wide = tf.constant([1.0, 2.0, 3.0])  # a new tensor of another shape: a new trace
    assert list(strategy.schedule(scale, args=(wide, 2.0)).result(60)) == [2.0, 4.0, 6.0]
    items = [1.0]
    assert list(strategy.schedule(scale, args=(x, 2.0), kwargs={"items": items}).result(60)) == [3.0, 5.0]
    items.append(10.0)  # the same list, changed: TF's own lookup sees the change
    assert list(strategy.schedule(scale, args=(x, 2.0), kwargs={"items": items}).result(60)) == [13.0, 15.0]
    before = len(calls)
    for _ in range(5):
        assert list(strategy.schedule(scale, args=(x, 3.0)).result(60)) == [3.0, 6.0]
    assert len(calls) == before  # repeated calls were not traced again


def test_join_raises_first_error_with_type_message_and_name_then_recovers(strategy):
    @tf.function
    def must_be_positive(x):
        tf.debugging.assert_positive(x, message="x must be positive")
        return x

    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        bad = strategy.schedule(must_be_positive, args=(tf.constant(-1.0),))
        strategy.join()
    message = str(info.value)
    assert "x must be positive" in message and "must_be_positive" in message
    assert isinstance(bad.exception(timeout=0), tf.errors.InvalidArgumentError)
    # The error was raised once; the strategy is usable again.
    strategy.join()
    assert strategy.schedule(must_be_positive, args=(tf.constant(2.0),)).result(60) == 2.0


def test_error_cancels_what_was_queued(strategy):
    with strategy.scope():
        slow_counter = tf.Variable(0)

    @tf.function
    def work(x):
        tf.debugging.assert_positive(x, message="bad input")
        slow_counter.assign_add(1)
        return x

    futures = [strategy.schedule(work, args=(tf.constant(1),)) for _ in range(20)]
    futures.append(strategy.schedule(work, args=(tf.constant(-1),)))
    # On a loaded machine the bad closure can fail before the next 200 are all
    # scheduled: then schedule() raises its error (once), as documented.
    raised_by_schedule = False
    for _ in range(200):
        try:
            futures.append(strategy.schedule(work, args=(tf.constant(1),)))
        except tf.errors.InvalidArgumentError as error:
            assert "bad input" in str(error)
            raised_by_schedule = True
            break
    if raised_by_schedule:
        strategy.join()  # raised once already: not again
    else:
        with pytest.raises(tf.errors.InvalidArgumentError, match="bad input"):
            strategy.join()
    cancelled = [f for f in futures if f.cancelled()]
    finished = [f for f in futures if f.done() and not f.cancelled() and f.exception() is None]
    # Queued closures behind the failure were cancelled, unless the error
    # surfaced so early that nothing was queued behind it.
    assert len(cancelled) > 0 or raised_by_schedule
    assert all(f.done() for f in futures)
    failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    assert 1 <= len(failed) <= 2  # the bad one, and maybe one running beside it (docs/api.md, Semantics)
    assert len(finished) + len(failed) + len(cancelled) == len(futures)
    # Every closure either ran or was cancelled: nothing lost, nothing run twice.
    # A failed closure may have applied its ps-side update: TF runs the ps part
    # of a function even when an op on the worker part fails.
    assert len(finished) <= slow_counter.numpy() <= len(finished) + len(failed)
    for f in cancelled:
        with pytest.raises(concurrent.futures.CancelledError):
            f.result(timeout=0)


def make_heavy(size: int, rounds: int):
    """A tf.function that keeps a worker busy for a while (tens of ms)."""

    @tf.function
    def heavy():
        x = tf.random.uniform([size, size])
        for _ in range(rounds):
            x = tf.linalg.matmul(x, x) / float(size)
        return tf.reduce_sum(x)

    return heavy


def test_done_does_not_block(strategy):
    heavy = make_heavy(300, 20)
    heavy.get_concrete_function()  # trace outside the timed part
    futures = [strategy.schedule(heavy) for _ in range(20)]
    start = time.monotonic()
    assert strategy.done() is False  # 20 busy closures cannot all be finished yet
    assert time.monotonic() - start < 1.0
    strategy.join()
    assert strategy.done() is True
    assert all(f.done() for f in futures)


def test_futures_work_with_stdlib_wait_and_as_completed(strategy):
    @tf.function
    def ident(x):
        return x

    futures = [strategy.schedule(ident, args=(tf.constant(i),)) for i in range(10)]
    done, not_done = concurrent.futures.wait(futures, timeout=60)
    assert not not_done
    assert sorted(int(f.result()) for f in concurrent.futures.as_completed(futures)) == list(range(10))


def test_cancel_before_start(strategy):
    heavy = make_heavy(200, 10)
    futures = [strategy.schedule(heavy) for _ in range(40)]
    last = futures[-1]
    # 39 busy closures are ahead of it on two workers: it has not started.
    assert last.cancel()
    assert last.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        last.result(timeout=0)
    strategy.join()
    assert all(f.done() for f in futures)
    assert [f.cancelled() for f in futures].count(True) == 1


def test_datasets_from_function_shard_by_worker(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return tf.data.Dataset.range(40).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4).repeat()

    per_worker = strategy.distribute_datasets_from_function(dataset_fn)
    # Traced once (as TF does); the worker's index is a tensor filled in on each worker.
    assert len(contexts) == 1 and contexts[0][0] == 2 and tf.is_tensor(contexts[0][1])
    iterator = iter(per_worker)

    @tf.function
    def take(it):
        return next(it)

    batches = [strategy.schedule(take, args=(iterator,)) for _ in range(20)]
    batches = [b.result(60) for b in batches]
    # Sharded by worker: each batch comes from one shard (all even or all
    # odd); without sharding a batch would be four consecutive numbers.
    assert all(len(set((b % 2).tolist())) == 1 for b in batches)
    assert {int(b[0] % 2) for b in batches} == {0, 1}  # both workers served


def test_dataset_is_cloned_to_every_worker(strategy):
    dataset = tf.data.Dataset.range(5).repeat()
    iterator = iter(strategy.distribute_datasets_from_function(dataset))

    @tf.function
    def take(it):
        return next(it)

    values = [strategy.schedule(take, args=(iterator,)).result(60) for _ in range(12)]
    # Two independent clones of 0,1,2,3,4,...: each value appears at most
    # twice per cycle, and both workers served.
    assert set(int(v) for v in values) <= {0, 1, 2, 3, 4}
    assert all(w["done"] > 0 for w in strategy.stats()["workers"])


def test_per_worker_resource_resolves_to_the_executing_worker(strategy):
    counters = strategy.create_per_worker_resource(lambda: tf.Variable(0, dtype=tf.int64))
    assert [("/job:worker/replica:0/task:%d" % i) in counters.value(i).device for i in range(2)] == [True, True]

    @tf.function
    def bump(counter):
        counter.assign_add(1)
        return counter.read_value()

    for _ in range(50):
        strategy.schedule(bump, args=(counters,))
    strategy.join()
    per_worker = [int(counters.value(i).numpy()) for i in range(2)]
    assert sum(per_worker) == 50


def test_schedule_from_many_threads(strategy):
    with strategy.scope():
        hits = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def hit():
        hits.assign_add(1)
        return hits.read_value()

    results = []
    lock = threading.Lock()

    def producer():
        local = [strategy.schedule(hit) for _ in range(100)]
        with lock:
            results.extend(local)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    strategy.join()
    assert len(results) == 400
    # Every future resolved to a count read after its own increment (the add and
    # the read are two ops, so concurrent closures may read the same count).
    values = [int(f.result(0)) for f in results]
    assert all(1 <= v <= 400 for v in values) and max(values) == 400
    assert hits.numpy() == 400  # no increment lost or doubled


def test_bad_fn_and_arguments_raise_type_error_at_schedule(strategy):
    with pytest.raises(TypeError, match="fn"):
        strategy.schedule(42)
    with pytest.raises(TypeError, match="args"):
        strategy.schedule(lambda x: x, args=5)
    with pytest.raises(TypeError, match="kwargs"):
        strategy.schedule(lambda x: x, args=(1,), kwargs=[1])

    @tf.function
    def one_arg(x):
        return x

    with pytest.raises(TypeError, match="one_arg"):
        strategy.schedule(one_arg, args=(1, 2))

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
    def typed(x):
        return x

    with pytest.raises(TypeError, match="typed"):
        strategy.schedule(typed, args=(tf.constant([1, 2, 3]),))
    assert strategy.stats()["unfinished"] == 0


def test_an_error_of_the_functions_own_code_is_raised_as_a_local_call_raises_it(strategy):
    """Tracing fails in the function's body: its own error (a ValueError here, as a local call
    raises it), with a note naming the function; it was a TypeError saying schedule()'s arguments
    did not match. A mismatch of the arguments themselves stays that TypeError (test above)."""

    @tf.function
    def misshapen(x):
        return tf.reshape(x, [2])

    with pytest.raises(ValueError, match="reshape") as raised:
        strategy.schedule(misshapen, args=(tf.zeros([3]),))
    assert any("'misshapen' was traced for schedule()" in note for note in raised.value.__notes__)
    with pytest.raises(ValueError, match="reshape"):
        misshapen(tf.zeros([3]))
    assert strategy.stats()["unfinished"] == 0

def test_variable_outside_scope_works_with_one_warning(strategy):
    outside = tf.Variable(5.0, name="made_outside")

    @tf.function
    def read():
        return outside + 1.0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = strategy.schedule(read).result(60)
        second = strategy.schedule(read).result(60)
    assert first == second == 6.0
    relevant = [w for w in caught if "made_outside" in str(w.message)]
    assert len(relevant) == 1
    assert "strategy.scope()" in str(relevant[0].message)


def test_stats_report_per_worker_counts_and_latency(strategy):
    @tf.function
    def noop():
        return tf.constant(1)

    strategy.join()
    [strategy.schedule(noop) for _ in range(20)]
    strategy.join()
    stats = strategy.stats()
    assert stats["queue_depth"] == 0 and stats["unfinished"] == 0
    for w in stats["workers"]:
        assert w["in_flight"] == 0
        assert w["latency_mean_s"] > 0 and w["latency_p99_s"] >= w["latency_mean_s"] * 0.5
    assert stats["dispatcher_threads_alive"] == 2 * stats["pipeline_depth"]


def lasting_threads():
    # Probes come and go by design; a fork server's reader is the clusters' (`_threads`).
    return sorted(t.name for t in threading.enumerate()
                  if not t.name.startswith("psclient-probe") and not cluster_owned(t))


@pytest.mark.long
def test_ten_thousand_closures_no_growth_in_memory_or_threads(strategy):
    import psutil

    with strategy.scope():
        acc = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def inc():
        acc.assign_add(1)
        return acc.read_value()

    def batch(n):
        futures = [strategy.schedule(inc) for _ in range(n)]
        strategy.join()
        assert all(f.done() for f in futures)

    batch(1000)  # warm up caches and allocator
    gc.collect()
    proc = psutil.Process()
    rss0, threads0 = proc.memory_info().rss, lasting_threads()
    batch(10_000)
    gc.collect()
    rss1, threads1 = proc.memory_info().rss, lasting_threads()
    assert acc.numpy() == 11_000
    assert threads1 == threads0
    # Health probes come and go, at most one per task at a time.
    probes = [t for t in threading.enumerate() if t.name.startswith("psclient-probe")]
    assert len(probes) <= strategy.num_workers + strategy.num_ps
    growth_mb = (rss1 - rss0) / 2**20
    print(f"RSS growth over 10,000 closures: {growth_mb:.1f} MiB")
    assert growth_mb < 64, f"coordinator memory grew by {growth_mb:.1f} MiB"
