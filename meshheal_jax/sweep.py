"""`python -m meshheal_jax.sweep`: a protocol (or emulator) parameter grid in one compiled program.

Every swept parameter takes a list; the cartesian grid x datasets x seeds becomes one batch of
streams whose parameter pytree (`engine.Params`) is stacked with a leading stream axis and run by
`engine.run_rounds(..., params_batched=True)`: one trace, one compiled program, whatever the grid
(spec/experiments.md §7). Per-task draws depend only on (seed, dataset, t), so each grid point's
streams are exactly the streams a single run with that configuration makes.

    python -m meshheal_jax.sweep --grid alpha=0.8,1.0,1.2,1.4,1.6 beta=1.6,1.8,2.0,2.2,2.4 --seeds 5

`--grid` takes one or more NAME=VALUES words after a single flag (or `--grid` repeated); VALUES is
a comma list `1.0,1.2,1.4` or an inclusive range `START:STOP:COUNT` (`1.0:1.8:5`). NAME is any
numeric field of ProtocolParams but the window sizes (alpha, beta, consecutive_to_isolate, tau_to,
sigma_com, min_observations, min_matched, z_scale_floor, probe_interval, warmup_per_six, route_limit,
move_limit, threshold_tol, and the absolute_* / cusum_* parameters of the detector that reads
them), or an emulator scalar of one model of the pair, `strong.NAME` / `weak.NAME` (p_infer,
p_rescue, rho_same, p_follow, p_fix, p_keep, p_popular_wrong, answer_fraction). Rejected, with the
reason: the windows (window_scores, window_shortfalls size arrays; one compiled program has one
shape), a name the configured detector or the engine never reads, and grids with an invalid
combination (e.g. alpha > beta). Unswept values come from `--protocol.*`.

Flags every experiment shares that a sweep refuses (it runs once, on the emulator, and does not
resume): `--backend live` and the live settings, `--data`, `--tokenizer`, `--hub-*`,
`--checkpoint-every`, `--engine reference`.

Output: a run folder (config.json; tasks/reviews/states parquet with `grid_point` and one column
per swept parameter; summary.json with one entry per grid point and dataset), a printed table
per dataset with one row per grid point, `tradeoff.png` (detection delay vs false isolations; with
several datasets one `tradeoff-<dataset>.png` each) and, for two swept parameters, `grid_maps.png`
(heat maps of delay, false isolations, accuracy, tokens).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
import tyro
from rich.progress import Progress

from meshheal_jax import metrics, runner
from meshheal_jax.cli import CommonFlags, entrypoint, fmt, live_settings, new_table, print_table
from meshheal_jax.config import CHECKPOINT_EVERY_S, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.files import default_out
from meshheal_jax.params import DIFFICULTY, OPTIONAL, SCALARS, Pair, load_pair
from meshheal_jax.report import BEFORE_ONSET

TRADEOFF_PNG = "tradeoff.png"
MAPS_PNG = "grid_maps.png"
# ProtocolParams fields that size arrays (engine.EngineConfig): one compiled program has one value.
STATIC_FIELDS = {
    "window_scores": "sizes the score ring buffers (N, T, A, W_mu)",
    "window_shortfalls": "sizes the shortfall ring buffers (N, T, A, W_x)",
}
# Fields only some detectors read (engine.observe_relative / observe_absolute / observe_cusum):
# sweeping one under another detector would repeat one configuration.
DETECTOR_FIELDS = {
    "alpha": ("relative", "absolute"),
    "beta": ("relative", "absolute"),
    "consecutive_to_isolate": ("relative", "absolute"),
    "z_scale_floor": ("relative",),
    "min_matched": ("relative",),
    "absolute_threshold": ("absolute",),
    "absolute_scale": ("absolute",),
    "cusum_target": ("cusum",),
    "cusum_k": ("cusum",),
    "cusum_h": ("cusum",),
}
MODELS = ("strong", "weak")


@dataclasses.dataclass(frozen=True)
class SweepConfig(CommonFlags):
    grid: typing.Annotated[
        tuple[tuple[str, ...], ...],
        tyro.conf.UseAppendAction,
        tyro.conf.arg(metavar="NAME=VALUES [NAME=VALUES ...]"),
    ] = ()
    """swept parameters, NAME=V1,V2,... or NAME=START:STOP:COUNT; several after one --grid or --grid
    repeated (e.g. --grid alpha=1.0,1.2 beta=1.6,2.0). NAME: a numeric ProtocolParams field
    (alpha, beta, tau_to, sigma_com, probe_interval, warmup_per_six, consecutive_to_isolate, ...)
    or strong.P / weak.P for an emulator scalar P of the pair's model"""
    datasets: tuple[str, ...] = ("bbh",)
    """datasets (profiles) to run at every grid point"""
    tasks: int = 504
    """stream length (a multiple of 42; of 84 for both phases to have the same task-type mix); degradation starts at the midpoint"""
    degraded: tuple[int, ...] | None = None
    """agents (0-based) degraded from the midpoint; default: the profile's A3 and A5 (agents 2 and 4)"""
    chunk: int = 512
    """rounds per compiled call (the host gathers records between calls)"""
    out: Path | None = None
    """run folder (default runs/sweep-<timestamp>); must not exist or be empty (a sweep does not resume)"""
    engine: Literal["jax", "reference"] = "jax"
    """only jax: the grid runs as one compiled program"""
    calls: bool = False
    """also keep calls.parquet (one row per model call: large for big grids)"""


