"""Prompts and reply parsers of the live backend (spec/live.md "Prompts", protocol.md §3-§4).

Every builder returns OpenAI chat `messages` (a list of {"role", "content"} dicts); every parser
takes a model's reply text and returns a typed value, or raises `ReplyParseError` on garbage.
The live client (`backends/live.py`) retries a reply that fails to parse once with a new seed
and then records the parser's fallback (a neutral 0.5 review, the documented ability pair of
the task type, no answer).

- Execution: the question, task type, accepted earlier outputs and one of three competence
  directives (`Directive`): full match (`COMPETENCE_MATCH:yes`), partial (Contribute: only the
  delegated part, then a handoff; Finalize: ONE final answer combining the draft;
  `COMPETENCE_MATCH:partial`), none (`COMPETENCE_MATCH:no`, baselines only). The answer line is
  `RESULT: ...`.
- Ability inference: the 7-ability vocabulary with descriptions, the documented pair of every
  task type (with an example question when given), answer `{"abilities": [a, b]}`.
- Contribute / Finalize review and committee round 2: the rubric (anchors 1.00 / 0.50 / 0.25 /
  0.00, the evidence rule for scores <= 0.40), answered as JSON (`ContributeReview`,
  `FinalizeReview`; their JSON schemas go out as `response_format`).
- Takeover: a correction candidate per committee member, then a synthesis of the candidates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from meshheal_jax import params
from meshheal_jax.data import DATASETS, MMLU_PRO_LETTERS
from meshheal_jax.errors import MeshHealError
from meshheal_jax.scoring import extract_answer
from meshheal_jax.topology import Profile, name_key

Message = dict[str, str]

# the review score grid: protocol.md §4's four anchors, the emulator's
ANCHORS = params.ANCHORS
NEUTRAL_SCORE = 0.5  # DECISION (live.md): a review that never parses counts as "cannot verify"
LOW_SCORE_LIMIT = 0.40  # a score at or below this needs a concrete correctness error as evidence
NO_FINAL_ANSWER_CAP = 0.25  # Finalize review: no single concrete final answer -> at most this
SNAP_TOLERANCE = 0.125  # a reported score this far outside [0, 1] is still read (as 0 or 1)

COMPETENCE_YES = "COMPETENCE_MATCH:yes"
COMPETENCE_PARTIAL = "COMPETENCE_MATCH:partial"
COMPETENCE_NO = "COMPETENCE_MATCH:no"

Directive = Literal["full", "partial", "none"]
Stage = Literal["contribute", "finalize"]
DIRECTIVES = ("full", "partial", "none")
STAGES = ("contribute", "finalize")
CONFIDENCES = ("low", "medium", "high")
FAILURE_TYPES = ("none", "wrong_half", "over_reach", "other")

SYSTEM_PROMPT = (
    "You are one agent in a decentralized network of language-model agents. Each agent holds a "
    "few named abilities; a task travels from agent to agent, and each agent contributes only "
    "what its own abilities cover, while neighbouring agents review every output. Be precise, "
    "keep to the format you are asked for, and never invent work you were not asked to do."
)


class ReplyParseError(ValueError):
    """A reply that does not carry what its prompt asked for (the client retries it once)."""


# ---------------------------------------------------------------------------------------------
# Inputs shared by the builders


@dataclasses.dataclass(frozen=True)
class AbilityRef:
    """An ability as the prompts name it."""

    name: str
    description: str = ""

    def line(self) -> str:
        return f"{self.name}: {self.description}" if self.description else self.name


@dataclasses.dataclass(frozen=True)
class PriorOutput:
    """One accepted earlier output of the task, with the abilities its author covered."""

    text: str
    abilities: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskText:
    """The text of a task as the prompts show it (host-side text store, not JAX)."""

    dataset: str  # bbh | math | mmlu_pro (decides the answer format)
    question: str
    task_type: str
    options: tuple[str, ...] | None = None  # MMLU-Pro options (BBH options are inside the question)
    accepted: tuple[PriorOutput, ...] = ()  # accepted outputs so far, in order

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise MeshHealError(f"prompts: unknown dataset {self.dataset!r}; known: {list(DATASETS)}")
        if not self.question.strip():
            raise MeshHealError("prompts: empty question")


@dataclasses.dataclass(frozen=True)
class RoundOneView:
    """A committee member's round-1 review as round 2 shows it."""

    score: float
    explanation: str


def abilities_of(profile: Profile, names_or_ids: Sequence[str | int]) -> tuple[AbilityRef, ...]:
    """AbilityRefs (name + description) for ability names or vocabulary indices of a profile."""
    refs = []
    for item in names_or_ids:
        index = item if isinstance(item, int) else _ability_index(profile, item)
        if not 0 <= index < len(profile.abilities):  # -1 would name the last ability
            raise MeshHealError(
                f"prompts: {profile.dataset} has no ability index {index}; its abilities are 0..{len(profile.abilities) - 1}"
            )
        refs.append(AbilityRef(profile.abilities[index], profile.descriptions[index]))
    return tuple(refs)


