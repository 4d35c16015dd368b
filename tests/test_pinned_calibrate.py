"""What `python -m meshheal_jax.calibrate` reads, estimates and writes (a mutation audit of
meshheal_jax/calibrate.py) that no other test held: the one-line errors for damaged tables and
config.json, for unknown pairs and clashing model names, and for settings and folders the command
refuses; how a call's `model` maps to a file (the run's params_dir, a live run's model ids and served
names, the base folder); which rows are read (MeshHeal's only) and when a run carries latent truth;
the labels of decisions C2 row by row (a live trace's draft proxy, gold-settled Finalize parts, a
Contribute's final judgement above 0.40); the estimators of the module docstring's table on counts
small enough to work by hand (review categoricals pooling committee round 1, rho_same's three-sample
groups, round 2 against the other member's round-1 score, Takeover rates, p_rescue, the integer
uniform of the completion tokens, answer_fraction's slope and its half-token slack, the prompt bases
net of the reconstructed context); and what is written (per-type p_part only with --per-type or where
the base file has the type, integers and nulls in calibration.json, the reason beside a kept value).
Hand-built traces of a few tasks: no run, no JAX compile."""

from __future__ import annotations

import json
import math
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from meshheal_jax import calibrate as C
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import MODEL_DIR, PAIRS, dump_model, load_model
from meshheal_jax.topology import PROFILE_DIR

# a fit from a few tasks writes round-2 rows no sharper than round 1: params warns, as it should
pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.params.ModelFileWarning")

