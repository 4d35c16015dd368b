"""Rules of the baselines' shared machinery (baselines/common.py, run.py) and of RAPS and AutoGen
that a second mutation audit changed without a failing test: the watchdog's prompt and the visit
its call is recorded at (spec/emulator.md tokens, decisions E7), the protocol's move budget and
next-hop tie rule reaching RAPS's relay (decisions B2, B8), and the clear errors on bad input
(mismatched schedules, pairs and batches, a second live run in one process). Each test fails on
its mutant. RAPS runs on short emulated streams: the bbh complete graph, the made-up mapping whose
tasks need three abilities (as in test_baseline_wiring.py), and a sparse "ladder" whose relays
meet ties."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from meshheal_jax import draws as D
from meshheal_jax.baselines import BaselineSpec, autogen, run, simulate
from meshheal_jax.baselines import common as C
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair
from meshheal_jax.streams import HealthSchedule, make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

PAIR = load_pair("default")
PROFILE = load_profile("bbh")
COMPLETE = build_network(PROFILE)
# every task needs three abilities (mathematical, sequence, logical): a second Contribute is made on
# a non-empty draft, so a watchdog's judged output has a context
THREE = build_network(dataclasses.replace(PROFILE, requires=((0, 3, 4),) * len(PROFILE.task_types)))
# A1 and A2..A6 joined so that A1 reaches the temporal holders (A2, A3, A6) only through A4 or A5,
# both one hop from A6: a tie for the shared path's relay (neither holds temporal)
LADDER = build_network(PROFILE, edges=np.asarray([(0, 3), (0, 4), (3, 5), (4, 5), (1, 5), (2, 5)]))
LABELS = {"dataset": "bbh", "pair": "default", "seed": 0}


def spec(network, n_tasks: int = 84, schedule: HealthSchedule | None = None) -> BaselineSpec:
    stream = make_stream(0, PROFILE.dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded"))
    schedule = schedule or persistent_schedule(6, n_tasks, network.degraded_targets)
    return BaselineSpec(network, stream, schedule, LABELS)


@functools.cache
def raps_watchdog_runs():
    """TaskOut of RAPS on the complete graph and on the three-ability mapping (one program)."""
    return simulate("raps", [spec(COMPLETE), spec(THREE)], PAIR)[1]


@functools.cache
def ladder_routes(**protocol) -> tuple[list[str], np.ndarray, np.ndarray]:
    """RAPS on the ladder (504 tasks) under ProtocolParams(**protocol): routes, end reasons, moves."""
    params = run.protocol_params("raps", ProtocolParams(**protocol))
    out = jax.tree_util.tree_map(
        lambda x: np.asarray(x)[0], simulate("raps", [spec(LADDER, 504)], PAIR, params)[1]
    )
    return [C._route_text(r) for r in out.route.tolist()], out.end, out.moves


def watchdogs(out, k: int):
    """(task index, watchdog slot, the judged author's generate slot, the task's infer slot) of stream k."""
    calls = jax.tree_util.tree_map(lambda x: np.asarray(x)[k], out.calls)
    for t in range(calls.valid.shape[0]):
        valid = calls.valid[t]
        infer = int(np.flatnonzero(valid & (calls.kind[t] == C.K_INFER))[0])
        for w in np.flatnonzero(valid & (calls.kind[t] == C.K_WATCHDOG)):
            generated = valid & (calls.kind[t] == C.K_GENERATE) & (calls.agent[t] == calls.author[t, w])
            generated &= calls.ability[t] == calls.ability[t, w]
            (g,) = np.flatnonzero(generated)
            yield t, int(w), int(g), infer, calls


# ------------------------------------------------------------------------------------------------
# RAPS: the watchdog call
# ------------------------------------------------------------------------------------------------


def test_raps_watchdog_tokens_count_the_question_the_draft_and_the_judged_output():
    """decisions E7 / spec/emulator.md: prompt = template (model, kind) + question tokens + the
    visible tokens of the accepted draft + the judged output. A watchdog judges the output the
    receiver got: its visible tokens (floor(completion x answer_fraction) of the writing model) on
    the draft that output was written on (the author's generate prompt minus its template and the
    question); the template is the watchdog's own (a review sample's figures, decisions B0). Its
    completion is drawn with the token uniform of MeshHeal's first review sample of that output
    (raps.py: paired). On the three-ability mapping the second Contribute's draft is not empty."""
    emu = C.make_emu(PAIR, PROFILE)
    template, fraction = np.asarray(emu.prompt), np.asarray(emu.answer_fraction)
    u_calls = np.asarray(D.stream_draws(0, PROFILE.dataset_id, 84).calls)
    out = raps_watchdog_runs()
    with_context = 0
    for k in range(2):
        checked = 0
        for t, w, g, infer, calls in watchdogs(out, k):
            question = calls.prompt[t, infer] - template[calls.role[t, infer], C.K_INFER]
            context = calls.prompt[t, g] - template[calls.role[t, g], C.K_GENERATE] - question
            judged = int(np.floor(calls.completion[t, g] * fraction[calls.role[t, g]]))
            want = template[calls.role[t, w], C.K_WATCHDOG] + question + context + judged
            assert calls.prompt[t, w] == want, (k, t, calls.prompt[t, w], want)
            u = u_calls[t, calls.visit[t, g], D.REVIEW_SAMPLES[0], D.U_TOKENS]
            assert calls.completion[t, w] == int(
                C.completion_tokens(emu, calls.role[t, w], C.K_WATCHDOG, u)
            ), (k, t)
            checked += 1
            with_context += context > 0
        assert checked > 40
    assert with_context > 20


