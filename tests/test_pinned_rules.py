"""Protocol rules a mutation audit could change in both engines alike without any test failing (the
differential tests compare the engines with each other, so a consistent change passes them): the
detector's median (§5), the tables recomputed on a release (§2), a Takeover's synthesis kept in the
draft (§3, §4), the budget defaults (§3.4), no probe from a probe visit and the isolated relay
before the probe check (§3), the uniform picks of the visit draw (§3, §4), and the weak model for a
degraded agent's inference and reviews (§1, §3.2).

Each rule is checked on the reference engine and, with the same world, on the JAX engine (one slot):
`jax_run` starts the JAX carry from the scenario's routing states and evidence and runs one round
per compiled call, so every scenario shares one program (6 MATH agents, 42 tasks, a neighbour table
5 wide)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshheal_jax import draws as D
from meshheal_jax import engine, topology
from meshheal_jax import reference as R
from meshheal_jax.config import ProtocolParams
from meshheal_jax.device import stack
from meshheal_jax.params import Pair, load_pair
from meshheal_jax.streams import HealthSchedule, make_stream

MATH = topology.load_profile("math")
PAIR = load_pair("default")
N_TASKS = 42
K_MAX = 5  # the complete graph's neighbour-table width; the path's is padded to it (one program)
LABELS = {"method": "meshheal", "dataset": "math", "pair": "default", "seed": 0}
FROZEN = ProtocolParams(warmup_per_six=10**6)  # no transition ever: routing states stay as set
NEVER = 10**6  # a probe timer that keeps an isolated agent from ever being probe-eligible
MOVES = ("rawrelay", "relay", "probe", "handoff")
JAX_STATE = {R.NORMAL: engine.NORMAL, R.WATCHED: engine.WATCHED, R.ISOLATED: engine.ISOLATED}
STREAM = make_stream(0, MATH.dataset_id, N_TASKS, 7, (1,), ("all",))
DRAWS = D.stream_draws(0, MATH.dataset_id, N_TASKS)
ALL_HEALTHY = HealthSchedule(6, N_TASKS, ())


def complete() -> topology.Network:
    return topology.build_network(MATH, 6)


def path() -> topology.Network:
    """0-1-2-3-4-5 with the MATH profile: deduction and enumeration held by {3,4,5}, figures by
    {0,2,3}, symbolic and arithmetic by {0,1,2}, theorems and analytic by {1,4,5}."""
    return topology.build_network(MATH, 6, edges=np.array([[k, k + 1] for k in range(5)]))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A world both engines start from: routing states and probe timers at the start, agents made
    probe-eligible again before every task (timer t - probe_interval), and optionally every
    (agent, type, ability) key primed with one score of 1.0 and three shortfalls of 0.0."""

    network: topology.Network
    params: ProtocolParams
    schedule: HealthSchedule = ALL_HEALTHY
    isolated: tuple[int, ...] = ()
    timers: tuple[tuple[int, int], ...] = ()  # (agent, probe timer at the start)
    due_every_task: tuple[int, ...] = ()
    primed: bool = False
    pair: Pair = PAIR


def reference_run(sc: Scenario, after_task=None) -> dict[str, list[dict]]:
    """The scenario's 42 tasks on the reference engine; after_task(world) after each task."""
    ref = R.ReferenceEngine(sc.network, sc.params, sc.pair, STREAM, sc.schedule, DRAWS, LABELS)
    world = ref.world
    if sc.primed:
        for key in world.scores:
            world.scores[key].push(1.0)
            for _ in range(3):
                world.shortfalls[key].push(0.0)
            world.n_shortfalls[key] = 3
    for agent in sc.isolated:
        world.state[agent] = R.ISOLATED
    for agent, timer in sc.timers:
        world.probe_timer[agent] = timer
    world.distance = world.distance_tables()
    for t in range(1, N_TASKS + 1):
        for agent in sc.due_every_task:
            world.probe_timer[agent] = t - sc.params.probe_interval
        ref.run_task(t)
        if after_task is not None:
            after_task(world)
    return {"tasks": ref.records.tasks, "reviews": ref.records.reviews, "states": ref.records.states,
            "calls": ref.backend.calls}  # fmt: skip


