"""Protocol rules that only the reference-vs-JAX comparison used to pin (a spec audit mutated
reference.py one rule at a time; the same mistake in both engines passed every other test):
neighbour-only reviewers, peers, comparison set and probes (§1), isolated relays (§2, §3), the
probe's committee and its budget rule (§3.4, §6), the detector's evidence (§4, §5), NextHop's
uniform ability pick and the wrong-pair draw (§3). Most of these only show on a sparse graph, where
tasks relay and not every holder is a neighbour: a ring of six. Reference engine, plain Python."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest

from meshheal_jax import draws as D
from meshheal_jax import reference as R
from meshheal_jax import topology
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import load_pair
from meshheal_jax.streams import HealthSchedule, make_stream, persistent_schedule

MATH = topology.load_profile("math")
P = ProtocolParams()
FROZEN = ProtocolParams(warmup_per_six=10**6)  # no transition ever: routing states stay as set
TOL = P.threshold_tol
MOVES = ("rawrelay", "relay", "probe", "handoff")
NEVER = 10**6  # a probe timer that keeps an isolated agent from ever being probe-eligible


def ring() -> topology.Network:
    """0-1-2-3-4-5-0 with the MATH profile: symbolic/arithmetic held by {0,1,2}, deduction and
    enumeration by {3,4,5}, figures by {0,2,3}, theorems/analytic by {1,4,5}. Agent 0's figure
    outputs have no same-ability neighbour (unreviewed); agent 3 reaches symbolic through 2."""
    return topology.build_network(MATH, 6, edges=np.array([[k, (k + 1) % 6] for k in range(6)]))


def complete() -> topology.Network:
    return topology.build_network(MATH, 6)


def engine_for(network, params=P, n_tasks=84, seed=0, schedule=None) -> R.ReferenceEngine:
    stream = make_stream(seed, MATH.dataset_id, n_tasks, 7, (1,), ("all",))
    draws = D.stream_draws(seed, MATH.dataset_id, n_tasks)
    schedule = schedule or HealthSchedule(network.n_agents, n_tasks, ())
    return R.ReferenceEngine(network, params, load_pair("default"), stream, schedule, draws)


def set_states(
    engine: R.ReferenceEngine, states: dict[int, str], timers: dict[int, int] | None = None
) -> None:
    world = engine.world
    for agent, state in states.items():
        world.state[agent] = state
    for agent, timer in (timers or {}).items():
        world.probe_timer[agent] = timer
    world.distance = world.distance_tables()


def steps(task: dict) -> list[tuple[str, int, int]]:
    """(action, from, to) per action of a task record; to == from for actions that are not moves."""
    route = [int(a) for a in task["route"].split("-")]
    out, at = [], 0
    for action in task["actions"].split(","):
        if action in MOVES:
            out.append((action, route[at], route[at + 1]))
            at += 1
        else:
            out.append((action, route[at], route[at]))
    assert at == len(route) - 1, task
    return out


def assert_moves_follow_edges(network, tasks) -> int:
    """§1: a task only ever moves to a direct neighbour. Returns the number of moves checked."""
    moves = 0
    for task in tasks:
        for action, i, j in steps(task):
            if action in MOVES:
                assert j in network.neighbours(i), (action, i, j, task)
                moves += 1
    return moves


# ----------------------------------------------------------------------------------------------
# §2/§3: an isolated agent reached as a relay writes nothing
# ----------------------------------------------------------------------------------------------


def test_isolated_relay_agent_makes_no_call_and_writes_nothing():
    """§2: an isolated agent's effective ability set is empty; a task reaching it on a shortest path
    (not a probe) is passed on with no LLM call. On the ring, with agent 2 isolated (never probe-
    eligible), agent 3's way to symbolic/arithmetic (held by 0, 1, 2) runs through 2, which holds
    them: it must relay, not Contribute."""
    network, x = ring(), 2
    engine = engine_for(network, FROZEN, n_tasks=84)
    set_states(engine, {x: R.ISOLATED}, {x: NEVER})
    records = engine.run()
    relays_through_x = 0
    for task in records.tasks:
        for action, i, _ in steps(task):
            if i == x and action in ("infer", "contribute", "finalize"):
                pytest.fail(f"isolated agent {x} acted: {task}")
            relays_through_x += action == "relay" and i == x
    assert relays_through_x >= 5, "the stream relays tasks through the isolated agent"
    assert all(task["answered"] for task in records.tasks)
    assert len(records.calls) > 84 * 4 and not [c for c in records.calls if c["agent"] == x], "no call by x"
    assert not [
        r for r in records.reviews if x in (r["author"], r["reviewer"], r["committee_a"], r["committee_b"])
    ]
    assert assert_moves_follow_edges(network, records.tasks) > 84


# ----------------------------------------------------------------------------------------------
# §4: reviewers are normal neighbours holding the ability
# ----------------------------------------------------------------------------------------------


def test_reviewers_are_normal_neighbours_under_fixed_states():
    """§4: E = neighbours of the author in state normal holding the ability. Complete graph, agent 1
    watched and agent 4 isolated (not probe-eligible) for the whole stream: neither ever reviews,
    sits on a committee, writes a Takeover candidate or synthesises; watched agent 1's outputs all
    get a committee."""
    network, watched, isolated = complete(), 1, 4
    engine = engine_for(network, FROZEN, n_tasks=84)
    set_states(engine, {watched: R.WATCHED, isolated: R.ISOLATED}, {isolated: NEVER})
    records = engine.run()
    holds = network.holds
    excluded = {watched: 0, isolated: 0}
    for row in records.reviews:
        assert row["author"] != isolated
        s = row["ability"]
        eligible = [
            j for j in network.neighbours(row["author"]) if holds[j, s] and j not in (watched, isolated)
        ]
        members = [row["reviewer"]] + ([row["committee_a"], row["committee_b"]] if row["committee"] else [])
        assert all(j in eligible for j in members), row
        for j in excluded:
            excluded[j] += bool(holds[j, s]) and j != row["author"]
        if row["author"] == watched:
            assert row["committee"] and row["state_before"] == R.WATCHED, row
    assert min(excluded.values()) > 10, "both excluded agents hold abilities that were reviewed"
    writers = {c["agent"] for c in records.calls if c["kind"] in ("review", "committee1", "committee2",
                                                                   "candidate", "synthesis")}  # fmt: skip
    assert len(writers) >= 3 and watched not in writers and isolated not in writers
    assert any(row["author"] == watched for row in records.reviews)


@pytest.fixture(scope="module")
def ring_streams():
    """Two 168-task MATH streams on the ring, A3 and A5 (agents 2 and 4) degraded from task 85:
    watched and isolated agents, probes, committees and unreviewed outputs all occur. Each task's
    score windows are snapshotted after it runs."""
    network = ring()
    out = []
    for seed in (0, 1):
        n = 168
        stream = make_stream(seed, MATH.dataset_id, n, 7, (1, 85), ("healthy", "degraded"))
        draws = D.stream_draws(seed, MATH.dataset_id, n)
        engine = R.ReferenceEngine(
            network, P, load_pair("default"), stream, persistent_schedule(6, n, (2, 4)), draws
        )
        windows = []
        for t in range(1, n + 1):
            engine.run_task(t)
            windows.append(
                {k: (w.count, sorted(w.slots[: w.filled()])) for k, w in engine.world.scores.items()}
            )
        out.append((engine.records, windows))
    return network, out


def test_reviewers_are_normal_neighbours_holding_the_ability_on_a_ring(ring_streams):
    """§1/§4 on a sparse graph: every reviewer and committee member is a direct neighbour of the
    author, normal (states replayed from the review rows) and holding the ability, though holders
    two hops away exist for every ability."""
    network, runs = ring_streams
    far_holders = 0
    for records, _ in runs:
        state = dict.fromkeys(range(6), R.NORMAL)
        for row in records.reviews:
            author, s = row["author"], row["ability"]
            near = network.neighbours(author)
            eligible = [j for j in near if network.holds[j, s] and state[j] == R.NORMAL]
            members = [row["reviewer"]] + (
                [row["committee_a"], row["committee_b"]] if row["committee"] else []
            )
            assert all(j in eligible for j in members), (row, eligible)
            far_holders += any(network.holds[j, s] for j in range(6) if j != author and j not in near)
            state[author] = row["state_after"]
    assert far_holders > 100


def test_moves_follow_edges_on_a_ring(ring_streams):
    network, runs = ring_streams
    for records, _ in runs:
        assert assert_moves_follow_edges(network, records.tasks) > 168


# ----------------------------------------------------------------------------------------------
# §4/§5: the evidence is the final score q, and only reviewed outputs give evidence
# ----------------------------------------------------------------------------------------------


def test_score_windows_hold_the_final_scores_of_reviewed_outputs(ring_streams):
    """§4: "the final score q (committee average where there was one) is the detector's evidence";
    an output with no eligible reviewer records none. Replaying each review row's q into a window
    of 8 per (author, type, ability) reproduces the engine's windows after every task."""
    _, runs = ring_streams
    committee_changed, unreviewed = 0, 0
    for records, windows in runs:
        types = {task["t"]: task["task_type"] for task in records.tasks}
        rows_by_t = defaultdict(list)
        for row in records.reviews:
            rows_by_t[row["t"]].append(row)
        replay = defaultdict(list)
        for task, after in zip(records.tasks, windows):
            t = task["t"]
            for row in rows_by_t[t]:
                replay[(row["author"], types[t], row["ability"])].append(row["q"])
                committee_changed += row["q"] != row["q0"]
            unreviewed += task["unreviewed"]
            for key, (count, values) in after.items():
                assert count == len(replay[key]), (t, key)
                assert values == sorted(replay[key][-P.window_scores :]), (t, key)
    assert committee_changed > 20 and unreviewed > 50, "committees changed q; some outputs went unreviewed"