def test_raps_watchdog_is_recorded_at_the_receivers_visit():
    """common.Call: a call's visit is "the execution's moves count on arrival at the calling
    agent"; the watchdog's caller is the receiver, the next agent on the route after the author's
    Contribute (raps.py), so its visit is the author's plus one and the route names the receiver
    there. Its `correct` ("latent truth for the trace") is the judged part's, as the author's
    generate call records it."""
    out = raps_watchdog_runs()
    for k in range(2):
        routes = np.asarray(out.route)[k]
        for t, w, g, _, calls in watchdogs(out, k):
            assert calls.visit[t, w] == calls.visit[t, g] + 1, (k, t)
            assert routes[t, calls.visit[t, w]] == calls.agent[t, w], (k, t)
            assert calls.correct[t, w] == calls.correct[t, g] >= 0, (k, t)


# ------------------------------------------------------------------------------------------------
# RAPS: the protocol settings it shares (decisions B8)
# ------------------------------------------------------------------------------------------------


def test_raps_relay_follows_the_protocols_next_hop_tie_rule():
    """decisions B2 / B8: when no neighbour holds the missing ability, RAPS relays one hop along the
    shared shortest path with `--protocol.next-hop-ties`. On the ladder A1's temporal tasks relay
    through A4 or A5 (both one hop from A6): "lowest" always takes A4, "random" the visit's draw
    (A5 too)."""
    relays = {}
    for ties in ("random", "lowest"):
        routes, _, _ = ladder_routes(next_hop_ties=ties)
        relays[ties] = {r for r in routes if r.startswith("0-") and r.count("-") >= 2}
    assert relays["lowest"] == {"0-3-5"}
    assert "0-4-5" in relays["random"]


def test_raps_moves_under_the_protocols_move_budget():
    """decisions B8: the move budget `--protocol.route-limit` reaches RAPS (its tasks move between
    agents). With route_limit 1 a relay (a second move since the last output) ends the task on the
    budget, unanswered; the default budget lets every ladder task finish."""
    _, ends, moves = ladder_routes()
    assert (ends == C.E_NONE).all()
    _, ends, moves = ladder_routes(route_limit=1)
    assert (ends == C.E_BUDGET).sum() > 20
    assert moves.max() == 1


# ------------------------------------------------------------------------------------------------
# AutoGen: the compose call and the tokens of the manager's and workers' calls (decisions B3, E7)
# ------------------------------------------------------------------------------------------------

CORRUPT = (0.3, 0.4)  # (strong, weak), corrupts="both": every manager model corrupts


@functools.cache
def autogen_run():
    """(TaskOut, control uniforms) of AutoGen with p_corrupt CORRUPT on one 84-task stream (A3, the
    manager, degraded from task 43), stream axis dropped."""
    params = autogen.AutoGenParams(p_corrupt=CORRUPT, corrupts="both")
    out = simulate("autogen", [spec(COMPLETE)], PAIR, params)[1]
    control = np.asarray(C.stream_uniforms(0, PROFILE.dataset_id, 84).control)
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[0], out), control


