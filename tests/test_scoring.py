"""Answer scoring (meshheal_jax.scoring) on the real benchmark data: gold answers must match
themselves in the forms a model writes them, and near misses must not."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import data, scoring
from meshheal_jax.errors import MeshHealError
from meshheal_jax.scoring import INVALID_OPTION, NO_ANSWER, OK, UNPARSABLE, extract_answer, judge, score

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is absent")


# ----------------------------------------------------------------------------------------------
# Extraction


@pytest.mark.parametrize(
    "dataset, text, expected",
    [
        ("math", "work...\nRESULT: 42", "42"),
        ("math", "RESULT: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("math", "so the total is $\\boxed{\\frac{a}{b+\\{c\\}}}$ indeed", "\\frac{a}{b+\\{c\\}}"),
        ("math", "**RESULT:** \\boxed{7}", "7"),
        ("math", "\\boxed{7} was a first guess.\nRESULT: 8", "8"),  # the later of the two
        ("math", "RESULT: 8\nchecking: \\boxed{9}", "9"),
        ("math", "RESULT:\n\n  12  ", "12"),
        ("math", "The answer is 5", None),  # MATH needs \boxed{} or RESULT:
        ("math", "", None),
        ("bbh", "Step 1...\nSo the answer is (C).", "(C)"),
        ("bbh", "Result: No", "No"),
        ("mmlu_pro", "... the answer is (J)", "(J)"),
        ("mmlu_pro", "RESULT: The answer is C", "C"),
    ],
)
def test_extract_answer(dataset, text, expected):
    assert extract_answer(dataset, text) == expected


def test_unknown_dataset_and_bad_gold():
    with pytest.raises(MeshHealError, match="cannot score dataset 'gsm8k'"):
        score("gsm8k", "RESULT: 1", "1")
    with pytest.raises(MeshHealError, match="empty gold"):
        score("bbh", "RESULT: 1", " ")
    with pytest.raises(MeshHealError, match="MMLU-Pro gold answer must be a letter A-J, got 'K'"):
        score("mmlu_pro", "RESULT: K", "K")


# ----------------------------------------------------------------------------------------------
# MATH: math-verify equivalence


def _model_forms(gold: str) -> list[str]:
    return [f"Reasoning.\nRESULT: {gold}", f"Therefore the answer is $\\boxed{{{gold}}}$."]


@needs_shared
def test_every_math500_gold_matches_itself_boxed_and_as_result(math_verify):
    records = data.load_local("math", SHARED_DATA / "math" / "math500_test.jsonl")
    assert len(records) == 500
    failures = []
    for rec in records:
        for text in _model_forms(rec.gold):
            verdict = judge("math", text, rec.gold)
            if not (verdict.correct and verdict.status == OK):
                failures.append((rec.uid, text, verdict))
    assert not failures, failures[:5]


@needs_shared
def test_math500_integer_golds_reject_off_by_one_and_sign_flips(math_verify):
    records = data.load_local("math", SHARED_DATA / "math" / "math500_test.jsonl")
    integers = [int(r.gold) for r in records if re.fullmatch(r"-?\d+", r.gold)]
    assert len(integers) > 200
    accepted = []
    for value in integers:
        misses = [value + 1, value - 1] + ([-value] if value else [])
        for miss in misses:
            if score("math", f"RESULT: {miss}", str(value)):
                accepted.append((value, miss))
    assert not accepted, accepted[:5]


@pytest.mark.parametrize(
    "gold, prediction",
    [
        ("\\frac{1}{2}", "RESULT: 1/2"),
        ("\\frac{1}{2}", "RESULT: 0.5"),
        ("\\frac{1}{2}", "$\\boxed{\\dfrac12}$"),
        ("\\frac{\\sqrt{2}}{2}", "RESULT: sqrt(2)/2"),
        ("\\frac{\\sqrt{2}}{2}", "RESULT: \\frac{1}{\\sqrt{2}}"),
        ("5", "RESULT: x = 5"),
        ("5", "RESULT: $5$ dollars"),  # inline math among words
        ("\\frac{1}{2}", "RESULT: the probability is $\\frac{1}{2}$"),
        ("2,\\!016", "RESULT: 2016"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "RESULT: (3, \\pi/2)"),
        ("\\text{(C)}", "RESULT: \\text{(C)}"),
        ("-2,1", "\\boxed{1, -2}"),
        # MATH golds math-verify misread before decisions L8's rewrite (Counting & Probability idx
        # 1598, Geometry 1714, Intermediate Algebra 2269): as text, as 2, as 1/5
        ("\\frac{12}{5,\\!525}", "RESULT: \\frac{12}{5,\\!525}"),
        ("\\frac{12}{5,\\!525}", "RESULT: \\frac{12}{5525}"),
        ("\\frac \\pi4 + 2 - \\sqrt2", "RESULT: \\boxed{\\frac{\\pi}{4}+2-\\sqrt{2}}"),
        ("\\frac{7}{5} + \\frac{1}{5} i.", "RESULT: \\frac{7}{5}+\\frac{1}{5}i"),
        ("\\frac 54", "RESULT: 5/4"),
        ("\\frac9{5}", "RESULT: 1.8"),
        # golds naming options (six of MATH's 5,000 test problems), in the forms a model writes them
        ("\\text{A,D}", "\\boxed{A, D}"),
        ("\\text{A,D}", "RESULT: D, A"),
        ("\\text{B, E, G}", "\\boxed{\\text{B,E,G}}"),
        ("B, C", "\\boxed{\\text{B, C}}"),
        ("B, C", "RESULT: (B), (C)"),
    ],
)
def test_math_equivalent_forms_are_accepted(math_verify, gold, prediction):
    assert score("math", prediction, gold), judge("math", prediction, gold)


@pytest.mark.parametrize(
    "gold, prediction",
    [
        ("\\frac{1}{2}", "RESULT: 1/3"),
        ("\\frac{1}{2}", "RESULT: -\\frac{1}{2}"),
        ("\\frac{1}{2}", "RESULT: 2"),
        ("-3", "RESULT: 3"),
        ("15", "\\boxed{16}"),
        ("15", "\\boxed{14}"),
        ("2 \\sqrt{5}", "RESULT: \\sqrt{5}"),
        ("6+9i", "RESULT: 6-9i"),
        ("(2,12) \\cup (12,102)", "RESULT: (2,102)"),
        (
            "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
            "RESULT: \\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
        ),
        ("\\text{(C)}", "RESULT: \\text{(D)}"),
        ("5", "RESULT: $6$ dollars"),
        ("2", "RESULT: $1$ or $2$"),  # a hedge: no one answer
        ("4", "RESULT: $3$ apples, not $4$"),
        ("\\frac{12}{5,\\!525}", "RESULT: \\frac{12}{5,\\!526}"),
        ("\\frac \\pi4 + 2 - \\sqrt2", "RESULT: \\boxed{2}"),
        ("\\frac{7}{5} + \\frac{1}{5} i.", "RESULT: \\boxed{1/5}"),
        ("\\text{A,D}", "\\boxed{A}"),
        ("\\text{A,D}", "\\boxed{A, D, E}"),
        ("B, C", "RESULT: B and C"),
    ],
)
def test_math_near_misses_are_rejected(math_verify, gold, prediction):
    verdict = judge("math", prediction, gold)
    assert not verdict.correct and verdict.status == OK


def test_math_missing_or_unparsable_answer_is_incorrect(math_verify):
    assert judge("math", "I think it is 5.", "5") == scoring.Judgement(False, NO_ANSWER, None)
    assert judge("math", None, "5").status == NO_ANSWER
    verdict = judge("math", "RESULT: ???", "5")
    assert verdict == scoring.Judgement(False, UNPARSABLE, "???")


def test_math_scoring_works_off_the_main_thread(math_verify):
    # math-verify's timeouts use signal.alarm (main thread only); worker threads run without them
    results = []
    worker = threading.Thread(target=lambda: results.append(score("math", "RESULT: 1/2", "\\frac{1}{2}")))
    worker.start()
    worker.join()
    assert results == [True]


def test_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(MeshHealError, match=r"math-verify.*pip install -e \.\[live\]"):
        score("math", "RESULT: 1", "1")


def test_math_sample_golds_match(math_verify):
    for rec in data.load_sample("math") + data.load_local(
        "math", data.SAMPLE_DIR / "math" / "math500_sample.jsonl"
    ):
        assert score("math", f"RESULT: {rec.gold}", rec.gold), rec.uid


# ----------------------------------------------------------------------------------------------
# BBH: normalised exact match


def _bbh_targets() -> dict[str, list[str]]:
    folder = SHARED_DATA / "bbh" / "bbh" if SHARED_DATA.is_dir() else data.SAMPLE_DIR / "bbh" / "bbh"
    return {
        path.stem: sorted({e["target"] for e in json.loads(path.read_text())["examples"]})
        for path in sorted(folder.glob("*.json"))
    }


def _bbh_forms(target: str) -> list[str]:
    forms = [
        f"Let me think.\nRESULT: {target}",
        f"RESULT: **{target}**",
        f"result: {target}.",
        f"Step by step... So the answer is {target}.",
    ]
    if "{" not in target and "}" not in target:
        forms.append(f"\\boxed{{{target}}}")
    if target.startswith("("):
        letter = target[1]
        forms += [
            f"RESULT: {letter}",
            f"RESULT: {letter}) because",
            f"RESULT: Option {letter}",
            f"RESULT: [{letter}]",
        ]
    return forms


def test_bbh_targets_match_themselves_and_not_each_other():
    targets = _bbh_targets()
    assert len(targets) == (27 if SHARED_DATA.is_dir() else 7)
    checked = 0
    for task, values in targets.items():
        for i, target in enumerate(values):
            for text in _bbh_forms(target):
                assert score("bbh", text, target), (task, text, judge("bbh", text, target))
                checked += 1
            if len(values) > 1:
                other = values[(i + 1) % len(values)]
                assert not score("bbh", f"RESULT: {other}", target), (task, other, target)
    assert checked > 100


def test_bbh_records_accept_the_gold_option_text():
    records = data.load_local("bbh", SHARED_DATA) if SHARED_DATA.is_dir() else data.load_sample("bbh")
    lettered = [r for r in records if r.options is not None and r.gold.startswith("(")]
    assert len(lettered) > 20
    for rec in lettered:
        index = ord(rec.gold[1]) - ord("A")
        text = rec.options[index]
        if sum(o.casefold() == text.casefold() for o in rec.options) == 1:
            assert score("bbh", f"RESULT: {text}", rec.gold, rec.options), rec.uid
            assert score("bbh", f"RESULT: {rec.gold} {text}", rec.gold, rec.options), rec.uid
        wrong = (index + 1) % len(rec.options)
        assert not score("bbh", f"RESULT: {rec.options[wrong]}", rec.gold, rec.options), rec.uid


@pytest.mark.parametrize(
    "text, gold, options, expected",
    [
        ("RESULT: (B)", "(A)", None, (False, OK)),
        ("RESULT: Brown", "(B)", None, (False, UNPARSABLE)),  # a word starting with B is no letter
        ("RESULT: a cat", "(A)", None, (False, UNPARSABLE)),
        ("RESULT: (F)", "(A)", ("x", "y"), (False, INVALID_OPTION)),
        ("RESULT: 15.0", "15", None, (True, OK)),
        ("RESULT: fifteen", "15", None, (False, OK)),
        ("RESULT: 1_5", "15", None, (False, OK)),  # float() would read it as 15
        ("RESULT: 1,5", "15", None, (False, OK)),  # a comma only as a thousands separator
        ("RESULT: 1,000", "1000", None, (True, OK)),
        ("RESULT: Yes, he returns", "Yes", None, (False, OK)),
        ("RESULT:  ] )  } ", "] ) }", None, (True, OK)),
        ("no final answer", "Yes", None, (False, NO_ANSWER)),
    ],
)
def test_bbh_edge_cases(text, gold, options, expected):
    verdict = judge("bbh", text, gold, options)
    assert (verdict.correct, verdict.status) == expected


# ----------------------------------------------------------------------------------------------
# MMLU-Pro: letters


def _mmlu_records():
    if SHARED_DATA.is_dir():
        return data.load_local("mmlu_pro", SHARED_DATA)
    return data.load_sample("mmlu_pro")


def test_mmlu_pro_letters_on_real_questions():
    records = _mmlu_records()
    for rec in records:
        letter = rec.gold
        for text in (
            f"RESULT: {letter}",
            f"The answer is ({letter}).",
            f"RESULT: ({letter}) {rec.options[ord(letter) - 65]}",
        ):
            assert score("mmlu_pro", text, rec.gold, rec.options), (rec.uid, text)
        wrong = data.MMLU_PRO_LETTERS[(ord(letter) - 65 + 1) % len(rec.options)]
        assert not score("mmlu_pro", f"RESULT: {wrong}", rec.gold, rec.options)
        if len(rec.options) < 10:
            beyond = data.MMLU_PRO_LETTERS[len(rec.options)]
            assert judge("mmlu_pro", f"RESULT: {beyond}", rec.gold, rec.options).status == INVALID_OPTION


def test_mmlu_pro_quoting_an_option_reads_as_that_option():
    # Option texts like "H. Ross Perot, Reform Party, 1996" (qid 4746, option C) start like a
    # letter; quoted in full they must read as their own option, and so must one-letter texts
    # outside A-J ("S", qid 2857's S phase), and so must texts starting "The answer" (qids 1841,
    # 8341), which the answer-prefix rule shortens. A bare letter of A-J stays a letter: left out.
    quoted = single = 0
    for rec in _mmlu_records():
        texts = [scoring._normalise_text(o) for o in rec.options]
        for i, option in enumerate(rec.options):
            bare = re.fullmatch(r"[(\[]?([A-Za-z])[)\]]?[.:]?", scoring._strip_wrappers(option))
            if (
                texts.count(texts[i]) > 1
                or "\n" in option
                or (bare and bare.group(1).upper() in "ABCDEFGHIJ")
            ):
                continue
            verdict = judge("mmlu_pro", f"RESULT: {option}", rec.gold, rec.options)
            assert verdict.answer == "ABCDEFGHIJ"[i], (rec.uid, option, verdict)
            quoted += 1
            single += bool(bare)
    assert quoted > (5_000 if SHARED_DATA.is_dir() else 200)  # the shipped sample is smaller
    assert single >= (10 if SHARED_DATA.is_dir() else 0)


def test_an_option_starting_the_answer_is_read_when_quoted():
    """An option whose text starts "The answer ..." (options modelled on MMLU-Pro qid 8341's) reads
    as itself when a reply quotes it, though extract_answer takes those words as the answer prefix;
    an exact option text still wins over one past the prefix, and two options equal past it name
    no letter."""
    options = (
        "The jury pool is 10% women.",
        "The answer cannot be determined without knowing the size of the jury pool.",
        "The jury pool is biased.",
        "The answer cannot be determined without knowing the percentage of men in the jury pool.",
        "Nothing can be said.",
        "The answer can be determined without knowing the size of the jury pool.",
    )
    for i in (1, 3, 5):
        verdict = judge("mmlu_pro", f"RESULT: {options[i]}", "B", options)
        assert verdict.status == OK and verdict.answer == "ABCDEF"[i]
    assert judge(
        "mmlu_pro",
        "RESULT: **The answer cannot be determined without knowing the size of the jury pool**",
        "B",
        options,
    ).correct
    assert scoring.option_letter("5", ("The answer is 5", "5")) == "B"
    assert scoring.option_letter("7", ("The answer is 5", "5")) is None
    assert scoring.option_letter("5", ("The answer is 5", "Answer: 5", "6")) is None


def test_a_one_letter_option_outside_the_letters_is_read_as_its_text():
    options = ("G1 phase", "G2 phase", "M phase", "S")  # "S" (phase) is no letter of A-D
    assert scoring.option_letter("S", options, letters="ABCD") == "D"
    assert (
        scoring.option_letter("B", ("x", "y", "B"), letters="ABC") == "B"
    )  # a letter of the question stays one
    assert judge("mmlu_pro", "RESULT: s", "D", options).correct


def test_mmlu_pro_option_text_and_unparsable():
    rec = next(r for r in data.load_sample("mmlu_pro") if r.uid == "qid:3983")
    assert rec.gold == "C" and rec.options[2] == "N—H"
    assert score("mmlu_pro", "RESULT: N—H", rec.gold, rec.options)
    assert not score("mmlu_pro", "RESULT: P—Cl", rec.gold, rec.options)
    assert judge("mmlu_pro", "RESULT: none of them", rec.gold, rec.options).status == UNPARSABLE
    assert judge("mmlu_pro", "I am not sure.", rec.gold, rec.options).status == NO_ANSWER
    assert judge("mmlu_pro", "RESULT: c", "C").correct  # no options given: letters A-J


# ----------------------------------------------------------------------------------------------
# Hedges: an answer naming two options or boxing two values names no one answer (decisions L8)

TEN_OPTIONS = tuple(f"option text {i}" for i in range(10))


@pytest.mark.parametrize(
    "text",
    [
        "RESULT: (B) or (C)",
        "RESULT: (B)/(C)",
        "RESULT: B) or C)",
        "RESULT: B. Or C.",
        "RESULT: (B), (C), (D)",
        "The answer is (B) or (C).",
        "RESULT: (B) (C) (D) (E) (F) (G) (H) (I) (J) (A)",
        "RESULT: (b) or (c)",
        "RESULT: \\boxed{B} or \\boxed{C}",
    ],
)
def test_a_hedge_over_options_is_unparsable(text):
    for gold in ("B", "C"):
        verdict = judge("mmlu_pro", text, gold, TEN_OPTIONS)
        assert (verdict.correct, verdict.status) == (False, UNPARSABLE), (text, gold, verdict)


@pytest.mark.parametrize(
    "text",
    [
        "RESULT: (B)",
        "RESULT: (B) option text 1",  # the letter and its own option's text
        "RESULT: (B) or (B)",  # one letter twice
        "RESULT: (B) or (c)",  # a lowercase letter after an uppercase one: a sub-point, not an option
        "RESULT: B. Vitamin C.",
        "RESULT: B) and C is wrong",
        "RESULT: (B). (A) was tempting but wrong",  # a sentence after the answer, not a second option
        "RESULT: 'B'",  # quoted, bold, an exclamation (the QA pass of decisions L8)
        "RESULT: \\textbf{B}",
        "RESULT: B!",
    ],
)
def test_one_option_with_words_after_it_is_that_option(text):
    assert judge("mmlu_pro", text, "B", TEN_OPTIONS) == scoring.Judgement(True, OK, "B")


def test_an_option_listing_lettered_sub_points_is_not_a_hedge():
    """MMLU-Pro qid 2374's options read "(a) Digestion ..., (b) ..., (c) ...": quoted after its
    letter, even with the sub-points' letters in capitals, it is that option."""
    options = (
        "(A) Digestion is inhibited, (B) the pupil would enlarge",
        "(A) Digestion is enhanced, (B) it would not",
    )
    assert judge("mmlu_pro", f"RESULT: (B) {options[1]}", "B", options).correct
    assert judge("mmlu_pro", f"RESULT: (A) {options[0]}", "A", options).correct


def test_a_bbh_hedge_over_options_is_unparsable():
    verdict = judge("bbh", "RESULT: (B), (C)", "(B)", ("red", "blue", "green"))
    assert (verdict.correct, verdict.status) == (False, UNPARSABLE)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("RESULT: \\boxed{1} or \\boxed{2}", "\\boxed{1} or \\boxed{2}"),
        ("so \\boxed{1}, \\boxed{2}", "so \\boxed{1}, \\boxed{2}"),
        ("RESULT:\n\\boxed{1} or \\boxed{2}", "\\boxed{1} or \\boxed{2}"),
        ("first \\boxed{1}\nthen \\boxed{2}", "2"),  # a later line's box is the answer
        ("\\boxed{2}, that is \\boxed{2}", "2"),  # the same value twice
        ("\\boxed{\\frac{25}{13}} = \\boxed{1\\frac{12}{13}}", "1\\frac{12}{13}"),  # one value restated
        ("$a=\\boxed{3}$, so $2a=\\boxed{6}$.", "6"),  # a chain of steps: the last is the answer
        ("\\boxed{\\frac12}, i.e. \\boxed{0.5}", "0.5"),
        ("RESULT: \\boxed{1}/\\boxed{2}", "\\boxed{1}/\\boxed{2}"),
    ],
)
def test_a_line_boxing_two_values_is_extracted_whole(text, expected):
    assert extract_answer("math", text) == expected


