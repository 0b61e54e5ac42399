"""Child process of `test_keras_fit_starts_while_a_worker_hangs`: Keras fit (with validation),
evaluate and predict, each started while a worker is SIGSTOPped; prints one JSON line.

A process of its own: what waited for the hung worker were ops and functions of kinds the
process had not run yet (TF registers each new kind on every task), which earlier tests in
the suite's process would already have registered.
"""

import json
import sys
import time

import keras
import numpy as np
from _heartbeat import Heartbeat
from _stopped import resume_later

import psclient

#: How long the worker stays stopped at most (then the watchdog resumes it).
WATCHDOG_S = 120


def stopped_now(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP): its state in /proc is T."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def main() -> None:
    hang_timeout = float(sys.argv[1])
    with psclient.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=hang_timeout)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        pid = cluster.pid("worker", 2)
        result = {}
        cluster.stop("worker", 2)
        stop_watchdog = resume_later(pid, WATCHDOG_S)
        try:
            with Heartbeat() as beat:
                for name, call in [
                    ("fit", lambda: model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=8,
                                              validation_data=(x, y), verbose=0).history),
                    ("evaluate", lambda: model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)),
                    ("predict", lambda: model.predict(x, batch_size=8, verbose=0).shape),
                ]:
                    start = time.monotonic()
                    output = call()
                    result[name] = {"seconds": round(time.monotonic() - start, 2),
                                    "worker_still_stopped": stopped_now(pid), "output": str(output)}
            result["longest_stall_s"] = beat.longest
        finally:
            cluster.resume("worker", 2)
            stop_watchdog()
        result["iterations"] = int(model.optimizer.iterations.numpy())
        strategy.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
