"""Run in a fresh process that never imports psclient: load SavedModels with stock TensorFlow.

argv[1]: a JSON request {name: {"path": a SavedModel, "inputs": an .npz of named inputs,
"signature": "serve" (Keras's export) or "serving_default"}}. Prints one JSON line: per model, its predictions,
the op types of every function in its saved_model.pb with those not registered in this TF,
and the variables of its checkpoint (name, shape); and whether psclient was ever imported.
"""

import json
import sys

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.framework import op_def_registry


def op_types(path):
    """Every op type in the graph and every function of the SavedModel at `path`."""
    proto = saved_model_pb2.SavedModel()
    with open(f"{path}/saved_model.pb", "rb") as f:
        proto.ParseFromString(f.read())
    types = set()
    for meta in proto.meta_graphs:
        types |= {node.op for node in meta.graph_def.node}
        for function in meta.graph_def.library.function:
            types |= {node.op for node in function.node_def}
    return sorted(types)


def main():
    out = {}
    for name, request in json.loads(sys.argv[1]).items():
        path = request["path"]
        with np.load(request["inputs"], allow_pickle=False) as data:
            inputs = {key: data[key] for key in data.files}
        loaded = tf.saved_model.load(path)
        types = op_types(path)
        feed = {key: tf.constant(value) for key, value in inputs.items()}
        if request.get("signature") == "serving_default":
            signature = loaded.signatures["serving_default"]
            names = signature.structured_input_signature[1]
            if set(names) == set(feed):  # Keras's export: named as the model's inputs
                by_name = feed
            else:  # tf.saved_model.save of a Keras model: "inputs", "inputs_1"... in the inputs' sorted order
                order = sorted(names, key=lambda arg: int(arg.rpartition("_")[2]) if "_" in arg else 0)
                by_name = dict(zip(order, (feed[key] for key in sorted(feed))))
            result = signature(**by_name)
            prediction = next(iter(result.values())).numpy()
        else:
            serve = loaded.serve
            spec = serve.input_signature[0] if serve.input_signature else None
            prediction = serve(feed if isinstance(spec, dict) else feed[next(iter(feed))]).numpy()
        out[name] = {
            "prediction": prediction.tolist(),
            "op_types": types,
            "unregistered": [op for op in types if op_def_registry.get(op) is None],
            "variables": [[key, shape] for key, shape in tf.train.list_variables(f"{path}/variables/variables")],
        }
    out["psclient_imported"] = any(module.split(".")[0] == "psclient" for module in sys.modules)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
