"""Benchmark loaders (meshheal_jax.data): shipped samples, the real data in ../shared/data when
present, malformed rows, missing task types, the hub loader's wiring, and question picking."""

from __future__ import annotations

import json
import sys
import types
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import data
from meshheal_jax.errors import MeshHealError
from meshheal_jax.scoring import score
from meshheal_jax.streams import make_stream
from meshheal_jax.topology import load_profile

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is absent")

PROFILE_TYPES = {ds: load_profile(ds).task_types for ds in data.DATASETS}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_rows(types_=None, per_type: int = 1) -> list[dict]:
    rows = []
    for t in types_ or PROFILE_TYPES["math"]:
        for i in range(per_type):
            rows.append({"problem": f"{t} problem {i}", "type": t, "solution": f"so $\\boxed{{{i + 1}}}$."})
    return rows


def mmlu_rows(per_type: int = 1) -> list[dict]:
    return [
        {"question_id": i, "question": f"{t}?", "options": ["x", " y", "z "], "answer": "B", "category": t}
        for i, t in enumerate(PROFILE_TYPES["mmlu_pro"] * per_type)
    ]


# ----------------------------------------------------------------------------------------------
# The shipped samples


@pytest.mark.parametrize("dataset", data.DATASETS)
def test_sample_covers_every_profile_task_type(dataset):
    records = data.load_sample(dataset)
    counts = Counter(r.task_type for r in records)
    assert set(counts) == set(PROFILE_TYPES[dataset])
    assert min(counts.values()) >= 4
    assert all(r.question.strip() and r.gold.strip() and r.source for r in records)
    assert len({r.uid for r in records}) == len(records)
    # records come grouped in profile order
    assert [r.task_type for r in records] == sorted(
        (r.task_type for r in records), key=PROFILE_TYPES[dataset].index
    )


