"""Benchmark questions for the live backend and `--data` runs (spec/live.md "Datasets").

Every loader maps a benchmark's own rows to `Record(question, task_type, gold, options)`, keeps
only the task types of the dataset's profile, and fails with a one-line `MeshHealError` naming
the file, row and field of a malformed row, or the profile task type the data lacks.

- `load_local(dataset, path)`: files in the benchmarks' own layouts (json / jsonl / parquet):
  BBH a folder of `<task>.json` (`{"examples": [{"input", "target"}]}`, task type = file stem);
  MATH rows with `problem`, `type` (MATH-500: `subject`) and `answer`, or else the last
  `\\boxed{...}` of `solution`; MMLU-Pro rows with `question`, `category`, `answer` (a letter,
  trusted over `answer_index`) and `options` (whitespace stripped).
- `load_hub(dataset, hub_id=..., split=...)`: the same mapping over Hugging Face `datasets`
  (optional dependency, imported lazily).
- `load_sample(dataset)`: the small verbatim sample shipped in `sample_data/` (see its NOTICE.md).
- `question_pool` + `pick_questions`: turn a stream's (task type, question id) arrays into
  records: question k of type T is the k-th question of T's pool in a seeded shuffled order;
  past the end of the pool questions are drawn with replacement, with a flag and a warning.
- `question_tokens`: the token counts an emulated run given a data dir uses for its questions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import string
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from meshheal_jax.errors import MeshHealError, MeshHealWarning
from meshheal_jax.files import read_text
from meshheal_jax.topology import Profile, load_profile, name_key

DATASETS = ("bbh", "math", "mmlu_pro")
SAMPLE_DIR = Path(__file__).resolve().parent / "sample_data"
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")

# Hugging Face hub defaults (spec/experiments.md: BBH 250 per task, the full MATH test split,
# the MMLU-Pro test split).
DEFAULT_HUB_IDS = {
    "bbh": "lukaemon/bbh",
    "math": "EleutherAI/hendrycks_math",
    "mmlu_pro": "TIGER-Lab/MMLU-Pro",
}
DEFAULT_SPLITS = {"bbh": "test", "math": "test", "mmlu_pro": "test"}
# Hub datasets that keep one config per task type (config name derived from the type name).
PER_TYPE_CONFIG_HUB_IDS = {"bbh": ("lukaemon/bbh",), "math": ("EleutherAI/hendrycks_math",)}

# File names looked for when `load_local` gets a folder, in order (the folder itself and its
# <dataset>/ subfolder are searched); BBH instead looks for <task>.json|jsonl|parquet.
DEFAULT_FILES = {
    "math": (
        "math_test_5000_with_answer.jsonl",
        "math_test_5000.jsonl",
        "test.jsonl",
        "test.parquet",
        "math_test_sample.jsonl",
    ),
    "mmlu_pro": (
        "mmlu_pro_test.jsonl",
        "test.jsonl",
        "test.parquet",
        "mmlu_pro_test_sample.jsonl",
    ),
}

MMLU_PRO_LETTERS = "ABCDEFGHIJ"
QUESTION_SALT = 0xA5C0  # separates question shuffling from stream shuffling (streams.STREAM_SALT)


@dataclasses.dataclass(frozen=True)
class Record:
    """One benchmark question, whatever its source."""

    question: str
    task_type: str  # a task type name of the dataset's profile
    gold: str  # BBH target string, MATH answer (LaTeX), MMLU-Pro letter
    options: tuple[str, ...] | None = None  # MMLU-Pro options; BBH "(A) ..." options parsed from the input
    uid: str = ""  # stable id: "navigate/3", MATH unique_id or "Algebra/idx:12", "qid:70", else "file:row"
    source: str = ""  # where it came from, for messages: "file, row 3"


# ---------------------------------------------------------------------------------------------
# Row reading


def _row_error(where: str, problem: str) -> MeshHealError:
    return MeshHealError(f"{where}: {problem}")


def iter_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based row number, row) of a .jsonl / .json / .parquet file.

    .json: a list of rows, or an object with an `examples` list (BBH); the row number is the
    position in that list. .jsonl: the line number (blank lines skipped). .parquet: the row.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        lines = read_text(path, "data file").split("\n")
        # split on "\n" only: str.splitlines would also split on U+2028 and friends, which occur
        # inside MMLU-Pro strings
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _row_error(
                    f"{path}, row {n}", f"invalid JSON at column {err.colno} ({err.msg})"
                ) from None
            except RecursionError:
                raise _row_error(f"{path}, row {n}", "JSON nested too deeply") from None
            except ValueError as err:  # an integer of more than 4,300 digits
                raise _row_error(f"{path}, row {n}", f"invalid JSON ({err})") from None
            if not isinstance(row, dict):
                raise _row_error(f"{path}, row {n}", f"expected a JSON object, got {type(row).__name__}")
            yield n, row
    elif suffix == ".json":
        text = read_text(path, "data file")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise MeshHealError(f"{path}: invalid JSON at line {err.lineno} ({err.msg})") from None
        except RecursionError:
            raise MeshHealError(f"{path}: JSON nested too deeply") from None
        except ValueError as err:  # an integer of more than 4,300 digits
            raise MeshHealError(f"{path}: invalid JSON ({err})") from None
        rows = doc.get("examples") if isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            raise MeshHealError(f"{path}: expected a list of rows or an object with an 'examples' list")
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise _row_error(f"{path}, row {n}", f"expected a JSON object, got {type(row).__name__}")
            yield n, row
    elif suffix == ".parquet":
        import polars as pl

        try:
            frame = pl.read_parquet(path)
        except Exception as err:  # noqa: BLE001 - polars raises several types for unreadable files
            raise MeshHealError(f"cannot read {path} as parquet: {str(err).splitlines()[0]}") from None
        for n, row in enumerate(frame.iter_rows(named=True), 1):
            yield n, row
    else:
        raise MeshHealError(f"{path}: unsupported file type {suffix or '(none)'}; use json, jsonl or parquet")


MAX_QUESTION_CHARS = 400_000  # ~100k tokens: past every served model's context (a garbage row)


def _question_field(row: dict, field: str, where: str) -> str:
    """A question's text: a text field no longer than MAX_QUESTION_CHARS."""
    text = _text_field(row, field, where)
    if len(text) > MAX_QUESTION_CHARS:
        raise _row_error(where, f"field {field!r} holds {len(text):,} characters, past the {MAX_QUESTION_CHARS:,} "
                                "a question may have (data.MAX_QUESTION_CHARS: more than a model's context)")  # fmt: skip
    return text


