"""Emulator parameter files: one TOML file per model, a pair = (strong file, weak file).

These are DATA shared by both engines. Cumulative categorical thresholds are computed here, once,
in float64 with the last set to 1.0, so no engine recomputes a cumsum (spec/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from meshheal_jax.config import TAU_TO
from meshheal_jax.errors import MeshHealError, MeshHealWarning
from meshheal_jax.files import read_text
from meshheal_jax.streams import DIFFICULTY_BINS
from meshheal_jax.topology import MAX_TOKENS, Profile, unknown_keys, whole_number

MODEL_DIR = Path(__file__).parent / "model_params"
ANCHORS = (0.0, 0.25, 0.5, 1.0)
CALL_KINDS = ("infer", "generate", "review", "committee1", "committee2", "candidate", "synthesis")
# The baselines' generate-like kinds (spec/emulator.md: "compose / refine / extra chain-of-thought
# samples are generate-like with their own token figures"). A file without them reads each as the
# MeshHeal kind it resembles (decisions B0); the shipped files carry their own.
BASELINE_TOKEN_KINDS = {"compose": "synthesis", "refine": "synthesis", "cot": "generate"}
TOKEN_KINDS = CALL_KINDS + tuple(BASELINE_TOKEN_KINDS)
AUTHOR_ROLES = ("strong_author", "weak_author")
PAIRS = {
    "default": ("gpt-oss-120b", "llama-3.2-1b"),
    "A": ("gpt-oss-120b", "gemma-3-4b"),
    "B": ("llama-3.3-70b", "llama-3.2-1b"),
}
SCALARS = (
    "p_infer", "p_rescue", "rho_same", "p_follow", "p_fix", "p_keep", "p_decide",
    "p_popular_wrong", "answer_fraction",
)  # fmt: skip
# Latent question difficulty (spec/emulator.md, docs/decisions.md E9): optional, non-negative,
# 0 (the independent model) when a file leaves them out. Kept in ModelParams.scalars.
DIFFICULTY = ("difficulty_spread", "review_difficulty")
# A Finalize built on a wrong draft, judged by this reviewer (spec/emulator.md "Structure the fit
# may need", docs/decisions.md E10): its own part correct, the review and round-2 categoricals are
# the mixture (1 - draft_blame) x P(score | correct) + draft_blame x P(score | wrong). Optional, a
# probability, 0 (judged on the own part alone, the spec's base rule) when a file leaves it out.
DRAFT_BLAME = "draft_blame"
OPTIONAL = DIFFICULTY + (DRAFT_BLAME,)  # every optional model-file number, neutral at 0
MAX_DISTRACTORS = 64  # wrong answers a baseline's vote can pick among (the shipped files: 4)
MODEL_KEYS = ("model",) + SCALARS + OPTIONAL + (
    "n_distractors", "p_part", "review", "round2", "completion_tokens", "prompt_tokens",
)  # fmt: skip
# The judged-output classes of the threshold tables: the judged part wrong, right, or right on a
# wrong accepted draft (a Finalize only).
JUDGED_WRONG, JUDGED_RIGHT, JUDGED_RIGHT_ON_WRONG_DRAFT = range(3)
# The difficulty z of each bin: the midpoint quantiles of a standard normal (bins are equally likely).
DIFFICULTY_Z = tuple(NormalDist().inv_cdf((b + 0.5) / DIFFICULTY_BINS) for b in range(DIFFICULTY_BINS))


# Where a review's verdict turns (protocol.md §4's tau_to, 0.40): a score above it accepts the
# judged output, one at or below it flags it. A right verdict accepts a correct output or flags a
# wrong one; "sharper" (emulator.md: a committee member's round-2 categorical "is sharper than
# round 1") is read as: a round-2 row gives a right verdict at least as often as the model's
# round-1 row for the same (author role, correct) (docs/decisions.md E11).
VERDICT_THRESHOLD = TAU_TO
SHARPNESS_TOLERANCE = 1e-5  # rows are written with 6 decimals


class ModelFileWarning(MeshHealWarning):
    """A model file that parses but breaks a rule of spec/emulator.md (a blunt round-2 row)."""


_WARNED_BLUNT: set[tuple[str, tuple[str, ...]]] = set()


def right_verdicts(row: tuple[float, ...] | list[float], correct: bool) -> float:
    """The probability that a score drawn from `row` is the right verdict on a correct (or wrong)
    judged output."""
    return sum(p for p, a in zip(row, ANCHORS) if (a > VERDICT_THRESHOLD) == correct)


def sharpened(round1: tuple[float, ...], round2: tuple[float, ...], correct: bool) -> tuple[float, ...]:
    """`round2` unchanged when it gives right verdicts at least as often as `round1`; otherwise the
    nearest row that does, keeping the shape within each side of the verdict: the right side's
    entries scaled up to round 1's right-verdict mass, the other side's down to the rest."""
    target, have = min(right_verdicts(round1, correct), 1.0), right_verdicts(round2, correct)
    if have >= target:
        return tuple(round2)
    right = [(a > VERDICT_THRESHOLD) == correct for a in ANCHORS]
    wrong_mass = 1.0 - have
    n_right = sum(right)
    return tuple(
        (p * target / have if have > 0 else target / n_right) if is_right
        else (p * (1.0 - target) / wrong_mass if wrong_mass > 0 else 0.0)
        for p, is_right in zip(round2, right)
    )  # fmt: skip


def blunt_round2(review: dict, round2: dict) -> list[str]:
    """The (author role, label) rows whose round-2 categorical gives right verdicts less often than
    round 1's (empty when every round-2 row is at least as sharp)."""
    blunt = []
    for (role, correct), row in round2.items():
        before, after = right_verdicts(review[(role, correct)], correct), right_verdicts(row, correct)
        if after < before - SHARPNESS_TOLERANCE:
            blunt.append(f"{role}.{'correct' if correct else 'wrong'} ({before:.3f} -> {after:.3f})")
    return blunt


