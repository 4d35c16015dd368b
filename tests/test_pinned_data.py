"""Benchmark loading that a mutation audit of `data.py` could change without any other test failing
(module docstring: a malformed row is a one-line MeshHealError naming file, row and field;
docs/decisions.md X10, L9): the file shapes `iter_rows` refuses, the row checks of MATH golds and
MMLU-Pro options and letters, the stable uids, the near-match warning, the hint an error carries
only for a file the loader chose, the hub loader's BBH configs, uids and revision, when
`hub_commit` counts as offline, and the pools and seeded question order of `pick_questions`. Each
test names the mutation it holds."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from meshheal_jax import data
from meshheal_jax.errors import MeshHealError
from meshheal_jax.topology import load_profile

PROFILE_TYPES = {ds: load_profile(ds).task_types for ds in data.DATASETS}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_rows() -> list[dict]:
    return [
        {"problem": f"{t}?", "type": t, "answer": str(i + 1)} for i, t in enumerate(PROFILE_TYPES["math"])
    ]


def mmlu_rows() -> list[dict]:
    return [
        {"question_id": i + 1, "question": f"{t}?", "options": ["x", "y", "z"], "answer": "B", "category": t}
        for i, t in enumerate(PROFILE_TYPES["mmlu_pro"])
    ]


# ----------------------------------------------------------------------------------------------
# File shapes: iter_rows


def test_a_jsonl_line_nested_too_deeply_names_its_row(tmp_path):
    """A line json cannot parse for its depth is a row error, not a RecursionError traceback.
    Mutation: the RecursionError branch of the .jsonl reader dropped."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(math_rows()[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(MeshHealError, match=r"m\.jsonl, row 2: JSON nested too deeply"):
        data.load_local("math", path)


def test_json_files_that_hold_no_list_of_row_objects_are_refused(tmp_path):
    """.json: "a list of rows, or an object with an `examples` list". Mutations: the list check
    dropped (an object without `examples` crashed), the per-row object check dropped, the
    RecursionError branch of the .json reader dropped."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"rows": math_rows()}))
    with pytest.raises(
        MeshHealError, match=r"m\.json: expected a list of rows or an object with an 'examples'"
    ):
        data.load_local("math", path)
    path.write_text(json.dumps([math_rows()[0], "a question"]))
    with pytest.raises(MeshHealError, match=r"m\.json, row 2: expected a JSON object, got str"):
        data.load_local("math", path)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MeshHealError, match=r"m\.json: JSON nested too deeply"):
        data.load_local("math", path)


def test_a_file_that_is_not_parquet_is_one_error_naming_it(tmp_path):
    """A .parquet file polars cannot read is one line naming the file. Mutation: polars' own
    exception re-raised."""
    path = tmp_path / "test.parquet"
    path.write_text('{"problem": "not parquet"}\n')
    with pytest.raises(MeshHealError, match=r"cannot read .*test\.parquet as parquet: ") as err:
        data.load_local("math", path)
    assert "\n" not in str(err.value)


def test_a_folder_whose_one_file_has_an_upper_case_suffix_loads(tmp_path):
    """decisions L9: a folder's one data file is found whatever the case of its suffix, "as
    `iter_rows` reads it". Mutation: iter_rows compares the suffix as written (".JSONL" refused)."""
    write_jsonl(tmp_path / "DATA.JSONL", math_rows())
    records = data.load_local("math", tmp_path)
    assert [r.gold for r in records] == [str(i + 1) for i in range(len(PROFILE_TYPES["math"]))]


# ----------------------------------------------------------------------------------------------
# Row checks


