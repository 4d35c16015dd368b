"""Answer extraction, option letters and reply parsers that a mutation audit of `scoring.py` and
`prompts.py` could change without any other test failing: which RESULT: / "answer is" counts when a
reply writes several, the forms of a hedge, the markup around a letter or a literal, the argument
order of math-verify, and the review, inference and execution replies' tolerated spellings and
client-side rules. Each test names the mutation it holds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from meshheal_jax import prompts, scoring
from meshheal_jax.prompts import ReplyParseError
from meshheal_jax.scoring import OK, UNPARSABLE, extract_answer, judge
from meshheal_jax.topology import load_profile

# ----------------------------------------------------------------------------------------------
# Extraction: which answer a reply gives


def test_the_last_of_several_result_lines_is_the_answer():
    """extract_answer: "the last `RESULT:` line". Mutation: the first RESULT: taken."""
    text = "RESULT: (A)\nWait, that miscounts the fish.\nRESULT: (C)"
    assert extract_answer("bbh", text) == "(C)"
    assert judge("bbh", text, "(C)").correct


def test_the_last_answer_is_phrase_is_the_answer():
    """extract_answer: failing RESULT: and \\boxed{}, "the text after the last 'answer is'".
    Mutation: the first "answer is" taken."""
    text = "I first thought the answer is (A). Checking again, the answer is (C)."
    assert extract_answer("mmlu_pro", text) == "(C)"
    assert judge("bbh", text, "(C)").correct


def test_a_result_label_with_a_space_before_its_colon_is_read_mid_line():
    """RESULT: may have spaces before its colon anywhere in a line ("RESULT\\s*:"), not only at a
    line's start. Mutation: the colon required right after the word."""
    assert extract_answer("math", "Adding them up, RESULT : 7") == "7"


def test_a_result_label_in_markup_takes_the_next_line():
    """A RESULT: line holding only markup ("**RESULT:**") continues on the next line. Mutation:
    only spaces count as an empty line, so "**" became the answer (and then nothing)."""
    assert extract_answer("math", "Sum of the roots.\n**RESULT:**\n42") == "42"
    assert judge("mmlu_pro", "**RESULT:**\n**B**", "B").correct


# ----------------------------------------------------------------------------------------------
# Hedges (decisions L8): their joins, their case, and one value boxed twice


@pytest.mark.parametrize(
    "text",
    [
        "RESULT: \\boxed{B}\\boxed{C}",  # nothing between the boxes
        "RESULT: \\boxed{B} OR \\boxed{C}",  # the connective in capitals
        "RESULT: \\boxed{B}; \\boxed{C}",
    ],
)
def test_boxes_joined_as_alternatives_are_a_hedge(text):
    """decisions L8: boxes joined by "or", ",", "/", ";" or nothing are a hedge, whatever the case
    of the "or". Mutations: "" dropped from the joins; the join compared case-sensitively."""
    assert extract_answer("mmlu_pro", text) == text.removeprefix("RESULT: ")
    for gold in ("B", "C"):
        verdict = judge("mmlu_pro", text, gold)
        assert (verdict.correct, verdict.status) == (False, UNPARSABLE), (text, gold)


def test_one_value_boxed_twice_as_alternatives_is_that_value():
    """_hedged: boxes of two *different* answers; the same box twice ("\\boxed{B} or \\boxed{B}")
    is one answer. Mutation: any two boxes joined by "or" read as a hedge."""
    assert extract_answer("mmlu_pro", "RESULT: \\boxed{B} or \\boxed{B}") == "B"
    assert judge("mmlu_pro", "RESULT: \\boxed{B} or \\boxed{B}", "B") == scoring.Judgement(True, OK, "B")


# ----------------------------------------------------------------------------------------------
# Option letters and literal targets: the markup around them


@pytest.mark.parametrize(
    "text",
    [
        "RESULT: B: the pupil shrinks",  # a colon after the letter
        "RESULT: \\mathrm{B}",  # decisions L8: \text{}, \textbf{}, \mathrm{}, \mathbf{} around a letter
        "RESULT: \\mathbf{B}",
    ],
)
def test_a_letter_in_these_forms_is_that_letter(text):
    """Mutations: ":" dropped from the marks a bare letter may carry; \\mathrm dropped from the
    LaTeX wrappers read around an answer."""
    assert judge("mmlu_pro", text, "B") == scoring.Judgement(True, OK, "B")


def test_an_option_quoted_after_its_letter_with_words_after_it_is_no_hedge():
    """_names_another: after its letter, the option's own text "or the start of it (a reply may cut
    a long option short)" names no second option, and words may follow it. Mutation: the rest of
    the answer compared whole with the option's text."""
    options = (
        "(A) Digestion is inhibited, (B) the pupil would enlarge, (C) the heart would slow down",
        "(A) Digestion is enhanced, (B) the pupil would shrink, (C) the heart would speed up",
    )
    for text in (
        f"RESULT: (B) {options[1]}, since the parasympathetic system dominates",
        "RESULT: (B) (A) Digestion is enhanced, (B) the pupil would shrink...",
    ):
        assert judge("mmlu_pro", text, "B", options) == scoring.Judgement(True, OK, "B"), text


