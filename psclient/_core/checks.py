"""Argument checks shared by every layer, in the project's error format.

"Invalid value for argument `x`. Received: x=... Expected ..." (the Keras 3 style):
the message names the argument, shows what was received and says what was expected.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any, Callable

__all__ = ["as_option", "check_port", "check_positive", "signature_refusing_one_argument", "with_overrides"]


def check_positive(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    optional: bool = False,
    allow_zero: bool = False,
    finite: bool = False,
    unit: str = "",
) -> Any:
    """Return `value` if it is a positive number (or None when `optional`); raise ValueError otherwise.

    Args:
      name: the argument's name, as the user wrote it.
      value: what the user passed.
      integer: require an `int` (>= 1, or >= 0 with `allow_zero`); otherwise an int or float.
      optional: None is accepted (and returned).
      allow_zero: accept 0.
      finite: reject infinity (NaN and bools are always rejected).
      unit: what the number counts, for the message: "seconds" gives "a number of seconds > 0".
    """
    if value is None and optional:
        return None
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and not integer:
        ok = not math.isnan(value) and (not finite or math.isfinite(value))
    if ok:
        ok = value >= 0 if allow_zero else value > 0
    if ok:
        return value
    if integer:
        expected = f"an integer >= {0 if allow_zero else 1}"
    else:
        expected = f"a {'finite ' if finite else ''}number{f' of {unit}' if unit else ''} " \
                   f"{'>= 0' if allow_zero else '> 0'}"
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        f"Expected {expected}{' or None' if optional else ''}."
    )


def as_option(message: str) -> str:
    """check_positive's "argument `max_evaluations`. Received: max_evaluations=0" said as
    the command line's "--max-evaluations. Received: 0" (and without "or None":
    on the command line, None is leaving the option out)."""
    message = re.sub(r"(argument `(\w+)`\. Received: )\2=", r"\1", message).replace(" or None.", ".")
    return re.sub(r"argument `(\w+)`", lambda m: "--" + m.group(1).replace("_", "-"), message)


def signature_refusing_one_argument(fn: Callable) -> inspect.Signature | None:
    """`fn`'s signature if it cannot be called with exactly one positional argument, else None.

    None too when `fn` has no signature to read (builtins, C functions): the
    call itself decides then.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(object())
    except TypeError:
        return signature
    return None


def check_port(name: str, port: object) -> None:
    """None, or a TCP port number (0: any free port)."""
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}={port!r}. Expected None (no "
            "metrics), 0 (any free port) or a TCP port number from 1 to 65535."
        )


def with_overrides(config: Any, config_class: type, overrides: dict[str, Any], owner: str) -> Any:
    """`config` (an instance of the frozen dataclass `config_class`, or None for its defaults) with the
    keyword arguments in `overrides` replacing its fields: how `owner(..., config, **overrides)` is read.

    Raises:
        TypeError: `config` is not a `config_class`, or a keyword is not one of its fields.
    """
    if config is not None and not isinstance(config, config_class):
        raise TypeError(
            f"Invalid value for argument `config`. Received: config={config!r} of type "
            f"{type(config).__name__}. Expected a psclient.{config_class.__name__} or None."
        )
    fields = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r}. "
            f"Expected one of: {', '.join(sorted(fields))}."
        )
    if config is None:
        return config_class(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config