def shifted_probability(p: float, shift: float) -> float:
    """sigmoid(logit(p) + shift); p itself, bit for bit, when shift is 0 or p is 0 or 1."""
    if shift == 0.0 or p <= 0.0 or p >= 1.0:
        return p
    try:
        return 1.0 / (1.0 + math.exp(-(math.log(p / (1.0 - p)) + shift)))
    except OverflowError:  # a shift far below -700: the sigmoid's limit
        return 0.0


def tilted(probabilities: tuple[float, ...], tilt: float) -> tuple[float, ...]:
    """A categorical over ANCHORS reweighted by exp(tilt * anchor) and renormalised; unchanged,
    bit for bit, when tilt is 0."""
    if tilt == 0.0:
        return probabilities
    try:
        w = [p * math.exp(tilt * a) for p, a in zip(probabilities, ANCHORS)]
    except OverflowError:
        w = []
    if not sum(w):  # a tilt of hundreds either way: the same weights over the largest exp(tilt * a)
        top = max(tilt * a for p, a in zip(probabilities, ANCHORS) if p > 0.0)
        w = [p * math.exp(tilt * a - top) if p > 0.0 else 0.0 for p, a in zip(probabilities, ANCHORS)]
    return tuple(x / sum(w) for x in w)


@dataclasses.dataclass(frozen=True)
class ModelParams:
    name: str  # file stem
    model: str  # model id served by vLLM
    scalars: dict[str, float]
    n_distractors: int
    p_part: dict[str, dict[str, float]]  # dataset -> {"default" | task type: p}
    review: dict[tuple[str, bool], tuple[float, ...]]  # (author role, correct) -> probabilities
    round2: dict[tuple[str, bool], tuple[float, ...]]
    completion_tokens: dict[str, tuple[int, int]]  # kind -> [min, max]
    prompt_tokens: dict[str, int]  # kind -> template tokens
    # cumulative thresholds, computed once here (spec/architecture.md "Randomness"); with
    # difficulty, one row per difficulty bin: (author role, correct) -> (DIFFICULTY_BINS, 4)
    review_cumulative: dict = dataclasses.field(init=False, repr=False, compare=False)
    round2_cumulative: dict = dataclasses.field(init=False, repr=False, compare=False)
    distractor_cumulative: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        rest = (1.0 - self.p_popular_wrong) / max(self.n_distractors - 1, 1)
        object.__setattr__(self, "review_cumulative", {k: self._binned(k, v) for k, v in self.review.items()})
        object.__setattr__(self, "round2_cumulative", {k: self._binned(k, v) for k, v in self.round2.items()})
        object.__setattr__(self, "distractor_cumulative",
                           self.thresholds((self.p_popular_wrong,) + (rest,) * (self.n_distractors - 1)))  # fmt: skip

    def __getattr__(self, item):  # p_infer, p_fix, ... read as attributes
        scalars = self.__dict__.get("scalars", {})
        if item in scalars:
            return scalars[item]
        raise AttributeError(item)

    def _binned(
        self, key: tuple[str, bool], probabilities: tuple[float, ...]
    ) -> tuple[tuple[float, ...], ...]:
        """A reviewer's categorical per difficulty bin: a harder question (z > 0) moves mass to low
        scores on a correct part and to high scores on a wrong one (misjudged more often)."""
        sign = -1.0 if key[1] else 1.0
        tau = self.scalars.get("review_difficulty", 0.0)
        return tuple(self.thresholds(tilted(probabilities, sign * tau * z)) for z in DIFFICULTY_Z)

    def p_part_for(self, profile: Profile) -> tuple[tuple[float, ...], ...]:
        """(task types, DIFFICULTY_BINS): P(part correct) per type and question difficulty bin,
        logit(p) - difficulty_spread * z."""
        spread = self.scalars.get("difficulty_spread", 0.0)
        return tuple(
            tuple(shifted_probability(p, -spread * z) for z in DIFFICULTY_Z)
            for p in self.p_part_base(profile)
        )

    def p_part_base(self, profile: Profile) -> tuple[float, ...]:
        """P(part correct) per task type, as the file states it (before difficulty)."""
        if profile.dataset not in self.p_part:
            raise MeshHealError(f"model file {self.name}: no [p_part] entry for dataset {profile.dataset!r}")
        table = self.p_part[profile.dataset]
        unknown = sorted(set(table) - set(profile.task_types) - {"default"})
        if unknown:
            raise MeshHealError(
                f"model file {self.name}: p_part.{profile.dataset} has unknown task type(s) {', '.join(unknown)}; "
                f"known: default, {', '.join(profile.task_types)}"
            )
        out = []
        for task_type in profile.task_types:
            if task_type not in table and "default" not in table:
                raise MeshHealError(
                    f"model file {self.name}: p_part.{profile.dataset} has no {task_type!r} or default"
                )
            out.append(float(table.get(task_type, table.get("default"))))
        return tuple(out)

    @staticmethod
    def thresholds(probabilities: tuple[float, ...]) -> tuple[float, ...]:
        cumulative, total = [], 0.0
        for p in probabilities:
            total += p
            cumulative.append(total)
        cumulative[-1] = 1.0
        return tuple(cumulative)

    def distractor_thresholds(self) -> tuple[float, ...]:
        """Wrong answers: distractor 1 with p_popular_wrong, the others share the rest."""
        return self.distractor_cumulative

    def review_thresholds(
        self, role: str, correct: bool, difficulty: int, wrong_draft: bool = False
    ) -> tuple[float, ...]:
        """Cumulative thresholds of one review sample; `wrong_draft`: the judged output is a
        Finalize whose accepted draft is wrong (only matters for a correct part)."""
        return self._judged(self.review_cumulative, role, correct, difficulty, wrong_draft)

    def round2_thresholds(
        self, role: str, correct: bool, difficulty: int, wrong_draft: bool = False
    ) -> tuple[float, ...]:
        return self._judged(self.round2_cumulative, role, correct, difficulty, wrong_draft)

    def _judged(self, table, role, correct, difficulty, wrong_draft) -> tuple[float, ...]:
        """A wrong part: its own row; a right one: its own row, mixed with the wrong row by
        draft_blame when it sits on a wrong draft (the last threshold stays exactly 1)."""
        right, wrong = table[(role, True)][difficulty], table[(role, False)][difficulty]
        w = self.scalars.get(DRAFT_BLAME, 0.0)
        if not correct:
            return wrong
        if not wrong_draft or w == 0.0:
            return right
        return tuple((1.0 - w) * a + w * b for a, b in zip(right[:-1], wrong[:-1])) + (1.0,)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _probability(value, where: str) -> float:
    if not _number(value) or not 0.0 <= float(value) <= 1.0:
        raise MeshHealError(f"{where} must be a probability in [0, 1], got {value!r}")
    return float(value)


