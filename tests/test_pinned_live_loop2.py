"""Pins of the live loops (meshheal_jax.backends.live_loop, live_baselines) that a second mutation
audit changed without a failing test. MeshHeal's loop: the abilities a Finalize after a Contribute
is asked for (the part the kept draft leaves), a Contribute's Takeover replacing its output in the
draft, a review prompt naming the reviewer's own abilities, single_reviewer's correction call
(decisions V2), an inference's recorded correctness, and the truth the records' columns read after
a Finalize Takeover. The baselines' host: each call's own reply's tokens and request id, an SAC
team's final answer as the one other teams evaluate and refine against, a clear error for a
stream it does not have, and an interrupt inside a call site recorded, not raised.

No HTTP and no model: the loop's request builder and reply reader (`_build_requests`,
`_absorb_replies`, `_backend_state`) are called directly on one slot's emitted arrays with a
hand-filled text store, and the baselines' host answers a call site through scripted in-process
clients (`Numbered`, `Interrupted`: NOT models) whose replies carry distinct token counts.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from test_live_baselines import bbh_specs  # the baselines' scripted setup
from test_live_loop import RECORDS, STRONG_ROOT, WEAK_ROOT, bbh_spec
from test_pinned_live_loop import ScriptedLive, _reply, _slot

from meshheal_jax import engine, prompts
from meshheal_jax.backends import live_loop
from meshheal_jax.backends.live_baselines import LiveBaselineHost
from meshheal_jax.baselines import common as C
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError

pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.data.QuestionPoolWarning")


# ----------------------------------------------------------------------------------------------
# The MeshHeal loop's requests


def _text_store(stream) -> dict:
    record = stream.records[0]
    base = prompts.TaskText(stream.profile.dataset, record.question, record.task_type, record.options)
    return {(0, 1): live_loop._TaskText(record, base)}


def test_a_finalize_after_a_contribute_is_asked_only_for_the_part_the_draft_leaves():
    """spec/live.md "Prompts": a Finalize after a Contribute does the remaining part: the abilities
    it is asked to use are the inferred pair's minus those the kept draft covers."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    profile = stream.profile
    first, second = sorted(profile.pairs[0])
    agent = int(np.flatnonzero(spec.network.holds[:, second])[0])
    store = _text_store(stream)
    store[(0, 1)].pending = prompts.PriorOutput("RESULT: the first part", (profile.abilities[first],))
    rq = _slot(engine.GENERATE, engine.K_GENERATE, agent, second, finalize=True)
    (pending,) = live_loop._build_requests([stream], store, rq, live_loop.LiveOptions())
    content = pending.request.messages[-1]["content"]
    assert "Earlier agents have covered" in content and "RESULT: the first part" in content
    asked = re.search(r"Using your abilities \((.+?)\), do the remaining part", content)[1]
    assert asked.split(", ") == [profile.abilities[second]]


def _answer(stream, store, rq, text: str) -> dict:
    """Send slot 0's call 0 and feed its reply (`text`, parsed by the request's parser) back into the
    store, as the loop does; the response arrays it filled."""
    (pending,) = live_loop._build_requests([stream], store, rq, live_loop.LiveOptions())
    parser = pending.request.parser
    reply = _reply(text, parser.parse(text) if parser is not None else text)
    rows = live_loop.trace_rows([pending.request], [reply])
    arrays, shape = live_loop._empty_responses(1, 1), (1, 1, 3)
    extra = {"latency": np.zeros(shape), "status": np.full(shape, "", object), "model": np.full(shape, "", object),
             "ability": rq.ability, "finalize": rq.finalize}  # fmt: skip
    live_loop._absorb_replies([stream], store, [pending], [reply], rows, arrays, extra)
    return arrays


