"""AgentNet (Yang et al., NeurIPS 2025; zoe-yyx/AgentNet `src/agentgraph.py`, `src/agent.py`).

Mechanism kept: execution follows the shared H/C/F interface; AgentNet decides only where the task
goes next. At every forward the current agent makes one router LLM call; the decision is the
neighbour with the best score 0.4·ability + 0.3·(1 − load/3) + 0.2·success_rate + 0.1 among
neighbours reachable over an unpruned edge with ability >= 0.5 for the missing ability and
load < 3 (ties uniform with the visit's HOP_TIE draw); at most 3 forwards per task. After the
task the evaluator's verdict is credited to every agent on the route (per-type successes/total;
+0.1 to each ability the agent used, cap 2.0), the forward edges' weights are multiplied by 1.1
or 0.9 (clip [0.1, 2.0]; their success EMA r <- 0.9r + 0.1·1[success]) and an edge with
w <= 0.3 is pruned from routing; an agent's task type with no success for 10 of the agent's
tasks decays that type's abilities ×0.9 (floor 0.1).

Mapping decisions (ours), each a named parameter below:
- router call: its model is the forwarding agent's no-ability model (strong iff healthy); with
  prob `p_decide[model]` the LLM names the score-rule choice, else it names a uniform neighbour
  over an unpruned edge (control uniform U_AUX), which the code's validity check keeps if it passes
  the ability/load filter and otherwise replaces with the score-rule choice
  (`router_uses_p_decide=False` makes every router call name the score-rule choice);
- load = tasks in flight at the neighbour: with one task in flight it is 0 for every neighbour
  (the task sits at the forwarding agent), so the load term is the constant 0.3;
- no eligible neighbour: a uniform unpruned neighbour (the code's random fallback; HOP_TIE); no
  unpruned neighbour at all: the task ends unanswered ("no route"); a 4th forward: unanswered
  ("forward limit"), on top of the shared 4/8 move budget;
- edges are directed (i -> j) as in the code; each distinct forward edge of the route is updated
  once per task; the route's agents (distinct) are credited once per task; "used" abilities are
  the abilities the agent generated for on this task; the decay countdown of a type starts at the
  agent's first task of that type and ticks once per task the agent is on the route.
Control-call uniforms: field 110, row f = the f-th forward of the task (f = 0, 1, 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshheal_jax import draws as D
from meshheal_jax.baselines import common as C

METHOD = "agentnet"


@C.pytree
class AgentNetParams:
    """Published defaults (AgentNet code) and our mapping choices."""

    w_ability: float = 0.4
    w_load: float = 0.3
    w_success: float = 0.2
    edge_term: float = 0.1  # the code's outgoing-edge term (constant on our undirected graphs)
    load_capacity: float = 3.0  # load / 3 in the score
    min_ability: float = 0.5  # candidates need ability >= 0.5 for the missing ability
    max_load: float = 3.0  # ... and load < 3
    held_ability: float = 1.0  # initial estimate of a held ability (ours: from the profile)
    unheld_ability: float = 0.6
    ability_gain: float = 0.1
    ability_cap: float = 2.0
    decay_factor: float = 0.9
    ability_floor: float = 0.1
    decay_interval: int = 10
    edge_init: float = 1.0
    edge_rate_init: float = 0.0  # code: edge_success_rate starts at 0.0
    edge_up: float = 1.1
    edge_down: float = 0.9
    edge_min: float = 0.1
    edge_max: float = 2.0
    edge_rate_keep: float = 0.9
    prune_at: float = 0.3  # edges with w <= 0.3 are pruned
    router_uses_p_decide: bool = C.static_field(True)
    max_forwards: int = C.static_field(3)
    budget: C.Budget = C.static_field(C.Budget())


@C.pytree
class AgentNetState:
    ability: jax.Array  # (N, A) float64 ability estimates
    successes: jax.Array  # (N, T) int32 successful tasks per type
    totals: jax.Array  # (N, T) int32 tasks per type
    countdown: jax.Array  # (N, T) int32 tasks left before decay; -1 = type never seen by the agent
    edge_weight: jax.Array  # (N, N) float64 directed i -> j
    edge_rate: jax.Array  # (N, N) float64 success EMA of i -> j


def init_state(params: AgentNetParams, world: C.World) -> AgentNetState:
    n = world.holds.shape[0]
    t = world.type_abilities.shape[0]
    return AgentNetState(
        ability=jnp.where(world.holds, params.held_ability, params.unheld_ability).astype(jnp.float64),
        successes=jnp.zeros((n, t), jnp.int32), totals=jnp.zeros((n, t), jnp.int32),
        countdown=jnp.full((n, t), -1, jnp.int32),
        edge_weight=jnp.full((n, n), params.edge_init, jnp.float64),
        edge_rate=jnp.full((n, n), params.edge_rate_init, jnp.float64),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Pure mechanism functions (tested directly)
# ------------------------------------------------------------------------------------------------


def routable(params: AgentNetParams, adjacency, edge_weight):
    """(N, N) bool: edges usable for routing (not pruned: w > prune_at)."""
    return adjacency & ~(edge_weight <= params.prune_at + C.TOL)


def success_rate(state: AgentNetState, task_type):
    """(N,) successes / total for the task type (0 before any task)."""
    total = state.totals[:, task_type]
    return jnp.where(total > 0, state.successes[:, task_type] / jnp.maximum(total, 1), 0.0)


def forward_scores(params: AgentNetParams, ability_s, rate, load):
    """(N,) 0.4·ability + 0.3·(1 − load/3) + 0.2·success_rate + 0.1."""
    return (params.w_ability * ability_s + params.w_load * (1.0 - load / params.load_capacity)
            + params.w_success * rate + params.edge_term)  # fmt: skip


def router_inputs(params: AgentNetParams, state: AgentNetState, adjacency, agent, ability, task_type):
    """What the router sees: usable (N,) unpruned edges from `agent`, eligible (N,) usable and
    passing the ability / load filter, score (N,) the forward scores."""
    load = jnp.zeros(adjacency.shape[0])  # one task in flight, held by `agent` (module docstring)
    usable = routable(params, adjacency, state.edge_weight)[agent]
    ability_s = state.ability[:, ability]
    eligible = usable & (ability_s >= params.min_ability - C.TOL) & (load < params.max_load)
    return usable, eligible, forward_scores(params, ability_s, success_rate(state, task_type), load)


def router_decision(params: AgentNetParams, state: AgentNetState, adjacency, agent, ability, task_type,
                    decide_ok, u_named, u_tie, named=None):  # fmt: skip
    """The next agent (or -1 when no unpruned edge leaves `agent`) and whether a fallback was used.

    decide_ok: the router LLM named the score-rule choice; otherwise it named the unpruned
    neighbour picked by u_named (or `named`: the agent a live router named, -1 none), kept only
    if it passes the candidate filter."""
    usable, eligible, score = router_inputs(params, state, adjacency, agent, ability, task_type)
    best_score = jnp.max(jnp.where(eligible, score, -jnp.inf))
    best = C.pick_from_mask(u_tie, eligible & (score >= best_score - C.TOL))
    named = C.pick_from_mask(u_named, usable) if named is None else jnp.asarray(named, jnp.int32)
    keep_named = ~decide_ok & (named >= 0) & eligible[jnp.maximum(named, 0)]
    chosen = jnp.where(keep_named, named, best)
    fallback = C.pick_from_mask(u_tie, usable)  # the code's random neighbour when none is eligible
    return jnp.where(eligible.any(), chosen, fallback).astype(jnp.int32), ~eligible.any()


def update_edges(params: AgentNetParams, state: AgentNetState, used, success) -> AgentNetState:
    """used (N, N) bool: forward edges of the task. w <- clip(w·1.1|0.9), r <- 0.9r + 0.1·1[success]."""
    factor = jnp.where(success, params.edge_up, params.edge_down)
    weight = jnp.clip(state.edge_weight * factor, params.edge_min, params.edge_max)
    rate = params.edge_rate_keep * state.edge_rate + (1.0 - params.edge_rate_keep) * success
    return dataclasses.replace(state, edge_weight=jnp.where(used, weight, state.edge_weight),
                               edge_rate=jnp.where(used, rate, state.edge_rate))  # fmt: skip


def credit_agents(params: AgentNetParams, state: AgentNetState, on_route, used_abilities, task_type,
                  success, type_abilities) -> AgentNetState:  # fmt: skip
    """Evaluator feedback to every agent on the route (on_route (N,) bool, used_abilities (N, A)).

    Per type: totals/successes; on success +gain to each used ability (cap); the decay countdown:
    start a new type at `decay_interval`, tick every started type once, reset the task's type on
    success, and decay (×factor, floor) the abilities of every type whose countdown reached 0."""
    n_types = state.totals.shape[1]
    this_type = (jnp.arange(n_types) == task_type)[None, :] & on_route[:, None]  # (N, T)
    totals = state.totals + this_type
    successes = state.successes + (this_type & success)
    gain = on_route[:, None] & used_abilities & success
    ability = jnp.where(
        gain, jnp.minimum(params.ability_cap, state.ability + params.ability_gain), state.ability
    )
    countdown = jnp.where(this_type & (state.countdown < 0), params.decay_interval, state.countdown)
    started = countdown >= 0
    countdown = jnp.where(on_route[:, None] & started, countdown - 1, countdown)
    countdown = jnp.where(this_type & success, params.decay_interval, countdown)
    decays = on_route[:, None] & started & (countdown <= 0)  # (N, T)
    countdown = jnp.where(decays, params.decay_interval, countdown)
    # (N, A) types decaying each ability
    n_decays = decays.astype(jnp.int32) @ type_abilities.astype(jnp.int32)
    decayed = jnp.maximum(params.ability_floor, ability * params.decay_factor**n_decays)
    ability = jnp.where(n_decays > 0, decayed, ability)
    return dataclasses.replace(state, ability=ability, successes=successes, totals=totals,
                               countdown=countdown.astype(jnp.int32))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# One task
# ------------------------------------------------------------------------------------------------


def task_step(params: AgentNetParams, emu: C.Emu, world: C.World, state: AgentNetState, t, u: C.TaskUniforms):
    d, control = u.task, u.control
    ty = world.task_type[t - 1]
    n = world.holds.shape[0]
    entry = C.pick_index(d.entry, n)
    inferred, pair_ok, call_infer = C.emulate_infer(emu, world, entry, t, ty, d.infer)
    required = world.pair_abilities[inferred]

    def choose(mstate, path, v, missing, valid):
        uc = control[jnp.minimum(path.moves, C.N_CONTROL - 1)]
        s = C.pick_from_mask(d.route[v, D.HOP_ABILITY], missing)
        role = C.role_of(world, path.agent, -1, t)
        if emu.live:  # the router LLM names a neighbour; one it may not use -> the score rule
            usable, eligible, score = router_inputs(
                params, state, world.adjacency, path.agent, jnp.maximum(s, 0), ty
            )
            asked = (s >= 0) & usable.any()  # no candidate to name: no call (and none recorded)
            r = C.live_reply("router", world, t, valid & asked, after=path.draft_tokens,
                             agent=path.agent, role=role, ability=s, visit=v, execution=0,
                             vectors={"usable": usable, "eligible": eligible, "score": score,
                                      "estimate": state.ability[:, jnp.maximum(s, 0)],
                                      "rate": success_rate(state, ty)})  # fmt: skip
            j, _ = router_decision(params, state, world.adjacency, path.agent, jnp.maximum(s, 0), ty, False,
                                   uc[D.U_AUX], d.route[v, D.HOP_TIE], named=r.choice)  # fmt: skip
            prompt, completion, request = r.prompt, r.completion, r.request
        else:
            asked = True
            decide_ok = (uc[D.U_MAIN] < emu.p_decide[role]) | (not params.router_uses_p_decide)
            j, _ = router_decision(params, state, world.adjacency, path.agent, jnp.maximum(s, 0), ty, decide_ok,
                                   uc[D.U_AUX], d.route[v, D.HOP_TIE])  # fmt: skip
            prompt = emu.prompt[role, C.K_ROUTER] + world.question_tokens[t - 1] + path.draft_tokens
            completion, request = C.completion_tokens(emu, role, C.K_ROUTER, uc[D.U_TOKENS]), -1
        call = C.make_call(asked, C.K_ROUTER, v, path.agent, role, prompt, completion, ability=s,
                           correct=(j >= 0) & world.holds[jnp.maximum(j, 0), jnp.maximum(s, 0)],
                           request=request)  # fmt: skip
        return mstate, C.Hop(j, jnp.where(j < 0, C.E_NO_ROUTE, C.E_NONE).astype(jnp.int32), call)

    _, path, calls, reviews = C.run_path(
        emu, world, t, ty, entry, required, pair_ok, d.calls, choose=choose, budget=params.budget,
        forward_limit=params.max_forwards, move_action=C.A_FORWARD,
    )  # fmt: skip
    success = path.answered & path.answer_ok  # the evaluator's verdict (AgentNet's feedback signal)
    steps = jnp.arange(C.MAX_PATH_ROUTE - 1)
    step_valid = steps < path.route_len - 1
    src, dst = jnp.maximum(path.route[:-1], 0), jnp.maximum(path.route[1:], 0)
    used_edges = jnp.zeros((n, n), bool).at[src, dst].max(step_valid)
    on_route = jnp.zeros(n, bool).at[jnp.maximum(path.route, 0)].max(path.route >= 0)
    gens = calls.valid & (calls.kind == C.K_GENERATE)
    used_abilities = jnp.zeros(world.holds.shape, bool).at[
        jnp.maximum(calls.agent, 0), jnp.maximum(calls.ability, 0)].max(gens)  # fmt: skip
    state = update_edges(params, state, used_edges, success)
    state = credit_agents(params, state, on_route, used_abilities, ty, success, world.type_abilities)
    out = C.TaskOut(
        entry=entry, route=C.path_route(path), actions=path.actions, moves=path.moves, answered=path.answered,
        correct=success, answer_id=path.answer_id, inferred_pair=inferred, pair_correct=pair_ok, end=path.end,
        calls=C.concat([C.stack([call_infer]), calls]), reviews=reviews,
    )  # fmt: skip
    return state, out