def test_bbh_options_are_the_lines_after_the_last_options_label():
    """bbh_options: the "(A) text" lines after "Options:" that close the input; a question that says
    "Options:" earlier still has its options. Mutation: the first "Options:" taken (None here)."""
    question = "Options: read them all first.\nWhich one is red?\nOptions:\n(A) apple\n(B) sky"
    assert data.bbh_options(question) == ("apple", "sky")
    record = data.map_bbh_row({"input": question, "target": "apple"}, "navigate", "navigate.json, row 1")
    assert record.gold == "(A)" and record.options == ("apple", "sky")


def test_a_math_answer_with_a_brace_that_closes_nothing_is_refused(tmp_path):
    """balanced_braces: "no `}` closes nothing"; a gold that fails it is a row error (decisions L9).
    Mutation: only the final depth checked ("1}{2" passed)."""
    assert not data.balanced_braces("1}{2") and data.balanced_braces("\\frac{1}{2}")
    rows = math_rows()
    rows[1]["answer"] = "1}{2"
    with pytest.raises(
        MeshHealError, match=r"m\.jsonl, row 2: field 'answer' '1\}\{2' has unbalanced braces"
    ):
        data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows))


def test_an_empty_boxed_answer_is_no_gold(tmp_path):
    """A MATH row whose solution's last \\boxed{} is empty has no gold: a row error. Mutation: an
    empty box accepted (gold "")."""
    rows = math_rows()
    del rows[2]["answer"]
    rows[2]["solution"] = "So the answer is $\\boxed{ }$."
    with pytest.raises(MeshHealError, match=r"m\.jsonl, row 3: no 'answer' field and no complete \\boxed"):
        data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows))


@pytest.mark.parametrize(
    "options, message",
    [
        ([], r"field 'options' must be a non-empty list of strings"),  # not "letters A-J"
        ([1, 2, 3], r"field 'options' must be a non-empty list of strings"),  # not AttributeError
        ([f"o{i}" for i in range(11)], r"field 'options' has 11 entries, at most 10 allowed"),
    ],
)
def test_mmlu_pro_options_that_letters_cannot_name_are_refused(tmp_path, options, message):
    """MMLU-Pro options: a non-empty list of strings, at most ten (letters A-J). Mutations: the
    empty check dropped, the string check dropped, the at-most-ten check dropped."""
    rows = mmlu_rows()
    rows[2]["options"] = options
    with pytest.raises(MeshHealError, match=rf"x\.jsonl, row 3: {message}"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))


def test_an_mmlu_pro_answer_of_two_letters_is_refused(tmp_path):
    """The answer is one letter of the options. Mutation: the one-character check dropped ("AB", a
    substring of "ABC", passed as the gold)."""
    rows = mmlu_rows()
    rows[1]["answer"] = "AB"
    with pytest.raises(MeshHealError, match=r"row 2: field 'answer' = 'AB' is not one of the letters A-C"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))


def test_questions_past_the_length_cap_are_refused_in_every_benchmark(tmp_path):
    """decisions L9: a question longer than MAX_QUESTION_CHARS is a row error naming file, row and
    field, for MMLU-Pro's `question` and BBH's `input` as for MATH's `problem`. Mutations: those
    two read as plain text fields."""
    rows = mmlu_rows()
    rows[0]["question"] = "x" * (data.MAX_QUESTION_CHARS + 1)
    with pytest.raises(MeshHealError, match=r"x\.jsonl, row 1: field 'question' holds 400,001 characters"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    with pytest.raises(MeshHealError, match=r"t\.json, row 4: field 'input' holds 400,001 characters"):
        data.map_bbh_row(
            {"input": "x" * (data.MAX_QUESTION_CHARS + 1), "target": "Yes"}, "t", "t.json, row 4"
        )


# ----------------------------------------------------------------------------------------------
# Uids, task types and the loader's hint


def test_uids_are_question_id_even_zero_else_file_and_row(tmp_path):
    """Record.uid: "qid:70" for MMLU-Pro, else "file:row". Mutations: question_id 0 read as absent;
    the row number left out of the fallback (every row one uid)."""
    rows = mmlu_rows()
    rows[0]["question_id"] = 0
    uids = [r.uid for r in data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))]
    assert uids[0] == "qid:0"
    for row in rows:
        del row["question_id"]
    uids = [r.uid for r in data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))]
    assert uids == [f"x.jsonl:{n}" for n in range(1, len(rows) + 1)]