def _ability_index(profile: Profile, name: str) -> int:
    try:
        return profile.abilities.index(name)
    except ValueError:
        raise MeshHealError(
            f"prompts: {profile.dataset} has no ability {name!r}; known: {list(profile.abilities)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Text blocks


def format_question(task: TaskText) -> str:
    """The question, with MMLU-Pro's options lettered A-J (BBH keeps its own "Options:" block)."""
    text = task.question.strip()
    if task.options and task.dataset == "mmlu_pro":
        lines = [f"{MMLU_PRO_LETTERS[i]}. {option}" for i, option in enumerate(task.options)]
        text += "\n\nOptions:\n" + "\n".join(lines)
    return text


def answer_format(task: TaskText) -> str:
    """How the final answer line must look for the task's dataset."""
    if task.dataset == "math":
        return (
            "Write the final answer as `RESULT: \\boxed{<answer>}` with the answer as a simplified "
            "LaTeX expression (no units, no words)."
        )
    if task.dataset == "mmlu_pro":
        last = MMLU_PRO_LETTERS[len(task.options) - 1] if task.options else "J"
        return f"Write the final answer as `RESULT: <letter>` with one option letter A-{last}."
    return (
        "Write the final answer as `RESULT: <answer>`: if the question lists options, the option "
        "in parentheses, e.g. `RESULT: (B)`; otherwise the exact answer alone (a number, Yes/No, "
        "True/False, valid/invalid, or the requested word sequence)."
    )


def _task_block(task: TaskText) -> str:
    return f"Task type: {task.task_type}\n\nQuestion:\n{format_question(task)}"


def _accepted_block(task: TaskText, title: str = "Accepted earlier outputs") -> str:
    if not task.accepted:
        return f"{title}: none yet."
    parts = []
    for k, prior in enumerate(task.accepted, start=1):
        covered = f" (covering: {', '.join(prior.abilities)})" if prior.abilities else ""
        parts.append(f"[Output {k}{covered}]\n{prior.text.strip()}")
    return f"{title}:\n" + "\n\n".join(parts)


def _abilities_block(abilities: Sequence[AbilityRef]) -> str:
    return "\n".join(f"- {ability.line()}" for ability in abilities)


def _names(abilities: Sequence[AbilityRef]) -> str:
    return ", ".join(ability.name for ability in abilities) or "(none)"


def _chat(user: str) -> list[Message]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# ---------------------------------------------------------------------------------------------
# Execution


def execution_messages(
    task: TaskText,
    abilities: Sequence[AbilityRef],
    directive: Directive,
    stage: Stage = "finalize",
    missing: Sequence[AbilityRef] = (),
) -> list[Message]:
    """The generation prompt of a Contribute or Finalize step.

    directive: "full" (the agent holds every remaining ability: solve all), "partial"
    (Contribute: only the part `abilities` cover, then hand off the `missing` abilities;
    Finalize: do the rest and commit ONE final answer combining the draft in `task.accepted`),
    "none" (outside the agent's abilities; baselines only). `abilities`: the calling agent's
    abilities that this step uses.
    """
    if directive not in DIRECTIVES:
        raise MeshHealError(f"prompts: directive must be one of {DIRECTIVES}, got {directive!r}")
    if stage not in STAGES:
        raise MeshHealError(f"prompts: stage must be one of {STAGES}, got {stage!r}")
    if directive == "full":
        instructions = (
            f"You hold every ability this task still needs ({_names(abilities)}). Solve the whole "
            f"task.\nThe first line of your reply must be exactly `{COMPETENCE_YES}`. Reason step "
            f"by step, then end with the final answer line.\n{answer_format(task)}"
        )
    elif directive == "partial" and stage == "contribute":
        handoff = f" The part that needs {_names(missing)} is for another agent." if missing else ""
        instructions = (
            f"You hold only part of what this task needs: {_names(abilities)}.{handoff} Do ONLY "
            f"the part your abilities cover: work it out, state your partial result clearly, and "
            f"do not attempt the rest.\nThe first line of your reply must be exactly "
            f"`{COMPETENCE_PARTIAL}`. End with the line `RESULT: <your partial result>`, then a "
            f"last line `HANDOFF: <what the next agent must still do>`."
        )
    elif directive == "partial":
        instructions = (
            f"Earlier agents have covered the other part of this task (their accepted output is "
            f"above). Using your abilities ({_names(abilities)}), do the remaining part, combine "
            f"it with the earlier output, and commit ONE concrete final answer: not a range, not "
            f"several candidates, not a refusal.\nThe first line of your reply must be exactly "
            f"`{COMPETENCE_PARTIAL}`.\n{answer_format(task)}"
        )
    else:
        instructions = (
            "None of your abilities covers this task. Still give your best attempt at the whole "
            f"task.\nThe first line of your reply must be exactly `{COMPETENCE_NO}`.\n"
            f"{answer_format(task)}"
        )
    user = (
        f"{_task_block(task)}\n\n{_accepted_block(task)}\n\n"
        f"Your abilities for this step:\n{_abilities_block(abilities)}\n\n{instructions}"
    )
    return _chat(user)


# ---------------------------------------------------------------------------------------------
# Ability inference


# the inference prompt's closing reply form; a reply that writes it repeats the prompt (a weak model
# without structured output), and the example answers before it are the prompt's, not the reply's
INFERENCE_TEMPLATE = {"abilities": ["<ability>", "<ability>"]}


def inference_messages(
    profile: Profile,
    question: str,
    task_type: str,
    examples: Mapping[str, str] | None = None,
    options: Sequence[str] | None = None,
) -> list[Message]:
    """InferAbilities: pick the two abilities the question needs from the documented pairs.

    examples: optional task type -> an example question of that type (one per task type);
    without it each task type is listed with its pair alone.
    """
    _check_task_type(profile, task_type)
    vocabulary = "\n".join(f"- {name}: {desc}" for name, desc in zip(profile.abilities, profile.descriptions))
    rows = []
    for tt, pair in zip(profile.task_types, profile.requires):
        answer = json.dumps({"abilities": [profile.abilities[pair[0]], profile.abilities[pair[1]]]})
        example = (examples or {}).get(tt)
        if example:
            snippet = " ".join(example.split())
            snippet = snippet if len(snippet) <= 300 else snippet[:297] + "..."
            rows.append(f"- Task type {tt}. Example question: {snippet}\n  Answer: {answer}")
        else:
            rows.append(f"- Task type {tt}. Answer: {answer}")
    task = TaskText(profile.dataset, question, task_type, tuple(options) if options else None)
    user = (
        f"Decide which two abilities are required to solve the question below. The ability "
        f"vocabulary of this benchmark:\n{vocabulary}\n\nEvery task needs exactly two abilities, "
        f"and the pair must be one of the documented pairs. One example per task type:\n"
        + "\n".join(rows)
        + f"\n\n{_task_block(task)}\n\nReply with JSON only, exactly of the form "
        f"{json.dumps(INFERENCE_TEMPLATE)}, using two names from the vocabulary."
    )
    return _chat(user)


def inference_schema(profile: Profile) -> dict:
    """JSON schema of the inference reply (ability names restricted to the vocabulary)."""
    return {
        "type": "object",
        "properties": {
            "abilities": {
                "type": "array",
                "items": {"type": "string", "enum": list(profile.abilities)},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["abilities"],
        "additionalProperties": False,
    }


@dataclasses.dataclass(frozen=True)
class InferredPair:
    abilities: tuple[int, int]  # ability ids in vocabulary order
    pair_index: int  # index into profile.pairs (distinct documented pairs, first-appearance order)


def parse_inference(text: str, profile: Profile) -> InferredPair:
    """The documented pair an inference reply names; ReplyParseError if it names none."""
    candidates = _json_values(text)
    if not candidates:
        raise ReplyParseError("inference reply has no JSON")
    problems = []
    lookup = {name_key(name): i for i, name in enumerate(profile.abilities)}
    for value in reversed(candidates):
        if value == INFERENCE_TEMPLATE:  # an echo of the prompt: what came before it is the prompt's
            problems.append("the prompt's reply form, repeated (an echo of the prompt)")
            break
        names = value.get("abilities") if isinstance(value, dict) else value
        if not isinstance(names, list) or len(names) != 2 or not all(isinstance(n, str) for n in names):
            problems.append("not a list of two ability names")
            continue
        ids = [lookup.get(name_key(n)) for n in names]
        if None in ids:
            problems.append(f"unknown ability in {names}")
            continue
        pair = frozenset(ids)
        if pair not in profile.pairs:
            problems.append(f"{sorted(names)} is not a documented pair")
            continue
        return InferredPair(tuple(sorted(ids)), profile.pairs.index(pair))  # type: ignore[arg-type]
    raise ReplyParseError("inference reply: " + "; ".join(problems))


def _check_task_type(profile: Profile, task_type: str) -> None:
    if task_type not in profile.task_types:
        raise MeshHealError(
            f"prompts: {profile.dataset} has no task type {task_type!r}; known: {list(profile.task_types)}"
        )


def documented_pair(profile: Profile, task_type: str) -> InferredPair:
    """The documented pair of a task type (the fallback after a failed inference)."""
    _check_task_type(profile, task_type)
    index = profile.task_types.index(task_type)
    return InferredPair(tuple(sorted(profile.requires[index])), profile.pair_index(index))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Reviews


def snap_score(value: Any) -> float:
    """A reported score read onto the anchor grid; ValueError for anything that is not a score."""
    if isinstance(value, bool):  # pydantic turns ValueError (not TypeError) into a validation error
        raise ValueError("a score must be a number, not a boolean")  # noqa: TRY004
    if isinstance(value, str):
        value = value.strip()
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"score {value!r} is not a number") from None
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"score {value!r:.40} is not a number")
    if not -SNAP_TOLERANCE <= value <= 1 + SNAP_TOLERANCE:
        raise ValueError(f"score {value!r:.40} is outside [0, 1]")
    # the nearest anchor; a tie (0.75) goes toward the neutral 0.5
    return min(ANCHORS, key=lambda anchor: (abs(anchor - value), abs(anchor - NEUTRAL_SCORE)))


def _normalise_choice(value: Any, allowed: tuple[str, ...], what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be one of {allowed}")  # noqa: TRY004 (pydantic validator)
    text = re.sub(r"[\s\-]+", "_", value.strip().casefold())
    if text not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {allowed}")
    return text


# advisory text of a reply (evidence, a reason): null reads as none given
OptionalText = Annotated[str, BeforeValidator(lambda value: "" if value is None else str(value))]


class ContributeReview(BaseModel):
    """The JSON a reviewer returns for a Contribute output (the drafter's delegated part)."""

    model_config = ConfigDict(extra="ignore")

    half_correct: float = Field(
        json_schema_extra={"enum": list(ANCHORS)},
        description="correctness of the judged part on the anchor grid",
    )
    in_scope: bool = Field(description="the output stays within the delegated part (advisory only)")
    normal_working_score: float = Field(
        json_schema_extra={"enum": list(ANCHORS)}, description="must equal half_correct"
    )
    confidence: Literal["low", "medium", "high"]
    specific_failure_found: bool
    failure_type: Literal["none", "wrong_half", "over_reach", "other"]
    failure_evidence: OptionalText = Field(description="a quote of the erroneous text, empty if none")
    one_sentence_reason: OptionalText

    @field_validator("half_correct", "normal_working_score", mode="before")
    @classmethod
    def _on_grid(cls, value: Any) -> float:
        return snap_score(value)

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, value: Any) -> str:
        if isinstance(value, str):  # "0.8": a number written as text reads as the number
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
            return "low" if value < 0.4 else "medium" if value < 0.75 else "high"
        return _normalise_choice(value, CONFIDENCES, "confidence")

    @field_validator("failure_type", mode="before")
    @classmethod
    def _failure_type(cls, value: Any) -> str:
        return _normalise_choice(value, FAILURE_TYPES, "failure_type")


class FinalizeReview(ContributeReview):
    """The JSON a reviewer returns for a Finalize output (the draft is context, not judged)."""

    final_answer_committed: bool = Field(description="the output commits ONE concrete final answer")


REVIEW_MODELS: dict[str, type[ContributeReview]] = {
    "contribute": ContributeReview,
    "finalize": FinalizeReview,
}


def review_schema(stage: Stage) -> dict:
    """The plain JSON schema of a review reply (every field required, no extra fields)."""
    schema = REVIEW_MODELS[_check_stage(stage)].model_json_schema()
    schema.pop("title", None)
    for prop in schema["properties"].values():
        prop.pop("title", None)
    schema["required"] = list(schema["properties"])
    schema["additionalProperties"] = False
    return schema


def json_schema_format(name: str, schema: dict) -> dict:
    """`response_format` asking an OpenAI-compatible server (vLLM) for JSON of this schema."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def review_response_format(stage: Stage) -> dict:
    return json_schema_format(f"{stage}_review", review_schema(stage))


def inference_response_format(profile: Profile) -> dict:
    return json_schema_format("ability_pair", inference_schema(profile))


def _check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise MeshHealError(f"prompts: stage must be one of {STAGES}, got {stage!r}")
    return stage


_ANCHOR_TEXT = (
    "Scores (use exactly one of these values):\n"
    "- 1.00: sound; correct and usable as it stands.\n"
    "- 0.50: you cannot verify it, or it is weak without a concrete error you can point to.\n"
    "- 0.25: it contains a concrete correctness error.\n"
    "- 0.00: unusable (empty, off-topic, or nonsense)."
)

_EVIDENCE_RULE = (
    f"A score of {LOW_SCORE_LIMIT:.2f} or lower (0.25 or 0.00) is allowed only with "
    "`specific_failure_found` = true, `failure_type` = wrong_half or other, and `failure_evidence` "
    "quoting the erroneous text. Going beyond the delegated part (over_reach) is never by itself a "
    "reason to lower the score. If judging the part needs an ability you do not hold, or you cannot "
    "check it, give 0.50 with confidence low."
)


def review_messages(
    task: TaskText,
    stage: Stage,
    output: str,
    judged: Sequence[AbilityRef],
    reviewer_abilities: Sequence[AbilityRef],
) -> list[Message]:
    """Initial review and committee round 1 of a Contribute or Finalize output.

    judged: the abilities the author's output covers (its delegated part); reviewer_abilities:
    the reviewer's own abilities (it may judge only with these). For Finalize, `task.accepted`
    holds the draft, shown as context and not scored.
    """
    _check_stage(stage)
    if stage == "contribute":
        what = (
            f"Another agent was delegated the part of this task that needs {_names(judged)}, and "
            f"produced the output below. Judge ONLY that delegated part, and only with an ability "
            f"you hold ({_names(reviewer_abilities)}). Other parts of the task are not its job: "
            f"their absence is not an error."
        )
        fields = _REVIEW_FIELDS
    else:
        what = (
            f"Another agent finished this task: it did the part that needs {_names(judged)} and "
            f"combined it with the earlier draft into the final answer below. The draft is shown for "
            f"context and is NOT being scored. Judge the finisher's own part, how faithfully it "
            f"used the draft, and whether it commits ONE concrete final answer, using only an "
            f"ability you hold ({_names(reviewer_abilities)}). An output with no single concrete "
            f"final answer scores at most {NO_FINAL_ANSWER_CAP:.2f}."
        )
        fields = _REVIEW_FIELDS + _FINALIZE_FIELD
    user = (
        f"You are reviewing another agent's work.\n\n{_task_block(task)}\n\n"
        f"{_accepted_block(task, 'Earlier accepted outputs (context)')}\n\n"
        f"Your abilities:\n{_abilities_block(reviewer_abilities)}\n\n{what}\n\n"
        f"Output under review:\n<<<\n{output.strip()}\n>>>\n\n{_ANCHOR_TEXT}\n\n"
        f"{_EVIDENCE_RULE}\n\nReply with one JSON object only, with these fields:\n{fields}"
    )
    return _chat(user)


_REVIEW_FIELDS = (
    "- half_correct: your score for the judged part (0, 0.25, 0.5 or 1)\n"
    "- in_scope: true if the output stays within its part (advisory; never lowers the score)\n"
    "- normal_working_score: the same number as half_correct\n"
    "- confidence: low, medium or high\n"
    "- specific_failure_found: true only if you found a concrete correctness error\n"
    "- failure_type: none, wrong_half, over_reach or other\n"
    "- failure_evidence: a short quote of the erroneous text (empty if none)\n"
    "- one_sentence_reason: one sentence explaining the score"
)
_FINALIZE_FIELD = "\n- final_answer_committed: true if the output commits ONE concrete final answer"


def committee_round2_messages(
    task: TaskText,
    stage: Stage,
    output: str,
    judged: Sequence[AbilityRef],
    reviewer_abilities: Sequence[AbilityRef],
    own: RoundOneView,
    other: RoundOneView,
) -> list[Message]:
    """Committee round 2: the round-1 prompt plus both members' round-1 scores and explanations."""
    messages = review_messages(task, stage, output, judged, reviewer_abilities)
    messages[-1]["content"] += (
        "\n\nThis is round 2 of a two-member committee. Round-1 reviews:\n"
        f"- Your round-1 score: {own.score:.2f}. Your explanation: {own.explanation.strip() or '(none)'}\n"
        f"- The other member's round-1 score: {other.score:.2f}. Its explanation: "
        f"{other.explanation.strip() or '(none)'}\n"
        "Look at the output again with both reviews in mind and give your round-2 review under the "
        "same rubric and in the same JSON form. Change your score only for a concrete reason."
    )
    return messages


@dataclasses.dataclass(frozen=True)
class ReviewVerdict:
    """A parsed review: the score the protocol uses and what round 2 shows of it."""

    score: float  # on the anchor grid
    confidence: str
    specific_failure_found: bool
    failure_type: str
    failure_evidence: str
    reason: str
    in_scope: bool = True
    final_answer_committed: bool | None = None  # Finalize reviews only
    adjustment: str = ""  # "" | "unsupported_low_score" | "no_final_answer" (client-side rules applied)
    parse_failed: bool = False

    @property
    def explanation(self) -> str:
        """What committee round 2 shows of this review."""
        if self.failure_evidence:
            return f'{self.reason} Evidence: "{self.failure_evidence}"'
        return self.reason


def neutral_verdict() -> ReviewVerdict:
    """The verdict recorded when a review reply never parses (DECISION: neutral 0.5)."""
    return ReviewVerdict(
        score=NEUTRAL_SCORE,
        confidence="low",
        specific_failure_found=False,
        failure_type="none",
        failure_evidence="",
        reason="(the review reply could not be parsed)",
        parse_failed=True,
    )


def review_reply(score: float, stage: Stage, evidence: str = "the quoted step is wrong",
                 reason: str = "checked the work") -> str:  # fmt: skip
    """A well-formed review reply giving `score` (the JSON a reviewer model should return), for
    stand-in servers and tests: a score <= 0.25 names `evidence` as a concrete correctness error
    (and, for a Finalize, no committed answer), so `parse_review` reads back `score` unchanged."""
    low = score <= 0.25
    reply = {
        "half_correct": score, "in_scope": True, "normal_working_score": score,
        "confidence": "low" if score == 0.5 else "high", "specific_failure_found": low,
        "failure_type": "wrong_half" if low else "none", "failure_evidence": evidence if low else "",
        "one_sentence_reason": reason,
    }  # fmt: skip
    if _check_stage(stage) == "finalize":
        reply["final_answer_committed"] = not low
    return json.dumps(reply)


def parse_review(text: str, stage: Stage) -> ReviewVerdict:
    """A review reply read into a verdict; ReplyParseError when no JSON object validates.

    The score is half_correct snapped onto the anchor grid (normal_working_score must equal it;
    when it does not, half_correct wins: scope never lowers a score). Client-side rules: a score
    <= 0.40 without a concrete correctness error as evidence becomes 0.50
    ("unsupported_low_score"); a Finalize output without a committed final answer is capped at
    0.25 ("no_final_answer").
    """
    model = REVIEW_MODELS[_check_stage(stage)]
    candidates = [value for value in _json_values(text) if isinstance(value, dict)]
    if not candidates:
        raise ReplyParseError("review reply has no JSON object")
    errors = []
    for value in reversed(candidates):
        try:
            reply = model.model_validate(value)
        except ValidationError as err:
            errors.append(f"{err.error_count()} invalid field(s): {_first_error(err)}")
            continue
        return _verdict(reply)
    raise ReplyParseError("review reply: " + "; ".join(errors))


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def _verdict(reply: ContributeReview) -> ReviewVerdict:
    score = reply.half_correct
    adjustment = ""
    evidence_ok = (
        reply.specific_failure_found
        and reply.failure_type in ("wrong_half", "other")
        and bool(reply.failure_evidence.strip())
    )
    if score <= LOW_SCORE_LIMIT and not evidence_ok:
        score, adjustment = NEUTRAL_SCORE, "unsupported_low_score"
    committed = getattr(reply, "final_answer_committed", None)
    if committed is False and score > NO_FINAL_ANSWER_CAP:
        score, adjustment = NO_FINAL_ANSWER_CAP, "no_final_answer"
    return ReviewVerdict(
        score=score,
        confidence=reply.confidence,
        specific_failure_found=reply.specific_failure_found,
        failure_type=reply.failure_type,
        failure_evidence=reply.failure_evidence.strip(),
        reason=reply.one_sentence_reason.strip(),
        in_scope=reply.in_scope,
        final_answer_committed=committed,
        adjustment=adjustment,
    )


# ---------------------------------------------------------------------------------------------
# Takeover


def _kind_of_output(stage: Stage) -> str:
    return "partial result" if stage == "contribute" else "final answer"


def _result_instruction(task: TaskText, stage: Stage) -> str:
    if stage == "contribute":
        return "End with the line `RESULT: <the corrected partial result>`."
    return answer_format(task)


def candidate_messages(
    task: TaskText,
    stage: Stage,
    output: str,
    judged: Sequence[AbilityRef],
    reviewer_abilities: Sequence[AbilityRef],
    reviews: Sequence[str] = (),
) -> list[Message]:
    """Takeover: a committee member writes a corrected version of the reviewed output."""
    _check_stage(stage)
    kind = _kind_of_output(stage)
    found = "\n".join(f"- {r.strip()}" for r in reviews if r.strip()) or "- (no explanation given)"
    user = (
        f"{_task_block(task)}\n\n{_accepted_block(task)}\n\nAnother agent produced the {kind} below "
        f"for the part of this task that needs {_names(judged)}. A review committee rejected it:\n"
        f"{found}\n\nRejected {kind}:\n<<<\n{output.strip()}\n>>>\n\nYour abilities:\n"
        f"{_abilities_block(reviewer_abilities)}\n\nWrite a corrected version of this {kind}: the "
        f"same kind of output covering the same part, with the errors fixed. Do not describe the "
        f"errors; write the replacement itself.\n{_result_instruction(task, stage)}"
    )
    return _chat(user)


def synthesis_messages(
    task: TaskText,
    stage: Stage,
    candidates: Sequence[str],
    judged: Sequence[AbilityRef],
    synthesiser_abilities: Sequence[AbilityRef],
) -> list[Message]:
    """Takeover: combine the committee's correction candidates into one replacement output."""
    _check_stage(stage)
    if not candidates:
        raise MeshHealError("prompts: a synthesis needs at least one candidate")
    kind = _kind_of_output(stage)
    listed = "\n\n".join(f"[Candidate {k}]\n{c.strip()}" for k, c in enumerate(candidates, start=1))
    user = (
        f"{_task_block(task)}\n\n{_accepted_block(task)}\n\nTwo reviewers each wrote a corrected "
        f"{kind} for the part of this task that needs {_names(judged)}:\n\n{listed}\n\n"
        f"Your abilities:\n{_abilities_block(synthesiser_abilities)}\n\nCombine the candidates with "
        f"the accepted task context into ONE replacement {kind}: keep what they agree on, resolve "
        f"where they differ by checking the work, and write the replacement itself.\n"
        f"{_result_instruction(task, stage)}"
    )
    return _chat(user)


# ---------------------------------------------------------------------------------------------
# Execution replies


@dataclasses.dataclass(frozen=True)
class ExecutionReply:
    text: str  # the whole reply (what the text store keeps)
    competence: str | None  # "yes" | "partial" | "no" from the first COMPETENCE_MATCH line, else None
    answer: str | None  # the final answer (scoring.extract_answer: last RESULT: / \boxed{}), else None


_COMPETENCE = re.compile(r"COMPETENCE_MATCH\s*:\s*(yes|partial|no)\b", re.IGNORECASE)


def parse_execution(text: str, dataset: str) -> ExecutionReply:
    """An execution / candidate / synthesis reply; ReplyParseError only when it is empty.

    A reply without an answer line still parses (answer None): its missing answer makes the
    task's answer incorrect, which is the protocol's outcome, not a transport failure.
    """
    if not text or not text.strip():
        raise ReplyParseError("empty reply")
    match = _COMPETENCE.search(text)
    competence = match.group(1).lower() if match else None
    return ExecutionReply(text, competence, extract_answer(dataset, text))


# ---------------------------------------------------------------------------------------------
# Parsers as the live client uses them


@dataclasses.dataclass(frozen=True)
class ReplyParser:
    """How the live client reads one kind of reply: `parse` raises ReplyParseError on garbage;
    `fallback` is recorded after the one retry also fails."""

    name: str
    parse: Callable[[str], Any]
    fallback: Any = None


def _parse_text(text: str) -> str:
    if not text or not text.strip():
        raise ReplyParseError("empty reply")
    return text


TEXT_PARSER = ReplyParser("text", _parse_text, None)


def review_parser(stage: Stage) -> ReplyParser:
    _check_stage(stage)
    return ReplyParser(f"{stage}_review", lambda text: parse_review(text, stage), neutral_verdict())


def inference_parser(profile: Profile, task_type: str) -> ReplyParser:
    return ReplyParser(
        "inference", lambda text: parse_inference(text, profile), documented_pair(profile, task_type)
    )


def execution_parser(dataset: str) -> ReplyParser:
    if dataset not in DATASETS:
        raise MeshHealError(f"prompts: unknown dataset {dataset!r}; known: {list(DATASETS)}")
    return ReplyParser("execution", lambda text: parse_execution(text, dataset), None)


# ---------------------------------------------------------------------------------------------
# JSON in free text


def _json_values(text: str | None) -> list[Any]:
    """Every JSON object or array found in a reply, in order of appearance: the whole text if it is
    one, else each top-level {...} / [...] a JSON decoder accepts, inside code fences or not (the
    parsers take the last valid one, so a fenced schema echo before the answer does not win)."""
    if not text:
        return []
    stripped = text.strip()
    # besides JSONDecodeError, json raises RecursionError when nested ~1,000 deep and ValueError for
    # an integer of more than 4,300 digits: garbage a model can write, read as no JSON there
    try:
        return [json.loads(stripped)]
    except (ValueError, RecursionError):
        pass
    decoder = json.JSONDecoder()
    # a value opened at i must close after i: starts past the last closer are not tried, which
    # keeps a reply that loops on an opener to its end ("[[[[...", '{"a": [{"a": [...') linear, not
    # ~1,000 steps of the decoder's nesting per start (6 s for 32,000 "["); where a closer follows
    # such a loop, _next_start skips the loop's openers that cannot close
    last_close = {"{": stripped.rfind("}"), "[": stripped.rfind("]")}
    found, i, chain_end = [], 0, 0
    while i < len(stripped):
        if stripped[i] in "{[" and i < last_close[stripped[i]]:
            try:
                value, end = decoder.raw_decode(stripped, i)
            except (ValueError, RecursionError) as err:
                # at the head of a chain of openers, skip those that cannot close; inside the chain
                # already read, or refused within SKIP_CHAIN characters (each opener before that
                # point is refused there too, at once), go one by one
                soon = isinstance(err, json.JSONDecodeError) and err.pos - i < SKIP_CHAIN
                i, chain_end = (i + 1, chain_end) if soon or i < chain_end else _next_start(stripped, i)
                continue
            if isinstance(value, (dict, list)):
                found.append(value)
            i = end
        else:
            i += 1
    return found


# one step into a chain of openers, each holding the next as an element or a value: "[" and any
# elements before it, or "{" and any members before its key and ":"; an element here is a scalar
# (a string without brackets or escapes, or a run of letters, digits, ".", "+" and "-"), so no
# text a step reads can open or close a value
_WS, _SCALAR, _KEY = r"[ \t\n\r]*", r'(?:"[^"\\\[\]{}]*"|[-+.\w]+)', r'"[^"\\\[\]{}]*"'
SKIP_CHAIN = 16  # _next_start counts the closers after a chain of at least this many openers
_CHAIN_STEP = re.compile(
    rf"(?:\[{_WS}(?:{_SCALAR}{_WS},{_WS})*|\{{{_WS}(?:{_KEY}{_WS}:{_WS}{_SCALAR}{_WS},{_WS})*{_KEY}{_WS}:{_WS})"
)


def _next_start(text: str, i: int) -> tuple[int, int]:
    """Where to try next after the decoder refused the value opened at i, and where the chain of
    openers from i ends. A value opened at the m-th opener of a chain of k has k - m containers to
    close after the chain, so the openers with more of them than closers follow the chain cannot
    open a value; each would cost the decoder up to k - m steps (or its nesting limit, ~1,000 in
    CPython 3.11) to refuse. In a chain of at least SKIP_CHAIN openers, those between i and the
    first that can close are skipped (none is, if that is i); a shorter chain is not worth the
    count of the closers. Still slow: loops the steps cannot read (a key with a bracket or an
    escape, a list or an object before the nested opener) and loops followed by about as many
    closers as they have openers."""
    starts, pos = [], i
    while (step := _CHAIN_STEP.match(text, pos)) is not None:
        starts.append(pos)
        pos = step.end()
    if len(starts) < SKIP_CHAIN:
        return i + 1, pos
    # fewer than len(starts): a closer of the head's kind follows it (_json_values tries no other)
    hopeless = len(starts) - (text.count("]", pos) + text.count("}", pos))
    return (starts[hopeless] if hopeless > 0 else i + 1), pos


# ---------------------------------------------------------------------------------------------
# The baselines' own calls (spec/baselines.md; live backend of `baselines/`)
#
# Router (AgentNet) and speaker selection (AutoGen) name one agent; the watchdog (RAPS) is the
# Contribute review above; an SAC evaluation scores the evaluator's own answer and another
# team's; compose (AutoGen) and refine (SAC) write a final answer; chain-of-thought resamples
# (Symphony) are execution prompts.


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An agent a router or a manager may name, as the prompt lists it."""

    agent: int
    abilities: tuple[AbilityRef, ...]
    note: str = ""  # e.g. the router's score terms


def _candidates_block(candidates: Sequence[Candidate]) -> str:
    lines = []
    for c in candidates:
        note = f"; {c.note}" if c.note else ""
        lines.append(f"- agent {c.agent}: {_names(c.abilities)}{note}")
    return "\n".join(lines)


def choice_schema(agents: Sequence[int]) -> dict:
    return {
        "type": "object", "properties": {"agent": {"type": "integer", "enum": sorted({int(a) for a in agents})}},
        "required": ["agent"], "additionalProperties": False,
    }  # fmt: skip


def choice_response_format(agents: Sequence[int]) -> dict:
    return json_schema_format("agent_choice", choice_schema(agents))


def router_messages(
    task: TaskText, agent: int, needed: AbilityRef, candidates: Sequence[Candidate]
) -> list[Message]:
    """AgentNet: the agent holding the task names the neighbour to forward it to."""
    if not candidates:
        raise MeshHealError("prompts: a router call needs at least one candidate neighbour")
    user = (
        f"You are agent {agent}, routing a task.\n\n{_task_block(task)}\n\n{_accepted_block(task)}\n\n"
        f"The task still needs the ability {needed.line()}. Your neighbours that may receive it, with "
        f"their ability estimate for it, success rate on this task type and load:\n"
        f"{_candidates_block(candidates)}\n\nName the ONE neighbour best placed to do this part. "
        'Reply with one JSON object only: {"agent": <id>}.'
    )
    return _chat(user)


def select_messages(
    task: TaskText, needed: AbilityRef, workers: Sequence[Candidate], retry: bool
) -> list[Message]:
    """AutoGen: the group-chat manager names the next speaker for the needed ability."""
    if not workers:
        raise MeshHealError("prompts: a speaker selection needs at least one worker")
    again = "The worker you named before does not hold this ability and declined the turn. " if retry else ""
    user = (
        f"You are the manager of a group chat of agents.\n\n{_task_block(task)}\n\n{_accepted_block(task)}\n\n"
        f"{again}The next step needs the ability {needed.line()}. The workers and their abilities:\n"
        f"{_candidates_block(workers)}\n\nName the ONE worker who should speak next. "
        'Reply with one JSON object only: {"agent": <id>}.'
    )
    return _chat(user)


def parse_choice(text: str, agents: Sequence[int]) -> int:
    """The agent a router / selection reply names; ReplyParseError when none of `agents`."""
    allowed = {int(a) for a in agents}
    for value in reversed(_json_values(text)):
        if isinstance(value, dict) and "agent" in value:
            named = value["agent"]  # 3, "3", "agent 3", "Agent 3" or 3.0; not true/false
            if isinstance(named, float) and named.is_integer():
                named = int(named)
            try:
                agent = int(str(named).strip().casefold().removeprefix("agent").strip())
            except ValueError:
                continue
            if agent in allowed:
                return agent
            raise ReplyParseError(f"named agent {agent} is not one of {sorted(allowed)}")
    raise ReplyParseError('reply has no JSON object {"agent": <id>}')


def choice_parser(agents: Sequence[int]) -> ReplyParser:
    """Fallback -1: the method's own rule decides (AgentNet's score rule, AutoGen's random worker)."""
    agents = tuple(int(a) for a in agents)
    return ReplyParser("agent_choice", lambda text: parse_choice(text, agents), -1)


def compose_messages(task: TaskText, worker_answer: str) -> list[Message]:
    """AutoGen: the manager composes the group chat's final reply from the last worker's answer."""
    user = (
        f"You are the manager of a group chat of agents.\n\n{_task_block(task)}\n\n{_accepted_block(task)}\n\n"
        f"The last worker answered:\n<<<\n{worker_answer.strip()}\n>>>\n\nCompose the group chat's "
        f"final reply to the user from the conversation.\n{answer_format(task)}"
    )
    return _chat(user)


class EvaluationReply(BaseModel):
    """SAC: an evaluator's scores of its own answer and of another team's answer."""

    model_config = ConfigDict(extra="ignore")

    own_score: float = Field(json_schema_extra={"enum": list(ANCHORS)})
    other_score: float = Field(json_schema_extra={"enum": list(ANCHORS)})
    one_sentence_reason: OptionalText = ""

    @field_validator("own_score", "other_score", mode="before")
    @classmethod
    def _on_grid(cls, value: Any) -> float:
        return snap_score(value)


def evaluation_messages(task: TaskText, own_answer: str, other_answer: str,
                        abilities: Sequence[AbilityRef]) -> list[Message]:  # fmt: skip
    """SAC: score your own team's answer (the anchor) and another team's answer."""
    user = (
        f"You evaluate answers to this task.\n\n{_task_block(task)}\n\nYour abilities:\n"
        f"{_abilities_block(abilities)}\n\nYour team's answer:\n<<<\n{own_answer.strip()}\n>>>\n\n"
        f"Another team's answer:\n<<<\n{other_answer.strip()}\n>>>\n\n{_ANCHOR_TEXT}\n\nScore both "
        "answers. Reply with one JSON object only, with the fields own_score, other_score and "
        "one_sentence_reason."
    )
    return _chat(user)


def evaluation_schema() -> dict:
    return {
        "type": "object",
        "properties": {"own_score": {"type": "number", "enum": list(ANCHORS)},
                       "other_score": {"type": "number", "enum": list(ANCHORS)},
                       "one_sentence_reason": {"type": "string"}},
        "required": ["own_score", "other_score", "one_sentence_reason"], "additionalProperties": False,
    }  # fmt: skip


def evaluation_response_format() -> dict:
    return json_schema_format("answer_evaluation", evaluation_schema())


def parse_evaluation(text: str) -> tuple[float, float]:
    """(own score, other score) on the anchor grid; ReplyParseError when no JSON object validates."""
    for value in reversed(_json_values(text)):
        if isinstance(value, dict):
            try:
                reply = EvaluationReply.model_validate(value)
            except ValidationError:
                continue
            return reply.own_score, reply.other_score
    raise ReplyParseError("evaluation reply has no valid JSON object with own_score and other_score")


def evaluation_parser() -> ReplyParser:
    return ReplyParser("evaluation", parse_evaluation, (NEUTRAL_SCORE, NEUTRAL_SCORE))


def refine_messages(task: TaskText, own_answer: str, retained: Sequence[str],
                    abilities: Sequence[AbilityRef]) -> list[Message]:  # fmt: skip
    """SAC: refine your team's answer from the other teams' answers you kept."""
    others = (
        "\n\n".join(f"[Answer {k}]\n{a.strip()}" for k, a in enumerate(retained, start=1)) or "(none kept)"
    )
    user = (
        f"{_task_block(task)}\n\nYour abilities:\n{_abilities_block(abilities)}\n\nYour team's answer:\n"
        f"<<<\n{own_answer.strip()}\n>>>\n\nOther teams' answers you kept after evaluation:\n{others}\n\n"
        f"Refine your answer: check the work, use what the other answers get right, and commit ONE "
        f"concrete final answer.\n{answer_format(task)}"
    )
    return _chat(user)
