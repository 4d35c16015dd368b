"""`python -m meshheal_jax.calibrate`: fit emulator parameter files from run traces (the digital twin).

    python -m meshheal_jax.calibrate runs/live-x [runs/live-y ...] --out runs/twin
    python -m meshheal_jax.main --params-dir runs/twin ...        # the twin, at any scale
    python -m meshheal_jax.calibrate --roundtrip --out runs/calibrate-roundtrip

spec/calibrate.md. Reads the MeshHeal rows of each run folder's calls / reviews / tasks tables,
maps every call's `model` (a model id, a file stem or a role name) to its parameter file through
the run's pair (the `pair` column and config.json's params_dir / live model ids), and inverts the
generative model of spec/emulator.md per model file:

| parameter                 | estimator (all rows are MeshHeal calls of the model)                        |
|---------------------------|-----------------------------------------------------------------------------|
| p_infer                   | share of infer calls returning the documented pair                          |
| p_part.<dataset>.default  | share of correct parts among generate calls (pooled over task types; per    |
|   (and .<task type>)      | type reported, written with --per-type or where the base file has the type) |
| p_rescue                  | P(answer ok | Finalize, pair ok, draft wrong, own part right)                |
| review.<role>.<label>     | the model's review and committee round-1 scores, by the author's role and   |
|                           | the judged part's correctness (all of them are draws of that categorical)  |
| rho_same                  | from the 3-sample groups: P(u_k = u_1) = rho + (1 - rho) * sum(pi^2)         |
| p_follow, round2.*        | EM on round-2 scores against the other member's round-1 score (follow or    |
|                           | fresh draw from round2)                                                     |
| p_fix / p_keep            | synthesis correctness after a wrong / right original (Takeover)             |
| completion_tokens.<kind>  | [min, max] of the integer uniform with the sample's mean and variance        |
| answer_fraction           | slope of (review prompt - generate prompt) on the generate completion       |
| prompt_tokens.<kind>      | prompt - question tokens (profile mean) - reconstructed context            |

Truth. An emulated trace carries the latent truth (a review call's `correct` is the judged part's
correctness, reviews.part_correct and correct_before/after are exact). A live trace carries the
pair's correctness and gold-scored final answers only (reviews.part_correct is False there), so:
- The draft's correctness (every Contribute output of the task as it joined the draft) is a
  PROXY: accepted without Takeover = right; after Takeover or unreviewed = unknown (excluded).
- p_part: a Finalize part is settled by the gold answer when the pair and the (proxy) draft are
  right (answer ok iff part ok); a Contribute part is labelled by its final judgement (q > 0.40),
  a PROXY. Both are biased by the reviewers' errors: wrong parts that pass count as right, and a
  wrong draft that passed makes a right Finalize part look wrong. On the round trip's trace with
  the truth stripped (tests/test_calibrate.py) the strong model's p_part comes out ~0.05 high
  and the twin fitted from it ~0.07 more accurate than the trace (docs/decisions.md C2).
- p_rescue: no draft is ever known to be wrong without truth (accepted = right, else unknown):
  not identified in live traces. (Rows without part truth would be deconvolved:
  P(answer ok | draft wrong) / p_part.)
- Review categoricals, rho_same, round 2: only Finalize outputs whose own part the gold settles
  (answer right = part right, exact; answer wrong on a right draft = part wrong, resting on the
  draft proxy). Contribute outputs are never used there (their label would be the review itself),
  so the fit assumes a model judges Finalize and Contribute parts alike (the emulator does).
  Live parse failures (the neutral 0.5) stay in: the twin should see what the protocol saw.
- p_fix / p_keep: Finalize Takeovers only (gold before and after).
Each estimate records its proxy share in calibration.json. The files hold categoricals per author
ROLE: traces of several pairs pool, for one reviewer, the weak models it judged.

Intervals. Bootstrap over tasks: every replicate resamples the tasks of each stream with
replacement (seeded); every estimator is a function of per-task sums, so a replicate is one
weighted matrix product. Percentile intervals (--level); a share's is widened to hold the
Clopper-Pearson interval at its effective sample size (p(1 - p) / se^2, at most n: Korn and
Graubard 1998), as the percentile interval of a share from few events is too narrow and collapses
at 0 and 1 (decisions C11; `--roundtrip --roundtrip-repeats R` measures coverage); answer_fraction's is
widened by half a token per mean completion (floor() quantises visible tokens); the prompt bases
of the judged kinds condition on the point answer_fraction and generate base; integer parameters
get outward-rounded intervals. Tasks are the right unit for parameters (given the path, each
call's draws are independent) but not for a run's aggregates: one isolation changes every later
task, so the round trip compares accuracy / calls / tokens with intervals over streams (seeds).

Not identified: p_decide (MeshHeal makes no baseline decision calls), n_distractors and
p_popular_wrong (traces record right/wrong, not which wrong answer), and any cell with fewer than
--min-n observations (e.g. a model that never reviewed a weak author): they keep the base file's
values (--base-params-dir, default the packaged files) and calibration.json says so. Nor are the
optional structure parameters (difficulty_spread, review_difficulty, draft_blame; decisions E9,
E10): every estimator here reads marginal rates under independent draws, so a fitted file sets
them to 0 (kept, a base file's difficulty would shift the fitted marginals a second time); each
written file's header and calibration.json's `structure_reset` name the base values. Nor the
token figures of the baselines' own kinds (compose, refine, cot: MeshHeal makes no such call),
kept from the base file. The output
folder holds every base file (fitted ones rewritten), so it works as `--params-dir` on any pair.

The twin check (spec/calibrate.md; on unless --no-check; decisions C7): each traced run's
configuration is then emulated by MeshHeal with the fitted files into `--out`/twin-check/<k>, and
its accuracy, calls and tokens per task, overall and per phase, are compared with the traced
run's (intervals over streams, as the round trip); the table and calibration.json's `twin_check`
say which fall outside.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl
import scipy.sparse
import scipy.stats
import tyro

from meshheal_jax import metrics
from meshheal_jax.cli import entrypoint, new_table, print_table
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import (
    ANCHORS,
    AUTHOR_ROLES,
    BASELINE_TOKEN_KINDS,
    CALL_KINDS,
    MODEL_DIR,
    OPTIONAL,
    PAIRS,
    SCALARS,
    ModelParams,
    dump_model,
    load_model,
)
from meshheal_jax.topology import load_profile

LOW = metrics.LOW_SCORE + metrics.TOL  # a final score above this is an accepting judgement
STREAM = ("run", "method", "dataset", "pair", "seed")
TASK = (*STREAM, "t")
OUTPUT = (*TASK, "visit", "author", "ability")  # one generated output (visits are unique: moves <= 8)
NEEDED = {
    "calls": ("method", "dataset", "pair", "seed", "t", "visit", "kind", "agent", "author", "ability", "model",
              "prompt_tokens", "completion_tokens", "score", "answer_id", "correct"),
    "reviews": ("method", "dataset", "pair", "seed", "t", "visit", "author", "ability", "action", "part_correct",
                "q", "takeover", "correct_before", "correct_after"),
    "tasks": ("method", "dataset", "pair", "seed", "t", "task_type", "phase", "correct", "pair_correct", "calls",
              "tokens"),
}  # fmt: skip
NOT_IDENTIFIABLE = {
    "p_decide": "MeshHeal makes no baseline decision calls (router, speaker selection)",
    "p_popular_wrong": "traces record whether an answer is right, not which wrong answer it is",
    "n_distractors": "traces record whether an answer is right, not which wrong answer it is",
}
LIVE_RESCUE = (
    "needs Finalize outputs on a draft known to be wrong: without latent truth a draft is accepted "
    "(proxy: right) or unknown"
)
LABELS = {True: "correct", False: "wrong"}
INTERVALS = "percentile; shares also effective Clopper-Pearson (decisions C11)"  # in roundtrip.json
MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(ANCHORS))


# ----------------------------------------------------------------------------------------------
# Reading run folders
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trace:
    """The MeshHeal rows of one or more run folders. Every row carries `run` (folder index) and
    `unit` (its task's index, the bootstrap unit); calls also carry `order` (chronological within
    a stream), `stem`/`role` (its model's file and role in the pair) and `truth` (the run carries
    latent truth); tasks carry `type_name` and `question_tokens` (the profile's mean)."""

    calls: pl.DataFrame
    reviews: pl.DataFrame
    tasks: pl.DataFrame
    strata: np.ndarray  # (n_units,) the stream of each task
    sources: tuple[str, ...]
    truth: tuple[bool, ...]  # per run


def read_table(run_dir: Path, name: str) -> pl.DataFrame:
    path = run_dir / f"{name}.parquet"
    if not path.is_file():
        raise MeshHealError(f"{path} not found: a run folder holds calls.parquet, reviews.parquet and "
                            "tasks.parquet (is the run finished?)")  # fmt: skip
    try:
        frame = pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as err:
        raise MeshHealError(f"cannot read {path}: {err}") from None
    missing = [c for c in NEEDED[name] if c not in frame.columns]
    if missing:
        raise MeshHealError(f"{path} lacks the columns {missing} (not a MeshHeal trace?)")
    return frame


def read_experiment(run_dir: Path) -> dict:
    """config.json's experiment (empty when the folder has none)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MeshHealError(f"{path} is not valid JSON") from None
    experiment = doc.get("experiment") or {} if isinstance(doc, dict) else None
    if not isinstance(experiment, dict):
        raise MeshHealError(f"{path} is not a run's config.json (its experiment is not an object)")
    return experiment


def model_map(experiment: dict, pairs: Sequence[str], base_dir: Path) -> pl.DataFrame:
    """(pair, model) -> (stem, role): every name a trace may write for a pair's two models (the
    file's model id, the file stem, the role name, a live run's model ids and served names)."""
    params_dir = experiment.get("params_dir")
    directory = Path(params_dir) if params_dir and Path(params_dir).is_dir() else base_dir
    live = experiment.get("live") or {}
    rows = []
    for pair in pairs:
        if pair not in PAIRS:
            raise MeshHealError(f"trace pair {pair!r} is not a known pair ({sorted(PAIRS)})")
        for role, stem in zip(("strong", "weak"), PAIRS[pair]):
            source = directory if (directory / f"{stem}.toml").exists() else base_dir
            names = {stem, role, load_model(stem, source).model, live.get(f"{role}_model"),
                     live.get(f"{role}_served_name")} - {None}  # fmt: skip
            rows += [{"pair": pair, "model": str(name), "stem": stem, "role": role} for name in names]
    schema = {"pair": pl.String, "model": pl.String, "stem": pl.String, "role": pl.String}
    frame = pl.DataFrame(rows, schema=schema)
    clash = frame.group_by("pair", "model").agg(pl.col("stem").n_unique().alias("n")).filter(pl.col("n") > 1)
    if clash.height:
        raise MeshHealError(
            f"model names {clash['model'].to_list()} name both models of a pair; cannot tell them apart"
        )
    return frame.unique(["pair", "model"])


def dataset_facts(datasets: Sequence[str], profiles_dir: str | None) -> pl.DataFrame:
    """(dataset, task_type index) -> task type name and the profile's mean question tokens."""
    rows = []
    for dataset in datasets:
        profile = load_profile(dataset, Path(profiles_dir) if profiles_dir else None)
        rows += [{"dataset": dataset, "task_type": k, "type_name": name, "question_tokens": profile.question_tokens}
                 for k, name in enumerate(profile.task_types)]  # fmt: skip
    return pl.DataFrame(rows, schema={"dataset": pl.String, "task_type": pl.Int64, "type_name": pl.String,
                                      "question_tokens": pl.Int64})  # fmt: skip