def _row_id(value: object) -> object:
    """An id field as a uid reads it: a missing cell (None, or NaN as pandas / parquet float columns
    hold it) is no id, so rows without one fall back to file and row instead of sharing "nan"; a
    whole float (70.0, an id column read as floats) is the integer it holds."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return int(value) if value.is_integer() else value
    return value


def _text_field(row: dict, field: str, where: str) -> str:
    if field not in row or row[field] is None:
        raise _row_error(where, f"missing field {field!r}")
    value = row[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _row_error(where, f"field {field!r} must be a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):  # a missing cell read by pandas/parquet
        what = "a missing value" if math.isnan(value) else "not a finite number"
        raise _row_error(where, f"field {field!r} is {value} ({what}), not text")
    text = str(value)
    if not text.strip():
        raise _row_error(where, f"field {field!r} is empty")
    return text


# ---------------------------------------------------------------------------------------------
# Per-benchmark row mapping

_BBH_OPTION = re.compile(r"^\(([A-Z])\)\s?(.*)$")


def bbh_options(question: str) -> tuple[str, ...] | None:
    """The "(A) text" option lines after "Options:" in a BBH input, in letter order, or None."""
    _, sep, tail = question.rpartition("Options:")
    if not sep:
        return None
    options: list[str] = []
    for line in tail.strip().split("\n"):
        match = _BBH_OPTION.match(line.strip())
        if not match or match.group(1) != chr(ord("A") + len(options)):
            return None
        options.append(match.group(2).strip())
    return tuple(options) or None


def _option_target(gold: str, options: tuple[str, ...]) -> str:
    """A lettered question's target as "(X)", BBH's own form, when it is written otherwise: "(a)",
    one option's text, or a bare "A", read as the scorer reads an answer (`scoring.option_letter`).
    Any other target is kept as written, a literal: three upstream rows (movie_recommendation 163,
    ruin_names 99 and 144) have options split wrongly at a comma, so their targets name none."""
    from meshheal_jax.scoring import option_letter  # scoring imports this module

    letter = option_letter(gold, options, letters=string.ascii_uppercase)
    return f"({letter})" if letter else gold


def map_bbh_row(row: dict, task_type: str, where: str, uid: str = "") -> Record:
    question = _question_field(row, "input", where)
    gold = _text_field(row, "target", where).strip()
    options = bbh_options(question)
    if options is not None:
        gold = _option_target(gold, options)
    letter = re.fullmatch(r"\(([A-Z])\)", gold)
    if letter and options is not None and ord(letter.group(1)) - ord("A") >= len(options):
        raise _row_error(
            where, f"target {gold!r} is not one of the question's options (A)-({chr(64 + len(options))})"
        )
    return Record(question, task_type, gold, options, uid, where)


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _braces(text: str):
    """(position, brace) of each unescaped `{` and `}` in text (a brace after an odd run of
    backslashes, `\\{`, is escaped; `\\\\{` is not)."""
    backslashes = 0
    for i, ch in enumerate(text):
        if ch == "\\":
            backslashes += 1
            continue
        escaped, backslashes = backslashes % 2 == 1, 0
        if not escaped and ch in "{}":
            yield i, ch


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each unescaped `{` -> position of its matching `}`, in one pass over text."""
    closing: dict[int, int] = {}
    open_at: list[int] = []
    for i, ch in _braces(text):
        if ch == "{":
            open_at.append(i)
        elif open_at:
            closing[open_at.pop()] = i
    return closing


