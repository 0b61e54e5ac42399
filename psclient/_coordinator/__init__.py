"""The strategy and everything that calls TensorFlow for it.

The strategy's own modules are here (`strategy`, the assembly `parts`, `stores`,
`tracing`, `compat`, `tf_api`), beside the base every wing may use
(`runtime`, `connection`, `engine_edge`, `ps_state`). Features live in wings,
one subpackage each: `checkpoints`, `serving`, `data`, `tables`, `training`,
`variables` (docs/development.md, "The coordinator's wings"; the import
contracts in pyproject.toml keep them apart).
"""
