"""What `calibration_fit` and `calibration_report` promise that a mutation audit of both modules
could change without any other fast test failing: the targets table against spec/emulator.md and
the audit key each target reads, the per-seed contexts, the report's table and exit status, the
written files' 6 decimals and header, a row's rounding, the start files of pairs A and B, batching,
the documented defaults and the commands in the shipped files' headers, a resumed search (bit for
bit, and refused under other settings), a damaged state.json, token scaling, and what a scan runs
and prints. Stand-in evaluators and hand-built contexts and frames: no protocol run, no JAX
compile. Each test names the mutation it holds; the last three hold bugs the audit found, each of
which failed on the code before its fix."""

from __future__ import annotations

import copy
import json
import math
import shlex
import shutil
from collections import defaultdict
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl
import pytest
import tyro

from meshheal_jax import calibration_fit as fit
from meshheal_jax import calibration_report as report
from meshheal_jax import metrics, runner
from meshheal_jax.calibration_report import GAP_PARTS, TARGETS, degraded_gap, evaluate, loss
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import persistent_schedule

START = fit.MODEL_DIR / "fit_start"
ROOT = Path(fit.__file__).resolve().parents[1]
B_TARGET = "pair B: accuracy, degraded phase, mean of 3"


def row(target: str, measured: float | None, paper: float, tolerance: float, priority: str = "primary",
        pair: str = "default") -> dict:  # fmt: skip
    return {"priority": priority, "target": target, "pair": pair, "paper": paper, "tolerance": tolerance,
            "measured": {"mean": measured, "std": None}, "pass": measured is not None
            and abs(measured - paper) <= tolerance}  # fmt: skip


class StrongInfer:
    """Stands in for fit.Evaluator: one row per candidate, pair B's target measured as the strong
    model's p_infer; `extra`: rows added to every candidate's; `calls`: candidates per call."""

    def __init__(self, paper: float, priority: str = "secondary", extra: tuple[dict, ...] = ()):
        self.paper, self.priority, self.extra, self.calls = paper, priority, extra, []

    def rows(self, pairs, gaps=None):
        self.calls.append(len(pairs))
        return [
            [row(B_TARGET, p.strong.p_infer, self.paper, 0.03, self.priority, "B"), *self.extra]
            for p in pairs
        ]


def pair_b(out: Path, **settings) -> fit.FitConfig:
    return fit.FitConfig(**{"pair": "B", "start": START, "fit_seeds": (100,), "out": out, **settings})


def start_p_infer() -> float:
    return fit.base_docs("B", start=START)["strong"]["p_infer"]


# ----------------------------------------------------------------------------------------------
# The targets (spec/emulator.md "Calibration targets for the default pair")

SPEC = [  # (priority, target, paper, tolerance, pair), in the spec's order
    ("primary", "mean q0, healthy-author outputs", 0.89, 0.03, "default"),
    ("primary", "mean q0, degraded-author outputs", 0.08, 0.03, "default"),
    ("primary", "initial low-score recall (degraded)", 0.90, 0.04, "default"),
    ("primary", "initial low-score false alarm (healthy)", 0.053, 0.02, "default"),
    ("primary", "after committee: recall", 0.88, 0.04, "default"),
    ("primary", "after committee: false alarm", 0.044, 0.02, "default"),
    ("primary", "committee clears healthy-flagged", 0.33, 0.08, "default"),
    ("primary", "committee keeps degraded-flagged", 0.95, 0.04, "default"),
    ("primary", "degraded-author outputs sent to committee", 0.98, 0.03, "default"),
    ("primary", "Takeover on Finalize: wrong->right", 15 / 32, 0.12, "default"),
    ("primary", "Takeover on Finalize: right->wrong", 1 / 32, 0.04, "default"),
    ("primary", "accuracy, healthy phase, mean of 3 datasets", 0.831, 0.02, "default"),
    ("primary", "accuracy, degraded phase, mean of 3 datasets", 0.839, 0.02, "default"),
    ("primary", "MATH accuracy, healthy phase", 0.821, 0.03, "default"),
    ("primary", "MATH accuracy, degraded phase", 0.802, 0.03, "default"),
    ("secondary", "model calls per task, healthy", 12.4, 1.0, "default"),
    ("secondary", "model calls per task, degraded", 13.6, 1.0, "default"),
    ("secondary", "model tokens per task, healthy", 51_000, 5_000, "default"),
    ("secondary", "model tokens per task, degraded", 51_000, 5_000, "default"),
    ("secondary", "pair A: accuracy, degraded phase, mean of 3", 0.905, 0.03, "A"),
    ("secondary", "pair B: accuracy, degraded phase, mean of 3", 0.782, 0.03, "B"),
]
# what each target reads: a review-audit key (pooled over datasets) or a stream metric (mean over
# the datasets, or MATH's alone)
READS = {
    "mean q0, healthy-author outputs": ("audit", "mean_q0_healthy"),
    "mean q0, degraded-author outputs": ("audit", "mean_q0_degraded"),
    "initial low-score recall (degraded)": ("audit", "initial_recall"),
    "initial low-score false alarm (healthy)": ("audit", "initial_false_alarm"),
    "after committee: recall": ("audit", "final_recall"),
    "after committee: false alarm": ("audit", "final_false_alarm"),
    "committee clears healthy-flagged": ("audit", "committee_clears_healthy"),
    "committee keeps degraded-flagged": ("audit", "committee_keeps_degraded"),
    "degraded-author outputs sent to committee": ("audit", "committee_share_degraded"),
    "Takeover on Finalize: wrong->right": ("audit", "takeover_wrong_to_right"),
    "Takeover on Finalize: right->wrong": ("audit", "takeover_right_to_wrong"),
    "accuracy, healthy phase, mean of 3 datasets": ("mean", "acc_healthy"),
    "accuracy, degraded phase, mean of 3 datasets": ("mean", "acc_degraded"),
    "MATH accuracy, healthy phase": ("math", "acc_healthy"),
    "MATH accuracy, degraded phase": ("math", "acc_degraded"),
    "model calls per task, healthy": ("mean", "calls_per_task_healthy"),
    "model calls per task, degraded": ("mean", "calls_per_task_degraded"),
    "model tokens per task, healthy": ("mean", "tokens_per_task_healthy"),
    "model tokens per task, degraded": ("mean", "tokens_per_task_degraded"),
    "pair A: accuracy, degraded phase, mean of 3": ("mean", "acc_degraded"),
    "pair B: accuracy, degraded phase, mean of 3": ("mean", "acc_degraded"),
}
AUDIT_KEYS = sorted({key for kind, key in READS.values() if kind == "audit"})
STREAM_KEYS = sorted({key for kind, key in READS.values() if kind != "audit"})
DATASETS = ("bbh", "math", "mmlu_pro")