def balanced_braces(text: str) -> bool:
    """Whether every unescaped `{` of text closes and no `}` closes nothing."""
    depth = 0
    for _, ch in _braces(text):
        depth += 1 if ch == "{" else -1
        if depth < 0:
            return False
    return depth == 0


def _complete_boxes(text: str) -> list[tuple[int, int, int]]:
    """(start of the `\\boxed`, start of its content, position of its closing `}`) of every complete
    `\\boxed{...}` / `\\fbox{...}` in text, in order; one pass over text for the braces."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return []
    closing = _closing_braces(text)
    return [(m.start(), m.end(), closing[m.end() - 1]) for m in matches if m.end() - 1 in closing]


def last_boxed_span(text: str) -> tuple[int, str] | None:
    """(start of the `\\boxed`, content) of the last complete `\\boxed{...}` / `\\fbox{...}`.

    Braces are balanced; escaped braces `\\{` `\\}` do not nest. A `\\boxed` whose braces never
    close is skipped in favour of an earlier complete one. None if there is none. Linear in the
    text's length, however many `\\boxed{` never close.
    """
    boxes = _complete_boxes(text)
    if not boxes:
        return None
    start, begin, end = boxes[-1]
    return start, text[begin:end].strip()


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """(start of the `\\boxed`, end past its `}`, content) of every complete `\\boxed{...}` /
    `\\fbox{...}` in text, in order (braces as in last_boxed_span)."""
    return [(start, end + 1, text[begin:end].strip()) for start, begin, end in _complete_boxes(text)]


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` in text (balanced braces), or None."""
    span = last_boxed_span(text)
    return None if span is None else span[1]


