"""Review, committee and Takeover decisions (spec/protocol.md §4) and their trace in a real stream."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from meshheal_jax import reference as R
from meshheal_jax import topology
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import load_pair
from meshheal_jax.streams import make_stream, persistent_schedule

P = ProtocolParams()


# ----------------------------------------------------------------------------------------------
# Thresholds
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q0, s_u, watched, probe, expected",
    [
        (0.40, 0.0, False, False, True),  # q0 <= tau_to
        (0.41, 0.0, False, False, False),
        (0.375, 0.1, False, False, True),
        (0.0, 0.0, False, False, True),
        (1.0, 0.55, False, False, True),  # s_u >= sigma_com
        (1.0, 0.5499, False, False, False),
        (1.0, math.sqrt(1 / 3), False, False, True),  # (1, 1, 0)
        (1.0, 0.0, True, False, True),  # watched author
        (1.0, 0.0, False, True, True),  # recovery probe
        (0.75, 0.5, False, False, False),
        (0.40 + 1e-10, 0.0, False, False, True),  # tolerance in favour of crossing
        (1.0, 0.55 - 1e-10, False, False, True),
    ],
)  # fmt: skip
def test_needs_committee(q0, s_u, watched, probe, expected):
    assert R.needs_committee(q0, s_u, watched, probe, P) is expected


@pytest.mark.parametrize(
    "q, low",
    [(0.40, True), (0.4125, False), (0.375, True), (0.0, True), (0.5, False), (0.40 + 1e-10, True),
     (0.40 + 1e-6, False)],
)  # fmt: skip
def test_is_low(q, low):
    assert R.is_low(q, P) is low


def test_thresholds_follow_the_parameters():
    p = ProtocolParams(tau_to=0.25, sigma_com=0.3)
    assert R.needs_committee(0.25, 0.0, False, False, p)
    assert not R.needs_committee(0.40, 0.0, False, False, p)
    assert R.needs_committee(1.0, 0.3, False, False, p)
    assert not R.is_low(0.40, p)


@pytest.mark.parametrize(
    "samples, median, std",
    [
        ((1.0, 1.0, 0.0), 1.0, math.sqrt(1 / 3)),
        ((0.0, 0.5, 1.0), 0.5, 0.5),
        ((0.25, 0.25, 0.25), 0.25, 0.0),
        ((1.0, 0.0, 0.25), 0.25, math.sqrt(((1 - 5 / 12) ** 2 + (5 / 12) ** 2 + (1 / 6) ** 2) / 2)),
        ((0.5, 1.0, 0.5), 0.5, math.sqrt(1 / 12)),
    ],
)  # fmt: skip
def test_median3_and_sample_std3(samples, median, std):
    assert R.median3(*samples) == median
    assert R.sample_std3(*samples) == pytest.approx(std, abs=1e-12)
    for perm in ((samples[2], samples[0], samples[1]), (samples[1], samples[2], samples[0])):
        assert R.median3(*perm) == median
        assert R.sample_std3(*perm) == pytest.approx(std, abs=1e-12)


def test_one_dissenting_zero_calls_the_committee():
    assert R.sample_std3(1.0, 1.0, 0.0) == pytest.approx(0.57735, abs=1e-5)
    assert R.needs_committee(R.median3(1, 1, 0), R.sample_std3(1, 1, 0), False, False, P)


def test_pick_convention():
    assert [R.pick(u, 3) for u in (0.0, 0.33, 0.34, 0.66, 0.67, 0.999999)] == [0, 0, 1, 1, 2, 2]
    assert R.pick(1.0, 3) == 2  # clamped


# ----------------------------------------------------------------------------------------------
# Engine-level: the reviews, tasks and calls of an 84-task MATH stream
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records():
    profile = topology.load_profile("math")
    network = topology.build_network(profile, 6)
    stream = make_stream(0, profile.dataset_id, 84, 7, (1, 43), ("healthy", "degraded"))
    schedule = persistent_schedule(6, 84, (2, 4))
    return R.run_stream(network, P, load_pair("default"), stream, schedule, {"seed": 0})


def test_stream_produces_records(records):
    assert [row["t"] for row in records.tasks] == list(range(1, 85))
    assert len(records.reviews) > 84
    assert all(row["seed"] == 0 for row in records.tasks)


def test_committee_false_means_q_equals_q0(records):
    for row in records.reviews:
        assert row["q0"] == R.median3(row["u1"], row["u2"], row["u3"])
        assert row["s_u"] == pytest.approx(R.sample_std3(row["u1"], row["u2"], row["u3"]), abs=1e-15)
        if not row["committee"]:
            assert row["q"] == row["q0"]
            assert row["v_a"] is None and row["committee_a"] == -1
        else:
            assert row["q"] == (row["v_a"] + row["v_b"]) / 2


def test_takeover_only_through_committee(records):
    takeovers = [row for row in records.reviews if row["takeover"]]
    assert takeovers, "an 84-task stream with degradation has Takeovers"
    for row in records.reviews:
        if row["takeover"]:
            assert row["committee"]
        if row["committee"]:
            assert row["takeover"] == R.is_low(row["q"], P)
        if not row["takeover"]:
            assert row["correct_after"] == row["correct_before"]


def test_committee_decision_matches_rule(records):
    forced = 0
    for row in records.reviews:
        expected = R.needs_committee(row["q0"], row["s_u"], row["state_before"] == R.WATCHED, row["probe"], P)
        assert row["committee"] == expected
        if row["committee"] and row["q0"] > 0.4 + 1e-9 and row["s_u"] < 0.55 - 1e-9:
            assert row["state_before"] == R.WATCHED or row["probe"]
            forced += 1
    assert forced > 0, "this stream has watched authors reviewed by a committee"


def test_reviewers_are_normal_ability_holders(records):
    holds = topology.load_profile("math").holds
    for row in records.reviews:
        members = [row["reviewer"]] + ([row["committee_a"], row["committee_b"]] if row["committee"] else [])
        for j in members:
            assert j != row["author"] and holds[j, row["ability"]]
    # probe outputs come from isolated authors
    for row in records.reviews:
        if row["probe"]:
            assert row["state_before"] == R.ISOLATED


def test_call_counts(records):
    calls_per_t = Counter(c["t"] for c in records.calls)
    reviews_by_t: dict[int, list[dict]] = {}
    for row in records.reviews:
        reviews_by_t.setdefault(row["t"], []).append(row)
    kinds_by_t: dict[int, Counter] = {}
    for c in records.calls:
        kinds_by_t.setdefault(c["t"], Counter())[c["kind"]] += 1
    plain = 0
    for task in records.tasks:
        t = task["t"]
        assert task["calls"] == calls_per_t.get(t, 0)
        assert task["tokens"] == sum(
            c["prompt_tokens"] + c["completion_tokens"] for c in records.calls if c["t"] == t
        )
        rows = reviews_by_t.get(t, [])
        kinds = kinds_by_t.get(t, Counter())
        # 1 inference + per output: 1 generation (+3 review samples, +4 committee, +3 Takeover)
        n_committee = sum(r["committee"] for r in rows)
        n_takeover = sum(r["takeover"] for r in rows)
        assert kinds["generate"] == len(rows) + task["unreviewed"]
        assert kinds["review"] == 3 * len(rows)
        assert kinds["committee1"] == kinds["committee2"] == 2 * n_committee
        assert kinds["candidate"] == 2 * n_takeover and kinds["synthesis"] == n_takeover
        assert (
            task["calls"]
            == kinds["infer"] + kinds["generate"] + 3 * len(rows) + 4 * n_committee + 3 * n_takeover
        )
        if (
            task["answered"]
            and not task["unreviewed"]
            and not any(r["committee"] or r["probe"] for r in rows)
        ):
            assert len(rows) == 2  # one Contribute and one Finalize
            assert task["calls"] == 9
            plain += 1
    assert plain > 40


def test_state_changes_are_recorded(records):
    changes = [(r["t"], r["author"], r["state_before"], r["state_after"]) for r in records.reviews
               if r["state_before"] != r["state_after"]]  # fmt: skip
    assert changes == [(s["t"], s["agent"], s["from"], s["to"]) for s in records.states]
    for row in records.reviews:
        if row["z"] is None:
            assert row["state_before"] == row["state_after"]
        if row["t"] <= P.warmup_tasks(6):
            assert row["z"] is None