# ----------------------------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------------------------


def _protocol_kinds() -> dict[str, type]:
    """Numeric ProtocolParams fields -> int or float (bools and others are not sweepable)."""
    hints = typing.get_type_hints(ProtocolParams)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(ProtocolParams) if hints[f.name] in (int, float)
    }


def sweepable() -> list[str]:
    """Every name --grid accepts."""
    protocol = [n for n in _protocol_kinds() if n not in STATIC_FIELDS]
    return protocol + [f"{m}.{s}" for m in MODELS for s in SCALARS + OPTIONAL]


def _kind(name: str) -> type:
    if name in STATIC_FIELDS:
        listed = ", ".join(f"{k} ({why})" for k, why in STATIC_FIELDS.items())
        raise MeshHealError(
            f"{name} cannot be swept: it is a static array shape, and one compiled program has one shape. "
            f"Static parameters: {listed}. Run one sweep per value with --protocol.{name} instead."
        )
    kinds = _protocol_kinds()
    if name in kinds:
        return kinds[name]
    model, _, scalar = name.partition(".")
    if model in MODELS and scalar in SCALARS + OPTIONAL:
        return float
    raise MeshHealError(f"unknown sweep parameter {name!r}; sweepable: {', '.join(sweepable())}")


def _number(text: str, kind: type, name: str):
    try:
        value = float(text)
    except ValueError:
        raise MeshHealError(f"--grid {name}: {text!r} is not a number") from None
    if kind is int:
        if not value.is_integer():
            raise MeshHealError(f"--grid {name}: {name} is an integer, got {text!r}")
        return int(value)
    return value


def parse_grid(items: Sequence[str]) -> dict[str, tuple]:
    """['alpha=1.0,1.2', 'beta=1.6:2.0:3'] -> {'alpha': (1.0, 1.2), 'beta': (1.6, 1.8, 2.0)}, in order."""
    if not items:
        raise MeshHealError(
            "nothing to sweep: give --grid NAME=V1,V2,... (e.g. --grid alpha=1.0,1.2 beta=1.6,2.0)"
        )
    grid: dict[str, tuple] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not eq or not name or not text:
            raise MeshHealError(f"--grid expects NAME=V1,V2,... or NAME=START:STOP:COUNT, got {item!r}")
        kind = _kind(name)
        if name in grid:
            raise MeshHealError(f"--grid names {name} twice")
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise MeshHealError(f"--grid {name}: a range is START:STOP:COUNT, got {text!r}")
            count = _number(parts[2], int, f"{name} (COUNT)")
            if count < 1:
                raise MeshHealError(f"--grid {name}: COUNT must be >= 1")
            start, stop = (_number(p, float, name) for p in parts[:2])
            values = tuple(
                _number(repr(round(float(v), 10)), kind, name) for v in np.linspace(start, stop, count)
            )
        else:
            values = tuple(_number(v.strip(), kind, name) for v in text.split(","))
        if len(set(values)) != len(values):
            raise MeshHealError(f"--grid {name}: repeated values {list(values)}")
        grid[name] = values
    return grid


@dataclasses.dataclass(frozen=True)
class GridPoint:
    index: int
    values: dict  # swept name -> value
    protocol: ProtocolParams
    pair: Pair

    def label(self) -> str:
        return ", ".join(f"{k}={_show(v)}" for k, v in self.values.items())


def _show(value) -> str:
    return str(value)


def _with_scalar(pair: Pair, name: str, value: float) -> Pair:
    model_name, _, scalar = name.partition(".")
    model = getattr(pair, model_name)
    if scalar in DIFFICULTY and not 0.0 <= value < float("inf"):
        raise MeshHealError(f"{name} must be finite and >= 0, got {value}")
    if scalar not in DIFFICULTY and not 0.0 <= value <= 1.0:
        raise MeshHealError(f"{name} must be a probability in [0, 1], got {value}")
    return dataclasses.replace(
        pair, **{model_name: dataclasses.replace(model, scalars={**model.scalars, scalar: value})}
    )