def test_detector_replay_uses_neighbours_only(ring_streams):
    """§5 replayed independently from the review rows on the ring: P and C come from the author's
    normal NEIGHBOURS only; every z and new state matches the engine's."""
    network, runs = ring_streams
    formed, transitions = 0, 0
    for records, _ in runs:
        types = {task["t"]: task["task_type"] for task in records.tasks}
        near = {i: network.neighbours(i) for i in range(6)}
        scores, short, n_x = defaultdict(list), defaultdict(list), defaultdict(int)
        state, consecutive = [R.NORMAL] * 6, [0] * 6
        warmup = P.warmup_tasks(6)
        for row in records.reviews:
            i, s, q, t = row["author"], row["ability"], row["q"], row["t"]
            ty = types[t]
            assert row["state_before"] == state[i], row
            peers = [j for j in near[i] if state[j] == R.NORMAL and scores[(j, ty, s)]]
            scores[(i, ty, s)] = (scores[(i, ty, s)] + [q])[-8:]
            z, new = None, state[i]
            if peers:
                qbar = sum(sum(scores[(j, ty, s)]) / len(scores[(j, ty, s)]) for j in peers) / len(peers)
                short[(i, ty, s)] = (short[(i, ty, s)] + [qbar - q])[-8:]
                n_x[(i, ty, s)] += 1
                pool = sorted(
                    sum(short[(j, ty, a)]) / len(short[(j, ty, a)])
                    for j in near[i]
                    if state[j] == R.NORMAL
                    for a in range(7)
                    if n_x[(j, ty, a)] >= 3
                )
                if t > warmup and n_x[(i, ty, s)] >= 3 and pool:
                    xbar = sum(short[(i, ty, s)]) / len(short[(i, ty, s)])
                    m, p25 = _quantile(pool, 0.5), _quantile(pool, 0.25)
                    z = (xbar - m) / max(m - p25, 0.10)
                    consecutive[i] = consecutive[i] + 1 if z >= 2.0 - TOL else 0
                    if state[i] != R.ISOLATED and consecutive[i] >= 2:
                        new, consecutive[i] = R.ISOLATED, 0
                    elif state[i] == R.NORMAL and z >= 1.2 - TOL:
                        new = R.WATCHED
                    elif state[i] == R.WATCHED and z < 1.2 - TOL:
                        new = R.NORMAL
                    elif state[i] == R.ISOLATED and z < 2.0 - TOL:
                        new = R.WATCHED
            if z is None:
                assert row["z"] is None, row
            else:
                assert row["z"] == pytest.approx(z, abs=1e-9), row
                formed += 1
            assert row["state_after"] == new, row
            transitions += new != state[i]
            state[i] = new
    assert formed > 50 and transitions > 10