def check_run_folder(run_dir: Path) -> None:
    """A folder that is no run folder is named as what it is: missing, or a top folder of run
    folders (`scale` writes one per topology, `sweep` one per value)."""
    if not run_dir.is_dir():
        raise MeshHealError(f"run folder {run_dir} does not exist")
    if not (run_dir / "calls.parquet").exists():
        inner = sorted(str(d) for d in run_dir.iterdir() if (d / "calls.parquet").is_file())
        if inner:
            shown = " ".join(inner[:4]) + (f" (and {len(inner) - 4} more)" if len(inner) > 4 else "")
            raise MeshHealError(f"{run_dir} is a folder of run folders, not a run: give those ({shown})")


def read_run(run_dir: Path, run: int, base_dir: Path) -> tuple[dict[str, pl.DataFrame], bool, str]:
    """One run folder's MeshHeal rows, labelled; whether it carries latent truth; and a fingerprint
    of its calls (`calls_fingerprint`)."""
    check_run_folder(run_dir)
    frames = {name: read_table(run_dir, name).filter(pl.col("method") == "meshheal") for name in NEEDED}
    calls = frames["calls"]
    if calls.is_empty():
        raise MeshHealError(f"{run_dir / 'calls.parquet'} holds no MeshHeal calls: nothing to fit")
    experiment = read_experiment(run_dir)
    mapping = model_map(experiment, sorted(calls["pair"].unique().to_list()), base_dir)
    facts = dataset_facts(sorted(calls["dataset"].unique().to_list()), experiment.get("profiles_dir"))
    calls = calls.with_row_index("order").join(mapping, on=["pair", "model"], how="left")
    unknown = calls.filter(pl.col("stem").is_null()).select("pair", "model").unique()
    if unknown.height:
        params_dir = experiment.get("params_dir")
        missing = (f"; the run's params_dir {params_dir} is not a folder here, so {base_dir} was read"
                   if params_dir and not Path(params_dir).is_dir() else "")  # fmt: skip
        raise MeshHealError(f"{run_dir / 'calls.parquet'}: model names {unknown.rows()} match no parameter file of "
                            f"their pair (known: {mapping.rows()}){missing}")  # fmt: skip
    # latent truth: a correctness on a call the gold cannot score (a review, a Contribute generation)
    partial = pl.col("kind").is_in(["review", "committee1", "committee2"]) | (
        (pl.col("kind") == "generate") & pl.col("answer_id").is_null()
    )
    truth = bool(calls.filter(partial)["correct"].is_not_null().any())
    q_tokens = facts.select("dataset", "question_tokens").unique()
    labelled = {
        "calls": calls.join(q_tokens, on="dataset", how="left"),
        "reviews": frames["reviews"],
        "tasks": frames["tasks"].join(facts, on=["dataset", "task_type"], how="left"),
    }
    extra = [pl.lit(run, pl.Int64).alias("run"), pl.lit(truth).alias("truth")]
    return (
        {name: df.with_columns(extra) for name, df in labelled.items()},
        truth,
        calls_fingerprint(frames["calls"]),
    )


def calls_fingerprint(calls: pl.DataFrame) -> str:
    """sha256 of the calls table's sorted row hashes: equal for two copies of one run folder (or
    two runs of the same deterministic settings), whatever their paths or row order."""
    rows = np.sort(calls.hash_rows(seed=0).to_numpy())
    return hashlib.sha256(rows.tobytes()).hexdigest()


def task_units(tasks: pl.DataFrame, calls: pl.DataFrame | None = None) -> tuple[pl.DataFrame, np.ndarray]:
    """Every task (stream, t) as a bootstrap unit: (TASK columns + unit, (n_units,) stratum = stream)."""
    keys = tasks.select(TASK) if calls is None else pl.concat([tasks.select(TASK), calls.select(TASK)])
    units = keys.unique().sort(TASK).with_row_index("unit").with_columns(pl.col("unit").cast(pl.Int64))
    streams = units.select(STREAM).unique().sort(STREAM).with_row_index("stratum")
    strata = units.join(streams, on=STREAM, how="left").sort("unit")["stratum"].to_numpy()
    return units, strata


def load_trace(run_dirs: Sequence[Path], base_dir: Path = MODEL_DIR) -> Trace:
    """Read and label the run folders (MeshHealError naming the file when one is missing or empty)."""
    if not run_dirs:
        raise MeshHealError(
            "no run folders given (python -m meshheal_jax.calibrate RUN_DIR [RUN_DIR...] --out DIR)"
        )
    runs = [read_run(Path(d), k, base_dir) for k, d in enumerate(run_dirs)]
    seen: dict[str, Path] = {}
    for d, (_, _, fingerprint) in zip(run_dirs, runs, strict=True):
        if fingerprint in seen:  # a run counted twice would narrow every interval
            raise MeshHealError(f"run folders {seen[fingerprint]} and {d} hold the same calls (a copy of one run, "
                                "or the same settings run twice): give each run once")  # fmt: skip
        seen[fingerprint] = Path(d)
    tables = {name: pl.concat([r[0][name] for r in runs], how="vertical_relaxed") for name in NEEDED}
    units, strata = task_units(tables["tasks"], tables["calls"])
    joined = {name: df.join(units, on=TASK, how="left") for name, df in tables.items()}
    return Trace(joined["calls"], joined["reviews"], joined["tasks"], strata,
                 tuple(str(d) for d in run_dirs), tuple(r[1] for r in runs))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Derived rows: what each estimator counts
# ----------------------------------------------------------------------------------------------


def anchor_index(score: pl.Expr) -> pl.Expr:
    """A score's anchor (0, 0.25, 0.5, 1.0) -> 0..3 (nearest anchor)."""
    return sum((score > m).cast(pl.Int64) for m in MIDPOINTS)


def outputs(trace: Trace) -> pl.DataFrame:
    """One row per generated output (a generate call) with its labels:

    - part_label: the part's correctness for p_part (truth; live: gold-settled Finalize part or
      the Contribute's final judgement, a proxy), part_proxy marks the proxy rows;
    - review_label: the part's correctness for the review fits (truth; live: gold-settled Finalize
      parts only), review_proxy marks labels resting on the draft proxy;
    - draft_ok: every Contribute output of the task right as it joined the draft (Finalize rows)."""
    gen = trace.calls.filter(pl.col("kind") == "generate").select(
        *OUTPUT, "unit", "order", "truth", "stem", "role", "question_tokens",
        pl.col("answer_id").is_not_null().alias("finalize"), pl.col("correct").alias("generated_ok"),
        pl.col("prompt_tokens").alias("prompt_g"), pl.col("completion_tokens").alias("completion_g"),
    )  # fmt: skip
    reviews = trace.reviews.select(*OUTPUT, "part_correct", "q", "takeover", "correct_after",
                                   pl.lit(True).alias("reviewed"))  # fmt: skip
    tasks = trace.tasks.select(*TASK, "type_name", "pair_correct")
    out = gen.join(reviews, on=OUTPUT, how="left").join(tasks, on=TASK, how="left")
    out = out.with_columns(pl.col("reviewed").fill_null(False))
    truth, reviewed, finalize = pl.col("truth"), pl.col("reviewed"), pl.col("finalize")
    kept_ok = (
        pl.when(truth)
        .then(pl.when(reviewed).then(pl.col("correct_after")).otherwise(pl.col("generated_ok")))
        .when(reviewed & ~pl.col("takeover"))
        .then(pl.col("q") > LOW)
    )  # live: unknown after Takeover
    draft = (out.filter(~finalize).group_by(TASK)
             .agg(pl.len().alias("n_contributed"), kept_ok.is_null().any().alias("draft_unknown"),
                  kept_ok.all().alias("draft_all_ok")))  # fmt: skip
    out = out.join(draft, on=TASK, how="left").with_columns(
        pl.when(pl.col("n_contributed").is_null()).then(True).when(pl.col("draft_unknown")).then(None)
        .otherwise(pl.col("draft_all_ok")).alias("draft_ok"),
        (~truth & (pl.col("n_contributed").fill_null(0) > 0)).alias("draft_proxy"),
    )  # fmt: skip
    answer, pair_ok, draft_ok = pl.col("generated_ok"), pl.col("pair_correct"), pl.col("draft_ok")
    part_truth = pl.when(finalize).then(pl.col("part_correct")).otherwise(answer)
    settled = pl.when(pair_ok & answer).then(True).when(pair_ok & ~answer & draft_ok).then(False)
    return out.with_columns(
        pl.when(truth).then(part_truth)
        .when(finalize).then(pl.when(pair_ok & draft_ok).then(answer))
        .otherwise(pl.when(reviewed).then(pl.col("q") > LOW)).alias("part_label"),
        (~truth & (~finalize | pl.col("draft_proxy"))).alias("part_proxy"),
        pl.when(truth).then(part_truth).when(finalize).then(settled).alias("review_label"),
        (~truth & ~answer.fill_null(True) & pl.col("draft_proxy")).alias("review_proxy"),
        pl.when(pl.col("role") == "strong").then(pl.lit(AUTHOR_ROLES[0])).otherwise(pl.lit(AUTHOR_ROLES[1]))
        .alias("author_role"),
    )  # fmt: skip


def judged_calls(trace: Trace, outs: pl.DataFrame, kinds: Sequence[str]) -> pl.DataFrame:
    """Calls of `kinds` on an output with a review label, with the author's role and the label."""
    labels = outs.filter(pl.col("review_label").is_not_null()).select(
        *OUTPUT, "author_role", pl.col("review_label").alias("label"), pl.col("review_proxy").alias("proxy")
    )
    return trace.calls.filter(pl.col("kind").is_in(list(kinds))).join(labels, on=OUTPUT, how="inner")


