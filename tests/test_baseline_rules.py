"""The baselines' rules of spec/baselines.md and docs/decisions.md B1-B5, each replayed from the
records of one emulated 504-task stream or checked on a hand-built case, and the completion-token
rule of decisions E7 in all three emulators. A mutation of each rule passed every other test
(twenty-fourth session's mutation pass)."""

from __future__ import annotations

import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
from test_baselines import N_TASKS, NETWORK, PAIR, PROFILE, spec  # the streams test_baselines runs

from meshheal_jax import draws as D
from meshheal_jax import engine, reference
from meshheal_jax.baselines import common as BC
from meshheal_jax.baselines import simulate, symphony
from meshheal_jax.params import ANCHORS
from meshheal_jax.topology import build_network

NETWORKS = {
    "complete": NETWORK,
    # a path A1-A2-...-A6: holders are up to 5 hops away, so AgentNet's forward limit binds
    "line": build_network(PROFILE, edges=np.asarray([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])),
}


@functools.cache
def run(method: str, graph: str = "complete"):
    """(state, TaskOut) of one stream (seed 0, A3/A5 degraded from the midpoint), numpy, stream axis dropped."""
    states, outs = simulate(method, [spec(0, method=method)._replace(network=NETWORKS[graph])], PAIR)
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[0], (states, outs))


def executions(route: np.ndarray) -> list[list[int]]:
    """A task's executions (its route as the tasks table writes it, split), padding dropped."""
    return [[int(a) for a in e.split("-")] for e in BC._route_text(route.tolist()).split("|") if e]


# ------------------------------------------------------------------------------------------------
# AgentNet (spec: "At most 3 forwards per task"; "Success feedback = the task's final correctness";
# edge weights w <- clip(w·(1.1 if success else 0.9), 0.1, 2.0) on the route's forward edges)
# ------------------------------------------------------------------------------------------------


def test_agentnet_forward_limit_and_success_needs_an_answer():
    _, out = run("agentnet", "line")
    forwards = (out.actions == BC.A_FORWARD).sum(axis=1)
    assert forwards.max() <= 3
    assert (out.end == BC.E_FORWARD_LIMIT).any()  # the limit binds in this stream
    assert not (out.correct & ~out.answered).any()  # an unanswered task is never a success
    assert (~out.answered).any()