def map_math_row(row: dict, where: str, fallback_uid: str = "") -> Record:
    question = _question_field(row, "problem", where)
    if row.get("type") is None and row.get("subject") is None:
        raise _row_error(where, "missing field 'type' (MATH) or 'subject' (MATH-500): the task type")
    task_type = _text_field(row, "type" if row.get("type") is not None else "subject", where).strip()
    answer = row.get("answer")
    if answer is not None and not (isinstance(answer, float) and math.isnan(answer)) and str(answer).strip():
        gold = _text_field(row, "answer", where).strip()  # a string or a number, never a list or a table
        if not balanced_braces(gold):
            raise _row_error(
                where, f"field 'answer' {gold[:80]!r} has unbalanced braces (cut short or garbled)"
            )
    else:
        if row.get("solution") is None:
            given = "empty field 'answer'" if answer is not None else "missing field 'answer'"
            raise _row_error(where, f"{given} (and no 'solution' to take its \\boxed{{}} from)")
        solution = _text_field(row, "solution", where)
        span = last_boxed_span(solution)
        if span is not None and any(m.start() > span[0] for m in _BOXED.finditer(solution)):
            raise _row_error(where, "the last \\boxed{ in 'solution' never closes (a cut solution?): its gold "
                             "answer is unknown")  # fmt: skip
        gold = None if span is None else span[1]
        if gold is None or not gold:
            raise _row_error(where, "no 'answer' field and no complete \\boxed{...} in 'solution'")
    unique_id, idx = _row_id(row.get("unique_id")), _row_id(row.get("idx"))
    if unique_id not in (None, ""):
        uid = str(unique_id)
    elif idx is not None:
        uid = f"{task_type}/idx:{idx}"
    else:
        uid = fallback_uid
    return Record(question, task_type, gold, None, uid, where)


def map_mmlu_pro_row(row: dict, where: str, fallback_uid: str = "") -> Record:
    question = _question_field(row, "question", where)
    task_type = _text_field(row, "category", where).strip()
    letter = _text_field(row, "answer", where).strip().upper()
    if "options" not in row or row["options"] is None:
        raise _row_error(where, "missing field 'options'")
    raw = row["options"]
    if isinstance(raw, (str, Mapping)) or not isinstance(raw, Iterable):
        raise _row_error(where, f"field 'options' must be a list of strings, got {type(raw).__name__}")
    raw = list(raw)
    if not raw or not all(isinstance(o, str) for o in raw):
        raise _row_error(where, "field 'options' must be a non-empty list of strings")
    if not all(o.strip() for o in raw):
        raise _row_error(where, "field 'options' has an empty option")
    if len(raw) > len(MMLU_PRO_LETTERS):
        raise _row_error(
            where, f"field 'options' has {len(raw)} entries, at most {len(MMLU_PRO_LETTERS)} allowed"
        )
    # Strip: a leading space on the gold option alone would give the answer away (data README).
    options = tuple(o.strip() for o in raw)
    if len(letter) != 1 or letter not in MMLU_PRO_LETTERS[: len(options)]:
        last = MMLU_PRO_LETTERS[len(options) - 1]
        raise _row_error(where, f"field 'answer' = {row['answer']!r} is not one of the letters A-{last}")
    # answer_index is not consulted: the letter is trusted (question 3983 disagrees, the letter is right).
    qid = _row_id(row.get("question_id"))
    uid = f"qid:{qid}" if qid is not None else fallback_uid
    return Record(question, task_type, letter, options, uid, where)


# ---------------------------------------------------------------------------------------------
# Profile filtering


def _profile_for(dataset: str, profile: Profile | str | Path | None) -> Profile:
    if dataset not in DATASETS:
        raise MeshHealError(f"unknown dataset {dataset!r}; known: {list(DATASETS)}")
    if profile is None:
        return load_profile(dataset)
    if isinstance(profile, Profile):
        return profile
    return load_profile(profile)


class TaskTypeWarning(MeshHealWarning):
    """Data rows left out because their task type only nearly matches one of the profile's."""


