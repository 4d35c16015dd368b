"""The baselines' `task_step` wiring: that the learned state each method keeps is what its routing
reads and what its feedback writes, and that every model call spec/baselines.md names is in the
records. The mechanisms' pure functions are tested on hand-built cases in test_baselines.py; a
mutation audit found that these wirings could be broken with every other test passing:

- RAPS's broker reading the prior instead of the learned reputation (spec: "exclude those with
  E[P] >= τ_rep = 0.7 ... reputation acts on later routing only");
- AgentNet's router reading its initial state (spec: the best score "0.4·ability + 0.3·(1 − load/3)
  + 0.2·success_rate + 0.1" over unpruned edges), its feedback credited to the finalizer only
  (spec: "credited to every agent on the route"), its router calls left out of the records (spec:
  "one router call per forward, tokens counted");
- AutoGen's compose call left out of the records (spec: the manager "composes the final reply
  (one call)");
- RAPS's broker reading the reputation as it was at the task's start, before this task's watchdog
  (raps.py: "the posterior is updated at the watchdog call, before the receiver's own next-hop
  decision"). No bbh graph can show it (see THREE below): RAPS also runs on a made-up three-ability
  mapping, besides the complete graph and a line (longer routes, shared-path relays).

Each test replays a rule from the records of one emulated 504-task stream (one compiled program
per method, shared by the module's fixtures). RAPS runs its earlier watchdog rule, judge_rule
"caller" (decisions B0), passed explicitly: the wiring is the same under either rule, and this
stream's exclusions were worked out under it; no test depends on whether a compose corrupts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import numpy as np
import pytest

from meshheal_jax import draws as D
from meshheal_jax.baselines import BaselineSpec, agentnet, autogen, raps, simulate
from meshheal_jax.baselines import common as C
from meshheal_jax.params import load_pair
from meshheal_jax.streams import HealthSchedule, make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

N_TASKS = 504
SEED = 0
PAIR = load_pair("default")
PROFILE = load_profile("bbh")
COMPLETE = build_network(PROFILE)
# a path A1-A2-...-A6: tasks forward up to 3 times, some edges lose every neighbour ("no route")
LINE = build_network(PROFILE, edges=np.asarray([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]))
STREAM = make_stream(SEED, PROFILE.dataset_id, N_TASKS, 7, (1, N_TASKS // 2 + 1), ("healthy", "degraded"))
MIDPOINT = persistent_schedule(6, N_TASKS, COMPLETE.degraded_targets)  # A3, A5 from task 253
# A3 and A5 degraded for the whole stream: their parts are often wrong from the first task, so the
# watchdogs of their receivers push E[P] past τ_rep = 0.7 often enough for exclusion to bind
WHOLE = HealthSchedule(6, N_TASKS, tuple((a, 1, N_TASKS + 1) for a in COMPLETE.degraded_targets))
ROUTE_U = np.asarray(D.stream_draws(SEED, PROFILE.dataset_id, N_TASKS).route)  # (n_tasks, visits, N_ROUTE)
CONTROL_U = np.asarray(C.stream_uniforms(SEED, PROFILE.dataset_id, N_TASKS).control)  # (n_tasks, 32, 4)


def spec(network, schedule, method: str) -> BaselineSpec:
    labels = {"method": method, "dataset": "bbh", "pair": "default", "seed": SEED}
    return BaselineSpec(network, STREAM, schedule, labels)


def stream_k(tree, k: int):
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[k], tree)


def pick(u: float, mask: np.ndarray) -> int:
    """The uniform pick among a mask's True indices (spec/architecture.md), -1 when none."""
    idx = np.flatnonzero(mask)
    return -1 if idx.size == 0 else int(idx[min(int(np.floor(u * idx.size)), idx.size - 1)])


def agents_of(route: np.ndarray) -> list[int]:
    """A single-execution task's route, padding and separator dropped."""
    return [int(a) for a in route if a >= 0]


def required_abilities(world: C.World, inferred_pair: int) -> np.ndarray:
    return np.asarray(world.pair_abilities)[inferred_pair].copy()