def jax_run(sc: Scenario, after_round=None) -> dict[str, list[dict]]:
    """The same on the JAX engine, one round per call; after_round(net) after each round."""
    spec = engine.StreamSpec(sc.network, STREAM, sc.schedule, sc.pair, LABELS)
    cfg = engine.engine_config([spec], sc.params, 1)
    params = engine.make_params(sc.params, sc.pair, MATH, 6)
    world = engine.make_world(sc.network, STREAM, sc.schedule, K_MAX)
    net = engine.initial_net(cfg, world)
    state = net.state.at[np.array(sc.isolated, dtype=int)].set(engine.ISOLATED)
    distance = engine.distance_tables(world.holds, world.nbr, state)
    net = dataclasses.replace(net, state=state, distance=distance)
    for agent, timer in sc.timers:
        net = dataclasses.replace(net, probe_timer=net.probe_timer.at[agent].set(timer))
    if sc.primed:
        net = dataclasses.replace(
            net, scores=net.scores.at[..., 0].set(1.0), score_count=jnp.ones_like(net.score_count),
            score_mean=jnp.ones_like(net.score_mean), shortfall_count=jnp.full_like(net.shortfall_count, 3),
        )  # fmt: skip
    worlds = stack([world])
    one_stream = jax.tree_util.tree_map(lambda x: x[None], net)
    carry = dataclasses.replace(engine.initial_carries(cfg, worlds), net=one_stream)
    parts = []
    while not engine.done(cfg, carry).all():
        if sc.due_every_task and int(carry.slots.phase[0, 0]) == engine.IDLE:
            t = int(carry.next_t[0])
            due = np.array(sc.due_every_task)
            timer = carry.net.probe_timer.at[0, due].set(t - sc.params.probe_interval)
            carry = dataclasses.replace(carry, net=dataclasses.replace(carry.net, probe_timer=timer))
        carry, packed = engine.run_rounds(cfg, params, worlds, carry, 1, False)
        parts.append(engine.host_records(cfg, packed))
        if after_round is not None:
            after_round(engine.at(carry.net, 0))
    records = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, axis=1), *parts)
    frames = engine.record_frames(spec, engine.at(records, 0))
    return {name: frame.to_dicts() for name, frame in frames.items()}


def steps(task: dict) -> list[tuple[str, int, int]]:
    """(action, from, to) per action of a task record; to == from for actions that are not moves."""
    route = [int(a) for a in task["route"].split("-")]
    out, at = [], 0
    for action in task["actions"].split(","):
        out.append((action, route[at], route[at + 1] if action in MOVES else route[at]))
        at += action in MOVES
    return out


def visits(task: dict, network: topology.Network, due: tuple[int, ...]) -> list[dict]:
    """Per action: the agent, the move's target, the moves before it (the visit's draw row), the
    missing abilities M (vocabulary order) and the agents still probe-eligible (those due at the
    task's start, less those the task probed: a probe sets the timer to t)."""
    holds = network.holds
    missing = sorted(MATH.pairs[task["inferred_pair"]])
    eligible, moves, out = set(due), 0, []
    for action, i, j in steps(task):
        out.append(dict(action=action, at=i, to=j, moves=moves, missing=missing, eligible=set(eligible)))
        if action == "probe":
            eligible.discard(j)
        if action == "contribute":
            missing = [s for s in missing if not holds[i, s]]
        moves += action in MOVES
    return out


def model_of(name: str):
    """The pair member (ModelParams) a call record names by its model id."""
    return {PAIR.strong.model: PAIR.strong, PAIR.weak.model: PAIR.weak}[name]