def test_sample_is_small_and_carries_its_notice():
    files = [p for p in data.SAMPLE_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 300_000
    notice = (data.SAMPLE_DIR / "NOTICE.md").read_text()
    for needle in ("BIG-Bench-Hard", "MIT", "Apache-2.0", "MMLU-Pro", "MATH-500", "Hendrycks"):
        assert needle in notice
    for licence in (
        "bbh/LICENSE",
        "math/LICENSE.prm800k",
        "math/LICENSE.math-evaluation-harness",
        "mmlu_pro/LICENSE.TIGER-AI-Lab-MMLU-Pro.Apache-2.0",
    ):
        assert (data.SAMPLE_DIR / licence).is_file()


def test_sample_math_gold_is_the_last_boxed_of_the_solution():
    path = data.SAMPLE_DIR / "math" / "math_test_sample.jsonl"
    rows = [json.loads(line) for line in path.open()]
    assert all("answer" not in r for r in rows)
    records = data.load_local("math", path)
    by_uid = {r.uid: r for r in records}
    assert by_uid["Algebra/idx:0"].gold == "2"
    for row in rows:
        rec = by_uid[f"{row['type']}/idx:{row['idx']}"]
        assert rec.question == row["problem"]
        assert f"\\boxed{{{rec.gold}}}" in row["solution"].replace("\\boxed {", "\\boxed{")


def test_math500_layout_uses_subject_and_answer():
    records = data.load_local("math", data.SAMPLE_DIR / "math" / "math500_sample.jsonl")
    assert Counter(r.task_type for r in records) == {t: 2 for t in PROFILE_TYPES["math"]}
    first = json.loads((data.SAMPLE_DIR / "math" / "math500_sample.jsonl").open().readline())
    rec = next(r for r in records if r.uid == first["unique_id"])
    assert rec.gold == first["answer"] and rec.task_type == first["subject"]


def test_sample_mmlu_pro_strips_options_trusts_letter_and_filters_categories():
    records = data.load_sample("mmlu_pro")
    by_uid = {r.uid: r for r in records}
    raw = {
        r["question_id"]: r
        for r in map(json.loads, (data.SAMPLE_DIR / "mmlu_pro" / "mmlu_pro_test_sample.jsonl").open())
    }
    assert any(r["category"] == "business" for r in raw.values())
    assert all(r.task_type != "business" for r in records)
    # question 3983: letter C, answer_index 1 -> the letter wins
    assert raw[3983]["answer_index"] == 1 and by_uid["qid:3983"].gold == "C"
    # 3544 / 6895: options with stray whitespace are stripped
    for qid in (3544, 6895):
        assert any(o != o.strip() for o in raw[qid]["options"])
        assert by_uid[f"qid:{qid}"].options == tuple(o.strip() for o in raw[qid]["options"])
    for rec in records:
        assert rec.gold in data.MMLU_PRO_LETTERS[: len(rec.options)]


def test_bbh_records_parse_lettered_options_only():
    records = {r.uid: r for r in data.load_sample("bbh")}
    shapes = records["geometric_shapes/0"]
    assert shapes.options[:3] == ("circle", "heptagon", "hexagon") and shapes.gold.startswith("(")
    assert records["navigate/0"].options is None and records["navigate/0"].gold in ("Yes", "No")
    assert records["object_counting/0"].options is None
    assert data.bbh_options("Q\nOptions:\n(A) x\n(C) y") is None  # letters out of order: not options


def test_parquet_and_json_rows_load_like_jsonl(tmp_path):
    src = data.SAMPLE_DIR / "mmlu_pro" / "mmlu_pro_test_sample.jsonl"
    rows = [json.loads(line) for line in src.open()]
    pl.DataFrame(rows).write_parquet(tmp_path / "test.parquet")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    expected = [(r.question, r.task_type, r.gold, r.options) for r in data.load_local("mmlu_pro", src)]
    for path in (tmp_path / "test.parquet", tmp_path, tmp_path / "rows.json"):
        got = [(r.question, r.task_type, r.gold, r.options) for r in data.load_local("mmlu_pro", path)]
        assert got == expected, path
    # BBH task files as jsonl / parquet rows
    bbh_dir = tmp_path / "bbh"
    bbh_dir.mkdir()
    for i, task in enumerate(PROFILE_TYPES["bbh"]):
        examples = json.loads((data.SAMPLE_DIR / "bbh" / "bbh" / f"{task}.json").read_text())["examples"]
        if i % 2:
            pl.DataFrame(examples).write_parquet(bbh_dir / f"{task}.parquet")
        else:
            write_jsonl(bbh_dir / f"{task}.jsonl", examples)
    from_rows = [(r.question, r.task_type, r.gold) for r in data.load_local("bbh", tmp_path)]
    assert from_rows == [(r.question, r.task_type, r.gold) for r in data.load_sample("bbh")]


# ----------------------------------------------------------------------------------------------
# The real data


@needs_shared
def test_shared_bbh_all_profile_tasks():
    records = data.load_local("bbh", SHARED_DATA)
    assert Counter(r.task_type for r in records) == {t: 250 for t in PROFILE_TYPES["bbh"]}
    same = data.load_local("bbh", SHARED_DATA / "bbh" / "bbh")
    assert [r.uid for r in same] == [r.uid for r in records]
    for rec in records:
        if rec.gold.startswith("("):
            assert rec.options is not None and ord(rec.gold[1]) - ord("A") < len(rec.options), rec.uid


@needs_shared
def test_shared_math_full_split_and_boxed_extraction():
    records = data.load_local("math", SHARED_DATA)  # a folder: the full test split with answers
    assert len(records) == 5000
    assert Counter(r.task_type for r in records) == {
        "Algebra": 1187,
        "Intermediate Algebra": 903,
        "Prealgebra": 871,
        "Precalculus": 546,
        "Number Theory": 540,
        "Geometry": 479,
        "Counting & Probability": 474,
    }
    # the verbatim file has no `answer`: the balanced last \boxed{} must give the same golds
    raw = data.load_local("math", SHARED_DATA / "math" / "math_test_5000.jsonl")
    assert [r.gold for r in raw] == [r.gold for r in records]
    assert len({r.uid for r in raw}) == 5000
    assert any("{" in r.gold for r in raw)  # nested braces were exercised
    math500 = data.load_local("math", SHARED_DATA / "math" / "math500_test.jsonl")
    assert len(math500) == 500 and Counter(r.task_type for r in math500)["Geometry"] == 41


@needs_shared
def test_shared_mmlu_pro_test_and_validation_parquet():
    records = data.load_local("mmlu_pro", SHARED_DATA)
    counts = Counter(r.task_type for r in records)
    assert counts == {
        "law": 1101,
        "history": 381,
        "psychology": 798,
        "biology": 717,
        "chemistry": 1132,
        "economics": 844,
        "physics": 1299,
    }
    assert all(o == o.strip() for r in records for o in r.options)
    assert {r.uid: r.gold for r in records}["qid:3983"] == "C"
    assert len({r.uid for r in records}) == len(records)
    parquet = data.load_local("mmlu_pro", SHARED_DATA / "mmlu_pro" / "validation.parquet")
    jsonl = data.load_local("mmlu_pro", SHARED_DATA / "mmlu_pro" / "mmlu_pro_validation.jsonl")
    assert len(parquet) == len(jsonl) == 35  # 5 per profile category
    assert [(r.uid, r.gold, r.task_type) for r in parquet] == [(r.uid, r.gold, r.task_type) for r in jsonl]


@needs_shared
def test_shipped_sample_is_verbatim():
    for sample, source in (
        ("math/math_test_sample.jsonl", "math/math_test_5000.jsonl"),
        ("math/math500_sample.jsonl", "math/math500_test.jsonl"),
        ("mmlu_pro/mmlu_pro_test_sample.jsonl", "mmlu_pro/mmlu_pro_test.jsonl"),
    ):
        source_lines = set((SHARED_DATA / source).read_bytes().split(b"\n"))
        for line in (data.SAMPLE_DIR / sample).read_bytes().split(b"\n"):
            assert not line or line in source_lines, sample
    for task in PROFILE_TYPES["bbh"]:
        ours = json.loads((data.SAMPLE_DIR / "bbh" / "bbh" / f"{task}.json").read_text())
        theirs = json.loads((SHARED_DATA / "bbh" / "bbh" / f"{task}.json").read_text())
        assert ours["canary"] == theirs["canary"] and ours["examples"] == theirs["examples"][:5]


# ----------------------------------------------------------------------------------------------
# Malformed data: one-line errors naming file, row and field


def test_missing_field_names_file_row_and_field(tmp_path):
    rows = math_rows()
    del rows[2]["solution"]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    with pytest.raises(MeshHealError, match=r"math\.jsonl, row 3: missing field 'answer'") as err:
        data.load_local("math", path)
    assert "\n" not in str(err.value)

    rows = math_rows()
    del rows[1]["type"]
    with pytest.raises(MeshHealError, match=r"row 2: missing field 'type'"):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))

    rows = math_rows()
    rows[4]["solution"] = "no box here, or a broken one \\boxed{3"
    with pytest.raises(MeshHealError, match=r"row 5: no 'answer' field and no complete \\boxed"):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))


