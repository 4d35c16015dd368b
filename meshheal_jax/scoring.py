"""Scoring a model's final answer against the benchmark's gold (spec/live.md "Scoring").

- BBH: exact match after normalisation; an option target "(B)" also accepts "B", "B)", "(B) text"
  and the option's own text; literal targets ("Yes", "True", "15", "] ) }") match case-
  insensitively with each run of spaces read as one, numbers also numerically ("1,000" = 1000).
- MATH: mathematical equivalence (the `math-verify` library, optional: `pip install -e .[live]`)
  of the last `\\boxed{...}` / `RESULT:` answer with the gold answer; a gold that lists option
  letters ("\\text{A,D}") against the letters written, in any order.
- MMLU-Pro: the chosen letter (A-J) against the gold letter; an answer quoting one option's full
  text is that option's letter.
- A missing or unparsable answer is incorrect; `judge` says which (`Judgement.status`). A hedge
  ("(B) or (C)", "\\boxed{1} or \\boxed{2}") is unparsable (docs/decisions.md L8).

The answer is taken from the text's last `RESULT:` line or last `\\boxed{...}`, whichever comes
later; BBH and MMLU-Pro fall back to the benchmarks' own "the answer is X" convention.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import threading

from meshheal_jax.data import MMLU_PRO_LETTERS, boxed_spans, last_boxed_span
from meshheal_jax.errors import MeshHealError

SCORED_DATASETS = ("bbh", "math", "mmlu_pro")

# Judgement.status values
OK = "ok"  # an answer was found and compared (correct or not)
NO_ANSWER = "no_answer"  # no RESULT:, \boxed{} or "answer is" in the text
UNPARSABLE = "unparsable"  # an answer was found but is not of the gold's kind (no letter, no expression)
INVALID_OPTION = "invalid_option"  # a letter outside the question's options
STATUSES = (OK, NO_ANSWER, UNPARSABLE, INVALID_OPTION)

MATH_TIMEOUT_S = 5  # math-verify's own per-call limit (signal based: main thread only)


@dataclasses.dataclass(frozen=True)
class Judgement:
    correct: bool
    status: str  # one of STATUSES; correct implies OK
    answer: str | None  # the extracted answer (for BBH / MMLU-Pro options: the letter, e.g. "B")


def _check_dataset(dataset: str) -> None:
    if dataset not in SCORED_DATASETS:
        raise MeshHealError(f"cannot score dataset {dataset!r}; known: {list(SCORED_DATASETS)}")


# ---------------------------------------------------------------------------------------------
# Answer extraction

_RESULT_ANYWHERE = re.compile(r"RESULT\s*:")
_RESULT_LINE_START = re.compile(r"(?im)^[ \t*_#>`-]*result\s*:")
_ANSWER_IS = re.compile(r"(?i)\banswer\s+is\s*:?\s*")
_ANSWER_PREFIX = re.compile(r"(?i)^(?:the\s+)?(?:final\s+)?answer\b\s*(?:is\b\s*)?[:=]?\s*")
_MARKUP = " \t\r\n*_`"


def _result_span(text: str) -> tuple[int, str] | None:
    """(position, content) of the last RESULT: line; content continues on the next line if empty."""
    last = None
    for pattern in (_RESULT_ANYWHERE, _RESULT_LINE_START):
        for match in pattern.finditer(text):
            if last is None or match.start() > last.start():
                last = match
    if last is None:
        return None
    rest = text[last.end() :]
    line, _, after = rest.partition("\n")
    if not line.strip(_MARKUP):
        line = next((candidate for candidate in after.split("\n") if candidate.strip(_MARKUP)), "")
    return last.start(), line


def _repeats(text: str, token: str, at_end: bool = False) -> int:
    """How many times `token` repeats at the start (or end) of text."""
    count, size = 0, len(token)
    if at_end:
        while text.endswith(token, 0, len(text) - count * size):
            count += 1
    else:
        while text.startswith(token, count * size):
            count += 1
    return count


def _strip_wrappers(answer: str) -> str:
    """Remove markup around an answer: spaces, markdown, $..$, \\(..\\), \\[..\\], a final period.

    A run of nested pairs of one kind ("$$x$$", "\\(\\(x\\)\\)") is removed at once, so the time is
    linear in the length of the run; pairs of alternating kinds ("$\\(...\\)$") still take one pass
    each."""
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().strip(_MARKUP).strip()
        if answer.endswith(".") and not answer.endswith(".."):  # a final period, not an ellipsis
            answer = answer[:-1].rstrip()
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            pairs = min(_repeats(answer, left), _repeats(answer, right, at_end=True),
                        len(answer) // (len(left) + len(right)))  # fmt: skip
            if pairs:
                answer = answer[pairs * len(left) : len(answer) - pairs * len(right)]
                break
        if answer.endswith("$") and answer.count("$") == 1:
            answer = answer[:-1]
        if answer.startswith("$") and answer.count("$") == 1:
            answer = answer[1:]
    return answer.strip()


def extract_answer(dataset: str, text: str | None) -> str | None:
    """The final answer written in a model's text, or None when it states none.

    The last `RESULT:` line or the last `\\boxed{...}`, whichever comes later (a boxed inside a
    RESULT line gives its content); for BBH and MMLU-Pro, failing both, the text after the
    last "answer is" (the benchmarks' own chain-of-thought convention). Markup around the
    answer ($..$, **..**, a final period) is removed.
    """
    _check_dataset(dataset)
    if not text:
        return None
    result, boxed_span = _result_span(text), last_boxed_span(text)
    if boxed_span is not None and (result is None or boxed_span[0] > result[0]):
        start, end = text.rfind("\n", 0, boxed_span[0]) + 1, text.find("\n", boxed_span[0])
        line = text[start : end if end >= 0 else len(text)]  # the line of the last \boxed{}
        if result is not None and result[0] >= start:  # a RESULT: line whose answer is boxed
            line = result[1]
        answer = line if _hedged(line) else boxed_span[1]
    elif result is not None:  # its line holds no box: one there would come after the RESULT
        answer = result[1]
    elif dataset != "math":
        matches = list(_ANSWER_IS.finditer(text))
        if not matches:
            return None
        answer = text[matches[-1].end() :].split("\n", 1)[0]
    else:
        return None
    answer = _strip_wrappers(_drop_answer_prefix(answer))
    return answer or None


_HEDGE_JOINS = ("", ",", "/", ";", "or", ",or")  # between two boxes, spaces and $ left out


def _hedged(line: str) -> bool:
    """Whether a line boxes two different answers joined as alternatives ("\\boxed{1} or
    \\boxed{2}", "\\boxed{1}, \\boxed{2}"): a hedge, which extract_answer returns whole and the
    judges read as no one answer. Boxes joined by anything else ("\\boxed{1/2} = \\boxed{0.5}",
    "$a=\\boxed{3}$, so $2a=\\boxed{6}$") are a chain of steps: the last is the answer."""
    boxes = boxed_spans(line)
    for (_, end, first), (start, _, second) in itertools.pairwise(boxes):
        join = re.sub(r"[\s$]", "", line[end:start]).casefold()
        if first != second and join in _HEDGE_JOINS:
            return True
    return False


def _drop_answer_prefix(text: str) -> str:
    """`text` without markup and a leading "The (final) answer (is):" (extract_answer's rule)."""
    return _ANSWER_PREFIX.sub("", _strip_wrappers(text), count=1)


# ---------------------------------------------------------------------------------------------
# Option letters (BBH options, MMLU-Pro)

_LETTER_PREFIX = re.compile(
    r"(?i)^(?:the\s+)?(?:final\s+|correct\s+)?(?:answer|option|choice)\s*(?:is)?\s*[:\-]?\s*"
)
_LETTER_PAREN = re.compile(r"^[(\[]([A-Za-z])[)\]]")
_LETTER_BARE = re.compile(r"^([A-Za-z])(?:[).:!]|$)")
# after a letter: another one, in brackets ("(B) or (C)", "(B)/(C)", "(B), (C)", "(B) (C)") or
# bare after a connective ("B) or C)", "B. Or C.")
_ANOTHER_LETTER = re.compile(
    r"(?i)^\s*(?:(?:or|and|/|,|;|&)\s*)?[(\[]([A-Za-z])[)\]]|^[\s.,;:]*(?:or|and|/|,|;|&)\s*([A-Za-z])(?:[).:]|\s*$)"
)


def _names_another(written: str, rest: str, options: tuple[str, ...] | None, letters: str) -> bool:
    """Whether `rest`, the text after the letter `written`, names another option letter of the same
    case ("(B) or (C)"), unless it is the named option's own text ("(E) (a) Digestion ...": an
    option that lists sub-points)."""
    another = _ANOTHER_LETTER.match(rest)
    if another is None:
        return False
    other = another.group(1) or another.group(2)
    if other.upper() == written.upper() or other.isupper() != written.isupper():
        return False
    index = letters.index(written.upper())
    own_text = options[index] if options and index < len(options) else None
    # its own text, or the start of it (a reply may cut a long option short)
    return own_text is None or not _normalise_text(rest).startswith(_normalise_text(own_text)[:40])


_QUOTES = "\"'“”‘’"
_TEXT_COMMANDS = r"\\(?:text|textbf|mathrm|mathbf)"  # LaTeX's text wrappers around an answer


def _normalise_text(text: str) -> str:
    text = _strip_wrappers(text)
    text = text.strip(_QUOTES).strip()
    text = re.sub(r"\s+", " ", text)
    return text.rstrip(".!").strip().casefold()


def _past_answer_prefix(text: str) -> str:
    """An option's text as extract_answer leaves it when a reply quotes it: an option that starts
    "The answer ..." (MMLU-Pro qids 1841, 8341) loses those words to the answer prefix."""
    return _normalise_text(_drop_answer_prefix(text))


_LETTER_ONLY = re.compile(r"^[(\[]?([A-Za-z])[)\]]?[.:]?$")


def option_letter(
    answer: str, options: tuple[str, ...] | None = None, letters: str = MMLU_PRO_LETTERS
) -> str | None:
    """The option letter an answer names ("(B)", "B", "B)", "B. text", "Option B", "\\text{(B)}"),
    or the letter of the one option whose text it equals; None otherwise.

    An answer that quotes an option's text in full reads as that option even where the text
    starts like a letter ("H. Ross Perot, 1996" is option C's text, not option H), and where it
    starts "The answer ..." (equal to no option once extract_answer took those words, it is
    compared again with every option past that prefix); a bare letter
    ("B", "(B)", "B.") of `letters` is always a letter, and one outside them ("S", an option's
    text for the S phase) can only be an option's text.
    """
    candidate = _strip_wrappers(answer)
    candidate = re.sub(rf"^{_TEXT_COMMANDS}\{{(.*)\}}$", r"\1", candidate).strip()
    candidate = candidate.strip(_QUOTES).strip()
    bare = _LETTER_ONLY.match(candidate)
    if options and not (bare and bare.group(1).upper() in letters):
        for key in (_normalise_text, _past_answer_prefix):
            wanted = key(answer)
            hits = [i for i, option in enumerate(options) if key(option) == wanted]
            if hits:
                break
        if len(hits) == 1 and hits[0] < len(letters):
            return letters[hits[0]]
    candidate = _LETTER_PREFIX.sub("", candidate, count=1).strip()
    for pattern in (_LETTER_PAREN, _LETTER_BARE):
        match = pattern.match(candidate)
        if match and match.group(1).upper() in letters:
            letter = match.group(1).upper()
            if _names_another(match.group(1), candidate[match.end() :], options, letters):
                return None  # a hedge over two options names no one option
            return letter
    return None


# ---------------------------------------------------------------------------------------------
# Per-dataset judges

_BBH_OPTION_TARGET = re.compile(r"^\(([A-Z])\)$")


_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _as_number(text: str) -> float | None:
    """A number as written: "15", "-2.5", "1e3"; commas only as thousands separators ("1,000"),
    so "1,5" is no number; float()'s underscores ("1_5") neither."""
    if "_" in text or ("," in text and not _THOUSANDS.fullmatch(text)):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _judge_bbh(text: str | None, gold: str, options: tuple[str, ...] | None) -> Judgement:
    answer = extract_answer("bbh", text)
    if answer is None:
        return Judgement(False, NO_ANSWER, None)
    target = gold.strip()
    option_target = _BBH_OPTION_TARGET.match(target)
    if option_target:
        letter = option_letter(answer, options, letters="ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        if letter is None:
            return Judgement(False, UNPARSABLE, answer)
        if options is not None and ord(letter) - ord("A") >= len(options):
            return Judgement(False, INVALID_OPTION, letter)
        return Judgement(letter == option_target.group(1), OK, letter)
    predicted, wanted = _normalise_text(answer), _normalise_text(target)
    if predicted == wanted:
        return Judgement(True, OK, answer)
    a, b = _as_number(predicted), _as_number(wanted)
    return Judgement(a is not None and b is not None and a == b, OK, answer)


def _judge_mmlu_pro(text: str | None, gold: str, options: tuple[str, ...] | None) -> Judgement:
    gold_letter = gold.strip().upper()
    if len(gold_letter) != 1 or gold_letter not in MMLU_PRO_LETTERS:
        raise MeshHealError(f"MMLU-Pro gold answer must be a letter A-J, got {gold!r}")
    answer = extract_answer("mmlu_pro", text)
    if answer is None:
        return Judgement(False, NO_ANSWER, None)
    letter = option_letter(answer, options)
    if letter is None:
        return Judgement(False, UNPARSABLE, answer)
    if options is not None and MMLU_PRO_LETTERS.index(letter) >= len(options):
        return Judgement(False, INVALID_OPTION, letter)
    return Judgement(letter == gold_letter, OK, letter)


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise MeshHealError(
            "scoring MATH answers needs the optional 'math-verify' package: pip install -e .[live]"
            "  (or pip install math-verify)"
        ) from None
    return math_verify


def _timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which only works in the main thread; elsewhere
    # (a worker thread of the live backend) it must run without one.
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


# a parenthetical remark closing a MATH answer: an alternative ("12 (or 10)") or a restatement
# ("\\frac12 (i.e. 0.5)", "\\frac13 (approximately 0.333)"); math-verify reads such text as the
# remark's last value (or as a product of the remark's letters)
_REMARK = re.compile(
    r"(?is)^(?P<answer>.*?\S)\s*\(\s*(?P<word>or|i\.\s*e\.?|e\.\s*g\.?|that is|which is|approx(?:imately|\.)?|about"
    r"|roughly|≈)(?![a-z])[\s,:]*(?P<remark>[^()]*?)\s*\)$"
)


def _parse_math(expression: str) -> list:
    """math-verify's parse of one answer expression (given without \\boxed), [] if unparsable. An
    expression with one inline math span among words ("$5$ dollars") is read by that span first:
    wrapped in \\boxed, the words would become symbols. Several spans ("$1$ or $2$", which reaches
    here as "1$ or $2") are not read so: taking one would credit a hedge. A remark in brackets
    closing the expression is not read (decisions L8): the expression is what comes before it, and
    an alternative naming another value ("12 (or 10)", a hedge like "\\boxed{12} or \\boxed{10}")
    is unparsable; one naming the same value ("0.5 (or \\frac12)") is not."""
    remark = _REMARK.match(expression.strip())
    if remark is not None:
        before, after = _strip_wrappers(remark["answer"]), _strip_wrappers(remark["remark"])
        hedge = remark["word"].casefold() == "or" and not same_answer("math", before, after)
        return [] if hedge else _parse_math(before)
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    expression = _latex_fixes(expression)
    span = re.fullmatch(r"[^$]*?(?<!\\)\$([^$]+?)(?<!\\)\$[^$]*", expression, re.DOTALL)
    if span and span.group(1).strip() == span.group(1):  # one $...$ among words: its math is the answer
        parsed = _parse_math(span.group(1))
        if any(_is_expression(x) for x in parsed):
            return parsed
    parsed = mv.parse("\\boxed{" + expression + "}", config, parsing_timeout=_timeout())
    if not parsed:  # plain-text forms latex parsing misses, e.g. "1/2 + x" without braces
        parsed = mv.parse(expression, [mv.ExprExtractionConfig()], parsing_timeout=_timeout())
    return parsed


# an unbraced \frac argument that math-verify misreads: a command ("\frac \pi4" -> \frac{\}{p}i4)
_FRAC_ARG = r"\s*(\\[A-Za-z]+|[0-9A-Za-z]|\{[^{}]*\})"
_UNBRACED_FRAC = re.compile(r"\\([dt]?frac)" + _FRAC_ARG + _FRAC_ARG)
_THIN_THOUSANDS = re.compile(r"(\d),\\!(?=\d{3}(?!\d))")  # MATH writes 5,525 as "5,\!525"


def _latex_fixes(expression: str) -> str:
    """Two LaTeX spellings of MATH's golds that math-verify misreads, rewritten before it parses
    (decisions L8): an unbraced \\frac argument ("\\frac \\pi4" is \\frac{\\pi}{4}; "\\frac12" was
    read right already) and the thin space of a thousands separator ("\\frac{12}{5,\\!525}" is
    12/5525; at the top level math-verify read it right already)."""
    expression = _THIN_THOUSANDS.sub(r"\1", expression)
    return _UNBRACED_FRAC.sub(
        lambda m: "\\" + m[1] + "".join(_braced(arg) for arg in m.groups()[1:]), expression
    )


def _braced(argument: str) -> str:
    return argument if argument.startswith("{") else "{" + argument + "}"


def _is_expression(parsed) -> bool:
    return not isinstance(parsed, str)


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> tuple:
    return tuple(_parse_math(gold))


def _judge_math(text: str | None, gold: str) -> Judgement:
    try:
        return _judge_math_unguarded(text, gold)
    except ValueError as err:
        if "thread" not in str(err):
            raise
        # math-verify before 0.8 has no way to run without its signal-based timeouts
        raise MeshHealError(
            "this math-verify cannot score outside the main thread: pip install -U 'math-verify>=0.8'"
        ) from None


_TEXT_WRAPPER = re.compile(_TEXT_COMMANDS + r"\{([^{}]*)\}")
_LETTER_LIST = re.compile(r"\(?[A-Z]\)?(?:\s*,\s*\(?[A-Z]\)?)+")


def _option_letters(answer: str) -> frozenset[str] | None:
    """The letters of a list of two or more option letters ("A, D", "\\text{B, E, G}", "(A), (C)"),
    as a set; None for anything else. MATH's golds name options so six times in its 5,000 test
    problems, and math-verify reads "\\text{A,D}" as a text symbol that no written "A, D" equals."""
    plain = _TEXT_WRAPPER.sub(r"\1", _strip_wrappers(answer)).strip()
    if not _LETTER_LIST.fullmatch(plain):
        return None
    return frozenset(re.findall(r"[A-Z]", plain))


def _judge_math_unguarded(text: str | None, gold: str) -> Judgement:
    mv = _math_verify()
    answer = extract_answer("math", text)
    if answer is None:
        return Judgement(False, NO_ANSWER, None)
    gold_letters = _option_letters(gold)
    if gold_letters is not None:  # the options named, in any order
        return Judgement(_option_letters(answer) == gold_letters, OK, answer)
    if _hedged(answer):  # "\boxed{1} or \boxed{2}": no one answer, unless all box one value
        values = [content for *_, content in boxed_spans(answer)]
        if not all(same_answer("math", v, values[-1]) for v in values[:-1]):
            return Judgement(False, UNPARSABLE, answer)
        answer = values[-1]  # "\boxed{x+11} or \boxed{11+x}"
    predicted = _parse_math(answer)
    gold_parsed = list(_parse_gold(_strip_wrappers(gold)))
    if not any(_is_expression(x) for x in gold_parsed):
        # a gold math-verify cannot read as mathematics: fall back to its exact text
        same_text = _normalise_text(answer) == _normalise_text(gold)
        return Judgement(same_text, OK if same_text or predicted else UNPARSABLE, answer)
    if not any(_is_expression(x) for x in predicted):
        # parse() hands back the raw string when it cannot build an expression: unparsable
        return Judgement(False, UNPARSABLE, answer)
    correct = mv.verify(gold_parsed, predicted, timeout_seconds=_timeout())
    return Judgement(bool(correct), OK, answer)


# ---------------------------------------------------------------------------------------------
# Public entry points


def judge(
    dataset: str, prediction_text: str | None, gold: str, options: tuple[str, ...] | list[str] | None = None
) -> Judgement:
    """Whether the final answer in `prediction_text` is correct, with the parse status and the
    extracted answer. `options`: the record's options (MMLU-Pro; BBH lettered options), used to
    reject out-of-range letters and to accept an answer that quotes an option's text."""
    _check_dataset(dataset)
    if gold is None or not str(gold).strip():
        raise MeshHealError(f"{dataset}: empty gold answer")
    options = tuple(options) if options is not None else None
    if dataset == "bbh":
        return _judge_bbh(prediction_text, str(gold), options)
    if dataset == "mmlu_pro":
        return _judge_mmlu_pro(prediction_text, str(gold), options)
    return _judge_math(prediction_text, str(gold))


def same_answer(dataset: str, a: str | None, b: str | None) -> bool:
    """Whether two extracted answers (`Judgement.answer` of two replies to one question) say the
    same thing, by the scorer's own normalisation: option letters and normalised text (BBH,
    MMLU-Pro; a judged option answer is already its letter), equal numbers, and math-verify
    equivalence for MATH. A missing answer equals nothing. Used for votes over wrong answers."""
    _check_dataset(dataset)
    if a is None or b is None:
        return False
    x, y = _normalise_text(a), _normalise_text(b)
    if x == y:
        return True
    if dataset != "math":
        u, v = _as_number(x), _as_number(y)
        return u is not None and v is not None and u == v
    first, second = _parse_math(a), _parse_math(b)
    if not (any(_is_expression(e) for e in first) and any(_is_expression(e) for e in second)):
        return False
    return bool(_math_verify().verify(first, second, timeout_seconds=_timeout()))


def score(
    dataset: str, prediction_text: str | None, gold: str, options: tuple[str, ...] | list[str] | None = None
) -> bool:
    """True when the final answer in `prediction_text` matches `gold`; unparsable or missing = False."""
    return judge(dataset, prediction_text, gold, options).correct
