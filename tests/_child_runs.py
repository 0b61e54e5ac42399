"""Child coordinator processes: run one, read its JSON events, SIGKILL it on cue; or run a script
whose last JSON line is its result (for what TF allows once per process, such as connecting)."""

import json
import os
import signal
import subprocess
import sys

from _paths import ROOT_STR


def run_script_for_json(script, cwd, timeout=300):
    """Run the Python source `script` in a child process (psclient importable from this checkout);
    return the last JSON line it printed. Fails with its stderr's tail if it exits non-zero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT_STR, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1])


def run_and_read_events(argv, stderr_path, kill_when=None, timeout=400, env=None):
    """Run `argv`, collecting the JSON lines it prints; SIGKILL it as soon as `kill_when(events)` holds.

    Returns (exit code, events, the tail of its stderr).
    """
    stderr = open(stderr_path, "w+")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    events = []
    try:
        for line in process.stdout:
            if line.startswith("{"):
                events.append(json.loads(line))
                if kill_when is not None and kill_when(events):
                    process.send_signal(signal.SIGKILL)  # mid-run, work in flight
                    break
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()
        stderr.seek(0)
        tail = stderr.read()[-3000:]
        stderr.close()
    return process.returncode, events, tail