def _quantile(values: list[float], q: float) -> float:
    pos = q * (len(values) - 1)
    lo, hi = values[math.floor(pos)], values[math.ceil(pos)]
    return lo + (hi - lo) * (pos - math.floor(pos))


@pytest.fixture
def ring_world() -> R.ReferenceNetwork:
    """Agent 0 on the ring: neighbours 1 and 5; agents 2, 3 and 4 are not its neighbours."""
    return R.ReferenceNetwork(ring(), P, 7)


def _give(world, j, ty=0, s=0, score=1.0, shortfall=None, n=3):
    world.scores[(j, ty, s)].push(score)
    if shortfall is not None:
        for _ in range(n):
            world.shortfalls[(j, ty, s)].push(shortfall)
        world.n_shortfalls[(j, ty, s)] = n


def test_peer_set_P_ignores_agents_that_are_not_neighbours(ring_world):
    """§5 step 1: P = NEIGHBOURS j with a score window for (T, s). Only non-neighbours have one:
    P is empty, so no shortfall is recorded (the own score still is)."""
    for j in (2, 3, 4):
        _give(ring_world, j, score=1.0, shortfall=0.0)
    out = ring_world.observe(0, 0, 0, 0.0, 100, 30)
    assert out["z"] is None
    assert ring_world.scores[(0, 0, 0)].filled() == 1
    assert ring_world.n_shortfalls[(0, 0, 0)] == 0 and ring_world.shortfalls[(0, 0, 0)].filled() == 0
    _give(ring_world, 1, score=0.5)  # a neighbour with a window: P = {1}, x = 0.5 - 0.0
    ring_world.observe(0, 0, 0, 0.0, 101, 30)
    assert ring_world.n_shortfalls[(0, 0, 0)] == 1
    assert ring_world.shortfalls[(0, 0, 0)].mean() == pytest.approx(0.5)


