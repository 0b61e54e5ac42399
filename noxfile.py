"""Sessions that keep psclient's dependency range honest.

`nox -s oldest` installs the oldest TensorFlow and Keras that pyproject.toml
allows (pinned in constraints/oldest.txt) into a fresh virtual environment and
runs the demo and the tests that touch TF's and Keras's internals the most:
the Keras seam, fit, partitioned variables, and the gate of TF's cache
clearing. The main suite runs against the newest versions; `.ci/run` runs
this session after it.
"""

import nox

nox.options.sessions = ["oldest"]
nox.options.reuse_existing_virtualenvs = False

OLDEST = "constraints/oldest.txt"
TESTS = ["tests/keras/test_keras_seam.py", "tests/keras/test_keras_fit.py", "tests/strategy/test_partitioned.py",
         "tests/keras/test_keras_moving_stats.py", "tests/keras/test_loop_reads.py",
         # Keras's adapters of generators and PyDatasets; a dataset's functions (`_inputs`, `_functions`).
         "tests/keras/test_keras_host_data.py", "tests/data/test_calls_python.py",
         # TF's cache clearing patched, the threads' executors switched around a wait: TF internals.
         "tests/strategy/test_cache_clearing.py",
         # A resource handle's encoding and TF's "missing resource" messages (_tf/local_variables.py);
         # Keras's LossScaleOptimizer in the replica context.
         "tests/data/test_local_variables.py",
         "tests/strategy/test_ps_updates.py::test_fit_with_a_loss_scale_optimizer_equals_local_fit",
         # Write marks wrapped on a variable's methods; a checkpoint's copy before its cut
         # (`Empty`, `DisableCopyOnRead`, a shape-changing `AssignVariableOp`).
         "tests/checkpoints/test_write_marks.py", "tests/checkpoints/test_fuzzy_copy.py",
         "tests/checkpoints/test_table_copy.py", "tests/checkpoints/test_table_pack.py",
         "tests/checkpoints/test_stages.py", "tests/checkpoints/test_hash_merge.py",
         # A variable's initial value lifted out of a function being traced (TF's `lift_to_graph`).
         "tests/strategy/test_init_on_ps.py",
         # Ops taken out of TF's automatic control dependencies (the traced function's ACD manager).
         "tests/tables/test_locked_sections.py",
         # Registrations streamed (TF's executors and its function hooks), Keras's metric
         # variables and its validation iterator, beside a hung worker.
         "tests/faults/test_no_freeze.py::test_keras_fit_starts_while_a_worker_hangs",
         # TF's `Function.__call__` replaced once a handle is renewed; a function's list of traces.
         "tests/faults/test_renewed_captures.py"]


@nox.session
def oldest(session: nox.Session) -> None:
    session.install("-c", OLDEST, "-r", OLDEST)
    session.install("-c", OLDEST, "-e", ".[test,examples]")
    session.run("python", "-c", "import tensorflow as tf, keras; print('TensorFlow', tf.__version__, 'Keras', keras.__version__)")
    session.run("psclient", "demo", "--workdir", session.create_tmp())
    # `-m ""`: these modules' long tests too (the long tier is left out of the default run only).
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *TESTS, *session.posargs)


@nox.session
def long(session: nox.Session) -> None:
    """The long tier (`-m long`): the end-to-end runs of 14 s or more that the default run, and
    so CI, leaves out. Run it before a change to recovery, checkpoints, serving or the Keras path
    lands."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "long", *session.posargs)