def _non_negative(value, where: str) -> float:
    if not _number(value) or not 0.0 <= float(value) < math.inf:
        raise MeshHealError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def _table(doc: dict, key: str, source: str) -> dict:
    if key not in doc:
        raise MeshHealError(f"{source}: missing key {key!r}")
    if not isinstance(doc[key], dict):
        raise MeshHealError(f"{source}: {key} must be a table, got {doc[key]!r}")
    return doc[key]


def _per_kind(doc: dict, key: str, source: str) -> dict:
    """completion_tokens / prompt_tokens: one entry per MeshHeal call kind, and per baseline kind
    (BASELINE_TOKEN_KINDS: the resembled kind's entry when a file leaves one out), in TOKEN_KINDS'
    order."""
    table = _table(doc, key, source)
    missing = [k for k in CALL_KINDS if k not in table]
    if missing:
        raise MeshHealError(f"{source}: {key} is missing {', '.join(missing)}")
    unknown = sorted(set(table) - set(TOKEN_KINDS))
    if unknown:
        raise MeshHealError(
            f"{source}: {key} has unknown call kind(s) {', '.join(unknown)}; known: {', '.join(TOKEN_KINDS)}"
        )
    return {k: table.get(k, table.get(BASELINE_TOKEN_KINDS.get(k, k))) for k in TOKEN_KINDS}


