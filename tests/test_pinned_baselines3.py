"""Rules of the baselines' shared emulator and execution layer (baselines/common.py, run.py) that a
third mutation audit changed without a failing test. Emulator (protocol.md §3 step 2, decisions
E4/E6/E7/E8/E9, B2): what inference, a Contribute, a Finalize and a RAPS watchdog draw, replayed
exactly from the task draws of a RAPS stream (its execution 0 reads `draws.task_draws` itself,
decisions B0, so every recorded call can be recomputed from the stream's uniforms, the model files
and the health schedule). The pair is the default one with changes that make mutants observable: a
latent difficulty spread on both models and a review difficulty on the weak one, RAPS's watchdog
model (so the question's bin matters, E9), and another wrong-answer skew on the weak model (so the
writing model's distractor table matters, E6). Also: the cot token figures, SAC's author model,
the move budget's bound, the reset of moves since the last output, AgentNet's 3 forwards, the shared
next hop's ability pick and unreachable end (protocol.md §3, decisions B0/B4/B7/B8), AutoGen's
manager model and retry log, live inference's fallback, and a stream's method label. Each test
fails on its mutant."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import test_pinned_baselines2 as pinned2  # the first audit's streams, networks and labels
from test_pinned_baselines2 import COMPLETE, LABELS, LADDER, PROFILE

from meshheal_jax import draws as D
from meshheal_jax.baselines import BaselineSpec, autogen, run, run_baseline_frames, simulate
from meshheal_jax.baselines import common as C
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import ANCHORS, AUTHOR_ROLES, load_pair
from meshheal_jax.streams import HealthSchedule
from meshheal_jax.topology import build_network

N_TASKS = 252
LINE_EDGES = np.asarray([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])
# every task needs three abilities (mathematical, sequence, logical) on a line: a Contribute can come
# after a move, so a task moves on both sides of it
LINE3 = build_network(
    dataclasses.replace(PROFILE, requires=((0, 3, 4),) * len(PROFILE.task_types)), edges=LINE_EDGES
)


def _with(model, **scalars):
    return dataclasses.replace(model, scalars={**model.scalars, **scalars})


_DEFAULT = load_pair("default")
PAIR = dataclasses.replace(
    _DEFAULT,
    strong=_with(_DEFAULT.strong, difficulty_spread=1.0),
    weak=_with(_DEFAULT.weak, difficulty_spread=0.5, p_popular_wrong=0.1, review_difficulty=1.0),
)
MODELS = (PAIR.strong, PAIR.weak)


def spec(network, n_tasks: int = N_TASKS) -> BaselineSpec:
    return pinned2.spec(network, n_tasks)


@functools.cache
def raps_stream():
    """(spec, TaskOut of stream 0 as numpy, the stream's task draws as numpy)."""
    one = spec(COMPLETE)
    out = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], simulate("raps", [one], PAIR)[1])
    draws = jax.tree_util.tree_map(np.asarray, D.stream_draws(0, PROFILE.dataset_id, N_TASKS))
    return one, out, draws


def pick(u: float, n: int) -> int:
    return min(int(np.floor(u * n)), n - 1)


def tokens(model, kind: str, u: float) -> int:
    lo, hi = model.completion_tokens[C.TOKEN_SOURCE[kind]]
    return min(lo + int(np.floor(u * (hi - lo + 1))), hi)


def first_at_or_above(u: float, thresholds) -> int:
    return min(int(np.sum(u >= np.asarray(thresholds))), len(thresholds) - 1)


def test_inference_is_right_with_p_infer_of_the_callers_model_else_another_documented_pair():
    """protocol.md §3 step 2 and decisions E8: InferAbilities is right with p_infer of the model
    the caller runs on (strong iff healthy), drawn with INFER_CORRECT; a wrong pair is the uniform
    pick (INFER_WRONG_PAIR) among the documented pairs other than the true one; its prompt is the
    infer template plus the question, its completion the infer figures (INFER_TOKENS)."""
    one, out, draws = raps_stream()
    questions = one.stream.question_tokens_or(PROFILE.question_tokens)
    degraded = one.schedule.degraded_matrix()
    n_pairs = len(PROFILE.pairs)
    weak_decides = 0
    for k in range(N_TASKS):
        t, u = k + 1, draws.infer[k]
        assert out.calls.kind[k, 0] == C.K_INFER and out.calls.valid[k, 0]
        role = int(degraded[t, out.entry[k]])
        assert out.calls.role[k, 0] == role
        model = MODELS[role]
        ok = u[D.INFER_CORRECT] < model.p_infer
        weak_decides += role == C.WEAK and (ok != (u[D.INFER_CORRECT] < PAIR.strong.p_infer))
        assert out.pair_correct[k] == ok, k
        true_pair = PROFILE.pair_index(int(one.stream.task_type[k]))
        others = [p for p in range(n_pairs) if p != true_pair]
        wrong_pair = others[pick(u[D.INFER_WRONG_PAIR], len(others))]
        assert out.inferred_pair[k] == (true_pair if ok else wrong_pair), k
        assert out.calls.prompt[k, 0] == model.prompt_tokens["infer"] + questions[k]
        assert out.calls.completion[k, 0] == tokens(model, "infer", u[D.INFER_TOKENS])
    assert weak_decides > 0  # the weak model's p_infer changes some outcome
    assert (~out.pair_correct).sum() >= 10


