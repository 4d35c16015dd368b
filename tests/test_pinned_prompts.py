"""Prompt texts and reply parsers that a mutation audit of `prompts.py` could change without any other
test failing (tests/test_pinned_scoring.py holds the earlier pins of its reply parsers): which of
several JSON values in a reply is read when a later one is not valid, the numeric confidence's range,
the inference fallback's pair index, what each role's prompt names where (the judged part against
the reviewer's own abilities, the Takeover's result line per stage, accepted outputs in order, BBH
options not shown twice, MMLU-Pro options in the inference prompt, the baselines' answers in place),
and the clear errors of bad input. Each test names the mutation it holds; two hold bugs the audit
found and that were fixed (a profile's ability name with a space or hyphen was never read back from a
reply; an unknown task type's fallback raised a bare ValueError)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from meshheal_jax import data, prompts, topology
from meshheal_jax.errors import MeshHealError
from meshheal_jax.prompts import PriorOutput, ReplyParseError, TaskText, abilities_of
from meshheal_jax.topology import load_profile


@pytest.fixture(scope="module")
def bbh():
    return load_profile("bbh")


def _user(messages) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def _review(**fields) -> str:
    reply = json.loads(prompts.review_reply(1.0, "contribute"))
    reply.update(fields)
    return json.dumps(reply)


# ----------------------------------------------------------------------------------------------
# Several JSON values in one reply: the last *valid* one is the reply's (_json_values' docstring)

# what a chatty model writes after its answer: a JSON object that is not an answer
TRAILER = '\n\nNote: I used the scale {"from": 0, "to": 1} as asked.'


def test_a_review_followed_by_a_json_that_is_no_review_is_read():
    """parse_review takes the last JSON object that validates: a fenced review and then another
    object (a note, an echo of the scale) is the fenced review, not garbage. Mutation: the first
    invalid object, in reverse order, ends the search."""
    text = "```json\n" + _review(half_correct=0.5, normal_working_score=0.5) + "\n```" + TRAILER
    assert prompts.parse_review(text, "contribute").score == 0.5


def test_an_inference_pair_followed_by_a_pair_that_is_none_is_read(bbh):
    """parse_inference takes the last JSON value naming a documented pair: a later value naming an
    unknown ability, or two abilities that are no documented pair, does not hide it. Mutations:
    an unknown ability or an undocumented pair ends the search."""
    good = '{"abilities": ["temporal", "linguistic"]}'
    expected = prompts.parse_inference(good, bbh)
    for later in ('{"abilities": ["temporal", "cooking"]}', '{"abilities": ["temporal", "spatial"]}'):
        assert prompts.parse_inference(f"{good}\nor maybe {later}", bbh) == expected, later


def test_an_agent_choice_followed_by_other_json_is_read():
    """parse_choice reads the last {"agent": ...} it can read: a later object without "agent" (or
    with an agent that is no number) is skipped, neither a crash nor garbage. Mutations: "agent"
    not required (a KeyError); an unreadable agent ends the search."""
    assert prompts.parse_choice('{"agent": 3}' + TRAILER, [3, 4]) == 3
    assert prompts.parse_choice('{"agent": 4} then {"agent": "the third one"}', [3, 4]) == 4


def test_an_agent_is_read_however_its_id_is_written():
    """A router / selection reply may write the agent as 3, "3", "agent 3", "Agent 3" or 3.0 (an
    audit found "Agent 3" and 3.0 refused while "agent 3" was read); a fraction or a boolean is no
    agent."""
    for written in ("3", '"3"', '"agent 3"', '"Agent 3"', '" AGENT  3 "', "3.0"):
        assert prompts.parse_choice(f'{{"agent": {written}}}', [3, 4]) == 3, written
    for garbage in ("3.5", "true", '"agent three"'):
        with pytest.raises(prompts.ReplyParseError):
            prompts.parse_choice(f'{{"agent": {garbage}}}', [1, 3, 4])


def test_an_evaluation_followed_by_a_json_that_is_none_is_read():
    """parse_evaluation takes the last JSON object that validates. Mutation: the first invalid
    object, in reverse order, ends the search."""
    text = '{"own_score": 1, "other_score": 0.25, "one_sentence_reason": "ok"}' + TRAILER
    assert prompts.parse_evaluation(text) == (1.0, 0.25)


def test_an_evaluation_whose_reason_is_null_reads_as_one_without_a_reason():
    """The reason is advisory: null reads as none given, as a missing one does and as a review's
    null evidence does (it made the whole evaluation garbage, scored neutral)."""
    for reason in (', "one_sentence_reason": null', ""):
        assert prompts.parse_evaluation(f'{{"own_score": 1, "other_score": 0{reason}}}') == (1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Review replies: the numeric confidence and the evidence as round 2 shows it


def test_a_numeric_confidence_is_read_only_within_zero_to_one():
    """A numeric confidence in [0, 1] is read as low (< 0.4), medium (< 0.75) or high; one outside
    (a percentage, 85) is garbage, not "high". Mutations: 0.4 read as low; the range not checked."""
    assert prompts.parse_review(_review(confidence=0.4), "contribute").confidence == "medium"
    assert prompts.parse_review(_review(confidence=1), "contribute").confidence == "high"
    for garbage in (85, -0.1, "85", "nan"):
        with pytest.raises(ReplyParseError, match="confidence"):
            prompts.parse_review(_review(confidence=garbage), "contribute")
    # a number written as text reads as the number (an audit found "0.8" refused while 0.8 was read)
    assert prompts.parse_review(_review(confidence=" 0.8"), "contribute").confidence == "high"
    assert prompts.parse_review(_review(confidence="0.2"), "contribute").confidence == "low"


def test_an_ability_index_outside_the_vocabulary_is_refused(bbh):
    """abilities_of takes names or vocabulary indices; -1 once named the last ability and 99 raised
    a bare IndexError."""
    assert [a.name for a in prompts.abilities_of(bbh, [0, "spatial"])] == [bbh.abilities[0], "spatial"]
    for index in (-1, len(bbh.abilities)):
        with pytest.raises(MeshHealError, match=rf"no ability index {index}; its abilities are 0\.\.6"):
            prompts.abilities_of(bbh, [index])


def test_a_verdict_keeps_its_evidence_without_surrounding_space():
    """The verdict's evidence (what round 2 quotes) and reason are the reply's, stripped. Mutation:
    the evidence kept with its newlines."""
    reply = _review(half_correct=0.25, normal_working_score=0.25, specific_failure_found=True,
                    failure_type="wrong_half", failure_evidence="\n  2 + 2 = 5 \n",
                    one_sentence_reason=" The sum is wrong. ")  # fmt: skip
    verdict = prompts.parse_review(reply, "contribute")
    assert (verdict.score, verdict.failure_evidence) == (0.25, "2 + 2 = 5")
    assert verdict.explanation == 'The sum is wrong. Evidence: "2 + 2 = 5"'


# ----------------------------------------------------------------------------------------------
# Inference: the fallback's pair index, the prompt's task type and options


@pytest.mark.parametrize(
    "task_type", ["geometric_shapes", "logical_deduction_five_objects", "temporal_sequences"]
)
def test_the_inference_fallback_is_the_pair_a_reply_naming_it_gives(bbh, task_type):
    """The fallback after a failed inference is the task type's documented pair, with that pair's
    index in profile.pairs (the live loop compares it with the true pair): the same InferredPair a
    reply naming the pair parses to. These task types' pair index differs from their own index.
    Mutation: the task type's index recorded as the pair index."""
    fallback = prompts.inference_parser(bbh, task_type).fallback
    names = [bbh.abilities[i] for i in fallback.abilities]
    assert fallback == prompts.parse_inference(json.dumps({"abilities": names}), bbh)
    assert fallback.pair_index == bbh.pair_index(bbh.task_types.index(task_type))


