"""Every name a benchmark or example imports from psclient exists.

Benchmarks reach into private modules (they measure the parts), and they
run by hand, not in the suite: a renamed function would only show when
someone next runs them. The imports are read from the source (also those
inside functions), so nothing here starts a cluster.
"""

import ast
import importlib

import pytest

from _paths import ROOT

SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])


def psclient_imports(path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "psclient":
            for alias in node.names:
                yield node.module, alias.name, node.lineno


@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_the_names_it_imports_from_psclient_exist(path):
    missing = []
    for module, name, line in psclient_imports(path):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"{path.name} imports names psclient no longer has: {missing}"


def test_scripts_are_found():
    assert len(SCRIPTS) > 10


def test_chaos_seeds_that_hold_no_seed_are_refused_by_name():
    """`--seeds 0` once ran no plan and printed an empty summary: refused now, with what it takes."""
    import subprocess
    import sys

    chaos_plans = _chaos_plans()
    assert chaos_plans.parse_seeds("3") == [0, 1, 2]
    assert chaos_plans.parse_seeds("0-0") == [0] and chaos_plans.parse_seeds("2-4") == [2, 3, 4]
    assert chaos_plans.parse_seeds("1,7") == [1, 7]
    for text in ("0", "5-3", "x", ","):
        with pytest.raises(ValueError, match=f"--seeds holds no seed: received {text!r}"):
            chaos_plans.parse_seeds(text)
    # The script itself stops before it imports TensorFlow, naming the argument.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seeds", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--seeds holds no seed: received '0'" in done.stderr, done


def _chaos_plans():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("chaos_plans")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_chaos_plans_count_the_warning_of_a_closure_traced_again():
    """The seeds' `traced_again_warnings` count what `parts.Prepare` logs, read from its own record."""
    import logging
    from types import SimpleNamespace

    from psclient._coordinator.parts import Prepare

    class StaleTracer:
        def current(self, closure):
            return True  # the closure's trace is older than the newest ps recovery

    chaos_plans = _chaos_plans()
    logged = chaos_plans._Logged()
    logger = logging.getLogger("psclient")
    logger.addHandler(logged)
    tracer = StaleTracer()
    closure = SimpleNamespace(per_worker=False, fn=len, args=("ab",), kwargs={})
    try:
        assert Prepare(tracer)(closure, 1) == (len, ("ab",), {})
        Prepare(tracer)(closure, 0)
    finally:
        logger.removeHandler(logged)
    assert logged.traced_again == 2


def test_chaos_plans_take_the_watchdogs_own_pauses_out_of_a_stall():
    chaos_plans = _chaos_plans()
    stalls = [(10.0, 13.0), (20.0, 20.5)]
    assert chaos_plans._without_pauses(stalls, []) == 3.0
    # A dump from 11.0 to 12.8 (the watchdog starts after 1 s of stall): 1.2 s of the stall were not.
    assert abs(chaos_plans._without_pauses(stalls, [(11.0, 12.8)]) - 1.2) < 1e-9
    assert abs(chaos_plans._without_pauses(stalls, [(11.0, 14.0), (40.0, 41.0)]) - 1.0) < 1e-9
    assert chaos_plans._without_pauses([], [(1.0, 2.0)]) == 0.0
    assert chaos_plans._without_pauses([], [], longest=0.15) == 0.15  # no dump: the longest stall itself


def test_a_fixed_chaos_plan_is_read_and_bad_ones_are_refused_by_name(tmp_path):
    import json
    import subprocess
    import sys

    chaos_plans = _chaos_plans()
    good = tmp_path / "plan.json"
    good.write_text(json.dumps([{"at": 12.0, "fault": "kill", "task": "ps:3", "for": 0},
                                {"at": 10.0, "fault": "hang", "task": "worker:1", "for": 5.0}]))
    assert [f["at"] for f in chaos_plans.read_plan(str(good), num_ps=4)] == [10.0, 12.0]  # by time
    (tmp_path / "none.json").write_text("[]")  # a run without faults, not a drawn plan
    assert chaos_plans.read_plan(str(tmp_path / "none.json"), num_ps=4) == []
    bad = {
        "[1]": "fault 0: received 1; expected an object",
        '[{"at": 1, "fault": "kill", "task": "ps:4", "for": 0}]': "received task 'ps:4'; expected 'worker:N'",
        '[{"at": 1, "fault": "stop", "task": "ps:0", "for": 0}]': "received fault 'stop'",
        '[{"at": -1, "fault": "kill", "task": "ps:0", "for": 0}]': "received at -1; expected a number",
        '{"at": 1}': "holds dict; expected a list",
        "[": "is not JSON",
    }
    for text, message in bad.items():
        good.write_text(text)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            chaos_plans.read_plan(str(good), num_ps=4)
    # The script refuses it before it imports TensorFlow or starts a cluster.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seeds", "1", "--ps", "2",
                           "--plan", str(good)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not JSON" in done.stderr, done


def test_chaos_stall_traces_write_the_stacks_of_a_stall_that_holds_the_gil(tmp_path):
    import ctypes
    import threading
    import time

    chaos_plans = _chaos_plans()
    traces = chaos_plans.StallTraces(str(tmp_path / "seed-1" / "traces.txt"), after_s=0.2)
    stop = threading.Event()

    def sample():
        while not stop.wait(0.02):
            traces.arm()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        time.sleep(0.1)
        start = time.monotonic()
        ctypes.PyDLL(None).usleep(1_000_000)  # a C call that keeps the GIL: the sampler cannot wake
        end = time.monotonic()
    finally:
        stop.set()
        sampler.join(10)
    traces.stalled(start, end, start - 5.0, [(start + 0.1, start + 0.3)])
    traces.stalled(end, end + 0.1, start - 5.0, [])  # shorter than after_s: no label
    traces.close()
    text = (tmp_path / "seed-1" / "traces.txt").read_text()
    assert text.count("Timeout (0:00:00.200000)!") >= 2, text
    assert "in test_chaos_stall_traces_write_the_stacks_of_a_stall_that_holds_the_gil" in text
    assert text.count("== stall of") == 1
    assert f"5.00-{end - start + 5.0:.2f} s into the plan, 0.20 s of it in garbage collections" in text


@pytest.mark.parametrize("script, argv", [
    ("step_cpu", ["--configs", "fit_adam_spe1", "--stacks", "psclient,tf"]),
    ("keras_fit", ["--paths", "psclient_keras3,tf_keras_pss"]),
    ("big_model", ["--paths", "psclient,tf_keras_pss"]),
    ("embeddings", []),
])
def test_a_benchmark_whose_anchor_needs_tf_keras_stops_first_where_it_is_missing(script, argv, monkeypatch, capsys):
    """Without tf_keras, every run of TF's stack failed late with a traceback (a new machine's
    step_cpu.py ran psclient's half and printed no ratio): now it stops before any cluster starts."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name, *a))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stopped:
        module.main(argv)
    assert stopped.value.code == 2
    assert "needs tf_keras" in capsys.readouterr().err
    sys.modules.pop(script, None)


def test_the_tf_keras_check_stops_only_a_run_that_needs_it(monkeypatch):
    import argparse
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    common = importlib.import_module("_common")
    parser = argparse.ArgumentParser()
    if importlib.util.find_spec("tf_keras") is not None:  # installed here: needed and there
        assert common.require_tf_keras(parser, True, "an anchor") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name, *a))
    assert common.require_tf_keras(parser, False, "nothing") is None  # missing, not needed
    with pytest.raises(SystemExit):
        common.require_tf_keras(parser, True, "an anchor")


def test_chaos_plans_write_every_threads_stack_when_a_task_is_slow_to_come_back(tmp_path, monkeypatch):
    """--stall-traces: seed 431 waited 75 s for a recovery with nothing in the logs to say where;
    a task not back SLOW_BACK_S after its fault ended now gets every thread's stack written."""
    import time

    chaos_plans = _chaos_plans()
    monkeypatch.setattr(chaos_plans, "SLOW_BACK_S", 0.05)

    class Local:  # a worker that is killed, restarted, and never rejoins
        def is_running(self, job, index):
            return True

        def kill(self, job, index):
            pass

        def restart(self, job, index, timeout):
            pass

        def pid(self, job, index):  # no process to dump (the dump's thread outlives the test)
            return None

    class Strategy:
        def stats(self):
            return {"workers": [{"up": False}], "ps": [{"recoveries": 0}], "completed": 0}

    fault = {"at": 0.0, "fault": "kill", "task": "worker:0", "for": 0.0}
    faults = chaos_plans._Faults(Local(), Strategy(), [fault], time.monotonic(), recovery_timeout=0.5,
                                 num_ps=1, slow_dir=str(tmp_path))
    faults._run(fault)
    assert faults.results[0]["back_after_s"] is None  # never back
    dumped = (tmp_path / "slow-kill-worker0-at-0.00.txt").read_text()
    assert "not back" in dumped and "in _run" in dumped  # the waiting thread's own frame among them
