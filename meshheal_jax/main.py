"""`python -m meshheal_jax.main`: persistent degradation (spec/experiments.md §1).

6 agents, complete graph; A3 and A5 (agents 2 and 4) degraded from task 253 of 504. Runs MeshHeal
and the five baselines (AgentNet, RAPS, AutoGen with A3 as mandatory manager, SAC, Symphony) on the
same streams (same seeds, task order and draws: paired) unless --methods picks some. Prints per
dataset and mean, per method: accuracy H / D, the paired phase change D − H, calls and tokens per
task in each phase (live: then a line per result where replies failed to parse or needed their
retry); then detection per degraded agent. Writes report.md in the run folder.
"""

from __future__ import annotations

import dataclasses

from meshheal_jax import report, runner
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, fmt, new_table, print_table
from meshheal_jax.report import (
    BEFORE_ONSET,
    NEVER_ISOLATED,
    NOT_ESTABLISHED,
    UNDEFINED,
    agent_cells,
    isolates,
    method_label,
    print_parse_notes,
)


@dataclasses.dataclass(frozen=True)
class MainConfig(CommonFlags):
    methods: tuple[str, ...] = runner.METHODS
    """methods to run, in table order: meshheal agentnet raps autogen sac symphony"""
    datasets: tuple[str, ...] = ("bbh", "math", "mmlu_pro")
    """datasets (profiles) to run"""
    tasks: int = 504
    """stream length (a multiple of 42; of 84 for both phases to have the same task-type mix); degradation starts at the midpoint"""
    degraded: tuple[int, ...] | None = None
    """agents (0-based) degraded from the midpoint; default: the profile's A3 and A5 (agents 2 and 4)"""


def experiment(cfg: MainConfig) -> runner.Experiment:
    return runner.Experiment(
        name="main", datasets=tuple(cfg.datasets), pairs=(cfg.pair,), seeds=cfg.seed_tuple(),
        methods=tuple(cfg.methods), engine=cfg.engine, slots=cfg.slots, n_tasks=cfg.tasks,
        degraded=runner.degraded_or_targets(cfg.degraded, cfg.datasets, cfg.profiles_dir), protocol=cfg.protocol, profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir,
        **backend_fields(cfg),
    )  # fmt: skip


def ordered(summary: dict) -> list[dict]:
    """Results grouped by pair, then dataset (the mean last), then method in run order."""
    results = summary["results"]
    pairs = list(dict.fromkeys(r["pair"] for r in results))
    datasets = list(dict.fromkeys(r["dataset"] for r in results if r["dataset"] != "mean"))
    datasets += ["mean"] if any(r["dataset"] == "mean" for r in results) else []
    methods = list(dict.fromkeys(r["method"] for r in results))
    key = {(r["pair"], r["dataset"], r["method"]): r for r in results}
    return [key[(p, d, m)] for p in pairs for d in datasets for m in methods if (p, d, m) in key]


def print_summary(summary: dict) -> None:
    results = ordered(summary)
    pairs = sorted({r["pair"] for r in results})
    n_seeds = len(results[0]["seeds"]) if results else 0
    half = summary["n_tasks"] // 2
    with_agents = [r for r in results if r.get("agents")]
    phases = (f"H: tasks 1–{half}, D: tasks {half + 1}–{summary['n_tasks']}; D − H paired within seed" if with_agents
              else f"no agent degraded: H is all {summary['n_tasks']} tasks, D none")  # fmt: skip
    print(f"Persistent degradation, pair {', '.join(pairs)}: mean ± std over {n_seeds} seeds ({summary['backend']} "
          f"backend; MeshHeal on the {summary['engine']} engine). {phases}; calls and tokens (thousands) per "
          "task.")  # fmt: skip
    table = new_table(
        "Accuracy, calls and tokens per task",
        "dataset", "method", "acc H", "acc D", "D − H", "calls H", "calls D", "tokens H (k)", "tokens D (k)",
    )  # fmt: skip
    previous = None
    for r in results:
        if previous is not None and (r["dataset"], r["pair"]) != previous:
            table.add_section()
        previous = (r["dataset"], r["pair"])
        table.add_row(
            r["dataset"] + ("" if len(pairs) == 1 else f" ({r['pair']})"), method_label(r),
            fmt(r["acc_healthy"]), fmt(r["acc_degraded"]), fmt(r["phase_change"]),
            fmt(r["calls_per_task_healthy"], 1), fmt(r["calls_per_task_degraded"], 1),
            fmt(r["tokens_per_task_healthy"], 1, 1e-3), fmt(r["tokens_per_task_degraded"], 1, 1e-3),
        )  # fmt: skip
    print_table(table)
    print_parse_notes(results)
    # with no agent degraded, the table still shows the detector's false isolations
    shown = with_agents or [r for r in results if isolates(r)]
    if not shown:
        return
    agents = [(a["agent"], a.get("profile", str(a["agent"]))) for a in shown[0].get("agents") or []]
    columns = [f"{p} detection delay" for _, p in agents] + [f"{p} closure" for _, p in agents]
    false_words = "false isolations (transitions of healthy agents to isolated) and the distinct agents falsely isolated"
    if agents:
        print(f"Detection delay: tasks after degradation, mean ± std (min–max) n=seeds where isolated (k before "
              f"onset: k of the n detections were {BEFORE_ONSET}); closure: seeds where it stays isolated to the "
              f"end; missed (of {len(agents)}), {false_words}, per seed.")  # fmt: skip
        detect = new_table("Detection per degraded agent", "dataset", "method", *columns, "missed",
                           "false isolations", "falsely isolated agents")  # fmt: skip
    else:
        print(f"No agent degraded: {false_words}, per seed.")
        detect = new_table(
            "False isolations", "dataset", "method", "false isolations", "falsely isolated agents"
        )
    previous = None
    for r in shown:
        if previous is not None and (r["dataset"], r["pair"]) != previous:
            detect.add_section()
        previous = (r["dataset"], r["pair"])
        cells = {a["agent"]: agent_cells(r, a) for a in r.get("agents") or []}  # detection, closure, -
        detect.add_row(
            r["dataset"] + ("" if len(pairs) == 1 else f" ({r['pair']})"), method_label(r),
            *(cells[k][0] for k, _ in agents), *(cells[k][1] for k, _ in agents),
            *([fmt(r["missed"], 2)] if agents else []), fmt(r["false_isolations"], 2),
            fmt(r["false_isolated_agents"], 2),
        )  # fmt: skip
    print_table(detect)
    if any(not isolates(r) for r in shown):
        print(f"Baselines have no detector: their degraded agents are {NEVER_ISOLATED} (detection delay null, "
              f"n_defined 0), closure {NOT_ESTABLISHED}, reintegration {UNDEFINED}.")  # fmt: skip


def body(cfg: MainConfig) -> None:
    results = runner.run(experiment(cfg), cfg.out, progress=not cfg.quiet, **cfg.run_options())
    print_summary(results.summary)
    if note := report.prefix_note(results.summary):
        print(note)
    path = report.write_report(results.run_dir)
    print(f"results: {results.run_dir}")
    print(f"report: {path}")


def cli() -> None:
    entrypoint(MainConfig, body, __doc__)


if __name__ == "__main__":
    cli()
