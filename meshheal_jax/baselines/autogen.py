"""AutoGen group chat with a mandatory manager (Wu et al. 2023; microsoft/autogen v0.2 `groupchat.py`).

Mechanism kept: A3 is the manager and appears on every path. The task goes to the manager, which
infers the required abilities and, for each missing ability, makes a speaker-selection LLM call
naming the next worker: a holder of the ability with prob `p_select[manager model]`, else a
random worker. Workers Contribute / Finalize as usual (a worker that does not hold the ability
answers with the weak model, by the model-backed rule), and the manager composes the final
reply (one call); a weak manager corrupts a correct answer with prob `p_corrupt[model]`.
Defaults: max 10 rounds, one selection retry, no review.

Mapping decisions (ours), each a named parameter below:
- `p_select` = the model file's `p_decide` (the emulator's success rate of decision calls);
- `corrupts`: which manager model corrupts. "weak" (default, baselines.md: "a weak manager
  corrupts"): a compose on the weak model (a degraded manager, by the model-backed rule) corrupts
  with `p_corrupt[weak]`, one on the strong model keeps the answer; "both": the strong model's
  compose corrupts too, with `p_corrupt[strong]` (the default until the twenty-sixth session,
  decisions B3);
- `p_corrupt` = 1 − `p_keep` of each model (a compose keeps a right answer right as a synthesis
  does; with the shipped files 0.020 for gpt-oss-120b and 0.181 for Llama-3.2-1B, and a refit of
  `p_keep` moves it too) unless given as (strong, weak); a wrong answer stays wrong with its
  distractor id; a corrupted one takes a distractor of the manager's model;
- the manager is not a worker (`manager_works=False`), as the GroupChatManager is not among the
  speakers; workers = every other agent; a correct selection is a uniform holder among workers;
- retry trigger: the named worker does not hold the ability (it declines the turn); one retry
  (`selection_retries`); if the retry names a non-holder too, that worker answers anyway;
- the manager's calls (infer, select, compose) are tied to no ability (strong iff healthy);
- abilities are served in vocabulary order (the first contributes, the second finalizes); the
  route is manager -> worker -> manager -> worker -> manager; a call's visit is the move count on
  arrival (worker generations at visits 1 and 3 use calls[1 / 3, GENERATE]);
- control uniforms (field 110): rows 0/1 selection and retry for the first ability, rows 2/3 for
  the second, row 4 the compose call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshheal_jax import draws as D
from meshheal_jax.baselines import common as C
from meshheal_jax.errors import MeshHealError

METHOD = "autogen"
PARTS = 2  # abilities per task under every profile (abilities.md)


@C.pytree
class AutoGenParams:
    manager: int = 2  # A3 (0-based)
    p_corrupt: tuple[float, float] | None = None  # (strong, weak); None: 1 − p_keep of the model files
    corrupts: str = C.static_field("weak")  # "weak" | "both": which manager model corrupts
    max_rounds: int = C.static_field(10)
    selection_retries: int = C.static_field(1)
    manager_works: bool = C.static_field(False)

    def check(self, n_agents: int) -> None:
        if not 0 <= self.manager < n_agents:
            raise MeshHealError(f"AutoGen: manager {self.manager} is not an agent of 0..{n_agents - 1}")
        if self.p_corrupt is not None:
            p = np.asarray(self.p_corrupt)
            if not (p.shape == (2,) and p.dtype.kind in "iuf" and ((p >= 0) & (p <= 1)).all()):
                raise MeshHealError(
                    f"AutoGen: p_corrupt must be (strong, weak) probabilities in [0, 1], got {self.p_corrupt!r}"
                )
        if self.corrupts not in ("weak", "both"):
            raise MeshHealError(f"AutoGen: corrupts must be 'weak' or 'both', got {self.corrupts!r}")
        if self.selection_retries not in (0, 1):
            raise MeshHealError("AutoGen: selection_retries must be 0 or 1")
        turns = PARTS * (1 + self.selection_retries) + 1
        if self.max_rounds < turns:
            raise MeshHealError(f"AutoGen: max_rounds {self.max_rounds} < the {turns} turns a task can take")


@C.pytree
class AutoGenState:
    tasks_done: jax.Array  # () int32 (AutoGen keeps no learning state across tasks)


def init_state(params: AutoGenParams, world: C.World) -> AutoGenState:
    return AutoGenState(tasks_done=jnp.int32(0))


def speaker_selection(holds, workers, ability, ok, u_pick):
    """The worker a selection call names: a uniform holder among workers when the call succeeds
    (any worker if no worker holds it), else a uniform worker."""
    holders = holds[:, ability] & workers
    holders = jnp.where(holders.any(), holders, workers)
    return jnp.where(ok, C.pick_from_mask(u_pick, holders), C.pick_from_mask(u_pick, workers)).astype(
        jnp.int32
    )


def compose(p_corrupt, answer_ok, answer_id, u, distractor_id):
    """The manager's final reply: a right answer is corrupted with prob p_corrupt (u < p)."""
    corrupt = answer_ok & (u < p_corrupt)
    return answer_ok & ~corrupt, jnp.where(corrupt, distractor_id, answer_id).astype(jnp.int32)


