"""Figures of a run (spec/experiments.md §2, §3): pure functions, frames in, a PNG path out.

Every function takes polars frames (the SCHEMAS of `metrics.py`) or summary entries and a path,
writes one PNG there and returns the path. Figures are built on `matplotlib.figure.Figure` with
the Agg canvas, so nothing touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from meshheal_jax.errors import MeshHealError
from meshheal_jax.metrics import agent_label, state_matrix
from meshheal_jax.streams import HealthSchedule

STATES = ("normal", "watched", "isolated")
STATE_COLORS = {"normal": "#0072B2", "watched": "#E69F00", "isolated": "#C0392B"}  # Okabe-Ito-like
DEGRADED_SHADE = "#8c8c8c"
PEER_BAND = "#7fbf7f"
TOPOLOGY_COLORS = {"complete": "#0072B2", "sparse": "#D55E00"}
METHOD_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
SCORE_JITTER = 0.025  # vertical jitter of trajectory markers: q takes few distinct values
MAX_GAP = 30  # tasks without an output after which the rolling-mean line is broken
DPI = 150


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def _single(frame: pl.DataFrame, column: str, given: str | None, what: str) -> str | None:
    """The one value of a label column (dataset, pair, method) unless the caller picked one."""
    if given is not None or frame.height == 0:
        return given
    values = frame[column].unique().to_list()
    if len(values) > 1:
        raise MeshHealError(
            f"the frames hold several {what}s {sorted(values)}; pass {column}=... to pick one"
        )
    return values[0]


def _pick(frame: pl.DataFrame, **labels) -> pl.DataFrame:
    for column, value in labels.items():
        if value is not None:
            frame = frame.filter(pl.col(column) == value)
    return frame


def _runs(values: np.ndarray) -> list[tuple[int, int, str]]:
    """Maximal runs of equal values: (first index, length, value)."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i - start, values[start]))
            start = i
    return out


def _rolling_by_task(t: np.ndarray, q: np.ndarray, n_tasks: int, window: int) -> np.ndarray:
    """(n_tasks,) mean q of the last `window` outputs up to task t (outputs sorted by t); NaN before any."""
    rolling = pl.Series(q, dtype=pl.Float64).rolling_mean(window_size=window, min_samples=1).to_numpy()
    last = np.searchsorted(t, np.arange(1, n_tasks + 1), side="right") - 1  # last output at or before t
    return np.where(last >= 0, rolling[np.maximum(last, 0)], np.nan)


def _peer_band(
    reviews: pl.DataFrame, agent: int, degraded_at: np.ndarray, n_tasks: int, window: int
) -> np.ndarray:
    """(n_tasks, 2): 25th/75th percentile over the healthy peers of their rolling mean q at task t.

    A peer is any other agent not degraded at t (schedule) with at least one output up to t;
    NaN where fewer than two peers qualify.
    """
    curves = []
    for peer in range(degraded_at.shape[1]):
        if peer == agent:
            continue
        own = reviews.filter(pl.col("author") == peer).sort("t", "visit")
        if own.height == 0:
            continue
        curve = _rolling_by_task(own["t"].to_numpy(), own["q"].to_numpy(), n_tasks, window)
        curves.append(np.where(degraded_at[1:, peer], np.nan, curve))
    band = np.full((n_tasks, 2), np.nan)
    if not curves:
        return band
    stacked = np.stack(curves)  # (peers, n_tasks)
    enough = (~np.isnan(stacked)).sum(axis=0) >= 2
    if enough.any():
        band[enough] = np.nanpercentile(stacked[:, enough], [25, 75], axis=0).T
    return band


