"""What the published-examples children share: run each example with local Keras, then on the cluster.

usage (of a child): python CHILD.py CLUSTER_JSON WORK_DIR; prints one JSON line {"local": ..., "cluster": ...}.
"""

import json
import sys
import time

import numpy as np

import psclient


def run_examples(tag, scope, examples):
    """Every example of `examples` (name -> maker) once, its model built in `scope()`:
    {name: {"history", "use", "on_ps", "seconds"} or {"error", "seconds"}}."""
    results = {}
    for name, make in examples.items():
        started = time.perf_counter()
        try:
            with scope():
                model, fit, use = make()
            history = fit()
            results[name] = {"history": {key: [float(v) for v in values] for key, values in history.history.items()},
                             "use": use(),
                             "on_ps": all("/job:ps" in v._value.device for v in model.variables) if tag == "cluster" else None}
        except Exception as error:  # noqa: BLE001 - reported per example by the test, the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)  # where the module's time goes
    return results


def digits_data():
    """scikit-learn's bundled 8x8 digits (offline): images [n, 8, 8, 1] in [0, 1], labels, flat features."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return {"digits": np.expand_dims(bunch.images.astype("float32") / 16.0, -1), "labels": bunch.target,
            "features": bunch.data.astype("float32") / 16.0}


def run_locally_then_on_the_cluster(examples_of, data):
    """`examples_of(tag, data, work)` run with local Keras, then on the cluster (argv: CLUSTER_JSON WORK_DIR);
    prints one JSON line {"local": ..., "cluster": ...}."""
    jobs, work = json.loads(sys.argv[1]), sys.argv[2]
    import contextlib

    results = {"local": run_examples("local", contextlib.nullcontext, examples_of("local", data, work))}
    strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_dict(jobs))
    try:
        results["cluster"] = run_examples("cluster", strategy.scope, examples_of("cluster", data, work))
    finally:
        strategy.shutdown()
    print(json.dumps(results), flush=True)


def run_children(children, local_cluster, work) -> dict:
    """Each child script (`run_locally_then_on_the_cluster`) run on `local_cluster` in `work`, its
    examples' results merged: {"local": {name: ...}, "cluster": {name: ...}} (for the tests)."""
    import os
    import subprocess

    from _paths import ROOT_STR

    # No "chief": the test process may hold that port already (TF never releases it).
    jobs = {job: list(addresses) for job, addresses in local_cluster.cluster.jobs.items() if job != "chief"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT_STR, os.environ.get("PYTHONPATH", "")]))
    results = {"local": {}, "cluster": {}}
    for child in children:
        run = subprocess.run([sys.executable, child, json.dumps(jobs), str(work)], cwd=work, env=env,
                             capture_output=True, text=True, timeout=900)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        assert run.returncode == 0 and lines, f"{child} failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
        for tag, ran in json.loads(lines[-1]).items():
            results[tag].update(ran)
    return results


def both_runs(examples, name):
    """(local, cluster) results of example `name`: neither failed, the cluster's variables all on
    the ps tasks, the same logs by name."""
    local, cluster = examples["local"][name], examples["cluster"][name]
    assert "error" not in local, local["error"]
    assert "error" not in cluster, cluster["error"]
    assert cluster["on_ps"], "the model's variables are not all on the ps tasks"
    assert set(cluster["history"]) == set(local["history"])  # the same logs, by name
    return local, cluster
