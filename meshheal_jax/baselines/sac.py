"""SAC, self-anchored consensus (Lee et al. 2026, arXiv 2605.09076; Algorithm 1, no official code).

Mechanism kept: three teams solve the task independently (three H/C/F executions from three
distinct entry agents); then two rounds of filtering and refinement: each team scores the other
teams' answers with its own evaluator (one review call each), drops those scoring below its own
answer (at most F = 1) and refines its answer from its own plus the retained ones (one call);
the final answer is the majority vote over the three teams (ties: the answer of the team whose
evaluator scores highest).

Mapping decisions (ours), each a named parameter below:
- teams 2 and 3 enter at further uniform picks over agents distinct from the earlier entries
  (entry uniform of their own draws); team k >= 1 uses row k - 1 of field 100 (a full draw layout);
  each team infers its own pair and routes with the shared shortest-path next hop;
- a team's evaluator and refiner is its finalizer; an unanswered team neither evaluates nor votes;
- "below its own answer": the evaluation call shows both answers and returns the other's score
  (a review sample); the anchor (the evaluator's score of its own answer) is one more review
  sample drawn once per round inside the team's first evaluation call (no extra call), on that
  call's model (under judge_rule "ability" the first judged answer's ability decides it, live and
  emulated alike); an answer is below iff its score < the anchor; if more than F are below, the F lowest are dropped (ties:
  the later team);
- `judge_rule` as in RAPS: "ability" (default; the model-backed rule on the judged answer's
  finalize ability: an evaluation is a review call, not one of architecture.md's calls tied to
  no ability) or "caller" (strong iff the evaluator is healthy; the default until the
  twenty-sixth session, decisions B0);
- refine (model-backed rule on the team's finalize ability, i.e. strong iff healthy): a right
  answer stays right with `p_keep[model]`; a wrong one becomes right with `p_fix[model]` only if
  a retained answer is right, else stays wrong with its distractor id; a right answer turned
  wrong takes a distractor of the refiner's model;
- tie rule: the team whose evaluator's anchor score in the last round is highest (then the
  lowest team index);
- SAC uniforms: control rows (field 110) read as (rounds, teams, teams + 1, 4): per team the
  evaluation calls in team order, then the refinement call, then the anchor sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshheal_jax import draws as D
from meshheal_jax.baselines import common as C
from meshheal_jax.errors import MeshHealError

METHOD = "sac"
NEUTRAL_ANCHOR = 0.5  # live: the anchor of a team that evaluated no other answer (prompts.NEUTRAL_SCORE)


@C.pytree
class SACParams:
    max_filtered: int = 1  # F: at most F answers dropped per team per round
    judge_rule: str = C.static_field("ability")  # "ability" | "caller"
    n_teams: int = C.static_field(3)
    rounds: int = C.static_field(2)
    budget: C.Budget = C.static_field(C.Budget())
    next_hop_ties: str = C.static_field("random")  # the shared routing's tie rule (protocol.next_hop_ties)

    def check(self, n_agents: int) -> None:
        C.check_judge_rule("SAC", self.judge_rule)
        if not 2 <= self.n_teams <= min(n_agents, C.N_PARALLEL + 1):
            raise MeshHealError(
                f"SAC: n_teams must be in 2..min(agents, {C.N_PARALLEL + 1}), got {self.n_teams}"
            )
        if sac_rows(self) > C.N_CONTROL:
            raise MeshHealError(f"SAC: rounds x teams x (teams + 1) must be <= {C.N_CONTROL} control rows")


@C.pytree
class SACState:
    tasks_done: jax.Array  # () int32 (SAC keeps no state across tasks)


def sac_rows(params: SACParams) -> int:
    """Control rows SAC reads: per round, per team, its evaluations, its refinement, its anchor."""
    return params.rounds * params.n_teams * (params.n_teams + 1)


def init_state(params: SACParams, world: C.World) -> SACState:
    return SACState(tasks_done=jnp.int32(0))


def others_table(n: int) -> np.ndarray:
    """(n, n-1): for each team the other teams in increasing order."""
    return np.asarray([[m for m in range(n) if m != k] for k in range(n)], dtype=np.int32).reshape(n, n - 1)


# ------------------------------------------------------------------------------------------------
# Pure mechanism functions (tested directly)
# ------------------------------------------------------------------------------------------------


def filter_answers(max_filtered, scores, anchor, valid):
    """scores (n, n-1) the others' scores per team, anchor (n,), valid (n, n-1) evaluated.

    Below = score < anchor; at most `max_filtered` dropped per team: the lowest scores (ties: the
    later team). Returns dropped (n, n-1) bool."""
    below = valid & (scores < anchor[:, None])
    j = jnp.arange(scores.shape[1])
    earlier_in_drop_order = below[:, None, :] & (
        (scores[:, None, :] < scores[:, :, None])
        | ((scores[:, None, :] == scores[:, :, None]) & (j[None, None, :] > j[None, :, None]))
    )  # [k, j, j']: j' is dropped before j
    return below & (earlier_in_drop_order.sum(axis=2) < max_filtered)


def majority_vote(answer_ids, valid, tie_scores):
    """Plurality over the valid teams; a strict majority wins; otherwise among the most-voted the
    team with the highest tie score (then the lowest index). Returns (winning team, answer id)."""
    same = valid[:, None] & valid[None, :] & (answer_ids[:, None] == answer_ids[None, :])
    votes = same.sum(axis=1)
    top = jnp.max(jnp.where(valid, votes, 0))
    candidates = valid & (votes == top)
    team = jnp.argmax(jnp.where(candidates, tie_scores, -jnp.inf)).astype(jnp.int32)
    return team, jnp.where(valid.any(), answer_ids[team], -1).astype(jnp.int32)


def refine_outcome(own_ok, any_retained_ok, u, p_keep, p_fix):
    """Refinement correctness: keep a right answer with p_keep; fix a wrong one with p_fix iff a
    retained answer is right."""
    return jnp.where(own_ok, u < p_keep, any_retained_ok & (u < p_fix))


# ------------------------------------------------------------------------------------------------
# One task
# ------------------------------------------------------------------------------------------------


def task_step(params: SACParams, emu: C.Emu, world: C.World, state: SACState, t, uniforms: C.TaskUniforms):
    n_agents = world.holds.shape[0]
    n = params.n_teams
    ty = world.task_type[t - 1]
    team_draws = [uniforms.execution(k) for k in range(n)]
    entries = []
    for k, dk in enumerate(team_draws):
        free = jnp.ones(n_agents, bool)
        for e in entries:
            free = free.at[e].set(False)
        entries.append(C.pick_index(dk.entry, n_agents) if k == 0 else C.pick_from_mask(dk.entry, free))
    draws = C.stack(team_draws)

    def team(entry, dk, k):
        inferred, pair_ok, call_infer = C.emulate_infer(emu, world, entry, t, ty, dk.infer, execution=k)
        _, path, calls, _ = C.run_path(emu, world, t, ty, entry, world.pair_abilities[inferred], pair_ok, dk.calls,
                                       choose=C.default_choose(world, dk.route, params.next_hop_ties), budget=params.budget,
                                       execution=k)  # fmt: skip
        return inferred, pair_ok, path, C.concat([C.stack([call_infer]), calls])

    team_ids = jnp.arange(n, dtype=jnp.int32)
    inferred, pair_ok, paths, path_calls = jax.vmap(team)(jnp.stack(entries), draws, team_ids)
    answered, ok, ids = paths.answered, paths.answer_ok, paths.answer_id
    roles, tokens, fin, fin_s = paths.answer_role, paths.answer_tokens, paths.finalizer, paths.fin_ability
    others = jnp.asarray(others_table(n))
    u_sac = uniforms.control[: sac_rows(params)].reshape(params.rounds, n, n + 1, D.N_CALL_U)
    f, s_f = jnp.maximum(fin, 0), jnp.maximum(fin_s, 0)
    round_calls, round_reviews, anchor = [], [], jnp.zeros(n)
    visit = jnp.max(paths.moves) + 1  # (records only) after the teams' executions
    fin_o, s_o = fin[others], fin_s[others]  # (n, n-1) the judged teams' finalizers / abilities
    for r_ in range(params.rounds):
        u = u_sac[r_]  # (n, n + 1, 4): evaluations, refinement, anchor
        u_eval, u_ref, u_anchor = u[:, : n - 1], u[:, n - 1], u[:, n]
        if params.judge_rule == "caller":
            judge = jnp.broadcast_to(C.role_of(world, f, -1, t)[:, None], (n, n - 1))
        else:
            judge = C.role_of(world, f[:, None], jnp.maximum(s_o, 0), t)
        valid = answered[:, None] & answered[others]
        # each team's first evaluation call, which also scores its own answer
        first = jnp.argmax(valid, axis=1)
        refiner = C.role_of(world, f, s_f, t)
        if emu.live:
            # each evaluation call scores the evaluator's own answer and another team's; the
            # anchor is the own score of the team's first evaluation (0.5 when it made none)
            r = C.live_reply("evaluate", world, t, valid, after=tokens, agent=fin[:, None], role=judge,
                             author=fin_o, ability=s_o, team=team_ids[:, None], other=others, round=r_,
                             visit=visit, execution=team_ids[:, None])  # fmt: skip
            scores, eval_prompt, eval_completion, eval_request = r.score, r.prompt, r.completion, r.request
            anchor = jnp.where(valid.any(axis=1), r.own_score[team_ids, first], NEUTRAL_ANCHOR)
        else:  # the anchor on the model of the call it comes from, as live
            anchor = C.review_score(emu, world, t, judge[team_ids, first], roles, ok, u_anchor[:, D.U_MAIN])
            # as live: a team that judged no other answer has no anchor of its own (the neutral one)
            anchor = jnp.where(valid.any(axis=1), anchor, NEUTRAL_ANCHOR)
            scores = C.review_score(emu, world, t, judge, roles[others], ok[others], u_eval[..., D.U_MAIN])
            eval_completion = C.completion_tokens(emu, judge, C.K_EVALUATE, u_eval[..., D.U_TOKENS])
            eval_prompt = (
                emu.prompt[judge, C.K_EVALUATE]
                + world.question_tokens[t - 1]
                + tokens[:, None]
                + tokens[others]
            )
            eval_request = -1
        dropped = filter_answers(params.max_filtered, scores, anchor, valid)
        retained = valid & ~dropped
        # refinement by each team's finalizer (all teams at once, from the round's start answers)
        if emu.live:
            kept = jnp.zeros((n, n), bool).at[team_ids[:, None], others].set(retained)  # (team, team kept)
            r = C.live_reply("refine", world, t, answered, after=scores, agent=fin, role=refiner, ability=fin_s,
                             team=team_ids, round=r_, visit=visit, execution=team_ids, vectors={"kept": kept})  # fmt: skip
            new_ids = jnp.where(answered, r.answer_id, -1).astype(jnp.int32)
            new_ok = answered & (new_ids == 0)
            ref_prompt, ref_completion, ref_request = r.prompt, r.completion, r.request
        else:
            new_ok = refine_outcome(ok, jnp.any(retained & ok[others], axis=1), u_ref[:, D.U_MAIN],
                                    emu.p_keep[refiner], emu.p_fix[refiner]) & answered  # fmt: skip
            wrong_id = jnp.where(ok, C.distractor(emu, refiner, u_ref[:, D.U_DISTRACTOR]), ids)
            new_ids = jnp.where(answered, jnp.where(new_ok, 0, wrong_id), -1).astype(jnp.int32)
            ref_completion = C.completion_tokens(emu, refiner, C.K_REFINE, u_ref[:, D.U_TOKENS])
            ref_prompt = (emu.prompt[refiner, C.K_REFINE] + world.question_tokens[t - 1] + tokens
                          + jnp.sum(jnp.where(retained, tokens[others], 0), axis=1))  # fmt: skip
            ref_request = -1
        evaluations = C.make_call(valid, C.K_EVALUATE, visit, fin[:, None], judge, eval_prompt, eval_completion,
                                  author=fin_o, ability=s_o, score=scores, request=eval_request,
                                  correct=-1 if emu.live else ok[others].astype(jnp.int32))  # fmt: skip
        refinements = C.make_call(answered, C.K_REFINE, visit, fin, refiner, ref_prompt, ref_completion, author=fin,
                                  ability=fin_s, answer_id=new_ids, correct=new_ok.astype(jnp.int32),
                                  request=ref_request)  # fmt: skip
        per_team = jax.tree_util.tree_map(lambda e, f_: jnp.concatenate([e, f_[:, None]], axis=1),
                                          evaluations, refinements)  # fmt: skip
        round_calls.append(C.flatten(per_team))  # per team: its evaluations, then its refinement
        selves = C.make_review(answered, C.R_SELF_EVALUATE, visit, fin, fin_s, fin, anchor, roles, ok)
        judged = C.make_review(
            valid, C.R_EVALUATE, visit, fin_o, s_o, fin[:, None], scores, roles[others], ok[others]
        )
        round_reviews.append(C.flatten(jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a[:, None], b], axis=1), selves, judged)))  # fmt: skip
        ok, ids = new_ok, new_ids
        roles = jnp.where(answered, refiner, roles)
        tokens = jnp.where(answered, C.visible_tokens(emu, refiner, ref_completion), tokens)
    winner, answer_id = majority_vote(ids, answered, anchor)
    any_answer = answered.any()
    round_actions = [C.A_EVALUATE, C.A_REFINE] * params.rounds + [C.A_VOTE]
    out = C.TaskOut(
        entry=entries[0], route=jnp.concatenate([C.path_route(jax.tree_util.tree_map(lambda x, k=k: x[k], paths))
                                                 for k in range(n)]),
        actions=jnp.concatenate([paths.actions.reshape(-1), jnp.asarray(round_actions, jnp.int32)]),
        moves=paths.moves.sum(), answered=any_answer, correct=any_answer & ok[winner] & (answer_id == 0),
        answer_id=answer_id, inferred_pair=inferred[0], pair_correct=pair_ok[0],
        end=jnp.where(any_answer, C.E_NONE, paths.end[0]).astype(jnp.int32),
        calls=C.concat([C.flatten(path_calls)] + round_calls),
        reviews=C.concat(round_reviews),
    )  # fmt: skip
    return SACState(tasks_done=state.tasks_done + 1), out