def test_edges_of_the_row_errors(tmp_path):
    """A bad JSONL line names its column; a MATH-500 row without 'subject' names both type fields;
    a MATH gold with unbalanced braces and a question past MAX_QUESTION_CHARS are refused; a
    folder's one data file is found whatever the case of its suffix."""
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps(math_rows()[0]) + '\n{"problem": "x", "type": }\n')
    with pytest.raises(MeshHealError, match=r"row 2: invalid JSON at column 26 \(Expecting value\)"):
        data.load_local("math", path)
    rows = math_rows()
    rows[1]["type"] = None
    rows[1]["subject"] = None
    with pytest.raises(
        MeshHealError, match=r"row 2: missing field 'type' \(MATH\) or 'subject' \(MATH-500\)"
    ):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))
    rows = math_rows()
    rows[2]["answer"] = "\\frac{1}{2"  # cut short: no answer could equal it
    with pytest.raises(
        MeshHealError, match=r"row 3: field 'answer' '\\\\frac\{1\}\{2' has unbalanced braces"
    ):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))
    rows = math_rows()
    rows[3]["problem"] = "x" * (data.MAX_QUESTION_CHARS + 1)
    with pytest.raises(
        MeshHealError, match=r"row 4: field 'problem' holds 400,001 characters, past the 400,000"
    ):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))
    rows[3]["problem"] = "x" * data.MAX_QUESTION_CHARS
    assert len(data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))) == len(rows)
    folder = tmp_path / "upper"
    folder.mkdir()
    write_jsonl(folder / "DATA.JSONL", math_rows())
    assert data.resolve_data_file("math", folder) == folder / "DATA.JSONL"


def test_math_gold_from_a_cut_solution_or_an_empty_answer_is_refused(tmp_path):
    rows = math_rows()
    rows[1]["solution"] = "first \\boxed{3}, then the real answer \\boxed{\\frac{1}{2}"
    with pytest.raises(MeshHealError, match=r"row 2: the last \\boxed\{ in 'solution' never closes"):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))
    rows = math_rows()
    rows[2]["answer"] = ""
    del rows[2]["solution"]
    with pytest.raises(MeshHealError, match=r"row 3: empty field 'answer' \(and no 'solution'"):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))