def grid_points(grid: dict[str, tuple], base: ProtocolParams, pair: Pair) -> list[GridPoint]:
    """The cartesian product (first parameter slowest); invalid combinations are named together."""
    points, invalid = [], []
    for k, combo in enumerate(itertools.product(*grid.values())):
        values = dict(zip(grid, combo))
        protocol_values = {n: v for n, v in values.items() if "." not in n}
        try:
            protocol = dataclasses.replace(base, **protocol_values)
            point_pair = pair
            for name, value in values.items():
                if "." in name:
                    point_pair = _with_scalar(point_pair, name, value)
        except MeshHealError as err:
            invalid.append(f"{', '.join(f'{n}={_show(v)}' for n, v in values.items())} ({err})")
            continue
        points.append(GridPoint(k, values, protocol, point_pair))
    if invalid:
        shown = "; ".join(invalid[:5]) + (f"; and {len(invalid) - 5} more" if len(invalid) > 5 else "")
        raise MeshHealError(f"{len(invalid)} grid point(s) are not valid configurations: {shown}. "
                            f"Choose ranges in which every combination is valid.")  # fmt: skip
    return points


# ----------------------------------------------------------------------------------------------
# One compiled program for the whole grid
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """The streams of a sweep, grid point slowest, then dataset, then seed."""

    points: list[GridPoint]
    specs: list  # engine.StreamSpec
    point_of: list[int]  # grid point index of each stream


def build_batch(exp: runner.Experiment, points: list[GridPoint]) -> Batch:
    from meshheal_jax import engine

    specs, point_of = [], []
    for point in points:
        for dataset in exp.datasets:
            for seed in exp.seeds:
                network, stream, _, labels = runner._stream_inputs(exp, dataset, exp.pairs[0], seed)
                specs.append(engine.StreamSpec(network, stream, exp.schedule(), point.pair, labels))
                point_of.append(point.index)
    return Batch(points, specs, point_of)


def sweep_config(batch: Batch, slots: int):
    """The one static config of the batch: every grid point must give the same shapes; the move
    loop bound is the largest point's (a bound, not a shape: extra passes find nothing to move)."""
    from meshheal_jax import engine

    configs = [engine.engine_config(batch.specs, p.protocol, slots) for p in batch.points]
    route_loop = max(c.route_loop for c in configs)
    shapes = {dataclasses.replace(c, route_loop=route_loop) for c in configs}
    if len(shapes) > 1:
        raise MeshHealError(
            f"the grid changes static shapes ({sorted(map(str, shapes))}); sweep only traced parameters"
        )
    return shapes.pop()


def check_effect(grid: dict[str, tuple], batch: Batch, params: list) -> None:
    """Reject a swept name that the engine does not read: one the configured detector ignores, or
    one that leaves the engine's parameters unchanged."""
    import jax

    detector = getattr(batch.points[0].protocol, "detector", "relative")
    for name in grid:
        if name in DETECTOR_FIELDS and detector not in DETECTOR_FIELDS[name]:
            raise MeshHealError(f"{name} is not read by the {detector} detector (only by "
                                f"{' and '.join(DETECTOR_FIELDS[name])}); set --protocol.detector or sweep "
                                f"another parameter")  # fmt: skip

    first = {}
    for s, k in enumerate(batch.point_of):
        first.setdefault(k, s)
    for name, values in grid.items():
        if len(values) < 2:
            continue
        seen = []
        for point in batch.points:
            if all(point.values[n] == batch.points[0].values[n] for n in grid if n != name):
                seen.append(params[first[point.index]])
        leaves = [jax.tree_util.tree_leaves(p) for p in seen]
        if all(all(np.array_equal(a, b) for a, b in zip(leaves[0], other)) for other in leaves[1:]):
            raise MeshHealError(f"{name} has no effect on the jax engine's parameters (it reads no value of it); "
                                f"sweeping it would repeat one configuration")  # fmt: skip


def stream_params(batch: Batch) -> list:
    """Each stream's engine.Params: its grid point's protocol and pair, its dataset's profile."""
    from meshheal_jax import engine

    by_index = {p.index: p for p in batch.points}
    return [engine.make_params(by_index[k].protocol, spec.pair, spec.network.profile, spec.network.n_agents)
            for k, spec in zip(batch.point_of, batch.specs)]  # fmt: skip


def run_batch(batch: Batch, slots: int, chunk: int, tables: tuple[str, ...], on_progress=None,
              params: list | None = None, timings: dict | None = None,
              lanes: int | None = None) -> list[dict[str, pl.DataFrame]]:  # fmt: skip
    """engine.run_batch with one parameter pytree per stream, in `lanes` lanes side by side (default:
    one per CPU core). `timings`, when given, receives the slowest lane's seconds: first_call
    (trace + compile + the first chunk), other_calls (the remaining chunks), records (host: arrays
    -> record tables), calls (count) and lanes."""
    from meshheal_jax import engine

    cfg = sweep_config(batch, slots)
    params = stream_params(batch) if params is None else params
    mesh = engine.stream_mesh()  # several devices: streams sharded over them (one lane)
    return engine.run_batch(cfg, list(batch.specs), params, batched=True, chunk=chunk, tables=tables, lanes=lanes,
                            mesh=mesh, on_progress=on_progress, timings=timings)  # fmt: skip


