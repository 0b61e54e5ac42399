"""Staging variables (`checkpoints.stages`), in this process: a failed copy leaves no stage whole."""

import pytest
import tensorflow as tf

from psclient._coordinator.checkpoints import stages


def test_stages_made_in_a_block_that_raises_are_emptied_and_the_error_goes_on():
    source = tf.Variable(tf.ones([100, 4]))
    with pytest.raises(stages.CopyStopped):
        with stages.emptied_on_failure() as made:
            for stop in (lambda: False, lambda: True):  # the second copy is given up before its first chunk
                stage = stages.new_stage([100, 4], tf.float32)
                made.append(stage)
                stages.copy_in_chunks(source, stage, 100, 30, stop)
    assert [stage.read_value().shape.as_list() for stage in made] == [[0, 4], [0, 4]]


def test_stages_of_a_block_that_ends_are_kept():
    source = tf.Variable(tf.ones([10, 4]))
    with stages.emptied_on_failure() as made:
        made.append(stages.new_stage([10, 4], tf.float32))
        stages.copy_in_chunks(source, made[0], 10, 3)
    assert made[0].read_value().numpy().sum() == 40.0
