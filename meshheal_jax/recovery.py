"""`python -m meshheal_jax.recovery`: staggered degradation and recovery (spec/experiments.md §2).

MATH, 630 tasks in five phases of 126: healthy; A5 degraded; A3 and A5 degraded; A3 degraded and
A5 restored; both restored. Runs MeshHeal and the five baselines on the same streams (paired)
unless --methods picks some. Prints per phase and method accuracy, calls and tokens per task; per
degraded agent and method the detection delay, closure and reintegration delay (baselines, which
have no detector: never isolated, closure not established, reintegration undefined); MeshHeal's
state changes of one representative seed. Writes report.md in the run folder.
"""

from __future__ import annotations

import dataclasses

import polars as pl

from meshheal_jax import report, runner
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, fmt, new_table, print_table
from meshheal_jax.errors import MeshHealError
from meshheal_jax.main import ordered
from meshheal_jax.report import (
    BEFORE_ONSET,
    NEVER_ISOLATED,
    NOT_ESTABLISHED,
    UNDEFINED,
    agent_cells,
    isolates,
    method_label,
)


@dataclasses.dataclass(frozen=True)
class RecoveryConfig(CommonFlags):
    methods: tuple[str, ...] = runner.METHODS
    """methods to run, in table order: meshheal agentnet raps autogen sac symphony"""
    dataset: str = "math"
    """dataset (profile) of the recovery stream"""
    tasks: int = 630
    """stream length: five equal phases (multiple of 210)"""
    show_seed: int | None = None
    """seed whose MeshHeal state changes are printed (default: the first)"""


def experiment(cfg: RecoveryConfig) -> runner.Experiment:
    return runner.Experiment(
        name="recovery", datasets=(cfg.dataset,), pairs=(cfg.pair,), seeds=cfg.seed_tuple(),
        methods=tuple(cfg.methods), engine=cfg.engine, slots=cfg.slots, n_tasks=cfg.tasks, protocol=cfg.protocol,
        degraded=runner.profile_targets((cfg.dataset,), cfg.profiles_dir),  # (A3, A5) of the profile
        profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir, **backend_fields(cfg),
    )  # fmt: skip


def print_summary(summary: dict, states: pl.DataFrame, seed: int) -> None:
    results = ordered(summary)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["dataset"], r["pair"]), []).append(r)
    for (dataset, pair), rs in groups.items():
        n_seeds = len(rs[0]["seeds"])
        phases = rs[0]["phases"]
        n = summary["n_tasks"] // len(phases)
        print(f"Staggered degradation and recovery: {dataset}, pair {pair}, mean ± std over {n_seeds} seeds "
              f"({summary['backend']} backend; MeshHeal on the {summary['engine']} engine)")  # fmt: skip
        for what, key, digits, scale in (("Accuracy", "acc", 3, 1.0), ("Tokens per task (k)", "tokens_per_task", 1, 1e-3),
                                         ("Calls per task", "calls_per_task", 1, 1.0)):  # fmt: skip
            table = new_table(f"{what} per phase", "phase", "tasks", *(method_label(r) for r in rs))
            for k, ph in enumerate(phases):
                table.add_row(ph["name"], f"{k * n + 1}–{(k + 1) * n}",
                              *(fmt(r["phases"][k][key], digits, scale) for r in rs))  # fmt: skip
            print_table(table)
        print(
            "Delays: mean ± std (min–max) n=seeds where defined; detection delay, k before onset: k of the n "
            f"detections were {BEFORE_ONSET}; closure: seeds where the agent stays isolated to the end of its "
            "degradation; reintegration: tasks from restoration to its final run in state normal."
        )
        agents = new_table(
            "Self-healing per degraded agent",
            "method", "agent", "degraded", "detection delay", "closure", "reintegration delay",
        )  # fmt: skip
        for i, r in enumerate(rs):
            if i:
                agents.add_section()
            for a in r["agents"]:
                end = a["recovered_at"] - 1 if a["recovered_at"] else summary["n_tasks"]
                agents.add_row(method_label(r), f"{a.get('profile', '')} (agent {a['agent']})",
                               f"{a['degraded_at']}–{end}", *agent_cells(r, a))  # fmt: skip
        print_table(agents)
        errors = new_table("Missed degraded agents and false isolations (transitions of healthy agents to "
                           "isolated; agents concerned), per seed",
                           "method", "missed", "false isolations", "falsely isolated agents")  # fmt: skip
        for r in rs:
            if isolates(r):
                errors.add_row(method_label(r), fmt(r["missed"], 2), fmt(r["false_isolations"], 2),
                               fmt(r["false_isolated_agents"], 2))  # fmt: skip
            else:
                errors.add_row(
                    method_label(r), f"all ({NEVER_ISOLATED})", "— (no detector)", "— (no detector)"
                )
        print_table(errors)
        if any(not isolates(r) for r in rs):
            print(f"Baselines have no detector: their degraded agents are {NEVER_ISOLATED} (detection delay null, "
                  f"n_defined 0), closure {NOT_ESTABLISHED}, reintegration {UNDEFINED}.")  # fmt: skip
        for r in rs:
            if not isolates(r):
                continue
            changes = states.filter((pl.col("seed") == seed) & (pl.col("dataset") == dataset) & (pl.col("pair") == pair)
                                    & (pl.col("method") == r["method"]))  # fmt: skip
            table = new_table(f"State changes of {method_label(r)}, seed {seed}", "t", "agent", "from", "to", "z",
                              "reason", "probe", "degraded")  # fmt: skip
            for row in changes.iter_rows(named=True):
                z = "—" if row["z"] is None else f"{row['z']:.2f}"
                table.add_row(str(row["t"]), str(row["agent"]), row["from"], row["to"], z, row["reason"],
                              "yes" if row["probe"] else "", "yes" if row["degraded"] else "")  # fmt: skip
            print_table(table)


def body(cfg: RecoveryConfig) -> None:
    if cfg.show_seed is not None and cfg.show_seed not in cfg.seed_tuple():
        raise MeshHealError(
            f"--show-seed {cfg.show_seed} is not among the seeds run {list(cfg.seed_tuple())}"
        )
    results = runner.run(experiment(cfg), cfg.out, progress=not cfg.quiet, **cfg.run_options())
    seed = cfg.show_seed if cfg.show_seed is not None else cfg.seed_tuple()[0]
    print_summary(results.summary, results.states, seed)
    report.print_parse_notes(results.summary["results"])
    if note := report.prefix_note(results.summary):
        print(note)
    path = report.write_report(results.run_dir, cfg.show_seed)
    print(f"results: {results.run_dir}")
    print(f"report: {path}")


def cli() -> None:
    entrypoint(RecoveryConfig, body, __doc__)


if __name__ == "__main__":
    cli()