def test_a_data_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_bytes(json.dumps(math_rows()[0]).encode() + b'\n{"problem": "caf\xe9"}\n')
    with pytest.raises(MeshHealError, match=r"math\.jsonl is not UTF-8 text \(line 2, byte"):
        data.load_local("math", path)


def test_invalid_json_line_and_non_object_rows(tmp_path):
    path = tmp_path / "mmlu.jsonl"
    lines = [json.dumps(r) for r in mmlu_rows()]
    lines[1] = lines[1][:-5]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MeshHealError, match=r"mmlu\.jsonl, row 2: invalid JSON"):
        data.load_local("mmlu_pro", path)
    path.write_text(json.dumps(mmlu_rows()[0]) + "\n[1, 2]\n")
    with pytest.raises(MeshHealError, match=r"row 2: expected a JSON object, got list"):
        data.load_local("mmlu_pro", path)
    path.write_text(json.dumps(mmlu_rows()[0]) + '\n{"question_id": ' + "9" * 5000 + "}\n")
    with pytest.raises(MeshHealError, match=r"row 2: invalid JSON \(Exceeds the limit \(4300 digits\)"):
        data.load_local("mmlu_pro", path)
    (tmp_path / "m.json").write_text("[" + "9" * 5000 + "]")
    with pytest.raises(MeshHealError, match=r"m\.json: invalid JSON \(Exceeds the limit"):
        data.load_local("mmlu_pro", tmp_path / "m.json")


def test_mmlu_pro_bad_rows(tmp_path):
    rows = mmlu_rows()
    del rows[3]["options"]
    with pytest.raises(MeshHealError, match=r"x\.jsonl, row 4: missing field 'options'"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    rows = mmlu_rows()
    rows[0]["answer"] = "D"  # three options: A-C
    with pytest.raises(MeshHealError, match=r"row 1: field 'answer' = 'D' is not one of the letters A-C"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    rows = mmlu_rows()
    rows[2]["options"] = "A or B"
    with pytest.raises(MeshHealError, match=r"row 3: field 'options' must be a list"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    rows = mmlu_rows()
    rows[5]["question"] = "   "
    with pytest.raises(MeshHealError, match=r"row 6: field 'question' is empty"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))


@pytest.mark.parametrize("answer, kind", [({"value": 2}, "dict"), ([1, 2], "list"), (True, "bool")])
def test_math_answer_that_is_not_text_or_a_number(tmp_path, answer, kind):
    rows = math_rows()
    rows[1]["answer"] = answer
    with pytest.raises(MeshHealError, match=rf"row 2: field 'answer' must be a string, got {kind}"):
        data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))


def test_math_missing_answer_cell_falls_back_to_the_solution(tmp_path):
    rows = math_rows()
    rows[0]["answer"] = float("nan")  # a parquet/pandas missing cell: the \boxed{} answer is used
    path = tmp_path / "math.parquet"
    pl.DataFrame(rows).write_parquet(path)
    record = data.load_local("math", path)[0]
    assert record.gold == data.last_boxed(rows[0]["solution"])


def test_mmlu_pro_options_as_a_table_or_with_an_empty_one(tmp_path):
    rows = mmlu_rows()
    rows[1]["options"] = {"A": "x", "B": "y", "C": "z"}
    with pytest.raises(MeshHealError, match=r"row 2: field 'options' must be a list of strings, got dict"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))
    rows = mmlu_rows()
    rows[1]["options"] = ["x", " ", "z"]
    with pytest.raises(MeshHealError, match=r"row 2: field 'options' has an empty option"):
        data.load_local("mmlu_pro", write_jsonl(tmp_path / "x.jsonl", rows))


def test_bbh_target_nan_is_named(tmp_path):
    for task in PROFILE_TYPES["bbh"]:
        (tmp_path / f"{task}.json").write_text(
            json.dumps({"examples": [{"input": "q", "target": "Yes"}] * 3})
        )
    (tmp_path / "navigate.json").write_text('{"examples": [{"input": "q", "target": NaN}]}')
    with pytest.raises(
        MeshHealError, match=r"navigate\.json, row 1: field 'target' is nan \(a missing value\)"
    ):
        data.load_local("bbh", tmp_path)
    (tmp_path / "navigate.json").write_text('{"examples": [{"input": "q", "target": -Infinity}]}')
    with pytest.raises(MeshHealError, match=r"field 'target' is -inf \(not a finite number\), not text"):
        data.load_local("bbh", tmp_path)