# ----------------------------------------------------------------------------------------------
# §5 step 8: m = median(C)
# ----------------------------------------------------------------------------------------------

T, S = 0, 0  # task type, ability
SHORTFALL_POOL = (0.0, 0.0, 0.0, 0.0, 1.0)  # C, one mean per peer 1..5


def test_z_centres_on_the_median_of_the_comparison_set():
    """§5 step 8: m = median(C). C = [0, 0, 0, 0, 1.0] (peers 1-5, each with a score of 1.0), own
    shortfalls 0.5 and 0.5, then q = 0.5 against qbar = 1.0: xbar = 0.5, m = p25 = 0, scale 0.10,
    z = 5.0 (the mean, 0.2, would give 1.5). Both engines' detectors, called directly."""
    world = R.ReferenceNetwork(complete(), ProtocolParams(), 7)
    for j, x in zip(range(1, 6), SHORTFALL_POOL):
        world.scores[(j, T, S)].push(1.0)
        for _ in range(3):
            world.shortfalls[(j, T, S)].push(x)
        world.n_shortfalls[(j, T, S)] = 3
    for _ in range(2):
        world.shortfalls[(0, T, S)].push(0.5)
    world.n_shortfalls[(0, T, S)] = 2
    assert world.observe(0, T, S, 0.5, 100, 30)["z"] == pytest.approx(5.0)

    cfg = engine.EngineConfig(n_agents=6, n_abilities=7, n_types=7, n_tasks=N_TASKS)
    jax_world = engine.make_world(complete(), STREAM, HealthSchedule(6, N_TASKS, ()))
    net = engine.initial_net(cfg, jax_world)
    pool = jnp.array(SHORTFALL_POOL)
    net = dataclasses.replace(
        net, scores=net.scores.at[1:, T, S, 0].set(1.0), score_count=net.score_count.at[1:, T, S].set(1),
        score_mean=net.score_mean.at[1:, T, S].set(1.0),
        shortfalls=net.shortfalls.at[1:, T, S, :3].set(pool[:, None]).at[0, T, S, :2].set(0.5),
        shortfall_count=net.shortfall_count.at[1:, T, S].set(3).at[0, T, S].set(2),
        shortfall_mean=net.shortfall_mean.at[1:, T, S].set(pool).at[0, T, S].set(0.5),
    )  # fmt: skip
    params = engine.make_params(ProtocolParams(), PAIR, MATH, 6)
    _, obs = engine.observe_relative(params, jax_world, net, 0, T, S, 0.5, 100, True, False)
    assert bool(obs.z_defined) and float(obs.z) == pytest.approx(5.0)


# ----------------------------------------------------------------------------------------------
# §2: tables recomputed when any h changes, a release included
# ----------------------------------------------------------------------------------------------


def test_tables_are_recomputed_when_an_agent_is_released():
    """§2: "When any h changes, distance tables are recomputed" — leaving isolation too. Agent 0 is
    isolated through observe (its zero scores far below its peers'), then released by good probe
    scores: its tables name it a provider of its abilities again, as a fresh computation does."""
    from test_window_reset import isolate_agent_0

    world = isolate_agent_0(ProtocolParams())
    assert world.distance == world.distance_tables() and world.distance[0][0] > 0
    t = 200
    while world.state[0] == R.ISOLATED:
        world.observe(0, 0, 0, 1.0, t, warmup=0)
        t += 1
        assert t < 230
    assert world.distance == world.distance_tables()
    assert world.distance[0][0] == 0  # agent 0 holds ability 0 and provides it again


RELEASE = Scenario(complete(), ProtocolParams(warmup_per_six=0), isolated=(0,), timers=((0, -10),),
                   primed=True)  # fmt: skip