def label_frames(batch: Batch, grid: dict[str, tuple], per_stream: list[dict[str, pl.DataFrame]],
                 tables: tuple[str, ...]) -> dict[str, pl.DataFrame]:  # fmt: skip
    """One frame per table: the stream frames with `grid_point` and one column per swept parameter."""
    by_index = {p.index: p for p in batch.points}
    kinds = {
        name: (pl.Int64 if all(isinstance(v, int) for v in vals) else pl.Float64)
        for name, vals in grid.items()
    }
    out = {}
    for name in tables:
        clash = set(grid) & set(metrics.SCHEMAS[name])
        if clash:
            raise MeshHealError(f"swept parameter(s) {sorted(clash)} clash with columns of the {name} table")
        parts = []
        for k, frames in zip(batch.point_of, per_stream):
            point = by_index[k]
            parts.append(frames[name].with_columns(
                pl.lit(k, dtype=pl.Int64).alias("grid_point"),
                *(pl.lit(point.values[n], dtype=kinds[n]).alias(n) for n in grid)))  # fmt: skip
        out[name] = pl.concat(parts)
    return out


# ----------------------------------------------------------------------------------------------
# Summary, table, plot
# ----------------------------------------------------------------------------------------------


def _detection(per_seed: list[dict]) -> dict:
    """Per seed the mean delay over the degraded agents that were detected; a stat over seeds."""
    delays = []
    for m in per_seed:
        d = [a["detection_delay"] for a in m["agents"] if a["detection_delay"] is not None]
        delays.append(float(np.mean(d)) if d else None)
    return metrics.stat(delays)


def _onset_detections(per_seed: list[dict]) -> dict:
    """Per seed the detections among those delays that were report.BEFORE_ONSET (§7's delay 0 for
    an agent falsely isolated before it degraded, decisions P5b); a stat over seeds."""
    return metrics.stat([float(sum(metrics.onset_detection(a) for a in m["agents"])) for m in per_seed])


def summarize(exp: runner.Experiment, grid: dict[str, tuple], points: list[GridPoint],
              frames: dict[str, pl.DataFrame]) -> dict:  # fmt: skip
    schedule = exp.schedule()
    _, phase_names = exp.phases()
    reviews = frames.get(
        "reviews", pl.DataFrame(schema={**metrics.SCHEMAS["reviews"], "grid_point": pl.Int64})
    )
    results = []
    for point in points:
        per_dataset = {}
        for dataset in exp.datasets:
            per_seed = []
            for seed in exp.seeds:

                def pick(df: pl.DataFrame, k=point.index, dataset=dataset, seed=seed) -> pl.DataFrame:
                    keep = (
                        (pl.col("grid_point") == k)
                        & (pl.col("dataset") == dataset)
                        & (pl.col("seed") == seed)
                    )
                    return df.filter(keep).drop(["grid_point", *grid])

                per_seed.append(metrics.stream_metrics(pick(frames["tasks"]), pick(reviews), pick(frames["states"]),
                                                       schedule, phase_names))  # fmt: skip
            per_dataset[dataset] = per_seed
            results.append({"grid_point": point.index, "values": point.values, "method": exp.method,
                            **exp.labels(exp.method), "dataset": dataset, "pair": exp.pairs[0], "detection_delay": _detection(per_seed),
                            "onset_detections": _onset_detections(per_seed),
                            **metrics.aggregate(per_seed, exp.seeds)})  # fmt: skip
        if len(exp.datasets) > 1:
            results.append({"grid_point": point.index, "values": point.values, "method": exp.method,
                            **exp.labels(exp.method), "dataset": "mean", "pair": exp.pairs[0],
                            **metrics.mean_over_datasets(per_dataset, exp.seeds)})  # fmt: skip
    return {"experiment": "sweep", "engine": "jax", "backend": exp.backend, "slots": exp.slots,
            "n_agents": exp.n_agents, "n_tasks": exp.n_tasks, "grid": {k: list(v) for k, v in grid.items()},
            "n_points": len(points), "seeds": list(exp.seeds), "results": results}  # fmt: skip


def print_summary(summary: dict) -> None:
    for dataset in dict.fromkeys(r["dataset"] for r in summary["results"]):
        headers, rows = summary_rows(summary, dataset)
        table = new_table(
            f"Sweep: {dataset}, {summary['n_points']} grid points × {len(summary['seeds'])} seeds, "
            f"{summary['n_tasks']} tasks (mean ± std over seeds; delay: mean over detected agents, n=seeds with one)",
            *headers,
        )  # fmt: skip
        for row in rows:
            table.add_row(*row)
        print_table(table)
    if any((r.get("onset_detections") or {}).get("mean") for r in summary["results"]):
        print(f"x before onset: x of a seed's detections (mean over seeds) were {BEFORE_ONSET}.")


def _mean_sem(stat: dict | None) -> tuple[float, float]:
    """(mean, standard error over the seeds where defined) of a stat dict; nan where undefined."""
    if not stat or stat.get("mean") is None:
        return math.nan, math.nan
    n, std = stat.get("n_defined") or 0, stat.get("std")
    return float(stat["mean"]), (float(std) / math.sqrt(n) if std is not None and n > 1 else 0.0)


