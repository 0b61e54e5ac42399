"""The optimizer updates of dynamic embedding rows: SGD, Adagrad, Adam and Ftrl, lazily.

A `DynamicEmbedding`'s rows are not Keras variables, so Keras's optimizers
cannot update them; `rule_for(optimizer)` gives the same arithmetic as the
optimizer's `update_step` (Keras 3.10-3.15), applied to the touched rows and
their slots only, with the optimizer's own hyperparameters, learning rate
(schedules included) and step count. The semantics are the lazy ones of
every dynamic-embedding system: a row's slots (momentum, accumulators,
moments) change only in steps that touch the row; Adam's bias correction
uses the optimizer's step count, as Keras's does. A key's gradient is the
sum over its occurrences in the batch.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from psclient._core.errors import PSClientError

__all__ = ["SUPPORTED", "UnsupportedOptimizerError", "rule_for", "slots_for"]

SUPPORTED = "SGD (with or without momentum), Adagrad, Adam (amsgrad=False) and Ftrl"


class UnsupportedOptimizerError(PSClientError, ValueError):
    """The model's optimizer cannot update a DynamicEmbedding's rows."""


def _refuse(optimizer, why: str, layer: str):
    raise UnsupportedOptimizerError(
        f"Invalid value for argument `optimizer` of a model with DynamicEmbedding {layer!r}. Received: "
        f"optimizer={type(optimizer).__name__}({why}). Expected one of {SUPPORTED}, without weight_decay, "
        "clipnorm, clipvalue, global_clipnorm, use_ema or gradient_accumulation_steps."
    )


def slots_for(optimizer, layer: str) -> dict[str, float]:
    """The slots (name -> initial value) `rule_for(optimizer)` updates; raise for an optimizer without
    support. Makes no tensor: the slot tables can be made before a step is traced (see
    `dynamic_embedding.make_slots_ahead`)."""
    import keras
    for attribute in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps"):
        if getattr(optimizer, attribute, None):
            _refuse(optimizer, f"{attribute}={getattr(optimizer, attribute)!r}", layer)
    if getattr(optimizer, "use_ema", False):
        _refuse(optimizer, "use_ema=True", layer)
    kind = type(optimizer)
    if kind is keras.optimizers.SGD:
        return {"momentum": 0.0} if float(optimizer.momentum) else {}
    if kind is keras.optimizers.Adagrad:
        return {"accumulator": float(optimizer.initial_accumulator_value)}
    if kind is keras.optimizers.Adam:
        if optimizer.amsgrad:
            _refuse(optimizer, "amsgrad=True", layer)
        return {"m": 0.0, "v": 0.0}
    if kind is keras.optimizers.Ftrl:
        return {"accumulator": float(optimizer.initial_accumulator_value), "linear": 0.0}
    _refuse(optimizer, "...", layer)


def rule_for(optimizer, layer: str) -> tuple[dict[str, float], Callable]:
    """(slot name -> initial value, update) for `optimizer`; raise for one without support.

    `update(rows, gradient, slots) -> (rows, slots)` runs on the rows' ps;
    it reads the learning rate and step count it needs from `optimizer`.
    """
    import keras
    slots = slots_for(optimizer, layer)  # checks the optimizer first
    kind = type(optimizer)
    lr = tf.cast(tf.convert_to_tensor(optimizer.learning_rate), tf.float32)

    if kind is keras.optimizers.SGD:
        momentum, nesterov = float(optimizer.momentum), bool(optimizer.nesterov)
        if momentum == 0:
            return slots, lambda rows, g, slots: (rows - lr * g, slots)

        def sgd(rows, g, slots):
            m = momentum * slots["momentum"] - lr * g
            step = momentum * m - lr * g if nesterov else m
            return rows + step, {"momentum": m}

        return slots, sgd

    if kind is keras.optimizers.Adagrad:
        epsilon = float(optimizer.epsilon)

        def adagrad(rows, g, slots):
            accumulator = slots["accumulator"] + g * g
            return rows - lr * g / tf.sqrt(accumulator + epsilon), {"accumulator": accumulator}

        return slots, adagrad

    if kind is keras.optimizers.Adam:
        beta_1, beta_2, epsilon = float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon)
        step = tf.cast(tf.convert_to_tensor(optimizer.iterations), tf.float32) + 1.0
        alpha = lr * tf.sqrt(1.0 - tf.pow(beta_2, step)) / (1.0 - tf.pow(beta_1, step))

        def adam(rows, g, slots):
            m = slots["m"] + (g - slots["m"]) * (1.0 - beta_1)
            v = slots["v"] + (g * g - slots["v"]) * (1.0 - beta_2)
            return rows - m * alpha / (tf.sqrt(v) + epsilon), {"m": m, "v": v}

        return slots, adam

    if kind is keras.optimizers.Ftrl:
        power = float(optimizer.learning_rate_power)
        l1 = float(optimizer.l1_regularization_strength)
        l2 = float(optimizer.l2_regularization_strength) + float(optimizer.beta) / (2.0 * lr)
        shrinkage = float(optimizer.l2_shrinkage_regularization_strength)

        def ftrl(rows, g, slots):
            accumulator, linear = slots["accumulator"], slots["linear"]
            new_accumulator = accumulator + g * g
            linear = linear + (g + 2.0 * shrinkage * rows) - (
                (tf.pow(new_accumulator, -power) - tf.pow(accumulator, -power)) / lr * rows)
            quadratic = tf.pow(new_accumulator, -power) / lr + 2.0 * l2
            rows = (tf.clip_by_value(linear, -l1, l1) - linear) / quadratic
            return rows, {"accumulator": new_accumulator, "linear": linear}

        return slots, ftrl
