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
  (one call)").

Each test replays a rule from the records of one emulated 504-task stream (one compiled program
per method, shared by the module's fixtures). RAPS runs its earlier watchdog rule, judge_rule
"caller" (decisions B0), passed explicitly: the wiring is the same under either rule, and this
stream's exclusions were worked out under it; no test depends on whether a compose corrupts.
"""

from __future__ import annotations

import functools

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


@pytest.fixture(scope="module")
def raps_decisions():
    """Every forward of a RAPS stream replayed: the Beta counts rebuilt in numpy from the reviews
    table (x <- λx + s, y <- λy + (1 − s), s = 1[score <= 0.40], updated at the watchdog, before
    the receiver's own next hop), and per forward (t, agent, candidates, allowed, E[P] row, the
    agent the broker should pick, the agent the task went to, the pick on the prior)."""
    _, outs = simulate("raps", [spec(COMPLETE, WHOLE, "raps")], PAIR, RAPS_PARAMS)
    out = stream_k(outs, 0)
    world = C.make_world(COMPLETE, STREAM, WHOLE, 0)
    holds, adjacency = COMPLETE.holds, COMPLETE.adjacency
    lam, tau = RAPS_PARAMS.lam, RAPS_PARAMS.tau_rep
    x = np.full((6, 6), RAPS_PARAMS.prior_x)
    y = np.full((6, 6), RAPS_PARAMS.prior_y)
    rv = out.reviews
    decisions = []
    for t in range(N_TASKS):
        route = agents_of(out.route[t])
        covered = np.zeros(holds.shape[1], bool)
        required = required_abilities(world, int(out.inferred_pair[t]))
        for v, agent in enumerate(route):
            for k in np.flatnonzero(rv.valid[t] & (rv.visit[t] == v)):
                i, j = int(rv.reviewer[t, k]), int(rv.author[t, k])
                bad = float(rv.score[t, k] <= RAPS_PARAMS.watchdog_threshold + C.TOL)
                x[i, j], y[i, j] = lam * x[i, j] + bad, lam * y[i, j] + (1.0 - bad)
            covered[generated_at(out.calls, t, v)] = True
            if v + 1 == len(route):
                break
            s = pick(ROUTE_U[t, v, D.HOP_ABILITY], required & ~covered)
            candidates = adjacency[agent] & holds[:, s]
            p = x[agent] / (x[agent] + y[agent])
            allowed = candidates & ~(p >= tau - C.TOL)
            u_tie = ROUTE_U[t, v, D.HOP_TIE]
            want = pick(u_tie, allowed) if allowed.any() else int(np.argmin(np.where(candidates, p, np.inf)))
            decisions.append(
                (t + 1, agent, candidates, allowed, p, want, route[v + 1], pick(u_tie, candidates))
            )
    return decisions


def test_raps_never_routes_to_an_excluded_holder_while_another_is_allowed(raps_decisions):
    """Once i's watchdogs on j's outputs put E[P_ij] >= 0.7, i's broker stops routing to j while
    another holder of the ability is allowed; before that it did route to j."""
    assert all(c.any() for _, _, c, *_ in raps_decisions)  # the complete graph: always a holder
    routed_before: dict[tuple[int, int], int] = {}  # (i, j) -> first task i routed to j
    excluded_later = set()
    binding = 0
    for t, i, candidates, allowed, p, _, chosen, _ in raps_decisions:
        assert candidates[chosen], (t, i, chosen)
        if allowed.any():
            assert allowed[chosen], f"task {t}: {i} routed to {chosen} with E[P] = {p[chosen]:.3f} >= 0.7"
        binding += int((candidates & ~allowed).any())
        routed_before.setdefault((i, chosen), t)
        for j in np.flatnonzero(candidates & ~allowed):
            if routed_before.get((i, int(j)), N_TASKS + 1) < t:
                excluded_later.add((i, int(j)))
    print(f"\nRAPS: exclusion binds in {binding} of {len(raps_decisions)} forwards")
    assert binding >= 50  # 223 of 504 forwards in this stream
    assert excluded_later  # a holder routed to once, excluded after its receiver's watchdogs


def test_raps_broker_pick_replays_from_the_learned_reputation(raps_decisions):
    """Every forward is the broker's pick on the reputation at that moment (uniform among the
    allowed holders by the visit's HOP_TIE draw; the lowest E[P] when all are excluded), and that
    pick often differs from the one the prior Beta(1, 1) would make."""
    for t, i, _, _, p, want, chosen, _ in raps_decisions:
        assert chosen == want, (t, i, chosen, want, np.round(p, 3))
    differs = sum(want != on_prior for *_, want, _, on_prior in raps_decisions)
    assert differs >= 20  # 78 of 504 forwards in this stream


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