def test_an_inference_is_recorded_right_exactly_when_it_names_the_documented_pair():
    """decisions L6: the calls table's `correct` of an inference is whether the inferred pair is the
    profile's documented one (the truth column the loop fills), and the pair goes to the controller."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    profile = stream.profile
    documented = stream.true_pair[profile.task_types.index(stream.records[0].task_type)]
    other = next(i for i, pair in enumerate(profile.pairs) if set(pair) != set(profile.pairs[documented]))
    for index, right in ((documented, 1), (other, 0)):
        store = _text_store(stream)
        names = [profile.abilities[a] for a in profile.pairs[index]]
        arrays = _answer(stream, store, _slot(engine.INFER, engine.K_INFER, 0, 0, False),
                         json.dumps({"abilities": names}))  # fmt: skip
        assert arrays["pair"][0, 0] == index and arrays["truth"][0, 0].tolist() == [right, -1, -1]
        assert store[(0, 1)].pair_ok == bool(right)


def test_a_contribute_s_takeover_replaces_its_output_in_the_draft():
    """protocol.md §3/§4: a Contribute appends the accepted OR the replaced output to the draft, so
    after a Takeover the Finalize reads the synthesis in place of the author's output, never both."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    first, second = sorted(stream.profile.pairs[0])
    author = int(np.flatnonzero(spec.network.holds[:, first])[0])
    store = _text_store(stream)
    generate = _slot(engine.GENERATE, engine.K_GENERATE, author, first, finalize=False)
    _answer(stream, store, generate, "COMPETENCE_MATCH:partial\nRESULT: AUTHOR-PART")
    synthesis = _slot(engine.SYNTH, engine.K_SYNTHESIS, author, first, finalize=False)
    store[(0, 1)].candidates = {0: "RESULT: candidate A", 1: "RESULT: candidate B"}
    _answer(stream, store, synthesis, "COMPETENCE_MATCH:partial\nRESULT: SYNTHESIS-PART")
    finisher = int(np.flatnonzero(spec.network.holds[:, second])[0])
    rq = _slot(engine.GENERATE, engine.K_GENERATE, finisher, second, finalize=True)
    (pending,) = live_loop._build_requests([stream], store, rq, live_loop.LiveOptions())
    content = pending.request.messages[-1]["content"]
    assert "SYNTHESIS-PART" in content and "AUTHOR-PART" not in content


def _verdict(reason: str) -> prompts.ReviewVerdict:
    return prompts.ReviewVerdict(0.25, "high", True, "wrong_half", "", reason)


def test_the_truth_the_records_get_keeps_the_reviewed_answer_apart_from_the_kept_one():
    """The backend state the records' truth columns read (reviews.correct_before / correct_after,
    author_model, tasks.pair_correct): a right Finalize answer replaced by a wrong synthesis is
    right before and wrong after, written by the author's model; a partial result has no gold."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    second = sorted(stream.profile.pairs[0])[1]
    author = int(np.flatnonzero(spec.network.holds[:, second])[0])
    store = _text_store(stream)
    store[(0, 1)].pair_ok = True
    gold = stream.records[0].gold
    finalize = _slot(engine.GENERATE, engine.K_GENERATE, author, second, finalize=True)
    arrays = _answer(stream, store, finalize, f"COMPETENCE_MATCH:yes\nRESULT: {gold}")
    assert arrays["answer_id"][0, 0] == 0 and arrays["truth"][0, 0, 0] == 1
    store[(0, 1)].candidates = {0: "RESULT: candidate A", 1: "RESULT: candidate B"}
    synthesis = _slot(engine.SYNTH, engine.K_SYNTHESIS, author, second, finalize=True)
    arrays = _answer(stream, store, synthesis, "COMPETENCE_MATCH:partial\nRESULT: I cannot tell")
    assert arrays["answer_id"][0, 0] == 1 and arrays["truth"][0, 0, 0] == 0
    initial = jax.tree_util.tree_map(lambda x: x[None], engine.initial_backend(1))  # (streams, slots)
    b = live_loop._backend_state(initial, [stream], store, np.array([[1]]))
    assert live_loop._role(stream, author, second, 1) == engine.STRONG
    assert (bool(b.answer_ok[0, 0]), bool(b.result_ok[0, 0])) == (True, False)
    assert int(b.part_role[0, 0]) == engine.STRONG and bool(b.pair_ok[0, 0]) and not bool(b.part_ok[0, 0])


def test_single_reviewer_s_correction_call_is_a_correction_prompt():
    """decisions V2: single_reviewer's one correction call comes as a synthesis with no candidates;
    live it is the candidate's correction prompt (the rejected output and the committee's round-2
    reasons), not the synthesis prompt, which needs candidates."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    first, _ = sorted(stream.profile.pairs[0])
    reviewer = int(np.flatnonzero(spec.network.holds[:, first])[0])
    store = _text_store(stream)
    text = store[(0, 1)]
    text.output = "REJECTED-OUTPUT"
    text.round1 = {0: _verdict("ROUND1-A"), 1: _verdict("ROUND1-B")}
    text.round2 = {0: _verdict("ROUND2-A"), 1: _verdict("ROUND2-B")}
    rq = _slot(engine.SYNTH, engine.K_SYNTHESIS, reviewer, first, finalize=False)
    (pending,) = live_loop._build_requests([stream], store, rq, live_loop.LiveOptions())
    content = pending.request.messages[-1]["content"]
    assert pending.request.kind == "synthesis"
    assert "A review committee rejected it" in content and "REJECTED-OUTPUT" in content
    assert "ROUND2-A" in content and "ROUND2-B" in content and "ROUND1-A" not in content
    assert "Two reviewers each wrote" not in content