def _default_values(names: Sequence[str]) -> dict:
    """The swept parameters' default values (ProtocolParams(); emulator scalars: none)."""
    base = ProtocolParams()
    return {n: getattr(base, n) for n in names if "." not in n}


def _ordered_colors(n: int) -> list:
    """n colours in value order (viridis without its palest end)."""
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return [cmap(0.05 + 0.8 * k / max(n - 1, 1)) for k in range(n)]


def tradeoff_plot(summary: dict, path: Path, dataset: str | None = None) -> Path:
    """Detection delay vs false isolations, one marker per grid point (mean over seeds, error bars
    one standard error). Points sharing every value but the last swept parameter are joined into a
    curve, coloured in the order of the first parameter's values; each marker is labelled with
    the last parameter's value. The defaults (ProtocolParams()) are ringed. Points where no
    degraded agent was ever isolated have no delay: they sit in a strip at the right."""
    from matplotlib.lines import Line2D

    from meshheal_jax import plots

    names = list(summary["grid"])
    if dataset is None:
        dataset = summary["results"][0]["dataset"]
    rows = [r for r in summary["results"] if r["dataset"] == dataset]
    if not rows:
        raise MeshHealError(f"no sweep results for dataset {dataset!r}")
    delay, delay_err = np.array([_mean_sem(r["detection_delay"]) for r in rows]).T
    false_iso, false_err = np.array([_mean_sem(r["false_isolations"]) for r in rows]).T
    missed = np.array([r["missed"]["mean"] or 0.0 for r in rows], dtype=float)
    defined = np.isfinite(delay)
    high = float(np.nanmax(delay + delay_err)) if defined.any() else 1.0
    low = float(np.nanmin(delay - delay_err)) if defined.any() else 0.0
    span = max(high - low, 1.0)
    never_x = high + 0.18 * span
    x = np.where(defined, delay, never_x)
    x_err = np.where(defined, delay_err, 0.0)

    fig = plots._new_figure(9.5, 6.6)
    ax = fig.subplots()
    last, group_names = names[-1], names[:-1]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r["values"][n] for n in group_names), []).append(i)
    colors = _ordered_colors(len(groups))
    defaults = _default_values(names)
    handles = []
    for color, (key, members) in zip(colors, sorted(groups.items())):
        members = sorted(members, key=lambda i: rows[i]["values"][last])
        ax.plot(x[members], false_iso[members], "-", color=color, lw=1.2, alpha=0.7, zorder=2)
        ax.errorbar(x[members], false_iso[members], xerr=x_err[members], yerr=false_err[members], fmt="none",
                    ecolor=color, elinewidth=0.7, alpha=0.25, zorder=1)  # fmt: skip
        for i in members:
            hollow = missed[i] > 0
            ax.plot(
                x[i],
                false_iso[i],
                "o",
                ms=7,
                color=color,
                mfc="white" if hollow else color,
                mew=1.6,
                zorder=3,
            )
            ax.annotate(_show(rows[i]["values"][last]), (x[i], false_iso[i]), xytext=(8, 4),
                        textcoords="offset points", fontsize=7, color=color)  # fmt: skip
            if len(defaults) == len(names) and all(rows[i]["values"][n] == defaults[n] for n in names):
                ax.plot(x[i], false_iso[i], "o", ms=13, mfc="none", mec="black", mew=1.2, zorder=4)
        label = ", ".join(f"{n} = {_show(v)}" for n, v in zip(group_names, key)) or f"{last} varies"
        handles.append(Line2D([], [], color=color, marker="o", lw=1.2, label=label))
    if len(defaults) == len(names):
        handles.append(Line2D([], [], color="black", marker="o", ms=11, mfc="none", lw=0,
                              label="defaults (" + ", ".join(f"{n} = {_show(v)}" for n, v in defaults.items()) + ")"))  # fmt: skip
    if (missed > 0).any():
        handles.append(
            Line2D(
                [], [], color="0.3", marker="o", mfc="white", lw=0, label="hollow: a degraded agent missed"
            )
        )
    if (~defined).any():
        ax.axvspan(never_x - 0.08 * span, never_x + 0.08 * span, color="0.93", zorder=0)
        ax.text(never_x, 0.99, "never\ndetected", transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize=8, color="0.35")  # fmt: skip
    ax.set_xlim(low - 0.08 * span, (never_x + 0.1 * span) if (~defined).any() else high + 0.12 * span)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("detection delay: tasks from the onset of degradation to isolation")
    ax.set_ylabel("false isolations: healthy agents' moves into isolation (per stream)")
    ax.set_title(f"Detection trade-off as {' and '.join(names)} vary\n{dataset}, {len(summary['seeds'])} seeds × "
                 f"{summary['n_tasks']} tasks per grid point; marker labels: {last}; lower left is better",
                 fontsize=10, loc="left")  # fmt: skip
    ax.grid(color="0.9", lw=0.6)
    ax.legend(handles=handles, fontsize=8, frameon=True, framealpha=0.9, edgecolor="0.85", loc="upper right")
    fig.text(0.01, 0.01, "Means over seeds; error bars: one standard error over seeds. Delay: per seed the mean over "
             "the degraded agents that were isolated. False isolations count transitions into isolation "
             "(an agent released by a probe and isolated again counts twice).", fontsize=7, color="0.3",
             wrap=True)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return plots._save(fig, path)