def test_autogen_compose_corrupts_with_the_given_rate_and_a_distractor_of_the_managers_model():
    """autogen.py: `p_corrupt` given as (strong, weak) replaces 1 - p_keep; the compose call reads
    control row 4 (field 110): a right answer turns wrong iff u_main < p_corrupt[manager model],
    and a corrupted one takes a distractor of the manager's model (1 + categorical(u_distractor));
    a wrong answer keeps its id."""
    out, control = autogen_run()
    emu = C.make_emu(PAIR, PROFILE)
    calls = out.calls
    corrupted = 0
    for t in range(84):
        valid = calls.valid[t]
        final = np.flatnonzero(valid & (calls.kind[t] == C.K_GENERATE))[-1]
        (compose,) = np.flatnonzero(valid & (calls.kind[t] == C.K_COMPOSE))
        role, u = calls.role[t, compose], control[t, 2 * autogen.PARTS]
        if calls.correct[t, final] != 1:
            assert calls.answer_id[t, compose] == calls.answer_id[t, final] and not out.correct[t]
        elif u[D.U_MAIN] < CORRUPT[role]:
            want = 1 + int(C.categorical(u[D.U_DISTRACTOR], emu.distractor_thr[role]))
            assert not out.correct[t] and calls.answer_id[t, compose] == want, t
            corrupted += 1
        else:
            assert out.correct[t] and calls.answer_id[t, compose] == 0, t
    assert corrupted >= 10


def test_autogen_tokens_count_the_draft_each_call_sees():
    """decisions E7: prompt = template + question + the accepted draft's visible tokens (+ the
    judged output). A selection sees the draft so far (empty for the first ability, the
    contributing worker's visible output for the second); the compose call sees the draft and the
    finalizing worker's answer. Worker generations at visits 1 and 3 draw their tokens from
    calls[1 / 3, GENERATE] (autogen.py)."""
    out, _ = autogen_run()
    emu = C.make_emu(PAIR, PROFILE)
    template, fraction = np.asarray(emu.prompt), np.asarray(emu.answer_fraction)
    u_calls = np.asarray(D.stream_draws(0, PROFILE.dataset_id, 84).calls)
    calls = out.calls
    for t in range(84):
        idx = np.flatnonzero(calls.valid[t])
        kind, role = calls.kind[t, idx], calls.role[t, idx]
        question = calls.prompt[t, idx[0]] - template[role[0], C.K_INFER]
        generates = idx[kind == C.K_GENERATE]
        assert [calls.visit[t, g] for g in generates] == [1, 3]
        visible = [int(np.floor(calls.completion[t, g] * fraction[calls.role[t, g]])) for g in generates]
        for g in generates:
            u = u_calls[t, calls.visit[t, g], D.GENERATE, D.U_TOKENS]
            assert calls.completion[t, g] == int(
                C.completion_tokens(emu, calls.role[t, g], C.K_GENERATE, u)
            ), t
        for k in idx[kind == C.K_SELECT]:
            draft = visible[0] if calls.visit[t, k] == 2 else 0
            assert calls.prompt[t, k] == template[calls.role[t, k], C.K_SELECT] + question + draft, t
        (compose,) = idx[kind == C.K_COMPOSE]
        want = template[calls.role[t, compose], C.K_COMPOSE] + question + visible[0] + visible[1]
        assert calls.prompt[t, compose] == want, t


def test_autogen_selection_names_some_worker_when_no_worker_holds_the_ability():
    """autogen.speaker_selection: a successful selection names "a uniform holder among workers
    (any worker if no worker holds it)": with the manager the only holder, the call still names a
    worker, by the same uniform pick as a failed call."""
    holds = np.asarray([[False], [False], [True], [False]])
    workers = np.asarray([True, True, False, True])  # agent 2 is the manager
    for u in (0.0, 0.5, 0.9):
        named = int(autogen.speaker_selection(holds, workers, 0, True, u))
        assert named == int(autogen.speaker_selection(holds, workers, 0, False, u)) != -1


def test_autogen_max_rounds_may_equal_the_turns_a_task_takes():
    """AutoGenParams.check: max_rounds must cover the PARTS x (1 + retries) selections and the
    compose, 5 turns by default: 5 is enough, 4 is refused."""
    autogen.AutoGenParams(max_rounds=5).check(6)
    autogen.AutoGenParams(max_rounds=3, selection_retries=0).check(6)
    with pytest.raises(MeshHealError, match="max_rounds 4 < the 5 turns"):
        autogen.AutoGenParams(max_rounds=4).check(6)


# ------------------------------------------------------------------------------------------------
# Bad input: one clear MeshHealError naming the problem
# ------------------------------------------------------------------------------------------------


def test_a_schedule_for_another_stream_is_refused():
    """common.make_world: a health schedule must be for the network's agents and the stream's tasks
    (JAX would clamp an out-of-range task index and read a wrong health row)."""
    good = spec(COMPLETE, 42)
    for schedule in (HealthSchedule(6, 84, ()), HealthSchedule(7, 42, ())):
        with pytest.raises(MeshHealError, match="schedule is for"):
            simulate("raps", [good._replace(schedule=schedule)], PAIR)