def _categorical(doc: dict, section: str, source: str) -> dict[tuple[str, bool], tuple[float, ...]]:
    out = {}
    table = _table(doc, section, source)
    unknown_keys(table, AUTHOR_ROLES, f"{source}: {section}")
    for role in AUTHOR_ROLES:
        rows = table.get(role, {})
        if not isinstance(rows, dict):
            raise MeshHealError(f"{source}: {section}.{role} must be a table, got {rows!r}")
        unknown_keys(rows, ("correct", "wrong"), f"{source}: {section}.{role}")
        for label, correct in (("correct", True), ("wrong", False)):
            where = f"{source}: {section}.{role}.{label}"
            if label not in rows:
                raise MeshHealError(f"{where} is missing")
            row = rows[label]
            if not isinstance(row, list) or len(row) != len(ANCHORS):
                raise MeshHealError(f"{where} needs {len(ANCHORS)} probabilities (anchors {ANCHORS})")
            probs = tuple(_probability(p, where) for p in row)
            if abs(sum(probs) - 1.0) > 1e-6:
                raise MeshHealError(f"{where} sums to {sum(probs):.6f}, not 1")
            out[(role, correct)] = probs
    return out


def _model_id(value: Any, source: str) -> str:
    """The id a live run sends to its server: non-empty text."""
    if not isinstance(value, str) or not value.strip():
        raise MeshHealError(f"{source}: model must be a non-empty model id (text), got {value!r}")
    return value