def task_step(
    params: AutoGenParams, emu: C.Emu, world: C.World, state: AutoGenState, t, uniforms: C.TaskUniforms
):
    d, control = uniforms.task, uniforms.control
    ty = world.task_type[t - 1]
    n = world.holds.shape[0]
    m = jnp.asarray(params.manager, jnp.int32)
    role_m = C.role_of(world, m, -1, t)
    workers = jnp.ones(n, bool) if params.manager_works else jnp.arange(n) != m
    p_corrupt = (1.0 - emu.p_keep) if params.p_corrupt is None else jnp.asarray(params.p_corrupt, jnp.float64)
    if params.corrupts == "weak":
        p_corrupt = p_corrupt.at[C.STRONG].set(0.0)
    inferred, pair_ok, call_infer = C.emulate_infer(emu, world, m, t, ty, d.infer)
    required = world.pair_abilities[inferred]
    abilities = (C.first_true(required), C.last_true(required))
    calls, actions, route = [call_infer], [C.A_INFER], [m]
    draft_ok, draft_tokens = jnp.bool_(True), jnp.int32(0)
    gen = None
    for k, s in enumerate(abilities):
        visit = 2 * k
        named, tries = [], []
        for attempt in range(1 + params.selection_retries):
            u = control[2 * k + attempt]
            asked = jnp.bool_(True) if attempt == 0 else ~world.holds[named[-1], s]
            if attempt > 0:
                asked = asked & tries[-1]
            if emu.live:  # the manager names a worker; a reply naming none -> a uniform worker
                r = C.live_reply("select", world, t, asked, after=draft_tokens, agent=m, role=role_m, ability=s,
                                 visit=visit, attempt=attempt, execution=0, vectors={"workers": workers})  # fmt: skip
                fallback = C.pick_from_mask(u[D.U_AUX], workers)
                w = jnp.where((r.choice >= 0) & workers[jnp.maximum(r.choice, 0)], r.choice, fallback)
                prompt, completion, request = r.prompt, r.completion, r.request
            else:
                ok = u[D.U_MAIN] < emu.p_decide[role_m]
                w = speaker_selection(world.holds, workers, s, ok, u[D.U_AUX])
                prompt = emu.prompt[role_m, C.K_SELECT] + world.question_tokens[t - 1] + draft_tokens
                completion, request = C.completion_tokens(emu, role_m, C.K_SELECT, u[D.U_TOKENS]), -1
            if attempt > 0:
                w = jnp.where(asked, w, named[-1])
            calls.append(C.make_call(asked, C.K_SELECT, visit, m, role_m, prompt, completion, ability=s,
                                     correct=world.holds[w, s].astype(jnp.int32), request=request))  # fmt: skip
            actions.append(jnp.where(asked, C.A_SELECT if attempt == 0 else C.A_RESELECT, -1))
            named.append(w)
            tries.append(asked)
        worker = named[-1]
        finalize = k == PARTS - 1
        gen, call = C.emulate_generate(emu, world, t, ty, worker, s, finalize, pair_ok, draft_ok, draft_tokens,
                                       d.calls[visit + 1, D.GENERATE], visit + 1)  # fmt: skip
        calls.append(call)
        actions.append(C.A_FINALIZE if finalize else C.A_CONTRIBUTE)
        route += [worker, m]
        if not finalize:
            draft_ok, draft_tokens = draft_ok & gen.part_ok, draft_tokens + gen.tokens
    u = control[2 * PARTS]
    if emu.live:  # the manager composes the reply from the finalizing worker's answer (visit 2·PARTS − 1)
        r = C.live_reply("compose", world, t, True, after=gen.tokens, agent=m, role=role_m, visit=2 * PARTS,
                         judged_visit=2 * PARTS - 1, execution=0)  # fmt: skip
        answer_id, prompt, completion, request = r.answer_id, r.prompt, r.completion, r.request
        ok = answer_id == 0
    else:
        ok, answer_id = compose(p_corrupt[role_m], gen.answer_ok, gen.answer_id, u[D.U_MAIN],
                                C.distractor(emu, role_m, u[D.U_DISTRACTOR]))  # fmt: skip
        prompt = emu.prompt[role_m, C.K_COMPOSE] + world.question_tokens[t - 1] + draft_tokens + gen.tokens
        completion, request = C.completion_tokens(emu, role_m, C.K_COMPOSE, u[D.U_TOKENS]), -1
    calls.append(C.make_call(True, C.K_COMPOSE, 2 * PARTS, m, role_m, prompt, completion, author=m,
                             answer_id=answer_id, correct=ok.astype(jnp.int32), request=request))  # fmt: skip
    actions.append(C.A_COMPOSE)
    route_arr = jnp.stack([jnp.asarray(a, jnp.int32) for a in route] + [jnp.int32(C.ROUTE_SEP)])
    out = C.TaskOut(
        entry=m, route=route_arr, actions=jnp.stack([jnp.asarray(a, jnp.int32) for a in actions]),
        moves=jnp.int32(len(route) - 1), answered=jnp.bool_(True), correct=ok, answer_id=answer_id,
        inferred_pair=inferred, pair_correct=pair_ok, end=jnp.int32(C.E_NONE), calls=C.stack(calls),
        reviews=C.stack([C.no_review()]),
    )  # fmt: skip
    return AutoGenState(tasks_done=state.tasks_done + 1), out
