"""`python -m psclient serve`: one real task process per test, ended by signals."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

import portpicker
import pytest

from _paths import ROOT_STR

# TensorFlow's import takes seconds; on a busy machine (load 20 on 2 cores) it
# took over 60 s: a limit, not the time it takes.
START_TIMEOUT = 180

pytestmark = pytest.mark.timeout(2 * START_TIMEOUT)


def child_env(tf_config=None):
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def psclient(*args, env=None, timeout=60):
    """Runs a `psclient` command that is expected to exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "psclient", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT_STR, env=env or child_env(),
    )


class Serve:
    """A `psclient serve` process whose output is read line by line by a thread."""

    def __init__(self, *args, env=None, pass_fds=()):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "psclient", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=ROOT_STR, env=env or child_env(), pass_fds=pass_fds,
        )
        self.lines = []
        self._queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)  # EOF

    def wait_for(self, text, timeout=START_TIMEOUT):
        """Returns the first line that contains `text`; fails at EOF or timeout."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no line with {text!r} within {timeout} s; output:\n{self.output()}")
            if line is None:
                pytest.fail(f"exited before printing {text!r}; output:\n{self.output()}")
            self.lines.append(line)
            if text in line:
                return line

    def output(self):
        return "".join(self.lines)

    def finish(self, timeout=30):
        """Waits for the exit (killing on timeout) and the reader; returns the code."""
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._reader.join(timeout=timeout)
            while not self._queue.empty():
                line = self._queue.get()
                if line is not None:
                    self.lines.append(line)


def cluster_jobs(chief=True):
    """A worker and a ps on free ports of 127.0.0.1, and the coordinator's address (unless not `chief`)."""
    ports = [portpicker.pick_unused_port() for _ in range(3)]
    jobs = {"worker": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"]}
    if chief:
        jobs["chief"] = [f"127.0.0.1:{ports[2]}"]
    return jobs


def write_json(tmp_path, obj):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "sig, tf_config_style, options",
    [(signal.SIGTERM, False, []), (signal.SIGINT, True, ["--allow-any-host"])],
    ids=["SIGTERM-jobs-file-closed", "SIGINT-tf-config-file-any-host"],
)
def test_serve_from_a_cluster_file_until_a_signal(tmp_path, sig, tf_config_style, options):
    jobs = cluster_jobs()
    path = write_json(tmp_path, {"cluster": jobs} if tf_config_style else jobs)
    serve = Serve("--job", "worker", "--index", "0", "--cluster", path, *options)
    ready = serve.wait_for("ready at")
    assert ready.strip() == f"psclient serve: worker:0 ready at {jobs['worker'][0]} (pid {serve.process.pid})"
    assert "WARNING: TensorFlow task servers accept unauthenticated RPCs" in serve.output()
    if options:  # open: the warning says to whom
        assert "With --allow-any-host this task's port is open to EVERY host" in serve.output()
        assert "drops every packet" not in serve.output()
    else:  # closed by default: the cluster is all 127.0.0.1, so loopback alone gets in
        assert "drops every packet that comes neither over loopback nor from the cluster's own hosts " \
               "(127.0.0.1)" in serve.output()
        assert "--allow-any-host" not in serve.output()
    with socket.create_connection(("127.0.0.1", int(jobs["worker"][0].split(":")[1])), timeout=10):
        pass
    serve.process.send_signal(sig)
    assert serve.finish() == 0, serve.output()
    assert f"worker:0 stopping on {sig.name}" in serve.output()
    assert serve.output().count("ready at") == 1


@pytest.mark.cluster
def test_serve_from_tf_config_takes_the_task_from_it():
    jobs = cluster_jobs()
    serve = Serve(env=child_env({"cluster": jobs, "task": {"type": "ps", "index": 0}}))
    assert f"ps:0 ready at {jobs['ps'][0]}" in serve.wait_for("ready at")
    serve.process.terminate()
    assert serve.finish() == 0, serve.output()


@pytest.mark.cluster
def test_ready_fd_and_parent_fd(tmp_path):
    path = write_json(tmp_path, cluster_jobs())
    ready_r, ready_w = os.pipe()
    parent_r, parent_w = os.pipe()
    serve = Serve("--job", "ps", "--index", "0", "--cluster", path, "--ready-fd", str(ready_w),
                  "--parent-fd", str(parent_r), pass_fds=(ready_w, parent_r))
    os.close(ready_w)
    os.close(parent_r)
    with os.fdopen(ready_r, "rb") as ready:
        assert ready.read() == b"ready\n"  # Then EOF: the task closed it.
    os.close(parent_w)  # As if this process had died: the task must exit by itself.
    assert serve.finish() == 1, serve.output()
    assert "ps:0 exiting: its parent process is gone" in serve.output()


@pytest.mark.cluster
def test_port_in_use_is_a_clear_error(tmp_path):
    jobs = cluster_jobs()
    port = int(jobs["worker"][0].split(":")[1])
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        serve = Serve("--job", "worker", "--index", "0", "--cluster", write_json(tmp_path, jobs))
        assert serve.finish(timeout=START_TIMEOUT) == 1, serve.output()
    assert f"psclient serve: error: cannot start worker:0 at 127.0.0.1:{port}" in serve.output()
    assert "ready at" not in serve.output()


def test_inter_op_threads_below_2_is_rejected(tmp_path):
    result = psclient("serve", "--job", "worker", "--index", "0", "--inter-op-threads", "1",
                      "--cluster", write_json(tmp_path, cluster_jobs()))
    assert result.returncode == 2
    assert "Invalid value for --inter-op-threads. Received: 1. Expected an integer >= 2" in result.stderr
    assert "deadlocks" in result.stderr