def test_a_math_hedge_is_unparsable_whichever_value_is_gold(math_verify):
    for gold in ("1", "2"):
        verdict = judge("math", "RESULT: \\boxed{1} or \\boxed{2}", gold)
        assert (verdict.correct, verdict.status) == (False, UNPARSABLE)
    # one value boxed twice (MATH's own solutions do: idx 3628, 4258) is that value
    assert judge("math", "This yields $\\boxed{x+11}$ or $\\boxed{11+x}$.", "11+x") == scoring.Judgement(
        True, OK, "11+x"
    )


@pytest.mark.parametrize("text", ["RESULT: 12 (or 10)", "RESULT: $12$ (or $10$)", "RESULT: 12 (Or possibly 10)",
                                  "RESULT: x = 12 (or x = 10)", "RESULT: 12 (or 12.0) (or 10)"])  # fmt: skip
def test_a_math_answer_offering_another_value_in_brackets_is_a_hedge(math_verify, text):
    """decisions L8: "12 (or 10)" names no one answer, whichever value is gold; math-verify alone
    read it as 10 (its "or" a comma, its last value kept)."""
    for gold in ("10", "12"):
        verdict = judge("math", text, gold)
        assert (verdict.correct, verdict.status) == (False, UNPARSABLE)
    assert not scoring.same_answer("math", text.removeprefix("RESULT: "), "10")


