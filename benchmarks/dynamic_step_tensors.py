"""The tensors a training step sends between tasks, and the nodes each task runs, from TF's partition graphs.

A multi-device `tf.function` is cut into one graph per task ("partition"); each tensor that one
task's ops produce and another's use becomes a `_Send` there and a `_Recv` here (a rendezvous:
on the gRPC runtime, one RecvTensor call from the receiver). This benchmark traces the training
step of the model of `dynamic_many_tables.py` (N embedding layers, one per feature, Dense(32),
Dense(1), Adagrad) on `LocalCluster(num_workers=1, num_ps=2)`, runs it twice on the worker, and
reads the partition graphs TF's graph dumper writes (`TF_DUMP_GRAPH_PREFIX`,
`TF_DUMP_GRAPH_NAME_FILTER=step`, `TF_DUMP_GRAPH_GROUPS=main`; the graphs as they run, after
every optimisation pass). Per path and task: `nodes`, `sent` and `received` (tensors, by peer task).

Paths: `hashing` (Hashing + Embedding), `dynamic` (DynamicEmbedding with `capacity`), and
`dynamic_policies` (the same with `--min-frequency` and `--ttl-steps`). Each runs in a child
process of its own (the dumper reads its environment once).

Conditionals are lowered into the partition graphs (Switch/Merge): `nodes` counts the branches'
nodes whether a branch runs or not, as TF's executor visits them (the untaken ones as dead).

    python benchmarks/dynamic_step_tensors.py --tables 26 [--min-frequency 2 --ttl-steps 400]

Prints one JSON object. Counts, not times: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, log, print_json  # noqa: E402

PATHS = ("hashing", "dynamic", "dynamic_policies")
TOP_OPS = 15  # op types listed per task, by count


def child(kind: str, args) -> None:
    """Trace and run the step of `kind` twice on worker 0 (the dumper writes its partitions)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import psclient
    from dynamic_embeddings import stream
    from dynamic_many_tables import build

    policy = {"min_frequency": args.min_frequency, "ttl_steps": args.ttl_steps} if kind == "dynamic_policies" else {}
    x = stream(0, 2, args.batch, 50_000).reshape(2, args.batch, -1)[:, :, :args.tables]
    with psclient.LocalCluster(num_workers=1, num_ps=2, start_timeout=300, start_method="spawn") as local:
        strategy = psclient.ParameterServerStrategy(local.cluster)
        try:
            with strategy.scope():
                model = build(keras, kind.replace("_policies", ""), args.tables, args.rows, args.dim, **policy)
            optimizer = model.optimizer

            @tf.function
            def step(ids, labels):
                with tf.GradientTape() as tape:
                    loss = keras.ops.mean(model.loss(labels, model(ids, training=True)))
                optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
                return loss

            with tf.device("/job:worker/task:0"):
                for batch in x:
                    step(tf.constant(np.ascontiguousarray(batch)), tf.zeros([args.batch])).numpy()
        finally:
            strategy.shutdown()


def partitions(directory: str) -> dict:
    """Per task, the nodes of the step's partition graph and its tensors sent and received, by peer."""
    from google.protobuf import text_format
    from tensorflow.core.framework import graph_pb2

    out = {}
    # The step's own partitions: a function the step calls has partitions of its own, named
    # "__inference_<name>_..._at___inference_step_...", which "*step*" would also match.
    pattern = "__inference_step_*_partition__*after_partition_passes.pbtxt"
    for path in sorted(glob.glob(os.path.join(directory, pattern))):
        task = re.search(r"partition__job:(\w+)_replica:0_task:(\d+)", path).expand(r"\1:\2")
        graph = graph_pb2.GraphDef()
        with open(path) as f:
            text_format.Parse(f.read(), graph)
        sent, received = collections.Counter(), collections.Counter()
        for node in graph.node:
            if node.op in ("_Send", "_Recv"):
                peer = node.attr["recv_device" if node.op == "_Send" else "send_device"].s.decode()
                peer = re.sub(r"/job:(\w+)/replica:0/task:(\d+)/device:CPU:0", r"\1:\2", peer)
                (sent if node.op == "_Send" else received)[peer] += 1
        # The tasks may dump their components too: the same graphs, counted once.
        out[task] = {"nodes": len(graph.node), "sent": dict(sorted(sent.items())),
                     "received": dict(sorted(received.items())),
                     "top_ops": dict(collections.Counter(node.op for node in graph.node).most_common(TOP_OPS))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=20_000, help="rows per feature: capacity and num_bins")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--ttl-steps", type=int, default=400)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args)
        return 0
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths must name some of {PATHS}, got {args.paths!r}")
    result = {"args": vars(args), "environment": environment(sys.argv)}
    for kind in paths:
        with tempfile.TemporaryDirectory(prefix="psclient-partitions-") as directory:
            env = {**os.environ, "TF_DUMP_GRAPH_PREFIX": directory, "TF_DUMP_GRAPH_NAME_FILTER": "step",
                   "TF_DUMP_GRAPH_GROUPS": "main"}
            command = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                       "--child", kind]
            log(f"{kind}: tracing and running the step")
            done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                raise RuntimeError(f"the {kind!r} child failed (exit {done.returncode}): {done.stderr[-3000:]}")
            tasks = partitions(directory)
        if not tasks:
            raise RuntimeError(f"no partition graph of the step was dumped for {kind!r} (TF's dumper changed?)")
        result[kind] = {
            **tasks,
            "ps_nodes": sum(t["nodes"] for name, t in tasks.items() if name.startswith("ps:")),
            # The worker's own partition's view (its _Send and _Recv nodes with a ps as the peer).
            "worker_to_ps_tensors": sum(v for peer, v in tasks["worker:0"]["sent"].items() if peer.startswith("ps:")),
            "ps_to_worker_tensors": sum(v for peer, v in tasks["worker:0"]["received"].items() if peer.startswith("ps:")),
        }
        log(f"{kind}: {json.dumps(result[kind])}")
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