def _math_profile_renamed(tmp_path, old: str, new: str):
    """The shipped MATH profile with one ability renamed (a --profiles-dir profile)."""
    text = (topology.PROFILE_DIR / "math.toml").read_text().replace(old, new)
    (tmp_path / "math.toml").write_text(text)
    return load_profile("math", tmp_path)


def test_inference_reads_a_profiles_ability_name_in_any_case(tmp_path):
    """A profile may write its ability names in capitals: the reply is matched without case on both
    sides. Mutation: the profile's names not case-folded (only the reply's)."""
    profile = _math_profile_renamed(tmp_path, "arithmetic", "Arithmetic")
    pair = prompts.parse_inference('{"abilities": ["Arithmetic", "multi_step_deduction"]}', profile)
    assert [profile.abilities[i] for i in pair.abilities] == ["Arithmetic", "multi_step_deduction"]


def test_inference_reads_a_profiles_ability_name_with_a_space_or_hyphen(tmp_path):
    """A profile's ability names are any non-empty text (topology.parse_profile); the inference
    schema's enum offers them as written, so a reply names one exactly. parse_inference once folded
    the reply's spaces and hyphens to "_" but not the profile's names, so "multi-step deduction" was
    an unknown ability however it was written, every inference of such a profile failed to parse,
    and the fallback (the true pair, recorded correct) stood in for it. Both sides are now folded
    alike (topology.name_key), also "Multi Step-Deduction"."""
    profile = _math_profile_renamed(tmp_path, "multi_step_deduction", "multi-step deduction")
    assert (
        "multi-step deduction"
        in prompts.inference_schema(profile)["properties"]["abilities"]["items"]["enum"]
    )
    for written in ("multi-step deduction", "Multi Step-Deduction"):
        pair = prompts.parse_inference(f'{{"abilities": ["arithmetic", "{written}"]}}', profile)
        assert [profile.abilities[i] for i in pair.abilities] == ["arithmetic", "multi-step deduction"]