def filter_to_profile(records: Iterable[Record], profile: Profile, source: str) -> list[Record]:
    """Keep the records of the profile's task types; every task type must have at least one. Rows
    of other types are left out (MMLU-Pro's other categories); one whose type differs from a
    profile type only in case, spaces, '-' or '_' is left out with a TaskTypeWarning."""
    wanted = set(profile.task_types)
    kept: list[Record] = []
    found: Counter[str] = Counter()
    for rec in records:
        found[rec.task_type] += 1
        if rec.task_type in wanted:
            kept.append(rec)
    loose = {name_key(t): t for t in wanted}
    near = sorted(t for t in found if t not in wanted and name_key(t) in loose)
    if near:
        listed = ", ".join(f"{t!r} ({found[t]} rows; the profile's {loose[name_key(t)]!r})" for t in near)
        warnings.warn(f"{source}: rows left out, their task type is not written as the profile's: {listed}",
                      TaskTypeWarning, stacklevel=2)  # fmt: skip
    missing = [t for t in profile.task_types if t not in found]
    if missing:
        listed = sorted(found)
        shown = ", ".join(repr(t) for t in listed[:20]) + (" ..." if len(listed) > 20 else "")
        raise MeshHealError(
            f"{source}: no {profile.dataset} questions of task type {missing[0]!r} required by the profile"
            f" ({len(missing)} profile type(s) missing: {missing}); task types in the data: [{shown}]"
        )
    order = {t: i for i, t in enumerate(profile.task_types)}
    kept.sort(key=lambda r: order[r.task_type])  # stable: file order within a type
    return kept


# ---------------------------------------------------------------------------------------------
# Local files


def _bbh_task_dir(root: Path, tasks: Sequence[str]) -> Path:
    candidates = [root, root / "bbh", root / "bbh" / "bbh"]
    for folder in candidates:
        if folder.is_dir() and any((folder / f"{t}{s}").is_file() for t in tasks for s in DATA_SUFFIXES):
            return folder
    raise MeshHealError(
        f"{root}: no BBH task files found (looked for <task>.json|jsonl|parquet of the profile's task types,"
        f" e.g. {tasks[0]}.json, in {', '.join(str(c) for c in candidates)})"
    )


def _load_local_bbh(root: Path, profile: Profile) -> list[Record]:
    if root.is_file():
        raise MeshHealError(f"{root}: BBH data must be a folder of <task>.json files (task type = file stem)")
    folder = _bbh_task_dir(root, profile.task_types)
    records: list[Record] = []
    for task in profile.task_types:
        files = [folder / f"{task}{s}" for s in DATA_SUFFIXES if (folder / f"{task}{s}").is_file()]
        if len(files) > 1:
            raise MeshHealError(f"{folder}: task type {task!r} has {len(files)} files ({', '.join(f.name for f in files)});"
                                " keep one")  # fmt: skip
        if not files:
            present = sorted(p.stem for p in folder.iterdir() if p.suffix in DATA_SUFFIXES and p.is_file())
            raise MeshHealError(
                f"{folder}: no file for task type {task!r} required by the BBH profile"
                f" (looked for {task}.json/.jsonl/.parquet); tasks present: {present}"
            )
        path = files[0]
        for n, row in iter_rows(path):
            records.append(map_bbh_row(row, task, f"{path}, row {n}", uid=f"{task}/{n - 1}"))
    return records


def resolve_data_file(dataset: str, path: Path) -> Path:
    """The data file for MATH / MMLU-Pro: `path` itself, or a known file name inside the folder."""
    if path.is_file():
        return path
    if not path.exists():
        raise MeshHealError(f"data path {path} does not exist")
    if not path.is_dir():
        raise MeshHealError(f"data path {path} is neither a file nor a folder")
    folders = [f for f in (path / dataset, path) if f.is_dir()]
    for name in DEFAULT_FILES[dataset]:
        for folder in folders:
            if (folder / name).is_file():
                return folder / name
    for folder in folders:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if len(files) == 1:
            return files[0]
    raise MeshHealError(
        f"{path}: cannot tell which {dataset} file to load (looked for {', '.join(DEFAULT_FILES[dataset])}"
        f" in {' and '.join(str(f) for f in folders)}); pass the file itself"
    )


