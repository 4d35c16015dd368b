"""Self-healing metrics on hand-built traces (spec/protocol.md §7, docs/decisions.md P4/P5)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from meshheal_jax import metrics, report
from meshheal_jax.streams import HealthSchedule


def states(*changes: tuple[int, int, str, str], probe_at: tuple[int, ...] = ()) -> pl.DataFrame:
    """(t, agent, from, to) rows -> a `states` frame."""
    rows = [
        {"method": "meshheal", "dataset": "math", "pair": "default", "seed": 0, "t": t, "agent": a,
         "from": f, "to": to, "z": 2.0, "reason": "r", "probe": t in probe_at, "degraded": True}
        for t, a, f, to in changes
    ]  # fmt: skip
    return metrics.frame("states", rows)


def outcome(frame: pl.DataFrame, schedule: HealthSchedule, agent: int = 2) -> dict:
    return next(o for o in metrics.agent_outcomes(frame, schedule) if o["agent"] == agent)


# agent 2 degraded for tasks 20..59, recovered at 60, stream of 100 tasks
RECOVERING = HealthSchedule(6, 100, ((2, 20, 60),))
# agent 2 degraded from 20 to the end
PERSISTENT = HealthSchedule(6, 100, ((2, 20, 101),))


def test_frame_has_the_schema():
    df = states((5, 1, "normal", "watched"))
    assert df.columns == list(metrics.SCHEMAS["states"])
    assert df.schema["t"] == pl.Int64 and df.schema["z"] == pl.Float64
    empty = metrics.frame("states", [])
    assert empty.height == 0 and empty.columns == list(metrics.SCHEMAS["states"])


def test_state_matrix_reads_end_of_task():
    df = states((5, 1, "normal", "watched"), (5, 1, "watched", "isolated"), (8, 1, "isolated", "watched"))
    m = metrics.state_matrix(df, 6, 10)
    assert m.shape == (11, 6)
    assert m[4, 1] == "normal" and m[5, 1] == "isolated"  # two changes in task 5: the last wins
    assert m[7, 1] == "isolated" and m[8, 1] == "watched" and m[10, 1] == "watched"
    assert (m[:, 0] == "normal").all()


def test_detection_closure_reintegration():
    df = states((22, 2, "normal", "watched"), (25, 2, "watched", "isolated"), (65, 2, "isolated", "watched"),
                (70, 2, "watched", "normal"), probe_at=(65,))  # fmt: skip
    o = outcome(df, RECOVERING)
    assert o == {"agent": 2, "degraded_at": 20, "recovered_at": 60, "detection_delay": 5, "closure": True,
                 "reintegration_delay": 10, "isolated_at_onset": False}  # fmt: skip


def test_isolated_before_onset_reads_as_delay_zero_and_is_marked():
    before = outcome(states((10, 2, "normal", "isolated")), RECOVERING)  # falsely isolated while healthy
    at_onset = outcome(
        states((20, 2, "normal", "isolated")), RECOVERING
    )  # isolated on its first degraded task
    assert before["detection_delay"] == at_onset["detection_delay"] == 0
    assert before["isolated_at_onset"] is True and at_onset["isolated_at_onset"] is False
    # a probe takes it out of isolation on its first degraded task: detected later, still marked
    left = outcome(states((10, 2, "normal", "isolated"), (20, 2, "isolated", "watched"),
                          (23, 2, "watched", "isolated"), probe_at=(20,)), RECOVERING)  # fmt: skip
    assert left["detection_delay"] == 3 and left["isolated_at_onset"] is True


def test_probe_moving_agent_to_watched_before_recovery_breaks_closure():
    df = states((25, 2, "normal", "isolated"), (40, 2, "isolated", "watched"), (41, 2, "watched", "isolated"),
                probe_at=(40,))  # fmt: skip
    o = outcome(df, RECOVERING)
    assert o["detection_delay"] == 5
    assert o["closure"] is False


def test_staying_isolated_keeps_closure():
    # probe visits that leave the agent isolated record no state change: closure holds
    df = states((30, 2, "normal", "isolated"))
    o = outcome(df, PERSISTENT)
    assert o["detection_delay"] == 10 and o["closure"] is True
    assert o["recovered_at"] is None and o["reintegration_delay"] is None  # P5


def test_leaving_isolation_exactly_at_recovery_keeps_closure():
    df = states((30, 2, "normal", "isolated"), (60, 2, "isolated", "watched"), (61, 2, "watched", "normal"))
    o = outcome(df, RECOVERING)
    assert o["closure"] is True  # t = r_i is outside [c_i, r_i)
    assert o["reintegration_delay"] == 1


def test_missed_detection_has_null_delay():
    df = states((30, 2, "normal", "watched"), (40, 2, "watched", "normal"))
    o = outcome(df, RECOVERING)
    assert o["detection_delay"] is None and o["closure"] is False
    assert o["reintegration_delay"] == 0  # normal from r_i through the end


def test_isolation_after_recovery_is_not_a_detection():
    df = states((60, 2, "normal", "isolated"))
    o = outcome(df, RECOVERING)
    assert o["detection_delay"] is None
    assert o["reintegration_delay"] is None  # never normal again


def test_isolated_before_degradation_detects_at_once():
    df = states((10, 2, "normal", "isolated"))
    assert outcome(df, RECOVERING)["detection_delay"] == 0


def test_reintegration_uses_the_last_normal_run():
    df = states((25, 2, "normal", "isolated"), (65, 2, "isolated", "watched"), (70, 2, "watched", "normal"),
                (80, 2, "normal", "watched"), (85, 2, "watched", "normal"))  # fmt: skip
    assert outcome(df, RECOVERING)["reintegration_delay"] == 25


def test_reintegration_null_when_not_normal_at_the_end():
    df = states((25, 2, "normal", "isolated"), (65, 2, "isolated", "watched"), (70, 2, "watched", "normal"),
                (100, 2, "normal", "watched"))  # fmt: skip
    assert outcome(df, RECOVERING)["reintegration_delay"] is None


def test_two_degraded_agents_are_reported_separately():
    schedule = HealthSchedule(6, 100, ((4, 21, 61), (2, 41, 81)))
    df = states((23, 4, "normal", "isolated"), (50, 2, "normal", "isolated"), (90, 2, "isolated", "normal"))
    out = metrics.agent_outcomes(df, schedule)
    assert [o["agent"] for o in out] == [4, 2]  # schedule order
    assert out[0]["detection_delay"] == 2 and out[0]["closure"] and out[0]["reintegration_delay"] is None
    assert out[1]["detection_delay"] == 9 and out[1]["closure"] and out[1]["reintegration_delay"] == 9


# ----------------------------------------------------------------------------------------------
# stat()
# ----------------------------------------------------------------------------------------------


def test_stat_with_none_values():
    s = metrics.stat([None, 2.0, 4.0])
    assert s["n_defined"] == 2
    assert s["mean"] == 3.0 and s["min"] == 2.0 and s["max"] == 4.0
    assert s["std"] == pytest.approx(math.sqrt(2.0))  # sample std


def test_stat_all_undefined():
    assert metrics.stat([None, None]) == {"mean": None, "std": None, "min": None, "max": None, "n_defined": 0}
    assert metrics.stat([])["n_defined"] == 0
    assert metrics.stat([float("nan"), None])["mean"] is None


def test_stat_single_value_has_no_std():
    s = metrics.stat([5])
    assert s == {"mean": 5.0, "std": None, "min": 5.0, "max": 5.0, "n_defined": 1}


def test_stat_ignores_nan():
    s = metrics.stat([1.0, float("nan"), 3.0, np.float64("nan")])
    assert s["n_defined"] == 2 and s["mean"] == 2.0


# ----------------------------------------------------------------------------------------------
# review_audit()
# ----------------------------------------------------------------------------------------------


def review(
    degraded, q0, q, committee, takeover=False, action="contribute", before=True, after=None, probe=False
):
    return {"method": "meshheal", "dataset": "math", "pair": "default", "seed": 0, "t": 1, "visit": 0,
            "action": action, "author": 2 if degraded else 0, "ability": 0, "author_degraded": degraded,
            "probe": probe, "q0": q0, "q": q, "committee": committee, "takeover": takeover,
            "correct_before": before, "correct_after": before if after is None else after}  # fmt: skip


AUDIT_ROWS = [
    # healthy authors
    review(False, 1.0, 1.0, False),  # h1
    review(False, 0.40, 0.75, True),  # h2: flagged, committee clears
    review(False, 0.25, 0.25, True, True, "finalize", before=False, after=True),  # h3: wrong -> right
    review(False, 0.75, 0.5, True),  # h4: committee by disagreement
    review(False, 0.0, 0.0, True, True, "finalize", before=False, after=False),  # h5: unchanged
    # degraded authors
    review(True, 0.0, 0.0, True, True, "finalize", before=True, after=False),  # d1: right -> wrong
    review(True, 0.25, 0.625, True),  # d2: flagged, committee clears
    review(True, 0.75, 0.75, False),  # d3: missed
    review(True, 0.40, 0.375, True, True, "contribute", before=False, after=True),  # d4
    # a probe output: reported apart
    review(True, 0.0, 0.125, True, True, "finalize", before=True, after=False, probe=True),
]


def test_review_audit_ratios():
    # an SAC self-score (no reviewing call) would change every ratio below: it is left out
    self_score = review(True, 1.0, 1.0, False, action="self_evaluate")
    a = metrics.review_audit(metrics.frame("reviews", [*AUDIT_ROWS, self_score]))
    approx = pytest.approx
    assert a["outputs_healthy"] == 5 and a["outputs_degraded"] == 4
    assert a["mean_q0_healthy"] == approx(2.4 / 5)
    assert a["mean_q0_degraded"] == approx(1.4 / 4)
    assert a["committee_rate"] == approx(7 / 9)
    assert a["committee_share_degraded"] == approx(3 / 4)
    assert a["initial_recall"] == approx(3 / 4)  # d1, d2, d4 have q0 <= 0.40
    assert a["initial_false_alarm"] == approx(3 / 5)  # h2, h3, h5
    assert a["final_recall"] == approx(2 / 4)  # d1, d4
    assert a["final_false_alarm"] == approx(2 / 5)  # h3, h5
    assert a["committee_clears_healthy"] == approx(1 / 3)  # h2 of h2, h3, h5
    assert a["committee_keeps_degraded"] == approx(2 / 3)  # d1, d4 of d1, d2, d4
    assert a["takeovers"] == 4
    assert a["finalize_takeovers"] == 3
    assert a["takeover_wrong_to_right"] == approx(1 / 3)
    assert a["takeover_right_to_wrong"] == approx(1 / 3)
    assert a["takeover_unchanged"] == approx(1 / 3)
    # spec §7 asks for the counts; the shares above are of finalize_takeovers
    counts = [a[f"takeover_{k}_count"] for k in ("wrong_to_right", "right_to_wrong", "unchanged")]
    assert counts == [1, 1, 1]
    assert a["probe_outputs"] == 1
    assert a["probe_takeovers"] == 1  # the probe's Takeover, not among the 4 above (ablate prints both)
    assert a["probe_mean_q"] == approx(0.125)
    assert (a["probe_outputs_degraded"], a["probe_mean_q0_degraded"], a["probe_low_degraded"]) == (
        1,
        0.0,
        1.0,
    )
    assert (
        a["probe_outputs_healthy"] == 0
        and a["probe_mean_q_healthy"] is None
        and a["probe_low_healthy"] is None
    )


def test_review_audit_undefined_ratios_are_null():
    a = metrics.review_audit(metrics.frame("reviews", [review(False, 1.0, 1.0, False)]))
    assert a["outputs_degraded"] == 0
    assert a["mean_q0_degraded"] is None
    assert a["initial_recall"] is None and a["final_recall"] is None
    assert a["committee_clears_healthy"] is None  # nothing flagged
    assert a["takeover_wrong_to_right"] is None and a["finalize_takeovers"] == 0
    assert a["takeover_wrong_to_right_count"] == a["takeover_unchanged_count"] == 0
    assert a["probe_outputs"] == 0 and a["probe_mean_q"] is None
    assert a["probe_outputs_healthy"] == a["probe_outputs_degraded"] == 0 and a["probe_low_degraded"] is None
    assert a["initial_false_alarm"] == 0.0


# ----------------------------------------------------------------------------------------------
# stream_metrics(): the health split of P4 and false isolations
# ----------------------------------------------------------------------------------------------


def test_stream_metrics_health_split_and_false_isolations():
    schedule = HealthSchedule(6, 6, ((2, 4, 7),))
    tasks = metrics.frame("tasks", [
        {"t": t, "phase": int(t >= 4), "correct": t in (1, 2, 4), "answered": t != 6, "calls": 9 + t,
         "tokens": 100 * t, "unreviewed": int(t == 5)}
        for t in (6, 5, 4, 3, 2, 1)  # order does not matter
    ])  # fmt: skip
    st = states((2, 1, "normal", "isolated"), (5, 2, "normal", "isolated"), (3, 1, "isolated", "watched"),
                (4, 1, "watched", "isolated"))  # fmt: skip
    st = st.with_columns(pl.Series("degraded", [False, True, False, False]))
    reviews = metrics.frame("reviews", [review(False, 1.0, 1.0, False)])
    m = metrics.stream_metrics(tasks, reviews, st, schedule, ("healthy", "degraded"))
    assert m["acc_healthy"] == pytest.approx(2 / 3) and m["acc_degraded"] == pytest.approx(1 / 3)
    assert m["phase_change"] == pytest.approx(-1 / 3)
    assert m["calls_per_task_healthy"] == 11.0 and m["calls_per_task_degraded"] == 14.0
    assert m["tokens_per_task_healthy"] == 200.0 and m["tokens_per_task_degraded"] == 500.0
    assert m["unanswered"] == 1 and m["unreviewed_outputs"] == 1
    assert [p["name"] for p in m["phases"]] == ["healthy", "degraded"]
    assert m["phases"][1]["acc"] == pytest.approx(1 / 3)
    assert m["false_isolations"] == 2 and m["false_isolated_agents"] == 1  # agent 1, twice
    assert m["missed"] == 0 and m["agents"][0]["detection_delay"] == 1


def test_aggregate_over_seeds():
    per_seed = []
    for delay, closure, onset in ((0, True, True), (None, False, True), (5, True, False)):
        per_seed.append({
            **{k: 1.0 for k in metrics.SCALAR_KEYS},
            "phases": [{"name": "healthy", "acc": 0.5, "tokens_per_task": 10.0, "calls_per_task": 9.0}],
            "agents": [{"agent": 2, "degraded_at": 20, "recovered_at": None, "detection_delay": delay,
                        "closure": closure, "reintegration_delay": None, "isolated_at_onset": onset}],
            "review_audit": {"committee_rate": 0.5},
        })  # fmt: skip
    out = metrics.aggregate(per_seed, [0, 1, 2])
    assert out["seeds"] == [0, 1, 2]
    a = out["agents"][0]
    assert a["detection_delay"]["n_defined"] == 2 and a["detection_delay"]["mean"] == 2.5
    assert a["closure_seeds"] == 2
    assert (
        a["onset_detections"] == 1
    )  # seed 0; seed 1 was isolated at onset, released at once, never detected
    assert report.detection_text(a) == "2.5 ± 3.5 (0–5) n=2, 1 before onset"
    assert report.detection_text({**a, "onset_detections": 0}) == "2.5 ± 3.5 (0–5) n=2"
    never = metrics.stat([None, None])
    assert report.detection_text({"detection_delay": never, "onset_detections": 0}) == report.NOT_DETECTED
    assert a["reintegration_delay"] == {"mean": None, "std": None, "min": None, "max": None, "n_defined": 0}
    assert out["phases"][0]["acc"]["mean"] == 0.5
    assert out["review_audit"]["committee_rate"]["n_defined"] == 3
