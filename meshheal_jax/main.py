"""`python -m meshheal_jax.main`: persistent degradation (spec/experiments.md §1).

6 agents, complete graph; A3 and A5 (agents 2 and 4) degraded from task 253 of 504; per dataset
and mean: accuracy H / D, the paired phase change, calls and tokens per task, detection.
"""

from __future__ import annotations

import dataclasses

from meshheal_jax import runner
from meshheal_jax.cli import CommonFlags, entrypoint, fmt, fmt_range, new_table, print_table


@dataclasses.dataclass(frozen=True)
class MainConfig(CommonFlags):
    datasets: tuple[str, ...] = ("bbh", "math", "mmlu_pro")
    """datasets (profiles) to run"""
    tasks: int = 504
    """stream length (multiple of 42); degradation starts at the midpoint"""
    degraded: tuple[int, ...] = (2, 4)
    """agents (0-based) degraded from the midpoint"""


def experiment(cfg: MainConfig) -> runner.Experiment:
    return runner.Experiment(
        name="main", datasets=tuple(cfg.datasets), pairs=(cfg.pair,), seeds=cfg.seed_tuple(),
        engine=cfg.engine, slots=cfg.slots, n_tasks=cfg.tasks, degraded=tuple(cfg.degraded), protocol=cfg.protocol,
        profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir,
    )  # fmt: skip


def print_summary(summary: dict) -> None:
    results = summary["results"]
    table = new_table(
        f"MeshHeal, persistent degradation ({summary['engine']} engine, {summary['backend']} backend)",
        "dataset", "pair", "acc H", "acc D", "D − H", "calls H", "calls D", "tokens H (k)", "tokens D (k)",
    )  # fmt: skip
    for r in results:
        table.add_row(
            r["dataset"], r["pair"], fmt(r["acc_healthy"]), fmt(r["acc_degraded"]), fmt(r["phase_change"]),
            fmt(r["calls_per_task_healthy"], 1), fmt(r["calls_per_task_degraded"], 1),
            fmt(r["tokens_per_task_healthy"], 1, 1e-3), fmt(r["tokens_per_task_degraded"], 1, 1e-3),
        )  # fmt: skip
    print_table(table)
    detect = new_table("Detection: delay in tasks after degradation, mean ± std (min–max) n=seeds where detected",
                       "dataset", "agent", "detection delay", "closure seeds", "missed", "false isolations")  # fmt: skip
    for r in results:
        for a in r.get("agents", []):
            detect.add_row(r["dataset"], str(a["agent"]), fmt_range(a["detection_delay"]),
                           f"{a['closure_seeds']}/{len(r['seeds'])}", fmt(r["missed"], 2),
                           fmt(r["false_isolations"], 2))  # fmt: skip
    print_table(detect)


def body(cfg: MainConfig) -> None:
    results = runner.run(experiment(cfg), cfg.out, progress=not cfg.quiet)
    print_summary(results.summary)
    print(f"results: {results.run_dir}")


def cli() -> None:
    entrypoint(MainConfig, body, __doc__)


if __name__ == "__main__":
    cli()