def distinct_context() -> dict:
    """A seed's context where every audit key and every (dataset, metric) holds its own value."""
    audit = {key: 0.01 * (k + 1) for k, key in enumerate(AUDIT_KEYS)}
    streams = {
        d: {key: 100 * (i + 1) + k for k, key in enumerate(STREAM_KEYS)} for i, d in enumerate(DATASETS)
    }
    return {"audit": audit, "streams": streams}


def test_the_targets_are_the_specs_table():
    """TARGETS holds spec/emulator.md's table: every quantity, its paper value and tolerance, its
    priority and its pair, in the spec's order. Mutations: a paper value, a tolerance, a priority or
    a pair changed (only the slow report run could notice some of them, by a target failing)."""
    got = [(t.priority, t.name, t.paper, t.tolerance, t.pair) for t in TARGETS]
    assert got == SPEC


def test_each_target_reads_its_own_quantity():
    """Each target measures what its name says: the pooled review audit's key, the mean of the
    three datasets' stream metric, or MATH's own. Mutations: two audit keys swapped, a phase
    swapped, MATH's targets read over every dataset."""
    ctx = distinct_context()
    for target in TARGETS:
        kind, key = READS[target.name]
        if kind == "audit":
            want = ctx["audit"][key]
        elif kind == "mean":
            want = float(np.mean([ctx["streams"][d][key] for d in DATASETS]))
        else:
            want = ctx["streams"]["math"][key]
        assert target.measure(ctx) == pytest.approx(want), target.name


def test_an_unmeasured_target_costs_as_much_as_one_ten_tolerances_off():
    """loss: a target no seed defines (mean None: no Takeover on a Finalize, say) scores z = 10, never
    0. Mutation: z = 0, which made a candidate that never measures a target look perfect on it."""
    for priority in ("primary", "secondary"):
        unmeasured = row("x", None, 0.5, 0.1, priority)
        far = row("x", 0.5 + 10 * 0.1, 0.5, 0.1, priority)
        assert loss([unmeasured]) == pytest.approx(loss([far])) and loss([unmeasured]) > 20


# ----------------------------------------------------------------------------------------------
# Per-seed contexts


def test_a_seed_context_pools_the_review_audit_over_its_datasets(monkeypatch):
    """seed_context: "metrics of every dataset's stream and the review audit pooled over datasets".
    Mutation: the audit of the first dataset's reviews only."""
    frames = {d: {"tasks": pl.DataFrame({"d": [d]}), "reviews": pl.DataFrame({"d": [d] * (k + 1)}),
                  "states": pl.DataFrame({"d": [d]})} for k, d in enumerate(DATASETS)}  # fmt: skip
    seen = {}

    def audit(reviews):
        seen["reviews"] = reviews
        return {}

    monkeypatch.setattr(metrics, "review_audit", audit)
    monkeypatch.setattr(metrics, "stream_metrics", lambda tasks, reviews, *_: {"rows": reviews.height})
    ctx = report.seed_context(frames, None, ())
    assert sorted(seen["reviews"]["d"].to_list()) == sorted(
        ["bbh", "math", "math", "mmlu_pro", "mmlu_pro", "mmlu_pro"]
    )
    assert ctx["streams"] == {"bbh": {"rows": 1}, "math": {"rows": 2}, "mmlu_pro": {"rows": 3}}


