"""Count the streams of a run folder whose network stopped answering: per phase (as numbered in
the tasks table) and group (a sweep's grid point, else method and pair), the streams that answered
fewer than `--answered` of their tasks (unreachable abilities after false isolations) and those
below `--accuracy`.

    python scripts/stream_collapses.py runs/sweep-...        # a sweep, a main or a recovery run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from meshheal_jax.cli import guarded
from meshheal_jax.metrics import LABELS
from meshheal_jax.report import read_run_folder, read_table


def collapses(tasks: pl.DataFrame, answered: float, accuracy: float) -> pl.DataFrame:
    swept = "grid_point" in tasks.columns
    group = ["grid_point"] if swept else [c for c in ("method", "pair") if c in tasks.columns]
    params = tasks.columns[tasks.columns.index("grid_point") + 1 :] if swept else []  # swept values
    stream = [c for c in LABELS if c in tasks.columns]  # a stream: method, dataset, pair, seed
    per_stream = tasks.group_by(list(dict.fromkeys([*group, *params, *stream, "phase"]))).agg(
        pl.col("answered").mean().alias("answered"), pl.col("correct").mean().alias("accuracy")
    )
    return (
        per_stream.group_by([*group, *params, "phase"])
        .agg(
            pl.len().alias("streams"),
            (pl.col("answered") < answered).sum().alias(f"answered < {answered}"),
            (pl.col("accuracy") < accuracy).sum().alias(f"accuracy < {accuracy}"),
            pl.col("answered").min().alias("min answered"),
            pl.col("accuracy").min().alias("min accuracy"),
        )
        .sort([*group, "phase"])
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--answered", type=float, default=0.95)
    parser.add_argument("--accuracy", type=float, default=0.7)
    args = parser.parse_args()
    read_run_folder(args.run_dir)  # a finished run folder (a sweep's too), or a one-line error
    tasks = read_table(args.run_dir, "tasks", ("phase", "answered", "correct"))
    table = collapses(tasks, args.answered, args.accuracy)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True):
        print(table)


if __name__ == "__main__":
    guarded(main, stopped="stopped")