MAP_METRICS = (
    ("detection_delay", "detection delay (tasks)", "{:.0f}", "lower is better"),
    ("false_isolations", "false isolations per stream", "{:.1f}", "lower is better"),
    ("acc_degraded", "accuracy, degraded phase", "{:.3f}", "higher is better"),
    ("tokens_per_task_degraded", "tokens per task, degraded phase (k)", "{:.1f}", "lower is cheaper"),
)


def grid_maps(summary: dict, path: Path, dataset: str | None = None) -> Path:
    """Two swept parameters: one heat map per metric over the grid (first parameter down, second
    across), each cell annotated with its mean over seeds; the defaults' cell outlined."""
    from matplotlib.patches import Rectangle

    from meshheal_jax import plots

    names = list(summary["grid"])
    if len(names) != 2:
        raise MeshHealError("grid maps need exactly two swept parameters")
    rows_name, cols_name = names
    row_values, col_values = summary["grid"][rows_name], summary["grid"][cols_name]
    if dataset is None:
        dataset = summary["results"][0]["dataset"]
    entries = {
        (r["values"][rows_name], r["values"][cols_name]): r
        for r in summary["results"]
        if r["dataset"] == dataset
    }
    defaults = _default_values(names)
    fig = plots._new_figure(4.0 * len(MAP_METRICS), 4.4)
    axes = fig.subplots(1, len(MAP_METRICS))
    for ax, (key, title, form, sense) in zip(axes, MAP_METRICS):
        scale = 1e-3 if key.startswith("tokens") else 1.0
        grid = np.full((len(row_values), len(col_values)), np.nan)
        for a, rv in enumerate(row_values):
            for b, cv in enumerate(col_values):
                stat = entries[(rv, cv)].get(key) if (rv, cv) in entries else None
                if stat and stat.get("mean") is not None:
                    grid[a, b] = stat["mean"] * scale
        cmap = "viridis_r" if sense.startswith("lower") else "viridis"
        image = ax.imshow(grid, cmap=cmap, aspect="auto", origin="lower")
        finite = grid[np.isfinite(grid)]
        middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
        for a in range(len(row_values)):
            for b in range(len(col_values)):
                text = "never" if not np.isfinite(grid[a, b]) else form.format(grid[a, b])
                dark = np.isfinite(grid[a, b]) and ((grid[a, b] > middle) == sense.startswith("lower"))
                ax.text(b, a, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        if len(defaults) == 2 and defaults[rows_name] in row_values and defaults[cols_name] in col_values:
            a, b = row_values.index(defaults[rows_name]), col_values.index(defaults[cols_name])
            ax.add_patch(Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, ec="red", lw=1.6))
        ax.set_xticks(range(len(col_values)), [_show(v) for v in col_values])
        ax.set_yticks(range(len(row_values)), [_show(v) for v in row_values])
        ax.set_xlabel(cols_name)
        ax.set_ylabel(rows_name)
        ax.set_title(f"{title}\n({sense})", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    default_note = " Red outline: the defaults." if len(defaults) == 2 else ""
    fig.suptitle(f"Sweep over {rows_name} × {cols_name}: {dataset}, means over {len(summary['seeds'])} seeds "
                 f"× {summary['n_tasks']} tasks.{default_note}", x=0.01, ha="left", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return plots._save(fig, path)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def experiment(cfg: SweepConfig) -> runner.Experiment:
    if cfg.engine != "jax":
        raise MeshHealError("a sweep runs as one compiled program: only --engine jax")
    if cfg.backend != "emulated":
        raise MeshHealError("a sweep runs on the emulator (one compiled program over the grid); "
                            "run single configurations live with main / recovery / ablate / detectors / scale")  # fmt: skip
    if cfg.checkpoint_every != CHECKPOINT_EVERY_S:
        raise MeshHealError(
            "a sweep takes no --checkpoint-every: it does not resume (it needs a new or empty --out)"
        )
    if live_settings(cfg) is not None:
        raise MeshHealError("a sweep takes no --data, --hub-*, --tokenizer or live settings: its questions count the profile's "
                            "mean tokens (decisions X4); run main / recovery / ... --data for real questions")  # fmt: skip
    return runner.Experiment(
        name="sweep", datasets=tuple(cfg.datasets), pairs=(cfg.pair,), seeds=cfg.seed_tuple(), engine="jax",
        slots=cfg.slots, n_tasks=cfg.tasks, degraded=runner.degraded_or_targets(cfg.degraded, cfg.datasets, cfg.profiles_dir), protocol=cfg.protocol,
        tables=("tasks", "reviews", "states", "calls") if cfg.calls else ("tasks", "reviews", "states"),
        profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir,
    )  # fmt: skip


def prepare_out(out: Path | None) -> Path:
    if out is None:
        out = default_out("sweep")
    if out.exists() and not out.is_dir():
        raise MeshHealError(f"output path {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        raise MeshHealError(
            f"output folder {out} exists and is not empty (a sweep does not resume); choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclasses.dataclass
class SweepResult:
    run_dir: Path
    frames: dict[str, pl.DataFrame]
    summary: dict
    wall_s: float


def run(cfg: SweepConfig, progress: bool = True, argv: Sequence[str] | None = None) -> SweepResult:
    """Run the sweep into a new run folder. `argv` (the command-line arguments, when run from the
    CLI) goes into config.json, so report.md reproduces the command verbatim, less its --out."""
    grid = parse_grid([item for group in cfg.grid for item in group])
    exp = experiment(cfg)
    exp.validate()
    points = grid_points(grid, cfg.protocol, load_pair(cfg.pair, cfg.params_dir))
    batch = build_batch(exp, points)
    sweep_config(batch, cfg.slots)
    if cfg.chunk < 1:
        raise MeshHealError(f"--chunk must be >= 1, got {cfg.chunk}")
    runner.check_lanes(cfg.lanes)
    params = stream_params(batch)
    check_effect(grid, batch, params)
    run_dir = prepare_out(cfg.out)
    config = {runner.RUN_MARKER: True, "experiment": exp.to_json(),
              "sweep": {"grid": {k: list(v) for k, v in grid.items()}, "n_points": len(points),
                        "streams": len(batch.specs), "chunk": cfg.chunk, "calls": cfg.calls,
                        "order": "grid point slowest (first parameter slowest), then dataset, then seed"},
              "versions": runner._versions(), "git_revision": runner._git_revision(),
              "created": datetime.datetime.now().isoformat()}  # fmt: skip
    if argv is not None:
        config["argv"] = list(argv)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    start = time.perf_counter()
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"sweep: {len(points)} grid points, {len(batch.specs)} streams", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(job, total=total, completed=done)

        timings: dict = {}
        per_stream = run_batch(batch, cfg.slots, cfg.chunk, exp.tables, tick, params, timings, cfg.lanes)
    wall = time.perf_counter() - start
    frames = label_frames(batch, grid, per_stream, exp.tables)
    for name, df in frames.items():
        df.write_parquet(run_dir / f"{name}.parquet")
    summary = summarize(exp, grid, points, frames)
    summary["timing_s"] = {"wall": wall, **timings, "device": jax_device()}
    runner.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    write_report(run_dir)
    return SweepResult(run_dir, frames, summary, wall)


def make_plots(run_dir: Path, summary: dict) -> list[tuple[str, Path]]:
    """The sweep's figures (per dataset): the trade-off plot, and grid maps for two parameters."""
    datasets = list(dict.fromkeys(r["dataset"] for r in summary["results"] if r["dataset"] != "mean"))
    figures = []
    for dataset in datasets:
        suffix = "" if len(datasets) == 1 else f"-{dataset}"
        path = tradeoff_plot(summary, run_dir / TRADEOFF_PNG.replace(".png", f"{suffix}.png"), dataset)
        figures.append((f"Detection delay vs false isolations, {dataset}", path))
        if len(summary["grid"]) == 2:
            path = grid_maps(summary, run_dir / MAPS_PNG.replace(".png", f"{suffix}.png"), dataset)
            figures.append((f"Metrics over the grid, {dataset}", path))
    return figures


def summary_rows(summary: dict, dataset: str) -> tuple[list[str], list[list[str]]]:
    """The printed table's header and rows (one per grid point) for one dataset."""
    names = list(summary["grid"])
    headers = ["#", *names, "acc H", "acc D", "detection delay", "missed", "false isol.", "false-isol. agents",
               "tokens/task H (k)", "tokens/task D (k)"]  # fmt: skip
    rows = []
    for r in summary["results"]:
        if r["dataset"] != dataset:
            continue
        delay = r.get("detection_delay")
        delay_text = "—" if not delay or delay["mean"] is None else f"{fmt(delay, 1)} n={delay['n_defined']}"
        onset = r.get("onset_detections")
        if delay_text != "—" and onset and onset.get("mean"):
            delay_text += f" ({fmt(onset, 1)} before onset)"
        rows.append([str(r["grid_point"]), *(_show(r["values"][n]) for n in names), fmt(r["acc_healthy"]),
                     fmt(r["acc_degraded"]), delay_text, fmt(r.get("missed"), 2), fmt(r["false_isolations"], 2),
                     fmt(r.get("false_isolated_agents"), 2), fmt(r["tokens_per_task_healthy"], 1, 1e-3),
                     fmt(r["tokens_per_task_degraded"], 1, 1e-3)])  # fmt: skip
    return headers, rows


def reproduce_commands(config: dict, run_dir: Path) -> list[str]:
    """The sweep's command (verbatim from config.json's argv, else rebuilt from its config), then
    the report's."""
    import shlex

    from meshheal_jax import report

    if config.get("argv"):  # without its --out: a sweep needs a new folder (the report says to add one)
        argv, command = list(map(str, config["argv"])), ["python", "-m", "meshheal_jax.sweep"]
        while argv:
            arg = argv.pop(0)
            if arg == "--out":
                del argv[:1]
            elif not arg.startswith("--out="):
                command.append(arg)
    else:
        exp, sweep = config.get("experiment", {}), config.get("sweep", {})
        command = ["python", "-m", "meshheal_jax.sweep", "--grid",
                   *(f"{k}={','.join(map(_show, v))}" for k, v in sweep.get("grid", {}).items()),
                   *report._common_flags(exp, (exp.get("pairs") or ["default"])[0]),
                   "--datasets", *exp.get("datasets", []), "--tasks", str(exp.get("n_tasks", 504)),
                   "--degraded", *map(str, exp.get("degraded", []))]  # fmt: skip
        if sweep.get("chunk", SweepConfig.chunk) != SweepConfig.chunk:
            command += ["--chunk", str(sweep["chunk"])]
        if sweep.get("calls"):  # older folders did not record it: a rerun then keeps no calls.parquet
            command.append("--calls")
    return [shlex.join(command), shlex.join(["python", "-m", "meshheal_jax.report", str(run_dir)])]


def write_report(run_dir: Path | str) -> Path:
    """report.md of a sweep run folder: the table per grid point, the figures (redrawn from
    summary.json), the commands that reproduce it and the config."""
    from meshheal_jax import report

    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = make_plots(run_dir, summary)
    timing = summary.get("timing_s", {})
    axes = " × ".join(f"{k} ∈ {{{', '.join(map(_show, v))}}}" for k, v in summary["grid"].items())
    where = f" ({timing['device']}, {timing['wall']:.1f} s)." if timing else "."
    lanes = timing.get("lanes", 1)
    programs = f"one compiled program, {lanes} lanes side by side" if lanes > 1 else "one compiled program"
    lines = [
        f"# MeshHeal parameter sweep ({run_dir.name})",
        "",
        (
            f"Grid: {axes} = {summary['n_points']} points; seeds {', '.join(map(str, summary['seeds']))}; "
            f"{summary['n_agents']} agents; {summary['n_tasks']} tasks per stream; {programs}{where}"
        ),
        "",
        (
            "Mean ± sample std over seeds. Detection delay: per seed the mean over the degraded agents that were "
            "isolated, n = seeds with one. False isolations: transitions into isolation of an agent that was "
            "healthy at the time; false-isol. agents: distinct such agents."
        ),
        "",
    ]
    for dataset in dict.fromkeys(r["dataset"] for r in summary["results"]):
        headers, rows = summary_rows(summary, dataset)
        lines += [f"## {dataset}", "", report.md_table(headers, rows), ""]
    for title, path in figures:
        lines += [f"## {title}", "", f"![{title}]({path.name})", ""]
    rerun = (
        "Re-run the sweep (a new run folder under `runs/` with its own report; add `--out DIR` to choose a "
        "new or empty one); the second command regenerates this folder's report:"
    )
    lines += ["## Reproduce", "", rerun, "", "```sh", *reproduce_commands(config, run_dir), "```", ""]
    lines += ["## Config", "", "```json", json.dumps(config, indent=2), "```", ""]
    path = run_dir / report.REPORT_NAME
    runner.write_atomic(path, "\n".join(lines))
    return path


def jax_device() -> str:
    import jax

    from meshheal_jax.engine import usable_cores

    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    if backend == "cpu":
        cores = usable_cores()
        return f"cpu, {cores} core{'s' if cores != 1 else ''}"
    return f"{backend}: {kind}"


def body(cfg: SweepConfig) -> None:
    result = run(cfg, progress=not cfg.quiet, argv=sys.argv[1:])
    print_summary(result.summary)
    summary, timing = result.summary, result.summary["timing_s"]
    streams = len(summary["seeds"]) * len(cfg.datasets) * summary["n_points"]
    setup = timing["wall"] - timing["first_call"] - timing["other_calls"] - timing["records"]
    lanes = timing.get("lanes", 1)
    where = (f"in one compiled program, {lanes} lanes side by side (the slowest lane's seconds per stage)"
             if lanes > 1 else "in one compiled program")  # fmt: skip
    print(f"{summary['n_points']} grid points × {len(cfg.datasets)} dataset(s) × {len(summary['seeds'])} seeds = "
          f"{streams} streams × {summary['n_tasks']} tasks {where} ({timing['device']}): "
          f"{timing['wall']:.1f} s = setup {setup:.1f} s + first call (trace, compile, chunk 1) "
          f"{timing['first_call']:.1f} s + {timing['calls'] - 1} more chunks {timing['other_calls']:.1f} s + "
          f"record tables {timing['records']:.1f} s")  # fmt: skip
    print(f"results: {result.run_dir}")


def cli() -> None:
    entrypoint(SweepConfig, body, __doc__, "stopped: a sweep does not resume; rerun it with a new --out")


if __name__ == "__main__":
    cli()
