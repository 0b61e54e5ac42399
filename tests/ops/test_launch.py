"""`psclient launch` with real processes: a LocalCluster, a script, an evaluator, signals."""

import importlib.util
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from _paths import ROOT_STR

EXAMPLE = os.path.join(ROOT_STR, "examples", "launch_train.py")
PY = sys.executable
LINE_TIMEOUT = 120  # Cluster start-up plus TensorFlow imports, on a busy 2-core machine.

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def child_env():
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    return env


class Launch:
    """A `psclient launch` process in its own session, its output read line by line."""

    def __init__(self, *args):
        self.process = subprocess.Popen(
            [PY, "-m", "psclient", "launch", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT_STR, env=child_env(), start_new_session=True,
        )
        self.lines = []
        self._queue = queue.Queue()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text, timeout=LINE_TIMEOUT, count=1):
        """The `count`-th line, read so far or from now on, that contains `text`."""
        # Processes print concurrently: the line may already have been read.
        if sum(text in line for line in self.lines) >= count:
            return [line for line in self.lines if text in line][count - 1]
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line with {text!r} within {timeout} s; output:\n{self.output()}")
            if line is None:
                pytest.fail(f"launch exited before printing {text!r}; output:\n{self.output()}")
            self.lines.append(line)
            if text in line and sum(text in seen for seen in self.lines) >= count:
                return line

    def output(self):
        return "".join(self.lines)

    def finish(self, timeout=LINE_TIMEOUT):
        """Waits for the exit (killing the session on timeout) and the reader; returns the code."""
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self._reader.join(timeout=timeout)
            while not self._queue.empty():
                line = self._queue.get()
                if line is not None:
                    self.lines.append(line)


def wait_gone(processes, timeout=30):
    gone, alive = psutil.wait_procs(processes, timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def descendants(pid):
    return psutil.Process(pid).children(recursive=True)


def test_ctrl_c_forwards_tears_down_and_leaves_no_process():
    script = "import time; print('training', flush=True); time.sleep(600)"
    evaluator = f"{PY} -c \"import time; print('evaluating', flush=True); time.sleep(600)\""
    launch = Launch("--workers", "2", "--ps", "1", "--evaluator", evaluator, "--", PY, "-c", script)
    try:
        launch.wait_for("chief     | training")
        launch.wait_for("evaluator | evaluating")
        children = descendants(launch.process.pid)
        commands = [" ".join(p.cmdline()) for p in children]
        assert sum("psclient serve --job" in c for c in commands) == 3, commands  # and a fork server, maybe
        assert any("time.sleep(600)" in c for c in commands)
        launch.process.send_signal(signal.SIGINT)
        code = launch.finish()
    finally:
        launch.finish()
    wait_gone(children)
    out = launch.output()
    assert "SIGINT: forwarded to the script and the evaluator" in out
    assert code == 130, out  # The script died of the forwarded SIGINT (KeyboardInterrupt).
    assert "accept unauthenticated RPCs" in out


def test_restart_failed_restarts_a_killed_worker(tmp_path):
    go = tmp_path / "go"
    script = (f"import os, sys, time; print('waiting', flush=True)\n"
              f"deadline = time.monotonic() + 200\n"
              f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline: time.sleep(0.1)\n"
              f"sys.exit(7)")
    launch = Launch("--workers", "1", "--ps", "1", "--restart-failed", "--", PY, "-c", script)
    try:
        launch.wait_for("chief     | waiting")
        (worker,) = [p for p in descendants(launch.process.pid) if "--job worker" in " ".join(p.cmdline())]
        worker.kill()
        launch.wait_for("worker:0 exited; restarting it (1/3)")
        launch.wait_for("worker:0  | psclient serve: worker:0 ready at", count=2)
        new = [p for p in descendants(launch.process.pid) if "--job worker" in " ".join(p.cmdline())]
        assert [p.pid for p in new] != [worker.pid] and len(new) == 1
        go.write_text("")
        assert launch.finish() == 7, launch.output()  # The script's own exit status.
    finally:
        launch.finish()
    assert "the script exited with status 7" in launch.output()


def load_example():
    spec = importlib.util.spec_from_file_location("launch_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
@pytest.mark.timeout(420)
def test_training_with_an_evaluator_matches_direct_evaluation(tmp_path):
    ckpts = tmp_path / "ckpts"
    evaluator = shlex.join([
        PY, "-m", "psclient", "evaluate", "--checkpoint-dir", str(ckpts), "--model", f"{EXAMPLE}:model",
        "--data", f"{EXAMPLE}:data", "--poll-interval", "0.1", "--idle-timeout", "300",
    ])
    launch = Launch("--workers", "2", "--ps", "1", "--evaluator", evaluator, "--",
                    PY, EXAMPLE, "--checkpoint-dir", str(ckpts), "--epochs", "3", "--steps-per-epoch", "8")
    try:
        code = launch.finish(timeout=360)
    finally:
        launch.finish()
    out = launch.output()
    assert code == 0, out
    # The evaluator stopped by itself at the final marker, before launch's timeout.
    assert "evaluator | psclient evaluate: stopping after" in out and "the final checkpoint ckpt-3 is done" in out, out
    assert "the evaluator exited with status 0" in out, out
    assert "chief     | training done" in out

    records = [json.loads(line) for line in (ckpts / "eval" / "evaluations.jsonl").read_text().splitlines()]
    assert records and records[-1]["checkpoint"] == "ckpt-3"
    assert records[-1]["step"] == 24  # The optimizer's iterations: 3 epochs x 8 steps.
    import tensorflow as tf

    example = load_example()
    x, y = example.data()
    for record in records:
        model = example.model()
        tf.train.Checkpoint(model=model).read(str(ckpts / record["checkpoint"])).expect_partial()
        direct = model.evaluate(x, y, verbose=0, return_dict=True)
        assert record["metrics"] == pytest.approx({k: float(v) for k, v in direct.items()}, rel=1e-5), record