def test_the_inference_prompt_refuses_a_task_type_the_profile_lacks(bbh):
    """inference_messages names the known task types for one it does not know. Mutation: the check
    dropped (the prompt built for a type with no documented pair)."""
    with pytest.raises(
        MeshHealError, match=r"no task type 'sports_understanding'; known: \['object_counting'"
    ):
        prompts.inference_messages(bbh, "Is it a goal?", "sports_understanding")


def test_the_inference_prompt_shows_mmlu_pro_options():
    """The inference prompt shows the question as the execution prompt does (format_question:
    MMLU-Pro's options lettered A-J). Mutation: the options not passed on."""
    profile = load_profile("mmlu_pro")
    record = data.load_sample("mmlu_pro")[0]
    text = _user(
        prompts.inference_messages(profile, record.question, record.task_type, options=record.options)
    )
    shown = prompts.format_question(TaskText("mmlu_pro", record.question, record.task_type, record.options))
    assert shown in text and f"\nA. {record.options[0]}\n" in text


# ----------------------------------------------------------------------------------------------
# The question and the accepted outputs as every prompt shows them


def test_a_bbh_question_is_shown_once_with_its_own_options():
    """format_question: "BBH keeps its own 'Options:' block". BBH records carry the options parsed
    from their input (data.Record), and the live loop passes them on; they are not appended again,
    lettered like MMLU-Pro's. Mutation: options appended for every dataset."""
    record = next(r for r in data.load_sample("bbh") if r.options)
    task = TaskText("bbh", record.question, record.task_type, record.options)
    assert prompts.format_question(task) == record.question.strip()


def test_accepted_outputs_are_shown_in_order_numbered_from_one(bbh):
    """_accepted_block: the accepted outputs "in order", each with the abilities its author covered.
    Mutation: shown in reverse order."""
    first, second = PriorOutput("first part", ("spatial",)), PriorOutput("second part", ("mathematical",))
    task = TaskText("bbh", "Q?", "object_counting", accepted=(first, second))
    text = _user(prompts.execution_messages(task, abilities_of(bbh, ["spatial"]), "partial"))
    assert (
        "[Output 1 (covering: spatial)]\nfirst part\n\n[Output 2 (covering: mathematical)]\nsecond part"
        in text
    )


