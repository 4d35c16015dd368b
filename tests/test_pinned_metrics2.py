"""Rules of the §7 metrics (spec/protocol.md, spec/experiments.md) that a docstring, the spec or
docs/decisions.md states and that no other test held (a second mutation audit of metrics.py): the
profile name per six-agent replica, the mean over seeds, the audit's tolerance on a committee's
clearing and which Finalize Takeovers count as wrong -> right, the scale counts' median and onset
(the end of task b_i − 1), unanswered = incorrect, the large-network and no-review streams, a joined
parse-status list, and the aggregation over seeds and over datasets within seed. Hand-built frames
and per-seed dicts, each answer worked out by hand from the rule: no run."""

from __future__ import annotations

import pytest
from test_pinned_metrics import LABELS, states  # the hand-built frames of the first audit

from meshheal_jax import metrics
from meshheal_jax.streams import HealthSchedule


def review(degraded: bool, q0: float, q: float, action: str = "contribute", takeover: bool = False,
           before: bool = True, after: bool = True) -> dict:  # fmt: skip
    """One reviewed, non-probe output of a healthy (0) or degraded (2) author."""
    return {**LABELS, "seed": 0, "t": 1, "visit": 0, "action": action, "author": 2 if degraded else 0,
            "ability": 0, "author_degraded": degraded, "probe": False, "q0": q0, "q": q,
            "committee": q0 <= 0.40, "takeover": takeover, "correct_before": before,
            "correct_after": after}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# names and statistics over seeds
# ----------------------------------------------------------------------------------------------


def test_profile_names_repeat_per_six_agent_replica():
    """agent_label: "the profile name (1-based, per six-agent replica) and the 0-based index":
    agent 8 of a 12-agent network is the second replica's A3; aggregate's `profile` the same."""
    assert metrics.agent_label(8) == "A3 (agent 8)"
    assert metrics.agent_label(11) == "A6 (agent 11)"
    agent = {"agent": 10, "degraded_at": 5, "recovered_at": None, "detection_delay": 1, "closure": True,
             "reintegration_delay": None, "isolated_at_onset": False}  # fmt: skip
    entry = {**{k: 0.0 for k in metrics.SCALAR_KEYS}, "phases": [], "review_audit": {}, "agents": [agent]}
    assert metrics.aggregate([entry], [0])["agents"][0]["profile"] == "A5"


def test_stat_mean_is_the_mean_not_the_median():
    """spec/experiments.md: "Report mean and sample std over seeds": 1, 2 and 6 -> mean 3 (median 2),
    sample std sqrt(7)."""
    s = metrics.stat([1, 2, 6])
    assert s["mean"] == 3.0 and s["std"] == pytest.approx(7**0.5)


# ----------------------------------------------------------------------------------------------
# review_audit
# ----------------------------------------------------------------------------------------------


def test_a_committee_score_a_rounding_above_0_40_does_not_clear_a_flagged_output():
    """P3: the audit's low-score decision is `q <= 0.40 + 1e-9`, so a final q a rounding above 0.40
    is still low: the flagged healthy output it ends is a false alarm, not cleared by the committee
    (committee_clears_healthy is the complement of final low among the flagged)."""
    rows = [review(False, 0.25, 0.40 + 1e-12), review(False, 0.25, 0.75)]
    a = metrics.review_audit(metrics.frame("reviews", rows))
    assert a["final_false_alarm"] == 0.5
    assert a["committee_clears_healthy"] == 0.5


