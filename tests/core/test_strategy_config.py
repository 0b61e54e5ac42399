"""`psclient.StrategyConfig`: the strategy's keyword arguments as one checked value.

No cluster: a bad value fails where the config is made (or where the strategy
is given it, before anything connects), with the keyword argument's message.
"""

import dataclasses

import pytest

import psclient

#: Nothing listens here: an error must come before any connect.
NOWHERE = {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}


def test_defaults_are_the_strategys():
    config = psclient.StrategyConfig()
    assert config.pipeline_depth == 1 and config.connect_timeout == 30.0 and config.hang_timeout == 30.0
    assert config.variable_partitioner == "auto" and config.checkpoint_dir is None
    assert config.measured is False and config.streaming is False


def test_it_is_frozen_and_replace_checks_again():
    config = psclient.StrategyConfig(hang_timeout=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hang_timeout = 6
    with pytest.raises(ValueError, match="`hang_timeout`. Received: hang_timeout=0"):
        dataclasses.replace(config, hang_timeout=0)


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        ({"pipeline_depth": 0}, ValueError, "pipeline_depth"),
        ({"connect_timeout": -1}, ValueError, "connect_timeout"),
        ({"hang_timeout": 0}, ValueError, "hang_timeout"),
        ({"worker_timeout": "60"}, ValueError, "worker_timeout"),
        ({"checkpoint_dir": "/tmp/x", "checkpoints_to_keep": 0}, ValueError, "checkpoints_to_keep"),
        ({"checkpoint_interval": 10}, ValueError, "checkpoint_dir"),
        ({"delta_checkpoint_every": 5}, ValueError, "checkpoint_dir"),
        ({"checkpoint_dir": "/tmp/x", "delta_checkpoint_every": 1.5}, ValueError, "delta_checkpoint_every"),
        ({"checkpoint_dir": "/tmp/x", "delta_checkpoint_interval": 0}, ValueError, "delta_checkpoint_interval"),
        ({"checkpoint_dir": 5}, TypeError, "checkpoint_dir"),
        ({"overwrite_checkpoints": True}, ValueError, "overwrite_checkpoints"),
        ({"variable_partitioner": "even"}, ValueError, "variable_partitioner"),
        ({"variable_partitioner": 3}, TypeError, "variable_partitioner"),
        ({"max_staleness": -1}, ValueError, "max_staleness"),
        ({"max_staleness": 1, "replicas_to_aggregate": 1}, ValueError, "max_staleness"),
        ({"max_staleness": 1, "measure_staleness": False}, ValueError, "measure_staleness"),
        ({"dynamic_table_storage": "dict"}, ValueError, "dynamic_table_storage"),
    ],
)
def test_a_bad_value_names_the_argument_in_the_config_and_in_the_strategy(kwargs, error, argument):
    with pytest.raises(error, match=f"`{argument}`. Received: {argument}=") as made:
        psclient.StrategyConfig(**kwargs)
    with pytest.raises(error) as given:
        psclient.ParameterServerStrategy(NOWHERE, **kwargs)
    assert str(given.value) == str(made.value)  # the same message either way


def test_measured_follows_staleness_and_synchronous_training():
    assert psclient.StrategyConfig(max_staleness=0).measured is True
    assert psclient.StrategyConfig(replicas_to_aggregate=2).measured is True
    assert psclient.StrategyConfig(measure_staleness=True).measured is True
    assert psclient.StrategyConfig(pipeline_depth=2).streaming is True


def test_an_unknown_keyword_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'hang_timout'"):
        psclient.ParameterServerStrategy(NOWHERE, hang_timout=3)


def test_a_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match="`config`. Received: config={'hang_timeout': 3} of type dict"):
        psclient.ParameterServerStrategy(NOWHERE, {"hang_timeout": 3})


def test_keyword_arguments_override_the_config_and_are_checked():
    config = psclient.StrategyConfig(replicas_to_aggregate=1)
    # The override is checked with the rest: one worker here, so 2 replicas cannot be aggregated.
    with pytest.raises(ValueError, match="replicas_to_aggregate=2 with 1 workers"):
        psclient.ParameterServerStrategy(NOWHERE, config, replicas_to_aggregate=2)
    with pytest.raises(ValueError, match="`hang_timeout`. Received: hang_timeout=-3"):
        psclient.ParameterServerStrategy(NOWHERE, config, hang_timeout=-3)