def test_comparison_set_C_ignores_agents_that_are_not_neighbours(ring_world):
    """§5 step 7: C holds NEIGHBOURS' shortfall means only. Neighbours 1 and 5 have score windows
    (P non-empty) but too few shortfalls; non-neighbours have plenty: C is empty, no z. Then with
    neighbours' C = {0.0, 0.2} (m = 0.1, p25 = 0.05 -> scale 0.10) and very different non-neighbour
    means, z is the neighbours-only value."""
    for j in (1, 5):
        _give(ring_world, j, score=1.0, shortfall=0.0, n=2)
    for j in (2, 3, 4):
        _give(ring_world, j, score=1.0, shortfall=5.0, n=3)
    outs = [ring_world.observe(0, 0, 0, 0.5, t, 30) for t in (100, 101, 102, 103)]
    assert all(out["z"] is None for out in outs) and ring_world.n_shortfalls[(0, 0, 0)] == 4
    assert ring_world.state[0] == R.NORMAL
    _give(ring_world, 1, s=3, shortfall=0.0, n=3)  # another ability of the same type counts (s')
    _give(ring_world, 5, s=4, shortfall=0.2, n=3)
    out = ring_world.observe(0, 0, 0, 0.5, 104, 30)  # own shortfalls: five of 1.0 - 0.5
    assert out["z"] == pytest.approx((0.5 - 0.1) / 0.10)