def load_local(dataset: str, path: str | Path, profile: Profile | str | Path | None = None) -> list[Record]:
    """Records of the profile's task types from local files in the benchmark's own layout.

    path: BBH, a folder holding <task>.json files (or its parent, e.g. a data root with bbh/bbh/);
    MATH / MMLU-Pro, a json/jsonl/parquet file or a folder holding one (see DEFAULT_FILES).
    """
    prof = _profile_for(dataset, profile)
    root = Path(path).expanduser()
    if dataset == "bbh":
        return filter_to_profile(_load_local_bbh(root, prof), prof, str(root))
    file = resolve_data_file(dataset, root)
    mapper = map_math_row if dataset == "math" else map_mmlu_pro_row
    try:
        records = [mapper(row, f"{file}, row {n}", f"{file.name}:{n}") for n, row in iter_rows(file)]
    except MeshHealError as err:
        if file == root or file.name in DEFAULT_FILES[dataset]:
            raise
        raise MeshHealError(f"{err} ({file.name} was taken as the {dataset} file, being the only data file"
                            f" in {file.parent}; pass the right file itself)") from None  # fmt: skip
    return filter_to_profile(records, prof, str(file))


def load_sample(dataset: str, profile: Profile | str | Path | None = None) -> list[Record]:
    """The small verbatim sample shipped with the package (sample_data/NOTICE.md)."""
    return load_local(dataset, SAMPLE_DIR, profile)


# ---------------------------------------------------------------------------------------------
# Hugging Face hub


def hub_config_name(task_type: str) -> str:
    """Hub config of a task type for per-type hub datasets: 'Counting & Probability' ->
    'counting_and_probability' (EleutherAI/hendrycks_math); BBH task names are unchanged."""
    return re.sub(r"\s+", "_", task_type.strip().lower().replace("&", "and"))


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise MeshHealError(
            "loading from the Hugging Face hub needs the optional 'datasets' package:"
            " pip install -e .[live]  (or pass local files with --data DIR)"
        ) from None
    return datasets


def _hub_rows(
    datasets_module, hub_id: str, config: str | None, split: str, **kwargs
) -> Iterator[tuple[int, dict]]:
    where = f"{hub_id}" + (f" config {config!r}" if config else "") + f" split {split!r}"
    try:
        table = datasets_module.load_dataset(hub_id, config, split=split, **kwargs)
    except Exception as err:  # noqa: BLE001 - network, auth, missing config/split: one message
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MeshHealError(f"cannot load {where} from the Hugging Face hub: {first}") from None
    for n, row in enumerate(table, 1):
        yield n, dict(row)


def hub_commit(hub_id: str, revision: str | None = None) -> str | None:
    """The commit of the Hugging Face dataset repo `hub_id` that `revision` (a branch, tag or commit;
    default the main branch) names, asked of the hub (`huggingface_hub`), so a run can read and
    record that one commit. None when it cannot be asked: offline (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set), no `huggingface_hub`, or any error; the data is then read at
    `revision` as given, and no commit is recorded."""
    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):  # fmt: skip
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(hub_id, revision=revision, timeout=10).sha
    except Exception:  # noqa: BLE001 - no network, no package, unknown id: the load says what is wrong
        return None


def load_hub(
    dataset: str,
    hub_id: str | None = None,
    split: str | None = None,
    profile: Profile | str | Path | None = None,
    config: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
) -> list[Record]:
    """Records of the profile's task types from the Hugging Face hub (needs `datasets`).

    Defaults: BBH `lukaemon/bbh` (one config per task, split test); MATH
    `EleutherAI/hendrycks_math` (one config per subject, split test: the 5,000-problem test
    split); MMLU-Pro `TIGER-Lab/MMLU-Pro` (split test). Other hub ids are loaded as one table
    (`config` optional) with the same field mapping as local files, e.g. HuggingFaceH4/MATH-500.
    """
    prof = _profile_for(dataset, profile)
    hub_id = hub_id or DEFAULT_HUB_IDS[dataset]
    split = split or DEFAULT_SPLITS[dataset]
    datasets_module = _import_datasets()
    kwargs = {k: v for k, v in (("revision", revision), ("cache_dir", cache_dir)) if v is not None}
    per_type = config is None and (dataset == "bbh" or hub_id in PER_TYPE_CONFIG_HUB_IDS.get(dataset, ()))
    records: list[Record] = []
    if per_type:
        for task in prof.task_types:
            name = task if dataset == "bbh" else hub_config_name(task)
            for n, row in _hub_rows(datasets_module, hub_id, name, split, **kwargs):
                where = f"hub {hub_id}/{name}[{split}], row {n}"
                if dataset == "bbh":
                    records.append(map_bbh_row(row, task, where, uid=f"{task}/{n - 1}"))
                else:
                    records.append(map_math_row(row, where, fallback_uid=f"{name}/{n - 1}"))
    else:
        if dataset == "bbh":
            raise MeshHealError(
                f"BBH from the hub is read one config per task (as in lukaemon/bbh); got config={config!r}"
            )
        mapper = map_math_row if dataset == "math" else map_mmlu_pro_row
        for n, row in _hub_rows(datasets_module, hub_id, config, split, **kwargs):
            records.append(mapper(row, f"hub {hub_id}[{split}], row {n}", f"{hub_id}:{n}"))
    return filter_to_profile(records, prof, f"hub {hub_id}[{split}]")