def test_per_seed_contexts_take_each_seeds_streams_of_the_pair(monkeypatch):
    """per_seed_contexts: per seed of a finished run, that seed's streams of the pair asked for, per
    dataset. Mutations: the pair or the seed not filtered."""
    exp = runner.Experiment(name="main", datasets=("bbh", "math"), pairs=("default", "A"), seeds=(0, 1))
    labels = [(s, p, d) for s in (0, 1) for p in ("default", "A") for d in ("bbh", "math")]
    table = pl.DataFrame({"seed": [s for s, _, _ in labels], "pair": [p for _, p, _ in labels],
                          "dataset": [d for _, _, d in labels]})  # fmt: skip
    results = runner.Results(Path("."), table, table, table, table, {})
    seen = []
    monkeypatch.setattr(report, "seed_context", lambda frames, *_: seen.append(frames) or {})
    assert len(report.per_seed_contexts(results, exp, "A")) == 2
    for seed, frames in zip((0, 1), seen):
        assert sorted(frames) == ["bbh", "math"]
        for dataset, tables in frames.items():
            for name in ("tasks", "reviews", "states"):
                assert tables[name].rows() == [(seed, "A", dataset)], (seed, dataset, name)


# ----------------------------------------------------------------------------------------------
# degraded_gap over several streams

LABELS = {"dataset": "bbh", "pair": "default"}