def _toml_key(key: str) -> str:
    """A key as TOML reads it back: bare where TOML allows, else a quoted basic string."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _printable(text: str) -> str:
    """`text` with each character TOML cannot hold in a comment (control characters) as a space."""
    return "".join(c if c.isprintable() else " " for c in text)


def _toml_string(text: str) -> str:
    # a JSON string is a TOML basic string, but for DEL, which TOML wants escaped
    return json.dumps(text).replace("\x7f", "\\u007f")


def parse_model(doc: dict, name: str, source: str) -> ModelParams:
    unknown_keys(doc, MODEL_KEYS, source)
    missing = [k for k in SCALARS + ("n_distractors",) if k not in doc]
    if missing:
        raise MeshHealError(f"{source}: missing key(s) {', '.join(missing)}")
    scalars = {k: _probability(doc[k], f"{source}: {k}") for k in SCALARS}
    scalars |= {k: _non_negative(doc.get(k, 0.0), f"{source}: {k}") for k in DIFFICULTY}
    scalars[DRAFT_BLAME] = _probability(doc.get(DRAFT_BLAME, 0.0), f"{source}: {DRAFT_BLAME}")
    n_distractors = whole_number(doc["n_distractors"], f"{source}: n_distractors", 1, MAX_DISTRACTORS)
    completion = {}
    for kind, bounds in _per_kind(doc, "completion_tokens", source).items():
        where = f"{source}: completion_tokens.{kind}"
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise MeshHealError(f"{where} must be [min, max], got {bounds!r}")
        low, high = (whole_number(x, where, 0, MAX_TOKENS) for x in bounds)
        if low > high:
            raise MeshHealError(f"{where} must be [min, max] with min <= max, got {bounds!r}")
        completion[kind] = (low, high)
    prompt = {
        k: whole_number(v, f"{source}: prompt_tokens.{k}", 0, MAX_TOKENS)
        for k, v in _per_kind(doc, "prompt_tokens", source).items()
    }
    p_part = {}
    for ds, table in _table(doc, "p_part", source).items():
        if not isinstance(table, dict):
            raise MeshHealError(
                f"{source}: p_part.{ds} must be a table such as {{ default = 0.9 }}, got {table!r}"
            )
        p_part[str(ds)] = {str(k): _probability(v, f"{source}: p_part.{ds}.{k}") for k, v in table.items()}
    review, round2 = _categorical(doc, "review", source), _categorical(doc, "round2", source)
    blunt = blunt_round2(review, round2)
    if blunt and (source, tuple(blunt)) not in _WARNED_BLUNT:  # once per file and finding, however often read
        _WARNED_BLUNT.add((source, tuple(blunt)))
        warnings.warn(f"{source}: round-2 categorical(s) give right verdicts less often than round 1 "
                      f"(spec/emulator.md: round 2 is sharper; right-verdict share round 1 -> 2): "
                      f"{'; '.join(blunt)}", ModelFileWarning, stacklevel=2)  # fmt: skip
    return ModelParams(
        name=name,
        model=_model_id(doc.get("model", name), source),
        scalars=scalars,
        n_distractors=n_distractors,
        p_part=p_part,
        review=review,
        round2=round2,
        completion_tokens=completion,  # type: ignore[arg-type]
        prompt_tokens=prompt,
    )


def model_path(name_or_path: str | Path, model_dir: Path | None = None) -> Path:
    """The file a model name (or a .toml path) is read from."""
    path = Path(name_or_path)
    return path if path.suffix == ".toml" else (model_dir or MODEL_DIR) / f"{name_or_path}.toml"


def load_model(name_or_path: str | Path, model_dir: Path | None = None) -> ModelParams:
    path = model_path(name_or_path, model_dir)
    if not path.exists():
        raise MeshHealError(f"model parameter file not found: {path}")
    text = read_text(path, "model parameter file")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise MeshHealError(f"cannot parse model parameter file {path}: {err}") from None
    return parse_model(doc, path.stem, str(path))


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    strong: ModelParams
    weak: ModelParams


def threshold_table(pair: Pair, section: str) -> np.ndarray:
    """A pair's cumulative review ("review") or round-2 ("round2") thresholds as the array both
    JAX engines read: (reviewer model [strong, weak], author role, judged class [JUDGED_WRONG,
    JUDGED_RIGHT, JUDGED_RIGHT_ON_WRONG_DRAFT], DIFFICULTY_BINS, anchors)."""
    out = np.zeros((2, len(AUTHOR_ROLES), 3, DIFFICULTY_BINS, len(ANCHORS)))
    for r, m in enumerate((pair.strong, pair.weak)):
        lookup = m.review_thresholds if section == "review" else m.round2_thresholds
        for a, role in enumerate(AUTHOR_ROLES):
            for c, (correct, wrong_draft) in enumerate(((False, False), (True, False), (True, True))):
                out[r, a, c] = [lookup(role, correct, b, wrong_draft) for b in range(DIFFICULTY_BINS)]
    return out


def load_pair(name: str, model_dir: Path | None = None) -> Pair:
    if name not in PAIRS:
        raise MeshHealError(f"unknown pair {name!r}; known: {sorted(PAIRS)}")
    strong, weak = PAIRS[name]
    return Pair(name, load_model(strong, model_dir), load_model(weak, model_dir))


def dump_model(m: ModelParams, header: str = "", notes: Mapping[str, str] | None = None) -> str:
    """A model file's TOML text, which parse_model reads back to the same model, its numbers written
    to 6 significant digits (the fits round to 6 decimals: a value >= 1 can lose its last digits).
    `notes`: a comment written beside a value, keyed by its path (`p_infer`, `p_part.bbh.default`,
    `review.strong_author.wrong`, `completion_tokens.generate`, ...; a p_part line gathers its types'
    notes)."""
    notes = notes or {}

    def note(*keys: str) -> str:  # one line of printable text, whatever a note holds
        clean = {k: " ".join(_printable(str(notes[k])).split()) for k in keys if k in notes}
        said = [f"{k.rsplit('.', 1)[-1]}: {v}" if len(keys) > 1 else v for k, v in clean.items()]
        return f"  # {'; '.join(said)}" if said else ""

    lines = [f"# {_printable(line)}" for line in header.splitlines()] + [f"model = {_toml_string(m.model)}"]
    for key in SCALARS + OPTIONAL:
        lines.append(f"{key} = {m.scalars.get(key, 0.0):.6g}{note(key)}")
    lines.append(f"n_distractors = {m.n_distractors}{note('n_distractors')}")
    lines += ["", "[p_part]"]
    for dataset, table in m.p_part.items():
        items = ", ".join(f"{_toml_key(k)} = {v:.6g}" for k, v in table.items())
        lines.append(f"{_toml_key(dataset)} = {{ {items} }}{note(*(f'p_part.{dataset}.{k}' for k in table))}")
    for section, table in (("review", m.review), ("round2", m.round2)):
        for role in AUTHOR_ROLES:
            lines += ["", f"[{section}.{role}]"]
            for label, correct in (("correct", True), ("wrong", False)):
                row = ", ".join(f"{p:.6g}" for p in table[(role, correct)])
                lines.append(f"{label} = [{row}]{note(f'{section}.{role}.{label}')}")
    lines += ["", "[completion_tokens]"]
    lines += [
        f"{k} = [{lo}, {hi}]{note(f'completion_tokens.{k}')}" for k, (lo, hi) in m.completion_tokens.items()
    ]
    lines += ["", "[prompt_tokens]"]
    lines += [f"{k} = {v}{note(f'prompt_tokens.{k}')}" for k, v in m.prompt_tokens.items()]
    return "\n".join(lines) + "\n"