S, W = PAIRS["default"]  # the default pair's files: gpt-oss-120b (strong), llama-3.2-1b (weak)
Q_TOKENS = 260  # the packaged bbh profile's mean question tokens
KEY = dict(method="meshheal", dataset="bbh", pair="default", seed=0, t=1)
SCHEMA = {
    "calls": {"method": pl.String, "dataset": pl.String, "pair": pl.String, "seed": pl.Int64, "t": pl.Int64,
              "visit": pl.Int64, "kind": pl.String, "agent": pl.Int64, "author": pl.Int64, "ability": pl.Int64,
              "model": pl.String, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64, "score": pl.Float64,
              "answer_id": pl.Int64, "correct": pl.Boolean},
    "reviews": {"method": pl.String, "dataset": pl.String, "pair": pl.String, "seed": pl.Int64, "t": pl.Int64,
                "visit": pl.Int64, "author": pl.Int64, "ability": pl.Int64, "action": pl.String,
                "part_correct": pl.Boolean, "q": pl.Float64, "takeover": pl.Boolean, "correct_before": pl.Boolean,
                "correct_after": pl.Boolean},
    "tasks": {"method": pl.String, "dataset": pl.String, "pair": pl.String, "seed": pl.Int64, "t": pl.Int64,
              "task_type": pl.Int64, "phase": pl.Int64, "correct": pl.Boolean, "pair_correct": pl.Boolean,
              "calls": pl.Int64, "tokens": pl.Int64},
}  # fmt: skip
DEFAULTS = {
    "calls": dict(visit=0, kind="infer", agent=0, author=-1, ability=-1, model=S, prompt_tokens=0,
                  completion_tokens=0, score=None, answer_id=None, correct=None),
    "reviews": dict(visit=0, author=0, ability=0, action="contribute", part_correct=False, q=1.0, takeover=False,
                    correct_before=False, correct_after=False),
    "tasks": dict(task_type=0, phase=0, correct=False, pair_correct=True, calls=0, tokens=0),
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Hand-built traces
# ----------------------------------------------------------------------------------------------


def frame(name: str, rows) -> pl.DataFrame:
    return pl.DataFrame([{**KEY, **DEFAULTS[name], **r} for r in rows], schema=SCHEMA[name])


def output(t, visit, author, reviewer, *, finalize=False, ok=None, part=None, scores=(1.0, 1.0, 1.0), q=None,
           takeover=False, before=None, after=None, reviewed=True, live=False, seed=0, gen=(0, 0), review=(0, 0),
           committee=None, synthesis=None):  # fmt: skip
    """One generated output of a task (author index and ability = visit) by model `author`: its
    generate call (a Finalize's carries an answer_id), the three review samples of `reviewer`, a
    committee ((round-1 a, b), (round-2 a, b) scores of two members), a synthesis call, and its
    reviews row. A live output carries no latent correctness: its review / committee calls and a
    Contribute's generation have `correct` null, part_correct and a Contribute's correct_before /
    after are False (live_loop's convention). `gen` / `review`: (prompt, completion) tokens."""
    key = dict(seed=seed, t=t, visit=visit, author=visit, ability=visit)
    judged = None if live else (part if finalize else ok)
    calls = [dict(key, kind="generate", model=author, prompt_tokens=gen[0], completion_tokens=gen[1],
                  answer_id=1 if finalize else None, correct=ok if (finalize or not live) else None)]  # fmt: skip
    rows = []
    if reviewed:
        calls += [dict(key, kind="review", model=reviewer, score=s, prompt_tokens=review[0],
                       completion_tokens=review[1], correct=judged) for s in scores]  # fmt: skip
        if committee is not None:
            (a1, b1), (a2, b2) = committee
            calls += [dict(key, kind=kind, agent=agent, model=reviewer, score=score, correct=judged)
                      for kind, agent, score in (("committee1", 1, a1), ("committee1", 2, b1),
                                                 ("committee2", 1, a2), ("committee2", 2, b2))]  # fmt: skip
        before = ok if before is None else before
        after = before if after is None else after
        if synthesis is not None:  # a Takeover's synthesis: its correctness (none for a live Contribute)
            synthesised = None if live and not finalize else after
            calls.append(dict(key, kind="synthesis", model=synthesis, correct=synthesised))
        if live and not finalize:
            before = after = False
        rows.append(dict(key, action="finalize" if finalize else "contribute", q=scores[0] if q is None else q,
                         part_correct=False if live else judged, takeover=takeover, correct_before=before,
                         correct_after=after))  # fmt: skip
    return calls, rows


def task(t, *outs, seed=0, pair_ok=True, correct=False, infer=None, task_type=0):
    """A task's rows: an infer call and the outputs' calls and reviews."""
    calls = []
    if infer is not None:  # (model, correct[, prompt tokens[, completion tokens]])
        prompt, completion = (*infer[2:], 0, 0)[:2]
        calls.append(dict(seed=seed, t=t, kind="infer", model=infer[0], correct=infer[1], prompt_tokens=prompt,
                          completion_tokens=completion))  # fmt: skip
    reviews = []
    for c, r in outs:
        calls += c
        reviews += r
    task_row = dict(seed=seed, t=t, pair_correct=pair_ok, correct=correct, task_type=task_type)
    return calls, reviews, task_row


def write_run(folder: Path, *tasks, experiment: dict | None = None, extra_calls=()) -> Path:
    """A run folder: calls / reviews / tasks .parquet of `tasks`, config.json when `experiment`."""
    folder.mkdir(parents=True, exist_ok=True)
    calls = [c for t in tasks for c in t[0]] + list(extra_calls)
    frame("calls", calls).write_parquet(folder / "calls.parquet")
    frame("reviews", [r for t in tasks for r in t[1]]).write_parquet(folder / "reviews.parquet")
    frame("tasks", [t[2] for t in tasks]).write_parquet(folder / "tasks.parquet")
    if experiment is not None:
        (folder / "config.json").write_text(json.dumps({"experiment": experiment}))
    return folder


def simple_run(folder: Path, **kwargs) -> Path:
    """Two tasks: an infer call each, the strong model's Finalize judged by the weak one."""
    return write_run(folder, *(task(t, output(t, 0, S, W, finalize=True, ok=True, part=True), infer=(S, True))
                               for t in (1, 2)), **kwargs)  # fmt: skip


def fit_run(run: Path, n_boot: int = 20, min_n: int = 1) -> dict[str, dict[str, C.Estimate]]:
    """The fit's estimates (stem -> parameter -> Estimate), every cell with an observation identified."""
    return C.fit(C.load_trace([run]), C.base_models(MODEL_DIR, [S, W]), n_boot, 0, min_n).estimates


def labels(run: Path) -> dict[tuple[int, int], dict]:
    """outputs() by (t, visit)."""
    outs = C.outputs(C.load_trace([run]))
    return {(r["t"], r["visit"]): r for r in outs.iter_rows(named=True)}


def model_file(folder: Path, stem: str, **changes) -> Path:
    """`stem`'s packaged file with `changes` (ModelParams fields) written into `folder`."""
    import dataclasses

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.toml").write_text(dump_model(dataclasses.replace(load_model(stem), **changes)))
    return folder


# ----------------------------------------------------------------------------------------------
# Folders and tables that are not a MeshHeal trace: one line naming the file
# ----------------------------------------------------------------------------------------------


def test_a_table_without_the_trace_columns_is_named_with_them(tmp_path):
    run = simple_run(tmp_path / "run")
    pl.read_parquet(run / "calls.parquet").drop("score", "answer_id").write_parquet(run / "calls.parquet")
    with pytest.raises(MeshHealError) as err:
        C.calibrate([run], tmp_path / "fit")
    assert str(err.value) == (
        f"{run / 'calls.parquet'} lacks the columns ['score', 'answer_id'] (not a MeshHeal trace?)"
    )


def test_a_damaged_table_is_named(tmp_path):
    run = simple_run(tmp_path / "run")
    (run / "reviews.parquet").write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(MeshHealError, match=r"^cannot read .*run/reviews\.parquet: "):
        C.calibrate([run], tmp_path / "fit")


def test_a_damaged_config_json_is_named(tmp_path):
    run = simple_run(tmp_path / "run")
    (run / "config.json").write_text("{not json")
    with pytest.raises(MeshHealError) as err:
        C.calibrate([run], tmp_path / "fit")
    assert str(err.value) == f"{run / 'config.json'} is not valid JSON"


def test_a_folder_of_more_than_four_run_folders_names_four_and_counts_the_rest(tmp_path):
    for k in range(5):
        simple_run(tmp_path / "top" / f"run{k}")
    with pytest.raises(MeshHealError) as err:
        C.check_run_folder(tmp_path / "top")
    shown = " ".join(str(tmp_path / "top" / f"run{k}") for k in range(4))
    assert str(err.value) == (
        f"{tmp_path / 'top'} is a folder of run folders, not a run: give those ({shown} (and 1 more))"
    )


def test_a_copy_of_a_run_in_another_row_order_is_still_the_same_run(tmp_path):
    """calls_fingerprint: equal "whatever their paths or row order" (a run counted twice would
    narrow every interval)."""
    run = simple_run(tmp_path / "run")
    copy = shutil.copytree(run, tmp_path / "copy")
    pl.read_parquet(run / "calls.parquet").reverse().write_parquet(copy / "calls.parquet")
    assert C.calls_fingerprint(pl.read_parquet(run / "calls.parquet")) == C.calls_fingerprint(
        pl.read_parquet(copy / "calls.parquet")
    )
    with pytest.raises(MeshHealError, match=r"run folders .*run and .*copy hold the same calls"):
        C.calibrate([run, copy], tmp_path / "fit")


# ----------------------------------------------------------------------------------------------
# A call's model -> its file (decisions C1)
# ----------------------------------------------------------------------------------------------


def test_names_of_a_pairs_models_map_to_their_files_and_roles():
    mapping = C.model_map({}, ["default"], MODEL_DIR)
    got = {(r["model"], r["stem"], r["role"]) for r in mapping.iter_rows(named=True)}
    assert got == {
        (S, S, "strong"), ("strong", S, "strong"), (load_model(S).model, S, "strong"),
        (W, W, "weak"), ("weak", W, "weak"), (load_model(W).model, W, "weak"),
    }  # fmt: skip


def test_a_live_runs_model_ids_and_served_names_map_to_the_pairs_files():
    live = {"strong_model": "acme/strong-7b", "strong_served_name": "strong-served",
            "weak_model": "acme/weak-1b", "weak_served_name": "weak-served"}  # fmt: skip
    mapping = C.model_map({"live": live}, ["default"], MODEL_DIR)
    stem = dict(zip(mapping["model"], mapping["stem"], strict=True))
    named = (stem["acme/strong-7b"], stem["strong-served"], stem["acme/weak-1b"], stem["weak-served"])
    assert named == (S, S, W, W)


def test_a_name_given_to_both_models_of_a_pair_is_refused():
    live = {"strong_model": load_model(W).model}  # the weak file's model id, configured as the strong model
    with pytest.raises(MeshHealError) as err:
        C.model_map({"live": live}, ["default"], MODEL_DIR)
    assert str(err.value) == (
        f"model names ['{load_model(W).model}'] name both models of a pair; cannot tell them apart"
    )


def test_an_unknown_pair_is_named():
    with pytest.raises(MeshHealError) as err:
        C.model_map({}, ["default", "Z"], MODEL_DIR)
    assert str(err.value) == f"trace pair 'Z' is not a known pair ({sorted(PAIRS)})"


def test_model_ids_come_from_the_runs_params_dir_and_else_from_the_base_folder(tmp_path):
    """A run emulated with its own files (config.json's params_dir) writes their model ids; a file
    that folder lacks comes from the base folder."""
    params = model_file(tmp_path / "params", S, model="acme/strong-custom")  # no weak file there
    mapping = C.model_map({"params_dir": str(params)}, ["default"], MODEL_DIR)
    stem = dict(zip(mapping["model"], mapping["stem"], strict=True))
    assert stem["acme/strong-custom"] == S and stem[load_model(W).model] == W
    assert load_model(S).model not in stem
    # and read from a run folder: calls naming the custom id are the strong model's
    run = write_run(tmp_path / "run", task(1, infer=("acme/strong-custom", True)), task(2, infer=("acme/strong-custom", False)),
                    experiment={"params_dir": str(params)})  # fmt: skip
    assert fit_run(run)[S]["p_infer"].value == 0.5
    with pytest.raises(MeshHealError, match=r"model names \[\('default', 'acme/strong-custom'\)\] match no "
                                            r"parameter file of their pair"):  # fmt: skip
        C.load_trace([write_run(tmp_path / "no-params", task(1, infer=("acme/strong-custom", True)))])
    # a params_dir that is not here is read as the base folder, and the message says so
    gone = write_run(tmp_path / "gone", task(1, infer=("acme/strong-custom", True)),
                     experiment={"params_dir": str(tmp_path / "moved")})  # fmt: skip
    with pytest.raises(
        MeshHealError, match=rf"the run's params_dir {tmp_path / 'moved'} is not a folder here, so "
    ):
        C.load_trace([gone])


def test_the_base_params_dir_names_the_models_of_a_run_without_a_params_dir(tmp_path):
    base = shutil.copytree(MODEL_DIR, tmp_path / "base", ignore=shutil.ignore_patterns("fit_start"))
    model_file(base, W, model="acme/weak-custom")
    run = write_run(tmp_path / "run", *(task(t, infer=("acme/weak-custom", True)) for t in (1, 2)))
    result, doc = C.calibrate([run], tmp_path / "fit", base_dir=base, n_boot=5, min_n=1)
    assert result.estimates[W]["p_infer"].value == 1.0 and doc["base_params_dir"] == str(base)
    with pytest.raises(MeshHealError, match=r"--base-params-dir .*nowhere is not a folder"):
        C.calibrate([run], tmp_path / "fit2", base_dir=tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------------
# Which rows are read, and whether a run carries latent truth (decisions C1, C2)
# ----------------------------------------------------------------------------------------------


def test_only_meshheal_rows_are_read(tmp_path):
    """A run of several methods: the baselines' calls (other models, other kinds) are not fitted."""
    baseline = [
        dict(method="single", t=t, kind="infer", model="some/baseline", correct=False) for t in (1, 2)
    ]
    run = simple_run(tmp_path / "run", extra_calls=baseline)
    estimates = fit_run(run)
    assert estimates[S]["p_infer"].value == 1.0 and estimates[S]["p_infer"].n == 2


def test_a_run_carries_latent_truth_when_any_judged_call_has_a_correctness(tmp_path):
    """Decisions C2: a review / committee / Contribute-generate call with a non-null `correct` makes
    the run an emulated one, read with truth (here Finalize outputs only, no Contribute, and one
    review call alone keeps its correctness); without any, it is live (gold and proxies)."""
    emulated = write_run(tmp_path / "emulated", *(task(t, output(t, 0, S, W, finalize=True, ok=False, part=True))
                                                  for t in (1, 2)))  # fmt: skip
    assert C.load_trace([emulated]).truth == (True,)
    calls = pl.read_parquet(emulated / "calls.parquet").with_row_index("row")
    first = calls.filter(pl.col("kind") == "review")["row"][0]
    keep = (pl.col("kind") != "review") | (pl.col("row") == first)
    calls.with_columns(pl.when(keep).then(pl.col("correct")).alias("correct")).drop("row").write_parquet(
        emulated / "calls.parquet"
    )
    assert C.load_trace([emulated]).truth == (True,)
    live = write_run(tmp_path / "live", *(task(t, output(t, 0, S, W, finalize=True, ok=False, live=True))
                                          for t in (1, 2)))  # fmt: skip
    assert C.load_trace([live]).truth == (False,)


def test_the_question_tokens_come_from_the_runs_profiles(tmp_path):
    """An infer call's prompt base is its prompt less the question tokens of the run's profile
    (config.json's profiles_dir), not the packaged one's."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (PROFILE_DIR / "bbh.toml").read_text()
    text = text.replace(f"question_tokens = {Q_TOKENS}", "question_tokens = 100", 1)
    (profiles / "bbh.toml").write_text(text)
    tasks = [task(t, infer=(S, True, 900)) for t in (1, 2)]
    packaged = fit_run(write_run(tmp_path / "packaged", *tasks))
    own = fit_run(write_run(tmp_path / "own", *tasks, experiment={"profiles_dir": str(profiles)}))
    assert packaged[S]["prompt_tokens.infer"].value == 900 - Q_TOKENS
    assert own[S]["prompt_tokens.infer"].value == 800


# ----------------------------------------------------------------------------------------------
# Labels: latent truth, or gold and proxies (decisions C2)
# ----------------------------------------------------------------------------------------------


def test_live_labels_follow_decisions_c2(tmp_path):
    """A live trace (weak Contribute judged by the strong model, strong Finalize judged by the weak):
    the draft is right when every Contribute was accepted (final judgement above 0.40) without a
    Takeover, unknown after a Takeover or unreviewed; a Finalize part is settled by the gold
    answer on a right pair and a right draft (right answer: right part; wrong answer on a right
    draft: wrong part); a Contribute part is its final judgement, a proxy."""
    live = dict(live=True)
    run = write_run(
        tmp_path / "live",
        task(1, output(1, 0, W, S, q=0.45, **live), output(1, 1, S, W, finalize=True, ok=True, **live)),
        task(2, output(2, 0, W, S, q=1.0, **live), output(2, 1, S, W, finalize=True, ok=False, **live)),
        task(3, output(3, 0, W, S, scores=(0.0, 0.0, 0.25), q=0.25, takeover=True, **live),
             output(3, 1, S, W, finalize=True, ok=False, **live)),
        task(4, output(4, 0, W, S, q=0.40, takeover=True, **live), output(4, 1, S, W, finalize=True, ok=True, **live)),
        task(5, output(5, 0, W, S, q=1.0, **live), output(5, 1, S, W, finalize=True, ok=True, **live), pair_ok=False),
        task(6, output(6, 0, W, S, q=1.0, **live), output(6, 1, S, W, finalize=True, ok=False, **live), pair_ok=False),
        task(7, output(7, 0, W, S, reviewed=False, **live), output(7, 1, S, W, finalize=True, ok=False, **live)),
        task(8, output(8, 0, S, W, finalize=True, ok=False, **live)),
        task(9, output(9, 0, W, S, q=1.0, **live), output(9, 1, W, S, q=0.5, **live),
             output(9, 2, S, W, finalize=True, ok=False, **live)),
    )  # fmt: skip
    rows = labels(run)
    finalize = {t: rows[(t, 2 if t == 9 else (0 if t == 8 else 1))] for t in range(1, 10)}
    got = {t: (r["draft_ok"], r["part_label"], r["review_label"]) for t, r in finalize.items()}
    assert got == {  # (draft right, part label for p_part, part label for the review fits)
        1: (True, True, True),  # accepted draft, right answer
        2: (True, False, False),  # accepted draft, wrong answer: the part is wrong
        3: (None, None, None),  # a Takeover: the draft is unknown
        4: (None, None, True),  # a right answer settles the part (review fits); p_part needs a right draft
        5: (True, None, None),  # a wrong pair settles nothing
        6: (True, None, None),
        7: (None, None, None),  # an unreviewed Contribute: unknown
        8: (True, False, False),  # no Contribute: the draft is right, exactly
        9: (True, False, False),
    }  # fmt: skip
    # proxies: every Contribute label; a Finalize's that rests on a draft; a wrong label on a draft
    assert [finalize[t]["part_proxy"] for t in (1, 2, 8)] == [True, True, False]
    assert [finalize[t]["review_proxy"] for t in (1, 2, 8)] == [False, True, False]
    # a Contribute part is its final judgement: above 0.40 (+ the engines' tolerance) accepts
    contribute = {(t, v): (rows[(t, v)]["part_label"], rows[(t, v)]["part_proxy"])
                  for t, v in ((1, 0), (2, 0), (3, 0), (4, 0), (9, 1))}  # fmt: skip
    assert contribute == {(1, 0): (True, True), (2, 0): (True, True), (3, 0): (False, True),
                          (4, 0): (False, True), (9, 1): (True, True)}  # fmt: skip
    assert rows[(7, 0)]["part_label"] is None
    assert (rows[(1, 0)]["author_role"], rows[(1, 1)]["author_role"]) == ("weak_author", "strong_author")


def test_truth_labels_are_the_latent_correctness(tmp_path):
    """An emulated trace: a Finalize part's label is reviews.part_correct (not the answer), a
    Contribute's its generation's correctness; the draft is each Contribute as it joined it (after
    a Takeover: the synthesis's correctness)."""
    run = write_run(
        tmp_path / "emulated",
        # a wrong Contribute fixed by a Takeover: the draft is right; a right part under a wrong answer
        task(1, output(1, 0, W, S, ok=False, q=0.0, takeover=True, after=True),
             output(1, 1, S, W, finalize=True, ok=False, part=True)),
        # a wrong Contribute accepted: the draft is wrong; a wrong part under a right answer
        task(2, output(2, 0, W, S, ok=False, q=1.0), output(2, 1, S, W, finalize=True, ok=True, part=False)),
        # an unreviewed right Contribute: its generation decides
        task(3, output(3, 0, W, S, ok=True, reviewed=False), output(3, 1, S, W, finalize=True, ok=True, part=True)),
        # a draft of a right and a wrong Contribute, both accepted: wrong
        task(4, output(4, 0, W, S, ok=True, q=1.0), output(4, 2, W, S, ok=False, q=1.0),
             output(4, 1, S, W, finalize=True, ok=False, part=True)),
    )  # fmt: skip
    rows = labels(run)
    got = {t: (rows[(t, 1)]["draft_ok"], rows[(t, 1)]["part_label"], rows[(t, 1)]["review_label"])
           for t in (1, 2, 3, 4)}  # fmt: skip
    assert got == {
        1: (True, True, True),
        2: (False, False, False),
        3: (True, True, True),
        4: (False, True, True),
    }
    assert [rows[(t, 0)]["part_label"] for t in (1, 2, 3)] == [False, False, True]
    assert not any(r["part_proxy"] or r["review_proxy"] for r in rows.values())


# ----------------------------------------------------------------------------------------------
# Estimators (the module docstring's table), on counts worked by hand
# ----------------------------------------------------------------------------------------------


def review_run(folder: Path) -> Path:
    """The weak model judging four strong Finalize outputs: two right parts, two wrong; a
    committee on the first."""
    return write_run(
        folder,
        task(1, output(1, 0, S, W, finalize=True, ok=True, part=True, scores=(1.0, 1.0, 0.5),
                       committee=((1.0, 0.0), (1.0, 1.0)))),
        task(2, output(2, 0, S, W, finalize=True, ok=True, part=True, scores=(1.0, 0.25, 1.0))),
        task(3, output(3, 0, S, W, finalize=True, ok=False, part=False, scores=(0.0, 0.0, 0.0))),
        task(4, output(4, 0, S, W, finalize=True, ok=False, part=False, scores=(0.25, 0.0, 0.25))),
    )  # fmt: skip


def test_review_categoricals_pool_the_reviews_and_committee_round_1(tmp_path):
    """review.<author role>.<label> of the reviewer: every initial sample and committee round-1
    sample (decisions C9), by anchor 0, 0.25, 0.5, 1.0."""
    weak = fit_run(review_run(tmp_path / "run"))[W]
    right, wrong = weak["review.strong_author.correct"], weak["review.strong_author.wrong"]
    # right parts: reviews 1, 1, .5 | 1, .25, 1 and round 1 1, 0
    np.testing.assert_allclose(right.value, np.array([1, 1, 1, 5]) / 8)
    np.testing.assert_allclose(wrong.value, np.array([4, 2, 0, 0]) / 6)
    assert (right.n, wrong.n) == (8, 6) and right.binomial
    assert weak["review.weak_author.correct"].note == "no observations in the traces"


def test_rho_same_counts_repeats_of_each_groups_first_sample(tmp_path):
    """rho_same from the three-sample groups, in the order drawn: P(u_k = u_1) = rho + (1 - rho) *
    sum(pi^2) per cell, pooled by moments; n counts the groups."""
    rho = fit_run(review_run(tmp_path / "run"))[W]["rho_same"]
    # matches of samples 2 and 3 with sample 1: (1, 1, .5) 1 | (1, .25, 1) 1 | (0, 0, 0) 2 | (.25, 0, .25) 1
    kappa = {"right": (1 + 1 + 1 + 25) / 64, "wrong": (16 + 4) / 36}
    moments = (
        (2 - 4 * kappa["right"]) + (3 - 4 * kappa["wrong"]),
        4 * (1 - kappa["right"]) + 4 * (1 - kappa["wrong"]),
    )
    expected = moments[0] / moments[1]
    assert rho.value == pytest.approx(expected) and rho.n == 4


def test_round_2_is_fitted_against_the_other_members_round_1_score(tmp_path):
    """EM on round-2 scores: a member follows the OTHER member's round-1 score with p_follow, else
    draws round2. Ten committees whose members swap their round-1 scores (both follow), ten whose
    members both say 0.5 after 0 and 1 (both fresh): p_follow 0.5, round2 all on 0.5, exactly (the
    EM's guard is no estimate); its interval counts the fresh draws alone (decisions C11)."""
    swap = ((0.0, 1.0), (1.0, 0.0))
    fresh = ((0.0, 1.0), (0.5, 0.5))
    run = write_run(tmp_path / "run", *(task(t, output(t, 0, S, W, finalize=True, ok=True, part=True,
                                                      committee=swap if t <= 10 else fresh)) for t in range(1, 21)))  # fmt: skip
    weak = fit_run(run, n_boot=50)[W]
    assert weak["p_follow"].value == pytest.approx(0.5, abs=1e-6) and weak["p_follow"].n == 40
    round2 = weak["round2.strong_author.correct"]
    assert tuple(round2.value) == (0.0, 0.0, 1.0, 0.0) and round2.n == 40
    # the 0.5 anchor's share is 1 in the trace: its lower bound is Clopper-Pearson's at the 20 fresh draws
    assert round2.interval(0.95)[2, 0] == pytest.approx(0.025 ** (1 / 20))


def test_takeover_rates_are_fix_after_a_wrong_original_and_keep_after_a_right_one(tmp_path):
    outs = [(False, True), (False, True), (False, False), (True, True), (True, True), (True, True), (True, False)]  # fmt: skip
    run = write_run(tmp_path / "run", *(
        task(t, output(t, 0, W, S, finalize=True, ok=before, part=before, q=0.0, takeover=True, before=before,
                       after=after, synthesis=S)) for t, (before, after) in enumerate(outs, 1)))  # fmt: skip
    strong = fit_run(run)[S]
    assert (strong["p_fix"].value, strong["p_fix"].n) == (pytest.approx(2 / 3), 3)
    assert (strong["p_keep"].value, strong["p_keep"].n) == (pytest.approx(3 / 4), 4)


def test_live_takeovers_are_read_on_finalize_outputs_only(tmp_path):
    """A live Contribute's correct_before / after are placeholders (False): its Takeovers are not
    counted (decisions C2); a Finalize's are gold-scored."""
    live = dict(live=True, q=0.0, takeover=True, synthesis=S)
    run = write_run(tmp_path / "run", *(
        task(t, output(t, 0, W, S, **live), output(t, 1, W, S, finalize=True, ok=True, before=t == 2, after=True, **live))
        for t in (1, 2)))  # fmt: skip
    strong = fit_run(run)[S]
    assert (strong["p_fix"].value, strong["p_fix"].n) == (1.0, 1)
    assert (strong["p_keep"].value, strong["p_keep"].n) == (1.0, 1)


def test_p_rescue_counts_right_parts_on_wrong_drafts_with_a_right_pair(tmp_path):
    """Truth rows: a Finalize with the pair right, the draft wrong and its own part right; the
    share of right answers among them."""

    def on_wrong_draft(t, ok, part=True, pair_ok=True):
        return task(t, output(t, 0, W, S, ok=False, q=1.0), output(t, 1, S, W, finalize=True, ok=ok, part=part),
                    pair_ok=pair_ok)  # fmt: skip

    run = write_run(tmp_path / "run", on_wrong_draft(1, True), on_wrong_draft(2, True), on_wrong_draft(3, False),
                    on_wrong_draft(4, False, part=False), on_wrong_draft(5, False, pair_ok=False),
                    task(6, output(6, 0, W, S, ok=True, q=1.0), output(6, 1, S, W, finalize=True, ok=False, part=True)))  # fmt: skip
    rescue = fit_run(run)[S]["p_rescue"]
    assert (rescue.value, rescue.n) == (pytest.approx(2 / 3), 3)


def test_p_rescue_of_a_live_run_is_deconvolved_by_p_part(tmp_path):
    """A live run of the no_takeover variant (`ablate`): a Contribute judged at or below 0.40 stays in
    the draft, which the proxy then calls wrong. Its Finalize part is unknown, so p_rescue is
    P(answer ok | draft wrong) / p_part (the module docstring), p_part from the gold-settled parts
    (here 3 of 4), a proxy throughout."""
    live = dict(live=True)
    settled = [task(t, output(t, 0, W, S, q=1.0, **live), output(t, 1, S, W, finalize=True, ok=t != 4, **live))
               for t in (1, 2, 3, 4)]  # fmt: skip
    kept_wrong = [task(t, output(t, 0, W, S, scores=(0.25, 0.25, 0.25), **live),
                       output(t, 1, S, W, finalize=True, ok=t == 5, **live)) for t in (5, 6)]  # fmt: skip
    strong = fit_run(write_run(tmp_path / "run", *settled, *kept_wrong))[S]
    assert strong["p_part.bbh.default"].value == 0.75
    rescue = strong["p_rescue"]
    assert rescue.identified and (rescue.n, rescue.proxy) == (2, 1.0)
    assert rescue.value == pytest.approx(1 / (2 * 0.75))


def test_completion_bounds_are_the_integer_uniform_of_the_samples_mean_and_variance(tmp_path):
    """[min, max] of the integer uniform with the sample's mean and variance ((max - min + 1)^2 - 1)
    / 12 (the sample variance, n - 1), min clipped at 0 keeping the mean."""
    gens = (100, 110, 100, 110)  # mean 105, sample variance 100 / 3: [95, 115]
    infers = (3, 4, 5, None)  # mean 4, sample variance 1: [3, 5]
    run = write_run(tmp_path / "run", *(
        task(t, output(t, 0, S, W, finalize=True, ok=True, part=True, gen=(0, g), review=(0, 30 if t == 1 else 0)),
             infer=None if i is None else (W, True, 0, i)) for t, (g, i) in enumerate(zip(gens, infers), 1)))  # fmt: skip
    estimates = fit_run(run)
    assert tuple(estimates[S]["completion_tokens.generate"].value) == (95, 115)
    assert tuple(estimates[W]["completion_tokens.infer"].value) == (3, 5)
    # the weak model's twelve review samples: three of 30, nine of 0 (mean 7.5, sample variance 184):
    # the width (46) would take min below 0, so [0, 2 x mean]
    assert tuple(estimates[W]["completion_tokens.review"].value) == (0, 15)
    assert estimates[S]["completion_tokens.generate"].integer


def prompt_run(folder: Path) -> Path:
    """The strong model's outputs judged by the weak one, prompts built as the emulator builds them
    (spec/emulator.md tokens) from these bases: infer 700, generate 500, review 600, committee1 650,
    committee2 800, candidate 700, synthesis 800; the strong answer_fraction 0.5, the weak model's
    its packaged file's (it authors nothing here, so its own is not identified)."""
    weak_af = load_model(W).answer_fraction
    tasks = []
    for t, c in enumerate((100, 200, 300, 400), 1):
        context = 500 + Q_TOKENS - 500 + c // 2  # generate prompt - generate base + visible answer
        calls, reviews, row = task(t, output(t, 0, S, W, finalize=True, ok=True, part=True, gen=(500 + Q_TOKENS, c),
                                             review=(600 + context, 50)), infer=(S, True, 700 + Q_TOKENS))  # fmt: skip
        if t == 1:  # a committee and a Takeover on the first output, the members' texts 101 tokens
            key = dict(t=1, visit=0, author=0, ability=0, model=W)
            calls += [dict(key, kind="committee1", agent=a, score=1.0, correct=True, prompt_tokens=650 + context,
                           completion_tokens=101) for a in (1, 2)]  # fmt: skip
            calls += [dict(key, kind="committee2", agent=a, score=1.0, correct=True,
                           prompt_tokens=800 + context + 2 * math.floor(weak_af * 101)) for a in (1, 2)]  # fmt: skip
            calls += [dict(key, kind="candidate", agent=a, prompt_tokens=700 + context, completion_tokens=201)
                      for a in (1, 2)]  # fmt: skip
            synthesis = 800 + context + 2 * math.floor(weak_af * 201)
            calls.append(dict(key, kind="synthesis", prompt_tokens=synthesis, correct=True))
            # a later generate of the task (not its first): its prompt holds the draft, not read as a base
            calls.append(dict(t=1, visit=1, author=1, ability=1, kind="generate", model=S, prompt_tokens=5000,
                              completion_tokens=100, answer_id=None, correct=True))  # fmt: skip
        tasks.append((calls, reviews, row))
    return write_run(folder, *tasks)


def test_answer_fraction_is_the_slope_of_the_review_prompt_on_the_generate_completion(tmp_path):
    """answer_fraction: the OLS slope of (review prompt - generate prompt) on the generate
    completion, pooled over the author's reviewers; its interval widened by half a token per mean
    completion (floor() quantises the visible tokens)."""
    af = fit_run(prompt_run(tmp_path / "run"), n_boot=30)[S]["answer_fraction"]
    assert af.value == pytest.approx(0.5) and af.n == 12  # three review calls per output
    slack = 0.5 * 12 / (3 * (100 + 200 + 300 + 400))
    np.testing.assert_allclose(af.interval(0.95), [0.5 - slack, 0.5 + slack])
    # a fraction: a review prompt that shrinks as the answer grows gives 0, not a negative slope
    shrinking = write_run(tmp_path / "shrinking", *(
        task(t, output(t, 0, S, W, finalize=True, ok=True, part=True, gen=(1000, 100 * t), review=(2000 - 100 * t, 0)))
        for t in (1, 2, 3)))  # fmt: skip
    assert fit_run(shrinking)[S]["answer_fraction"].value == 0.0


def test_prompt_bases_are_the_prompt_less_the_reconstructed_context(tmp_path):
    """prompt_tokens.<kind>: prompt - question tokens (infer, a task's first generate) or - the judged
    context (generate prompt - generate base + visible answer, plus a committee's visible round-1
    texts or a synthesis's candidates, each floor(answer_fraction x completion) of its caller)."""
    estimates = fit_run(prompt_run(tmp_path / "run"))
    bases = {kind: estimates[stem][f"prompt_tokens.{kind}"].value for stem, kind in
             ((S, "infer"), (S, "generate"), (W, "review"), (W, "committee1"), (W, "committee2"),
              (W, "candidate"), (W, "synthesis"))}  # fmt: skip
    assert bases == {"infer": 700, "generate": 500, "review": 600, "committee1": 650, "committee2": 800,
                     "candidate": 700, "synthesis": 800}  # fmt: skip


def test_intervals_of_integer_values_round_outward_and_judge_names_why_a_value_is_kept():
    e = C.Estimate(reps=np.array([5.0, 4.7, 4.8, 5.2, 5.3]), n=30, integer=True)
    low, high = np.percentile([4.7, 4.8, 5.2, 5.3], [2.5, 97.5])  # 4.71, 5.29: rounded, 5 and 5
    assert tuple(e.interval(0.95)) == (np.floor(low), np.ceil(high)) == (4.0, 6.0)
    assert C.judge(np.array([0.5, 0.5]), 0, 0).note == "no observations in the traces"
    assert C.judge(np.array([np.nan, 0.5]), 30, 20).note == "not estimable from these observations"
    categorical = np.array([[0.5, np.nan], [0.5, 0.5]])  # one anchor undefined in the trace
    assert C.judge(categorical, 30, 20).note == "not estimable from these observations"


# ----------------------------------------------------------------------------------------------
# What is written (decisions C5, C8)
# ----------------------------------------------------------------------------------------------


def types_run(folder: Path) -> Path:
    """Strong Finalize parts of two bbh task types: object_counting 2 of 3 right, navigate 4 of 4."""
    parts = [(0, True), (0, True), (0, False), (1, True), (1, True), (1, True), (1, True)]
    return write_run(folder, *(task(t, output(t, 0, S, W, finalize=True, ok=part, part=part), task_type=k)
                               for t, (k, part) in enumerate(parts, 1)))  # fmt: skip


def test_p_part_per_type_is_reported_and_written_only_when_asked_or_in_the_base_file(tmp_path, capsys):
    run = types_run(tmp_path / "run")
    result, doc = C.calibrate([run], tmp_path / "pooled", n_boot=5, min_n=1)
    strong = result.estimates[S]
    assert strong["p_part.bbh.default"].value == pytest.approx(6 / 7)
    assert strong["p_part.bbh.object_counting"].value == pytest.approx(2 / 3)
    assert strong["p_part.bbh.navigate"].value == 1.0
    written = tomllib.loads((tmp_path / "pooled" / f"{S}.toml").read_text())["p_part"]["bbh"]
    assert set(written) == {"default"} and written["default"] == pytest.approx(6 / 7, abs=1e-5)
    params = doc["models"][S]["parameters"]
    assert params["p_part.bbh.navigate"]["identified"] and not params["p_part.bbh.navigate"]["written"]
    C.print_fit(result)
    assert "reported (--per-type to write)" in capsys.readouterr().out
    # --per-type writes every type
    C.calibrate([run], tmp_path / "per-type", n_boot=5, min_n=1, per_type=True)
    written = tomllib.loads((tmp_path / "per-type" / f"{S}.toml").read_text())["p_part"]["bbh"]
    assert set(written) == {"default", "object_counting", "navigate"}
    # a type the base file already has is written (refitted) without it
    base = shutil.copytree(MODEL_DIR, tmp_path / "base", ignore=shutil.ignore_patterns("fit_start"))
    model_file(base, S, p_part={**load_model(S).p_part, "bbh": {"default": 0.9, "navigate": 0.5}})
    _, doc = C.calibrate([run], tmp_path / "with-base", base_dir=base, n_boot=5, min_n=1)
    written = tomllib.loads((tmp_path / "with-base" / f"{S}.toml").read_text())["p_part"]["bbh"]
    assert written == {"default": pytest.approx(6 / 7, abs=1e-5), "navigate": 1.0}
    assert doc["models"][S]["parameters"]["p_part.bbh.navigate"]["written"] is True


def test_calibration_json_keeps_integers_and_a_kept_value_says_why(tmp_path):
    run = simple_run(tmp_path / "run")
    _, doc = C.calibrate([run], tmp_path / "fit", n_boot=5, min_n=1)
    params = doc["models"][S]["parameters"]
    base = params["n_distractors"]["base"]
    assert base == load_model(S).n_distractors and isinstance(base, int)
    assert params["n_distractors"]["value"] is None and params["n_distractors"]["written"] is False
    assert isinstance(params["prompt_tokens.infer"]["base"], int)
    assert params["p_rescue"]["value"] is None and params["p_rescue"]["interval"] == [None, None]
    text = (tmp_path / "fit" / f"{S}.toml").read_text()
    assert re.search(r"^n_distractors = \d+  # kept from the base file \(traces record whether an answer is "
                     r"right, not which wrong answer it is\)$", text, re.MULTILINE)  # fmt: skip
    kept = r"^p_rescue = [\d.]+  # kept from the base file \(no observations in the traces\)$"
    assert re.search(kept, text, re.MULTILINE)
    json.loads((tmp_path / "fit" / "calibration.json").read_text(), parse_constant=pytest.fail)  # no NaN


def test_written_values_are_valid_for_the_model_file():
    """Probabilities clipped into [0, 1], a categorical rounded to 5 decimals summing to 1 (its
    largest anchor takes the rounding), token figures whole and never below 0."""
    model = load_model(S)
    assert C.probabilities((1 / 3, 1 / 3, 1 / 3, 0.0)) == (0.33334, 0.33333, 0.33333, 0.0)
    assert C.probabilities((0.5, -0.1, 0.25, 0.25)) == (0.5, 0.0, 0.25, 0.25)
    changed = C.with_values(model, {"p_infer": 1.2, "p_fix": -0.1, "p_part.bbh.default": 1.5,
                                    "completion_tokens.review": (-20.4, 39.6), "completion_tokens.infer": (50, 40),
                                    "prompt_tokens.review": -3.0})  # fmt: skip
    assert (changed.scalars["p_infer"], changed.scalars["p_fix"]) == (1.0, 0.0)
    assert changed.p_part["bbh"]["default"] == 1.0
    assert changed.completion_tokens["review"] == (0, 40) and changed.completion_tokens["infer"] == (50, 50)
    assert changed.prompt_tokens["review"] == 0


# ----------------------------------------------------------------------------------------------
# Settings the command refuses
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [(dict(n_boot=0), "--bootstrap must be >= 1, got 0"), (dict(level=1.0), "--level must be in (0, 1), got 1.0"),
     (dict(level=0.0), "--level must be in (0, 1), got 0.0")],
)  # fmt: skip
def test_fit_settings_out_of_range_are_refused_before_anything_is_written(tmp_path, settings, message):
    run = simple_run(tmp_path / "run")
    with pytest.raises(MeshHealError) as err:
        C.calibrate([run], tmp_path / "fit", **settings)
    assert str(err.value) == message and not (tmp_path / "fit").exists()


def test_the_command_needs_an_out_folder_and_a_round_trip_takes_no_run_folders(tmp_path):
    run = simple_run(tmp_path / "run")
    with pytest.raises(
        MeshHealError, match=r"^--out DIR is required \(the folder of fitted parameter files\)$"
    ):
        C.body(C.CalibrateConfig(run_dirs=(run,), check=False))
    with pytest.raises(MeshHealError, match="^--roundtrip makes its own traces: give no run folders$"):
        C.body(C.CalibrateConfig(run_dirs=(run,), roundtrip=True, out=tmp_path / "trip"))
    assert not (tmp_path / "trip").exists()


def test_a_shares_band_counts_its_expected_events_from_the_lower_edge():
    """The coverage table's bands (decisions C11): 0-5, 5-20, 20-100, >= 100 expected events
    n x min(p, 1 - p), each holding its lower edge."""
    report = {"parameters": [{"model": S, "parameter": "p_infer", "true": 0.75, "interval": [0.0, 1.0], "n": n,
                              "share": True} for n in (16, 20, 80, 400)]}  # fmt: skip
    bands = [r["band"] for r in C.element_rows(report)]
    assert bands == [
        "shares, 0-5 events",
        "shares, 5-20 events",
        "shares, 20-100 events",
        "shares, >= 100 events",
    ]