def test_with_a_single_documented_pair_inference_cannot_be_wrong():
    """protocol.md §3 step 2: a wrong pair is drawn among the OTHER documented pairs; a mapping with
    one pair has none, so every inference is right (not a pair index of -1)."""
    network = build_network(dataclasses.replace(PROFILE, requires=((0, 2),) * len(PROFILE.task_types)))
    out = simulate("raps", [spec(network, 84)], PAIR)[1]
    assert np.asarray(out.pair_correct).all() and (np.asarray(out.inferred_pair) == 0).all()
    assert np.asarray(out.answered).all()


def test_parts_and_final_answers_replay_from_their_generation_draws():
    """decisions E4, E6, E7, E9 on every generation of the stream (uniforms u = the visit's
    GENERATE slot): a part is right with u_main < p_part[writer's model, type, question bin]; a
    Finalize's answer, with the right pair, is its part and (the draft right, or u_aux < p_rescue of
    the finalizer's model), with a wrong pair u_aux < the weak model's p_part of the true type; a
    wrong answer carries 1 + the categorical of u_distractor over the finalizer's model's
    distractor table, a right one id 0; the completion is the generate figures of the writer's
    model (u_tokens)."""
    one, out, draws = raps_stream()
    p_part = [np.asarray(m.p_part_for(PROFILE)) for m in MODELS]
    seen = set()
    for k in range(N_TASKS):
        ty, q = int(one.stream.task_type[k]), int(one.stream.difficulty[k])
        c = jax.tree_util.tree_map(lambda x, k=k: x[k], out.calls)
        generations = np.flatnonzero(c.valid & (c.kind == C.K_GENERATE))
        draft_ok = True
        for g in generations:
            role, u = int(c.role[g]), draws.calls[k, c.visit[g], D.GENERATE]
            model = MODELS[role]
            part_ok = u[D.U_MAIN] < p_part[role][ty, q]
            assert c.completion[g] == tokens(model, "generate", u[D.U_TOKENS]), (k, g)
            if c.answer_id[g] < 0:  # a Contribute
                assert c.correct[g] == part_ok, (k, g)
                draft_ok &= bool(part_ok)
                continue
            if out.pair_correct[k]:
                answer_ok = part_ok & (draft_ok | (u[D.U_AUX] < model.p_rescue))
                if part_ok and not draft_ok:
                    seen.add(("rescue", role))
            else:
                answer_ok = u[D.U_AUX] < p_part[C.WEAK][ty, q]
                seen.add(("wrong pair", role))
            assert c.correct[g] == answer_ok == out.correct[k], (k, g)
            wrong = 1 + first_at_or_above(u[D.U_DISTRACTOR], model.distractor_thresholds())
            assert c.answer_id[g] == (0 if answer_ok else wrong) == out.answer_id[k], (k, g)
            seen.add(("answer", role, bool(answer_ok)))
    assert {("answer", r, ok) for r in (0, 1) for ok in (True, False)} <= seen
    assert {("wrong pair", 0), ("rescue", 0), ("rescue", 1)} <= seen


def test_a_watchdog_score_is_the_reviewers_sample_on_the_judged_parts_question_bin():
    """decisions B2/E1/E9 through common.review_score: a RAPS watchdog's score is the anchor of the
    first review sample (u_main of REVIEW_SAMPLES[0] at the judged output's visit) on the categorical
    of (the watchdog's model, the author's model, the part right?, the bin of task t's question)."""
    one, out, draws = raps_stream()
    checked = set()
    for k in range(N_TASKS):
        c = jax.tree_util.tree_map(lambda x, k=k: x[k], out.calls)
        for w in np.flatnonzero(c.valid & (c.kind == C.K_WATCHDOG)):
            (g,) = np.flatnonzero(
                c.valid & (c.kind == C.K_GENERATE) & (c.agent == c.author[w]) & (c.ability == c.ability[w])
            )
            role, author_role, right = int(c.role[w]), int(c.role[g]), bool(c.correct[g])
            bin_ = int(one.stream.difficulty[k])
            u = draws.calls[k, c.visit[g], D.REVIEW_SAMPLES[0], D.U_MAIN]
            thresholds = MODELS[role].review_thresholds(AUTHOR_ROLES[author_role], right, bin_)
            assert c.score[w] == ANCHORS[first_at_or_above(u, thresholds)], (k, w)
            checked.add((role, author_role, bin_))
    assert len(checked) >= 16  # both authors' models on many question bins