def test_a_takeover_of_a_right_answer_that_stays_right_is_unchanged():
    """§7: Takeover outcome counts on Finalize outputs: wrong->right, right->wrong, unchanged. A
    Takeover of a right answer with a right answer is unchanged, not wrong->right; one of a wrong
    answer with a wrong answer is unchanged, not right->wrong."""
    rows = [review(False, 0.25, 0.25, "finalize", True, before=True, after=True),
            review(False, 0.25, 0.25, "finalize", True, before=False, after=False),
            review(True, 0.0, 0.0, "finalize", True, before=False, after=True)]  # fmt: skip
    a = metrics.review_audit(metrics.frame("reviews", rows))
    counts = [a[f"takeover_{k}_count"] for k in ("wrong_to_right", "right_to_wrong", "unchanged")]
    assert counts == [1, 0, 2]
    assert a["takeover_unchanged"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------
# scale_outcomes
# ----------------------------------------------------------------------------------------------


def test_scale_median_delay_is_the_median_of_the_detected_agents():
    """scale_outcomes: detection_delay_median beside the mean. Agents 1, 2 and 4 degraded from task
    11 of 30, isolated on tasks 11, 12 and 19 (delays 0, 1, 8); agent 5, degraded too, never: mean 3,
    median 1, over the three detected; one missed."""
    schedule = HealthSchedule(6, 30, ((1, 11, 31), (2, 11, 31), (4, 11, 31), (5, 11, 31)))
    frame = states(
        (11, 1, "normal", "isolated"), (12, 2, "watched", "isolated"), (19, 4, "watched", "isolated")
    )
    out = metrics.scale_outcomes(frame, schedule)
    assert out["detection_delay_mean"] == 3.0 and out["detection_delay_median"] == 1.0
    assert out["missed"] == 1 and out["isolated_degraded"] == 3


def test_scale_onset_is_the_state_at_the_end_of_the_task_before_onset():
    """P5b at scale: an agent isolated at the end of task b_i − 1 and still at the end of b_i is an
    onset detection, also when it was isolated ON task b_i − 1 (normal at the end of b_i − 2); one
    released on task b_i − 1 is not isolated at onset (its isolation on b_i is a real detection)."""
    schedule = HealthSchedule(6, 30, ((2, 11, 31),))
    isolated_on_b_minus_1 = states((10, 2, "watched", "isolated"))
    released_on_b_minus_1 = states((5, 2, "normal", "isolated"), (10, 2, "isolated", "watched"),
                                   (11, 2, "watched", "isolated"))  # fmt: skip
    for frame, onset in ((isolated_on_b_minus_1, 1), (released_on_b_minus_1, 0)):
        out = metrics.scale_outcomes(frame, schedule)
        assert out["onset_detections"] == onset
        assert out["detection_delay_mean"] == 0.0 and out["missed"] == 0
        (outcome,) = metrics.agent_outcomes(frame, schedule)
        assert metrics.onset_detection(outcome) is bool(onset)


# ----------------------------------------------------------------------------------------------
# stream_metrics
# ----------------------------------------------------------------------------------------------

SIX = HealthSchedule(6, 6, ((2, 4, 7),))  # tasks 1..3 healthy, 4..6 agent 2 degraded
PHASES = ("healthy", "degraded")


def tasks(answered: tuple[int, ...] = (1, 2, 3, 4, 5, 6), correct: tuple[int, ...] = (1, 2, 3, 4, 5, 6)):
    """Six tasks, phase 1 from task 4; `answered` and `correct` list the tasks that are."""
    return metrics.frame("tasks", [
        {**LABELS, "seed": 0, "t": t, "phase": int(t >= 4), "answered": t in answered, "correct": t in correct,
         "calls": 5, "tokens": 100, "unreviewed": 0}
        for t in range(1, 7)
    ])  # fmt: skip


def test_an_unanswered_task_counts_as_incorrect_in_each_health_split():
    """§7: "Unanswered = incorrect": task 2 (healthy) and task 5 (degraded) unanswered, every
    answered task correct: 2/3 in each split, not 1."""
    frame = tasks(answered=(1, 3, 4, 6), correct=(1, 3, 4, 6))
    m = metrics.stream_metrics(frame, None, states(), SIX, PHASES)
    assert m["acc_healthy"] == pytest.approx(2 / 3) and m["acc_degraded"] == pytest.approx(2 / 3)
    assert m["unanswered"] == 2


def test_large_networks_still_count_missed_agents():
    """per_agent=False (large networks) replaces the per-agent list by scale_outcomes' counts, the
    missed count kept: agent 2, degraded on tasks 4-6 and never isolated, is missed either way."""
    for per_agent in (True, False):
        m = metrics.stream_metrics(tasks(), None, states(), SIX, PHASES, per_agent=per_agent)
        assert m["missed"] == 1, per_agent
    assert m["agents"] == [] and m["degraded"] == 1
    assert set(metrics.SCALE_KEYS) <= set(m)  # every count the scaling table reads


def test_a_seed_without_review_rows_still_has_its_review_audit():
    """With a reviews table given (per-agent runs), a stream with no reviewed output has an audit of
    zero outputs and undefined ratios, so seeds aggregate over the same keys (n_defined counts the
    seed whose rate is defined)."""
    with_reviews = metrics.frame("reviews", [review(True, 0.25, 0.25)])
    seeds = [metrics.stream_metrics(tasks(), r, states(), SIX, PHASES)
             for r in (with_reviews, metrics.frame("reviews", []))]  # fmt: skip
    assert seeds[1]["review_audit"]["outputs_degraded"] == 0
    assert seeds[1]["review_audit"]["initial_recall"] is None
    out = metrics.aggregate(seeds, [0, 1])["review_audit"]
    assert out["initial_recall"]["n_defined"] == 1 and out["outputs_degraded"]["mean"] == 0.5


def test_parse_counts_count_each_entry_of_a_joined_status_list():
    """parse_counts: "A status list joined by commas ... counts each entry": a baseline call whose
    trace reads failed, failed, retried is two failures and one retry."""
    calls = metrics.frame("calls", [{**LABELS, "seed": 0, "t": 2, "kind": "router",
                                     "parse_status": "failed,failed,retried"}])  # fmt: skip
    m = metrics.stream_metrics(tasks(), None, states(), SIX, PHASES, calls=calls)
    assert (m["parse_failed"], m["parse_failed_choice"], m["parse_retried"]) == (2, 2, 1)
    assert m["phases"][0]["parse_failed"] == 2 and m["phases"][1]["parse_failed"] == 0


# ----------------------------------------------------------------------------------------------
# aggregate and mean_over_datasets
# ----------------------------------------------------------------------------------------------


def per_seed(
    acc: tuple[float, float], reintegration: int | None = None, acc_healthy: float | None = 0.5
) -> dict:
    """A hand-built stream_metrics dict: two phases with accuracies `acc`, one degraded agent."""
    phases = [{"name": name, "acc": a, "tokens_per_task": 100.0, "calls_per_task": 5.0}
              for name, a in zip(PHASES, acc)]  # fmt: skip
    agent = {"agent": 2, "degraded_at": 4, "recovered_at": 5, "detection_delay": 0, "closure": True,
             "reintegration_delay": reintegration, "isolated_at_onset": False}  # fmt: skip
    return {**{k: 0.0 for k in metrics.SCALAR_KEYS}, "acc_healthy": acc_healthy, "phases": phases,
            "agents": [agent], "review_audit": {}}  # fmt: skip


def test_aggregate_reads_each_phase_and_each_seed():
    """aggregate: each phase's statistics over seeds of that phase's numbers, and each seed's own
    reintegration delay (seed 0: 2, seed 1: 6 -> mean 4)."""
    out = metrics.aggregate([per_seed((1.0, 0.5), 2), per_seed((0.5, 0.25), 6)], [0, 1])
    assert [ph["acc"]["mean"] for ph in out["phases"]] == [0.75, 0.375]
    assert out["agents"][0]["reintegration_delay"]["mean"] == 4.0
    assert out["agents"][0]["reintegration_delay"]["n_defined"] == 2
    assert (out["agents"][0]["degraded_at"], out["agents"][0]["recovered_at"]) == (4, 5)


def test_aggregate_carries_both_false_isolation_counts_and_the_scale_counts():
    """§7: false isolations, "report both the number of such transitions and the number of distinct
    agents"; at scale the counts the scaling table reads (onset detections among them, P5b)."""
    frame = states((2, 1, "normal", "isolated"), (3, 1, "isolated", "watched"), (5, 1, "watched", "isolated"),
                   (1, 2, "normal", "isolated"))  # fmt: skip
    m = metrics.stream_metrics(tasks(), None, frame, SIX, PHASES, per_agent=False)
    out = metrics.aggregate([m], [0])
    assert out["false_isolations"]["mean"] == 3.0 and out["false_isolated_agents"]["mean"] == 2.0
    assert out["onset_detections"]["mean"] == 1.0 and out["isolated_degraded"]["mean"] == 1.0
    assert out["detection_delay_median"]["mean"] == 0.0 and out["missed"]["mean"] == 0.0
    # a first seed without a detection (delays null) still carries the key: n_defined says so
    blind = metrics.stream_metrics(tasks(), None, states(), SIX, PHASES, per_agent=False)
    out = metrics.aggregate([blind, m], [0, 1])
    assert out["detection_delay_mean"]["n_defined"] == 1 and out["missed"]["mean"] == 0.5


def test_mean_over_datasets_is_computed_within_seed():
    """experiments.md: the "dataset": "mean" entry "carries the mean over datasets computed within
    seed": per seed the mean over datasets, then mean and sample std over seeds. bbh's seeds 0.2, 0.6;
    math's 0.4, 1.0: within seed 0.3 and 0.8, so mean 0.55, std sqrt(0.125); per phase the same."""
    bbh = [per_seed((0.2, 0.1), acc_healthy=0.2), per_seed((0.6, 0.3), acc_healthy=0.6)]
    math_ = [per_seed((0.4, 0.3), acc_healthy=0.4), per_seed((1.0, 0.5), acc_healthy=1.0)]
    out = metrics.mean_over_datasets({"bbh": bbh, "math": math_}, [0, 1])
    assert out["acc_healthy"]["mean"] == pytest.approx(0.55)
    assert out["acc_healthy"]["std"] == pytest.approx(0.125**0.5)
    assert (out["acc_healthy"]["min"], out["acc_healthy"]["max"]) == pytest.approx((0.3, 0.8))
    assert out["phases"][1]["acc"]["mean"] == pytest.approx(0.3)  # (0.1 + 0.3) / 2, (0.3 + 0.5) / 2
    assert out["agents"] == [] and out["review_audit"] == {}


def test_mean_over_datasets_is_undefined_in_a_seed_where_a_dataset_is():
    """A seed where one dataset's number is undefined (null) has no mean over datasets (the mean of
    the others would average a different set of datasets): that seed is left out of n_defined."""
    bbh = [per_seed((0.2, 0.1), acc_healthy=None), per_seed((0.6, 0.3), acc_healthy=0.6)]
    math_ = [per_seed((0.4, 0.3), acc_healthy=0.4), per_seed((1.0, 0.5), acc_healthy=1.0)]
    out = metrics.mean_over_datasets({"bbh": bbh, "math": math_}, [0, 1])
    assert out["acc_healthy"]["n_defined"] == 1 and out["acc_healthy"]["mean"] == pytest.approx(0.8)
