"""Why a restored agent is not reintegrated: read a `recovery` run folder's reviews and states and,
per restored agent (pooled over seeds), after its restoration:

- its reviewed outputs, how many scored well (q >= 0.75), and of those with a z how many still
  had z >= alpha (watched) or z >= beta (counted toward isolation);
- how many of its outputs were judged on a (task type, ability) key whose shortfall window could
  still hold degraded-era shortfalls: fewer than W_x outputs on that key since restoration
  (protocol.md §5: the windows are never reset, and each output writes one key's window);
- its transitions to normal and back to isolated.

The same z shares for agents never degraded, over the healthy phase after the warm-up, are the
baseline: how often a well-scored output of a healthy agent reads as a shortfall.

    python scripts/reintegration.py runs/recovery-...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from meshheal_jax.cli import guarded
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.report import experiment_from_config, read_run_folder, read_table


def good_output_z(rows: pl.DataFrame, p: ProtocolParams) -> dict:
    good = rows.filter((pl.col("q") >= 0.75) & pl.col("z").is_not_null())
    n = max(good.height, 1)
    return {
        "outputs": rows.height,
        "q >= 0.75 with z": good.height,
        "of which z >= alpha": f"{(good['z'] >= p.alpha - 1e-9).sum() / n:.2f}",
        "of which z >= beta": f"{(good['z'] >= p.beta - 1e-9).sum() / n:.2f}",
    }


def reintegration(reviews: pl.DataFrame, tasks: pl.DataFrame, states: pl.DataFrame, intervals, p: ProtocolParams,
                  warmup: int) -> pl.DataFrame:  # fmt: skip
    """The table above, from MeshHeal's records; `intervals`: (agent, first degraded task, restored at)."""
    reviews = reviews.join(tasks.select("seed", "t", "task_type"), on=["seed", "t"])
    first_degraded = min(first for _, first, _ in intervals)
    rows = []
    for agent, _, restored in intervals:
        after = reviews.filter((pl.col("author") == agent) & (pl.col("t") >= restored)).sort(
            "seed", "t", "visit"
        )
        seen = after.with_columns(  # outputs on the same key since restoration, this one excluded
            pl.int_range(pl.len()).over("seed", "task_type", "ability").alias("earlier on key")
        )
        moves = states.filter((pl.col("agent") == agent) & (pl.col("t") >= restored))
        rows.append({
            "agents": f"A{agent + 1} (restored at task {restored})",
            **good_output_z(after, p),
            "on a key with < W_x outputs since": f"{(seen['earlier on key'] < p.window_shortfalls).mean():.2f}",
            "to normal": int((moves["to"] == "normal").sum()),
            "back to isolated": int((moves["to"] == "isolated").sum()),
        })  # fmt: skip
    healthy = reviews.filter(
        ~pl.col("author").is_in([a for a, _, _ in intervals])
        & (pl.col("t") > warmup)
        & (pl.col("t") < first_degraded)
    )
    rows.append(
        {"agents": f"never degraded, tasks {warmup + 1}-{first_degraded - 1}", **good_output_z(healthy, p)}
    )
    return pl.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a `python -m meshheal_jax.recovery` run folder")
    args = ap.parse_args()
    experiment = read_run_folder(args.run_dir)[0]["experiment"]  # a finished run folder, or a one-line error
    if experiment.get("name") != "recovery":
        raise MeshHealError(
            f"{args.run_dir} is not a recovery run (its experiment is {experiment.get('name')!r})"
        )
    exp = experiment_from_config(experiment)
    columns = {"reviews": ("method", "seed", "t", "visit", "author", "ability", "q", "z"),
               "tasks": ("method", "seed", "t", "task_type"), "states": ("method", "agent", "t", "to")}  # fmt: skip
    frames = [
        read_table(args.run_dir, name, cols).filter(pl.col("method") == "meshheal")
        for name, cols in columns.items()
    ]
    if not frames[1].height:
        raise MeshHealError(f"{args.run_dir} holds no MeshHeal streams (methods {list(exp.methods)})")
    table = reintegration(
        *frames, exp.schedule().intervals, exp.protocol, exp.protocol.warmup_tasks(exp.n_agents)
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60):
        print(table)


if __name__ == "__main__":
    guarded(main, stopped="stopped")