def test_a_missing_id_read_as_nan_is_no_id_and_a_whole_float_id_is_an_integer(tmp_path):
    """An id column read as floats (pandas / parquet) holds NaN for a missing id and 70.0 for 70: the
    NaN rows fall back to file and row (they once all became "qid:nan", one uid), 70.0 reads as
    "qid:70" as the integer column gives it; the same for MATH's unique_id and idx."""
    rows = mmlu_rows()
    for row, qid in zip(rows, (70.0, float("nan"), float("nan"))):
        row["question_id"] = qid
    records = data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    uids = {r.uid for r in records}
    assert {"qid:70", "x.jsonl:2", "x.jsonl:3"} <= uids and len(uids) == len(rows)
    rows = math_rows()
    rows[0]["unique_id"], rows[0]["idx"] = float("nan"), 12.0
    rows[1]["unique_id"] = float("nan")
    records = data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows))
    assert {f"{rows[0]['type']}/idx:12", "m.jsonl:2"} <= {r.uid for r in records}


def test_a_type_that_differs_from_the_profiles_only_in_case_warns(tmp_path):
    """decisions X10: a row whose type differs from a profile type only in case, spaces, '-' or '_'
    is left out with a TaskTypeWarning. Mutation: case not folded (left out without a word)."""
    rows = [*math_rows(), {"problem": "p", "type": "ALGEBRA", "answer": "1"}]
    with pytest.warns(data.TaskTypeWarning, match=r"'ALGEBRA' \(1 rows; the profile's 'Algebra'\)"):
        records = data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows))
    assert len(records) == len(math_rows())


def test_an_error_in_a_file_passed_by_name_claims_no_guess(tmp_path):
    """The "(... was taken as the <dataset> file, being the only data file ...)" hint is for a file
    the loader chose in a folder, not one the user named. Mutation: the hint added to a named file's
    errors."""
    rows = mmlu_rows()
    del rows[1]["category"]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    with pytest.raises(MeshHealError, match=r"mine\.jsonl, row 2: missing field 'category'") as err:
        data.load_local("mmlu_pro", path)
    assert "was taken as" not in str(err.value)
    with pytest.raises(MeshHealError, match=r"\(mine\.jsonl was taken as the mmlu_pro file"):
        data.load_local("mmlu_pro", tmp_path)


# ----------------------------------------------------------------------------------------------
# The hub loader (a stub `datasets`)


def _bbh_sample_tables() -> dict:
    return {
        ("lukaemon/bbh", task): json.loads((data.SAMPLE_DIR / "bbh" / "bbh" / f"{task}.json").read_text())[
            "examples"
        ]
        for task in PROFILE_TYPES["bbh"]
    }