def test_missing_cluster_is_a_clear_error():
    result = psclient("serve", "--job", "worker", "--index", "0")
    assert result.returncode == 2
    assert "No cluster given: pass --cluster FILE.json or set the TF_CONFIG" in result.stderr
    assert "TF_CONFIG is not set" in result.stderr


def test_invalid_cluster_file_quotes_the_bad_part(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text('{"worker": ["127.0.0.1:1"], "ps": [127.0.0.1:2]}')
    result = psclient("serve", "--job", "ps", "--index", "0", "--cluster", str(path))
    assert result.returncode == 2
    assert "is not valid JSON" in result.stderr
    assert '[127.0.0.1:2]' in result.stderr


def test_bad_address_in_tf_config_is_quoted():
    env = child_env({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["localhost"]}, "task": {"type": "ps"}})
    result = psclient("serve", env=env)
    assert result.returncode == 2
    assert "Invalid address for task ps:0. Received: 'localhost'" in result.stderr


def test_index_out_of_range(tmp_path):
    result = psclient("serve", "--job", "worker", "--index", "3", "--cluster", write_json(tmp_path, cluster_jobs()))
    assert result.returncode == 2
    assert "Invalid value for --index. Received: 3. Expected an integer in 0..0" in result.stderr


def test_chief_task_in_tf_config_needs_an_explicit_job():
    result = psclient("serve", env=child_env({"cluster": cluster_jobs(), "task": {"type": "chief"}}))
    assert result.returncode == 2
    assert "runs only 'worker' and 'ps' tasks" in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"]], ids=["psclient", "serve"])
def test_help_shows_an_example(args):
    result = psclient(*args)
    assert result.returncode == 0
    assert "example:" in result.stdout
    assert "psclient serve --job worker --index 0 --cluster cluster.json" in result.stdout


def test_serve_refuses_an_address_that_is_not_on_this_host(tmp_path):
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    jobs = {"worker": ["192.0.2.1:2222"], "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}"]}
    result = psclient("serve", "--job", "worker", "--index", "0", "--cluster", write_json(tmp_path, jobs))
    assert result.returncode == 1, result.stderr
    assert "error: cannot start worker:0 at 192.0.2.1:2222" in result.stderr
    assert "is not an address of this machine" in result.stderr
    assert "ready" not in result.stderr


def test_serve_refuses_a_host_that_does_not_resolve(tmp_path):
    jobs = {"worker": ["no-such-host.invalid:2222"], "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}"]}
    result = psclient("serve", "--job", "worker", "--index", "0", "--cluster", write_json(tmp_path, jobs))
    assert result.returncode == 1, result.stderr
    assert "'no-such-host.invalid' does not resolve" in result.stderr


@pytest.mark.parametrize("options", [[], ["--restrict-to-peers"]], ids=["default", "restrict-to-peers"])
def test_a_cluster_without_the_coordinator_is_refused(tmp_path, options):
    # Closed by default, the task would shut out a coordinator whose host the cluster does not name.
    result = psclient("serve", "--job", "worker", "--index", "0", *options,
                      "--cluster", write_json(tmp_path, cluster_jobs(chief=False)))
    assert result.returncode == 1, result.stderr
    assert "cannot start worker:0 closed to other hosts: the cluster names no coordinator" in result.stderr
    assert 'Add a "chief" job with the coordinator\'s address to the cluster, or pass --allow-any-host' \
        in result.stderr
    assert "ready" not in result.stderr


def test_a_peer_that_does_not_resolve_is_refused(tmp_path):
    jobs = dict(cluster_jobs(), chief=["no-such-host.invalid:2222"])
    result = psclient("serve", "--job", "worker", "--index", "0", "--cluster", write_json(tmp_path, jobs))
    assert result.returncode == 1, result.stderr
    assert "cannot resolve the cluster host 'no-such-host.invalid'" in result.stderr
    assert "ready" not in result.stderr


def test_without_socket_filters_serve_refuses_unless_allow_any_host(tmp_path):
    """Where socket filters do not exist (not Linux; simulated here by making
    `exposure.supported()` say so), the closed default cannot hold: refused."""
    code = ("import sys\n"
            "from psclient._cluster import exposure\n"
            "exposure.supported = lambda: False\n"
            "from psclient._cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    path = write_json(tmp_path, cluster_jobs())
    result = subprocess.run([sys.executable, "-c", code, "serve", "--job", "ps", "--index", "0", "--cluster", path],
                            capture_output=True, text=True, timeout=START_TIMEOUT, cwd=ROOT_STR, env=child_env())
    assert result.returncode == 1, result.stderr
    assert "cannot start ps:0 closed to other hosts: socket filters need Linux" in result.stderr
    assert "Pass --allow-any-host to run it with its port open to every host" in result.stderr
    assert "ready" not in result.stderr


def test_a_task_imports_tensorflow_without_keras_and_keras_still_imports():
    # The task server's TensorFlow import skips the Keras import TensorFlow
    # makes by itself (a third of each task's start-up); nothing else changes.
    code = (
        "import sys\n"
        "from psclient._cluster.server import _import_tensorflow\n"
        "tf = _import_tensorflow()\n"
        "assert tf.constant(2).numpy() == 2 and callable(tf.distribute.Server)\n"
        "print(sorted(m for m in ('keras', 'keras.src.optimizers', 'IPython') if m in sys.modules))\n"
        "import keras\n"
        "print(keras.optimizers.SGD.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_TIMEOUT,
                            cwd=ROOT_STR, env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]", "SGD"]