def gap_frames(isolations: dict[int, list[tuple[int, int, str]]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """8-task streams (A3, A5 degraded from task 5), one per seed: every route visits agent 0
    only, tasks 1-4 right, 5-8 right only on odd t; `isolations[seed]`: (t, agent, to) changes."""
    tasks = pl.DataFrame([{**LABELS, "seed": s, "t": t, "phase": int(t > 4), "route": "0",
                           "correct": t <= 4 or t % 2 == 1}
                          for s in isolations for t in range(1, 9)])  # fmt: skip
    states = pl.DataFrame([{**LABELS, "seed": s, "t": t, "agent": a, "to": to}
                           for s, changes in isolations.items() for t, a, to in changes])  # fmt: skip
    return tasks, states


def test_a_degraded_agents_first_isolation_since_it_degraded_counts():
    """degraded_gap: a task is "after both are isolated" when every degraded agent "had been isolated
    at least once since it degraded, before the task": A3 isolated at task 5, released, isolated
    again at 7; A5 at 6: tasks 7 and 8 are after. Mutation: an agent's last isolation counted."""
    tasks, states = gap_frames(
        {0: [(5, 2, "isolated"), (6, 2, "watched"), (7, 2, "isolated"), (6, 4, "isolated")]}
    )
    *parts, _ = degraded_gap(tasks, states, persistent_schedule(6, 8, (2, 4)))
    assert [p["tasks"] for p in parts] == [0, 0, 0, 2, 0, 2]


def test_each_stream_is_split_by_its_own_isolations():
    """degraded_gap: "per stream": seed 0 isolates both degraded agents at task 5, seed 1 never
    isolates A5; seed 1's tasks are "not both isolated", seed 0's task 5 "before" and 6-8 "after".
    Mutation: streams told apart by dataset and pair only, so seed 0's isolations counted for seed 1."""
    tasks, states = gap_frames({0: [(5, 2, "isolated"), (5, 4, "isolated")], 1: [(6, 2, "isolated")]})
    *parts, total = degraded_gap(tasks, states, persistent_schedule(6, 8, (2, 4)))
    assert [p["tasks"] for p in parts] == [0, 4, 0, 1, 0, 3] and total["tasks"] == 8


# ----------------------------------------------------------------------------------------------
# The report's table and its command


@pytest.fixture
def tables(monkeypatch) -> list:
    """Every table calibration_report prints, as rich Tables."""
    shown = []
    monkeypatch.setattr(report, "print_table", shown.append)
    return shown


def cells(table) -> list[list[str]]:
    return [list(row) for row in zip(*(list(c.cells) for c in table.columns))]


def test_the_report_table_reads_as_the_readmes(tables):
    """print_report's rows as README's calibration table shows them: 3 decimals, a count of tokens
    with thousands separators (a paper value of 100 or more), "±" before the tolerance, "yes" or
    "NO"; an undefined value is "—". Mutations: the big-number threshold, "no", "0" for undefined."""
    rows = [row("model tokens per task, healthy", 50_695.2, 51_000, 5_000, "secondary"),
            dict(row("model calls per task, healthy", 10.345, 12.4, 1.0, "secondary"),
                 measured={"mean": 10.345, "std": 0.3712}),
            row("Takeover on Finalize: right->wrong", None, 1 / 32, 0.04)]  # fmt: skip
    report.print_report(rows, "title")
    assert cells(tables[0]) == [
        ["secondary", "model tokens per task, healthy", "51,000", "50,695", "±5,000", "yes"],
        ["secondary", "model calls per task, healthy", "12.400", "10.345 ± 0.371", "±1.000", "NO"],
        ["primary", "Takeover on Finalize: right->wrong", "0.031", "—", "±0.040", "NO"],
    ]


def test_the_gap_table_shows_an_empty_part_as_a_dash(tables):
    """print_gap: a part no task fell in has no accuracy ("—"). Mutation: an empty cell."""
    parts = [{"part": "p", "tasks": 0, "share": 0.0, "accuracy": None, "contribution": 0.0},
             {"part": "q", "tasks": 1234, "share": 1.0, "accuracy": 0.5, "contribution": -0.0312}]  # fmt: skip
    report.print_gap(parts, "t")
    assert cells(tables[0]) == [
        ["p", "0", "0.000", "—", "+0.0000"],
        ["q", "1,234", "1.000", "0.500", "-0.0312"],
    ]


@pytest.fixture
def report_body(monkeypatch, tmp_path, tables):
    """calibration_report.body with runner.run, the per-seed contexts, evaluate and degraded_gap
    stood in for: `rows` are the evaluated rows; `seen` what the stand-ins were given."""
    seen: dict = {"rows": []}
    frame = pl.DataFrame({"pair": ["default", "A"], "t": [1, 1]})

    def run(exp, out, **_):
        seen["exp"] = exp
        return runner.Results(tmp_path / "run", frame, frame, frame, frame, {"results": []})

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "profile_targets", lambda datasets, profiles_dir=None: (1, 3))
    monkeypatch.setattr(report, "per_seed_contexts", lambda results, exp, pair: [pair])
    monkeypatch.setattr(
        report, "evaluate", lambda contexts: [r for r in seen["rows"] if r["pair"] in contexts]
    )

    def gap(tasks, states, schedule):
        seen["gap_pairs"] = set(tasks["pair"]) | set(states["pair"])
        return [{"part": "p", "tasks": 1, "share": 1.0, "accuracy": 1.0, "contribution": 0.0}]

    monkeypatch.setattr(report, "degraded_gap", gap)

    def call(rows: list[dict], **flags):
        seen["rows"] = rows
        report.body(report.ReportConfig(out=tmp_path / "run", quiet=True, **flags))

    return call, seen


def test_the_report_exits_1_only_when_a_primary_target_misses(report_body, capsys):
    """calibration_report: "Exits with status 1 when a primary target fails" (decisions R3); a
    secondary target missing is reported, not an error. Mutation: any failed row exits 1."""
    call, _ = report_body
    good = row("mean q0, healthy-author outputs", 0.89, 0.89, 0.03)
    call([good, row("model calls per task, healthy", 10.3, 12.4, 1.0, "secondary")], pairs=("default",))
    assert "primary targets: 1/1 within tolerance" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        call([good, row("mean q0, degraded-author outputs", 0.2, 0.08, 0.03)], pairs=("default",))
    assert stop.value.code == 1


def test_a_report_without_the_default_pair_measures_no_primary_target_and_exits_0(report_body, capsys):
    """decisions R3: `--pairs A B` without `default` measures no primary target, prints "0/0" and
    exits 0 (nothing failed), even with a secondary target missed; no loss line and no breakdown of
    the degraded phase (both the default pair's). Mutations: any failed row exits 1; the loss or the
    gap printed without the default pair."""
    call, seen = report_body
    call(
        [row("pair A: accuracy, degraded phase, mean of 3", 0.5, 0.905, 0.03, "secondary", "A")], pairs=("A",)
    )
    out = capsys.readouterr().out
    assert "primary targets: 0/0 within tolerance" in out and "loss (" not in out
    assert "gap_pairs" not in seen


def test_the_reports_loss_is_the_default_pairs_and_its_json_holds_the_gap(report_body, capsys, tmp_path):
    """body: the printed loss is calibration_fit's over the default pair's targets (what a held-out
    check of fitted files compares, docs/calibration.md), not pairs A's and B's; --json-out holds the
    targets and the degraded-phase breakdown, computed on the default pair's streams only.
    Mutations: the loss over every row, the gap left out of the JSON, the gap over every pair."""
    call, seen = report_body
    rows = [row("mean q0, healthy-author outputs", 0.91, 0.89, 0.03),
            row("pair A: accuracy, degraded phase, mean of 3", 0.5, 0.905, 0.03, "secondary", "A")]  # fmt: skip
    call(rows, pairs=("default", "A"), json_out=tmp_path / "report.json")
    assert (
        f"loss (calibration_fit's, default pair's targets): {loss(rows[:1]):.2f}" in capsys.readouterr().out
    )
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["targets"] == rows and written["degraded_gap"][0]["part"] == "p"
    assert seen["gap_pairs"] == {"default"}


def test_the_report_runs_the_three_pairs_with_the_profiles_degraded_agents(report_body):
    """calibration_report: pairs A and B run by default (their secondary targets); the degraded agents
    are the profiles' A3/A5 (runner.profile_targets, here a stand-in naming 1 and 3). Mutations: the
    default pairs cut to the default one; the Experiment's own (2, 4)."""
    assert report.ReportConfig().pairs == ("default", "A", "B")
    call, seen = report_body
    call([row("mean q0, healthy-author outputs", 0.89, 0.89, 0.03)], pairs=("default",))
    assert seen["exp"].degraded == (1, 3) and seen["exp"].seeds == (0, 1, 2, 3, 4)


# ----------------------------------------------------------------------------------------------
# Coordinates and the written rows


def test_every_decoded_value_has_six_decimals():
    """decode: "6 decimals, categoricals summing to exactly 1" (the files' rows, E11's tolerance): a
    probability is its sigmoid rounded to 6 decimals, a clipped number its clipped value so rounded,
    every entry of a row has 6 decimals. Mutations: 5 decimals for a probability or a clipped number;
    the last entry of a row 1 - sum(others) unrounded."""
    base = fit.base_docs()
    for seed in range(3):
        x = np.random.default_rng(seed).normal(0.5, 2.0, fit.DIM)
        docs = fit.decode(x, base, sharpen=False)
        k = 0
        for knob in fit.KNOBS:
            z, k = x[k:k + knob.size], k + knob.size  # fmt: skip
            value = fit._get(docs[knob.model], knob.path)
            if knob.categorical:
                assert all(round(v, 6) == v >= 0.0 for v in value) and sum(value) == pytest.approx(
                    1.0, abs=1e-9
                )
            elif knob.clipped:
                assert value == round(min(max(float(z[0]), knob.clip[0]), knob.clip[1]), 6), knob.name
            else:
                assert value == round(1.0 / (1.0 + math.exp(-float(z[0]))), 6), knob.name


def test_a_row_rounded_past_1_gives_the_difference_to_its_largest_entry():
    """_rounded: "if the others' rounding leaves it below 0, it is 0 and the largest entry takes the
    difference" (rounded to 6 decimals). Mutations: the first entry takes it; it is not rounded."""
    assert fit._rounded([0.0999996, 0.4500006, 0.4499998, 0.0]) == [0.1, 0.45, 0.45, 0.0]


# ----------------------------------------------------------------------------------------------
# Start files and batches


def test_a_missing_or_undecodable_model_file_is_named(tmp_path):
    """base_docs: a start folder without the pair's file, or with one that is not UTF-8 text, is one
    error naming the file. Mutations: the existence check removed (a bare FileNotFoundError);
    UnicodeDecodeError not caught."""
    with pytest.raises(
        MeshHealError, match=r"model file .*llama-3\.3-70b\.toml not found \(the B pair's strong model\)"
    ):
        fit.base_docs("B", start=tmp_path)
    (tmp_path / "llama-3.3-70b.toml").write_bytes(b"\xff\xfe model = 1")
    with pytest.raises(MeshHealError, match=r"cannot parse model parameter file .*llama-3\.3-70b\.toml"):
        fit.base_docs("B", start=tmp_path)


def test_pair_a_fits_gemma_only():
    """FitConfig.pair: "A: fit gemma-3-4b to pair A's accuracy target" (the other file is the
    default pair's, already fitted): its coordinates are the weak model's, its start file gemma's.
    Mutation: pair A fitting its strong file."""
    assert {k.model for k in fit.knobs_for("A", structure=True)} == {"weak"}
    docs = fit.base_docs("A", start=START)
    assert docs["strong"] == fit.base_docs()["strong"]
    assert docs["weak"] == fit.tomllib.loads((START / "gemma-3-4b.toml").read_text())


@pytest.mark.parametrize("streams, max_streams, candidates, batches", [
    (3, 2, 2, [1, 1]),  # one candidate's streams above the limit: still one candidate a batch
    (24, None, 24, [24]),  # the default generation, 24 x 3 datasets x 8 seeds: one batch
    (96, None, 24, [6, 6, 6, 6]),  # 32 fit seeds: batches of at most 576 streams
])  # fmt: skip
def test_batches_hold_at_most_max_streams_and_at_least_one_candidate(monkeypatch, streams, max_streams,
                                                                      candidates, batches):  # fmt: skip
    """Evaluator.rows and docs/calibration.md "Evaluation": a generation's 24 x 3 x 8 = 576 streams
    are one batch; with more seeds, batches of at most 576 streams. Mutations: no floor of one
    candidate a batch (a 0 step); another MAX_STREAMS."""
    ev = object.__new__(fit.Evaluator)
    ev.streams = [None] * streams
    seen = []
    monkeypatch.setattr(ev, "_rows", lambda pairs, gaps: seen.append(len(pairs)) or [[p] for p in pairs])
    if max_streams is not None:
        monkeypatch.setattr(fit, "MAX_STREAMS", max_streams)
    assert ev.rows(list(range(candidates))) == [[k] for k in range(candidates)]
    assert seen == batches


# ----------------------------------------------------------------------------------------------
# Settings, commands, headers


def test_the_documented_defaults():
    """docs/calibration.md "Evaluation": fit seeds 100-107, disjoint from the report's 0-4, 24
    candidates a generation; "Loss": pairs A and B add 0.02 x the squared distance from the start.
    Mutations: another default seed list, population or prior."""
    cfg = fit.FitConfig()
    assert cfg.fit_seeds == tuple(range(100, 108)) and not set(cfg.fit_seeds) & set(range(5))
    assert cfg.population == 24 and cfg.prior == 0.02


@pytest.mark.parametrize(
    "axes", [dict(scan_spread=(1.0,)), dict(scan_review=(1.0,)), dict(scan_blame=(0.5,))]
)
def test_any_one_scan_axis_makes_a_scan(axes):
    """FitConfig.scan_spread: "no search when any --scan-* is given". Mutation: spread and review
    both needed."""
    assert fit.FitConfig(**axes).scans() and not fit.FitConfig().scans()


@pytest.mark.parametrize("args, shipped", [
    (("--pair A --start meshheal_jax/model_params/fit_start --generations 12 --population 16 --sigma 0.3 "
      "--fit-seeds 100 101 102 103 104 --out runs/fit/A --write"), "gemma-3-4b.toml"),
    (("--pair B --start meshheal_jax/model_params/fit_start --generations 12 --population 16 --sigma 0.3 "
      "--fit-seeds 100 101 102 103 104 --out runs/fit/B --write"), "llama-3.3-70b.toml"),
    (f"--generations 8 --sigma 0.1 --fit-seeds {' '.join(map(str, range(100, 132)))} --out runs/fit/d --write",
     "gpt-oss-120b.toml"),
])  # fmt: skip
def test_the_documented_commands_name_the_shipped_files_headers(monkeypatch, args, shipped):
    """docs/calibration.md "How the files were made": each of the last three commands, run from the
    repository, writes the header the shipped file holds (the defaults it leaves out: population 24,
    search seed 0, prior 0.02 not shown; --start relative to the folder). Mutations: another default
    population or search seed, --prior always shown, --start written absolute."""
    monkeypatch.chdir(ROOT)
    cfg = tyro.cli(fit.FitConfig, args=shlex.split(args))
    header = (fit.MODEL_DIR / shipped).read_text().splitlines()[1]
    assert header == f"# Fitted by `python -m meshheal_jax.calibration_fit {fit.command_line(cfg)}`."


class Stop(Exception):
    pass


class StubEvaluator:
    """fit.Evaluator's stand-in for `body`: StrongInfer's rows, pair-wise (`made`: every instance)."""

    made: ClassVar[list] = []
    refuse = False  # rows raise Stop (a command that must not evaluate)

    def __init__(self, seeds, pair="default"):
        self.inner = StrongInfer(0.99, "primary" if pair == "default" else "secondary")
        StubEvaluator.made.append(self)

    def rows(self, pairs, gaps=None):
        if StubEvaluator.refuse:
            raise Stop
        return self.inner.rows(pairs, gaps)


@pytest.fixture
def stub(monkeypatch, tmp_path):
    monkeypatch.setattr(fit, "Evaluator", StubEvaluator)
    monkeypatch.setattr(StubEvaluator, "made", [])
    monkeypatch.setattr(StubEvaluator, "refuse", False)
    monkeypatch.setattr(fit, "MODEL_DIR", tmp_path / "package")
    return StubEvaluator


def test_a_written_files_header_is_the_shipped_files(stub, tmp_path):
    """body: a written file's first line is the one every shipped file holds. Mutation: another
    header text."""
    fit.body(fit.FitConfig(out=tmp_path / "fit", generations=0, fit_seeds=(100,), tokens=False))
    first = (tmp_path / "fit" / "model_params" / "gpt-oss-120b.toml").read_text().splitlines()[0]
    assert first == (ROOT / "meshheal_jax" / "model_params" / "gpt-oss-120b.toml").read_text().splitlines()[0]


def test_pairs_a_and_b_keep_their_token_ranges(stub, tmp_path):
    """body writes pair B's one fitted file, Llama-3.3-70B's, and (FitConfig.tokens: "default pair";
    docs/calibration.md: pairs A and B's token ranges are not fitted) keeps its completion-token
    ranges although --tokens is on by default. Mutation: the written file named after the pair's
    other model. (Dropping the `pair == "default"` guard changes nothing: pair B's rows hold no token
    target, so scale_tokens stops at once.)"""
    fit.body(pair_b(tmp_path / "fit", generations=0))
    written = fit.tomllib.loads((tmp_path / "fit" / "model_params" / "llama-3.3-70b.toml").read_text())
    start = fit.base_docs("B", start=START)["strong"][
        "completion_tokens"
    ]  # the baselines' kinds: written as read
    assert {kind: written["completion_tokens"][kind] for kind in start} == start
    assert stub.made[-1].inner.calls == [1]


def test_a_scan_writes_its_table_and_nothing_else(stub, monkeypatch, tmp_path):
    """--scan-*: "no search"; body writes OUT/difficulty_scan.json (scan_structure's result) and no
    model file. Mutations: the scan branch skipped, or a fit run after it."""
    stub.refuse = True
    monkeypatch.setattr(fit, "scan_structure", lambda cfg, evaluator: [{"difficulty_spread": 0.5}])
    fit.body(fit.FitConfig(out=tmp_path / "scan", scan_spread=(0.5,), fit_seeds=(100,)))
    assert json.loads((tmp_path / "scan" / "difficulty_scan.json").read_text()) == [
        {"difficulty_spread": 0.5}
    ]
    assert sorted(p.name for p in (tmp_path / "scan").iterdir()) == ["difficulty_scan.json"]


def test_a_scan_with_settings_it_cannot_run_is_refused_before_anything(stub, monkeypatch, tmp_path):
    """body checks the settings first (check_search) on the scan path too, where no fit checks them
    again: a scan into a file is refused before an evaluator is built. Mutation: body's check
    removed (the scan ran, then failed on the folder)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(fit, "scan_structure", lambda cfg, evaluator: [])
    with pytest.raises(MeshHealError, match="--out .*a-file exists and is not a folder"):
        fit.body(fit.FitConfig(out=tmp_path / "a-file", scan_spread=(0.5,), fit_seeds=(100,)))
    assert stub.made == []


def test_the_default_pairs_score_weighs_secondary_targets_as_secondary(tmp_path):
    """The default pair's score is loss(rows) (decisions R4: 0.25 z^2 per secondary target); only
    pairs A and B weigh their one target as primary. Mutation: all_primary for every pair."""
    extra = (row("model calls per task, healthy", 10.4, 12.4, 1.0, "secondary"),)
    cfg = fit.FitConfig(population=2, generations=1, fit_seeds=(100,), out=tmp_path / "fit")
    _, rows, value = fit.fit(cfg, StrongInfer(0.99, "primary", extra))
    assert value == pytest.approx(loss(rows), rel=1e-12) and value < loss(rows, all_primary=True) - 1.0


# ----------------------------------------------------------------------------------------------
# Resuming a search


def test_a_resumed_search_is_the_search_run_at_once(tmp_path):
    """FitConfig.out: "a rerun with the same folder resumes from it" (its mean, step sizes, random
    state and best candidate): 1 + 2 generations end where 3 at once do, state.json and result alike.
    The target is the start's own value, so the start stays the best: state.json's best rows are its
    rows. Mutations: the random state, generation count, step sizes or best loss not restored; the
    state's best rows those of the generation's best instead of the best candidate's."""
    target = start_p_infer()
    at_once = fit.fit(pair_b(tmp_path / "a", population=4, generations=3), StrongInfer(target))
    fit.fit(pair_b(tmp_path / "b", population=4, generations=1), StrongInfer(target))
    resumed = fit.fit(pair_b(tmp_path / "b", population=4, generations=3), StrongInfer(target))
    assert resumed == at_once
    a, b = (json.loads((tmp_path / k / "state.json").read_text()) for k in "ab")
    assert a == b and a["generation"] == 3
    assert a["best"]["rows"][0]["measured"]["mean"] == pytest.approx(target, abs=1e-6)
    assert a["best"]["docs"]["strong"]["p_infer"] == a["best"]["rows"][0]["measured"]["mean"]


@pytest.mark.parametrize("change, differ", [
    (dict(difficulty_sigma=0.9), "difficulty_sigma"),
    (dict(prior=0.05), "prior"),
    (dict(fit_seeds=(100, 101)), "fit_seeds"),
    (dict(structure=True), "knobs"),
    ("start", "start"),
])  # fmt: skip
def test_a_resume_under_any_setting_that_changes_the_search_is_refused(tmp_path, change, differ):
    """fit: a folder's state.json is resumed only by the same settings; each of these changes the
    search (the step sizes, the score, the evaluation, the coordinates, the start files: a copy of
    fit_start elsewhere is another --start). Mutations: each left out of the compared settings."""
    fit.fit(pair_b(tmp_path / "fit", population=2, generations=1), StrongInfer(0.99))
    if change == "start":
        shutil.copytree(START, tmp_path / "copy")
        change = dict(start=tmp_path / "copy")
    with pytest.raises(MeshHealError, match=rf"other settings \({differ} differ\)"):
        fit.fit(pair_b(tmp_path / "fit", population=2, generations=2, **change), StrongInfer(0.99))


@pytest.mark.parametrize("damage, message", [
    ("bytes", r"cannot be read \(UnicodeDecodeError\)"),
    ("folder", r"cannot be read \(IsADirectoryError\)"),
    ("config", r"is not a search's state \(it needs config, rng, mean, sigma, generation, best\)"),
])  # fmt: skip
def test_a_state_json_that_is_no_state_is_named(tmp_path, damage, message):
    """_read_state: a state.json that is not UTF-8, is a folder, or holds every key but a config that
    is no table is one error naming it. Mutations: UnicodeDecodeError or OSError not caught; the
    config's type not checked (the "before --start" message instead)."""
    state = tmp_path / "state.json"
    if damage == "bytes":
        state.write_bytes(b"\xff\xfe{}")
    elif damage == "folder":
        state.mkdir()
    else:
        state.write_text(
            json.dumps(dict.fromkeys(("rng", "mean", "sigma", "generation", "best"), 0) | {"config": []})
        )
    with pytest.raises(MeshHealError, match=message):
        fit.fit(pair_b(tmp_path, population=2, generations=1), StrongInfer(0.99))


# ----------------------------------------------------------------------------------------------
# Token scaling


class TokenRows:
    """Evaluator stand-in for scale_tokens: the two token targets measured as given."""

    def __init__(self, healthy: float, degraded: float):
        self.measured, self.pairs = (healthy, degraded), []

    def rows(self, pairs, gaps=None):
        self.pairs += pairs
        return [[row(t, m, 51_000, 5_000, "secondary") for t, m in zip(fit.TOKEN_TARGETS, self.measured)]]


def test_token_ranges_of_both_files_scale_by_the_mean_target_over_the_mean_measured():
    """scale_tokens: factor = mean(51k, 51k) / mean(measured, both phases); every (lo, hi) of BOTH
    fitted files times it, rounded to the nearest token; the given files are not changed.
    Mutations: the weak file kept; max instead of mean; hi truncated; the input edited in place."""
    docs = fit.base_docs()
    before = copy.deepcopy(docs)
    ev = TokenRows(40_000, 60_000)
    new, _ = fit.scale_tokens(docs, ev.rows([None])[0], ev, "default", rounds=1)
    assert docs == before
    for role in ("strong", "weak"):
        want = {
            k: [max(1, round(lo * 1.02)), max(1, round(hi * 1.02))]
            for k, (lo, hi) in before[role]["completion_tokens"].items()
        }
        assert new[role]["completion_tokens"] == want, role
        assert new[role] == {**before[role], "completion_tokens": want}
    assert ev.pairs[-1].strong.completion_tokens["generate"] == tuple(
        new["strong"]["completion_tokens"]["generate"]
    )


def test_token_ranges_never_scale_below_one_token():
    """scale_tokens: max(1, ...): a range stays a valid one however small the factor. Mutation: no
    floor (0 tokens, a range parse_model refuses)."""
    ev = TokenRows(51e9, 51e9)
    new, _ = fit.scale_tokens(fit.base_docs(), ev.rows([None])[0], ev, "default", rounds=1)
    assert {tuple(v) for role in ("strong", "weak") for v in new[role]["completion_tokens"].values()} == {
        (1, 1)
    }


# ----------------------------------------------------------------------------------------------
# What a scan prints


def passing_context() -> dict:
    """A seed's context where every default-pair target sits at its paper value."""
    audit = defaultdict(float)
    streams = {d: defaultdict(float) for d in DATASETS}
    for t in TARGETS:
        kind, key = READS[t.name]
        if t.pair != "default":
            continue
        if kind == "audit":
            audit[key] = t.paper
        elif kind == "mean":
            for d in DATASETS:
                streams[d][key] = streams[d].get(key) or t.paper
    for key, math_value in (("acc_healthy", 0.821), ("acc_degraded", 0.802)):
        mean = next(t.paper for t in TARGETS if READS[t.name] == ("mean", key) and t.pair == "default")
        streams["math"][key] = math_value
        for d in ("bbh", "mmlu_pro"):
            streams[d][key] = (3 * mean - math_value) / 2
    streams["bbh"]["calls_per_task_healthy"] += 3.0  # a secondary target 1 tolerance off
    return {"audit": audit, "streams": streams}


def test_a_scan_row_shows_the_never_detected_share_the_clean_part_and_the_loss(monkeypatch):
    """scan_structure's table: "isolated at onset or never" adds the first two parts of
    degraded_gap (share, contribution), "after isolation, visits none" is the last part's
    contribution, and the loss is calibration_fit's for the default pair (a secondary target at 0.25
    z^2). Mutations: the second part left out, another part shown, the loss with all_primary."""
    rows = evaluate({"default": [passing_context()]})
    gap = [{"part": p, "tasks": 1, "share": 0.1 * (k + 1), "accuracy": 0.5, "contribution": -0.001 * (k + 1)}
           for k, p in enumerate(GAP_PARTS)] + [{"part": "total", "tasks": 6, "share": 1.0, "accuracy": 0.5,
                                                 "contribution": -0.021}]  # fmt: skip

    class Scan:
        def rows(self, pairs, gaps=None):
            gaps += [gap] * len(pairs)
            return [rows] * len(pairs)

    shown = []
    monkeypatch.setattr(fit, "print_table", shown.append)
    fit.scan_structure(fit.FitConfig(scan_spread=(0.5,)), Scan())
    (line,) = cells(shown[0])
    assert line[-2:] == ["0.300, -0.0030", "-0.0060"]
    assert line[-3] == f"{loss(rows):.1f}" == "0.2" and line[-4] == "15/15"


# ----------------------------------------------------------------------------------------------
# Bugs the audit found, fixed


def test_a_scan_of_pair_a_is_refused_before_anything_runs(stub, monkeypatch, tmp_path):
    """`--pair A --scan-spread 0` passed check_search, evaluated every point, then stopped with a raw
    KeyError ('accuracy, healthy phase, mean of 3 datasets'): the pair's rows hold only its one
    target. A scan is of the default pair: any other is refused before anything runs or is written."""
    gap = [{"part": p, "tasks": 1, "share": 0.1, "accuracy": 0.5, "contribution": 0.0} for p in GAP_PARTS]

    class PairA:
        def __init__(self, seeds, pair="default"):
            self.pair = pair

        def rows(self, pairs, gaps=None):
            gaps += [gap] * len(pairs)
            return [
                [row("pair A: accuracy, degraded phase, mean of 3", 0.9, 0.905, 0.03, "secondary", "A")]
            ] * len(pairs)

    monkeypatch.setattr(fit, "Evaluator", PairA)
    with pytest.raises(MeshHealError, match="--scan-.* default pair"):
        fit.body(fit.FitConfig(pair="A", scan_spread=(0.0,), fit_seeds=(100,), out=tmp_path / "scan"))
    assert not (tmp_path / "scan").exists()


def test_a_start_files_per_type_p_part_is_kept(tmp_path):
    """A start file with per-type p_part entries (calibrate --per-type writes them, decisions C8) is
    fitted on its `default` only; decode replaced the whole table, so every candidate and the written
    file silently lost the per-type values. They are kept, like the other unfitted values
    (docs/calibration.md)."""
    shutil.copytree(START, tmp_path / "start")
    path = tmp_path / "start" / "llama-3.3-70b.toml"
    path.write_text(
        path.read_text().replace(
            "bbh = { default = 0.86 }", "bbh = { default = 0.86, object_counting = 0.5 }"
        )
    )
    base = fit.base_docs("B", start=tmp_path / "start")
    assert base["strong"]["p_part"]["bbh"]["object_counting"] == 0.5
    knobs = fit.knobs_for("B")
    assert (
        fit.decode(fit.encode(base, knobs), base, knobs)["strong"]["p_part"]["bbh"].get("object_counting")
        == 0.5
    )


@pytest.mark.parametrize("prior", [float("nan"), float("inf"), -0.02])
def test_a_prior_that_is_no_weight_is_refused(prior, tmp_path):
    """--prior (pairs A and B: loss += prior x squared distance from the start) of NaN makes every
    score NaN (the search moves at random and writes the start files), a negative one rewards
    leaving the start; check_search refused sigma's like, not the prior's. Now the prior's too."""
    with pytest.raises(MeshHealError, match="--prior"):
        fit.check_search(pair_b(tmp_path, prior=prior))
