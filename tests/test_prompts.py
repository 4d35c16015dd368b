"""Prompt builders carry the facts of spec/live.md "Prompts"; reply parsers accept good replies
and turn garbage into ReplyParseError (meshheal_jax.prompts)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pydantic")

from meshheal_jax import data, prompts
from meshheal_jax.errors import MeshHealError
from meshheal_jax.prompts import (
    ANCHORS,
    ReplyParseError,
    RoundOneView,
    TaskText,
    abilities_of,
)
from meshheal_jax.topology import load_profile


@pytest.fixture(scope="module")
def bbh():
    return load_profile("bbh")


@pytest.fixture(scope="module")
def mmlu():
    return load_profile("mmlu_pro")


def _user(messages) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def _review_json(**overrides) -> str:
    reply = {
        "half_correct": 1.0,
        "in_scope": True,
        "normal_working_score": 1.0,
        "confidence": "high",
        "specific_failure_found": False,
        "failure_type": "none",
        "failure_evidence": "",
        "one_sentence_reason": "The count of instruments is right.",
    }
    reply.update(overrides)
    return json.dumps(reply)


# ----------------------------------------------------------------------------------------------
# Execution prompt: three competence directives


def test_execution_full_match(bbh):
    task = TaskText("bbh", "How many fruits do I have? I have an apple and a plum.", "object_counting")
    text = _user(prompts.execution_messages(task, abilities_of(bbh, ["spatial", "mathematical"]), "full"))
    assert "COMPETENCE_MATCH:yes" in text
    assert "object_counting" in text and "I have an apple and a plum." in text
    assert "RESULT:" in text
    assert "spatial: identifying, locating and classifying objects and moves" in text
    assert "none yet" in text  # no accepted outputs


def test_execution_partial_contribute_asks_for_handoff(bbh):
    task = TaskText("bbh", "Q?", "object_counting")
    text = _user(
        prompts.execution_messages(
            task,
            abilities_of(bbh, ["spatial"]),
            "partial",
            stage="contribute",
            missing=abilities_of(bbh, ["mathematical"]),
        )
    )
    assert "COMPETENCE_MATCH:partial" in text
    assert "ONLY" in text and "partial result" in text
    assert "HANDOFF" in text and "mathematical" in text
    assert "COMPETENCE_MATCH:yes" not in text


def test_execution_partial_finalize_shows_draft_and_one_answer(bbh):
    draft = prompts.PriorOutput("I found 3 apples and 2 plums.", ("spatial",))
    task = TaskText("bbh", "Q?", "object_counting", accepted=(draft,))
    text = _user(prompts.execution_messages(task, abilities_of(bbh, ["mathematical"]), "partial", "finalize"))
    assert "COMPETENCE_MATCH:partial" in text
    assert "ONE concrete final answer" in text
    assert "I found 3 apples and 2 plums." in text and "covering: spatial" in text


def test_execution_none_directive(bbh):
    task = TaskText("bbh", "Q?", "navigate")
    text = _user(prompts.execution_messages(task, abilities_of(bbh, ["temporal"]), "none"))
    assert "COMPETENCE_MATCH:no" in text


@pytest.mark.parametrize(
    "dataset, needle", [("math", "\\boxed{"), ("mmlu_pro", "option letter A-B"), ("bbh", "(B)")]
)
def test_answer_format_per_dataset(dataset, needle):
    task = TaskText(dataset, "Q?", "t", options=("yes", "no") if dataset == "mmlu_pro" else None)
    assert needle in prompts.answer_format(task)


def test_mmlu_pro_options_are_lettered(mmlu):
    record = data.load_sample("mmlu_pro")[0]
    task = TaskText("mmlu_pro", record.question, record.task_type, record.options)
    text = _user(prompts.execution_messages(task, abilities_of(mmlu, [0]), "full"))
    assert f"A. {record.options[0]}" in text
    assert f"{'ABCDEFGHIJ'[len(record.options) - 1]}. {record.options[-1]}" in text


def test_bad_directive_or_stage_is_rejected(bbh):
    task = TaskText("bbh", "Q?", "navigate")
    with pytest.raises(MeshHealError, match="directive"):
        prompts.execution_messages(task, (), "maybe")
    with pytest.raises(MeshHealError, match="stage"):
        prompts.execution_messages(task, (), "partial", stage="review")
    with pytest.raises(MeshHealError, match="dataset"):
        TaskText("gsm8k", "Q?", "x")


# ----------------------------------------------------------------------------------------------
# Ability inference


def test_inference_prompt_lists_vocabulary_pairs_and_examples(bbh):
    text = _user(
        prompts.inference_messages(
            bbh, "Today is 1 May. What is tomorrow?", "date_understanding", examples={"navigate": "Go left."}
        )
    )
    for name, description in zip(bbh.abilities, bbh.descriptions):
        assert f"{name}: {description}" in text
    for task_type in bbh.task_types:
        assert f"Task type {task_type}." in text
    assert '{"abilities": ["temporal", "linguistic"]}' in text
    assert "Example question: Go left." in text
    assert "Today is 1 May." in text


def test_parse_inference_good_replies(bbh):
    expected = prompts.InferredPair(
        tuple(sorted((bbh.abilities.index("temporal"), bbh.abilities.index("linguistic")))),
        bbh.pairs.index(frozenset({bbh.abilities.index("temporal"), bbh.abilities.index("linguistic")})),
    )
    assert prompts.parse_inference('{"abilities": ["temporal", "linguistic"]}', bbh) == expected
    assert prompts.parse_inference('{"abilities": ["Linguistic", " temporal "]}', bbh) == expected
    assert (
        prompts.parse_inference('Sure.\n```json\n{"abilities": ["linguistic","temporal"]}\n```', bbh)
        == expected
    )
    assert prompts.parse_inference('["temporal", "linguistic"]', bbh) == expected


def test_an_echoed_inference_prompt_names_no_pair(bbh):
    """A reply that repeats the prompt holds every type's example answer and then the reply form:
    it is no answer (before, the last example's pair was read), and a pair after the echo still is."""
    prompt = prompts.inference_messages(bbh, "Is it Monday?", bbh.task_types[0])[-1]["content"]
    with pytest.raises(ReplyParseError, match="an echo of the prompt"):
        prompts.parse_inference(prompt, bbh)
    after = prompts.parse_inference(prompt + '\n{"abilities": ["linguistic", "temporal"]}', bbh)
    assert after == prompts.parse_inference('{"abilities": ["temporal", "linguistic"]}', bbh)


@pytest.mark.parametrize(
    "reply",
    [
        "temporal and linguistic",  # no JSON
        '{"abilities": ["temporal"]}',  # one ability
        '{"abilities": ["temporal", "cooking"]}',  # not in the vocabulary
        '{"abilities": ["temporal", "mathematical"]}',  # not a documented pair
        '{"abilities": ["temporal", "temporal"]}',
        "",
        "[" * 3000,  # deeper than json's recursion allows
        '{"abilities": ' + "9" * 5000 + "}",  # past int()'s 4,300 digits
    ],
    ids=lambda reply: reply[:24],
)
def test_parse_inference_garbage(bbh, reply):
    with pytest.raises(ReplyParseError):
        prompts.parse_inference(reply, bbh)


def test_inference_fallback_is_the_documented_pair(bbh):
    parser = prompts.inference_parser(bbh, "geometric_shapes")
    spatial, symbolic = bbh.abilities.index("spatial"), bbh.abilities.index("symbolic")
    assert parser.fallback.abilities == tuple(sorted((spatial, symbolic)))
    schema = prompts.inference_response_format(bbh)["json_schema"]["schema"]
    assert schema["properties"]["abilities"]["items"]["enum"] == list(bbh.abilities)


# ----------------------------------------------------------------------------------------------
# Reviews


def _review_text(bbh, stage, accepted=()):
    task = TaskText("bbh", "How many instruments?", "object_counting", accepted=accepted)
    return _user(
        prompts.review_messages(
            task,
            stage,
            "There are 8 instruments.\nRESULT: 8",
            abilities_of(bbh, ["mathematical"]),
            abilities_of(bbh, ["mathematical", "symbolic"]),
        )
    )


def test_contribute_review_prompt_facts(bbh):
    text = _review_text(bbh, "contribute")
    assert "Judge ONLY that delegated part" in text and "only with an ability" in text
    for field in (
        "half_correct",
        "in_scope",
        "normal_working_score",
        "confidence",
        "specific_failure_found",
        "failure_type",
        "failure_evidence",
        "one_sentence_reason",
    ):
        assert field in text
    for anchor in (
        "1.00: sound",
        "0.50: you cannot verify",
        "0.25: it contains a concrete correctness error",
        "0.00: unusable",
    ):
        assert anchor in text
    assert "0.40 or lower" in text and "over_reach" in text and "never by itself" in text
    assert "give 0.50 with confidence low" in text
    assert "There are 8 instruments." in text
    assert "final_answer_committed" not in text


def test_finalize_review_prompt_facts(bbh):
    draft = prompts.PriorOutput("Instruments: flute, piano, ...", ("spatial",))
    text = _review_text(bbh, "finalize", accepted=(draft,))
    assert "NOT being scored" in text and "Instruments: flute, piano, ..." in text
    assert "ONE concrete final answer" in text and "at most 0.25" in text
    assert "final_answer_committed" in text


def test_committee_round2_shows_both_round1_reviews(bbh):
    task = TaskText("bbh", "Q?", "object_counting")
    messages = prompts.committee_round2_messages(
        task,
        "contribute",
        "out",
        abilities_of(bbh, ["spatial"]),
        abilities_of(bbh, ["spatial"]),
        own=RoundOneView(0.25, "It counts the stoves."),
        other=RoundOneView(1.0, "Looks right."),
    )
    text = _user(messages)
    assert "round 2" in text
    assert "Your round-1 score: 0.25" in text and "It counts the stoves." in text
    assert "other member's round-1 score: 1.00" in text and "Looks right." in text
    assert "half_correct" in text  # same rubric


@pytest.mark.parametrize("stage", ["contribute", "finalize"])
def test_review_schema_is_strict_json_schema(stage):
    fmt = prompts.review_response_format(stage)
    assert fmt["type"] == "json_schema"
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == set(schema["properties"])
    assert schema["properties"]["half_correct"]["enum"] == list(ANCHORS)
    assert schema["properties"]["failure_type"]["enum"] == ["none", "wrong_half", "over_reach", "other"]
    assert ("final_answer_committed" in schema["properties"]) == (stage == "finalize")
    json.dumps(fmt)  # serialisable as a request body


def test_parse_review_good():
    verdict = prompts.parse_review(_review_json(), "contribute")
    assert verdict.score == 1.0 and verdict.confidence == "high" and not verdict.parse_failed
    low = prompts.parse_review(
        _review_json(
            half_correct=0.25,
            normal_working_score=0.25,
            specific_failure_found=True,
            failure_type="wrong_half",
            failure_evidence="4 stoves are instruments",
        ),
        "contribute",
    )
    assert low.score == 0.25 and low.adjustment == ""
    assert '"4 stoves are instruments"' in low.explanation


def _score(value) -> float:
    return prompts.parse_review(
        _review_json(half_correct=value, normal_working_score=value), "contribute"
    ).score


def test_scores_snap_to_the_four_anchors(bbh):
    """protocol.md §4's anchors 0 / 0.25 / 0.5 / 1 (the emulator's too): a reported score is read as
    the nearest, 0.75 (equally near 0.5 and 1) as the neutral 0.5; past [0, 1] by more than the
    tolerance it is garbage."""
    assert prompts.ANCHORS == (0.0, 0.25, 0.5, 1.0)
    assert [prompts.snap_score(v) for v in (0.1, 0.2, 0.4, 0.7, 0.75, 0.8, 0.9, 1.1, -0.1, "0.6")] == [
        0.0, 0.25, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0, 0.5,
    ]  # fmt: skip
    assert _score(0.8) == 1.0  # through the reply parser
    for garbage in (1.2, -0.2, 3):
        with pytest.raises(ReplyParseError):
            _score(garbage)
    assert all("0.75" not in _review_text(bbh, stage) for stage in ("contribute", "finalize"))


def test_parse_review_snaps_and_tolerates_wrappers():
    assert _score(0.7) == 0.5
    assert (
        prompts.parse_review(_review_json(half_correct="1", normal_working_score="1"), "contribute").score
        == 1.0
    )
    fenced = (
        "Here is my review:\n```json\n" + _review_json(half_correct=0.5, normal_working_score=0.5) + "\n```"
    )
    assert prompts.parse_review(fenced, "contribute").score == 0.5
    # several JSON values, fenced or not: the last valid one is the reply's
    second = "\n```json\n" + _review_json() + "\n```"
    assert prompts.parse_review(fenced + second, "contribute").score == 1.0
    echo = 'The schema:\n```json\n{"half_correct": "number"}\n```\n'
    assert prompts.parse_review(echo + fenced, "contribute").score == 0.5
    chatty = (
        "Thinking... {not json} then " + _review_json(confidence="Medium", failure_type="None") + " done."
    )
    assert prompts.parse_review(chatty, "contribute").confidence == "medium"


def test_scope_and_mismatch_never_lower_the_score():
    verdict = prompts.parse_review(
        _review_json(in_scope=False, failure_type="over_reach", normal_working_score=0.5), "contribute"
    )
    assert verdict.score == 1.0 and verdict.in_scope is False


def test_low_score_without_evidence_becomes_neutral():
    no_evidence = _review_json(
        half_correct=0.0,
        normal_working_score=0.0,
        specific_failure_found=True,
        failure_type="other",
        failure_evidence="",
    )
    over_reach = _review_json(
        half_correct=0.25,
        normal_working_score=0.25,
        specific_failure_found=True,
        failure_type="over_reach",
        failure_evidence="it also solved part B",
    )
    for reply in (no_evidence, over_reach):
        verdict = prompts.parse_review(reply, "contribute")
        assert verdict.score == 0.5 and verdict.adjustment == "unsupported_low_score"


def test_finalize_without_committed_answer_is_capped():
    reply = _review_json(final_answer_committed=False)
    verdict = prompts.parse_review(reply, "finalize")
    assert verdict.score == 0.25 and verdict.adjustment == "no_final_answer"
    with pytest.raises(ReplyParseError):  # the finalize schema requires the field
        prompts.parse_review(_review_json(), "finalize")


@pytest.mark.parametrize(
    "reply",
    [
        "The output looks correct to me. Score: 1.0",  # no JSON
        _review_json(half_correct=7),  # off the grid
        _review_json(half_correct=-0.5, normal_working_score=-0.5),
        _review_json(half_correct="high", normal_working_score="high"),
        _review_json(half_correct=True, normal_working_score=True),
        _review_json(confidence="absolute"),
        _review_json(failure_type="typo"),
        json.dumps({"half_correct": 1.0}),  # fields missing
        "[1, 0.5]",
        "",
        "{" * 50,
        # garbage past json's own limits: nesting deeper than its recursion, an integer of more
        # than 4,300 digits, a score too large for a float
        "[" * 3000,
        '{"a":' * 3000,
        '{"half_correct": ' + "9" * 5000 + "}",
        _review_json(half_correct=10**400, normal_working_score=10**400),
    ],
    ids=lambda reply: reply[:24],
)
def test_parse_review_garbage(reply):
    with pytest.raises(ReplyParseError):
        prompts.parse_review(reply, "contribute")


def test_review_parser_fallback_is_neutral():
    parser = prompts.review_parser("contribute")
    assert parser.fallback.score == prompts.NEUTRAL_SCORE == 0.5
    assert parser.fallback.parse_failed and parser.fallback.confidence == "low"
    assert parser.parse(_review_json()).score == 1.0


@pytest.mark.parametrize(
    "value, expected", [(0, 0.0), (0.1, 0.0), (0.26, 0.25), (0.5, 0.5), (0.9, 1.0), (1.1, 1.0)]
)
def test_snap_score(value, expected):
    assert prompts.snap_score(value) == expected


@pytest.mark.parametrize("value", [1.2, -0.2, float("nan"), "x", None, False])
def test_snap_score_rejects(value):
    with pytest.raises(ValueError):
        prompts.snap_score(value)


# ----------------------------------------------------------------------------------------------
# Takeover


def test_candidate_prompt(bbh):
    task = TaskText("bbh", "Q?", "object_counting")
    text = _user(
        prompts.candidate_messages(
            task,
            "finalize",
            "RESULT: 9",
            abilities_of(bbh, ["mathematical"]),
            abilities_of(bbh, ["mathematical"]),
            reviews=["Counted the lamps."],
        )
    )
    assert "corrected version" in text and "final answer" in text
    assert "RESULT: 9" in text and "Counted the lamps." in text and "RESULT: <answer>" in text


def test_synthesis_prompt(bbh):
    task = TaskText("bbh", "Q?", "object_counting", accepted=(prompts.PriorOutput("draft text"),))
    text = _user(
        prompts.synthesis_messages(
            task,
            "contribute",
            ["cand one", "cand two"],
            abilities_of(bbh, ["spatial"]),
            abilities_of(bbh, ["spatial"]),
        )
    )
    assert "[Candidate 1]\ncand one" in text and "[Candidate 2]\ncand two" in text
    assert "ONE replacement partial result" in text and "draft text" in text
    with pytest.raises(MeshHealError):
        prompts.synthesis_messages(task, "contribute", [], (), ())


# ----------------------------------------------------------------------------------------------
# Execution replies


def test_parse_execution_answers():
    reply = prompts.parse_execution(
        "COMPETENCE_MATCH:partial\nSo x = 2.\nRESULT: \\boxed{\\frac{1}{2}}", "math"
    )
    assert reply.competence == "partial" and reply.answer == "\\frac{1}{2}"
    assert prompts.parse_execution("COMPETENCE_MATCH:yes\nRESULT: (B)", "bbh").answer == "(B)"
    assert prompts.parse_execution("The answer is C.", "mmlu_pro").answer == "C"
    no_answer = prompts.parse_execution("I am not sure.", "math")
    assert no_answer.answer is None and no_answer.competence is None
    with pytest.raises(ReplyParseError):
        prompts.parse_execution("   ", "math")


@pytest.mark.parametrize("stage", ["contribute", "finalize"])
def test_review_reply_reads_back_its_score_on_every_anchor(stage):
    """The stand-ins' and tests' well-formed reply (prompts.review_reply) is what parse_review
    accepts unchanged: a low score carries its evidence, so no client-side rule moves it."""
    for score in prompts.ANCHORS:
        verdict = prompts.parse_review(prompts.review_reply(score, stage, evidence="2 + 2 = 5"), stage)
        assert verdict.score == score and verdict.adjustment == ""
        assert verdict.failure_evidence == ("2 + 2 = 5" if score <= 0.25 else "")
        assert verdict.final_answer_committed is (None if stage == "contribute" else score > 0.25)


def _json_values_trying_every_opener(text: str) -> list:
    """_json_values without its skip of openers past the last closer: every '{' and '[' tried."""
    stripped = text.strip()
    try:
        return [json.loads(stripped)]
    except (ValueError, RecursionError):
        pass
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(stripped):
        if stripped[i] in "{[":
            try:
                value, end = decoder.raw_decode(stripped, i)
            except (ValueError, RecursionError):
                i += 1
                continue
            if isinstance(value, (dict, list)):
                found.append(value)
            i = end
        else:
            i += 1
    return found


@given(
    st.lists(st.sampled_from(["{", "}", "[", "]", '"', ":", ",", "1", "a", " ", '"a"', "\\"]), max_size=40)
)
@settings(max_examples=400, deadline=None)
def test_json_values_skips_only_openers_that_cannot_close(pieces):
    """Not trying an opener past the last closer of its kind finds exactly what trying every opener
    finds (a value opened by '{' ends with '}', by '[' with ']')."""
    text = "".join(pieces)
    assert prompts._json_values(text) == _json_values_trying_every_opener(text)


@pytest.fixture
def decoder_starts(monkeypatch):
    """Where _json_values' decoder starts, in order (each start costs it a parse)."""
    starts = []

    class Counting(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            starts.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(prompts.json, "JSONDecoder", Counting)
    return starts


def test_json_values_of_a_reply_looping_on_openers(decoder_starts):
    """A reply that repeats an opener to its token limit holds no JSON, and what comes before the
    loop is still found; no opener of the loop is decoded (none can close)."""
    assert prompts._json_values("[" * 32_000) == [] and decoder_starts == []
    assert prompts._json_values('{"score": 1} ' + '{"a": [' * 5_000) == [{"score": 1}]
    assert decoder_starts == [0]


# loops of openers a closer follows: each start in them makes the decoder nest past its ~1,000
# limit, the case `_next_start` skips (1,100 units: just past the limit, so the oracle stays quick)
DEEP_LOOPS = [
    "[" * 1_100 + "]",
    "[" * 1_100 + "]]",
    '{"a": [' * 1_100 + "]}",
    '{"score": 1} ' + "[ " * 1_100 + '] {"x": 2}',
    "[\n" * 1_100 + "1]",
    "[1, " * 1_100 + "]",
    '{"a": 1, "b": [' * 1_100 + "2]}",
    '[true, "x", -1.5e3, ' * 1_100 + "null]",
    "[" * 1_100 + "]" * 300,
    '{"[1]": [' * 1_100 + "]",  # a key with a bracket ends a chain: that start is tried
    '{"k": "v", "[": [' * 1_100 + "]}",
    "[" * 1_100 + '"]"]',
]


@pytest.mark.parametrize("text", DEEP_LOOPS, ids=range(len(DEEP_LOOPS)))
def test_json_values_of_a_loop_a_closer_follows(text):
    """Skipping the openers of a loop that cannot close finds what trying every opener finds."""
    assert prompts._json_values(text) == _json_values_trying_every_opener(text)


@given(
    st.lists(
        st.sampled_from(["{", "[", "]", "}", ",", ":", " ", "1", '"a"', '"["', "\\"]), min_size=1, max_size=6
    ),
    st.lists(st.sampled_from(["{", "}", "[", "]", ",", ":", "1", '"a"', " "]), max_size=12),
)
@settings(max_examples=25, deadline=None)
def test_json_values_of_random_loops(unit, tail):
    """The same for a random unit repeated 1,100 times, then a random tail."""
    text = "".join(unit) * 1_100 + "".join(tail)
    assert prompts._json_values(text) == _json_values_trying_every_opener(text)


@pytest.mark.parametrize("units", [32_000, 900, prompts.SKIP_CHAIN])
@pytest.mark.parametrize("loop", ["[", '{"a": [', "[1, ", '{"k": 0, "a": ['])
def test_json_values_decodes_few_starts_of_a_long_loop(decoder_starts, loop, units):
    """A loop and two closers: the decoder tries the first opener and the last few (each tried
    opener of the loop costs it up to its nesting limit, ~1,000 steps; 6.6 s for 32,000 "[" then
    "]"), whether it refuses the first for its nesting (32,000 units) or for the missing closers
    (900: within the limit), down to the shortest chain counted."""
    text = loop * units + "]}"
    expected = _json_values_trying_every_opener(text[-len(loop) * 2 - 2 :])  # the last two units
    decoder_starts.clear()  # the oracle's starts
    assert prompts._json_values(text) == expected
    assert len(decoder_starts) <= 3, decoder_starts


def test_json_values_reads_a_chain_of_openers_once(monkeypatch):
    """A loop of openers followed by as many closers: no opener can be skipped, and the chain is
    read once, not again from each of its openers (which would be quadratic)."""
    steps = []

    class Counting:
        def match(self, text, pos):
            steps.append(pos)
            return chain_step.match(text, pos)

    chain_step = prompts._CHAIN_STEP
    monkeypatch.setattr(prompts, "_CHAIN_STEP", Counting())
    text = "[" * 1_100 + "]" * 1_100
    assert prompts._json_values(text) == _json_values_trying_every_opener(text)
    assert len(steps) == 1_101