@pytest.mark.parametrize("text", ['RESULT: "Yes"', "RESULT: 'Yes'", "RESULT: Yes!"])
def test_a_literal_target_in_quotes_or_with_an_exclamation_matches(text):
    """_normalise_text strips quotes and a final "." or "!" (decisions L8's QA pass). Mutations:
    the quotes kept; only a final period dropped."""
    assert judge("bbh", text, "Yes").correct
    assert not judge("bbh", text, "No").correct


def test_a_comma_in_a_number_only_as_a_thousands_separator():
    """_as_number: commas "only as thousands separators": "1000,000" (a group of four before the
    comma) is no number. Mutation: any run of digits before the first comma."""
    assert not judge("bbh", "RESULT: 1000,000", "1000000").correct
    assert not scoring.same_answer("bbh", "1000,000", "1000000")
    assert judge("bbh", "RESULT: 1,000,000", "1000000").correct


def test_golds_are_read_past_spaces_and_case():
    """judge reads the gold stripped (a BBH option target with a space around it is still an
    option target, so a bare letter matches it) and an MMLU-Pro gold letter in any case.
    Mutations: the BBH gold not stripped; the MMLU-Pro gold not upper-cased (a lowercase gold
    raised)."""
    assert judge("bbh", "RESULT: B", " (B) ").correct
    assert judge("mmlu_pro", "RESULT: C", "c") == scoring.Judgement(True, OK, "C")


# ----------------------------------------------------------------------------------------------
# MATH: math-verify's gold first, its timeout on the main thread, hedges of three boxes


def test_math_verify_gets_the_gold_first(math_verify):
    """math-verify's `verify(gold, target)` is not symmetric (a relation is compared with a set only
    when the prediction is the set): an interval answer to a gold written as an inequality is right.
    Mutation: the arguments swapped."""
    assert judge("math", "RESULT: (2, \\infty)", "x > 2") == scoring.Judgement(True, OK, "(2, \\infty)")
    assert judge("math", "RESULT: \\boxed{[-2, 7]}", "x \\in [-2,7]").correct  # MATH-500's own gold


def test_math_verify_runs_with_its_timeout_on_the_main_thread(math_verify, monkeypatch):
    """MATH_TIMEOUT_S: "math-verify's own per-call limit (signal based: main thread only)"; only a
    worker thread runs without it. Mutation: no timeout anywhere."""
    limits = []
    verify = math_verify.verify

    def recording(gold, target, *args, timeout_seconds=5, **kwargs):
        limits.append(timeout_seconds)
        return verify(gold, target, *args, timeout_seconds=timeout_seconds, **kwargs)

    monkeypatch.setattr(math_verify, "verify", recording)
    assert judge("math", "RESULT: 0.5", "\\frac{1}{2}").correct
    assert limits == [scoring.MATH_TIMEOUT_S]


def test_a_gold_of_one_option_letter_is_left_to_math_verify(math_verify):
    """_option_letters reads a list of "two or more option letters" as a set; a gold of one letter
    (MATH's "\\text{(C)}") stays math-verify's, which also accepts the letter in lower case.
    Mutation: a single letter read as a one-letter set (then "(c)" named no letter)."""
    assert scoring._option_letters("\\text{(C)}") is None
    assert judge("math", "RESULT: (c)", "\\text{(C)}").correct
    assert not judge("math", "RESULT: (D)", "\\text{(C)}").correct


def test_a_math_hedge_over_three_boxes_is_unparsable_if_any_box_differs(math_verify):
    """A hedge is one answer only when math-verify finds *every* box the same value. Mutation: any
    box equal to the last one made it that value."""
    verdict = judge("math", "RESULT: \\boxed{1} or \\boxed{2} or \\boxed{2}", "2")
    assert (verdict.correct, verdict.status) == (False, UNPARSABLE)


# ----------------------------------------------------------------------------------------------
# Execution replies: the competence line


def test_the_competence_line_is_read_in_any_case_and_after_a_preamble():
    """parse_execution: "yes" | "partial" | "no" from the first COMPETENCE_MATCH line, wherever it
    is and however it is capitalised. Mutations: the match case-sensitive; anchored at the reply's
    start; the value not lower-cased."""
    assert prompts.parse_execution("competence_match: Yes\nRESULT: 1", "bbh").competence == "yes"
    assert prompts.parse_execution("COMPETENCE_MATCH:PARTIAL\nRESULT: 1", "bbh").competence == "partial"
    reply = prompts.parse_execution("Sure, here it is.\nCOMPETENCE_MATCH:no\nRESULT: 1", "bbh")
    assert reply.competence == "no" and reply.answer == "1"


# ----------------------------------------------------------------------------------------------
# Inference replies