# ---------------------------------------------------------------------------------------------
# Question pools and stream picking


def question_pool(records: Iterable[Record], task_types: Sequence[str]) -> tuple[tuple[Record, ...], ...]:
    """Per task type (in the given order, i.e. the stream's type indices) its records, in input order."""
    index = {t: i for i, t in enumerate(task_types)}
    if len(index) != len(task_types):
        raise MeshHealError(f"task types must be distinct: {list(task_types)}")
    pools: list[list[Record]] = [[] for _ in task_types]
    for rec in records:
        if rec.task_type in index:
            pools[index[rec.task_type]].append(rec)
    empty = [t for t, p in zip(task_types, pools) if not p]
    if empty:
        raise MeshHealError(f"no questions of task type {empty[0]!r} in the pool (empty types: {empty})")
    return tuple(tuple(p) for p in pools)


class QuestionPoolWarning(MeshHealWarning):
    """A stream needs more questions of a type than the pool holds: drawn with replacement."""


@dataclasses.dataclass(frozen=True)
class QuestionPick:
    records: tuple[Record, ...]  # (N,) the question of every task
    pool_index: np.ndarray  # (N,) int32: index of the question in its type's pool
    with_replacement: bool  # some type needed more questions than its pool holds
    needed: np.ndarray  # (T,) int64: questions of each type the stream asks for (max id + 1)
    available: np.ndarray  # (T,) int64: pool size of each type
    short_types: tuple[str, ...]  # types drawn with replacement


def question_order(pool_size: int, needed: int, seed: int, dataset_id: int, task_type: int) -> np.ndarray:
    """Pool indices of question ids 0..needed-1 of one type (int64, shape (needed,)).

    Ids below the pool size follow a seeded permutation (no repeats); ids past it are drawn
    uniformly with replacement from a second seeded generator. Both depend only on (seed,
    dataset_id, task_type), so the prefix a shorter stream uses is the same in a longer one.
    """
    perm = np.random.default_rng([QUESTION_SALT, seed, dataset_id, task_type, 0]).permutation(pool_size)
    if needed <= pool_size:
        return perm[:needed]
    extra = np.random.default_rng([QUESTION_SALT, seed, dataset_id, task_type, 1]).integers(
        0, pool_size, size=needed - pool_size
    )
    return np.concatenate([perm, extra])