def test_a_blank_question_is_refused():
    """TaskText refuses a question of white space only, as it does an empty one. Mutation: only ""
    refused."""
    with pytest.raises(MeshHealError, match="empty question"):
        TaskText("bbh", " \n\t", "navigate")


# ----------------------------------------------------------------------------------------------
# Reviews and Takeover: the judged part against the reviewer's own abilities

JUDGED, OWN = ["symbolic"], ["temporal", "spatial"]


@pytest.mark.parametrize("stage", ["contribute", "finalize"])
def test_a_review_names_the_judged_part_and_the_reviewers_own_abilities(bbh, stage):
    """spec/live.md: judge only the drafter's delegated part (Finalize: the finaliser's own part),
    using only an ability the reviewer holds: the prompt names the first by the judged abilities
    and the second by the reviewer's. Mutations: either list shown in the other's place."""
    task = TaskText("bbh", "Q?", "geometric_shapes")
    text = _user(
        prompts.review_messages(task, stage, "out", abilities_of(bbh, JUDGED), abilities_of(bbh, OWN))
    )
    part = (
        "delegated the part of this task that needs symbolic,"
        if stage == "contribute"
        else ("it did the part that needs symbolic and")
    )
    assert part in text
    assert "ability you hold (temporal, spatial)" in text


@pytest.mark.parametrize("stage", ["contribute", "finalize"])
def test_takeover_prompts_ask_for_the_reviewed_kind_of_output(bbh, stage):
    """spec/live.md: a candidate and the synthesis are "of the same kind (partial result or final
    answer)" as the reviewed output, covering the judged part: a Contribute's end with the partial
    result's RESULT line, a Finalize's with the dataset's answer format. Mutations: the answer format
    asked of a Contribute's candidate or synthesis; the reviewer's or synthesiser's abilities named
    as the part."""
    task = TaskText("mmlu_pro", "Q?", "law", options=("yes", "no", "maybe"))
    judged, own = abilities_of(load_profile("mmlu_pro"), [0]), abilities_of(load_profile("mmlu_pro"), [5])
    candidate = _user(prompts.candidate_messages(task, stage, "RESULT: B", judged, own, reviews=["wrong"]))
    synthesis = _user(prompts.synthesis_messages(task, stage, ["c1", "c2"], judged, own))
    for text in (candidate, synthesis):
        assert "part of this task that needs humanities_knowledge" in text
        assert "needs contextual_inference" not in text
        if stage == "contribute":
            assert text.endswith("End with the line `RESULT: <the corrected partial result>`.")
            assert "option letter" not in text
        else:
            assert text.endswith(prompts.answer_format(task)) and "option letter A-C" in text


def test_a_candidate_prompt_lists_only_the_reviews_that_say_something(bbh):
    """candidate_messages lists the committee's explanations, leaving out blank ones, and says when
    none was given. Mutation: blank explanations listed as empty bullets."""
    ab = abilities_of(bbh, ["spatial"])
    task = TaskText("bbh", "Q?", "navigate")
    text = _user(
        prompts.candidate_messages(task, "contribute", "out", ab, ab, reviews=["  ", "Turned left.", ""])
    )
    assert "rejected it:\n- Turned left.\n\nRejected" in text
    blank = _user(prompts.candidate_messages(task, "contribute", "out", ab, ab, reviews=["", " "]))
    assert "rejected it:\n- (no explanation given)\n\nRejected" in blank


# ----------------------------------------------------------------------------------------------
# Parsers the live client uses for text replies


