"""scripts/isolation_episodes.py: how long isolations last, from hand-built state changes."""

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl

from meshheal_jax.streams import HealthSchedule

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "isolation_episodes.py"
spec = importlib.util.spec_from_file_location("isolation_episodes", SCRIPT)
ie = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ie)


def test_episodes_are_runs_of_isolated_tasks():
    isolated = np.zeros((6, 2), bool)
    isolated[1:3, 0] = isolated[4:, 0] = isolated[0, 1] = True
    assert ie.episodes(isolated) == [(0, 2, 2), (0, 5, 2), (1, 1, 1)]


def test_counts_releases_shares_and_the_isolations_of_healthy_agents():
    """Agent 4 degraded on tasks 10-20. Agent 0 isolated on task 3, released on 8 (isolated at the
    end of tasks 3-7); agent 4 isolated on 12 to the end (degraded: not a healthy episode, but 9 of
    its 11 degraded tasks); agent 1 isolated on 18 to the end (3 tasks)."""
    schedule = HealthSchedule(6, 20, ((4, 10, 21),))
    changes = [(3, 0, "normal", "isolated"), (8, 0, "isolated", "watched"), (12, 4, "watched", "isolated"),
               (18, 1, "normal", "isolated")]  # fmt: skip
    states = pl.DataFrame([{"seed": 0, "t": t, "agent": a, "from": f, "to": to} for t, a, f, to in changes])
    tasks = pl.DataFrame(
        {"seed": [0] * 20, "t": range(1, 21), "answered": [t not in (5, 6) for t in range(1, 21)]}
    )
    reviews = pl.DataFrame({"seed": [0] * 4, "t": [5, 7, 8, 9], "probe": [True, True, True, False],
                            "z": [None, None, 1.5, None]})  # fmt: skip
    out = ie.isolation_episodes(states, tasks, reviews, schedule)
    # normal: 6 on tasks 1-2, 5 on 3-11 (agent 0 isolated, then watched), 4 on 12-17, 3 on 18-20: 90 / 20
    assert out == {
        "seeds": 1, "releases": 1, "normal agents per task": 4.5, "healthy agents isolated per task": 0.4,
        "degraded agent-tasks isolated": 0.82, "isolations of healthy agents": 2, "mean length": 4.0,
        "median length": 4.0, "unanswered per seed": 2.0, "probe reviews": 3, "of which no z": 0.67,
    }  # fmt: skip