def test_bbh_bad_example_names_task_file_and_row(tmp_path):
    for task in PROFILE_TYPES["bbh"]:
        (tmp_path / f"{task}.json").write_text(
            json.dumps({"examples": [{"input": "q", "target": "Yes"}] * 3})
        )
    (tmp_path / "navigate.json").write_text(
        json.dumps({"examples": [{"input": "q", "target": "No"}, {"input": "q"}]})
    )
    with pytest.raises(MeshHealError, match=r"navigate\.json, row 2: missing field 'target'"):
        data.load_local("bbh", tmp_path)
    (tmp_path / "navigate.json").write_text('{"examples": [')
    with pytest.raises(MeshHealError, match=r"navigate\.json: invalid JSON at line 1"):
        data.load_local("bbh", tmp_path)


def test_rows_whose_type_nearly_matches_the_profile_warn(tmp_path):
    rows = math_rows() + [{**math_rows()[0], "type": "algebra"}, {**math_rows()[0], "type": "Number  Theory"}]
    with pytest.warns(
        data.TaskTypeWarning, match=r"'Number  Theory' \(1 rows; the profile's 'Number Theory'\)"
    ):
        records = data.load_local("math", write_jsonl(tmp_path / "math.jsonl", rows))
    assert len(records) == len(math_rows())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MMLU-Pro's other categories are left out without a word
        data.load_local(
            "mmlu_pro",
            write_jsonl(tmp_path / "mmlu.jsonl", [*mmlu_rows(), {**mmlu_rows()[0], "category": "history"}]),
        )


def test_bbh_letter_target_outside_the_options_and_two_files_for_one_task(tmp_path):
    question = "Which one?\nOptions:\n(A) this\n(B) that"
    for task in PROFILE_TYPES["bbh"]:
        (tmp_path / f"{task}.json").write_text(
            json.dumps({"examples": [{"input": question, "target": "(B)"}] * 2})
        )
    assert len(data.load_local("bbh", tmp_path)) == 14
    (tmp_path / "navigate.json").write_text(json.dumps({"examples": [{"input": question, "target": "(Z)"}]}))
    with pytest.raises(
        MeshHealError,
        match=r"navigate\.json, row 1: target '\(Z\)' is not one of the question's options \(A\)-\(B\)",
    ):
        data.load_local("bbh", tmp_path)
    (tmp_path / "navigate.json").write_text(json.dumps({"examples": [{"input": question, "target": "(A)"}]}))
    write_jsonl(tmp_path / "navigate.jsonl", [{"input": question, "target": "(B)"}])
    with pytest.raises(
        MeshHealError, match=r"task type 'navigate' has 2 files \(navigate\.json, navigate\.jsonl\); keep one"
    ):
        data.load_local("bbh", tmp_path)


def test_parquet_missing_column_names_row(tmp_path):
    rows = mmlu_rows()
    for r in rows:
        del r["category"]
    pl.DataFrame(rows).write_parquet(tmp_path / "t.parquet")
    with pytest.raises(MeshHealError, match=r"t\.parquet, row 1: missing field 'category'"):
        data.load_local("mmlu_pro", tmp_path / "t.parquet")


def test_profile_task_type_absent_from_data(tmp_path):
    rows = [r for r in math_rows(per_type=2) if r["type"] != "Geometry"]
    with pytest.raises(
        MeshHealError, match=r"no math questions of task type 'Geometry' required by the profile"
    ):
        data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows))
    for task in PROFILE_TYPES["bbh"]:
        if task != "temporal_sequences":
            (tmp_path / f"{task}.json").write_text(
                json.dumps({"examples": [{"input": "q", "target": "Yes"}]})
            )
    with pytest.raises(MeshHealError, match=r"no file for task type 'temporal_sequences'"):
        data.load_local("bbh", tmp_path)


