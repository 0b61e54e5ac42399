"""The `psclient` command line: help with examples, argument errors, and `psclient evaluate` as a job."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from _paths import ROOT_STR

EXAMPLE = os.path.join(ROOT_STR, "examples", "launch_train.py")

pytestmark = pytest.mark.timeout(180)


def psclient(*args, timeout=120, cwd=ROOT_STR):
    env = dict(os.environ, PYTHONPATH=ROOT_STR)
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "psclient", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.mark.parametrize("command, example", [
    ([], "psclient launch --workers 2 --ps 1 -- python train.py"),
    (["launch"], "psclient launch --workers 2 --ps 1"),
    (["evaluate"], "psclient evaluate --checkpoint-dir /tmp/ckpts --model myjob:model --data myjob:data"),
    (["demo"], "psclient demo"),
])
def test_help_of_each_command_has_an_example(command, example):
    result = psclient(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "example:" in result.stdout and example in result.stdout
    if command in (["launch"], ["demo"]):  # Commands that start task servers say so.
        assert "unauthenticated RPCs" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["launch", "--workers", "0", "--", "python", "x.py"], "Invalid value for --workers. Received: 0. Expected an integer >= 1."),
    (["launch", "--workers", "1"], "No training command given. Expected it after --"),
    (["evaluate", "--checkpoint-dir", "d", "--model", "nocolon", "--data", "m:f"],
     "Invalid value for --model. Received: 'nocolon'. Expected MODULE:FUNCTION"),
    (["evaluate", "--checkpoint-dir", "d", "--model", "no_such_module_xyz:f", "--data", "m:f"],
     "cannot import 'no_such_module_xyz'"),
    (["evaluate", "--checkpoint-dir", "d", "--model", f"{EXAMPLE}:nothing", "--data", f"{EXAMPLE}:data"],
     "has no function 'nothing'"),
    (["demo", "--epochs", "0"], "Invalid value for --epochs. Received: 0. Expected an integer >= 1."),
    (["launch", "--max-restarts", "-1", "--", "python", "x.py"],
     "Invalid value for --max-restarts. Received: -1. Expected an integer >= 0."),
    (["launch", "--evaluator-timeout", "0", "--", "python", "x.py"],
     "Invalid value for --evaluator-timeout. Received: 0.0. Expected a number of seconds > 0."),
])
def test_bad_arguments_name_the_option(args, message):
    result = psclient(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("option, message", [
    (["--max-evaluations", "0"], "Invalid value for --max-evaluations. Received: 0. Expected an integer >= 1."),
    (["--export-best", "best.h5"], "Invalid value for --export-best. Received: 'best.h5'. Expected a path ending in '.keras'."),
])
def test_evaluate_option_errors_use_option_names_before_the_model_is_built(tmp_path, option, message):
    built, imported = tmp_path / "built", tmp_path / "imported"
    (tmp_path / "builders.py").write_text(
        f"open({str(imported)!r}, 'w').close()  # a module of models imports TensorFlow here: seconds\n"
        f"def model():\n    open({str(built)!r}, 'w').close()\n    raise SystemExit(3)\n"
        "def data():\n    raise SystemExit(3)\n")
    result = psclient("evaluate", "--checkpoint-dir", str(tmp_path), "--model", f"{tmp_path / 'builders.py'}:model",
                      "--data", f"{tmp_path / 'builders.py'}:data", *option)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not built.exists()  # refused before --model's function ran
    assert not imported.exists()  # and before its module was imported


def test_evaluate_job_on_tf_checkpoints_then_a_mismatching_model(tmp_path):
    import tensorflow as tf

    spec = importlib.util.spec_from_file_location("launch_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.model(compile_metrics=False)
    prefix = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path), max_to_keep=None).save()
    (tmp_path / "psclient-final.json").write_text(json.dumps({"checkpoint": "ckpt-1", "step": 5}))
    result = psclient("evaluate", "--checkpoint-dir", str(tmp_path), "--model", f"{EXAMPLE}:model",
                      "--data", f"{EXAMPLE}:data", "--poll-interval", "0.1")
    assert result.returncode == 0, result.stderr
    assert "the final checkpoint ckpt-1 is done" in result.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "eval" / "evaluations.jsonl").read_text().splitlines()]
    assert record["checkpoint"] == os.path.basename(prefix) and record["step"] == 5  # From the marker.

    (tmp_path / "wrong.py").write_text(
        "import keras\n"
        "def model():\n"
        "    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])\n"
        "    m.compile(loss='mse')\n"
        "    return m\n")
    result = psclient("evaluate", "--checkpoint-dir", str(tmp_path), "--model", f"{tmp_path / 'wrong.py'}:model",
                      "--data", f"{EXAMPLE}:data", "--poll-interval", "0.1", "--log-dir", str(tmp_path / "e2"))
    assert result.returncode == 1
    assert "does not match the checkpoint ckpt-1" in result.stderr
    assert "missing from the checkpoint" in result.stderr and "[64, 10]" in result.stderr


def test_evaluate_on_a_regular_file_says_what_it_is_and_fails(tmp_path):
    a_file = tmp_path / "ckpt"
    a_file.write_text("not a directory")
    result = psclient("evaluate", "--checkpoint-dir", str(a_file), "--model", f"{EXAMPLE}:model",
                      "--data", f"{EXAMPLE}:data", "--idle-timeout", "1")
    assert result.returncode == 2, result.stderr
    assert f"Invalid value for --checkpoint-dir. Received: {str(a_file)!r}, which is a file" in result.stderr
    assert "does not exist" not in result.stderr


class _Exited(Exception):
    pass


def test_an_interrupted_demo_exits_130_at_once_without_the_interpreters_own_exit(monkeypatch, capsys):
    # The demo has stopped everything it started when KeyboardInterrupt reaches
    # the command; the interpreter's exit (a final garbage collection over
    # TensorFlow's objects) took 20-40 s on a loaded machine and is skipped.
    from psclient import _cli, _demo

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    def exit_now(code):
        raise _Exited(code)

    monkeypatch.setattr(_demo, "run", interrupted)
    monkeypatch.setattr(_cli.os, "_exit", exit_now)
    with pytest.raises(_Exited) as exited:
        _cli.main(["demo", "--epochs", "1"])
    assert exited.value.args == (130,)
    assert "interrupted; everything it started is stopped" in capsys.readouterr().err