def test_tables_match_the_states_after_a_release_in_both_engines():
    """§2 in a stream: every key primed with a score of 1.0 and three zero shortfalls, agent 0
    isolated and due for a probe at task 1; its probe output releases it (isolated -> watched).
    After every task (reference) and every round (JAX) the tables equal a fresh computation from
    the routing states."""

    def check(states: list[str], distance) -> None:
        fresh = R.ReferenceNetwork(RELEASE.network, RELEASE.params, 7)
        fresh.state = states
        assert np.asarray(distance).tolist() == fresh.distance_tables(), states

    names = list(JAX_STATE)
    ref = reference_run(RELEASE, lambda world: check(list(world.state), world.distance))
    jax_tables = jax_run(RELEASE, lambda net: check([names[k] for k in np.asarray(net.state)], net.distance))
    for tables in (ref, jax_tables):
        released = [row for row in tables["states"] if row["from"] == R.ISOLATED]
        assert released and released[0]["agent"] == 0 and released[0]["probe"], tables["states"]


# ----------------------------------------------------------------------------------------------
# §3/§4: a Takeover's synthesis replaces a Contribute's output in Y
# ----------------------------------------------------------------------------------------------


def _no_rescue(pair):
    """The pair with p_rescue 0 in both models: a Finalize is right iff its part and the draft are."""

    def without_rescue(model):
        return dataclasses.replace(model, scalars={**model.scalars, "p_rescue": 0.0})

    return dataclasses.replace(pair, strong=without_rescue(pair.strong), weak=without_rescue(pair.weak))


DEGRADED = (2, 4)
# tau_to 1.0: every output gets a committee and a Takeover; agents 2 and 4 degraded throughout
TAKEOVERS = Scenario(complete(), dataclasses.replace(FROZEN, tau_to=1.0),
                     HealthSchedule(6, N_TASKS, tuple((a, 1, N_TASKS + 1) for a in DEGRADED)),
                     pair=_no_rescue(PAIR))  # fmt: skip


@pytest.fixture(scope="module")
def takeover_runs() -> dict[str, dict[str, list[dict]]]:
    return {"reference": reference_run(TAKEOVERS), "jax": jax_run(TAKEOVERS)}


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_a_contributes_takeover_result_enters_the_draft(takeover_runs, which):
    """§3 "append the accepted (or replaced) output to Y", §4 "The synthesis replaces y": after a
    Contribute's Takeover, the Finalize's generate prompt is its base + the question + the
    synthesis's visible tokens, and (p_rescue 0, the right pair) the final answer is right iff the
    Finalize's part and the synthesis are."""
    tables = takeover_runs[which]
    tasks = {task["t"]: task for task in tables["tasks"]}
    calls: dict[int, list[dict]] = {}
    for call in tables["calls"]:
        calls.setdefault(call["t"], []).append(call)
    question = STREAM.question_tokens_or(MATH.question_tokens)
    checked, tokens_differ, truth_differs = 0, 0, 0
    for row in tables["reviews"]:
        if row["action"] != "contribute":
            continue
        t = row["t"]
        assert row["takeover"], row
        (synth,) = [c for c in calls[t] if c["kind"] == "synthesis" and c["visit"] == row["visit"]]
        (original,) = [c for c in calls[t] if c["kind"] == "generate" and c["visit"] == row["visit"]]
        (final,) = [c for c in calls[t] if c["kind"] == "generate" and c["visit"] > row["visit"]]
        visible = math.floor(synth["completion_tokens"] * model_of(synth["model"]).answer_fraction)
        base = model_of(final["model"]).prompt_tokens["generate"]
        assert final["prompt_tokens"] == base + question[t - 1] + visible, (row, synth, final)
        kept = math.floor(original["completion_tokens"] * model_of(original["model"]).answer_fraction)
        tokens_differ += kept != visible
        (finalize,) = [r for r in tables["reviews"] if r["t"] == t and r["action"] == "finalize"]
        if tasks[t]["pair_correct"]:
            right = finalize["part_correct"] and synth["correct"]
            assert finalize["correct_before"] == right, (row, finalize)
            truth_differs += finalize["part_correct"] and synth["correct"] != row["correct_before"]
        checked += 1
    counts = {"checked": checked, "tokens differ": tokens_differ, "truth differs": truth_differs}
    assert checked >= 30 and tokens_differ >= 20 and truth_differs >= 3, counts


