"""Edge cases of the §7 metrics (spec/protocol.md) and of the detector study's counts
(spec/experiments.md §5, docs/decisions.md V6) on hand-built record tables: a recovery at the
stream's last task, unreviewed outputs counted per output, and the missed / falsely isolated
agents per seed. Each was a mutation no other test caught."""

from __future__ import annotations

from types import SimpleNamespace

import polars as pl

from meshheal_jax import ablate, metrics
from meshheal_jax.streams import HealthSchedule


def states(*changes: tuple[int, int, str, str], seed: int = 0, method: str = "meshheal") -> pl.DataFrame:
    """(t, agent, from, to) rows -> a `states` frame of one stream."""
    rows = [
        {"method": method, "dataset": "bbh", "pair": "default", "seed": seed, "t": t, "agent": a,
         "from": f, "to": to, "z": 2.0, "reason": "r", "probe": False, "degraded": False}
        for t, a, f, to in changes
    ]  # fmt: skip
    return metrics.frame("states", rows)


def outcome(frame: pl.DataFrame, schedule: HealthSchedule, agent: int) -> dict:
    return next(o for o in metrics.agent_outcomes(frame, schedule) if o["agent"] == agent)


# ----------------------------------------------------------------------------------------------
# agent_outcomes(): reintegration at the last task
# ----------------------------------------------------------------------------------------------


def test_recovery_at_the_last_task_gets_its_reintegration_delay():
    """§7: "reintegration delay u_i − r_i with u_i the first t >= r_i from which i is normal through
    the end of the stream (null if never)". In a 10-task stream agent 2 recovers at r_i = N = 10 and
    is normal at the end of task 10: u_i = 10, delay 0. Agent 4, also recovered at task 10, is still
    isolated at the end of the stream: null. Both recoveries are reported (r_i = 10 <= N)."""
    schedule = HealthSchedule(6, 10, ((2, 5, 10), (4, 5, 10)))
    df = states((6, 2, "normal", "isolated"), (10, 2, "isolated", "watched"), (10, 2, "watched", "normal"),
                (7, 4, "normal", "isolated"))  # fmt: skip
    back, still_isolated = outcome(df, schedule, 2), outcome(df, schedule, 4)
    assert back == {"agent": 2, "degraded_at": 5, "recovered_at": 10, "detection_delay": 1, "closure": True,
                    "reintegration_delay": 0, "isolated_at_onset": False}  # fmt: skip
    assert still_isolated == {"agent": 4, "degraded_at": 5, "recovered_at": 10, "detection_delay": 2,
                              "closure": True, "reintegration_delay": None, "isolated_at_onset": False}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# stream_metrics(): unreviewed outputs
# ----------------------------------------------------------------------------------------------


def test_unreviewed_outputs_count_outputs_not_tasks():
    """spec/protocol.md §4: "the output is accepted unreviewed ... and `unreviewed_outputs` is
    counted and reported": outputs, so a task with two unreviewed outputs counts two. Tasks with
    2, 0 and 1 unreviewed outputs: 3 (two tasks have some)."""
    schedule = HealthSchedule(6, 3, ())
    tasks = metrics.frame("tasks", [
        {"t": t, "phase": 0, "correct": True, "answered": True, "calls": 9, "tokens": 100, "unreviewed": u}
        for t, u in ((1, 2), (2, 0), (3, 1))
    ])  # fmt: skip
    m = metrics.stream_metrics(tasks, None, states(), schedule, ("healthy",))
    assert m["unreviewed_outputs"] == 3


# ----------------------------------------------------------------------------------------------
# ablate.per_seed_detection(): the detector study's counts
# ----------------------------------------------------------------------------------------------


def test_per_seed_detection_counts_missed_and_falsely_isolated_healthy_agents():
    """experiments.md §5: "Report missed (of 2 degraded) and falsely isolated (of 4 healthy) agents
    per seed"; decisions V6: "`missed` = degraded agents never isolated while degraded;
    `falsely_isolated_healthy` = never-degraded agents isolated at some task". Agents 1 and 4 are
    degraded from task 5 to the end of a 10-task stream.
    Seed 0: agent 1 isolated at 6 and kept (detected, closure); agent 4 isolated at 7 but watched at 8
    (detected, closure fails: not missed); healthy agent 2 isolated twice: missed 0, falsely isolated 1
    (degraded agents isolated are not counted; one agent however many transitions).
    Seed 1: agent 1 isolated at 9, agent 4 never: missed 1, falsely isolated 0. A baseline's rows
    (healthy agent 3 isolated in seed 1) are not MeshHeal's and are left out."""
    schedule = HealthSchedule(6, 10, ((1, 5, 11), (4, 5, 11)))
    frame = pl.concat([
        states((3, 2, "normal", "isolated"), (4, 2, "isolated", "watched"), (8, 2, "watched", "isolated"),
               (6, 1, "normal", "isolated"), (7, 4, "normal", "isolated"), (8, 4, "isolated", "watched"), seed=0),
        states((9, 1, "normal", "isolated"), seed=1),
        states((2, 3, "normal", "isolated"), seed=1, method="sac"),
    ])  # fmt: skip
    exp = SimpleNamespace(schedule=lambda: schedule, n_agents=6, seeds=(0, 1))
    out = ablate.per_seed_detection(SimpleNamespace(states=frame), exp, "default", "bbh")
    assert out == {
        "n_degraded": 2, "n_healthy": 4,
        "missed_per_seed": [0, 1], "missed_total": 1,
        "falsely_isolated_healthy_per_seed": [1, 0], "falsely_isolated_healthy_total": 1,
        "falsely_isolated_healthy": {"mean": 0.5, "std": 0.5**0.5, "min": 0.0, "max": 1.0, "n_defined": 2},
    }  # fmt: skip
