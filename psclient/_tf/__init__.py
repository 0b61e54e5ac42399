"""TensorFlow's internals, behind one edge.

The only package that imports `tensorflow.python`, reads TF's private
attributes or patches TF (a contract in pyproject.toml forbids
`tensorflow.python` everywhere else). Each module wraps what has no public
API, thinly, and decides no policy:

  executors    each dispatcher thread's executor; registrations streamed while tracing
  registrations  calls retried while their function's registration is on its way, the
               function traced again when it never reached a task
  calls        cancellable calls; the gate of TF's cache clearing
  context      the eager and dispatch contexts, the coordinator's server definition, the one
               replica's context a step runs in (its all_reduce registers no gradient)
  variables    a variable's resource renewed; psclient's own variables; control edges
  partitioned  `PartitionedVariable`, TF's `ShardedVariable` made usable by Keras 3
  updates      the one patch of TF's default-strategy updates, with a router
  data         a dataset's graph, moved between devices
  checkpoints  the checkpoint ops (SaveV2, RestoreV2, MergeV2Checkpoints) and state file
  gradients    `tf.custom_gradient` whose graph-mode registration dies with its graph
  serving      exports in progress on a thread (TF's save context made an export scope)
"""