# ----------------------------------------------------------------------------------------------
# §3.4: the budget's defaults
# ----------------------------------------------------------------------------------------------


def test_budget_defaults_are_the_papers_routing_limit_and_the_move_decision():
    """§3.4: a task ends unanswered when moves_since_output would exceed 4 (the paper's routing
    limit) or moves would exceed 8 (DECISION)."""
    params = ProtocolParams()
    assert (params.route_limit, params.move_limit) == (4, 8)


# ----------------------------------------------------------------------------------------------
# §3: probes: none from a probe visit, drawn uniformly; an isolated relay relays first
# ----------------------------------------------------------------------------------------------

# complete graph, agents 2 and 4 isolated and made due before every task: nearly every task probes
PROBES = Scenario(complete(), FROZEN, isolated=(2, 4), due_every_task=(2, 4))


@pytest.fixture(scope="module")
def probe_runs() -> dict[str, dict[str, list[dict]]]:
    return {"reference": reference_run(PROBES), "jax": jax_run(PROBES)}


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_no_probe_from_a_visit_that_is_itself_a_probe(probe_runs, which):
    """§3: the probe check runs "only when this visit is not itself a probe". On the complete graph
    with agents 2 and 4 both eligible, the agent a probe reaches writes its part (the other eligible
    agent, a neighbour holding a missing ability, is not probed from there)."""
    network = PROBES.network
    probes, could_chain = 0, 0
    for task in probe_runs[which]["tasks"]:
        acts = visits(task, network, PROBES.due_every_task)
        for k, visit in enumerate(acts):
            if visit["action"] != "probe":
                continue
            probes += 1
            j, rest = visit["to"], visit["eligible"] - {visit["to"]}
            could_chain += any(network.holds[c, s] for c in rest for s in visit["missing"])
            assert acts[k + 1]["action"] in ("contribute", "finalize") and acts[k + 1]["at"] == j, task
    assert probes >= 30 and could_chain >= 20, (probes, could_chain)


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_probe_target_is_drawn_with_the_visit_draw(probe_runs, which):
    """§3: among the probe-eligible neighbours holding a missing ability, in increasing index, the
    probe goes to candidates[pick(u, |candidates|)] with the visit's probe draw; both of two
    candidates are drawn."""
    network = PROBES.network
    picked = {0: 0, 1: 0}
    for task in probe_runs[which]["tasks"]:
        for visit in visits(task, network, PROBES.due_every_task):
            if visit["action"] != "probe":
                continue
            i = visit["at"]
            candidates = [j for j in network.neighbours(i) if j in visit["eligible"]
                          and any(network.holds[j, s] for s in visit["missing"])]  # fmt: skip
            u = float(DRAWS.route[task["t"] - 1][visit["moves"]][D.PROBE])
            k = R.pick(u, len(candidates))
            assert visit["to"] == candidates[k], (task, candidates)
            if len(candidates) == 2:
                picked[k] += 1
    assert min(picked.values()) >= 5, picked


# path 0-1-2-3-4-5: agent 2 isolated and never eligible, agent 3 isolated and due before every task
RELAYS = Scenario(path(), FROZEN, isolated=(2, 3), timers=((2, NEVER),), due_every_task=(3,))


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_an_isolated_relay_relays_before_the_probe_check(which):
    """§3: at an isolated agent reached as a relay (not a probe) the task is handed on with no LLM
    call ("continue"), before the probe check. On the path, agent 2 isolated and never eligible,
    agent 3 isolated and eligible: a task relayed through 2 goes on as a relay even when 3 holds a
    missing ability and could be probed."""
    tables = reference_run(RELAYS) if which == "reference" else jax_run(RELAYS)
    network, tempting = RELAYS.network, 0
    for task in tables["tasks"]:
        for visit in visits(task, network, RELAYS.due_every_task):
            if visit["at"] != 2:
                continue
            assert visit["action"] in ("rawrelay", "relay"), task
            tempting += (visit["action"] == "relay" and 3 in visit["eligible"]
                         and any(network.holds[3, s] for s in visit["missing"]))  # fmt: skip
    assert tempting >= 5, tempting
    assert not [c for c in tables["calls"] if c["agent"] == 2]