def review_rows(trace: Trace, outs: pl.DataFrame) -> pl.DataFrame:
    """Score samples (initial review and committee round 1: draws of review[author role][label]),
    one-hot a0..a3; plus one row per initial 3-sample group: pairs = 2, match = #(u_k == u_1)."""
    samples = judged_calls(trace, outs, ("review", "committee1")).with_columns(
        anchor_index(pl.col("score")).alias("a")
    )
    samples = samples.select("unit", "stem", "author_role", "label", pl.col("proxy").cast(pl.Int64),
                             *((pl.col("a") == k).cast(pl.Int64).alias(f"a{k}") for k in range(len(ANCHORS))))  # fmt: skip
    reviews = judged_calls(trace, outs, ("review",)).sort("order")
    groups = (reviews.group_by(OUTPUT).agg(pl.col("unit", "stem", "author_role", "label", "proxy").first(),
                                           anchor_index(pl.col("score")).alias("u"), pl.len().alias("n"))
              .filter(pl.col("n") == 3))  # fmt: skip
    triples = groups.select(
        "unit", "stem", "author_role", "label", pl.lit(2).alias("pairs"),
        pl.col("proxy").cast(pl.Int64).alias("proxy_triples"),
        ((pl.col("u").list.get(1) == pl.col("u").list.get(0)).cast(pl.Int64)
         + (pl.col("u").list.get(2) == pl.col("u").list.get(0)).cast(pl.Int64)).alias("match"),
    )  # fmt: skip
    return pl.concat([samples, triples], how="diagonal_relaxed").fill_null(0)


def round2_rows(trace: Trace, outs: pl.DataFrame) -> pl.DataFrame:
    """Round-2 scores v against the other member's round-1 score o: one-hot columns vo{v}{o}."""

    def members(kind: str) -> pl.DataFrame:
        calls = judged_calls(trace, outs, (kind,))
        return calls.with_columns(
            (pl.col("order").rank("ordinal").over(OUTPUT) - 1).cast(pl.Int64).alias("member")
        )

    first = members("committee1").select(*OUTPUT, (1 - pl.col("member")).alias("member"),
                                         anchor_index(pl.col("score")).alias("o"))  # fmt: skip
    second = members("committee2").join(first, on=[*OUTPUT, "member"], how="inner")
    second = second.with_columns(anchor_index(pl.col("score")).alias("v"))
    n = len(ANCHORS)
    return second.select("unit", "stem", "author_role", "label", pl.col("proxy").cast(pl.Int64),
                         *(((pl.col("v") == v) & (pl.col("o") == o)).cast(pl.Int64).alias(f"vo{v}{o}")
                           for v in range(n) for o in range(n)))  # fmt: skip


def takeover_rows(trace: Trace) -> pl.DataFrame:
    """Synthesis calls with the original's and the synthesis's correctness (live: Finalize only)."""
    reviews = trace.reviews.select(*OUTPUT, "action", "correct_before", "correct_after")
    synth = trace.calls.filter(pl.col("kind") == "synthesis").join(reviews, on=OUTPUT, how="inner")
    before, after = pl.col("correct_before"), pl.col("correct_after")
    return synth.filter(pl.col("truth") | (pl.col("action") == "finalize")).select(
        "unit", "stem", (~before).cast(pl.Int64).alias("wrong"), (~before & after).cast(pl.Int64).alias("fixed"),
        before.cast(pl.Int64).alias("right"), (before & after).cast(pl.Int64).alias("kept"),
    )  # fmt: skip


def rescue_rows(outs: pl.DataFrame) -> pl.DataFrame:
    """Finalize outputs with the right pair on a wrong draft: truth rows condition on the own part
    being right (exact); live rows do not (deconvolved by p_part later)."""
    rows = outs.filter(pl.col("finalize") & pl.col("pair_correct") & (pl.col("draft_ok") == False))
    rows = rows.filter(~pl.col("truth") | (pl.col("part_label") == True))
    return rows.select("unit", "stem", "dataset", pl.col("generated_ok").cast(pl.Int64).alias("ok"),
                       pl.col("truth").cast(pl.Int64).alias("exact"), (~pl.col("truth")).cast(pl.Int64).alias("deconv"))  # fmt: skip


def answer_fraction_rows(trace: Trace, outs: pl.DataFrame) -> pl.DataFrame:
    """Review calls against their output's generate call: y = review prompt - generate prompt
    = base difference + floor(answer_fraction[author] * generate completion)."""
    gen = outs.select(*OUTPUT, pl.col("stem").alias("author_stem"), "prompt_g", "completion_g")
    rows = trace.calls.filter(pl.col("kind") == "review").join(gen, on=OUTPUT, how="inner")
    c, y = (
        pl.col("completion_g").cast(pl.Float64),
        (pl.col("prompt_tokens") - pl.col("prompt_g")).cast(pl.Float64),
    )
    return rows.select("unit", "author_stem", "stem", pl.lit(1).alias("one"), c.alias("c"), (c * c).alias("c2"),
                       y.alias("y"), (c * y).alias("cy"))  # fmt: skip


def prompt_rows(trace: Trace, outs: pl.DataFrame, answer_fraction: dict[str, float],
                generate_base: dict[str, float]) -> pl.DataFrame:  # fmt: skip
    """Per call: y = prompt - what the emulator adds to the kind's base (spec/emulator.md tokens):
    infer and a task's first generate: the question tokens (profile mean); judged kinds: the
    judged context (generate prompt - generate base + the output's visible tokens); committee2 /
    synthesis: also the visible round-1 explanations / candidates. Visible = floor(af * completion)."""
    af = pl.DataFrame({"stem": list(answer_fraction), "af": list(answer_fraction.values())},
                      schema={"stem": pl.String, "af": pl.Float64})  # fmt: skip
    base = pl.DataFrame({"author_stem": list(generate_base), "base_g": list(generate_base.values())},
                        schema={"author_stem": pl.String, "base_g": pl.Float64})  # fmt: skip
    calls = trace.calls
    first = calls.filter(pl.col("kind") == "generate").filter(
        pl.col("order") == pl.col("order").min().over(TASK)
    )
    direct = pl.concat([calls.filter(pl.col("kind") == "infer"), first]).select(
        "unit",
        "stem",
        "kind",
        (pl.col("prompt_tokens") - pl.col("question_tokens")).cast(pl.Float64).alias("y"),
    )

    def visible(kind: str, name: str) -> pl.DataFrame:
        return (calls.filter(pl.col("kind") == kind).join(af, on="stem", how="inner")
                .group_by(OUTPUT).agg((pl.col("af") * pl.col("completion_tokens")).floor().sum().alias(name)))  # fmt: skip

    gen = (outs.select(*OUTPUT, pl.col("stem").alias("author_stem"), "prompt_g", "completion_g")
           .join(af.rename({"stem": "author_stem"}), on="author_stem", how="inner")
           .join(base, on="author_stem", how="inner"))  # fmt: skip
    judged = (calls.filter(pl.col("kind").is_in(["review", "committee1", "committee2", "candidate", "synthesis"]))
              .join(gen, on=OUTPUT, how="inner")
              .join(visible("committee1", "explained"), on=OUTPUT, how="left")
              .join(visible("candidate", "candidates"), on=OUTPUT, how="left"))  # fmt: skip
    extra = (pl.when(pl.col("kind") == "committee2").then(pl.col("explained").fill_null(0))
             .when(pl.col("kind") == "synthesis").then(pl.col("candidates").fill_null(0)).otherwise(0.0))  # fmt: skip
    context = pl.col("prompt_g") - pl.col("base_g") + (pl.col("af") * pl.col("completion_g")).floor() + extra
    judged = judged.select(
        "unit", "stem", "kind", (pl.col("prompt_tokens") - context).cast(pl.Float64).alias("y")
    )
    return pl.concat([direct, judged]).with_columns(pl.lit(1).alias("one"))


# ----------------------------------------------------------------------------------------------
# Bootstrap: per-task sums, one weighted product per replicate
# ----------------------------------------------------------------------------------------------