def test_a_pair_whose_models_disagree_on_distractors_is_refused():
    """common.make_emu: the two models' distractor ids are one vocabulary of wrong answers (votes
    compare them), so both models must have the same n_distractors."""
    weak = dataclasses.replace(PAIR.weak, n_distractors=PAIR.weak.n_distractors + 1)
    with pytest.raises(MeshHealError, match="same n_distractors"):
        simulate("raps", [spec(COMPLETE, 42)], dataclasses.replace(PAIR, weak=weak))


def test_bad_batches_and_unknown_methods_are_refused():
    """run.simulate: an unknown method, no streams, and streams that cannot share one program
    (another length, number of agents or number of abilities) are refused by name."""
    good = spec(COMPLETE, 42)
    with pytest.raises(MeshHealError, match="unknown baseline 'rap'"):
        simulate("rap", [good], PAIR)
    with pytest.raises(MeshHealError, match="no streams given"):
        simulate("raps", [], PAIR)
    with pytest.raises(MeshHealError, match="same length"):
        simulate("raps", [good, spec(COMPLETE, 84)], PAIR)
    fewer = dataclasses.replace(COMPLETE, holds=COMPLETE.holds[:, :6])
    with pytest.raises(MeshHealError, match="same number of abilities"):
        simulate("raps", [good, good._replace(network=fewer)], PAIR)


def test_a_second_live_baseline_run_in_one_process_is_refused():
    """common.live_host: one live baseline run per process (its host answers every live call); a
    second one inside it is refused, and the first host stays in place."""
    first, second = object(), object()
    with C.live_host(first):
        with pytest.raises(MeshHealError, match="already in progress"), C.live_host(second):
            pass
        assert C._HOST[0] is first
    assert C._HOST[0] is None


def test_another_methods_parameters_are_refused_by_name():
    """run.simulate takes the method's parameter dataclass (DEFAULT_PARAMS); another method's (here
    AutoGen's for RAPS) should be one MeshHealError naming the expected class, not an
    AttributeError ('AutoGenParams' object has no attribute 'prior_x') from inside the program."""
    with pytest.raises(MeshHealError, match=r"^raps: parameters must be RAPSParams, got AutoGenParams$"):
        simulate("raps", [spec(COMPLETE, 42)], PAIR, autogen.AutoGenParams())


@pytest.mark.parametrize(
    "p_corrupt", [(0.1, 0.2, 0.3), (0.1,), (0.1, 1.5), (-0.1, 0.2), (0.1, float("nan")), ("a", "b")]
)
def test_autogen_p_corrupt_must_be_two_probabilities(p_corrupt):
    with pytest.raises(
        MeshHealError, match=r"^AutoGen: p_corrupt must be \(strong, weak\) probabilities in \[0, 1\]"
    ):
        autogen.AutoGenParams(p_corrupt=p_corrupt).check(6)
    autogen.AutoGenParams(p_corrupt=(0.0, 1.0)).check(6)  # the bounds are probabilities


def test_a_baseline_stream_tuple_needs_its_four_parts():
    with pytest.raises(
        MeshHealError, match=r"^a baseline stream is \(network, stream, schedule, labels\), got a tuple of 3$"
    ):
        simulate("raps", [spec(COMPLETE, 42)[:3]], PAIR)


def test_autogen_finalizes_on_the_draft_its_contribute_wrote():
    """decisions E4/E6 through AutoGen: the Finalize answer is right only if its own part is right
    and the Contribute's draft is right (or rescued, p_rescue). With no rescue and no corrupting
    compose, every task whose Contribute part was wrong (inference right) is answered wrong, while
    tasks on a right draft are answered right at the Finalize's own rate."""

    def no_rescue(m):
        return dataclasses.replace(m, scalars={**m.scalars, "p_rescue": 0.0})

    pair = dataclasses.replace(PAIR, strong=no_rescue(PAIR.strong), weak=no_rescue(PAIR.weak))
    _, outs = simulate("autogen", [spec(COMPLETE, 168)], pair, autogen.AutoGenParams(p_corrupt=(0.0, 0.0)))
    calls = outs.calls
    contribute = (calls.kind == C.KINDS.index("generate")) & (calls.answer_id == -1) & calls.valid
    assert (contribute.sum(-1) == 1).all()  # one Contribute a task (two parts)
    draft_ok = (np.where(contribute, calls.correct, 0).sum(-1) == 1)[0]
    pair_ok, correct = outs.pair_correct[0], outs.correct[0]
    wrong_draft = pair_ok & ~draft_ok
    assert wrong_draft.sum() >= 5 and (pair_ok & draft_ok).sum() >= 50  # both kinds occur
    assert not correct[wrong_draft].any()
    assert correct[pair_ok & draft_ok].mean() > 0.5