def generated_at(calls: C.Call, t: int, v: int) -> list[int]:
    """Abilities generated for (Contribute or Finalize) at visit v of task index t."""
    mask = calls.valid[t] & (calls.kind[t] == C.K_GENERATE) & (calls.visit[t] == v)
    return [int(a) for a in calls.ability[t][mask]]


# ================================================================================================
# RAPS: the broker excludes holders by the reputation learned from earlier watchdogs
# ================================================================================================

RAPS_PARAMS = raps.RAPSParams(judge_rule="caller", watchdog_threshold=0.40, tau_rep=0.7)
# Under abilities.md every task needs two abilities held by disjoint agent sets: its one watchdog
# (by the receiver of its one Contribute) judges an author that holds none of the ability still
# missing, so whether the receiver's broker reads the posterior before or after that watchdog
# changes no pick, on any graph. In this made-up mapping every task needs three (mathematical,
# sequence, logical): A1 and A3 hold the first two, A2 the first and last, so after one of them
# contributes, a receiver that contributes another forwards among holders that include the author
# it has just judged, on the posterior that watchdog updated (raps.py: "before the receiver's own
# next-hop decision"). Such a watchdog changes a pick only when it moves E[P] across τ_rep = 0.7;
# with A1, A3 and A4 degraded for the whole stream that happens 14 times in this stream (with bbh's
# targets A3 and A5, twice).
THREE = build_network(dataclasses.replace(PROFILE, requires=((0, 3, 4),) * len(PROFILE.task_types)))
THREE_HEALTH = HealthSchedule(6, N_TASKS, tuple((a, 1, N_TASKS + 1) for a in (0, 2, 3)))
RAPS_GRAPHS = (("complete", COMPLETE, WHOLE), ("line", LINE, WHOLE), ("three-ability", THREE, THREE_HEALTH))


class Forward(NamedTuple):
    """One forward of a RAPS task as the replay sees it."""

    t: int
    agent: int
    candidates: np.ndarray  # neighbours holding the missing ability (none: a shared-path relay)
    allowed: np.ndarray  # candidates with E[P] < 0.7
    p: np.ndarray  # the agent's E[P] row at the decision
    want: int  # the broker's pick on that row (or the relay's hop)
    chosen: int  # where the task went
    on_prior: int  # the pick on the prior Beta(1, 1)
    on_start: int  # the pick on the task-start posterior (before this task's watchdog)
    judged: bool  # the agent made a watchdog earlier in this task (its own, at or before this visit)


