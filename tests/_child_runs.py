"""Child coordinator processes for restart tests: run one, read its JSON events, SIGKILL it on cue."""

import json
import signal
import subprocess


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