def test_inference_reads_ability_names_written_with_spaces_or_hyphens():
    """parse_inference reads "multi-step deduction" as multi_step_deduction (MATH's vocabulary
    has underscores; BBH's, which the other tests use, has none). Mutation: names only stripped
    and case-folded."""
    profile = load_profile("math")
    ids = sorted(profile.abilities.index(name) for name in ("arithmetic", "multi_step_deduction"))
    pair = prompts.parse_inference('{"abilities": ["Multi-step deduction", "arithmetic"]}', profile)
    assert pair == prompts.InferredPair(tuple(ids), profile.pairs.index(frozenset(ids)))


def test_inference_with_three_names_is_garbage():
    """Every task needs "exactly two abilities": a list of three names, even one repeating another
    of a documented pair, names no pair. Mutation: only fewer than two refused."""
    with pytest.raises(ReplyParseError, match="not a list of two"):
        prompts.parse_inference('{"abilities": ["temporal", "linguistic", "temporal"]}', load_profile("bbh"))


# ----------------------------------------------------------------------------------------------
# Review replies: tolerated spellings and the evidence rule


def _review(**fields) -> str:
    reply = json.loads(prompts.review_reply(1.0, "contribute"))
    reply.update(fields)
    return json.dumps(reply)


LOW = {"half_correct": 0.25, "normal_working_score": 0.25, "failure_type": "wrong_half"}


def test_a_review_reads_spelling_variants_of_its_choices():
    """_normalise_choice folds case and reads spaces or hyphens as "_"; a numeric confidence in
    [0, 1] is read as low (< 0.4), medium (< 0.75) or high. Mutations: spaces and hyphens kept; the
    numeric confidence refused; 0.75 read as medium."""
    assert prompts.parse_review(_review(failure_type="Wrong half"), "contribute").failure_type == "wrong_half"
    assert prompts.parse_review(_review(failure_type="over-reach"), "contribute").failure_type == "over_reach"
    confidences = [
        prompts.parse_review(_review(confidence=c), "contribute").confidence for c in (0.3, 0.5, 0.75)
    ]
    assert confidences == ["low", "medium", "high"]


def test_a_review_tolerates_null_texts_and_extra_fields():
    """failure_evidence / one_sentence_reason of null read as "" (not "None"), and a field the
    schema does not name is ignored. Mutations: null read as "None" (which is evidence); extra
    fields refused."""
    verdict = prompts.parse_review(_review(failure_evidence=None, one_sentence_reason=None), "contribute")
    assert (verdict.failure_evidence, verdict.reason, verdict.explanation) == ("", "", "")
    low = prompts.parse_review(
        _review(**LOW, specific_failure_found=True, failure_evidence=None), "contribute"
    )
    assert (low.score, low.adjustment) == (0.5, "unsupported_low_score")
    assert prompts.parse_review(_review(score=0.0, notes="checked twice"), "contribute").score == 1.0


@pytest.mark.parametrize(
    "fields",
    [
        {"specific_failure_found": False, "failure_evidence": "2 + 2 = 5"},  # no failure claimed
        {"specific_failure_found": True, "failure_evidence": "  \n "},  # blank evidence
    ],
    ids=["no_failure_found", "blank_evidence"],
)
def test_a_low_score_needs_a_found_failure_with_evidence(fields):
    """spec/live.md: a score <= 0.40 "requires specific_failure_found=true with non-empty evidence".
    Mutations: specific_failure_found not required; whitespace counted as evidence."""
    verdict = prompts.parse_review(_review(**LOW, **fields), "contribute")
    assert (verdict.score, verdict.adjustment) == (0.5, "unsupported_low_score")


# ----------------------------------------------------------------------------------------------
# The baselines' replies: agent choices and SAC evaluations


def test_an_agent_choice_reads_the_last_json_and_refuses_an_agent_not_offered():
    """parse_choice: the last {"agent": ...} names the agent ("agent 3" as well as 3); one that
    is not among the candidates is garbage, not a reason to read an earlier one; the fallback -1
    leaves the choice to the method's own rule. Mutations: "agent" prefix not removed; an agent not
    offered skipped; another fallback."""
    assert prompts.parse_choice('{"agent": 9} Sorry, I meant {"agent": "agent 3"}', [3, 4]) == 3
    with pytest.raises(ReplyParseError, match="not one of"):
        prompts.parse_choice('{"agent": 3} then {"agent": 9}', [3, 4])
    assert prompts.choice_parser([3, 4]).fallback == -1


def test_an_evaluation_reads_the_last_valid_json_and_falls_back_to_neutral():
    """parse_evaluation takes the last JSON object that validates (scores snapped to the anchors);
    the fallback is the neutral (0.5, 0.5). Mutations: the first object taken; another fallback."""
    text = '{"own_score": 0, "other_score": 0} then {"own_score": 0.9, "other_score": 0.3}'
    assert prompts.parse_evaluation(text) == (1.0, 0.25)
    assert prompts.evaluation_parser().fallback == (0.5, 0.5) == (prompts.NEUTRAL_SCORE,) * 2
