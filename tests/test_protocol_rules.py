"""Rules of spec/protocol.md §3.4 (budgets, probes), §4 (reviewers, committee, Takeover) and §7
(closure, the health split) checked on the reference engine and the metrics directly: a mutation
of the same rule in both engines passed every differential test (twenty-fourth session). The
differential tests in test_engine.py hold the JAX engine to the reference. Plain Python, no compile."""

from __future__ import annotations

import pytest

from meshheal_jax import draws as D
from meshheal_jax import metrics, topology
from meshheal_jax import reference as R
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import load_pair
from meshheal_jax.streams import HealthSchedule, make_stream, persistent_schedule

N_TASKS = 84


@pytest.fixture(scope="module")
def math_network():
    return topology.build_network(topology.load_profile("math"), 6)


@pytest.fixture(scope="module")
def stream_records(math_network):
    """An 84-task MATH stream, A3 and A5 degraded from task 43: watched and isolated agents occur."""
    profile = math_network.profile
    stream = make_stream(0, profile.dataset_id, N_TASKS, 7, (1, 43), ("healthy", "degraded"))
    schedule = persistent_schedule(6, N_TASKS, (2, 4))
    return R.run_stream(math_network, ProtocolParams(), load_pair("default"), stream, schedule, {"seed": 0})


def test_reviewers_and_committee_members_follow_section_4(math_network, stream_records):
    """§4: E = the author's neighbours in state normal holding the ability (watched peers never
    review); with |E| >= 2 the committee's B is drawn from E without A, with |E| = 1 A = B. States
    are replayed from the review rows (every state change is an author's observation)."""
    state = dict.fromkeys(range(6), R.NORMAL)
    distinct, watched_excluded = 0, 0
    for row in stream_records.reviews:
        author, s = row["author"], row["ability"]
        holders = [j for j in math_network.neighbours(author) if math_network.holds[j, s]]
        eligible = [j for j in holders if state[j] == R.NORMAL]
        watched_excluded += any(state[j] == R.WATCHED for j in holders)
        assert row["reviewer"] in eligible, row
        if row["committee"]:
            a, b = row["committee_a"], row["committee_b"]
            assert a in eligible and b in eligible, row
            if len(eligible) >= 2:
                assert a != b, row
                distinct += 1
            else:
                assert a == b == eligible[0], row
        state[author] = row["state_after"]
    assert distinct > 0 and watched_excluded > 0, "the stream exercises both rules"


def test_takeover_candidates_by_a_and_b_and_synthesis_by_a(stream_records):
    """§4 Takeover: A and B each write a candidate, A synthesises them."""
    calls: dict[tuple[int, int], list[dict]] = {}
    for call in stream_records.calls:
        calls.setdefault((call["t"], call["visit"]), []).append(call)
    checked = 0
    for row in stream_records.reviews:
        if not row["takeover"]:
            continue
        a, b = row["committee_a"], row["committee_b"]
        these = calls[(row["t"], row["visit"])]
        assert sorted(c["agent"] for c in these if c["kind"] == "candidate") == sorted([a, b])
        assert [c["agent"] for c in these if c["kind"] == "synthesis"] == [a]
        checked += a != b
    assert checked > 0, "the stream has Takeovers with two distinct members"


def _engine(network, params: ProtocolParams, n_tasks: int = 42) -> R.ReferenceEngine:
    profile = network.profile
    stream = make_stream(0, profile.dataset_id, n_tasks, 7, (1,), ("all",))
    draws = D.stream_draws(0, profile.dataset_id, n_tasks)
    return R.ReferenceEngine(
        network, params, load_pair("default"), stream, HealthSchedule(6, n_tasks, ()), draws
    )


def _isolate(engine: R.ReferenceEngine, agent: int, probe_timer: int) -> None:
    world = engine.world
    world.state[agent] = R.ISOLATED
    world.probe_timer[agent] = probe_timer
    world.distance = world.distance_tables()


def test_budget_limits_may_be_reached_and_contribute_resets_moves_since_output(math_network):
    """§3.4: a task ends only when a counter would EXCEED its limit, and moves_since_output is reset
    by a Contribute. route_limit 1, move_limit 2: an isolated entry agent's RawRelay (moves 1, since
    1), a Contribute (since 0) and the handoff (moves 2, since 1) reach both limits, exceed none."""
    t = 1
    engine = _engine(math_network, ProtocolParams(route_limit=1, move_limit=2))
    entry = R.pick(float(engine.draws.entry[t - 1]), 6)
    _isolate(engine, entry, probe_timer=t)  # not probe-eligible
    engine.run_task(t)
    task = engine.records.tasks[-1]
    assert task["actions"] == "rawrelay,infer,contribute,handoff,finalize", task
    assert task["answered"] and task["moves"] == 2 and task["end"] == ""


def test_a_probe_redirect_that_reaches_the_move_limit_is_taken(math_network):
    """§3.4: only a probe redirect that would EXCEED the budget is skipped. With move_limit 1 the
    first visit's probe is the task's last allowed move; the neighbour is due exactly at t."""
    params = ProtocolParams(move_limit=1)
    t = 12
    engine = _engine(math_network, params)
    entry = R.pick(float(engine.draws.entry[t - 1]), 6)
    probed = (entry + 1) % 6
    _isolate(engine, probed, probe_timer=t - params.probe_interval)  # eligible: t - timer >= 10
    engine.run_task(t)
    task = engine.records.tasks[-1]
    assert task["actions"].split(",")[:2] == ["infer", "probe"], task
    assert task["route"].split("-")[:2] == [str(entry), str(probed)]
    assert engine.world.probe_timer[probed] == t
    assert [row["probe"] for row in engine.records.reviews] == [True]


def test_closure_needs_isolation_through_the_last_degraded_task():
    """§7: closure holds iff i in I_t for all c_i <= t < r_i; leaving isolation at t = r_i - 1
    breaks it (at t = r_i it does not: test_metrics)."""
    schedule = HealthSchedule(6, 100, ((2, 20, 60),))
    rows = [
        dict(method="meshheal", dataset="math", pair="default", seed=0, t=t, agent=2, z=2.0, reason="r",
             probe=probe, degraded=True, **{"from": f, "to": to})
        for t, f, to, probe in ((30, "normal", "isolated", False), (59, "isolated", "watched", True))
    ]  # fmt: skip
    out = metrics.agent_outcomes(metrics.frame("states", rows), schedule)[0]
    assert out["detection_delay"] == 10
    assert out["closure"] is False


def test_health_split_treats_the_recovery_task_as_healthy():
    """An agent degraded at b_i and recovered at r_i is degraded for b_i <= t < r_i (§7, streams)."""
    schedule = HealthSchedule(6, 10, ((2, 3, 6),))
    assert metrics.any_degraded(schedule).tolist() == [False, False, True, True, True] + [False] * 5