def test_path_and_dataset_errors(tmp_path):
    with pytest.raises(MeshHealError, match="unknown dataset 'gsm8k'"):
        data.load_local("gsm8k", tmp_path)
    with pytest.raises(MeshHealError, match="does not exist"):
        data.load_local("math", tmp_path / "nowhere")
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(MeshHealError, match="unsupported file type .csv"):
        data.load_local("math", tmp_path / "a.csv")
    write_jsonl(tmp_path / "one.jsonl", math_rows())
    write_jsonl(tmp_path / "two.jsonl", math_rows())
    with pytest.raises(MeshHealError, match="cannot tell which math file to load"):
        data.load_local("math", tmp_path)
    with pytest.raises(MeshHealError, match="no BBH task files found"):
        data.load_local("bbh", tmp_path)
    with pytest.raises(MeshHealError, match="BBH data must be a folder"):
        data.load_local("bbh", tmp_path / "one.jsonl")
    with pytest.raises(MeshHealError, match="data path /dev/null is neither a file nor a folder"):
        data.load_local("math", "/dev/null")
    # the only data file of a folder is taken as the dataset's: an error in it says so
    (tmp_path / "mmlu").mkdir()
    write_jsonl(tmp_path / "mmlu" / "mine.jsonl", math_rows())
    with pytest.raises(
        MeshHealError, match=r"mine\.jsonl, row 1: .*\(mine\.jsonl was taken as the mmlu_pro file"
    ):
        data.load_local("mmlu_pro", tmp_path / "mmlu")


def test_an_explicit_profile_filters_to_its_types(tmp_path):
    rows = math_rows(per_type=2) + [{"problem": "p", "type": "Calculus", "answer": "1"}]
    records = data.load_local("math", write_jsonl(tmp_path / "m.jsonl", rows), profile="math")
    assert len(records) == 14 and {r.task_type for r in records} == set(PROFILE_TYPES["math"])
    assert records[0].gold == "1" and records[1].gold == "2"


# ----------------------------------------------------------------------------------------------
# Hugging Face hub: only the wiring can be tested offline


def test_hub_without_datasets_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(MeshHealError, match=r"pip install -e \.\[live\]"):
        data.load_hub("bbh")


