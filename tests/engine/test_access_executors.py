"""psclient's reads and writes of ps state (`ps_state.on_ps`) go through an executor of the calling
thread's own, not TF's default one that every thread shares.

On the shared default executor the ops to one task go down one stream, and an error there
reaches whichever thread's op comes next: in a seeded chaos plan (seed 500, docs/chaos.md) a
dynamic table's stats read made by one thread while its function was not yet registered on a ps
failed a `fit`'s metric read in another thread with that error, and the `fit` with it. The
error's way through TF cannot be made to happen on demand here; what is checked is that each
thread's accesses use an executor of their own, made once a thread, its error cleared after a
failed access, and the thread's executor restored afterwards (no cluster: eager ops run locally).
The threads psclient starts for long TF work do the same: an export's thread, the serving deltas'
writer (the recovery thread's steps: tests/engine/test_engine_edge.py).
"""

import threading

import pytest
import tensorflow as tf

from psclient._coordinator import ps_state
from psclient._tf import executors


class _Executors:
    """Counts the executors made and remembers which one each access ran under."""

    def __init__(self, monkeypatch):
        self.made, self.cleared, self.used = [], [], []
        stock_new, stock_scope = executors.new_call_executor, executors.executor_scope
        outer = self

        class Recorded:
            def __init__(self, executor):
                self.executor = executor

            def handle(self):
                return self.executor.handle()

            def clear_error(self):
                outer.cleared.append(self)
                self.executor.clear_error()

        def new_call_executor(streaming=None):
            made = Recorded(stock_new(streaming=streaming))
            self.made.append((threading.get_ident(), streaming, made))
            return made

        def executor_scope(executor):
            self.used.append((threading.get_ident(), executor))
            return stock_scope(executor.executor if isinstance(executor, Recorded) else executor)

        monkeypatch.setattr(executors, "new_call_executor", new_call_executor)
        monkeypatch.setattr(executors, "executor_scope", executor_scope)
        monkeypatch.setattr(executors, "_thread_executors", threading.local())  # none made yet


@pytest.fixture
def recorded(monkeypatch):
    return _Executors(monkeypatch)


def test_each_thread_accesses_through_one_unary_executor_of_its_own(recorded):
    assert float(ps_state._on_own_executor(lambda: tf.constant(2.0) * 3)) == 6.0
    ps_state._on_own_executor(lambda: tf.constant(1.0))
    results = []
    other = threading.Thread(target=lambda: results.append(float(ps_state._on_own_executor(lambda: tf.constant(5.0)))))
    other.start()
    other.join(60)
    assert results == [5.0]
    assert len(recorded.made) == 2  # one for this thread (used twice), one for the other
    assert {ident for ident, _, _ in recorded.made} == {threading.get_ident(), other.ident}
    assert all(streaming is False for _, streaming, _ in recorded.made)  # unary: a dead task's error comes back
    mine = [made for ident, _, made in recorded.made if ident == threading.get_ident()][0]
    assert [executor for ident, executor in recorded.used if ident == threading.get_ident()] == [mine, mine]


def test_a_failed_access_clears_its_executors_error_and_the_next_one_runs(recorded):
    def fails():
        return tf.debugging.assert_equal(tf.constant(1), tf.constant(2), message="deliberate")

    with pytest.raises(tf.errors.InvalidArgumentError, match="deliberate"):
        ps_state._on_own_executor(fails)
    assert len(recorded.cleared) >= 1
    assert float(ps_state._on_own_executor(lambda: tf.constant(4.0))) == 4.0


def test_the_threads_own_ops_run_as_before_after_an_access(recorded):
    ps_state._on_own_executor(lambda: tf.constant(1.0))
    assert float(tf.constant(3.0) + 1) == 4.0  # the thread's executor restored by the scope's end


def _on_own_executor_now() -> bool:
    """Whether this thread's ops go through its own executor now (`executors.on_thread_executor`'s
    executor in force: the innermost of its `executor_scope`s), read from psclient's own records."""
    own = getattr(executors._thread_executors, "executor", None)
    scopes = getattr(executors._scopes, "stack", [])
    return own is not None and bool(scopes) and scopes[-1][1] is own


def test_an_exports_writes_run_through_an_executor_of_the_export_threads_own():
    from psclient._keras import bounded_export

    seen = []

    def write(publication):
        seen.append((threading.current_thread().name, _on_own_executor_now()))
        return float(tf.constant(2.0) + 1)  # an op through it runs

    assert bounded_export.export_bounded(write, num_ps=0, hang_timeout=5.0, describe_ps=str) == 3.0
    assert seen == [(bounded_export.THREAD_NAME, True)]
    assert not _on_own_executor_now()  # the caller's thread untouched


def test_a_serving_delta_is_written_through_an_executor_of_the_writer_threads_own(tmp_path):
    from psclient._keras.servable import _DeltaChain

    class Cut:
        """Stands for a `DeltaCut` (no cluster here): records where its write ran."""

        def __init__(self):
            self.seen = []

        def write(self, cut, directory, after_part):
            self.seen.append((threading.current_thread().name, _on_own_executor_now()))
            return {"tables": [], "dense": []}

    chain = _DeltaChain(str(tmp_path), [])
    chain.cut, chain.position = Cut(), (1, 0)
    chain.submit(object(), {"seconds": 0.0})
    chain.stop_writer()
    assert chain.failures == []
    assert [name.startswith("psclient-serving-deltas") for name, _ in chain.cut.seen] == [True]
    assert [inside for _, inside in chain.cut.seen] == [True]