def bootstrap_weights(strata: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(1 + n_boot, n_units) task weights: row 0 all ones (the trace itself), then per replicate
    the multiplicities of a resample with replacement of each stream's tasks (seeded)."""
    rng = np.random.default_rng(seed)
    weights = np.ones((1 + n_boot, len(strata)))
    order = np.argsort(strata, kind="stable")
    bounds = np.flatnonzero(np.diff(strata[order])) + 1
    for members in np.split(order, bounds):  # one multinomial per stream
        weights[1:, members] = rng.multinomial(
            len(members), np.full(len(members), 1.0 / len(members)), size=n_boot
        )
    return weights


@dataclasses.dataclass(frozen=True)
class Totals:
    """Sums of per-row values per cell (a combination of key values) for the trace (index 0 of the
    leading axis) and every bootstrap replicate: sums (R, n_cells, n_values)."""

    cells: pl.DataFrame
    values: tuple[str, ...]
    sums: np.ndarray

    def at(self, value: str, **key) -> np.ndarray:
        """(R,) sum of `value` over the cells matching every key=value given."""
        mask = np.ones(self.cells.height, dtype=bool)
        for name, wanted in key.items():
            mask &= self.cells[name].to_numpy() == wanted
        return self.sums[:, mask, self.values.index(value)].sum(axis=1)

    def keys(self, *names: str) -> list[tuple]:
        return self.cells.select(names).unique(maintain_order=True).rows()


def totals(rows: pl.DataFrame, keys: Sequence[str], values: Sequence[str], weights: np.ndarray) -> Totals:
    """Per cell of `keys`, the weighted sum over tasks of each value column (vectorised: per-task
    sums as a sparse (tasks, cells) matrix times the (R, tasks) weights)."""
    n_reps, n_units = weights.shape
    agg = rows.group_by("unit", *keys).agg(pl.col(v).cast(pl.Float64).sum() for v in values)
    cells = agg.select(keys).unique().sort(keys)
    agg = agg.join(cells.with_row_index("cell"), on=list(keys), how="left", nulls_equal=True)
    sums = np.zeros((n_reps, cells.height, len(values)))
    unit, cell = agg["unit"].to_numpy(), agg["cell"].to_numpy()
    for j, value in enumerate(values):
        per_task = scipy.sparse.csr_matrix(
            (agg[value].to_numpy(), (unit, cell)), shape=(n_units, cells.height)
        )
        sums[:, :, j] = np.asarray(per_task.T @ weights.T).T
    return Totals(cells, tuple(values), sums)


# ----------------------------------------------------------------------------------------------
# Estimators (vectorised over replicates)
# ----------------------------------------------------------------------------------------------


def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def uniform_bounds(n: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """(R, 2) [min, max] of the integer uniform with the sample's mean and variance
    (var = ((max - min + 1)^2 - 1) / 12); min clipped at 0 keeping the mean."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = s1 / n
        var = np.maximum((s2 - n * mean * mean) / (n - 1), 0.0)
    width = np.sqrt(12.0 * var + 1.0) - 1.0
    low = np.maximum(mean - width / 2.0, 0.0)
    out = np.stack([low, 2.0 * mean - low], axis=-1)
    return np.where((n > 1)[..., None], out, np.nan)


def rho_same(probs: np.ndarray, pairs: np.ndarray, match: np.ndarray) -> np.ndarray:
    """(R,) rho from the cells of one reviewer: probs (R, C, 4), pairs/match (R, C). A repeat
    sample equals the first with P = rho + (1 - rho) * kappa, kappa = sum(pi^2); pooled method of
    moments: rho = sum(match - pairs * kappa) / sum(pairs * (1 - kappa))."""
    kappa = np.nan_to_num((probs * probs).sum(axis=-1))
    return np.clip(ratio((match - pairs * kappa).sum(-1), (pairs * (1.0 - kappa)).sum(-1)), 0.0, 1.0)


def follow_em(counts: np.ndarray, iterations: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """EM for round 2 of one model: counts (R, C, 4 v, 4 o) of its round-2 score v against the
    other member's round-1 score o, per cell C. With prob p_follow v = o, else v ~ round2[C].
    Returns p_follow (R,) and round2 probabilities (R, C, 4) (nan for an empty cell)."""
    diagonal = np.diagonal(counts, axis1=2, axis2=3)  # (R, C, 4): v == o
    by_v = counts.sum(axis=3)
    total = counts.sum(axis=(1, 2, 3))
    follow = np.full(total.shape, 0.5)
    probs = ratio(by_v + 1e-12, by_v.sum(-1, keepdims=True) + 4e-12)
    for _ in range(iterations):
        f = follow[:, None, None]
        share = np.nan_to_num(ratio(f, f + (1.0 - f) * probs))  # P(followed | v == o)
        followed = diagonal * share
        follow = ratio(followed.sum(axis=(1, 2)), total)
        own = by_v - followed + 1e-12
        probs = own / own.sum(-1, keepdims=True)
    probs = np.where(probs < 1e-9, 0.0, probs)  # the 1e-12 guard, not an estimate: exact zeros
    probs = np.where(by_v.sum(-1, keepdims=True) > 0, probs / probs.sum(-1, keepdims=True), np.nan)
    return follow, probs


def answer_fraction(t: Totals, author: str) -> np.ndarray:
    """(R,) pooled within-cell OLS slope of (review prompt - generate prompt) on the generate
    completion, over the reviewers of `author`'s outputs."""
    idx = np.flatnonzero(t.cells["author_stem"].to_numpy() == author)
    get = {v: t.sums[:, idx, t.values.index(v)] for v in t.values}
    n = np.maximum(get["one"], 1e-300)
    sxy = (get["cy"] - get["c"] * get["y"] / n).sum(-1)
    sxx = (get["c2"] - get["c"] ** 2 / n).sum(-1)
    return ratio(sxy, sxx)


# ----------------------------------------------------------------------------------------------
# The fit
# ----------------------------------------------------------------------------------------------


def effective_clopper_pearson(value: np.ndarray, se: np.ndarray, n: float, level: float) -> np.ndarray:
    """(..., 2) Clopper-Pearson interval of a share at its effective sample size (Korn and
    Graubard 1998, without their degrees-of-freedom correction): n_eff = p(1 - p) / se^2 from the
    bootstrap's own variance (clustered samples, e.g. a review's three correlated scores, count
    less than n), at most n; n itself where p is 0 or 1 or se is 0. Shares of few events are where
    the percentile interval of a bootstrap is too narrow (docs/decisions.md C11)."""
    value = np.asarray(value, dtype=float)
    inner = (se > 0) & (value > 0) & (value < 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        n_eff = np.where(inner, value * (1.0 - value) / np.square(se), n)
    n_eff = np.clip(n_eff, min(1.0, n), n)
    x = value * n_eff
    alpha = 1.0 - level
    with np.errstate(invalid="ignore"):
        low = np.where(x > 0, scipy.stats.beta.ppf(alpha / 2, x, n_eff - x + 1), 0.0)
        high = np.where(x < n_eff, scipy.stats.beta.ppf(1 - alpha / 2, x + 1, n_eff - x), 1.0)
    defined = np.isfinite(value)
    return np.stack([np.where(defined, low, np.nan), np.where(defined, high, np.nan)], axis=-1)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One parameter: reps (R,) or (R, k), index 0 the trace's value, then bootstrap replicates."""

    reps: np.ndarray
    n: int  # observations behind it
    integer: bool = False
    proxy: float = 0.0  # share of those observations labelled by a proxy
    note: str = ""  # why it is not identified (empty: identified)
    written: bool = True  # whether an identified value goes into the file
    binomial: bool = False  # a share of n trials (interval widened to the effective Clopper-Pearson)
    trials: float | None = None  # a share's trials when fewer than n (round 2: the fresh draws)
    slack: float = 0.0  # added on both sides of the interval (a known quantisation of the estimator)

    @property
    def identified(self) -> bool:
        return not self.note

    @property
    def value(self) -> np.ndarray:
        value = self.reps[0]
        return np.round(value) if self.integer else value

    def interval(self, level: float) -> np.ndarray:
        """(2,) or (k, 2) percentile interval over the replicates (outward-rounded for integers);
        a share's also holds its effective Clopper-Pearson interval (decisions C11)."""
        with warnings.catch_warnings():  # an all-nan column (no replicate defines it) gives nan, by design
            warnings.simplefilter("ignore", RuntimeWarning)
            low, high = np.nanpercentile(self.reps[1:], [50 * (1 - level), 50 * (1 + level)], axis=0)
        if self.integer:
            low, high = np.floor(low), np.ceil(high)
        if self.binomial and self.n > 0:  # few events: the percentile interval is too narrow
            trials = self.n if self.trials is None else self.trials
            exact = effective_clopper_pearson(self.reps[0], self.se, trials, level)
            low, high = np.fmin(low, exact[..., 0]), np.fmax(high, exact[..., 1])
        return np.stack([low - self.slack, high + self.slack], axis=-1)

    @functools.cached_property
    def se(self) -> np.ndarray:
        """Bootstrap standard error (nan where no replicate defines the value)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanstd(self.reps[1:], axis=0, ddof=1)


def judge(reps: np.ndarray, n: float, min_n: int, **kwargs) -> Estimate:
    """An Estimate, marked not identified when it rests on fewer than min_n observations."""
    n = round(float(n))
    note = kwargs.pop("note", "")
    if not note and n == 0:
        note = "no observations in the traces"
    elif not note and n < min_n:
        note = f"too few observations (n={n} < min_n={min_n})"
    elif not note and not np.all(np.isfinite(reps[0])):
        note = "not estimable from these observations"
    return Estimate(reps=reps, n=n, note=note, **kwargs)


@dataclasses.dataclass(frozen=True)
class Fit:
    estimates: dict[str, dict[str, Estimate]]  # stem -> parameter name -> estimate
    n_boot: int
    seed: int
    min_n: int


@dataclasses.dataclass(frozen=True)
class FitInputs:
    """What every family of estimators reads: the trace, its outputs, the task weights."""

    trace: Trace
    outs: pl.DataFrame  # outputs(trace)
    weights: np.ndarray  # (R, n_units): row 0 the trace, then the bootstrap replicates
    stems: tuple[str, ...]
    min_n: int


Estimates = dict[str, dict[str, Estimate]]  # stem -> parameter name -> estimate
ONE = pl.lit(1).alias("one")
CELLS = tuple((role, correct) for role in AUTHOR_ROLES for correct in (True, False))  # review / round2 cells


def share(t: Totals, num: str, den: str, min_n: int, **key) -> Estimate:
    """A binomial share num / den over the cells matching key."""
    n = t.at(den, **key)
    return judge(ratio(t.at(num, **key), n), n[0], min_n, binomial=True)


def fit_infer(f: FitInputs) -> Estimates:
    rows = f.trace.calls.filter((pl.col("kind") == "infer") & pl.col("correct").is_not_null())
    t = totals(rows.select("unit", "stem", ONE, pl.col("correct").cast(pl.Int64).alias("ok")), ("stem",),
               ("one", "ok"), f.weights)  # fmt: skip
    return {stem: {"p_infer": share(t, "ok", "one", f.min_n, stem=stem)} for stem in f.stems}


def fit_parts(f: FitInputs, base: dict[str, ModelParams], per_type: bool) -> Estimates:
    """p_part per (dataset, "default" pooled over types) and per (dataset, type)."""
    rows = f.outs.filter(pl.col("part_label").is_not_null()).select(
        "unit", "stem", "dataset", "type_name", ONE, pl.col("part_label").cast(pl.Int64).alias("ok"),
        pl.col("part_proxy").cast(pl.Int64).alias("proxy"))  # fmt: skip
    t = totals(rows, ("stem", "dataset", "type_name"), ("one", "ok", "proxy"), f.weights)
    out: Estimates = {stem: {} for stem in f.stems}
    for stem, dataset, type_name in t.keys("stem", "dataset", "type_name"):
        for key, cell in (("default", {}), (type_name, {"type_name": type_name})):
            e = share(t, "ok", "one", f.min_n, stem=stem, dataset=dataset, **cell)
            proxy = float(ratio(t.at("proxy", stem=stem, dataset=dataset, **cell)[:1], np.array([e.n]))[0])
            written = key == "default" or per_type or key in base[stem].p_part.get(dataset, {})
            out[stem][f"p_part.{dataset}.{key}"] = dataclasses.replace(e, proxy=proxy, written=written)
    return out


def fit_rescue(f: FitInputs, parts: Estimates) -> Estimates:
    """p_rescue = rescued answers / expected: 1 per truth row (own part known right), p_part per
    live row (own part unknown: P(answer ok | draft wrong) = p_part * p_rescue)."""
    t = totals(rescue_rows(f.outs), ("stem", "dataset"), ("ok", "exact", "deconv"), f.weights)
    out: Estimates = {}
    for stem in f.stems:
        expected = np.zeros(len(f.weights))
        for s, dataset in t.keys("stem", "dataset"):
            if s == stem:
                p_part = parts[stem].get(f"p_part.{dataset}.default")
                live = t.at("deconv", stem=stem, dataset=dataset)
                deconvolved = live * (p_part.reps if p_part is not None else np.nan)
                expected = (
                    expected
                    + t.at("exact", stem=stem, dataset=dataset)
                    + np.where(live > 0, deconvolved, 0.0)
                )
        n = t.at("exact", stem=stem) + t.at("deconv", stem=stem)
        note = "" if n[0] > 0 or any(f.trace.truth) else LIVE_RESCUE
        proxy = float(np.nan_to_num(ratio(t.at("deconv", stem=stem)[:1], n[:1])[0]))
        reps = np.clip(ratio(t.at("ok", stem=stem), expected), 0.0, 1.0)
        out[stem] = {"p_rescue": judge(reps, n[0], f.min_n, proxy=proxy, binomial=True, note=note)}
    return out


def fit_reviews(f: FitInputs) -> Estimates:
    """review categoricals, rho_same, p_follow and round2 categoricals per reviewer model."""
    anchors = tuple(f"a{k}" for k in range(len(ANCHORS)))
    keys = ("stem", "author_role", "label")
    review_values = (*anchors, "pairs", "match", "proxy", "proxy_triples")
    tc = totals(review_rows(f.trace, f.outs), keys, review_values, f.weights)
    grid_names = tuple(f"vo{v}{o}" for v in range(len(ANCHORS)) for o in range(len(ANCHORS)))
    t2 = totals(round2_rows(f.trace, f.outs), keys, (*grid_names, "proxy"), f.weights)
    out: Estimates = {}
    for stem in f.stems:
        est: dict[str, Estimate] = {}

        def cells(t: Totals, names: Sequence[str], stem=stem) -> np.ndarray:  # (R, cells, names)
            return np.stack([np.stack([t.at(v, stem=stem, author_role=r, label=c) for v in names], -1)
                             for r, c in CELLS], 1)  # fmt: skip

        counts = cells(tc, anchors)
        probs = ratio(counts, counts.sum(-1, keepdims=True))
        proxy = cells(tc, ("proxy",))[0, :, 0]
        for k, (role, correct) in enumerate(CELLS):
            n = counts[0, k].sum()
            est[f"review.{role}.{LABELS[correct]}"] = judge(
                probs[:, k], n, f.min_n, proxy=float(np.nan_to_num(ratio(proxy[k], n))), binomial=True)  # fmt: skip
        pairs, match = cells(tc, ("pairs",))[..., 0], cells(tc, ("match",))[..., 0]
        triples = pairs[0].sum() / 2
        proxy_triples = float(np.nan_to_num(ratio(cells(tc, ("proxy_triples",))[0].sum(), triples)))
        est["rho_same"] = judge(rho_same(probs, pairs, match), triples, f.min_n, proxy=proxy_triples)
        grid = cells(t2, grid_names).reshape(len(f.weights), len(CELLS), len(ANCHORS), len(ANCHORS))
        proxy2 = cells(t2, ("proxy",))[0, :, 0]
        follow, round2 = follow_em(grid)
        n2 = grid[0].sum(axis=(1, 2))  # (cells,)
        est["p_follow"] = judge(
            follow, n2.sum(), f.min_n, proxy=float(np.nan_to_num(ratio(proxy2.sum(), n2.sum())))
        )
        for k, (role, correct) in enumerate(CELLS):
            proxy = float(np.nan_to_num(ratio(proxy2[k], n2[k])))
            fresh = n2[k] * (1.0 - follow[0])  # followed judgements do not draw round2
            est[f"round2.{role}.{LABELS[correct]}"] = judge(
                round2[:, k], n2[k], f.min_n, binomial=True, proxy=proxy,
                trials=float(fresh) if np.isfinite(fresh) else None,
            )  # fmt: skip
        out[stem] = est
    return out


def fit_takeover(f: FitInputs) -> Estimates:
    t = totals(takeover_rows(f.trace), ("stem",), ("wrong", "fixed", "right", "kept"), f.weights)
    return {stem: {"p_fix": share(t, "fixed", "wrong", f.min_n, stem=stem),
                   "p_keep": share(t, "kept", "right", f.min_n, stem=stem)} for stem in f.stems}  # fmt: skip


def fit_completion(f: FitInputs) -> Estimates:
    x = pl.col("completion_tokens").cast(pl.Float64)
    rows = f.trace.calls.select("unit", "stem", "kind", ONE, x.alias("x"), (x * x).alias("x2"))
    t = totals(rows, ("stem", "kind"), ("one", "x", "x2"), f.weights)
    out: Estimates = {stem: {} for stem in f.stems}
    for stem in f.stems:
        for kind in CALL_KINDS:
            n = t.at("one", stem=stem, kind=kind)
            reps = uniform_bounds(n, t.at("x", stem=stem, kind=kind), t.at("x2", stem=stem, kind=kind))
            out[stem][f"completion_tokens.{kind}"] = judge(reps, n[0], f.min_n, integer=True)
    return out


def fit_prompts(f: FitInputs, base: dict[str, ModelParams]) -> Estimates:
    """answer_fraction (interval widened by half a token per mean completion: floor() quantises
    the visible tokens), then the prompt bases given the point answer_fraction and generate base."""
    ta = totals(answer_fraction_rows(f.trace, f.outs), ("author_stem", "stem"), ("one", "c", "c2", "y", "cy"),
                f.weights)  # fmt: skip
    out: Estimates = {}
    for stem in f.stems:
        n = ta.at("one", author_stem=stem)[:1]
        half_token = float(np.nan_to_num(0.5 * ratio(n, ta.at("c", author_stem=stem)[:1])[0]))
        reps = np.clip(answer_fraction(ta, stem), 0.0, 1.0)
        out[stem] = {"answer_fraction": judge(reps, n[0], f.min_n, slack=half_token)}
    tg = totals(
        prompt_rows(f.trace, f.outs, {}, {}), ("stem", "kind"), ("one", "y"), f.weights
    )  # infer, generate
    generate_base = {s: float(ratio(tg.at("y", stem=s, kind="generate"), tg.at("one", stem=s, kind="generate"))[0])
                     for s in f.stems if tg.at("one", stem=s, kind="generate")[0] > 0}  # fmt: skip
    fractions = {s: float(out[s]["answer_fraction"].reps[0]) if out[s]["answer_fraction"].identified
                 else base[s].answer_fraction for s in f.stems}  # fmt: skip
    t = totals(
        prompt_rows(f.trace, f.outs, fractions, generate_base), ("stem", "kind"), ("one", "y"), f.weights
    )
    for stem in f.stems:
        for kind in CALL_KINDS:
            n = t.at("one", stem=stem, kind=kind)
            reps = ratio(t.at("y", stem=stem, kind=kind), n)
            out[stem][f"prompt_tokens.{kind}"] = judge(reps, n[0], f.min_n, integer=True)
    return out


def fit(trace: Trace, base: dict[str, ModelParams], n_boot: int = 200, seed: int = 0, min_n: int = 20,
        per_type: bool = False) -> Fit:  # fmt: skip
    """Fit every parameter the traces identify, for both models of every traced pair."""
    stems = tuple(sorted({s for p in trace.calls["pair"].unique().to_list() for s in PAIRS[p]}))
    f = FitInputs(trace, outputs(trace), bootstrap_weights(trace.strata, n_boot, seed), stems, min_n)
    parts = fit_parts(f, base, per_type)
    families = (fit_infer(f), parts, fit_rescue(f, parts), fit_reviews(f), fit_takeover(f), fit_completion(f),
                fit_prompts(f, base))  # fmt: skip
    out: Estimates = {stem: {} for stem in stems}
    for family in families:
        for stem in stems:
            out[stem].update(family.get(stem, {}))
    for stem in stems:
        for name, reason in NOT_IDENTIFIABLE.items():
            out[stem][name] = Estimate(reps=np.full(1 + n_boot, np.nan), n=0, note=reason)
    return Fit(out, n_boot, seed, min_n)


# ----------------------------------------------------------------------------------------------
# Parameter files: read / replace a named value
# ----------------------------------------------------------------------------------------------


def probabilities(value) -> tuple[float, ...]:
    """A categorical rounded to 5 decimals that sums to 1 exactly (parse_model checks 1e-6)."""
    p = np.clip(np.asarray(value, dtype=float), 0.0, 1.0)
    p = np.round(p / p.sum(), 5)
    k = int(np.argmax(p))
    p[k] = round(1.0 - (p.sum() - p[k]), 5)
    return tuple(float(x) for x in p)


def value_of(model: ModelParams, name: str):
    """A parameter by its calibration name (p_infer, p_part.bbh.default, review.weak_author.wrong,
    completion_tokens.generate, prompt_tokens.review, n_distractors ...)."""
    head, _, rest = name.partition(".")
    if head in SCALARS:
        return model.scalars[head]
    if head == "n_distractors":
        return model.n_distractors
    if head == "p_part":
        dataset, _, key = rest.partition(".")
        table = model.p_part.get(dataset, {})
        return table.get(key, table.get("default"))
    if head in ("review", "round2"):
        role, _, label = rest.partition(".")
        return getattr(model, head)[(role, label == "correct")]
    if head == "completion_tokens":
        return model.completion_tokens[rest]
    if head == "prompt_tokens":
        return model.prompt_tokens[rest]
    raise MeshHealError(f"unknown parameter name {name!r}")


def with_values(model: ModelParams, values: dict[str, object]) -> ModelParams:
    """The model with the named parameters replaced (probabilities clipped / normalised)."""
    scalars, review, round2 = dict(model.scalars), dict(model.review), dict(model.round2)
    p_part = {ds: dict(table) for ds, table in model.p_part.items()}
    completion, prompt = dict(model.completion_tokens), dict(model.prompt_tokens)
    n_distractors = model.n_distractors
    for name, value in values.items():
        head, _, rest = name.partition(".")
        if head in SCALARS:
            scalars[head] = round(float(np.clip(value, 0.0, 1.0)), 5)
        elif head in OPTIONAL:
            scalars[head] = round(float(value), 5)
        elif head == "n_distractors":
            n_distractors = int(value)
        elif head == "p_part":
            dataset, _, key = rest.partition(".")
            p_part.setdefault(dataset, {})[key] = round(float(np.clip(value, 0.0, 1.0)), 5)
        elif head in ("review", "round2"):
            role, _, label = rest.partition(".")
            (review if head == "review" else round2)[(role, label == "correct")] = probabilities(value)
        elif head == "completion_tokens":
            low, high = (round(float(v)) for v in value)
            completion[rest] = (max(low, 0), max(high, low, 0))
        elif head == "prompt_tokens":
            prompt[rest] = max(round(float(value)), 0)
        else:
            raise MeshHealError(f"unknown parameter name {name!r}")
    return dataclasses.replace(model, scalars=scalars, n_distractors=n_distractors, p_part=p_part, review=review,
                               round2=round2, completion_tokens=completion, prompt_tokens=prompt)  # fmt: skip


def fitted_model(model: ModelParams, estimates: dict[str, Estimate]) -> ModelParams:
    """The base model with the identified, written estimates, and its structure parameters at 0:
    every estimate is a marginal rate under independent draws (decisions C10)."""
    fitted = {name: e.value for name, e in estimates.items() if e.identified and e.written}
    return with_values(model, {**fitted, **dict.fromkeys(OPTIONAL, 0.0)})


# ----------------------------------------------------------------------------------------------
# Writing the twin: parameter files + calibration.json + the printed table
# ----------------------------------------------------------------------------------------------


def _json_value(x, integer: bool):
    x = np.asarray(x, dtype=float)
    if x.ndim:
        return [_json_value(v, integer) for v in x]
    if not np.isfinite(x):
        return None
    return int(x) if integer else round(float(x), 6)


def base_models(base_dir: Path, stems: Sequence[str]) -> dict[str, ModelParams]:
    return {stem: load_model(stem, base_dir) for stem in stems}


def interval_notes(
    estimates: dict[str, Estimate], intervals: dict[str, object], level: float
) -> dict[str, str]:
    """The comment written beside each value of a fitted file (spec/calibrate.md: intervals beside
    each value): its interval (`intervals`, JSON values by name) and count, or why the base file's
    value was kept."""
    notes = {}
    for name, e in estimates.items():
        if not e.identified:
            notes[name] = f"kept from the base file ({e.note})" if e.note else "kept from the base file"
        elif e.written:
            notes[name] = f"{level * 100:g}% interval {intervals[name]}, n {e.n}".replace("None", "nan")
    return notes


def write_twin(result: Fit, out: Path, base_dir: Path, sources: Sequence[str], truth: Sequence[bool],
               level: float = 0.95) -> dict:  # fmt: skip
    """Write every base file into `out` (fitted ones with the fitted values) and calibration.json;
    return the calibration document."""
    if out.resolve() == MODEL_DIR.resolve():
        raise MeshHealError(f"--out {out} is the packaged parameter folder; choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    base = base_models(base_dir, list(result.estimates))
    for path in sorted(base_dir.glob("*.toml")):
        if path.stem not in result.estimates:
            shutil.copyfile(path, out / path.name)
    doc = {"sources": list(sources), "truth": ["latent truth" if t else "gold answers + proxies" for t in truth],
           "bootstrap": result.n_boot, "seed": result.seed, "level": level, "min_n": result.min_n,
           "base_params_dir": str(base_dir), "models": {}, "not_identified": [], "structure_reset": [],
           "copied": sorted(p.stem for p in base_dir.glob("*.toml") if p.stem not in result.estimates)}  # fmt: skip
    for stem, estimates in result.estimates.items():
        structure = {name: base[stem].scalars.get(name, 0.0) for name in OPTIONAL}
        model = fitted_model(base[stem], estimates)
        kept = sorted(n for n, e in estimates.items() if not e.identified)
        doc["structure_reset"] += [{"model": stem, "parameter": k, "base": v} for k, v in structure.items()]
        header = (f"Emulator parameters of one MODEL (spec/emulator.md); anchors {list(ANCHORS)}.\n"
                  f"Fitted by `python -m meshheal_jax.calibrate` from the traces of {', '.join(sources)}\n"
                  f"(bootstrap {result.n_boot}, seed {result.seed}; intervals in calibration.json).\n"
                  f"Not identified by the traces, kept from {base_dir / (stem + '.toml')}: {', '.join(kept) or 'none'}.\n"
                  f"Structure set to 0, the fit assuming independent draws (the base's: "
                  + ", ".join(f"{k} {v:g}" for k, v in structure.items())
                  + f"); the baselines' token figures ({', '.join(BASELINE_TOKEN_KINDS)}) kept from it.")  # fmt: skip
        intervals = {name: _json_value(e.interval(level), e.integer) for name, e in estimates.items()}
        path = out / f"{stem}.toml"
        path.write_text(dump_model(model, header, interval_notes(estimates, intervals, level)))
        load_model(path)  # the written file parses
        params = {}
        for name, e in estimates.items():
            params[name] = {"value": _json_value(e.value, e.integer), "interval": intervals[name],
                            "se": _json_value(e.se, False), "n": e.n, "identified": e.identified, "written": e.identified and e.written,
                            "proxy_share": round(e.proxy, 4), "note": e.note,
                            "base": _json_value(value_of(base[stem], name), e.integer or name == "n_distractors")}  # fmt: skip
            if not e.identified:
                doc["not_identified"].append({"model": stem, "parameter": name, "reason": e.note})
        doc["models"][stem] = {"file": str(path), "parameters": params}
    (out / "calibration.json").write_text(json.dumps(doc, indent=2))
    return doc


def _fmt(x, integer: bool = False) -> str:
    x = np.asarray(x, dtype=float)
    if x.ndim:
        return "[" + " ".join(_fmt(v, integer) for v in x) + "]"
    if not np.isfinite(x):
        return "—"
    return f"{x:.0f}" if integer else f"{x:.3f}"


def _fmt_interval(interval, integer: bool) -> str:
    interval = np.asarray(interval, dtype=float)
    if interval.ndim == 2:
        return " ".join(_fmt_interval(row, integer) for row in interval)
    return f"{_fmt(interval[0], integer)}–{_fmt(interval[1], integer)}"


def print_fit(result: Fit, level: float = 0.95) -> None:
    table = new_table(f"Fitted parameters ({result.n_boot} bootstrap replicates over tasks, {level:.0%} intervals)",
                      "model", "parameter", "value", "interval", "n", "status")  # fmt: skip
    for stem, estimates in result.estimates.items():
        table.add_section()
        for name, e in estimates.items():
            if e.identified:
                status = ("fitted" if e.written else "reported (--per-type to write)") + (
                    f", proxy {e.proxy:.0%}" if e.proxy > 0 else ""
                )
                table.add_row(stem, name, _fmt(e.value, e.integer), _fmt_interval(e.interval(level), e.integer),
                              str(e.n), status)  # fmt: skip
            else:
                table.add_row(stem, name, "—", "—", str(e.n), f"kept: {e.note}")
    print_table(table)


def check_fit_settings(n_boot: int, min_n: int, level: float) -> None:
    if n_boot < 1:
        raise MeshHealError(f"--bootstrap must be >= 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise MeshHealError(f"--level must be in (0, 1), got {level}")
    if min_n < 0:
        raise MeshHealError(f"--min-n must be >= 0, got {min_n}")


def calibrate(run_dirs: Sequence[Path], out: Path, base_dir: Path | None = None, n_boot: int = 200, seed: int = 0,
              min_n: int = 20, per_type: bool = False, level: float = 0.95) -> tuple[Fit, dict]:  # fmt: skip
    """Read, fit and write the twin into `out`; returns the fit and the calibration document."""
    check_fit_settings(n_boot, min_n, level)
    given = [Path(d).resolve() for d in run_dirs]
    if len(set(given)) != len(given):  # a run counted twice would narrow every interval
        raise MeshHealError(f"run folders must be distinct, got {[str(d) for d in run_dirs]}")
    if (Path(out) / "config.json").exists():
        raise MeshHealError(f"--out {out} is a run folder; write the twin to a folder of its own")
    if Path(out).exists() and not Path(out).is_dir():
        raise MeshHealError(f"--out {out} exists and is not a folder")
    base_dir = Path(base_dir) if base_dir is not None else MODEL_DIR
    if not base_dir.is_dir():
        raise MeshHealError(f"--base-params-dir {base_dir} is not a folder")
    trace = load_trace([Path(d) for d in run_dirs], base_dir)
    stems = sorted({s for p in trace.calls["pair"].unique().to_list() for s in PAIRS[p]})
    result = fit(trace, base_models(base_dir, stems), n_boot, seed, min_n, per_type)
    return result, write_twin(result, Path(out), base_dir, trace.sources, trace.truth, level)


# ----------------------------------------------------------------------------------------------
# The round trip: perturbed files -> traced run -> fit -> twin run
# ----------------------------------------------------------------------------------------------


def perturbation(dataset: str) -> dict[str, dict[str, object]]:
    """The round trip's known truth: noticeable shifts from the packaged default pair, without its
    structure parameters (0: what this fit estimates and writes, decisions C10)."""
    flat = dict.fromkeys(OPTIONAL, 0.0)
    return {
        "gpt-oss-120b": {**flat,
            "p_infer": 0.88, "p_rescue": 0.7, "rho_same": 0.4, "p_follow": 0.55, "p_fix": 0.5, "p_keep": 0.9,
            "answer_fraction": 0.3, f"p_part.{dataset}.default": 0.83,
            "review.strong_author.wrong": (0.2, 0.2, 0.2, 0.4), "round2.strong_author.wrong": (0.5, 0.3, 0.1, 0.1),
            "completion_tokens.generate": (1500, 6000), "prompt_tokens.review": 680,
        },
        "llama-3.2-1b": {**flat, "p_infer": 0.6, f"p_part.{dataset}.default": 0.25, "completion_tokens.generate": (200, 900)},
    }  # fmt: skip


def write_params(directory: Path, changes: dict[str, dict[str, object]], base_dir: Path = MODEL_DIR) -> Path:
    """A parameter folder: every base file, with `changes` (stem -> name -> value) applied."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(base_dir.glob("*.toml")):
        model = with_values(load_model(path), changes.get(path.stem, {}))
        (directory / path.name).write_text(
            dump_model(model, "Round-trip truth: perturbed from the packaged file.")
        )
    return directory


def run_metrics(
    tasks: pl.DataFrame, stream_weights: np.ndarray, phase_names: Sequence[str] = ("healthy", "degraded")
) -> dict[str, np.ndarray]:
    """(R,) accuracy, calls and tokens per task, overall and per phase, under (R, n_streams)
    weights of the run's streams (sorted by their labels). Streams, not tasks, are the bootstrap
    unit here: a run's aggregates depend on its network's history (one isolation changes every
    later task), so its tasks are not independent; a parameter's draws are, given the path,
    which is why the fit itself resamples tasks."""
    tasks = tasks.filter(pl.col("method") == "meshheal").with_columns(pl.lit(0, pl.Int64).alias("run"))
    units, strata = task_units(tasks)
    rows = tasks.join(units, on=TASK, how="left").select(
        "unit", "phase", pl.lit(1).alias("one"), pl.col("correct").cast(pl.Int64), "calls", "tokens"
    )
    t = totals(rows, ("phase",), ("one", "correct", "calls", "tokens"), stream_weights[:, strata])
    out = {}
    for label, key in (("all", {}), *((name, {"phase": k}) for k, name in enumerate(phase_names))):
        n = t.at("one", **key)
        for name, column in (("accuracy", "correct"), ("calls/task", "calls"), ("tokens/task", "tokens")):
            out[f"{name} ({label})"] = ratio(t.at(column, **key), n)
    return out


def compare_runs(
    traced: pl.DataFrame, twin: pl.DataFrame, n_boot: int, seed: int, level: float,
    phase_names: Sequence[str] = ("healthy", "degraded"),
) -> list[dict]:  # fmt: skip
    """Traced vs twin aggregates (tasks tables of the same streams): the traced value and its
    interval (bootstrap over streams), the twin's value, and the interval of twin - traced with
    the two runs' streams resampled independently. `consistent`: that interval holds 0. Not
    paired by seed on purpose: the twin's parameters differ from the trace's by their estimation
    error, and early in a stream (before the paths part) a paired difference measures that error
    with almost no noise, flagging differences well inside the parameters' own intervals."""
    n_streams = traced.select(STREAM[1:]).unique().height
    a = run_metrics(traced, bootstrap_weights(np.zeros(n_streams, dtype=np.int64), n_boot, seed), phase_names)
    b = run_metrics(
        twin, bootstrap_weights(np.zeros(n_streams, dtype=np.int64), n_boot, seed + 1), phase_names
    )
    rows = []
    for name in a:
        low, high = Estimate(a[name], n=traced.height).interval(level)
        d_low, d_high = Estimate(b[name] - a[name], n=traced.height).interval(level)
        rows.append({"quantity": name, "traced": float(a[name][0]), "interval": [float(low), float(high)],
                     "twin": float(b[name][0]), "inside": bool(low <= b[name][0] <= high),
                     "difference": float(b[name][0] - a[name][0]), "difference_interval": [float(d_low), float(d_high)],
                     "consistent": bool(d_low <= 0.0 <= d_high)})  # fmt: skip
    return rows


def roundtrip(out: Path, dataset: str = "bbh", seeds: Sequence[int] = tuple(range(8)), n_tasks: int = 504,
              n_boot: int = 200, seed: int = 0, min_n: int = 20, level: float = 0.95, progress: bool = False) -> dict:  # fmt: skip
    """Emulate with perturbed files, fit the traces, emulate the same configuration with the
    fitted files; compare parameters (true vs fitted vs interval) and the runs' aggregates."""
    from meshheal_jax import runner  # the JAX engine only when a round trip is asked for

    out = Path(out)
    check_fit_settings(n_boot, min_n, level)  # before anything is written
    if out.exists() and any(out.iterdir()):
        raise MeshHealError(f"round-trip folder {out} exists and is not empty; choose a new --out")
    started = time.perf_counter()
    changes = perturbation(dataset)
    exp = runner.Experiment(name="main", datasets=(dataset,), pairs=("default",), seeds=tuple(seeds),
                            n_tasks=n_tasks)  # fmt: skip
    exp.validate()  # seeds, tasks, dataset: before anything is written (a refused --out stays empty)
    true_dir = write_params(out / "true-params", changes)
    exp = dataclasses.replace(exp, params_dir=true_dir)
    traced = runner.run(exp, out / "traced", progress=progress)
    result, _ = calibrate(
        [out / "traced"], out / "fitted", n_boot=n_boot, seed=seed, min_n=min_n, level=level
    )
    twin = runner.run(dataclasses.replace(exp, params_dir=out / "fitted"), out / "twin", progress=progress)
    params = []
    for stem, estimates in result.estimates.items():
        truth = load_model(stem, true_dir)
        for name, e in estimates.items():
            if not (e.identified and e.written):
                continue
            true = np.asarray(value_of(truth, name), dtype=float)
            interval = e.interval(level)
            covered = (interval[..., 0] - 1e-9 <= true) & (true <= interval[..., 1] + 1e-9)
            params.append({"model": stem, "parameter": name, "true": _json_value(true, e.integer),
                           "fitted": _json_value(e.value, e.integer), "interval": _json_value(interval, e.integer),
                           "covered": bool(np.all(covered)), "elements": int(np.size(covered)),
                           "elements_covered": int(np.sum(covered)), "n": e.n, "se": _json_value(e.se, False),
                           "share": e.binomial, "perturbed": name in changes.get(stem, {})})  # fmt: skip
    aggregates = compare_runs(traced.tasks, twin.tasks, n_boot, seed, level)
    report = {"dataset": dataset, "seeds": list(seeds), "n_tasks": n_tasks, "bootstrap": n_boot, "seed": seed,
              "min_n": min_n, "level": level, "intervals": INTERVALS,
              "parameters": params, "aggregates": aggregates,
              "not_identified": [{"model": s, "parameter": n, "reason": e.note}
                                 for s, es in result.estimates.items() for n, e in es.items() if not e.identified],
              "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    # whole or absent: a coverage study resumes on it
    runner.write_atomic(out / "roundtrip.json", json.dumps(report, indent=2))
    return report


EVENT_BANDS = (0, 5, 20, 100)  # a share's expected events n * min(p, 1 - p): the coverage table's bands
BANDS = (*(f"shares, {a}-{b} events" for a, b in itertools.pairwise(EVENT_BANDS)),
         f"shares, >= {EVENT_BANDS[-1]} events", "other parameters")  # fmt: skip


def element_rows(report: dict) -> list[dict]:
    """One row per value (a categorical's anchors apart) of a round trip: covered or not, and its
    band (a share's expected events under the truth; other parameters apart)."""
    rows = []
    for p in report["parameters"]:
        true = np.atleast_1d(np.asarray(p["true"], dtype=float))
        interval = np.asarray(p["interval"], dtype=float).reshape(-1, 2)
        for i, (t, (low, high)) in enumerate(zip(true, interval)):
            events = p["n"] * min(t, 1.0 - t)
            band = (
                BANDS[int(np.searchsorted(EVENT_BANDS, events, side="right")) - 1]
                if p["share"]
                else BANDS[-1]
            )
            rows.append({"model": p["model"], "parameter": p["parameter"], "element": i, "n": p["n"], "band": band,
                         "covered": bool(low - 1e-9 <= t <= high + 1e-9)})  # fmt: skip
    return rows


def roundtrip_coverage(out: Path, repeats: int, dataset: str = "bbh", seeds_per: int = 8, n_tasks: int = 504,
                       n_boot: int = 200, seed: int = 0, min_n: int = 20, level: float = 0.95,
                       progress: bool = False) -> dict:  # fmt: skip
    """Do the intervals cover at their level? `repeats` round trips on disjoint seed sets (k:
    seeds k * seeds_per ...) into out/rep-<k>, each kept as it finishes (a rerun resumes; an
    unfinished one is redone); their values pooled into coverage by band of expected events
    (docs/decisions.md C11). Written to out/coverage.json."""
    out = Path(out)
    if repeats < 2:
        raise MeshHealError(f"--roundtrip-repeats must be at least 2 for a coverage study, got {repeats}")
    settings = {"dataset": dataset, "n_tasks": n_tasks, "bootstrap": n_boot, "seed": seed, "min_n": min_n,
                "level": level, "intervals": INTERVALS}  # fmt: skip
    reports = []
    for k in range(repeats):
        rep_dir, seeds = out / f"rep-{k}", list(range(k * seeds_per, (k + 1) * seeds_per))
        done = rep_dir / "roundtrip.json"
        report = None
        if done.exists():
            try:
                report = json.loads(done.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                pass
            if not isinstance(report, dict):
                print(f"{done}: unreadable, the round trip is redone")
                report = None
        if report is not None:
            wanted = {**settings, "seeds": seeds}
            differ = {key: (report.get(key), v) for key, v in wanted.items() if report.get(key) != v}
            if differ:
                raise MeshHealError(f"{rep_dir} holds a round trip with other settings {differ} (kept, wanted); "
                                    "choose a new --out")  # fmt: skip
        else:
            if rep_dir.exists():
                print(f"{rep_dir}: unfinished round trip, redone")
                shutil.rmtree(rep_dir)
            report = roundtrip(rep_dir, dataset, seeds, n_tasks, n_boot, seed, min_n, level, progress)
        reports.append(report)
    rows = [r for report in reports for r in element_rows(report)]
    frame = pl.DataFrame(rows)
    bands = (frame.group_by("band").agg(pl.len().alias("values"), pl.col("covered").sum().alias("covered"))
             .with_columns((pl.col("covered") / pl.col("values")).alias("coverage"))
             .sort(pl.col("band").replace_strict(BANDS, range(len(BANDS)))))  # fmt: skip
    cells = (frame.group_by("model", "parameter", "element")
             .agg(pl.len().alias("round_trips"), pl.col("covered").mean().alias("coverage"), pl.col("n").mean().alias("mean_n"))
             .sort("coverage", "mean_n", "model", "parameter", "element").head(8))  # fmt: skip
    aggregates = [a for report in reports for a in report["aggregates"]]
    coverage = {**settings, "repeats": repeats, "seeds_per": seeds_per, "values": frame.height,
                "covered": int(frame["covered"].sum()), "bands": bands.to_dicts(), "least_covered": cells.to_dicts(),
                "twin_comparisons": len(aggregates), "twin_consistent": sum(a["consistent"] for a in aggregates)}  # fmt: skip
    (out / "coverage.json").write_text(json.dumps(coverage, indent=2))
    return coverage


def print_coverage(coverage: dict) -> None:
    level = coverage["level"]
    table = new_table(f"Round-trip coverage: {coverage['repeats']} round trips ({coverage['dataset']}, "
                      f"{coverage['seeds_per']} seeds each, disjoint), values inside their {level:.0%} interval",
                      "band", "values", "covered", "coverage")  # fmt: skip
    for b in coverage["bands"]:
        table.add_row(b["band"], str(b["values"]), str(b["covered"]), f"{b['coverage']:.3f}")
    table.add_row("all", str(coverage["values"]), str(coverage["covered"]),
                  f"{coverage['covered'] / coverage['values']:.3f}")  # fmt: skip
    print_table(table)
    print("least covered values (over the round trips that identified them): " + "; ".join(
        f"{c['model']} {c['parameter']}[{c['element']}] {c['coverage']:.2f} of {c['round_trips']} (mean n {c['mean_n']:.0f})"
        for c in coverage["least_covered"]))  # fmt: skip
    print(f"twin against traced run (accuracy, calls and tokens per task, overall and per phase): the difference's "
          f"interval holds 0 in {coverage['twin_consistent']} of {coverage['twin_comparisons']} comparisons")  # fmt: skip


def twin_experiments(run_dirs: Sequence[Path], twin_dir: Path) -> list:
    """The experiment of each traced run (its config.json: experiment, datasets, pairs, seeds,
    tasks, protocol) as the twin check emulates it: MeshHeal alone, with the fitted files in
    `twin_dir`, emulated, every question counted as its profile's mean (live=None: the basis the
    fit's prompt bases were taken on, fit_prompts and decisions X4). Checked before anything is
    fitted: a folder whose configuration cannot be rebuilt is named."""
    from meshheal_jax.report import experiment_from_config

    out = []
    for run_dir in (Path(d) for d in run_dirs):
        check_run_folder(run_dir)
        try:
            experiment = read_experiment(run_dir)
            if not experiment:
                raise MeshHealError(f"{run_dir / 'config.json'} not found")
            exp = dataclasses.replace(experiment_from_config(experiment), methods=("meshheal",),
                                      backend="emulated", live=None, params_dir=Path(twin_dir))  # fmt: skip
            dataclasses.replace(exp, params_dir=None).validate()  # the fitted files may not exist yet
        except MeshHealError as err:
            raise MeshHealError(f"twin check of {run_dir}: its configuration cannot be emulated ({err}); "
                                "--no-check to fit without the check") from None  # fmt: skip
        out.append(exp)
    return out


def twin_check(run_dirs: Sequence[Path], twin_dir: Path, n_boot: int = 200, seed: int = 0, level: float = 0.95,
               progress: bool = False, experiments: list | None = None) -> list[dict]:  # fmt: skip
    """spec/calibrate.md's check: each traced run's configuration (twin_experiments) emulated with
    the fitted files in `twin_dir`, its accuracy, calls and tokens per task (overall and per
    phase) against the traced run's (compare_runs). The twin runs go to twin_dir/twin-check/<k>
    (made anew each time: the files they read may have been refitted). `experiments`: those
    twin_experiments built already (the command checks them before it fits)."""
    from meshheal_jax import runner  # the JAX engine only when the check runs

    experiments = twin_experiments(run_dirs, twin_dir) if experiments is None else experiments
    folder = Path(twin_dir) / "twin-check"
    shutil.rmtree(folder, ignore_errors=True)
    out = []
    for k, (run_dir, exp) in enumerate(zip((Path(d) for d in run_dirs), experiments, strict=True)):
        try:
            twin = runner.run(exp, folder / str(k), progress=progress)
        except MeshHealError as err:
            raise MeshHealError(f"twin check of {run_dir}: {err} (the fitted files are written in {twin_dir}; "
                                "--no-check fits without the check)") from None  # fmt: skip
        traced = read_table(run_dir, "tasks").filter(pl.col("method") == "meshheal")
        phase_names = exp.phases()[1]
        streams = traced.select(STREAM[1:]).unique().height  # one stream: every interval has width 0
        out.append({"run": str(run_dir), "twin": str(folder / str(k)), "experiment": exp.name, "streams": streams,
                    "undetermined": streams < 2,
                    "aggregates": compare_runs(traced, twin.tasks, n_boot, seed, level, phase_names)})  # fmt: skip
    doc_path = Path(twin_dir) / "calibration.json"
    doc = json.loads(doc_path.read_text())
    doc["twin_check"] = out
    doc_path.write_text(json.dumps(doc, indent=2))
    return out


def print_aggregates(rows: list[dict], title: str, level: float, undetermined: bool = False) -> None:
    """`undetermined`: intervals of width 0 (one stream), so "—", not "NO", in the verdict cells."""
    verdict = (lambda ok: "—") if undetermined else (lambda ok: "yes" if ok else "NO")
    agg = new_table(title, "quantity", "traced", f"{level:.0%} interval", "twin", "inside", "twin − traced",
                    f"{level:.0%} interval ", "consistent")  # fmt: skip
    for a in rows:
        digits = 3 if a["quantity"].startswith("accuracy") else 1
        span = f"{{:,.{digits}f}}–{{:,.{digits}f}}"
        agg.add_row(a["quantity"], f"{a['traced']:,.{digits}f}", span.format(*a["interval"]), f"{a['twin']:,.{digits}f}",
                    verdict(a["inside"]), f"{a['difference']:+,.{digits}f}",
                    span.format(*a["difference_interval"]), verdict(a["consistent"]))  # fmt: skip
    print_table(agg)


def print_twin_check(check: list[dict], level: float) -> None:
    for c in check:
        print_aggregates(c["aggregates"], f"Twin check: {c['run']} vs its configuration emulated with the fitted "
                         f"files ({c['twin']}; intervals: bootstrap over streams)", level,
                         bool(c.get("undetermined")))  # fmt: skip
        off = [a["quantity"] for a in c["aggregates"] if not (a["inside"] and a["consistent"])]
        if c.get("undetermined"):
            print(f"undetermined: {c['run']} holds one stream, and the intervals are over streams (each has width 0); "
                  "trace two seeds or more for the check")  # fmt: skip
        else:
            print(f"not reproduced within the intervals: {', '.join(off)}" if off else
                  "every quantity reproduced within its interval")  # fmt: skip


def print_roundtrip(report: dict) -> None:
    level = report["level"]
    table = new_table(f"Round trip, parameters ({report['dataset']}, seeds {report['seeds']}, {report['n_tasks']} "
                      f"tasks; * = perturbed from the packaged file)", "model", "parameter", "true", "fitted",
                      f"{level:.0%} interval", "n", "covered")  # fmt: skip
    for p in report["parameters"]:
        integer = p["parameter"].split(".")[0] in ("completion_tokens", "prompt_tokens")
        table.add_row(p["model"], p["parameter"] + (" *" if p["perturbed"] else ""), _fmt(p["true"], integer),
                      _fmt(p["fitted"], integer), _fmt_interval(p["interval"], integer), str(p["n"]),
                      "yes" if p["covered"] else f"NO ({p['elements_covered']}/{p['elements']})")  # fmt: skip
    print_table(table)
    elements = sum(p["elements"] for p in report["parameters"])
    covered = sum(p["elements_covered"] for p in report["parameters"])
    print(
        f"coverage: {covered}/{elements} values inside their {level:.0%} interval "
        f"({sum(p['covered'] for p in report['parameters'])}/{len(report['parameters'])} parameters)"
    )
    kept = report["not_identified"]
    print(
        f"not identified (kept from the base files): {len(kept)}: "
        + "; ".join(f"{k['model']} {k['parameter']}" for k in kept)
    )
    print_aggregates(report["aggregates"], "Round trip, traced run vs twin (same configuration and seeds; intervals: "
                     "bootstrap over streams, the two runs resampled independently for the difference)", level)  # fmt: skip
    print(f"wall time: {report['wall_s']:.1f} s")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    run_dirs: tyro.conf.Positional[tuple[Path, ...]] = ()
    """run folders whose traces to fit (calls / reviews / tasks .parquet and config.json)"""
    out: Path | None = None
    """folder for the fitted files and calibration.json (use it as --params-dir); required for a fit
    from run folders (a --roundtrip defaults to runs/calibrate-roundtrip, a coverage study to
    runs/calibrate-coverage)"""
    bootstrap: int = 200
    """bootstrap replicates (resampling tasks within each stream)"""
    seed: int = 0
    """seed of the bootstrap"""
    base_params_dir: Path | None = None
    """files the unidentified parameters and absent models come from (default: the packaged ones)"""
    min_n: int = 20
    """fewest observations for a parameter to count as identified"""
    per_type: bool = False
    """also write p_part per task type (default: the pooled value, per-type only reported)"""
    level: float = 0.95
    """interval level"""
    roundtrip: bool = False
    """instead: emulate with perturbed files, fit, re-emulate and compare (into --out)"""
    roundtrip_dataset: str = "bbh"
    roundtrip_seeds: int = 8
    roundtrip_tasks: int = 504
    roundtrip_repeats: int = 1
    """with --roundtrip: this many round trips on disjoint seed sets, and how often their intervals
    cover the truth (a coverage study; each kept in --out/rep-<k>, a rerun resumes)"""
    check: bool = True
    """then emulate each traced run's configuration with the fitted files and compare its accuracy,
    calls and tokens per task with the traced run's (spec/calibrate.md; --no-check to skip)"""
    quiet: bool = False
    """no table, no progress bar"""


def body(cfg: CalibrateConfig) -> None:
    if cfg.roundtrip:
        if cfg.run_dirs:
            raise MeshHealError("--roundtrip makes its own traces: give no run folders")
        study = cfg.roundtrip_repeats != 1  # a coverage study of several round trips
        out = cfg.out or Path("runs/calibrate-coverage" if study else "runs/calibrate-roundtrip")
        if study:
            coverage = roundtrip_coverage(out, cfg.roundtrip_repeats, cfg.roundtrip_dataset, cfg.roundtrip_seeds,
                                          cfg.roundtrip_tasks, cfg.bootstrap, cfg.seed, cfg.min_n, cfg.level,
                                          progress=not cfg.quiet)  # fmt: skip
            if not cfg.quiet:
                print_coverage(coverage)
        else:
            report = roundtrip(out, cfg.roundtrip_dataset, tuple(range(cfg.roundtrip_seeds)), cfg.roundtrip_tasks,
                               cfg.bootstrap, cfg.seed, cfg.min_n, cfg.level, progress=not cfg.quiet)  # fmt: skip
            if not cfg.quiet:
                print_roundtrip(report)
        print(f"results: {out}")
        return
    if cfg.roundtrip_repeats != 1:
        raise MeshHealError("--roundtrip-repeats is a round-trip setting: give --roundtrip too")
    if cfg.out is None:
        raise MeshHealError("--out DIR is required (the folder of fitted parameter files)")
    # a folder the twin check cannot emulate is named before the fit
    experiments = twin_experiments(cfg.run_dirs, cfg.out) if cfg.check else None
    result, doc = calibrate(cfg.run_dirs, cfg.out, cfg.base_params_dir, cfg.bootstrap, cfg.seed, cfg.min_n,
                            cfg.per_type, cfg.level)  # fmt: skip
    if not cfg.quiet:
        print_fit(result, cfg.level)
        print("structure set to 0 in the fitted files (the fit assumes independent draws); the base files': "
              + "; ".join(f"{k['model']} {k['parameter']} {k['base']:g}" for k in doc["structure_reset"]))  # fmt: skip
    if cfg.check:
        check = twin_check(
            cfg.run_dirs,
            cfg.out,
            cfg.bootstrap,
            cfg.seed,
            cfg.level,
            progress=not cfg.quiet,
            experiments=experiments,
        )
        if not cfg.quiet:
            print_twin_check(check, cfg.level)
    print(f"fitted files and calibration.json: {cfg.out} (use it as --params-dir {cfg.out})")


STOPPED_CALIBRATE = (
    "stopped: the same command resumes a fit from run folders or a coverage study "
    "(--roundtrip-repeats) in its --out; a single --roundtrip reruns into a new --out"
)


def cli() -> None:
    entrypoint(CalibrateConfig, body, __doc__, STOPPED_CALIBRATE)


if __name__ == "__main__":
    cli()