def raps_replay(world: C.World, out: C.TaskOut) -> list[Forward]:
    """Every forward of a RAPS stream replayed: the Beta counts rebuilt in numpy from the reviews
    table (x <- λx + s, y <- λy + (1 − s), s = 1[score <= 0.40], updated at the watchdog, before
    the receiver's own next hop), the broker's pick (uniform among the allowed holders by the
    visit's HOP_TIE draw, the lowest E[P] when all are excluded) or, when no neighbour holds the
    missing ability, the shared shortest-path relay (a neighbour one hop closer to its nearest
    holder, by the same HOP_TIE draw)."""
    holds, adjacency = np.asarray(world.holds), np.asarray(world.adjacency)
    hops = np.asarray(world.hop_distance)
    lam, tau = RAPS_PARAMS.lam, RAPS_PARAMS.tau_rep
    x = np.full((6, 6), RAPS_PARAMS.prior_x)
    y = np.full((6, 6), RAPS_PARAMS.prior_y)
    rv = out.reviews

    def broker(p, agent, s, u_tie):
        candidates = adjacency[agent] & holds[:, s]
        allowed = candidates & ~(p >= tau - C.TOL)
        if allowed.any():
            return candidates, allowed, pick(u_tie, allowed)
        if candidates.any():
            return candidates, allowed, int(np.argmin(np.where(candidates, p, np.inf)))
        return candidates, allowed, pick(u_tie, adjacency[agent] & (hops[:, s] == hops[agent, s] - 1))

    decisions = []
    for t in range(N_TASKS):
        route = agents_of(out.route[t])
        covered = np.zeros(holds.shape[1], bool)
        required = required_abilities(world, int(out.inferred_pair[t]))
        x0, y0 = x.copy(), y.copy()
        judges = set()
        for v, agent in enumerate(route):
            for k in np.flatnonzero(rv.valid[t] & (rv.visit[t] == v)):
                i, j = int(rv.reviewer[t, k]), int(rv.author[t, k])
                bad = float(rv.score[t, k] <= RAPS_PARAMS.watchdog_threshold + C.TOL)
                x[i, j], y[i, j] = lam * x[i, j] + bad, lam * y[i, j] + (1.0 - bad)
                judges.add(i)
            covered[generated_at(out.calls, t, v)] = True
            if v + 1 == len(route):
                break
            s = pick(ROUTE_U[t, v, D.HOP_ABILITY], required & ~covered)
            u_tie = ROUTE_U[t, v, D.HOP_TIE]
            p = x[agent] / (x[agent] + y[agent])
            candidates, allowed, want = broker(p, agent, s, u_tie)
            on_prior = broker(np.full(6, 0.5), agent, s, u_tie)[2]
            on_start = broker(x0[agent] / (x0[agent] + y0[agent]), agent, s, u_tie)[2]
            decisions.append(
                Forward(
                    t + 1,
                    agent,
                    candidates,
                    allowed,
                    p,
                    want,
                    route[v + 1],
                    on_prior,
                    on_start,
                    agent in judges,
                )
            )
    return decisions


@pytest.fixture(scope="module")
def raps_decisions():
    """graph name -> every forward of its RAPS stream (the bbh graphs with A3/A5 degraded for the
    whole stream), the three streams in one vmapped program."""
    specs = [spec(network, health, "raps") for _, network, health in RAPS_GRAPHS]
    _, outs = simulate("raps", specs, PAIR, RAPS_PARAMS)
    return {
        name: raps_replay(C.make_world(network, STREAM, health, k), stream_k(outs, k))
        for k, (name, network, health) in enumerate(RAPS_GRAPHS)
    }


@pytest.mark.parametrize("graph", [name for name, *_ in RAPS_GRAPHS])
def test_raps_never_routes_to_an_excluded_holder_while_another_is_allowed(raps_decisions, graph):
    """Once i's watchdogs on j's outputs put E[P_ij] >= 0.7, i's broker stops routing to j while
    another holder of the ability is allowed; before that it did route to j."""
    decisions = raps_decisions[graph]
    relays = sum(not d.candidates.any() for d in decisions)
    if graph == "line":  # A1-A6: some forwards find no neighbour holding the ability and relay
        assert relays > 0
    else:  # a complete graph: always a holder
        assert relays == 0
    routed_before: dict[tuple[int, int], int] = {}  # (i, j) -> first task i routed to j
    excluded_later = set()
    binding = 0
    for d in decisions:
        if not d.candidates.any():
            continue
        assert d.candidates[d.chosen], (graph, d.t, d.agent, d.chosen)
        if d.allowed.any():
            assert d.allowed[d.chosen], (
                f"{graph} task {d.t}: {d.agent} routed to {d.chosen} with E[P] = {d.p[d.chosen]:.3f} >= 0.7"
            )
        binding += int((d.candidates & ~d.allowed).any())
        routed_before.setdefault((d.agent, d.chosen), d.t)
        for j in np.flatnonzero(d.candidates & ~d.allowed):
            if routed_before.get((d.agent, int(j)), N_TASKS + 1) < d.t:
                excluded_later.add((d.agent, int(j)))
    print(f"\nRAPS {graph}: exclusion binds in {binding} of {len(decisions)} forwards ({relays} relays)")
    assert binding >= 50  # complete 223 of 504, line 147 of 750, three-ability 457 of 914 in this stream
    assert excluded_later  # a holder routed to once, excluded after its receiver's watchdogs