@pytest.mark.parametrize(
    "text, right, wrong",
    [
        ("RESULT: 0.5 (or \\frac{1}{2})", "\\frac12", "0.4"),  # an alternative of the same value
        ("RESULT: 12 (i.e. 10)", "12", "10"),  # a restatement: the answer is what comes before it
        ("RESULT: 12 (e.g. 10)", "12", "10"),
        ("RESULT: \\frac{1}{3} (approximately 0.333)", "\\frac13", "0.333"),
        ("RESULT: 12 (which is 10)", "12", "10"),
        ("RESULT: 2 (3+4)", "14", "2"),  # brackets that are mathematics stay so
        ("RESULT: (2, 3)", "(2,3)", "3"),
    ],
)
def test_a_remark_in_brackets_after_a_math_answer_is_not_the_answer(math_verify, text, right, wrong):
    assert judge("math", text, right).correct
    assert not judge("math", text, wrong).correct


# ----------------------------------------------------------------------------------------------
# _strip_wrappers removes a run of nested pairs at once: the same result as one pair per pass


def _strip_wrappers_one_pair_per_pass(answer: str) -> str:
    """The rule as first written (one pair per pass, quadratic in a long run): the oracle."""
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().strip(scoring._MARKUP).strip()
        if answer.endswith(".") and not answer.endswith(".."):
            answer = answer[:-1].rstrip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
                answer = answer[len(left) : len(answer) - len(right)]
                break
        if answer.endswith("$") and answer.count("$") == 1:
            answer = answer[:-1]
        if answer.startswith("$") and answer.count("$") == 1:
            answer = answer[1:]
    return answer.strip()


@settings(max_examples=2_000, deadline=None)
@given(
    st.lists(st.sampled_from(["$", "$$", "\\(", "\\)", "\\[", "\\]", "x", " ", ".", "*", "\n"]), max_size=12)
)
def test_strip_wrappers_equals_one_pair_per_pass(pieces):
    text = "".join(pieces)
    assert scoring._strip_wrappers(text) == _strip_wrappers_one_pair_per_pass(text)


def test_strip_wrappers_removes_a_long_run_of_dollars():
    assert scoring._strip_wrappers("$" * 20_000 + "5" + "$" * 20_000) == "5"
    assert extract_answer("bbh", "RESULT: " + "$" * 20_000) is None
