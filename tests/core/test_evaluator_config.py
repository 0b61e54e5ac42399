"""`EvaluatorConfig`: the sidecar evaluator's options, checked once, as fields or as keywords. Pure: no cluster."""

import os

import pytest

import psclient
from psclient._core.checks import with_overrides
from psclient._sidecar.evaluator_config import EvaluatorConfig, check_watch


def test_defaults_and_derived_values(tmp_path):
    config = EvaluatorConfig()
    assert (config.idle_timeout, config.settle_time, config.poll_interval, config.model_key) == (600.0, 2.0, 1.0, "model")
    assert config.log_dir_for(str(tmp_path)) == os.path.join(str(tmp_path), "eval")
    assert config.export_best_path is None
    assert not config.higher_is_better  # "auto" on "loss"
    assert EvaluatorConfig(best_metric="val_accuracy").higher_is_better
    assert not EvaluatorConfig(best_metric="val_accuracy", best_mode="min").higher_is_better
    assert EvaluatorConfig(export_best="b.keras").export_best_path == os.path.abspath("b.keras")


@pytest.mark.parametrize("field, value, expected", [
    ("idle_timeout", 0, "idle_timeout"),
    ("idle_timeout", float("inf"), "idle_timeout"),
    ("settle_time", -1, "settle_time"),
    ("poll_interval", 0, "poll_interval"),
    ("export_best", "/tmp/best.h5", "ending in '.keras'"),
    ("best_mode", "largest", "'auto', 'max' or 'min'"),
    ("model_key", "", "non-empty string"),
    ("best_metric", None, "non-empty string"),
])
def test_a_bad_value_is_refused_where_the_config_is_made(field, value, expected):
    with pytest.raises(ValueError, match=f"argument `{field}`") as caught:
        EvaluatorConfig(**{field: value})
    assert expected in str(caught.value)


def test_paths_and_clock_must_be_what_they_say():
    with pytest.raises(TypeError, match="argument `log_dir`.*Expected a path"):
        EvaluatorConfig(log_dir=3)
    with pytest.raises(TypeError, match="argument `clock`"):
        EvaluatorConfig(clock=1.0)


def test_keywords_replace_the_configs_fields_and_unknown_ones_are_named():
    base = EvaluatorConfig(idle_timeout=30, best_metric="auc")
    merged = with_overrides(base, EvaluatorConfig, {"idle_timeout": 5}, "SidecarEvaluator")
    assert (merged.idle_timeout, merged.best_metric) == (5, "auc") and base.idle_timeout == 30
    with pytest.raises(TypeError, match=r"SidecarEvaluator\(\) got an unexpected keyword argument 'idle'"):
        with_overrides(None, EvaluatorConfig, {"idle": 5}, "SidecarEvaluator")
    with pytest.raises(TypeError, match="argument `config`.*Expected a psclient.EvaluatorConfig"):
        with_overrides(psclient.StrategyConfig(), EvaluatorConfig, {}, "SidecarEvaluator")


def test_tfs_positional_arguments_are_checked(tmp_path):
    assert check_watch(tmp_path, None, None) == str(tmp_path)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="argument `checkpoint_dir`.*a file, not a directory"):
        check_watch(a_file, None, None)
    with pytest.raises(ValueError, match="argument `steps`"):
        check_watch(tmp_path, 0, None)
    with pytest.raises(ValueError, match="argument `max_evaluations`"):
        check_watch(tmp_path, None, 1.5)
    with pytest.raises(TypeError, match="argument `checkpoint_dir`"):
        check_watch(None, None, None)
