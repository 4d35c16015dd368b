"""RAPS (Li et al. 2026, arXiv 2602.08009): reputation-aware publish/subscribe.

Mechanism kept: per ordered pair (observer i, author j) a Beta(1, 1) misbehaviour estimate. When
agent i receives an output of j, i makes one watchdog call scoring it s in {0, 1} (1 = a concrete
error); x <- λx + s, y <- λy + (1 − s), λ = 0.9, E[P_ij] = x / (x + y). The broker routes a
missing ability to the neighbours holding it (similarity filter = ability match), excludes those
with E[P] >= τ_rep = 0.7 and picks uniformly among the rest, or the lowest E[P] if all are
excluded. No correction of the current task: reputation acts on later routing only.

Mapping decisions (ours), each a named parameter below:
- the watchdog is made by the receiver = the next agent on the route after a Contribute (the
  finalizer on a two-agent path); a final answer has no receiving agent, so it is not watched;
- its verdict is one review sample (reviewer model, author model, judged part correct?) with
  s = 1[score <= 0.40] (`watchdog_threshold`), drawn with the uniforms MeshHeal uses for the
  first review sample of that output (calls[author's visit, REVIEW_SAMPLES[0]]): paired;
- `judge_rule`: which model serves the watchdog. "ability" (default): the model-backed rule on
  the judged ability (protocol.md §1: a call by i about ability s is strong iff i is healthy and
  holds s; a watchdog verdict is a review sample of an ability-s output, and architecture.md's
  calls tied to no ability do not list it), so the receiver of a two-agent path, which never
  holds that ability, judges with the weak model: the "cheap LLM call" of baselines.md;
  "caller": tied to no ability, strong iff the receiver is healthy (the default until the
  twenty-sixth session, decisions B0);
- the first uniform pick among the allowed holders uses the visit's HOP_TIE draw and the missing
  ability the visit's HOP_ABILITY draw (as MeshHeal's next hop); when no neighbour holds the
  missing ability the task relays one hop along the shared shortest path instead;
- the posterior is updated at the watchdog call, before the receiver's own next-hop decision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshheal_jax import draws as D
from meshheal_jax.baselines import common as C

METHOD = "raps"


@C.pytree
class RAPSParams:
    lam: float = 0.9  # forgetting factor of the Beta counts
    tau_rep: float = 0.7  # exclusion threshold on E[P]
    prior_x: float = 1.0  # Beta(1, 1)
    prior_y: float = 1.0
    watchdog_threshold: float = 0.40  # s = 1 iff the watchdog's review sample <= tau_to (0.40)
    judge_rule: str = C.static_field("ability")  # "ability" | "caller"
    budget: C.Budget = C.static_field(C.Budget())
    next_hop_ties: str = C.static_field(
        "random"
    )  # the relay's shortest-path tie rule (protocol.next_hop_ties)

    def check(self, n_agents: int) -> None:
        C.check_judge_rule("RAPS", self.judge_rule)


@C.pytree
class RAPSState:
    x: jax.Array  # (N, N) float64 misbehaviour counts, observer (row) about author (column)
    y: jax.Array  # (N, N) float64 good-behaviour counts


def init_state(params: RAPSParams, world: C.World) -> RAPSState:
    n = world.holds.shape[0]
    return RAPSState(
        x=jnp.full((n, n), params.prior_x, jnp.float64), y=jnp.full((n, n), params.prior_y, jnp.float64)
    )


# ------------------------------------------------------------------------------------------------
# Pure mechanism functions (tested directly)
# ------------------------------------------------------------------------------------------------


def beta_update(params: RAPSParams, state: RAPSState, observer, author, misbehaved) -> RAPSState:
    """x <- λx + s, y <- λy + (1 − s) for the pair (observer, author) only."""
    s = jnp.asarray(misbehaved, jnp.float64)
    x = state.x.at[observer, author].set(params.lam * state.x[observer, author] + s)
    y = state.y.at[observer, author].set(params.lam * state.y[observer, author] + (1.0 - s))
    return RAPSState(x=x, y=y)


def expected_misbehaviour(state: RAPSState):
    """(N, N) E[P_ij] = x / (x + y)."""
    return state.x / (state.x + state.y)


def broker_choice(params: RAPSParams, state: RAPSState, holds, adjacency, agent, ability, u_pick):
    """Among the neighbours holding `ability`: uniform over those with E[P] < τ_rep, else the lowest
    E[P] (ties: lowest index). Returns (agent or -1 if no neighbour holds it, all excluded?)."""
    p = expected_misbehaviour(state)[agent]
    candidates = adjacency[agent] & holds[:, ability]
    allowed = candidates & ~(p >= params.tau_rep - C.TOL)
    lowest = jnp.argmin(jnp.where(candidates, p, jnp.inf)).astype(jnp.int32)
    j = jnp.where(allowed.any(), C.pick_from_mask(u_pick, allowed), lowest)
    return jnp.where(candidates.any(), j, -1).astype(jnp.int32), candidates.any() & ~allowed.any()


def watchdog_verdict(params: RAPSParams, score):
    """1 = misbehaviour: the review sample is a low score (<= threshold, tolerance toward flagging)."""
    return score <= params.watchdog_threshold + C.TOL


# ------------------------------------------------------------------------------------------------
# One task
# ------------------------------------------------------------------------------------------------


def task_step(params: RAPSParams, emu: C.Emu, world: C.World, state: RAPSState, t, uniforms: C.TaskUniforms):
    d = uniforms.task
    ty = world.task_type[t - 1]
    entry = C.pick_index(d.entry, world.holds.shape[0])
    inferred, pair_ok, call_infer = C.emulate_infer(emu, world, entry, t, ty, d.infer)
    required = world.pair_abilities[inferred]

    def arrive(mstate, path, v, valid):
        receiver, author, s = path.agent, path.out_author, path.out_ability
        if params.judge_rule == "caller":
            role = C.role_of(world, receiver, -1, t)
        else:
            role = C.role_of(world, receiver, s, t)
        u = d.calls[path.out_visit, D.REVIEW_SAMPLES[0]]
        if emu.live:  # the receiver's review of the output it received (its text: the author's visit)
            r = C.live_reply("watchdog", world, t, valid, after=path.out_tokens, agent=receiver, role=role,
                             author=author, ability=s, visit=v, judged_visit=path.out_visit, execution=0)  # fmt: skip
            score, prompt, completion, request, correct = r.score, r.prompt, r.completion, r.request, -1
        else:
            score = C.review_score(emu, world, t, role, path.out_role, path.out_ok, u[D.U_MAIN])
            prompt = (
                emu.prompt[role, C.K_WATCHDOG]
                + world.question_tokens[t - 1]
                + path.out_context
                + path.out_tokens
            )
            completion = C.completion_tokens(emu, role, C.K_WATCHDOG, u[D.U_TOKENS])
            request, correct = -1, path.out_ok.astype(jnp.int32)
        bad = watchdog_verdict(params, score)
        mstate = beta_update(params, mstate, receiver, jnp.maximum(author, 0), bad)
        call = C.make_call(True, C.K_WATCHDOG, v, receiver, role, prompt, completion, author=author, ability=s,
                           score=score, correct=correct, request=request)  # fmt: skip
        review = C.make_review(True, C.R_WATCHDOG, v, author, s, receiver, score, path.out_role, path.out_ok)
        return mstate, call, review

    def choose(mstate, path, v, missing, valid):
        s = C.pick_from_mask(d.route[v, D.HOP_ABILITY], missing)
        j, _ = broker_choice(params, mstate, world.holds, world.adjacency, path.agent, jnp.maximum(s, 0),
                             d.route[v, D.HOP_TIE])  # fmt: skip
        relay, end = C.shortest_path_hop(world, path.agent, missing, d.route[v], params.next_hop_ties)
        j = jnp.where(j >= 0, j, relay).astype(jnp.int32)
        return mstate, C.Hop(j, jnp.where(j < 0, end, C.E_NONE).astype(jnp.int32), C.no_call())

    state, path, calls, reviews = C.run_path(
        emu, world, t, ty, entry, required, pair_ok, d.calls, choose=choose, arrive=arrive, mstate=state,
        budget=params.budget,
    )  # fmt: skip
    out = C.TaskOut(
        entry=entry, route=C.path_route(path), actions=path.actions, moves=path.moves, answered=path.answered,
        correct=path.answered & path.answer_ok, answer_id=path.answer_id, inferred_pair=inferred,
        pair_correct=pair_ok, end=path.end, calls=C.concat([C.stack([call_infer]), calls]), reviews=reviews,
    )  # fmt: skip
    return state, out