def test_a_review_names_the_reviewer_s_own_abilities_and_asks_three_samples():
    """spec/live.md "Prompts": the reviewer judges the delegated part only with an ability it holds:
    the prompt lists the reviewer's abilities (every one it holds, not the judged part's); the
    three initial samples are one request with n = 3."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    holds, names = spec.network.holds, stream.profile.abilities
    reviewer = next(a for a in range(holds.shape[0]) if holds[a].sum() >= 2)
    judged = int(np.flatnonzero(holds[reviewer])[0])
    store = _text_store(stream)
    store[(0, 1)].output = "RESULT: the part under review"
    rq = _slot(engine.REVIEW, engine.K_REVIEW, reviewer, judged, finalize=False)
    rq.mask = np.array([[[True, True, True]]])
    (pending,) = live_loop._build_requests([stream], store, rq, live_loop.LiveOptions())
    content = pending.request.messages[-1]["content"]
    held = re.search(r"only with an ability you hold \((.+?)\)\.", content)[1]
    assert held.split(", ") == [names[i] for i in np.flatnonzero(holds[reviewer])]
    assert pending.request.n == 3 and pending.calls == (0, 1, 2) and pending.request.kind == "review"


class Checkpoints(ScriptedLive):
    """test_pinned_live_loop's scripted client (NOT a model), its replies labelled with model ids
    other than the pair's files name (a local checkpoint served under each role)."""

    def run_batch(self, requests):
        return [dataclasses.replace(r, model_id=f"/models/{r.model_id}") for r in super().run_batch(requests)]


def test_the_calls_table_names_the_model_that_answered_not_the_pair_s_file():
    """spec/live.md "Traces": each call's model id is the one the server reported for its reply."""
    (frames,) = live_loop.run_live_streams([bbh_spec(0)], ProtocolParams(), Checkpoints(), RECORDS)
    assert set(frames["calls"]["model"]) == {f"/models/{STRONG_ROOT}", f"/models/{WEAK_ROOT}"}


# ----------------------------------------------------------------------------------------------
# The baselines' host