def _fake_datasets(monkeypatch, tables):
    calls = []

    def load_dataset(hub_id, config=None, split=None, **kwargs):
        calls.append((hub_id, config, split))
        if (hub_id, config) not in tables:
            raise FileNotFoundError(f"Couldn't find config {config!r}\nmore detail")
        return tables[(hub_id, config)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hub_loader_wiring_with_a_stub(monkeypatch):
    bbh_tables = {
        ("lukaemon/bbh", task): json.loads((data.SAMPLE_DIR / "bbh" / "bbh" / f"{task}.json").read_text())[
            "examples"
        ]
        for task in PROFILE_TYPES["bbh"]
    }
    calls = _fake_datasets(monkeypatch, bbh_tables)
    hub = data.load_hub("bbh")
    assert [c[1] for c in calls] == list(PROFILE_TYPES["bbh"]) and {c[2] for c in calls} == {"test"}
    assert [(r.question, r.gold, r.task_type) for r in hub] == [
        (r.question, r.gold, r.task_type) for r in data.load_sample("bbh")
    ]

    rows = [json.loads(line) for line in (data.SAMPLE_DIR / "math" / "math_test_sample.jsonl").open()]
    math_tables = {
        ("EleutherAI/hendrycks_math", data.hub_config_name(t)): [
            {k: r[k] for k in ("problem", "level", "type", "solution")} for r in rows if r["type"] == t
        ]
        for t in PROFILE_TYPES["math"]
    }
    calls = _fake_datasets(monkeypatch, math_tables)
    hub = data.load_hub("math")
    assert "counting_and_probability" in [c[1] for c in calls]
    assert sorted(r.gold for r in hub) == sorted(r.gold for r in data.load_sample("math"))

    mmlu = [json.loads(line) for line in (data.SAMPLE_DIR / "mmlu_pro" / "mmlu_pro_test_sample.jsonl").open()]
    _fake_datasets(monkeypatch, {("TIGER-Lab/MMLU-Pro", None): mmlu})
    assert [r.uid for r in data.load_hub("mmlu_pro")] == [r.uid for r in data.load_sample("mmlu_pro")]

    _fake_datasets(monkeypatch, {})
    with pytest.raises(
        MeshHealError,
        match=r"cannot load TIGER-Lab/MMLU-Pro split 'test' from the Hugging Face hub: "
        r"Couldn't find config None$",
    ):
        data.load_hub("mmlu_pro")


# ----------------------------------------------------------------------------------------------
# Question pools and picking


def _stream(seed: int, dataset_id: int = 1, n_tasks: int = 504):
    return make_stream(seed, dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded"))


def test_question_pool_orders_by_type_and_rejects_empty_types():
    records = data.load_sample("math")
    pool = data.question_pool(records, PROFILE_TYPES["math"])
    assert [p[0].task_type for p in pool] == list(PROFILE_TYPES["math"])
    assert sum(len(p) for p in pool) == len(records)
    with pytest.raises(MeshHealError, match="no questions of task type 'Calculus'"):
        data.question_pool(records, (*PROFILE_TYPES["math"], "Calculus"))


def test_pick_questions_is_seeded_disjoint_and_prefix_stable():
    pool = tuple(tuple(data.Record(f"q{t}-{i}", f"T{t}", str(i)) for i in range(100)) for t in range(7))
    stream = _stream(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 72 per type fit in 100: no warning
        pick = data.pick_questions(pool, stream.task_type, stream.question, seed=stream.seed, dataset_id=1)
        again = data.pick_questions(pool, stream.task_type, stream.question, seed=stream.seed, dataset_id=1)
    assert not pick.with_replacement and pick.short_types == ()
    assert pick.records == again.records and np.array_equal(pick.pool_index, again.pool_index)
    assert [r.task_type for r in pick.records] == [f"T{t}" for t in stream.task_type]
    for t in range(7):  # no question repeats; healthy and degraded phases are disjoint
        chosen = pick.pool_index[stream.task_type == t]
        assert len(set(chosen.tolist())) == len(chosen) == 72
    assert pick.pool_index[:10].tolist() != list(range(10))  # shuffled, not file order
    other = data.pick_questions(pool, stream.task_type, stream.question, seed=4, dataset_id=1)
    assert other.records != pick.records
    # question k of type T does not depend on the stream's length
    short = data.pick_questions(pool, stream.task_type[:42], stream.question[:42], seed=3, dataset_id=1)
    assert short.records == pick.records[:42]


def test_pick_questions_with_replacement_is_flagged_and_warned():
    records = data.load_sample("math")  # 4 per type, a 504-task stream needs 72 per type
    pool = data.question_pool(records, PROFILE_TYPES["math"])
    stream = _stream(0)
    with pytest.warns(data.QuestionPoolWarning, match=r"'Algebra': needs 72, pool holds 4"):
        pick = data.pick_questions(pool, stream.task_type, stream.question, seed=0, dataset_id=1)
    assert pick.with_replacement and set(pick.short_types) == set(PROFILE_TYPES["math"])
    assert pick.needed.tolist() == [72] * 7 and pick.available.tolist() == [4] * 7
    for t in range(7):
        chosen = pick.pool_index[stream.task_type == t][np.argsort(stream.question[stream.task_type == t])]
        assert sorted(chosen[:4].tolist()) == [0, 1, 2, 3]  # the pool is used up before repeating
        assert chosen.max() < 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = data.pick_questions(pool, stream.task_type, stream.question, seed=0, dataset_id=1, warn=False)
    assert quiet.records == pick.records


def test_a_question_pool_warning_prints_once_whoever_asks():
    """MeshHeal's live path and each live baseline pick the same streams' questions: under Python's
    default filter the same text is printed once, not once per caller."""
    pool = data.question_pool(data.load_sample("math"), PROFILE_TYPES["math"])
    stream = _stream(0)

    def meshheal_path():
        return data.pick_questions(pool, stream.task_type, stream.question, seed=0, dataset_id=1)

    def baseline_path():
        return data.pick_questions(pool, stream.task_type, stream.question, seed=0, dataset_id=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        meshheal_path()
        baseline_path()
    assert [type(w.message) for w in caught] == [data.QuestionPoolWarning]


@needs_shared
def test_math500_is_too_small_for_a_504_task_stream_but_the_full_split_is_not():
    stream = _stream(0)
    full = data.question_pool(data.load_local("math", SHARED_DATA), PROFILE_TYPES["math"])
    assert not data.pick_questions(full, stream.task_type, stream.question, seed=0).with_replacement
    math500 = data.question_pool(
        data.load_local("math", SHARED_DATA / "math" / "math500_test.jsonl"), PROFILE_TYPES["math"]
    )
    with pytest.warns(data.QuestionPoolWarning):
        pick = data.pick_questions(math500, stream.task_type, stream.question, seed=0)
    # 72 per type needed; MATH-500 holds Geometry 41, Counting & Probability 38, Precalculus 56,
    # Number Theory 62
    assert set(pick.short_types) == {"Geometry", "Counting & Probability", "Precalculus", "Number Theory"}


def test_pick_questions_rejects_bad_arrays():
    pool = data.question_pool(data.load_sample("bbh"), PROFILE_TYPES["bbh"])
    with pytest.raises(MeshHealError, match="1-D arrays of one length"):
        data.pick_questions(pool, np.zeros(3, int), np.zeros(4, int), seed=0)
    with pytest.raises(MeshHealError, match="task type indices must lie in 0..6"):
        data.pick_questions(pool, np.array([7]), np.array([0]), seed=0)
    with pytest.raises(MeshHealError, match="question ids must be >= 0"):
        data.pick_questions(pool, np.array([0]), np.array([-1]), seed=0)
    with pytest.raises(MeshHealError, match="seeds must be >= 0"):
        data.pick_questions(pool, np.array([0]), np.array([0]), seed=-1)


def test_hub_commit_asks_the_hub_only_when_it_can(monkeypatch):
    sha = "0123456789abcdef" * 2 + "01234567"
    assert data.hub_commit("any/id", sha) == sha  # a commit names itself
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert data.hub_commit("any/id") is None  # offline: not asked
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    asked = []

    class HfApi:  # a stand-in for huggingface_hub's client (no hub here)
        def dataset_info(self, repo_id, revision=None, timeout=None):
            asked.append((repo_id, revision, timeout))
            if repo_id == "gone/id":
                raise OSError("404")
            return types.SimpleNamespace(sha=sha)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=HfApi))
    assert data.hub_commit("EleutherAI/hendrycks_math", "v1") == sha
    assert data.hub_commit("gone/id") is None  # any error: read as given
    assert asked == [("EleutherAI/hendrycks_math", "v1", 10), ("gone/id", None, 10)]


def _last_boxed_by_rescanning(text: str):
    """The old reading of last_boxed_span, kept as the oracle: each `\\boxed{` from the last one
    back, its braces counted from its content's start (quadratic when many never close)."""

    def escaped(i: int) -> bool:
        n = 0
        while i - n - 1 >= 0 and text[i - n - 1] == "\\":
            n += 1
        return n % 2 == 1

    for m in reversed(list(data._BOXED.finditer(text))):
        depth = 1
        for i in range(m.end(), len(text)):
            if text[i] in "{}" and escaped(i):
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return m.start(), text[m.end() : i].strip()
    return None


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(["\\boxed{", "\\fbox {", "{", "}", "\\", "\\{", "\\}", "x", " ", "7"]), max_size=30
    )
)
def test_last_boxed_span_equals_a_rescan_of_each_box(pieces):
    text = "".join(pieces)
    assert data.last_boxed_span(text) == _last_boxed_by_rescanning(text)