@pytest.mark.parametrize("graph", [name for name, *_ in RAPS_GRAPHS])
def test_raps_broker_pick_replays_from_the_learned_reputation(raps_decisions, graph):
    """Every forward is the broker's pick on the reputation at that moment, updated by this task's
    own watchdog when the forwarding agent made it (or the relay's hop when no neighbour holds the
    ability); that pick often differs from the one the prior Beta(1, 1) would make, and where the
    forwarding agent judged the author it may route to, from the one the task-start posterior would
    make."""
    decisions = raps_decisions[graph]
    for d in decisions:
        assert d.chosen == d.want, (graph, d.t, d.agent, d.chosen, d.want, np.round(d.p, 3))
    differs = sum(d.want != d.on_prior for d in decisions)
    judged = [d for d in decisions if d.judged]
    on_start = sum(d.want != d.on_start for d in judged)
    print(
        f"\nRAPS {graph}: {differs} of {len(decisions)} picks differ from the prior's; {len(judged)} "
        f"forwards after the agent's own watchdog, {on_start} differ from the task-start posterior's"
    )
    # complete 78 of 504, line 12 of 750 (246 relays, many single holders), three-ability 284 of 914
    assert differs >= {"complete": 20, "line": 5, "three-ability": 50}[graph]
    if graph == "complete":  # every task: entry -> one forward -> finalize
        assert not judged
    else:  # longer routes: a receiver forwards after its own watchdog
        assert len(judged) >= 50  # line 169, three-ability 410 in this stream
    if graph == "three-ability":
        assert on_start >= 5  # 14 in this stream
    else:  # abilities.md: the judged author never holds the missing ability
        assert on_start == 0


# ================================================================================================
# AgentNet: the router reads the learned state; feedback credits every agent on the route
# ================================================================================================

AN_PARAMS = agentnet.AgentNetParams()
AN_GRAPHS = (("complete", COMPLETE), ("line", LINE))


@pytest.fixture(scope="module")
def agentnet_runs():
    """graph name -> (world, final state, TaskOut) of one stream each (A3/A5 degraded from the
    midpoint), both graphs in one vmapped program."""
    specs = [spec(network, MIDPOINT, "agentnet") for _, network in AN_GRAPHS]
    states, outs = simulate("agentnet", specs, PAIR, AN_PARAMS)
    return {
        name: (C.make_world(network, STREAM, MIDPOINT, k), stream_k(states, k), stream_k(outs, k))
        for k, (name, network) in enumerate(AN_GRAPHS)
    }


@functools.cache
def _an_functions():
    return (
        jax.jit(functools.partial(agentnet.router_decision, AN_PARAMS)),
        jax.jit(functools.partial(agentnet.update_edges, AN_PARAMS)),
        jax.jit(functools.partial(agentnet.credit_agents, AN_PARAMS)),
    )


