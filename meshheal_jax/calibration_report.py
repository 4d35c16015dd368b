"""`python -m meshheal_jax.calibration_report`: the emulator against the paper's call-level targets.

Runs the persistent-degradation experiment through the real protocol (3 datasets, 5 seeds by
default; pairs A and B for the secondary accuracy targets) and prints, per target of
spec/emulator.md: the paper's value, the measured mean ± std over seeds, the tolerance and
whether the mean is within it. Exits with status 1 when a primary target fails.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from meshheal_jax import metrics, runner
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, new_table, print_table
from meshheal_jax.data import DATASETS
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair
from meshheal_jax.report import print_parse_notes


@dataclasses.dataclass(frozen=True)
class Target:
    priority: str
    name: str
    paper: float
    tolerance: float
    measure: Callable[[dict], float | None]  # per-seed context -> value
    pair: str = "default"


def _audit(key: str) -> Callable[[dict], float | None]:
    return lambda ctx: ctx["audit"][key]


def _acc(phase: str, dataset: str | None = None) -> Callable[[dict], float | None]:
    def measure(ctx: dict) -> float | None:
        values = [m[phase] for d, m in ctx["streams"].items() if dataset in (None, d)]
        return float(np.mean(values))

    return measure


TARGETS = (
    Target("primary", "mean q0, healthy-author outputs", 0.89, 0.03, _audit("mean_q0_healthy")),
    Target("primary", "mean q0, degraded-author outputs", 0.08, 0.03, _audit("mean_q0_degraded")),
    Target("primary", "initial low-score recall (degraded)", 0.90, 0.04, _audit("initial_recall")),
    Target("primary", "initial low-score false alarm (healthy)", 0.053, 0.02, _audit("initial_false_alarm")),
    Target("primary", "after committee: recall", 0.88, 0.04, _audit("final_recall")),
    Target("primary", "after committee: false alarm", 0.044, 0.02, _audit("final_false_alarm")),
    Target("primary", "committee clears healthy-flagged", 0.33, 0.08, _audit("committee_clears_healthy")),
    Target("primary", "committee keeps degraded-flagged", 0.95, 0.04, _audit("committee_keeps_degraded")),
    Target("primary", "degraded-author outputs sent to committee", 0.98, 0.03, _audit("committee_share_degraded")),
    Target("primary", "Takeover on Finalize: wrong->right", 15 / 32, 0.12, _audit("takeover_wrong_to_right")),
    Target("primary", "Takeover on Finalize: right->wrong", 1 / 32, 0.04, _audit("takeover_right_to_wrong")),
    Target("primary", "accuracy, healthy phase, mean of 3 datasets", 0.831, 0.02, _acc("acc_healthy")),
    Target("primary", "accuracy, degraded phase, mean of 3 datasets", 0.839, 0.02, _acc("acc_degraded")),
    Target("primary", "MATH accuracy, healthy phase", 0.821, 0.03, _acc("acc_healthy", "math")),
    Target("primary", "MATH accuracy, degraded phase", 0.802, 0.03, _acc("acc_degraded", "math")),
    Target("secondary", "model calls per task, healthy", 12.4, 1.0, _acc("calls_per_task_healthy")),
    Target("secondary", "model calls per task, degraded", 13.6, 1.0, _acc("calls_per_task_degraded")),
    Target("secondary", "model tokens per task, healthy", 51_000, 5_000, _acc("tokens_per_task_healthy")),
    Target("secondary", "model tokens per task, degraded", 51_000, 5_000, _acc("tokens_per_task_degraded")),
    Target("secondary", "pair A: accuracy, degraded phase, mean of 3", 0.905, 0.03, _acc("acc_degraded"), "A"),
    Target("secondary", "pair B: accuracy, degraded phase, mean of 3", 0.782, 0.03, _acc("acc_degraded"), "B"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ReportConfig(CommonFlags):
    pairs: tuple[str, ...] = ("default", "A", "B")
    """pairs to run (the A/B targets are skipped when their pair is not run)"""
    json_out: Path | None = None
    """also write the table as JSON here"""


def seed_context(frames: dict[str, dict[str, pl.DataFrame]], schedule, phase_names) -> dict:
    """One seed: metrics of every dataset's stream (frames[dataset][table]) and the review audit
    pooled over datasets."""
    streams = {d: metrics.stream_metrics(f["tasks"], f["reviews"], f["states"], schedule, phase_names)
               for d, f in frames.items()}  # fmt: skip
    return {
        "streams": streams,
        "audit": metrics.review_audit(pl.concat([f["reviews"] for f in frames.values()])),
    }


def per_seed_contexts(results: runner.Results, exp: runner.Experiment, pair: str) -> list[dict]:
    """Per seed of a finished run: seed_context over its datasets."""
    schedule = exp.schedule()
    _, phase_names = exp.phases()
    out = []

    def pick(df: pl.DataFrame, seed: int, dataset: str) -> pl.DataFrame:
        return df.filter((pl.col("seed") == seed) & (pl.col("pair") == pair) & (pl.col("dataset") == dataset))

    for seed in exp.seeds:
        frames = {d: {name: pick(getattr(results, name), seed, d) for name in ("tasks", "reviews", "states")}
                  for d in exp.datasets}  # fmt: skip
        out.append(seed_context(frames, schedule, phase_names))
    return out


def evaluate(contexts_by_pair: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for target in TARGETS:
        if target.pair not in contexts_by_pair:
            continue
        values = [target.measure(ctx) for ctx in contexts_by_pair[target.pair]]
        s = metrics.stat(values)
        ok = s["mean"] is not None and abs(s["mean"] - target.paper) <= target.tolerance + 1e-12
        rows.append({"priority": target.priority, "target": target.name, "pair": target.pair,
                     "paper": target.paper, "tolerance": target.tolerance, "measured": s, "pass": ok})  # fmt: skip
    return rows


def loss(rows: list[dict], all_primary: bool = False) -> float:
    """calibration_fit's objective (its module docstring), z = (measured - paper) / tolerance;
    `all_primary`: weigh every row as a primary target (pairs A and B, whose one target is secondary)."""
    total = 0.0
    for r in rows:
        mean = r["measured"]["mean"]
        z = 10.0 if mean is None else (mean - r["paper"]) / r["tolerance"]
        if r["priority"] == "primary" or all_primary:
            total += z * z + 10.0 * max(abs(z) - 0.6, 0.0) ** 2
        else:
            total += 0.25 * z * z
    return total


GAP_PARTS = (
    "a degraded agent already isolated when it degrades (falsely isolated while healthy)",
    "degraded agents not both isolated by the stream's end",
    "before both are isolated: task visits a degraded agent",
    "before both are isolated: task visits none",
    "after both are isolated: task visits a degraded agent (probe, relay, re-entry)",
    "after both are isolated: task visits none",
)


def degraded_gap(tasks: pl.DataFrame, states: pl.DataFrame, schedule) -> list[dict]:
    """Where the degraded phase's accuracy goes, relative to the healthy phase of the same streams.

    Degraded-phase tasks (phase 1 of the persistent schedule) fall in the parts of GAP_PARTS, by
    whether every degraded agent had been isolated at least once since it degraded, before the task
    (per stream), and whether the task's route visits a degraded agent. A stream where a degraded
    agent is still isolated when it degrades (falsely isolated while healthy: its isolation is no
    detection) is a part of its own, first. A part's contribution is
    its share of the phase's tasks × (its accuracy − the healthy-phase accuracy); the contributions
    sum to acc D − acc H (pooled over streams; every stream has the same number of tasks per phase)."""
    start = {a: s for a, s, _ in schedule.intervals}
    degraded = sorted(start)
    streams = ["dataset", "pair", "seed"]
    since = pl.col("agent").replace_strict(start, default=None, return_dtype=pl.Int64)
    mine = states.filter(pl.col("agent").is_in(degraded))
    # isolated at onset: its last change before its first degraded task put it in isolation
    at_onset = (mine.filter(pl.col("t") < since).group_by(*streams, "agent", maintain_order=True)
                .agg(pl.col("to").last()).filter(pl.col("to") == "isolated")
                .select(*streams).unique().with_columns(onset_isolated=pl.lit(True)))  # fmt: skip
    isolated = (mine.filter((pl.col("to") == "isolated") & (pl.col("t") >= since))
                .group_by(*streams, "agent").agg(pl.col("t").min())
                .group_by(*streams).agg(pl.col("t").max().alias("t_all"), pl.len().alias("n_isolated")))  # fmt: skip
    visits = pl.col("route").str.split("-").list.eval(pl.element().cast(pl.Int64).is_in(degraded)).list.any()
    x = (tasks.join(isolated, on=streams, how="left").join(at_onset, on=streams, how="left")
         .with_columns(visits=visits, onset_isolated=pl.col("onset_isolated").fill_null(False)))  # fmt: skip
    healthy = float(x.filter(pl.col("phase") == 0)["correct"].mean())
    d = x.filter(pl.col("phase") == 1)
    never = pl.col("n_isolated").is_null() | (pl.col("n_isolated") < len(degraded))
    after = pl.col("t") > pl.col("t_all")
    onset_, never_, before_visits, before_clean, after_visits, after_clean = (
        pl.lit(name) for name in GAP_PARTS
    )
    part = (pl.when(pl.col("onset_isolated")).then(onset_)
            .when(never).then(never_)
            .when(~after & pl.col("visits")).then(before_visits)
            .when(~after).then(before_clean)
            .when(pl.col("visits")).then(after_visits)
            .otherwise(after_clean))  # fmt: skip
    parts = d.with_columns(part=part).group_by("part").agg(acc=pl.col("correct").mean(), n=pl.len())
    by = {r["part"]: r for r in parts.iter_rows(named=True)}
    rows = []
    for name in GAP_PARTS:
        r = by.get(name, {"acc": None, "n": 0})
        share = r["n"] / max(len(d), 1)
        rows.append({"part": name, "tasks": r["n"], "share": share, "accuracy": r["acc"],
                     "contribution": 0.0 if r["acc"] is None else share * (r["acc"] - healthy)})  # fmt: skip
    degraded_acc = float(d["correct"].mean())
    rows.append({"part": "degraded phase (acc D − acc H)", "tasks": len(d), "share": 1.0,
                 "accuracy": degraded_acc, "contribution": degraded_acc - healthy})  # fmt: skip
    return rows


def print_gap(rows: list[dict], title: str) -> None:
    table = new_table(title, "degraded-phase tasks", "tasks", "share", "accuracy", "contribution to D − H")
    for r in rows:
        acc = "—" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        table.add_row(r["part"], f"{r['tasks']:,}", f"{r['share']:.3f}", acc, f"{r['contribution']:+.4f}")
    print_table(table)


def _num(x: float | None, big: bool) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if big else f"{x:.3f}"


def print_report(rows: list[dict], title: str) -> None:
    table = new_table(title, "priority", "target", "paper", "measured (mean ± std)", "tolerance", "pass")
    for r in rows:
        big = abs(r["paper"]) >= 100
        m = r["measured"]
        measured = _num(m["mean"], big) + ("" if m["std"] is None else f" ± {_num(m['std'], big)}")
        table.add_row(r["priority"], r["target"], _num(r["paper"], big), measured,
                      "±" + _num(r["tolerance"], big), "yes" if r["pass"] else "NO")  # fmt: skip
    print_table(table)


def body(cfg: ReportConfig) -> None:
    if cfg.pair != "default":
        raise MeshHealError("this command takes --pairs (several), not --pair")
    if cfg.json_out is not None and (cfg.json_out.is_dir() or not cfg.json_out.parent.is_dir()):
        raise MeshHealError(f"--json-out {cfg.json_out}: not a file path in an existing folder")
    exp = runner.Experiment(
        name="main", datasets=DATASETS, pairs=tuple(cfg.pairs), seeds=cfg.seed_tuple(),
        degraded=runner.profile_targets(DATASETS, cfg.profiles_dir),
        engine=cfg.engine, slots=cfg.slots, protocol=cfg.protocol, profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir,
        **backend_fields(cfg),
    )  # fmt: skip
    results = runner.run(exp, cfg.out, progress=not cfg.quiet, **cfg.run_options())
    rows = evaluate({pair: per_seed_contexts(results, exp, pair) for pair in exp.pairs})
    source = "Live models" if cfg.backend == "live" else "Emulator calibration"
    print_report(rows, f"{source} ({cfg.engine} engine, {len(exp.seeds)} seeds, non-probe outputs)")
    print_parse_notes(results.summary["results"])  # live: fallback scores count as the models' own
    for name in exp.pairs:  # the structures beyond independent draws the files switch on (decisions E9, E10)
        pair = load_pair(name, cfg.params_dir)
        print(f"pair {name}, optional structure: " + "; ".join(
            f"{m.name} difficulty_spread {m.difficulty_spread:g}, review_difficulty {m.review_difficulty:g}, "
            f"draft_blame {m.draft_blame:g}" for m in (pair.strong, pair.weak)))  # fmt: skip
    gap = None
    if "default" in exp.pairs:
        pick = pl.col("pair") == "default"
        gap = degraded_gap(results.tasks.filter(pick), results.states.filter(pick), exp.schedule())
        print_gap(gap, "Where the degraded phase's accuracy goes (default pair, all streams pooled)")
    if cfg.json_out is not None:
        cfg.json_out.write_text(json.dumps({"targets": rows, "degraded_gap": gap}, indent=2))
    if "default" in exp.pairs:  # what a held-out check of fitted files compares (docs/calibration.md)
        print(
            f"loss (calibration_fit's, default pair's targets): {loss([r for r in rows if r['pair'] == 'default']):.2f}"
        )
    failed = [r["target"] for r in rows if r["priority"] == "primary" and not r["pass"]]
    print(f"primary targets: {sum(r['pass'] for r in rows if r['priority'] == 'primary')}/"
          f"{sum(r['priority'] == 'primary' for r in rows)} within tolerance")  # fmt: skip
    print(f"results: {results.run_dir}")
    if failed:
        sys.exit(1)


def cli() -> None:
    entrypoint(ReportConfig, body, __doc__)


if __name__ == "__main__":
    cli()