def pick_questions(
    pool: Sequence[Sequence[Record]],
    task_type: np.ndarray,
    question: np.ndarray,
    seed: int,
    dataset_id: int = 0,
    warn: bool = True,
) -> QuestionPick:
    """The record of every task of a stream (streams.Stream.task_type / .question arrays).

    Question id k of type T is the k-th question of T in a seeded shuffled order of T's pool
    (seeded by seed, dataset_id and T, so methods sharing a seed get the same questions). When
    the stream needs more questions of T than the pool holds, the ids past the pool are drawn
    with replacement: `with_replacement` is set, `short_types` names the types and, unless
    warn=False, a QuestionPoolWarning says so.
    """
    task_type = np.asarray(task_type)
    question = np.asarray(question)
    if task_type.ndim != 1 or task_type.shape != question.shape:
        raise MeshHealError(
            "task_type and question must be 1-D arrays of one length,"
            f" got shapes {task_type.shape} and {question.shape}"
        )
    if seed < 0:
        raise MeshHealError(f"seeds must be >= 0, got {seed}")
    n_types = len(pool)
    if task_type.size and (task_type.min() < 0 or task_type.max() >= n_types):
        raise MeshHealError(
            f"task type indices must lie in 0..{n_types - 1}, got {task_type.min()}..{task_type.max()}"
        )
    if question.size and question.min() < 0:
        raise MeshHealError(f"question ids must be >= 0, got {question.min()}")
    available = np.array([len(p) for p in pool], dtype=np.int64)
    if (available == 0).any():
        raise MeshHealError(f"the pool of task type index {int(np.argmin(available))} is empty")
    needed = np.zeros(n_types, dtype=np.int64)
    np.maximum.at(needed, task_type.astype(np.int64), question.astype(np.int64) + 1)
    pool_index = np.zeros(task_type.shape, dtype=np.int32)
    for t in range(n_types):
        mask = task_type == t
        if not mask.any():
            continue
        order = question_order(int(available[t]), int(needed[t]), seed, dataset_id, t)
        pool_index[mask] = order[question[mask]]
    short = np.flatnonzero(needed > available)
    short_types = tuple(pool[t][0].task_type for t in short)
    if len(short) and warn:
        detail = "; ".join(
            f"{pool[t][0].task_type!r}: needs {needed[t]}, pool holds {available[t]}" for t in short
        )
        warnings.warn(
            f"stream needs more questions than the pool holds: drawing with replacement past the pool"
            f" ({detail})",
            QuestionPoolWarning,
            stacklevel=1,  # one place for every caller: Python's default filter prints a text once
        )
    records = tuple(pool[int(t)][int(i)] for t, i in zip(task_type, pool_index))
    return QuestionPick(records, pool_index, bool(len(short)), needed, available, short_types)


CHARS_PER_TOKEN = 4  # spec/emulator.md: an emulated question's tokens are its characters / 4


def question_tokens(records: Sequence[Record], dataset: str, tokenizer=None) -> np.ndarray:
    """(N,) int32: the tokens of each record's question as the prompts show it
    (prompts.format_question: MMLU-Pro's options included): counted by `tokenizer` (a
    `tokenizers.Tokenizer`, `load_tokenizer`; no special tokens) when one is configured, else as
    characters / 4 rounded up (spec/emulator.md; docs/decisions.md E7). At least 1 each."""
    from meshheal_jax import prompts  # prompts reads this module's constants

    texts = [
        prompts.format_question(prompts.TaskText(dataset, r.question, r.task_type, r.options))
        for r in records
    ]
    if tokenizer is not None:
        counts = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        counts = [-(-len(text) // CHARS_PER_TOKEN) for text in texts]
    return np.array([max(1, c) for c in counts], dtype=np.int32)


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str):
    """The `tokenizers.Tokenizer` that counts question tokens (spec/emulator.md: "characters / 4
    unless a tokenizer is configured"): a tokenizer.json file, a model folder holding one (e.g. a
    downloaded gpt-oss-120b), or a Hugging Face model id (its tokenizer.json, from the hub or the
    local cache). Bad input raises MeshHealError naming it."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MeshHealError("--tokenizer needs the `tokenizers` package: pip install -e .[live]") from None
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise MeshHealError(f"--tokenizer {spec}: the folder holds no tokenizer.json")
    if path.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- the library raises a bare Exception for a malformed file
            raise MeshHealError(f"--tokenizer {spec}: not a tokenizers JSON file ({e})") from None
        return _counting(tokenizer)
    if path.suffix == ".json" or spec.startswith((".", "/", "~")):
        raise MeshHealError(f"--tokenizer {spec}: no such file or folder")
    try:
        return _counting(Tokenizer.from_pretrained(spec))
    except Exception as e:  # noqa: BLE001 -- offline, an unknown id, no tokenizer.json in the repo
        raise MeshHealError(f"--tokenizer {spec}: not a file or folder here, and its tokenizer.json could not "
                            f"be read from the Hugging Face hub ({type(e).__name__}: {e})") from None  # fmt: skip


def _counting(tokenizer):
    """The tokenizer without the padding and truncation its file may set (a batch padded to its
    longest text, or cut at a length, would miscount)."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer
