"""examples/actor_learner.py: actors on the workers, the learner on the coordinator, learns cart-pole.

The bar is the example's stated one, CartPole-v0's "solved": a mean return of
at least 195 over the last 100 episodes (a uniformly random policy scores
about 22), within the example's update budget.
"""

import json
import os
import subprocess
import sys

import pytest

from _paths import ROOT_STR

_EXAMPLE = os.path.join(ROOT_STR, "examples", "actor_learner.py")

pytestmark = [pytest.mark.cluster]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_actor_learner_reaches_the_stated_return(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT_STR)
    result = subprocess.run(
        [sys.executable, _EXAMPLE, "--workers", "2", "--envs", "16", "--max-updates", "400", "--seed", "0",
         "--json", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=280, env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(summary)
    assert summary["reached"] is True
    assert summary["target_return"] == 195.0 and summary["window_episodes"] == 100
    assert 195.0 <= summary["mean_return"] <= 200.0  # 200 is the most an episode can score.
    assert summary["episodes"] >= 100 and summary["episodes"] == 16 * summary["updates"]
    assert 0 < summary["updates"] <= 400
    # Every worker acted; the learner trained on every batch it received.
    assert len(summary["collects_per_worker"]) == 2 and min(summary["collects_per_worker"]) > 0
    assert sum(summary["collects_per_worker"]) >= summary["updates"]
    assert summary["env_steps"] >= 195 * 100 and summary["env_steps_per_s"] > 0
    assert summary["policy_lag_max"] is not None and summary["policy_lag_mean"] >= 0
    assert "reached: mean return" in result.stdout and "environment steps/s" in result.stdout
