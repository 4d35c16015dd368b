"""`python -m meshheal_jax.recovery`: staggered degradation and recovery (spec/experiments.md §2).

MATH, 630 tasks in five phases of 126: healthy; A5 degraded; A3 and A5 degraded; A3 degraded and
A5 restored; both restored. Prints per-phase accuracy and tokens, per degraded agent the detection
delay, closure and reintegration delay, and the state changes of one representative seed.
"""

from __future__ import annotations

import dataclasses

import polars as pl

from meshheal_jax import runner
from meshheal_jax.cli import CommonFlags, entrypoint, fmt, fmt_range, new_table, print_table


@dataclasses.dataclass(frozen=True)
class RecoveryConfig(CommonFlags):
    dataset: str = "math"
    """dataset (profile) of the recovery stream"""
    tasks: int = 630
    """stream length: five equal phases (multiple of 210)"""
    show_seed: int | None = None
    """seed whose state changes are printed (default: the first)"""


def experiment(cfg: RecoveryConfig) -> runner.Experiment:
    return runner.Experiment(
        name="recovery", datasets=(cfg.dataset,), pairs=(cfg.pair,), seeds=cfg.seed_tuple(),
        engine=cfg.engine, slots=cfg.slots, n_tasks=cfg.tasks, protocol=cfg.protocol,
        profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir,
    )  # fmt: skip


def print_summary(summary: dict, states: pl.DataFrame, seed: int) -> None:
    for r in summary["results"]:
        table = new_table(
            f"MeshHeal, staggered degradation and recovery: {r['dataset']}, pair {r['pair']} "
            f"({summary['engine']} engine, {len(r['seeds'])} seeds)",
            "phase", "tasks", "accuracy", "calls/task", "tokens/task (k)",
        )  # fmt: skip
        n = summary["n_tasks"] // len(r["phases"])
        for k, ph in enumerate(r["phases"]):
            table.add_row(ph["name"], f"{k * n + 1}–{(k + 1) * n}", fmt(ph["acc"]), fmt(ph["calls_per_task"], 1),
                          fmt(ph["tokens_per_task"], 1, 1e-3))  # fmt: skip
        print_table(table)
        agents = new_table(
            "Self-healing per degraded agent: mean ± std (min–max) n=seeds where defined",
            "agent", "degraded", "detection delay", "closure", "reintegration delay",
        )  # fmt: skip
        for a in r["agents"]:
            end = a["recovered_at"] - 1 if a["recovered_at"] else summary["n_tasks"]
            agents.add_row(str(a["agent"]), f"{a['degraded_at']}–{end}", fmt_range(a["detection_delay"]),
                           f"{a['closure_seeds']}/{len(r['seeds'])} seeds", fmt_range(a["reintegration_delay"]))  # fmt: skip
        print_table(agents)
        print(f"false isolations of healthy agents: {fmt(r['false_isolations'], 2)} transitions, "
              f"{fmt(r['false_isolated_agents'], 2)} agents; missed: {fmt(r['missed'], 2)}")  # fmt: skip
        changes = states.filter((pl.col("seed") == seed) & (pl.col("dataset") == r["dataset"]) & (pl.col("pair") == r["pair"]))
        table = new_table(f"State changes, seed {seed}", "t", "agent", "from", "to", "z", "reason", "probe", "degraded")
        for row in changes.iter_rows(named=True):
            z = "—" if row["z"] is None else f"{row['z']:.2f}"
            table.add_row(str(row["t"]), str(row["agent"]), row["from"], row["to"], z, row["reason"],
                          "yes" if row["probe"] else "", "yes" if row["degraded"] else "")  # fmt: skip
        print_table(table)


def body(cfg: RecoveryConfig) -> None:
    results = runner.run(experiment(cfg), cfg.out, progress=not cfg.quiet)
    seed = cfg.show_seed if cfg.show_seed is not None else cfg.seed_tuple()[0]
    print_summary(results.summary, results.states, seed)
    print(f"results: {results.run_dir}")


def cli() -> None:
    entrypoint(RecoveryConfig, body, __doc__)


if __name__ == "__main__":
    cli()
