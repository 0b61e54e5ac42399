"""How long a first trace stalls the coordinator while one worker hangs.

One measurement behind docs/development.md (a hung task and a first trace): a worker
is SIGSTOPped for `--hang` seconds (resumed by a separate process: a thread of
the coordinator could not run during a stall), then a new `tf.function` is
traced and called on two other workers. A heartbeat thread in the coordinator
records its longest gap: the time the process let no Python thread run.

Modes, each in its own coordinator process with its own LocalCluster (TF's
eager context is process-wide):

- `psclient`: a psclient strategy as it runs today (streaming enqueue off at
  pipeline_depth 1, as TF's ParameterServerStrategy): `schedule` of a new
  function on worker 0, then worker 1.
- `streaming-trace`: TF's gRPC client with streaming enqueue on, the default
  executor without it, and the trace made under a streaming executor of its
  own (so the function's registration on every task is not waited for); then
  calls on worker 0 and worker 1 under a non-streaming executor.
- `streaming-trace-threads`: the same trace, then the calls on worker 0 and
  worker 1 made from two threads, each with a non-streaming executor of its
  own (as one dispatcher thread per worker would), one after the other.

Prints one JSON object: per mode, seconds until the trace returned, until each
call returned, the longest heartbeat gap, and (streaming) how many calls TF
refused with NotFoundError because the streamed registration had not arrived.

    python benchmarks/first_trace_stall.py [--hang 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Heartbeat, environment, log, print_json, quiet_tf_env  # noqa: E402

MODES = ("psclient", "streaming-trace", "streaming-trace-threads")


def _resume_later(pid: int, seconds: float) -> subprocess.Popen:
    code = f"import os, signal, time; time.sleep({seconds}); os.kill({pid}, signal.SIGCONT)"
    return subprocess.Popen([sys.executable, "-c", code])


def _child(mode: str, hang: float) -> dict:
    if mode.startswith("streaming-trace"):
        os.environ["TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"] = "True"
    import portpicker
    import tensorflow as tf
    from tensorflow.python.eager import context, executor

    import psclient

    result: dict = {"mode": mode, "hang_s": hang}
    with psclient.LocalCluster(num_workers=3, num_ps=1, start_timeout=300, start_method="spawn") as local:
        if mode == "psclient":
            strategy = psclient.ParameterServerStrategy(local.cluster, hang_timeout=3)
            with strategy.scope():
                v = tf.Variable(0.0)
        else:
            ctx = context.context()
            ctx._config = ctx.config  # noqa: SLF001 - only place to set it before initialization
            ctx._config.experimental.disable_eager_executor_streaming_enqueue = True  # noqa: SLF001
            spec = local.cluster.training_spec()
            spec["chief"] = [f"localhost:{portpicker.pick_unused_port()}"]
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
            tf.config.experimental_connect_to_cluster(resolver, job_name="chief", make_master_device_default=False)
            with tf.device("/job:ps/replica:0/task:0"):
                v = tf.Variable(0.0)

        @tf.function
        def warm():
            v.assign_add(1.0)
            return v.read_value()

        @tf.function
        def fresh():
            v.assign_add(2.0)
            return v.read_value() * 3

        def call_on(worker, fn):
            if mode == "psclient":
                strategy.schedule(fn)  # runs on any free worker; warm() first, as a user would
                return strategy.join()
            # A streamed registration can arrive after the call: TF answers
            # NotFoundError then; call again (bounded), counting the refusals.
            deadline = time.monotonic() + 30
            while True:
                try:
                    with tf.device(f"/job:worker/replica:0/task:{worker}"):
                        return fn().numpy()
                except tf.errors.NotFoundError:
                    result["not_found_retries"] = result.get("not_found_retries", 0) + 1
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

        call_on(0, warm)
        hung = local.pid("worker", 2)
        os.kill(hung, signal.SIGSTOP)
        resumer = _resume_later(hung, hang)
        try:
            with Heartbeat() as beat:
                start = time.monotonic()
                if mode == "psclient":
                    strategy.schedule(fresh)  # traces here
                    result["trace_s"] = time.monotonic() - start
                    strategy.join()
                    result["first_call_s"] = time.monotonic() - start
                    strategy.schedule(fresh)
                    strategy.join()
                    result["second_call_s"] = time.monotonic() - start
                else:
                    # Executors are kept referenced: a dropped Executor deletes its C++ executor.
                    streaming = executor.new_executor(enable_async=False, enable_streaming_enqueue=True)
                    unary = executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
                    old = ctx.executor
                    ctx.executor = streaming
                    try:
                        fresh.get_concrete_function()
                    finally:
                        ctx.executor = old
                    result["trace_s"] = time.monotonic() - start
                    if mode == "streaming-trace":
                        ctx.executor = unary
                        call_on(0, fresh)
                        result["first_call_s"] = time.monotonic() - start
                        call_on(1, fresh)
                        result["second_call_s"] = time.monotonic() - start
                    else:
                        def in_thread(worker, key):
                            mine = executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
                            ctx.executor = mine  # this thread's own executor
                            call_on(worker, fresh)
                            result[key] = time.monotonic() - start

                        for worker, key in ((0, "first_call_s"), (1, "second_call_s")):
                            thread = threading.Thread(target=in_thread, args=(worker, key))
                            thread.start()
                            thread.join()
            result["longest_stall_s"] = beat.longest
        finally:
            resumer.wait()
        if mode == "psclient":
            strategy.shutdown()
    return {k: round(x, 3) if isinstance(x, float) else x for k, x in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hang", type=float, default=8.0, help="seconds the worker stays stopped")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.hang)), flush=True)
        return
    runs = []
    for mode in MODES:
        log(f"mode {mode}: worker 2 stopped for {args.hang} s")
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--hang", str(args.hang)],
            env=quiet_tf_env(), stdout=subprocess.PIPE, check=True, text=True, timeout=600,
        ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print_json({"benchmark": "first_trace_stall", "environment": environment(sys.argv), "runs": runs})


if __name__ == "__main__":
    main()