class Numbered:
    """A scripted client (NOT a model): request i of every batch answers with prompt tokens 1000 + i
    and completion tokens 10 + i, its reply the request's own parser's fallback."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def run_batch(self, requests):
        self.batches.append(list(requests))
        text = json.dumps({"abilities": ["x", "y"]})
        return [_reply(text, r.parser.fallback, 1000 + i, 10 + i) for i, r in enumerate(requests)]


def test_the_host_hands_each_call_its_own_reply_s_tokens_and_request_id():
    """One call site for two streams goes out as one batch; the numbers handed back to the program
    at each valid position are that position's reply's (prompt and completion tokens apart, the
    request id its trace row's), and an invalid position keeps the neutral values."""
    host = LiveBaselineHost(bbh_specs((0, 1)), RECORDS, client=Numbered())
    valid = np.array([[True, True], [False, True]])  # (stream, call) positions; one not asked
    stream = np.array([[0, 0], [1, 1]])
    ones = np.ones((2, 2), np.int64)
    out = host.answer("infer", valid, {"stream": stream, "t": ones, "agent": 0 * ones, "role": 0 * ones}, {})
    assert host.error is None and len(host.client.batches) == 1
    asked = [(r.stream, r.call_id) for r in host.client.batches[0]]
    assert [s for s, _ in asked] == [0, 0, 1]
    assert out["prompt"][valid].tolist() == [1000, 1001, 1002]
    assert out["completion"][valid].tolist() == [10, 11, 12]
    assert out["request"][valid].tolist() == [row["request"] for row in host.trace] == [0, 1, 2]
    assert [row["stream"] for row in host.trace] == [0, 0, 1]
    assert out["prompt"][1, 0] == 0 and out["completion"][1, 0] == 0 and out["request"][1, 0] == -1


def test_a_team_s_final_answer_is_what_the_other_teams_evaluate_and_refine_against():
    """SAC: an execution's final answer (its Finalize generation) is the answer another team's
    evaluation judges and its refinement keeps; a Contribute's part is not an answer."""
    host = LiveBaselineHost(bbh_specs((0,)), RECORDS, client=Numbered())
    agent, ability = (int(x) for x in np.argwhere(host.streams[0].spec.network.holds)[0])
    generate = C.KINDS.index("generate")
    call = {"stream": 0, "t": 1, "agent": agent, "role": 0, "ability": ability, "kind": generate}
    for team, finalize in ((1, False), (1, True)):
        _, finish = host._request("generate", {**call, "execution": team, "visit": int(finalize),
                                               "finalize": finalize}, {})  # fmt: skip
        finish(_reply(f"RESULT: TEAM-ONE-{'ANSWER' if finalize else 'PART'}", None))
    evaluation, _ = host._request("evaluate", {**call, "execution": 0, "other": 1}, {})
    content = evaluation.messages[-1]["content"]
    assert "TEAM-ONE-ANSWER" in content and "TEAM-ONE-PART" not in content
    kept = {"kept": np.array([False, True, False])}
    refinement, _ = host._request("refine", {**call, "execution": 0}, kept)
    assert "TEAM-ONE-ANSWER" in refinement.messages[-1]["content"]


def test_a_call_for_a_stream_the_host_does_not_have_is_a_clear_error():
    host = LiveBaselineHost(bbh_specs((0, 1)), RECORDS, client=Numbered())
    with pytest.raises(MeshHealError, match="a call for stream 2, the host has 2"):
        host._request("infer", {"stream": 2, "t": 1, "agent": 0, "role": 0}, {})


class Interrupted(Numbered):
    """A client interrupted mid-batch (Ctrl-C reaching the callback's thread)."""

    def run_batch(self, requests):
        self.batches.append(list(requests))
        raise KeyboardInterrupt


def test_an_interrupt_inside_a_call_site_is_recorded_and_every_later_call_is_neutral():
    """A failure while a call site's batch is out (here a KeyboardInterrupt, not an Exception) does
    not escape into the compiled program: the host records it (run_live_baselines raises it once
    the program returns), hands back neutral values and sends nothing more; the first reason to
    stop is the one kept."""
    client = Interrupted()
    host = LiveBaselineHost(bbh_specs((0, 1)), RECORDS, client=client)
    valid, ones = np.ones(2, bool), np.ones(2, np.int64)
    scalars = {"stream": np.arange(2), "t": ones, "agent": 0 * ones, "role": 0 * ones}
    try:
        out = host.answer("infer", valid, scalars, {})
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the call site instead of being recorded")
    assert isinstance(host.error, KeyboardInterrupt)
    assert out["pair"].tolist() == out["request"].tolist() == [-1, -1] and out["prompt"].sum() == 0
    host.stop(RuntimeError("a later reason"))
    assert isinstance(host.error, KeyboardInterrupt)
    host.answer("infer", valid, scalars, {})
    assert len(client.batches) == 1 and host.trace == []