def agentnet_replay(world: C.World, out: C.TaskOut):
    """The learned state task by task from the records (the pure update functions fed with what
    the spec says: success = the task's final correctness; every agent on the route credited; the
    abilities each agent generated for; each forward edge of the route), and every router decision
    recomputed on the state before its task and on the initial state. Returns (final state,
    [(t, visit, agent, decision, decision on the initial state, next agent or -1, pruned
    neighbours)])."""
    decide, update_edges, credit = _an_functions()
    p_decide = np.asarray(C.make_emu(PAIR, PROFILE).p_decide)
    degraded = np.asarray(world.degraded)
    adjacency, holds = np.asarray(world.adjacency), np.asarray(world.holds)
    initial = agentnet.init_state(AN_PARAMS, world)
    state = initial
    decisions = []
    for t in range(N_TASKS):
        ty = int(STREAM.task_type[t])
        route = agents_of(out.route[t])
        required = required_abilities(world, int(out.inferred_pair[t]))
        covered = np.zeros(holds.shape[1], bool)
        n_asked = len(route) - 1 + int(out.end[t] == C.E_NO_ROUTE)  # the last may find no route
        for v in range(n_asked):
            agent = route[v]
            covered[generated_at(out.calls, t, v)] = True
            s = pick(ROUTE_U[t, v, D.HOP_ABILITY], required & ~covered)
            uc = CONTROL_U[t, min(v, C.N_CONTROL - 1)]
            role = C.WEAK if degraded[t + 1, agent] else C.STRONG
            decide_ok = uc[D.U_MAIN] < p_decide[role]
            args = (adjacency, agent, s, ty, decide_ok, uc[D.U_AUX], ROUTE_U[t, v, D.HOP_TIE])
            usable = np.asarray(agentnet.routable(AN_PARAMS, adjacency, state.edge_weight))[agent]
            nxt = route[v + 1] if v + 1 < len(route) else -1
            want, on_initial = int(decide(state, *args)[0]), int(decide(initial, *args)[0])
            decisions.append((t + 1, v, agent, want, on_initial, nxt, adjacency[agent] & ~usable))
        success = bool(out.correct[t])
        used_edges = np.zeros(adjacency.shape, bool)
        used_edges[route[:-1], route[1:]] = True
        on_route = np.zeros(holds.shape[0], bool)
        on_route[route] = True
        gens = out.calls.valid[t] & (out.calls.kind[t] == C.K_GENERATE)
        used = np.zeros(holds.shape, bool)
        used[out.calls.agent[t][gens], out.calls.ability[t][gens]] = True
        state = update_edges(state, used_edges, success)
        state = credit(state, on_route, used, ty, success, world.type_abilities)
    return jax.tree_util.tree_map(np.asarray, state), decisions


@pytest.fixture(scope="module")
def agentnet_replays(agentnet_runs):
    return {name: agentnet_replay(world, out) for name, (world, _, out) in agentnet_runs.items()}


@pytest.mark.parametrize("graph", [name for name, _ in AN_GRAPHS])
def test_agentnet_router_decides_on_the_learned_state(agentnet_runs, agentnet_replays, graph):
    """Every forward (and every "no route" end) is the router's decision on the abilities, success
    rates and edge weights learned from the earlier tasks; many differ from the decision on the
    initial estimates, and a pruned edge (w <= 0.3) is never forwarded along."""
    _, _, out = agentnet_runs[graph]
    _, decisions = agentnet_replays[graph]
    assert len(decisions) > N_TASKS // 2
    for t, v, agent, want, _, nxt, _ in decisions:
        assert nxt == want, (graph, t, v, agent, nxt, want)
    differs = sum(want != on_initial for _, _, _, want, on_initial, _, _ in decisions)
    pruned_seen = sum(pruned.any() for *_, pruned in decisions)  # decisions with a pruned neighbour
    for t, v, agent, _, _, nxt, pruned in decisions:
        assert nxt < 0 or not pruned[nxt], f"{graph} task {t}: {agent} forwarded to {nxt} over a pruned edge"
    print(
        f"\nAgentNet {graph}: {differs} of {len(decisions)} router decisions differ from the initial state's"
    )
    assert differs >= 50  # complete 328 of 508, line 133 of 774 in this stream
    assert pruned_seen > 0
    if graph == "line":  # pruned edges leave an agent no usable neighbour: the task ends, no route
        assert (out.end == C.E_NO_ROUTE).any()


@pytest.mark.parametrize("graph", [name for name, _ in AN_GRAPHS])
def test_agentnet_feedback_is_credited_to_every_agent_on_the_route(agentnet_runs, agentnet_replays, graph):
    """Per agent and task type, the tasks it was on the route of and the successes among them
    (not only the finalizer's); and the whole learned state equals its replay from the records."""
    _, state, out = agentnet_runs[graph]
    totals = np.zeros((6, len(PROFILE.task_types)), np.int64)
    successes = np.zeros_like(totals)
    shared = 0  # successful tasks with agents on the route besides the finalizer
    for t in range(N_TASKS):
        route = set(agents_of(out.route[t]))
        ty = int(STREAM.task_type[t])
        for a in route:
            totals[a, ty] += 1
            successes[a, ty] += int(out.correct[t])
        shared += len(route) > 1 and bool(out.correct[t])
    assert shared > 100
    np.testing.assert_array_equal(state.totals, totals)
    np.testing.assert_array_equal(state.successes, successes)
    replayed, _ = agentnet_replays[graph]
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), state, replayed
    )