def test_text_and_execution_parsers_refuse_what_they_cannot_read():
    """The live client's default parser refuses a blank reply (retried, then its fallback), and an
    execution parser is refused up front for a dataset it cannot score, naming the known ones; an
    execution reply keeps its whole text (the text store's). Mutations: a blank text accepted; the
    dataset not checked when the parser is made; the text stripped."""
    with pytest.raises(ReplyParseError, match="empty reply"):
        prompts.TEXT_PARSER.parse(" \n")
    assert prompts.TEXT_PARSER.parse("ok") == "ok" and prompts.TEXT_PARSER.fallback is None
    with pytest.raises(MeshHealError, match=r"unknown dataset 'gsm8k'; known: \['bbh'"):
        prompts.execution_parser("gsm8k")
    text = "COMPETENCE_MATCH:yes\nRESULT: (B)\n"
    assert prompts.execution_parser("bbh").parse(text).text == text


def test_an_unknown_ability_name_is_refused_naming_the_known_ones(bbh):
    """abilities_of names the profile's abilities for a name it does not know. Mutation: the error
    loses its detail."""
    with pytest.raises(MeshHealError, match=r"bbh has no ability 'cooking'; known: \['mathematical'"):
        abilities_of(bbh, ["cooking"])


# ----------------------------------------------------------------------------------------------
# The baselines' prompts (spec/baselines.md)


def test_router_and_selection_prompts_refuse_no_candidates_and_say_why_they_ask_again(bbh):
    """A router call needs a neighbour to name; a repeated speaker selection says the worker named
    before declined; the choice schema offers exactly the candidates. Mutations: no candidates
    accepted; the retry's reason left out; the schema's agent not restricted."""
    task, needed = TaskText("bbh", "Q?", "navigate"), abilities_of(bbh, ["spatial"])[0]
    with pytest.raises(MeshHealError, match="at least one candidate"):
        prompts.router_messages(task, 1, needed, [])
    workers = [prompts.Candidate(4, abilities_of(bbh, ["spatial"])), prompts.Candidate(2, ())]
    again = _user(prompts.select_messages(task, needed, workers, retry=True))
    assert "declined the turn" in again and "declined" not in _user(
        prompts.select_messages(task, needed, workers, retry=False)
    )
    schema = prompts.choice_response_format([4, 2, 4])["json_schema"]["schema"]
    assert schema["properties"]["agent"]["enum"] == [2, 4]


def test_the_baselines_answer_prompts_show_each_answer_in_its_place(bbh):
    """SAC's evaluation shows the team's own answer and the other team's each under its heading, its
    refine prompt the kept answers in order (or that none was kept); AutoGen's compose shows the
    last worker's answer. Mutations: one answer shown twice; kept answers dropped; the worker's
    answer dropped."""
    task, ab = TaskText("bbh", "Q?", "navigate"), abilities_of(bbh, ["spatial"])
    evaluation = _user(prompts.evaluation_messages(task, "OWN-ANSWER", "OTHER-ANSWER", ab))
    assert "Your team's answer:\n<<<\nOWN-ANSWER\n>>>" in evaluation
    assert "Another team's answer:\n<<<\nOTHER-ANSWER\n>>>" in evaluation
    refine = _user(prompts.refine_messages(task, "mine", ["kept one", "kept two"], ab))
    assert "[Answer 1]\nkept one\n\n[Answer 2]\nkept two" in refine
    assert "you kept after evaluation:\n(none kept)" in _user(prompts.refine_messages(task, "mine", [], ab))
    assert "The last worker answered:\n<<<\nWORKER-SAYS\n>>>" in _user(
        prompts.compose_messages(task, "WORKER-SAYS")
    )


# ----------------------------------------------------------------------------------------------
# Bad input found by the audit


def test_the_inference_fallback_refuses_an_unknown_task_type_by_name(bbh):
    """Every other entry point of prompts.py names what it does not know (a task type, an ability, a
    dataset, a stage); the inference parser's fallback raised `tuple.index(x): x not in tuple`."""
    with pytest.raises(MeshHealError, match="sports_understanding"):
        prompts.inference_parser(bbh, "sports_understanding")