def _stub_datasets(monkeypatch, tables) -> list:
    calls = []

    def load_dataset(hub_id, config=None, split=None, **kwargs):
        calls.append((hub_id, config, split, kwargs))
        return tables[(hub_id, config)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hub_bbh_uids_and_revision_match_the_local_files(monkeypatch):
    """Record.uid is stable whatever the source: BBH's hub rows get the uids its local files give
    ("navigate/0" for the first), and every config is read at the revision given (decisions L5).
    Mutations: the hub's uids counted from 1; revision not passed to load_dataset."""
    calls = _stub_datasets(monkeypatch, _bbh_sample_tables())
    hub = data.load_hub("bbh", revision="a" * 40)
    assert [r.uid for r in hub] == [r.uid for r in data.load_sample("bbh")]
    assert "navigate/0" in {r.uid for r in hub}
    assert [c[3] for c in calls] == [{"revision": "a" * 40}] * len(PROFILE_TYPES["bbh"])


def test_hub_bbh_with_one_config_is_refused(monkeypatch):
    """BBH from the hub is read one config per task: a config given is refused, not ignored and not
    read as another benchmark's rows. Mutations: `config is None` left out of the per-type test (the
    config silently ignored); the BBH refusal dropped."""
    calls = _stub_datasets(monkeypatch, _bbh_sample_tables())
    with pytest.raises(
        MeshHealError, match=r"BBH from the hub is read one config per task .*config='navigate'"
    ):
        data.load_hub("bbh", config="navigate")
    assert calls == []


@pytest.mark.parametrize("value", ["true", "YES", "on"])
def test_hub_commit_is_not_asked_when_either_offline_variable_is_set(monkeypatch, value):
    """hub_commit: None, without asking the hub, when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set
    (as huggingface_hub reads them: 1, true, yes or on, any case). Mutation: only "1" read as set."""
    asked = []

    class HfApi:  # a stand-in for huggingface_hub's client
        def dataset_info(self, repo_id, revision=None, timeout=None):
            asked.append(repo_id)
            return types.SimpleNamespace(sha="b" * 40)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=HfApi))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", value)
    assert data.hub_commit("TIGER-Lab/MMLU-Pro") is None
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert data.hub_commit("TIGER-Lab/MMLU-Pro") is None
    assert asked == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert data.hub_commit("TIGER-Lab/MMLU-Pro") == "b" * 40  # online: asked


# ----------------------------------------------------------------------------------------------
# Question pools and their seeded order


def test_a_question_pool_refuses_a_task_type_named_twice():
    """question_pool: task types must be distinct (a type's index is its stream index). Mutation:
    the check dropped (the second name's pool silently empty or shadowed)."""
    records = data.load_sample("math")
    with pytest.raises(MeshHealError, match=r"task types must be distinct: \['Algebra', 'Algebra'\]"):
        data.question_pool(records, ("Algebra", "Algebra"))


def test_question_order_is_seeded_by_dataset_id_and_task_type():
    """pick_questions: the order of T's pool is "seeded by seed, dataset_id and T". Mutations:
    dataset_id left out of the seed; the task type left out (two types of one pool size took the
    same order)."""
    pool = tuple(tuple(data.Record(f"q{t}-{i}", f"T{t}", str(i)) for i in range(50)) for t in range(2))
    task_type = np.repeat(np.arange(2), 50)
    question = np.tile(np.arange(50), 2)
    first = data.pick_questions(pool, task_type, question, seed=3, dataset_id=1).pool_index
    other = data.pick_questions(pool, task_type, question, seed=3, dataset_id=2).pool_index
    assert first[:50].tolist() != first[50:].tolist()  # types 0 and 1 differ
    assert first.tolist() != other.tolist()  # datasets 1 and 2 differ
    assert sorted(first[:50].tolist()) == list(range(50))  # still a permutation


def test_a_negative_task_type_index_is_refused():
    """Task type indices must lie in 0..T-1. Mutation: only the upper bound checked (-1 silently
    read as the last type)."""
    pool = data.question_pool(data.load_sample("bbh"), PROFILE_TYPES["bbh"])
    with pytest.raises(MeshHealError, match=r"task type indices must lie in 0\.\.6, got -1\.\.0"):
        data.pick_questions(pool, np.array([0, -1]), np.array([0, 0]), seed=0)


def test_picking_from_a_pool_with_an_empty_type_is_refused():
    """pick_questions refuses a pool with an empty type, used by the stream or not. Mutation: the
    check dropped (the empty type went unnoticed)."""
    pool = ((data.Record("q", "Algebra", "1"),), ())
    with pytest.raises(MeshHealError, match=r"the pool of task type index 1 is empty"):
        data.pick_questions(pool, np.array([0]), np.array([0]), seed=0)
