"""A Ctrl-C during `fit` on the cluster stops it after that step, even when Python dropped the
KeyboardInterrupt where it landed (psclient/_keras/interrupts.py): a callback sends the process
SIGINT and drops the exception, as a destructor would."""

import os
import signal
import time

import numpy as np
import pytest

keras = pytest.importorskip("keras")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(5)
X = _RNG.standard_normal((64, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


class _DropsCtrlC(keras.callbacks.Callback):
    """Presses Ctrl-C during step `at` and drops the KeyboardInterrupt it raises there."""

    def __init__(self, at):
        super().__init__()
        self.at, self.begun, self.dropped = at, [], False

    def on_train_batch_begin(self, batch, logs=None):
        self.begun.append(batch)
        if batch == self.at:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # raised here, at once...
            except KeyboardInterrupt:
                self.dropped = True  # ...and dropped


def test_a_ctrl_c_dropped_during_fit_stops_it_after_that_step(strategy):
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip(f"this process has its own SIGINT handler ({signal.getsignal(signal.SIGINT)!r}): "
                    "fit then leaves it alone, by design")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pressed = _DropsCtrlC(at=2)
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, batch_size=8, epochs=3, callbacks=[pressed], verbose=0)
    assert pressed.dropped and pressed.begun == [0, 1, 2]  # no step begun after the one interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0)  # the strategy trains on
    assert np.isfinite(history.history["loss"][0])


def test_a_process_with_its_own_sigint_handler_keeps_it(strategy):
    calls = []

    def own(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, own)
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        seen = []

        class Looks(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                seen.append(signal.getsignal(signal.SIGINT))

        model.fit(X, Y, batch_size=16, epochs=1, callbacks=[Looks()], verbose=0)
        assert seen and all(handler is own for handler in seen), seen  # during fit: the process's own
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