@pytest.mark.parametrize(
    "target, gold",
    [
        ("(B)", "(B)"),
        ("(b)", "(B)"),
        ("B", "(B)"),
        ("b", "(B)"),
        ("that", "(B)"),
        (" That  one ", "(C)"),
        ("A", "(A)"),
    ],
)
def test_bbh_option_targets_written_otherwise_become_their_letter(target, gold):
    question = "Which one?\nOptions:\n(A) this\n(B) that\n(C) that one"
    record = data.map_bbh_row({"input": question, "target": target}, "navigate", "navigate.json, row 1")
    assert record.gold == gold
    # the scorer now reads the option's letter and its text alike
    assert score("bbh", f"RESULT: {gold}", record.gold, record.options)
    assert score("bbh", f"RESULT: {record.options[ord(gold[1]) - 65]}", record.gold, record.options)


def test_bbh_target_naming_no_option_stays_a_literal():
    # three upstream rows have options split wrongly at a comma (movie_recommendation 163:
    # "(A) Monsters" / "Inc"): their targets name no option and are scored as literal text
    question = "Which one?\nOptions:\n(A) Monsters\n(B) Inc\n(C) Up"
    record = data.map_bbh_row({"input": question, "target": "Monsters, Inc"}, "movie", "movie.json, row 164")
    assert record.gold == "Monsters, Inc"
    assert score("bbh", "RESULT: Monsters, Inc", record.gold, record.options)
    literal = data.map_bbh_row({"input": "Is it?", "target": "Yes"}, "navigate", "navigate.json, row 1")
    assert literal.gold == "Yes" and literal.options is None