def recovery_trajectory(
    reviews: pl.DataFrame,
    states: pl.DataFrame,
    tasks: pl.DataFrame,
    schedule_info: HealthSchedule,
    seed: int,
    path: Path | str,
    *,
    phase_names: Sequence[str] | None = None,
    dataset: str | None = None,
    pair: str | None = None,
    method: str | None = None,
    window: int = 8,
) -> Path:
    """One seed's self-healing: one panel per agent the health schedule degrades.

    Per panel (x: task t, y: final score q of a reviewed output):
    - every reviewed output of that agent as a marker at (t, q), coloured by the author's state
      AFTER the update (`state_after`); probe outputs hollow; markers are jittered by
      ±SCORE_JITTER in q because q takes few distinct values;
    - grey shading where the schedule degrades the agent (ground truth, unseen by the protocol);
    - the agent's rolling mean q over its last `window` reviewed outputs (broken where it has
      had no output for more than MAX_GAP tasks);
    - the peers' reference range: at each task, the 25–75% range over the other agents not
      degraded at that time of their own rolling mean q (same window), i.e. where the black line
      would sit for a healthy agent;
    - dotted lines at phase starts (first t of each `phase` value in tasks), named from
      `phase_names`;
    - a strip under the panel with the agent's state at the end of every task (from states).

    The frames may hold several seeds / datasets / pairs / methods: `seed` is picked; the other
    labels must be unique in that seed or be picked with the keyword arguments.
    """
    schedule = schedule_info
    if not schedule.intervals:
        raise MeshHealError("the health schedule degrades no agent: no trajectory to draw")
    labels = {}
    for column, given in (("dataset", dataset), ("pair", pair), ("method", method)):
        labels[column] = _single(_pick(tasks, seed=seed), column, given, column)
    reviews = _pick(reviews, seed=seed, **labels)
    states = _pick(states, seed=seed, **labels)
    tasks = _pick(tasks, seed=seed, **labels)
    if tasks.height == 0:
        picked = ", ".join(f"{k}={v}" for k, v in labels.items() if v is not None)
        raise MeshHealError(f"no tasks for seed {seed}" + (f" ({picked})" if picked else ""))
    n_tasks, n_agents = schedule.n_tasks, schedule.n_agents
    matrix = state_matrix(states, n_agents, n_tasks)  # (n_tasks + 1, n_agents) state at the end of t
    degraded_at = schedule.degraded_matrix()  # (n_tasks + 1, n_agents) bool
    intervals = {agent: (begin, end) for agent, begin, end in schedule.intervals}
    degraded_agents = sorted(intervals)
    firsts = tasks.group_by("phase").agg(pl.col("t").min()).sort("phase")
    phase_starts = [(int(p), int(t)) for p, t in firsts.iter_rows()]
    jitter = np.random.default_rng(seed).uniform(-SCORE_JITTER, SCORE_JITTER, size=reviews.height)
    reviews = reviews.with_columns(pl.Series("q_plot", reviews["q"].to_numpy() + jitter))
    t_axis = np.arange(1, n_tasks + 1)

    n_panels = len(degraded_agents)
    top_in, bottom_in, panel_in = 1.55, 0.6, 3.2  # inches: title + legends, x label, one panel
    height = top_in + bottom_in + panel_in * n_panels
    ratios = [r for _ in degraded_agents for r in (4.0, 0.45, 1.05)][:-1]  # panel, strip, gap
    fig = _new_figure(13.0, height)
    grid = fig.add_gridspec(
        len(ratios),
        1,
        height_ratios=ratios,
        hspace=0.0,
        left=0.07,
        right=0.985,
        top=1 - top_in / height,
        bottom=bottom_in / height,
    )
    first_ax = strip = None
    for k, agent in enumerate(degraded_agents):
        ax = fig.add_subplot(grid[3 * k], sharex=first_ax)
        strip = fig.add_subplot(grid[3 * k + 1], sharex=ax)
        first_ax = first_ax or ax
        begin, end = intervals[agent]
        for axis in (ax, strip):
            axis.axvspan(begin - 0.5, end - 0.5, color=DEGRADED_SHADE, alpha=0.2, lw=0, zorder=0)
            for _, start in phase_starts[1:]:
                axis.axvline(start - 0.5, color="0.3", lw=0.9, ls=":", zorder=1)
        band = _peer_band(reviews, agent, degraded_at, n_tasks, window)
        ax.fill_between(
            t_axis, band[:, 0], band[:, 1], step="mid", color=PEER_BAND, alpha=0.45, lw=0, zorder=1
        )
        for edge in (band[:, 0], band[:, 1]):  # edges keep a zero-width band (all peers agree) visible
            ax.plot(t_axis, edge, drawstyle="steps-mid", color=PEER_BAND, lw=0.7, alpha=0.9, zorder=1)
        own = reviews.filter(pl.col("author") == agent).sort("t", "visit")
        for state in STATES:
            mine = own.filter(pl.col("state_after") == state)
            plain, probe = mine.filter(~pl.col("probe")), mine.filter(pl.col("probe"))
            ax.scatter(
                plain["t"], plain["q_plot"], s=16, color=STATE_COLORS[state], lw=0, alpha=0.9, zorder=3
            )
            ax.scatter(
                probe["t"],
                probe["q_plot"],
                s=44,
                facecolors="none",
                edgecolors=STATE_COLORS[state],
                lw=1.3,
                zorder=4,
            )
        if own.height:
            t_own = own["t"].to_numpy()
            rolling = own["q"].rolling_mean(window_size=window, min_samples=1).to_numpy()
            t_line = np.append(t_own, np.minimum(t_own[-1] + MAX_GAP, n_tasks))  # hold the last value a while
            rolling = np.append(rolling, rolling[-1])
            gaps = np.flatnonzero(np.diff(t_line) > MAX_GAP)  # no output for a long stretch: break the line
            for g in gaps[::-1]:
                t_line = np.insert(t_line, g + 1, [t_line[g] + MAX_GAP, t_line[g] + MAX_GAP])
                rolling = np.insert(rolling, g + 1, [rolling[g], np.nan])
            ax.plot(t_line, rolling, color="black", lw=1.4, drawstyle="steps-post", zorder=5)
        ax.set_ylim(-0.08, 1.08)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_ylabel("final score q")
        ax.grid(axis="y", color="0.9", lw=0.6, zorder=0)
        ax.tick_params(axis="x", labelbottom=False)
        end_text = f"{end - 1}" if end <= n_tasks else f"{n_tasks} (end)"
        n_probes = int(own["probe"].sum()) if own.height else 0
        isolated_tasks = int((matrix[1:, agent] == "isolated").sum())
        title = (
            f"{agent_label(agent)}: degraded in tasks {begin}–{end_text}; {own.height} reviewed outputs "
            f"({n_probes} probes); isolated at the end of {isolated_tasks} of {n_tasks} tasks"
        )
        has_names = phase_names is not None and len(phase_names) > 0
        ax.set_title(title, loc="left", fontsize=10, pad=15 if has_names else 5)
        if has_names:
            bounds = [t for _, t in phase_starts] + [n_tasks + 1]
            for (p, start), stop in zip(phase_starts, bounds[1:]):
                if p < len(phase_names):
                    ax.text(
                        (start + stop - 1) / 2,
                        1.012,
                        phase_names[p],
                        transform=ax.get_xaxis_transform(),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        color="0.3",
                    )
        for start, length, state in _runs(matrix[1:, agent]):
            strip.broken_barh([(start + 0.5, length)], (0, 1), color=STATE_COLORS[state], lw=0, zorder=2)
        strip.set_ylim(0, 1)
        strip.set_yticks([0.5], ["state"])
        strip.tick_params(axis="y", length=0)
        strip.tick_params(axis="x", labelbottom=k == n_panels - 1)
    first_ax.set_xlim(0.5 - 0.005 * n_tasks, n_tasks + 0.5 + 0.005 * n_tasks)  # room for edge markers
    strip.set_xlabel("task t")

    state_handles = [Line2D([], [], ls="", marker="s", ms=8, color=STATE_COLORS[s], label=s) for s in STATES]
    other_handles = [
        Line2D([], [], ls="", marker="o", ms=5, color="0.35", label="reviewed output"),
        Line2D([], [], ls="", marker="o", ms=7, mfc="none", mec="0.35", mew=1.3, label="probe output"),
        Line2D([], [], color="black", lw=1.4, label=f"rolling mean q (last {window} outputs)"),
        Patch(color=PEER_BAND, alpha=0.6, label="healthy peers' rolling mean q, 25–75%"),
        Patch(color=DEGRADED_SHADE, alpha=0.4, label="degraded (schedule, ground truth)"),
        Line2D([], [], color="0.3", lw=0.9, ls=":", label="phase start"),
    ]
    where = ", ".join(f"{k} {v}" for k, v in labels.items() if v is not None)
    fig.suptitle(
        f"Recovery trajectory, seed {seed}" + (f" ({where})" if where else ""),
        x=0.07,
        ha="left",
        y=1 - 0.1 / height,
        fontsize=12,
    )
    legend_top = 1 - 0.45 / height
    states_legend = fig.legend(
        handles=state_handles,
        loc="upper left",
        bbox_to_anchor=(0.065, legend_top),
        ncol=3,
        fontsize=8,
        frameon=False,
        title="state after the update (markers and strip)",
        title_fontsize=8,
        alignment="left",
        columnspacing=1.2,
        handletextpad=0.3,
    )
    fig.add_artist(states_legend)
    fig.legend(
        handles=other_handles,
        loc="upper left",
        bbox_to_anchor=(0.33, legend_top),
        ncol=3,
        fontsize=8,
        frameon=False,
        columnspacing=1.5,
    )
    fig.text(
        0.985,
        0.08 / height,
        f"markers jittered ±{SCORE_JITTER} in q; strip: state at the end of each task",
        ha="right",
        va="bottom",
        fontsize=7,
        color="0.4",
    )
    return _save(fig, path)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else math.nan