# ----------------------------------------------------------------------------------------------
# §4: the initial reviewer and committee member A are drawn uniformly
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_reviewer_and_committee_members_are_drawn_with_the_visit_draw(takeover_runs, which):
    """§4: E = the author's normal neighbours holding the ability, in increasing index; the initial
    reviewer is E[pick(u, |E|)], committee member A is E[pick(u_A, |E|)] and B (E without A)
    [pick(u_B, |E| - 1)], each with its own draw of the visit. Every output here has a committee
    (tau_to 1.0); both of two candidates are drawn for the reviewer and for A."""
    network = TAKEOVERS.network
    picked = {"reviewer": [0, 0], "committee_a": [0, 0]}
    for row in takeover_runs[which]["reviews"]:
        eligible = [j for j in network.neighbours(row["author"]) if network.holds[j, row["ability"]]]
        u = DRAWS.route[row["t"] - 1][row["visit"]]
        k_reviewer = R.pick(float(u[D.REVIEWER]), len(eligible))
        k_a = R.pick(float(u[D.COMMITTEE_A]), len(eligible))
        rest = [j for j in eligible if j != eligible[k_a]]
        assert row["committee"], row
        assert row["reviewer"] == eligible[k_reviewer], (row, eligible)
        assert row["committee_a"] == eligible[k_a], (row, eligible)
        assert row["committee_b"] == rest[R.pick(float(u[D.COMMITTEE_B]), len(rest))], (row, eligible)
        if len(eligible) == 2:
            picked["reviewer"][k_reviewer] += 1
            picked["committee_a"][k_a] += 1
    assert min(picked["reviewer"] + picked["committee_a"]) >= 5, picked


# ----------------------------------------------------------------------------------------------
# §1, §3.2: a degraded agent's inference and reviews use the weak model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_a_degraded_entry_agent_infers_with_the_weak_model(takeover_runs, which):
    """§3.2 DECISION: InferAbilities uses the strong model if the agent is healthy and the weak one
    if it is degraded (agents 2 and 4 here, throughout)."""
    seen = {True: 0, False: 0}
    for call in takeover_runs[which]["calls"]:
        if call["kind"] != "infer":
            continue
        degraded = TAKEOVERS.schedule.is_degraded(call["agent"], call["t"])
        assert call["model"] == (PAIR.weak.model if degraded else PAIR.strong.model), call
        seen[degraded] += 1
    assert min(seen.values()) >= 5, seen


@pytest.mark.parametrize("which", ["reference", "jax"])
def test_a_degraded_agent_reviews_with_the_weak_model(takeover_runs, which):
    """§1: a degraded agent's every LLM call, "generation AND review", uses the weak model: its
    review samples and both committee rounds; a healthy reviewer (always a holder of the ability)
    uses the strong one."""
    kinds = ("review", "committee1", "committee2")
    seen = {(kind, degraded): 0 for kind in kinds for degraded in (True, False)}
    for call in takeover_runs[which]["calls"]:
        if call["kind"] not in kinds:
            continue
        degraded = TAKEOVERS.schedule.is_degraded(call["agent"], call["t"])
        assert call["model"] == (PAIR.weak.model if degraded else PAIR.strong.model), call
        seen[(call["kind"], degraded)] += 1
    assert min(seen.values()) >= 10, seen