def test_agentnet_edge_weights_replay_from_the_routes():
    """decisions B1: each distinct forward edge i -> j of the route, once per task, w·1.1|0.9
    clipped to [0.1, 2.0]; edges off the route unchanged."""
    state, out = run("agentnet")
    w = np.ones((6, 6))
    for t in range(N_TASKS):
        (route,) = executions(out.route[t])
        used = set(itertools.pairwise(route))
        for i, j in used:
            w[i, j] = min(2.0, max(0.1, w[i, j] * (1.1 if out.correct[t] else 0.9)))
    np.testing.assert_allclose(state.edge_weight, w, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# AutoGen (decisions B3: "one retry when the named worker lacks the ability")
# ------------------------------------------------------------------------------------------------


def test_autogen_retries_exactly_when_the_named_worker_lacks_the_ability():
    _, out = run("autogen")
    calls = out.calls
    select = calls.valid & (calls.kind == BC.K_SELECT)
    retried = declined = 0
    for t in range(N_TASKS):
        by_ability: dict[int, list[int]] = {}
        for k in np.flatnonzero(select[t]):
            by_ability.setdefault(int(calls.ability[t, k]), []).append(int(calls.correct[t, k]))
        assert len(by_ability) == 2
        for named_holder in by_ability.values():
            assert len(named_holder) == 1 + (named_holder[0] == 0), (t, by_ability)
            retried += len(named_holder) == 2
            declined += named_holder[0] == 0
    assert retried == declined > 0


# ------------------------------------------------------------------------------------------------
# SAC (spec: refine "from its own plus the retained ones"; final vote "ties: the answer of the team
# whose evaluator scores highest", decisions B4: the highest last anchor)
# ------------------------------------------------------------------------------------------------


def sac_rounds(out, t):
    """Per round (own ok (3,), anchor (3,), others' scores (3, 2), others' ok (3, 2), refined ok
    (3,), refined answer id (3,)), or None when a team did not answer."""
    rv, calls = out.reviews, out.calls
    if not rv.valid[t].all():
        return None
    refine = np.flatnonzero(calls.valid[t] & (calls.kind[t] == BC.K_REFINE))
    if refine.size != 6:
        return None
    rounds = []
    for r in range(2):
        block = slice(9 * r, 9 * (r + 1))
        action = rv.action[t, block].reshape(3, 3)
        assert (action[:, 0] == BC.R_SELF_EVALUATE).all() and (action[:, 1:] == BC.R_EVALUATE).all()
        score = rv.score[t, block].reshape(3, 3)
        ok = rv.correct[t, block].reshape(3, 3)
        k = refine[3 * r : 3 * (r + 1)]
        rounds.append(
            (ok[:, 0], score[:, 0], score[:, 1:], ok[:, 1:], calls.correct[t, k] == 1, calls.answer_id[t, k])
        )
    return rounds


def answered_sac_rounds(out):
    """(t, sac_rounds) of every task whose teams all answered."""
    for t in range(N_TASKS):
        rounds = sac_rounds(out, t)
        if rounds is not None:
            yield t, rounds


def test_sac_refinement_fixes_only_from_a_retained_right_answer():
    """A wrong answer becomes right only if an answer the team kept (not dropped by its filter:
    the lowest one scoring below its anchor) is right."""
    _, out = run("sac")
    checked = 0
    for t, rounds in answered_sac_rounds(out):
        for own_ok, anchor, scores, other_ok, refined_ok, _ in rounds:
            for k in range(3):
                below = scores[k] < anchor[k]
                dropped = np.zeros(2, bool)
                if below.any():  # F = 1: the lowest below the anchor (ties: the later team)
                    low = np.where(below, scores[k], np.inf)
                    dropped[np.flatnonzero(low == low.min())[-1]] = True
                if not own_ok[k] and refined_ok[k]:
                    assert (other_ok[k] & ~dropped).any(), (t, k, scores[k], anchor[k], other_ok[k])
                    checked += 1
                if not own_ok[k] and (other_ok[k] & dropped).any() and not (other_ok[k] & ~dropped).any():
                    assert not refined_ok[k]
    assert checked > 0


def test_sac_final_vote_tie_goes_to_the_highest_last_anchor():
    _, out = run("sac")
    ties = 0
    for t, rounds in answered_sac_rounds(out):
        _, anchor, _, _, _, ids = rounds[-1]
        if len(set(ids.tolist())) == 3:  # no majority: the tie rule decides
            assert out.answer_id[t] == ids[int(np.argmax(anchor))], (t, ids, anchor)
            ties += 1 if anchor.max() > anchor.min() else 0
    assert ties > 0


# ------------------------------------------------------------------------------------------------
# Symphony (spec: reputation EMA 0.95/0.05 of the reward; load += 0.3 per call, ×0.88 per step;
# stage A keeps the top L = 3 by match; decisions B5: the rerun plans take ranks 0 and 1 again)
# ------------------------------------------------------------------------------------------------


def test_symphony_learning_state_replays_from_the_calls():
    """spec + decisions B5, replayed in numpy: per task load ×0.88 first; each executed call (plan
    order) updates LinUCB with the context its executor had at selection time,
    x = [1, match, load, latency_norm, reputation, available] (L2-normalised if its norm > 1),
    A += x xᵀ, b += r x, with r = 1[non-empty] − 0.2·sqrt(latency_norm) = 0.8 (both models'
    latency_norm is capped at 1 with the defaults); then reputation += 0.05·(r − reputation),
    load = min(1, load + 0.3), latency EMA 0.2 toward 1 from 500 / 2000 ms."""
    state, out = run("symphony")
    holds = NETWORK.holds
    rep, load, lat = np.full(6, 0.5), np.zeros(6), np.full(6, 0.25)
    a_matrix, b_vector = np.eye(6), np.zeros(6)
    calls = out.calls
    executed = calls.valid & np.isin(calls.kind, [BC.K_GENERATE, BC.K_COT])
    reward = 1.0 - 0.2 * np.sqrt(1.0)
    for t in range(N_TASKS):
        load *= 0.88
        seen = (load.copy(), rep.copy(), lat.copy())  # the contexts at selection time
        for k in np.flatnonzero(executed[t]):
            a, s = int(calls.agent[t, k]), int(calls.ability[t, k])
            match = 1.0 if holds[a, s] else 0.2
            x = np.asarray(
                [1.0, match, min(1.0, seen[0][a]), seen[2][a], seen[1][a], float(seen[0][a] < 0.95)]
            )
            norm = np.linalg.norm(x)
            x = x / norm if norm > 1.0 else x
            a_matrix += np.outer(x, x)
            b_vector += reward * x
            rep[a] += 0.05 * (reward - rep[a])
            load[a] = min(1.0, load[a] + 0.3)
            lat[a] += 0.2 * (1.0 - lat[a])
    assert int(state.n_updates) == executed.sum()
    np.testing.assert_allclose(state.a_matrix, a_matrix, rtol=1e-9)
    np.testing.assert_allclose(state.b_vector, b_vector, rtol=1e-9)
    np.testing.assert_allclose(state.reputation, rep, rtol=1e-9)
    np.testing.assert_allclose(state.load, load, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state.latency_norm, lat, rtol=1e-9)


def test_symphony_rerun_plans_reuse_the_executors_of_ranks_0_and_1():
    _, out = run("symphony")
    reruns = 0
    for t in range(N_TASKS):
        plans = executions(out.route[t])
        if len(plans) == 5:
            assert plans[3][1:] == plans[0][1:] and plans[4][1:] == plans[1][1:], plans
            reruns += 1
    assert reruns > 0


def test_symphony_stage_a_keeps_only_the_top_3_by_match():
    """Five holders all available: stage A is the first three by match (ties: lower index), ranked
    ahead of the other matched agents even when those have the higher UCB."""
    sp = symphony.SymphonyParams()
    state = symphony.SymphonyState(
        a_matrix=jnp.eye(6), b_vector=jnp.asarray([0.0, 0.0, 0.0, 0.0, 10.0, 0.0]), n_updates=jnp.int32(1),
        load=jnp.zeros(6), reputation=jnp.asarray([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
        latency_norm=jnp.full(6, 0.25),
    )  # fmt: skip
    holds = jnp.asarray([True, True, True, True, True, False])
    ranking, x = symphony.executor_ranking(sp, state, holds)
    score = np.asarray(symphony.ucb(sp, state, x))
    assert score[3] > score[:3].max()  # the hand-built case: 3 and 4 beat the stage-A agents by UCB
    assert sorted(np.asarray(ranking)[:3].tolist()) == [0, 1, 2]
    assert np.asarray(ranking)[5] == 5  # the non-holder (match 0.2 < 0.3) last


# ------------------------------------------------------------------------------------------------
# RAPS (decisions B2: the watchdog's verdict is a review sample "paired with MeshHeal's first
# review sample": the uniform calls[author's visit, REVIEW_SAMPLES[0]])
# ------------------------------------------------------------------------------------------------


def test_raps_watchdog_score_is_drawn_with_the_first_review_sample_of_the_judged_output():
    _, out = run("raps")
    stream = spec(0).stream
    u_calls = np.asarray(D.stream_draws(0, PROFILE.dataset_id, N_TASKS).calls)
    review_thr = np.asarray(BC.make_emu(PAIR, PROFILE).review_thr)
    calls, rv = out.calls, out.reviews
    checked = 0
    for t in range(N_TASKS):
        watch = [k for k in range(rv.valid.shape[1]) if rv.valid[t, k] and rv.action[t, k] == BC.R_WATCHDOG]
        last_generate, judged = {}, []
        for k in np.flatnonzero(calls.valid[t]):
            if calls.kind[t, k] == BC.K_GENERATE:
                last_generate[int(calls.agent[t, k])] = int(calls.visit[t, k])
            elif calls.kind[t, k] == BC.K_WATCHDOG:
                judged.append((k, last_generate[int(calls.author[t, k])]))
        assert len(judged) == len(watch)
        for (k, visit), r in zip(judged, watch, strict=True):
            u = u_calls[t, visit, D.REVIEW_SAMPLES[0], D.U_MAIN]
            thr = review_thr[
                calls.role[t, k], rv.author_role[t, r], int(rv.correct[t, r]), stream.difficulty[t]
            ]
            assert rv.score[t, r] == ANCHORS[int(D.categorical(u, jnp.asarray(thr)))], (t, k)
            checked += 1
    assert checked > 100


# ------------------------------------------------------------------------------------------------
# Emulator tokens (decisions E7: completion = min + floor(u (max − min + 1)), capped at max)
# ------------------------------------------------------------------------------------------------


def test_completion_tokens_are_uniform_over_min_to_max_inclusive():
    lo, hi = 10, 13
    us = np.asarray([0.0, 0.2499, 0.25, 0.5, 0.7499, 0.75, 0.999999, 1.0])
    want = [10, 10, 11, 12, 12, 13, 13, 13]
    table = np.zeros((2, max(engine.K_SYNTHESIS, BC.K_COT) + 1, 2), np.int32)  # engine and baseline kinds
    table[:, :, 0], table[:, :, 1] = lo, hi
    p = types.SimpleNamespace(completion=jnp.asarray(table))
    got = [int(engine._completion(p, jnp.int32(engine.STRONG), engine.K_GENERATE, u)) for u in us]
    assert got == want
    model = types.SimpleNamespace(completion_tokens={"generate": (lo, hi)})
    assert [reference.ReferenceEmulator._complete(None, model, "generate", float(u)) for u in us] == want
    emu = types.SimpleNamespace(completion=jnp.asarray(table))
    assert [int(BC.completion_tokens(emu, 0, BC.K_GENERATE, u)) for u in us] == want