def test_a_streams_method_label_wins_over_the_baselines_name():
    """run.run_baseline_frames: the labels carry method / dataset / pair / seed, and the method
    defaults to the baseline's name (a stream labelled, say, "raps-caller" keeps its label)."""
    labelled, plain = spec(COMPLETE, 42), spec(COMPLETE, 42)
    labelled = labelled._replace(labels={**LABELS, "method": "raps-caller"})
    frames = run_baseline_frames("raps", [labelled, plain], PAIR)
    for one, method in zip(frames, ("raps-caller", "raps"), strict=True):
        for name in ("tasks", "calls", "reviews"):
            assert set(one[name]["method"].to_list()) == {method}, name


def moves_and_ends(
    method: str, network, n_tasks: int, **protocol
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(moves, end reasons, actions) of one stream of `method` under ProtocolParams(**protocol)."""
    params = run.protocol_params(method, ProtocolParams(**protocol))
    out = simulate(method, [spec(network, n_tasks)], PAIR, params)[1]
    return np.asarray(out.moves[0]), np.asarray(out.end[0]), np.asarray(out.actions[0])


def test_a_task_may_make_exactly_move_limit_moves():
    """protocol.md §3.4: a task ends on the budget when its moves WOULD EXCEED move_limit, so a
    task of move_limit moves finishes. On the ladder RAPS tasks take one or two moves: with
    move_limit 2 all finish, with 1 the two-move ones end on the budget."""
    moves, ends, _ = moves_and_ends("raps", LADDER, 252, move_limit=2)
    assert (ends == C.E_NONE).all() and moves.max() == 2
    moves, ends, _ = moves_and_ends("raps", LADDER, 252, move_limit=1)
    assert (ends == C.E_BUDGET).sum() >= 10 and moves.max() == 1


def test_the_moves_since_the_last_output_restart_at_each_contribute():
    """protocol.md §3.3-4: moves_since_output resets after each Contribute, so with route_limit 1
    a three-ability task that moves once to each of its next two holders finishes (two moves),
    while one that needs a relay (two moves without an output) ends on the budget."""
    moves, ends, _ = moves_and_ends("raps", LINE3, 84, route_limit=1)
    assert (moves[ends == C.E_NONE] == 2).sum() >= 10
    assert (ends == C.E_BUDGET).any() and moves.max() == 2


def test_agentnet_makes_up_to_three_forwards_not_fewer():
    """spec/baselines.md (AgentNet): at most 3 forwards per task, so a task may make 3 (on the
    line graph some do) and none makes a fourth; the limit ends the others ("forward limit")."""
    network = build_network(PROFILE, edges=LINE_EDGES)
    _, ends, actions = moves_and_ends("agentnet", network, 168)
    forwards = (actions == C.A_FORWARD).sum(axis=1)
    assert forwards.max() == 3 and (forwards[ends == C.E_NONE] == 3).any()
    assert (ends == C.E_FORWARD_LIMIT).any()


def test_a_wrong_inferred_pair_is_answered_at_the_weak_models_part_rate():
    """decisions E4 through RAPS and AutoGen (whose manager infers): with a wrong inferred pair the
    answer is right with the weak model's p_part of the true type, whatever the writers' models. On
    a healthy network every part is written by a healthy holder (strong), so with the weak model's
    p_part set to 0 exactly the wrong-pair tasks are answered wrong (and AutoGen's compose does not
    corrupt)."""
    weak = dataclasses.replace(PAIR.weak, p_part={**PAIR.weak.p_part, "bbh": {"default": 0.0}})
    pair = dataclasses.replace(PAIR, weak=weak)
    healthy = spec(COMPLETE, 168)._replace(schedule=HealthSchedule(6, 168, ()))
    for method, params in (("raps", None), ("autogen", autogen.AutoGenParams(p_corrupt=(0.0, 0.0)))):
        out = simulate(method, [healthy], pair, params)[1]
        pair_ok, correct = np.asarray(out.pair_correct[0]), np.asarray(out.correct[0])
        assert (~pair_ok).sum() >= 5, method
        assert not correct[~pair_ok].any(), method
        assert correct[pair_ok].mean() > 0.6, method


@functools.cache
def autogen_without_a3_mathematical():
    """AutoGen (84 tasks, A3 degraded from task 43) on bbh with A3 no longer holding ability 0
    (mathematical, still held by A1 and A2): (network, schedule, TaskOut of the stream)."""
    holds = PROFILE.holds.copy()
    holds[2, 0] = False
    network = build_network(dataclasses.replace(PROFILE, holds=holds))
    one = spec(network, 84)
    out = simulate("autogen", [one], PAIR)[1]
    return network, one.schedule, jax.tree_util.tree_map(lambda x: np.asarray(x)[0], out)


def test_autogen_manager_calls_are_tied_to_no_ability():
    """decisions B0/B3: the manager's inference, selection and compose calls are tied to no ability:
    strong iff A3 is healthy at task t, whether or not A3 holds the first ability of the vocabulary."""
    _, schedule, out = autogen_without_a3_mathematical()
    degraded = schedule.degraded_matrix()
    manager = out.calls.valid & np.isin(out.calls.kind, (C.K_INFER, C.K_SELECT, C.K_COMPOSE))
    assert (out.calls.agent[manager] == 2).all()
    for k in range(out.calls.valid.shape[0]):
        assert (out.calls.role[k][manager[k]] == int(degraded[k + 1, 2])).all(), k
    assert not degraded[1, 2] and degraded[84, 2]  # both models manage


def test_autogen_logs_a_retry_as_reselect():
    """ACTIONS "reselect": AutoGen's second selection call for an ability (the retry when the named
    worker lacks it) is logged as reselect, the first as select: one action per selection call."""
    _, _, out = autogen_without_a3_mathematical()
    selects = (out.calls.valid & (out.calls.kind == C.K_SELECT)).sum(axis=1)
    first, again = (out.actions == C.A_SELECT).sum(axis=1), (out.actions == C.A_RESELECT).sum(axis=1)
    assert (first == 2).all() and (first + again == selects).all()
    assert again.sum() >= 3


def test_an_ability_nobody_holds_ends_the_task_as_unreachable():
    """decisions.md (§3.4's budget rules: an INF next hop ends the task as `unreachable ability`),
    common.shortest_path_hop: with no holder of temporal left, a RAPS task whose inferred pair needs
    it contributes its other part and then ends unanswered as "unreachable ability"."""
    holds = PROFILE.holds.copy()
    temporal = PROFILE.abilities.index("temporal")
    holds[:, temporal] = False
    network = build_network(dataclasses.replace(PROFILE, holds=holds))
    out = simulate("raps", [spec(network, 84)], PAIR)[1]
    pairs = [sorted(p) for p in PROFILE.pairs]
    needs = np.asarray([temporal in pairs[p] for p in np.asarray(out.inferred_pair[0])])
    ends, answered = np.asarray(out.end[0]), np.asarray(out.answered[0])
    assert needs.sum() >= 5 and (ends[needs] == C.E_UNREACHABLE).all() and not answered[needs].any()
    assert (ends[~needs] == C.E_NONE).all()


def test_the_shared_next_hop_picks_the_missing_ability_with_the_visits_draw():
    """protocol.md §3 NextHop(i, M) / common.shortest_path_hop: M in vocabulary order, s picked
    uniformly with the visit's HOP_ABILITY uniform (not always the first missing one). Tasks need
    three abilities, each held by two agents only, so after the entry's Contribute two are missing;
    SAC's first team (execution 0: the task's own draws) moves to a holder of the picked one."""
    holds = np.zeros_like(PROFILE.holds)
    needed = (0, 3, 4)
    for s, agents in zip(needed, ((0, 1), (2, 3), (4, 5)), strict=True):
        holds[list(agents), s] = True
    profile = dataclasses.replace(PROFILE, holds=holds, requires=(needed,) * len(PROFILE.task_types))
    out = simulate("sac", [spec(build_network(profile), 84)], PAIR)[1]
    draws = np.asarray(D.stream_draws(0, PROFILE.dataset_id, 84).route)
    picked = set()
    for k, route in enumerate(np.asarray(out.route[0]).tolist()):
        team0 = [int(a) for a in C._route_text(route).split("|")[0].split("-")]
        missing = [s for s in needed if not holds[team0[0], s]]
        s = missing[pick(draws[k, 0, D.HOP_ABILITY], len(missing))]
        assert holds[team0[1], s], k
        picked.add(missing.index(s))
    assert picked == {0, 1}


def test_chain_of_thought_plans_use_the_cot_token_figures():
    """decisions B0/E7: a generation's prompt template and completion figures are those of the
    call's kind; Symphony's rerun plans are chain-of-thought calls with the model files' cot figures
    (in the shipped files the same as generate's, so here cot gets figures of its own: a 5,000-token
    template and exactly 999 completion tokens). Parts are often wrong here, so plans disagree and
    reruns happen."""

    def model(m):
        m = _with(m, p_popular_wrong=0.25)
        return dataclasses.replace(
            m,
            p_part={**m.p_part, "bbh": {"default": 0.3}},
            completion_tokens={**m.completion_tokens, "cot": (999, 999)},
            prompt_tokens={**m.prompt_tokens, "cot": 5000},
        )

    pair = dataclasses.replace(PAIR, strong=model(PAIR.strong), weak=model(PAIR.weak))
    calls = simulate("symphony", [spec(COMPLETE, 84)], pair)[1].calls
    valid, kind = np.asarray(calls.valid), np.asarray(calls.kind)
    prompt, completion = np.asarray(calls.prompt), np.asarray(calls.completion)
    cot, generate = valid & (kind == C.K_COT), valid & (kind == C.K_GENERATE)
    assert cot.sum() >= 10
    assert (completion[cot] == 999).all() and (prompt[cot] > 5000).all()
    assert (completion[generate] != 999).all() and (prompt[generate] < 5000).all()


def test_sac_judges_a_team_answer_as_written_by_its_finalizers_model():
    """decisions B4/E1 through common.run_path's answer_role: SAC's self-evaluations (and
    evaluations) of a team's answer read the review categorical of the answer's author model, the
    model its finalizer wrote it with (its refinement, by the same agent on the same ability, keeps
    that model). With A3 and A6 degraded from task 43, weak-written answers occur."""
    out = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], simulate("sac", [spec(COMPLETE, 84)], PAIR)[1])
    c, r = out.calls, out.reviews
    roles = set()
    for k in range(c.valid.shape[0]):
        finalize = c.valid[k] & (c.kind[k] == C.K_GENERATE) & (c.answer_id[k] >= 0)
        written = dict(zip(c.agent[k][finalize].tolist(), c.role[k][finalize].tolist(), strict=True))
        for j in np.flatnonzero(r.valid[k] & (r.action[k] == C.R_SELF_EVALUATE)):
            assert r.author_role[k, j] == written[int(r.reviewer[k, j])], (k, j)
            roles.add(int(r.author_role[k, j]))
    assert roles == {C.STRONG, C.WEAK}


@functools.cache
def live_raps_run() -> tuple[BaselineSpec, C.TaskOut]:
    """RAPS run live on a 42-task stream against _NoPairHost: (spec, TaskOut)."""
    one = spec(COMPLETE, 42)
    return one, simulate("raps", [one], PAIR, None, _NoPairHost())[1]


class _NoPairHost:
    """A live host whose inference replies name no pair (unparsable) and whose generations all
    read as the gold answer (id 0); every other call gets the neutral defaults (REPLY_FIELDS)."""

    error = None

    def answer(self, op, valid, scalars, vectors):
        return {"infer": {"pair": -1}, "generate": {"answer_id": 0}}.get(op, {})

    def stop(self, error):
        self.error = error


def test_a_live_inference_naming_no_pair_falls_back_to_the_documented_pair():
    """decisions B7 (inference: the parsed pair, fallback: the documented pair): a reply that names
    no pair routes the task by the task type's documented pair (not pair -1), recorded as a wrong
    inference."""
    one, out = live_raps_run()
    documented = [PROFILE.pair_index(int(ty)) for ty in one.stream.task_type]
    np.testing.assert_array_equal(np.asarray(out.inferred_pair[0]), documented)
    assert not np.asarray(out.pair_correct[0]).any()


def test_a_live_contribute_carries_no_answer_id():
    """decisions B7 (a Contribute has no gold: part_ok False, correct null, as in MeshHeal's live
    records): only a Finalize's generation carries the judged answer id, even when the host's reply
    to a Contribute reads as one."""
    _, out = live_raps_run()
    calls = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], out.calls)
    generate = calls.valid & (calls.kind == C.K_GENERATE)
    answered = np.asarray(out.answered[0])
    assert answered.all()
    assert ((generate & (calls.answer_id >= 0)).sum(axis=1) == 1).all()  # the Finalize's only
    assert (calls.correct[generate & (calls.answer_id < 0)] == -1).all()
    assert (generate.sum(axis=1) == 2).all()
