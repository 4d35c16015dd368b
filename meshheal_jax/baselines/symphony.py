"""Symphony-Coord (Guan et al. 2026; guanzhaoyang86-lab/symphony2.0 `core/linucb_selector.py`,
`core/risk_guard.py`, `agents/agent.py`, `experiments/exp1_sim_efficiency_cost`).

Mechanism kept: three parallel plans per task with voting. For each required ability a plan's
executor is chosen in two stages: (A) candidates with match score >= 0.3 that are available,
top L = 3 by match; (B) one LinUCB shared by all agents over x = [1, match, load, latency_norm,
reputation, available] (L2-normalised if its norm > 1), A = λI + Σxxᵀ, b = Σ r x,
UCB = xᵀθ + β_t·sqrt(xᵀA⁻¹x), β_t = α·sqrt(d·ln(1 + t/λ) + 2·ln(1/δ)) + sqrt(λ)·S with t the
number of updates (at least 1), λ = α = S = 1, δ = 0.05. Reward = clip(1[non-empty output] −
0.2·sqrt(latency_norm), 0, 1); reputation EMA 0.95/0.05 of the reward; load += 0.3 per call
(clipped to 1), ×0.88 per step; available = load < 0.95. Majority vote over the plans' answers;
risk = 0.45·(1 − top vote share) + 0.30·instability + 0.20·domain + 0.05·history; risk >= 0.45
triggers one rerun with 2 extra chain-of-thought samples (2 more plans), votes recounted over five.

Mapping decisions (ours), each a named parameter below:
- match = 1 for holders, 0.2 otherwise; a step = a task (load decays at the task's start);
- the three plans use three DISTINCT executors per ability: the top-3 of the ranking (stage-A
  candidates by UCB, then the other matched agents by UCB with available = 0 in x, as the code's
  simulator falls back when no top-L candidate is available, then the rest by UCB); ties in match
  or UCB by lower index; the two rerun plans use the first two ranks again (ranks 0 and 1:
  chain-of-thought resamples of the best executors, call kind "cot");
- latency_norm of a call = min(1, mean generate completion tokens of the serving model ×
  `decode_ms_per_token` / 2000 ms), a constant per model; the agent's latency feature is an EMA
  (β = 0.2, start 500 ms as in the code) of what it observed; the emulator always returns a
  non-empty output (a gray failure answers), so the reward never sees correctness; live, an
  output is non-empty when its reply has text (an empty reply, e.g. a reasoning model that spent
  its tokens, is rewarded 0);
- instability = 1 when no answer has a strict majority, domain = history = 0;
- the entry agent (task draw) infers the pair; each plan runs the pair's abilities in vocabulary
  order (the first contributes, the second finalizes); plan k uses the generation uniforms of
  draw layout k (plan 0: draws.task_draws; plan k >= 1: row k - 1 of field 100) at visits 1 and 2
  (entry = visit 0); the final answer is the plurality winner (ties: the earliest plan);
- LinUCB, reputation, load and latency updates are applied after the task, one per executed
  call in plan order, each with the context x its executor had at selection time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshheal_jax import draws as D
from meshheal_jax.baselines import common as C
from meshheal_jax.errors import MeshHealError

METHOD = "symphony"
D_CONTEXT = 6  # [1, match, load, latency_norm, reputation, available]
PARTS = 2


@C.pytree
class SymphonyParams:
    l2: float = 1.0  # λ
    alpha: float = 1.0
    delta: float = 0.05
    theta_bound: float = 1.0  # S
    match_holder: float = 1.0  # (ours)
    match_other: float = 0.2  # (ours)
    match_threshold: float = 0.3
    available_below: float = 0.95
    load_per_call: float = 0.3
    load_decay: float = 0.88
    reputation_init: float = 0.5
    reputation_keep: float = 0.95
    latency_penalty: float = 0.2
    latency_scale_ms: float = 2000.0
    latency_init_ms: float = 500.0
    latency_ema: float = 0.2
    decode_ms_per_token: float = 10.0  # (ours) for latency_norm per model
    w_disagree: float = 0.45
    w_unstable: float = 0.30
    w_domain: float = 0.20
    w_history: float = 0.05
    domain_risk: float = 0.0
    history_risk: float = 0.0
    rerun_at: float = 0.45
    top_l: int = C.static_field(3)
    n_plans: int = C.static_field(3)
    n_extra: int = C.static_field(2)

    def check(self, n_agents: int) -> None:
        if self.n_plans + self.n_extra > 1 + C.N_PARALLEL:
            raise MeshHealError("Symphony: at most 1 + N_PARALLEL plans (task draws and field 100's rows)")
        if self.n_extra > self.n_plans:
            raise MeshHealError(
                "Symphony: the rerun plans reuse the first n_extra ranks, so n_extra <= n_plans"
            )


@C.pytree
class SymphonyState:
    a_matrix: jax.Array  # (6, 6) float64 A = λI + Σ x xᵀ
    b_vector: jax.Array  # (6,) float64 Σ r x
    n_updates: jax.Array  # () int32
    load: jax.Array  # (N,) float64
    reputation: jax.Array  # (N,) float64
    latency_norm: jax.Array  # (N,) float64 the agent's observed latency (EMA), normalised


def init_state(params: SymphonyParams, world: C.World) -> SymphonyState:
    n = world.holds.shape[0]
    return SymphonyState(
        a_matrix=params.l2 * jnp.eye(D_CONTEXT), b_vector=jnp.zeros(D_CONTEXT), n_updates=jnp.int32(0),
        load=jnp.zeros(n), reputation=jnp.full(n, params.reputation_init, jnp.float64),
        latency_norm=jnp.full(n, params.latency_init_ms / params.latency_scale_ms, jnp.float64),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Pure mechanism functions (tested directly)
# ------------------------------------------------------------------------------------------------


def context_vector(match, load, latency_norm, reputation, available):
    """(..., 6) x = [1, match, load, latency_norm, reputation, available], each clipped to [0, 1],
    L2-normalised when its norm exceeds 1."""
    clip = lambda v: jnp.clip(jnp.asarray(v, jnp.float64), 0.0, 1.0)
    x = jnp.stack(jnp.broadcast_arrays(jnp.ones_like(clip(match)), clip(match), clip(load), clip(latency_norm),
                                       clip(reputation), jnp.asarray(available, jnp.float64)), axis=-1)  # fmt: skip
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    return jnp.where(norm > 1.0, x / norm, x)


def confidence_radius(params: SymphonyParams, n_updates):
    """β_t = α·sqrt(d·ln(1 + t/λ) + 2·ln(1/δ)) + sqrt(λ)·S, t = max(1, updates)."""
    t = jnp.maximum(n_updates, 1).astype(jnp.float64)
    return (params.alpha * jnp.sqrt(D_CONTEXT * jnp.log(1.0 + t / params.l2) + 2.0 * jnp.log(1.0 / params.delta))
            + jnp.sqrt(params.l2) * params.theta_bound)  # fmt: skip


def ucb(params: SymphonyParams, state: SymphonyState, x):
    """(K,) UCB of contexts x (K, 6)."""
    theta = jnp.linalg.solve(state.a_matrix, state.b_vector)
    a_inv_x = jnp.linalg.solve(state.a_matrix, x.T).T
    variance = jnp.maximum(0.0, jnp.sum(x * a_inv_x, axis=-1))
    return x @ theta + confidence_radius(params, state.n_updates) * jnp.sqrt(variance)


def linucb_update(state: SymphonyState, x, reward, valid=True) -> SymphonyState:
    """A += x xᵀ, b += r x, t += 1 (when valid)."""
    v = jnp.asarray(valid, jnp.float64)
    return dataclasses.replace(
        state, a_matrix=state.a_matrix + v * jnp.outer(x, x), b_vector=state.b_vector + v * reward * x,
        n_updates=state.n_updates + jnp.asarray(valid, jnp.int32),
    )  # fmt: skip


def reward_of(params: SymphonyParams, non_empty, latency_norm):
    return jnp.clip(
        jnp.where(non_empty, 1.0, 0.0) - params.latency_penalty * jnp.sqrt(latency_norm), 0.0, 1.0
    )


def executor_ranking(params: SymphonyParams, state: SymphonyState, holds_s):
    """Agents ranked for one ability: (ranking (N,), contexts (N, 6)). Stage A (match >= threshold,
    available, top L by match) by UCB first, then the other matched agents, then the rest."""
    n = holds_s.shape[0]
    index = jnp.arange(n)
    match = jnp.where(holds_s, params.match_holder, params.match_other)
    available = state.load < params.available_below
    matched = match >= params.match_threshold - C.TOL
    stage_a = matched & available
    order = jnp.lexsort((index, -match, ~stage_a))  # stage-A first, by match, then index
    position = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    top = stage_a & (position < params.top_l)
    x = context_vector(match, state.load, state.latency_norm, state.reputation, available)
    score = ucb(params, state, x)
    group = jnp.where(top, 0, jnp.where(matched, 1, 2))
    return jnp.lexsort((index, -score, group)).astype(jnp.int32), x


def vote(answer_ids, valid):
    """(winner plan, answer id, top vote share, strict majority?) over the valid plans; ties: the
    earliest plan."""
    same = valid[:, None] & valid[None, :] & (answer_ids[:, None] == answer_ids[None, :])
    votes = jnp.where(valid, same.sum(axis=1), 0)
    top = jnp.max(votes)
    n_valid = jnp.maximum(valid.sum(), 1)
    winner = jnp.argmax(votes == top).astype(jnp.int32)
    return winner, answer_ids[winner], top / n_valid, 2 * top > n_valid


def risk(params: SymphonyParams, top_share, strict_majority):
    instability = jnp.where(strict_majority, 0.0, 1.0)
    return (params.w_disagree * (1.0 - top_share) + params.w_unstable * instability
            + params.w_domain * params.domain_risk + params.w_history * params.history_risk)  # fmt: skip


def latency_norm_of(params: SymphonyParams, emu: C.Emu):
    """(2,) constant latency_norm per model from its mean generation length."""
    mean_tokens = (emu.completion[:, C.K_GENERATE, 0] + emu.completion[:, C.K_GENERATE, 1]) / 2.0
    return jnp.minimum(1.0, mean_tokens * params.decode_ms_per_token / params.latency_scale_ms)


# ------------------------------------------------------------------------------------------------
# One task
# ------------------------------------------------------------------------------------------------


def task_step(
    params: SymphonyParams, emu: C.Emu, world: C.World, state: SymphonyState, t, uniforms: C.TaskUniforms
):
    n = world.holds.shape[0]
    ty = world.task_type[t - 1]
    total = params.n_plans + params.n_extra
    u_gen = jnp.concatenate([uniforms.task.calls[None], uniforms.parallel.calls[: total - 1]])[
        :, 1:3, D.GENERATE
    ]
    state = dataclasses.replace(state, load=state.load * params.load_decay)
    entry = C.pick_index(uniforms.task.entry, n)
    inferred, pair_ok, call_infer = C.emulate_infer(emu, world, entry, t, ty, uniforms.task.infer)
    required = world.pair_abilities[inferred]
    abilities = jnp.stack([C.first_true(required), C.last_true(required)])
    rankings, contexts = jax.vmap(lambda s: executor_ranking(params, state, world.holds[:, s]))(abilities)
    plan_rank = jnp.asarray(list(range(params.n_plans)) + list(range(params.n_extra)), jnp.int32) % n
    plan_kind = jnp.where(jnp.arange(total) < params.n_plans, C.K_GENERATE, C.K_COT)

    def run_plan(rank, u, kind, plan, valid):
        """One plan: the first ability's executor contributes, the second's finalizes."""
        executors = rankings[:, rank]  # (2,)
        first, call_a = C.emulate_generate(emu, world, t, ty, executors[0], abilities[0], False, pair_ok, True, 0,
                                           u[0], 1, kind=kind, valid=valid, execution=plan)  # fmt: skip
        last, call_b = C.emulate_generate(emu, world, t, ty, executors[1], abilities[1], True, pair_ok,
                                          first.part_ok, first.tokens, u[1], 2, kind=kind, valid=valid,
                                          execution=plan)  # fmt: skip
        return (
            executors,
            jnp.stack([first.role, last.role]),
            jnp.stack([first.non_empty, last.non_empty]),
            last.answer_ok,
            last.answer_id,
            C.stack([call_a, call_b]),
        )

    plans = jnp.arange(total, dtype=jnp.int32)
    first = plans < params.n_plans
    head = slice(0, params.n_plans)
    results = jax.vmap(run_plan)(plan_rank[head], u_gen[head], plan_kind[head], plans[head], first[head])
    _, _, share, majority = vote(results[4], first[head])
    rerun = risk(params, share, majority) >= params.rerun_at - C.TOL
    if params.n_extra:  # the rerun's plans are made (asked, live) only when the risk calls for them
        tail = slice(params.n_plans, total)
        extra = jax.vmap(run_plan, in_axes=(0, 0, 0, 0, None))(plan_rank[tail], u_gen[tail], plan_kind[tail],
                                                                plans[tail], rerun)  # fmt: skip
        results = C.concat([results, extra])
    executors, roles, non_empty, oks, ids, plan_calls = results
    ran = first | rerun
    winner, answer_id, _, _ = vote(ids, ran)
    # learning updates, one per executed call in plan order, with the selection-time contexts
    latency = latency_norm_of(params, emu)
    x_calls = contexts[jnp.arange(PARTS)[None, :], executors]  # (plans, parts, 6)

    def update(state, item):
        agent, x, role, has_text, valid = item
        observed = latency[role]
        r = reward_of(params, has_text, observed)
        state = linucb_update(state, x, r, valid)
        v = jnp.where(valid, 1.0, 0.0)
        keep, ema = params.reputation_keep, params.latency_ema
        return dataclasses.replace(
            state,
            reputation=state.reputation.at[agent].add(v * (1.0 - keep) * (r - state.reputation[agent])),
            load=state.load.at[agent].set(jnp.minimum(1.0, state.load[agent] + v * params.load_per_call)),
            latency_norm=state.latency_norm.at[agent].add(v * ema * (observed - state.latency_norm[agent])),
        ), None  # fmt: skip

    items = (executors.reshape(-1), x_calls.reshape(-1, D_CONTEXT), roles.reshape(-1), non_empty.reshape(-1),
             jnp.repeat(ran, PARTS))  # fmt: skip
    state, _ = jax.lax.scan(update, state, items)
    calls = C.concat([C.stack([call_infer]),
                      C.flatten(dataclasses.replace(plan_calls, valid=plan_calls.valid & ran[:, None]))])  # fmt: skip
    route = jnp.concatenate(
        [jnp.broadcast_to(entry, (total, 1)), executors, jnp.full((total, 1), C.ROUTE_SEP)], axis=1
    ).astype(jnp.int32)
    route = jnp.where(ran[:, None], route, -1).reshape(-1)
    plan_actions = jnp.where(ran[:, None], jnp.asarray([[C.A_CONTRIBUTE, C.A_FINALIZE]]), -1)
    actions = jnp.concatenate([
        jnp.asarray([C.A_INFER]), plan_actions[: params.n_plans].reshape(-1), jnp.asarray([C.A_VOTE]),
        jnp.where(rerun, jnp.asarray([C.A_RERUN]), -1), plan_actions[params.n_plans :].reshape(-1),
        jnp.where(rerun, jnp.asarray([C.A_VOTE]), -1),
    ]).astype(jnp.int32)  # fmt: skip
    out = C.TaskOut(
        entry=entry, route=route, actions=actions, moves=(PARTS * ran.sum()).astype(jnp.int32),
        answered=jnp.bool_(True), correct=oks[winner], answer_id=answer_id, inferred_pair=inferred,
        pair_correct=pair_ok, end=jnp.int32(C.E_NONE), calls=calls, reviews=C.stack([C.no_review()]),
    )  # fmt: skip
    return state, out