# ----------------------------------------------------------------------------------------------
# §3.4/§6: recovery probes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe_run():
    """The ring, agent 2 isolated (and healthy) for the whole stream, made probe-eligible again
    before every task (timer = t - probe_interval)."""
    network, x = ring(), 2
    n = 168
    engine = engine_for(network, FROZEN, n_tasks=n)
    set_states(engine, {x: R.ISOLATED})
    for t in range(1, n + 1):
        engine.world.probe_timer[x] = t - P.probe_interval
        engine.run_task(t)
    engine.records.calls = engine.backend.calls
    return network, x, engine.records


def test_probe_outputs_get_a_committee(probe_run):
    """§6: the probe's output gets mandatory committee review, also when q0 > tau_to and
    s_u < sigma_com would not call one (the probed agent is isolated, not watched)."""
    _, x, records = probe_run
    probes = [row for row in records.reviews if row["probe"]]
    assert probes and all(row["author"] == x and row["state_before"] == R.ISOLATED for row in probes)
    assert all(row["committee"] for row in probes), [r for r in probes if not r["committee"]]
    forced = [row for row in probes if row["q0"] > P.tau_to + TOL and row["s_u"] < P.sigma_com - TOL]
    assert len(forced) >= 5, "probe outputs a committee was called for only because they are probes"
    committee_visits = {(c["t"], c["visit"]) for c in records.calls if c["kind"] == "committee2"}
    assert all((row["t"], row["visit"]) in committee_visits for row in forced)


def test_probes_go_to_eligible_neighbours_holding_a_missing_ability(probe_run):
    """§3: the probe candidates are the probe-eligible NEIGHBOURS j with K_j ∩ M non-empty. Every
    probe is a move along an edge, after which the probed agent writes (Contribute or Finalize), and
    the probe timer is set; visits next to the eligible agent whose missing ability it does not hold
    are not redirected."""
    network, x, records = probe_run
    assert_moves_follow_edges(network, records.tasks)
    n_probes = 0
    for task in records.tasks:
        acts = steps(task)
        for k, (action, i, j) in enumerate(acts):
            if action == "probe":
                n_probes += 1
                assert j == x and i in network.neighbours(x), task
                assert acts[k + 1][0] in ("contribute", "finalize") and acts[k + 1][1] == x, task
    assert n_probes >= 20
    # a task with no probe that visits a neighbour of the (always eligible) agent: its M there is
    # not held by it (the second visit, after a Contribute of the ability it does hold)
    passed_by = [
        task for task in records.tasks if "probe" not in task["actions"]
        and any(i in network.neighbours(x) for action, i, _ in steps(task) if action != "infer")
    ]  # fmt: skip
    assert len(passed_by) >= 3, "visits next to the eligible agent that lacks M's ability"
    tasks = {task["t"]: task for task in records.tasks}
    far_entries = [t for t in tasks.values() if t["entry"] not in network.neighbours(x) + [x]]
    assert any("probe" in t["actions"] for t in far_entries), "probes after a Contribute, away from the entry"


def test_probe_skipped_for_budget_leaves_the_timer():
    """§3.4: a probe redirect that would exceed the budget is skipped, timer unchanged. Complete
    graph, route_limit 1: the entry agent is isolated (never eligible), so its RawRelay spends the
    route budget and no visit may probe; agent x, eligible and a neighbour of every visit, keeps
    its timer."""
    params = ProtocolParams(route_limit=1)
    network = complete()
    checked = 0
    for t in range(11, 41):
        engine = engine_for(network, params, n_tasks=42)
        entry = R.pick(float(engine.draws.entry[t - 1]), 6)
        x = (entry + 3) % 6
        timer = t - params.probe_interval  # due exactly now
        set_states(engine, {entry: R.ISOLATED, x: R.ISOLATED}, {entry: NEVER, x: timer})
        engine.run_task(t)
        task = engine.records.tasks[-1]
        assert task["actions"] == "rawrelay,infer,contribute,handoff,finalize", task
        assert engine.world.probe_timer[x] == timer, task
        checked += 1
    assert checked == 30