@pytest.mark.parametrize("graph", [name for name, _ in AN_GRAPHS])
def test_agentnet_records_one_router_call_per_forward(agentnet_runs, graph):
    """One router call per forward, by the forwarding agent at its visit, tokens counted in the
    calls and tasks tables; a router call that finds no unpruned neighbour is counted too (the
    task ends "no route"), a forward past the limit of 3 is not asked."""
    _, _, out = agentnet_runs[graph]
    frames = C.frames(out, STREAM, MIDPOINT, PAIR, {"method": "agentnet"})
    calls = frames["calls"].to_dicts()
    tasks = frames["tasks"].to_dicts()
    by_task: dict[int, list[dict]] = {}
    for c in calls:
        if c["kind"] == "router":
            by_task.setdefault(c["t"], []).append(c)
            assert c["prompt_tokens"] > 0 and c["completion_tokens"] > 0
    total = 0
    for task in tasks:
        route = [int(a) for a in task["route"].split("-")]
        forwards = task["actions"].split(",").count("forward")
        assert forwards == len(route) - 1 == task["moves"]
        routers = by_task.get(task["t"], [])
        want = forwards + (task["end"] == "no route")
        assert len(routers) == want, f"task {task['t']}: {len(routers)} router calls, {forwards} forwards"
        assert [(c["visit"], c["agent"]) for c in routers] == list(enumerate(route))[:want], task["t"]
        total += forwards
        task_calls = [c for c in calls if c["t"] == task["t"]]
        assert task["calls"] == len(task_calls)
        assert task["tokens"] == sum(c["prompt_tokens"] + c["completion_tokens"] for c in task_calls)
    assert total > N_TASKS // 2


# ================================================================================================
# AutoGen: the manager composes the final reply in one recorded call
# ================================================================================================


@pytest.fixture(scope="module")
def autogen_run():
    params = autogen.AutoGenParams()
    _, outs = simulate("autogen", [spec(COMPLETE, MIDPOINT, "autogen")], PAIR, params)
    out = stream_k(outs, 0)
    return params, out, C.frames(out, STREAM, MIDPOINT, PAIR, {"method": "autogen"})


def test_autogen_manager_composes_every_reply_in_one_recorded_call(autogen_run):
    """Every task (all answered) has exactly one compose call, the manager's, last, after the
    finalizing worker's generation; it carries the task's final answer and its tokens are counted."""
    params, out, frames = autogen_run
    calls = frames["calls"].to_dicts()
    tasks = frames["tasks"].to_dicts()
    assert all(task["answered"] for task in tasks)
    by_task: dict[int, list[dict]] = {}
    for c in calls:
        by_task.setdefault(c["t"], []).append(c)
    for task in tasks:
        mine = by_task[task["t"]]
        composes = [c for c in mine if c["kind"] == "compose"]
        assert len(composes) == 1, f"task {task['t']}: {len(composes)} compose calls"
        (compose,) = composes
        assert mine[-1] is compose and compose["agent"] == params.manager == compose["author"]
        assert compose["visit"] == 2 * autogen.PARTS
        assert compose["answer_id"] == task["answer_id"] and compose["correct"] == task["correct"]
        assert compose["prompt_tokens"] > 0 and compose["completion_tokens"] > 0
        assert task["actions"].split(",")[-1] == "compose"
        assert task["calls"] == len(mine)
        assert task["tokens"] == sum(c["prompt_tokens"] + c["completion_tokens"] for c in mine)
    valid = out.calls.valid & (out.calls.kind == C.K_COMPOSE)
    np.testing.assert_array_equal(valid.sum(axis=1), 1)
