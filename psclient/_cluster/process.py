"""What every child process psclient starts shares: its environment, and the TF noise in its output.

Task servers (`LocalCluster`), the training script and the evaluator of
`psclient launch`, and the demo's evaluator all run this checkout's psclient
with unbuffered output and gRPC failing fast; `child_env` builds that once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# The directory that holds the psclient package: first on the children's
# PYTHONPATH, so that they run the same psclient as this process.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# TensorFlow's C++ INFO lines (absl format "I0000 00:00:..."), the notice absl
# prints before it is initialised, and the CPU-feature banner's second line.
# TF_CPP_MIN_LOG_LEVEL=1 silences INFO only once absl is initialised, so the
# first banners of every TF process still come; this names exactly them.
# Warnings and errors (W..., E...) are never matched.
_TF_BANNER = re.compile(
    r"^(I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.)"
)


def is_tf_banner(line: str) -> bool:
    """Whether `line` is TensorFlow's C++ start-up chatter (INFO), not a warning or an error."""
    return bool(_TF_BANNER.match(line))


def child_env(
    extra: Mapping[str, str] | None = None, *, tf_config: str | None = None, quiet_tf: bool = False
) -> dict[str, str]:
    """This process's environment for a child that runs psclient.

    Args:
        extra: variables to set on top (they win over everything but `tf_config`).
        tf_config: the child's TF_CONFIG; None leaves out this process's TF_CONFIG,
            so a child never mistakes the parent's task for its own.
        quiet_tf: default TF_CPP_MIN_LOG_LEVEL to 1 (TF's INFO lines off,
            warnings and errors kept) unless `extra` or this process set it.
    """
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.update(extra or {})
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    env["PYTHONUNBUFFERED"] = "1"
    # Failures of other tasks reach callers as errors instead of gRPC retrying
    # forever. Not inherited: a coordinator process sets its own ("true", see
    # psclient._coordinator.connection) before it starts tasks.
    env["GRPC_FAIL_FAST"] = (extra or {}).get("GRPC_FAIL_FAST", "use_caller")
    if quiet_tf:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    pythonpath = env.get("PYTHONPATH")
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + pythonpath if pythonpath else "")
    return env