def phase_accuracy_bars(tasks: pl.DataFrame, path: Path | str, phases: Sequence[str] | None = None) -> Path:
    """Per-phase accuracy, one bar per method present in `method` (per pair if several pairs).

    Accuracy of a phase = mean of `correct` over its tasks, per stream; bars are the mean over
    seeds and error bars the sample std over seeds (none with one seed). One panel per dataset,
    and with several datasets a last panel with the mean over datasets computed within seed.
    `phases` names the values of the `phase` column in order (default "phase k").
    """
    if tasks.height == 0:
        raise MeshHealError("no tasks to plot")
    several_pairs = tasks["pair"].n_unique() > 1
    per_stream = (
        tasks.group_by("method", "dataset", "pair", "seed", "phase")
        .agg(pl.col("correct").cast(pl.Float64).mean().alias("acc"))
        .with_columns(
            (pl.col("method") + " (" + pl.col("pair") + ")" if several_pairs else pl.col("method")).alias(
                "group"
            )
        )
    )
    datasets = sorted(per_stream["dataset"].unique().to_list())
    panels = [(d, per_stream.filter(pl.col("dataset") == d)) for d in datasets]
    if len(datasets) > 1:
        within_seed = (
            per_stream.group_by("group", "seed", "phase")
            .agg(pl.col("acc").mean(), pl.col("dataset").n_unique().alias("n"))
            .filter(pl.col("n") == len(datasets))
        )
        panels.append(("mean over datasets", within_seed))
    groups = sorted(per_stream["group"].unique().to_list(), key=lambda g: (not g.startswith("meshheal"), g))
    phase_ids = sorted(per_stream["phase"].unique().to_list())
    names = [phases[p] if phases is not None and p < len(phases) else f"phase {p}" for p in phase_ids]
    n_seeds = per_stream["seed"].n_unique()

    width_per_panel = max(3.2, 0.55 + len(phase_ids) * (0.35 + 0.28 * len(groups)))
    fig = _new_figure(min(0.9 + width_per_panel * len(panels), 22.0), 5.0)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    bar_width = 0.8 / len(groups)
    x = np.arange(len(phase_ids))
    annotate = len(groups) <= 3
    for ax, (title, frame) in zip(axes, panels):
        for g, group in enumerate(groups):
            means, stds = [], []
            for p in phase_ids:
                cell = frame.filter((pl.col("group") == group) & (pl.col("phase") == p))["acc"].to_list()
                m, s = _mean_std(cell)
                means.append(m)
                stds.append(s)
            offset = (g - (len(groups) - 1) / 2) * bar_width
            color = METHOD_COLORS[g % len(METHOD_COLORS)]
            errs = np.nan_to_num(np.asarray(stds), nan=0.0)
            ax.bar(
                x + offset,
                means,
                bar_width * 0.92,
                color=color,
                label=group,
                zorder=2,
                yerr=errs if n_seeds > 1 else None,
                capsize=3,
                error_kw={"lw": 1, "ecolor": "0.2"},
            )
            if annotate:
                for xi, m, s in zip(x + offset, means, errs):
                    if not math.isnan(m):
                        ax.text(
                            xi,
                            m + s + 0.02,
                            f"{m:.2f}",
                            ha="center",
                            va="bottom",
                            fontsize=7,
                            rotation=90 if len(groups) > 1 else 0,
                        )
        ax.set_xticks(x, [textwrap.fill(n, 13) for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", color="0.9", lw=0.6, zorder=0)
        ax.set_ylim(0, 1.12)
        ax.set_xlabel("phase")
    axes[0].set_ylabel("accuracy (fraction of tasks correct)")
    seeds_text = f"mean ± sample std over {n_seeds} seeds" if n_seeds > 1 else "1 seed (no error bars)"
    fig.suptitle(f"Accuracy per phase: {seeds_text}", x=0.01, ha="left", fontsize=11)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="lower center",
        ncol=min(len(groups), 6),
        fontsize=8,
        frameon=False,
        title="method",
        title_fontsize=8,
        alignment="center",
    )
    legend_rows = 1 + (len(groups) - 1) // 6
    fig.tight_layout(rect=(0, (0.35 + 0.22 * legend_rows) / fig.get_figheight(), 1, 0.97))
    return _save(fig, path)


_ALIASES = {"acc_h": "acc_healthy", "acc_d": "acc_degraded"}


def _value(entry: Mapping, key: str) -> tuple[float, float]:
    """(mean, std) of an entry field given as a number or a stat dict {mean, std, ...}."""
    value = entry.get(key, entry.get(_ALIASES.get(key, ""), None))
    if value is None:
        return math.nan, math.nan
    if isinstance(value, Mapping):
        mean, std = value.get("mean"), value.get("std")
        return (math.nan if mean is None else float(mean)), (math.nan if std is None else float(std))
    return float(value), math.nan


def _degraded_count(entry: Mapping) -> float:
    """A scaling entry's degraded agents: `degraded`, else `n_degraded`, else n_agents // 3 (0 kept)."""
    for key in ("degraded", "n_degraded"):
        if entry.get(key) is not None:
            return float(entry[key])
    return float(int(entry["n_agents"]) // 3)


def scaling_plot(summary_entries: Sequence[Mapping], path: Path | str) -> Path:
    """Accuracy and detection vs network size, complete vs sparse graph (spec/experiments.md §3).

    One entry per (n_agents, topology) run; keys (a number, or a stat dict {"mean", "std", ...}
    as in summary.json, where error bars are drawn from "std"):
    - `n_agents` (int, required): agents in the network;
    - `topology` (str, required): "complete" or "sparse" (any other name gets its own line);
    - `acc_h`, `acc_d`: accuracy in the healthy / degraded phase (`acc_healthy`/`acc_degraded`
      are accepted too);
    - `isolated_degraded`: degraded agents isolated at the end of the stream (count);
    - `degraded` (int; `n_degraded` is accepted too): degraded agents (default n_agents // 3), so
      the plot shows the fraction `isolated_degraded / degraded` (none drawn where it is 0);
    - optional `false_isolations`: isolations of healthy agents (transitions to isolated, as
      in summary.json); drawn in a third panel when any entry has it.
    """
    if not summary_entries:
        raise MeshHealError("no scaling entries to plot")
    for entry in summary_entries:
        if "n_agents" not in entry or "topology" not in entry:
            raise MeshHealError(f"a scaling entry needs n_agents and topology, got keys {sorted(entry)}")
    with_false = any("false_isolations" in e for e in summary_entries)
    fig = _new_figure(14.0 if with_false else 10.0, 4.4)
    axes = fig.subplots(1, 3 if with_false else 2, squeeze=False)[0]
    topologies = sorted({str(e["topology"]) for e in summary_entries}, key=lambda s: (s != "complete", s))
    sizes = sorted({int(e["n_agents"]) for e in summary_entries})
    for k, topology in enumerate(topologies):
        color = TOPOLOGY_COLORS.get(topology, METHOD_COLORS[(k + 2) % len(METHOD_COLORS)])
        # later topologies are drawn thinner and hollow on top, so coinciding lines stay visible
        style = {
            "color": color,
            "capsize": 3,
            "lw": 2.4 - 0.9 * min(k, 1),
            "ms": 7 - 2 * min(k, 1),
            "mfc": color if k == 0 else "white",
            "mew": 1.4,
            "zorder": 3 + k,
        }
        rows = sorted(
            (e for e in summary_entries if str(e["topology"]) == topology), key=lambda e: int(e["n_agents"])
        )
        n = np.array([int(e["n_agents"]) for e in rows])
        for key, ls, marker, phase in (("acc_h", "-", "o", "healthy"), ("acc_d", "--", "s", "degraded")):
            m, s = np.array([_value(e, key) for e in rows]).T
            axes[0].errorbar(
                n, m, yerr=np.nan_to_num(s), ls=ls, marker=marker, label=f"{topology}, {phase} phase", **style
            )
        iso = np.array([_value(e, "isolated_degraded") for e in rows])
        n_deg = np.array([_degraded_count(e) for e in rows])
        n_deg[n_deg == 0] = np.nan  # no degraded agent: no fraction to draw
        axes[1].errorbar(
            n, iso[:, 0] / n_deg, yerr=np.nan_to_num(iso[:, 1] / n_deg), marker="o", label=topology, **style
        )
        if with_false:
            fi = np.array([_value(e, "false_isolations") for e in rows])
            axes[2].errorbar(n, fi[:, 0], yerr=np.nan_to_num(fi[:, 1]), marker="o", label=topology, **style)
    titles = ("Accuracy", "Degraded agents isolated at the end", "False isolations")
    ylabels = (
        "accuracy (fraction of tasks correct)",
        "isolated / degraded agents (fraction)",
        "isolations of healthy agents (count)",
    )
    for ax, title, ylabel in zip(axes, titles, ylabels):
        if len(sizes) > 1 and sizes[-1] / max(sizes[0], 1) >= 8:
            ax.set_xscale("log")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("agents in the network")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(color="0.9", lw=0.6)
        ax.legend(fontsize=8, frameon=False)
    low, high = axes[0].get_ylim()
    axes[0].set_ylim(max(0.0, low - 0.05), min(1.02, high + 0.05))
    axes[1].set_ylim(-0.02, 1.05)
    if with_false:
        axes[2].set_ylim(bottom=0)
    fig.suptitle(
        "Network scaling: complete vs sparse graph (error bars: sample std over seeds)",
        x=0.01,
        ha="left",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, path)
