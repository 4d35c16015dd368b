"""How long isolations last: read a run folder's MeshHeal states (a `main` or `recovery` run of a
small network, or one variant's folder of an `ablate` run, `OUT/<variant>`) and, per dataset and
pair, pooled over seeds:

- releases: transitions out of isolated (a probe's z < beta);
- agents normal on an average task; healthy agents isolated on an average task, and the share of
  degraded agent-tasks isolated;
- probe reviews, and the share that formed no z (no transition was possible);
- isolation episodes that start while the agent is healthy (false isolations, and re-isolations
  of a restored agent): how many, and their mean and median length in tasks (an episode still
  running at the end of the stream counts to the end);
- unanswered tasks per seed.

Written to compare the detector's window settings (`--protocol.window-reset`, decisions P7):

    python scripts/isolation_episodes.py runs/recovery-...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl

from meshheal_jax import metrics
from meshheal_jax.cli import guarded
from meshheal_jax.errors import MeshHealError
from meshheal_jax.report import experiment_from_config, read_run_folder, read_table
from meshheal_jax.streams import HealthSchedule

MAX_CELLS = 5_000_000  # tasks x agents per stream: the state matrix holds one string per cell


def episodes(isolated: np.ndarray) -> list[tuple[int, int, int]]:
    """(agent, first task, length) of every run of isolated tasks; `isolated` is (tasks, agents)
    with row k = the end of task k + 1."""
    out = []
    for agent in range(isolated.shape[1]):
        edges = np.diff(np.concatenate([[0], isolated[:, agent].astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        out += [(agent, int(s) + 1, int(e - s)) for s, e in zip(starts, ends)]
    return out


def isolation_episodes(
    states: pl.DataFrame, tasks: pl.DataFrame, reviews: pl.DataFrame, schedule: HealthSchedule
) -> dict:
    """The figures above for one (dataset, pair): `states`, `tasks` and `reviews` of its seeds."""
    n, n_agents = schedule.n_tasks, schedule.n_agents
    during = schedule.degraded_matrix()  # row t: who is degraded during task t
    degraded = during[1:]  # aligned with the state matrix's rows (the end of task 1, 2, ...)
    seeds = sorted(tasks["seed"].unique().to_list())
    lengths, normal, healthy_isolated, degraded_isolated, releases = [], [], [], [], 0
    for seed in seeds:
        mine = states.filter(pl.col("seed") == seed)
        matrix = metrics.state_matrix(mine, n_agents, n)[1:]
        isolated = matrix == "isolated"
        normal.append((matrix == "normal").sum(axis=1).mean())
        releases += mine.filter(pl.col("from") == "isolated").height
        healthy_isolated.append((isolated & ~degraded).sum(axis=1).mean())
        if degraded.any():
            degraded_isolated.append((isolated & degraded).sum() / degraded.sum())
        lengths += [length for agent, first, length in episodes(isolated) if not during[first, agent]]
    lengths = np.array(lengths, dtype=float)
    probes = reviews.filter(pl.col("probe"))
    return {
        "seeds": len(seeds),
        "releases": releases,
        "normal agents per task": round(float(np.mean(normal)), 2),
        "healthy agents isolated per task": round(float(np.mean(healthy_isolated)), 2),
        "degraded agent-tasks isolated": round(float(np.mean(degraded_isolated)), 2)
        if degraded_isolated
        else None,
        "isolations of healthy agents": len(lengths),
        "mean length": round(float(lengths.mean()), 1) if len(lengths) else None,
        "median length": float(np.median(lengths)) if len(lengths) else None,
        "unanswered per seed": round(float((~tasks["answered"]).sum() / len(seeds)), 1),
        "probe reviews": probes.height,
        "of which no z": round(float(probes["z"].is_null().mean()), 2) if probes.height else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "run_dir", type=Path, help="a main or recovery run folder, or an ablate run's OUT/<variant>"
    )
    args = ap.parse_args()
    experiment = read_run_folder(args.run_dir)[0]["experiment"]  # a finished run folder, or a one-line error
    exp = experiment_from_config(experiment)
    if exp.n_agents * exp.n_tasks > MAX_CELLS:
        raise MeshHealError(f"{args.run_dir}: {exp.n_agents} agents x {exp.n_tasks} tasks is too large for a state "
                            f"matrix per stream (at most {MAX_CELLS:,} cells)")  # fmt: skip
    columns = {"states": ("dataset", "pair", "seed", "agent", "t", "from", "to"),
               "tasks": ("dataset", "pair", "seed", "t", "answered"), "reviews": ("dataset", "pair", "probe", "z")}  # fmt: skip
    frames = [read_table(args.run_dir, name, cols) for name, cols in columns.items()]
    if experiment.get("name") == "sweep":  # its grid points would be pooled as one stream
        raise MeshHealError(
            f"{args.run_dir} is a sweep run: give a main or recovery run, or an ablate run's OUT/<variant>"
        )
    if "method" in frames[1].columns:
        frames = [df.filter(pl.col("method") == "meshheal") for df in frames]
    if not frames[1].height:
        raise MeshHealError(f"{args.run_dir} holds no MeshHeal streams (methods {list(exp.methods)})")
    rows = []
    for (dataset, pair), _ in frames[1].group_by("dataset", "pair", maintain_order=True):
        states, tasks, reviews = (df.filter((pl.col("dataset") == dataset) & (pl.col("pair") == pair))
                                  for df in frames)  # fmt: skip
        rows.append(
            {"dataset": dataset, "pair": pair, **isolation_episodes(states, tasks, reviews, exp.schedule())}
        )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=220, fmt_str_lengths=40):
        print(pl.DataFrame(rows))


if __name__ == "__main__":
    guarded(main, stopped="stopped")