# ----------------------------------------------------------------------------------------------
# §3: NextHop's uniform ability pick and the wrong-pair draw
# ----------------------------------------------------------------------------------------------


def test_next_hop_picks_the_missing_ability_with_the_visit_draw():
    """§3 NextHop(i, M): M in vocabulary order, s = M[pick(u, |M|)]. With the packaged profiles every
    agent holds one ability of every pair, so |M| = 2 at a Handoff needs an agent holding neither:
    here agent 0 holds nothing (a network built past the profile rules). A task entering at 0 hands
    off toward the drawn ability: on the complete graph straight to one of its holders."""
    base = complete()
    holds = base.holds.copy()
    holds[0, :] = False
    network = dataclasses.replace(base, holds=holds)
    engine = engine_for(network, FROZEN, n_tasks=168)
    records = engine.run()
    picked = defaultdict(int)
    for task in records.tasks:
        if task["entry"] != 0:
            continue
        assert task["actions"].split(",")[:2] == ["infer", "handoff"], task
        missing = sorted(MATH.pairs[task["inferred_pair"]])
        k = R.pick(float(engine.draws.route[task["t"] - 1][0][D.HOP_ABILITY]), 2)
        to = int(task["route"].split("-")[1])
        assert holds[to, missing[k]], (task, missing, k)
        picked[k] += 1
    assert picked[0] >= 3 and picked[1] >= 3, picked


def test_next_hop_ties_are_drawn_with_the_visit_draw():
    """§2: the next hops for s are the neighbours one hop nearer an eligible provider (BFS here),
    in increasing index, and a tie is broken by the visit's tie draw, not by the lowest index. On
    the ring, all normal, every Handoff after the Contribute heads for the Finalize's ability."""
    network = ring()
    engine = engine_for(network, FROZEN, n_tasks=84)
    records = engine.run()
    far = {}
    for s in range(7):
        holders = [j for j in range(6) if network.holds[j, s]]
        far[s] = [min(min(abs(i - j), 6 - abs(i - j)) for j in holders) for i in range(6)]
    ties = defaultdict(int)
    for task in records.tasks:
        t = task["t"]
        (s,) = [c["ability"] for c in engine.backend.calls if c["t"] == t and c["kind"] == "generate"][-1:]
        moves = [(i, j) for action, i, j in steps(task) if action in MOVES]
        assert [a for a in task["actions"].split(",") if a in MOVES] == ["handoff"] * len(moves), task
        for k, (i, j) in enumerate(moves):
            hops = [n for n in network.neighbours(i) if far[s][n] == far[s][i] - 1]
            assert j == hops[R.pick(float(engine.draws.route[t - 1][k][D.HOP_TIE]), len(hops))], task
            if len(hops) > 1:
                ties[hops.index(j)] += 1
    assert ties[0] >= 3 and ties[1] >= 3, ties


def test_wrong_pair_is_drawn_among_the_other_pairs():
    """§3: a wrong inference draws uniformly among the DISTINCT documented pairs other than the
    true one (listed in order of first appearance); never the true pair."""
    engine = engine_for(complete(), P, n_tasks=42)
    emu = engine.backend
    n_pairs = len(MATH.pairs)
    assert n_pairs == 6
    for true_pair in range(n_pairs):
        others = [k for k in range(n_pairs) if k != true_pair]
        for k, other in enumerate(others):
            for frac in (0.01, 0.5, 0.99):
                u = np.array([0.999999, (k + frac) / len(others), 0.5])
                ctx = dict(t=1, visit=0, author=-1)
                assert emu.infer(ctx, 0, 1, true_pair, n_pairs, u) == other
        assert (
            emu.infer(dict(t=1, visit=0, author=-1), 0, 1, true_pair, n_pairs, np.array([0.0, 0.5, 0.5]))
            == true_pair
        )
    assert [c["correct"] for c in emu.calls].count(False) == n_pairs * (n_pairs - 1) * 3
