"""`python -m meshheal_jax.scale --agents 576 --sparse`: network scaling (spec/experiments.md §3).

The dataset's profile replicated to --agents (a multiple of 6); A3 and A5 of every replica (one
third) degraded from the midpoint of a 504 x replicas stream; warm-up 30 x replicas. The graph is
complete (default), the seeded sparse generator (--sparse), or a user edge list (--edges FILE,
CSV or JSON); the sparse graph's requirements are checked before anything runs. --compare runs
complete and sparse side by side on the same seeds.

Slots (in-flight tasks per stream) default to N/6: one task per six agents in flight, the load per
agent of the 6-agent experiments with their single task (docs/decisions.md S4); --slots 1 gives
the paper's sequential semantics.

Output: <out>/<topology>/ run folders (config.json, parquet tables, summary.json) and
<out>/summary.json with one result per topology (n_agents, topology, degraded, isolated_degraded,
false_isolations, missed, edges, edge_fraction, max_ability_distance, ...).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from meshheal_jax import runner
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, fmt, new_table, print_table
from meshheal_jax.errors import MeshHealError
from meshheal_jax.files import default_out
from meshheal_jax.report import BEFORE_ONSET, print_parse_notes

PAPER_EDGES = {96: 228, 288: 705, 576: 1454}  # undirected edges of the paper's sparse graphs


@dataclasses.dataclass(frozen=True)
class ScaleConfig(CommonFlags):
    agents: int = 96
    """network size, a multiple of 6 (replicas of the 6-agent profile)"""
    sparse: bool = False
    """use the seeded sparse graph generator instead of the complete graph"""
    compare: bool = False
    """run complete and sparse side by side (same seeds)"""
    edges: Path | None = None
    """a user graph: CSV (two integer columns) or JSON edge list; checked against the requirements"""
    graph_seed: int = 0
    """seed of the sparse graph generator"""
    dataset: str = "bbh"
    """dataset (profile)"""
    slots: int | None = None  # type: ignore[assignment]
    """in-flight tasks per stream (default N/6; 1 = the paper's sequential semantics)"""
    tables: tuple[str, ...] = ("tasks", "reviews", "states", "calls")
    """record tables to keep (tasks and states are required: the figures are read from them; dropping
    calls saves memory on huge networks, dropping reviews too, and leaves out the review audit)"""


def topologies(cfg: ScaleConfig) -> list[str]:
    if cfg.edges is not None:
        if cfg.sparse or cfg.compare:
            raise MeshHealError("--edges gives the graph: do not combine it with --sparse or --compare")
        return ["file"]
    if cfg.compare:
        return ["complete", "sparse"]
    return ["sparse" if cfg.sparse else "complete"]


def experiment(cfg: ScaleConfig, topology: str) -> runner.Experiment:
    if cfg.agents <= 0 or cfg.agents % 6:
        raise MeshHealError(f"--agents must be a positive multiple of 6, got {cfg.agents}")
    replicas = cfg.agents // 6
    slots = cfg.slots if cfg.slots is not None else max(replicas, 1)
    return runner.Experiment(
        name="scale", datasets=(cfg.dataset,), pairs=(cfg.pair,), seeds=cfg.seed_tuple(), engine=cfg.engine,
        slots=slots, n_agents=cfg.agents, n_tasks=504 * replicas, degraded=None, topology=topology,
        graph_seed=cfg.graph_seed, edges_file=cfg.edges, tables=tuple(cfg.tables), protocol=cfg.protocol,
        profiles_dir=cfg.profiles_dir, params_dir=cfg.params_dir, **backend_fields(cfg),
    )  # fmt: skip


def detection_cell(r: dict) -> str:
    """Mean detection delay, and the detections per seed before onset (report.BEFORE_ONSET)."""
    onset = r.get("onset_detections")
    at_onset = f" ({fmt(onset, 1)} before onset)" if onset and onset.get("mean") else ""
    return fmt(r.get("detection_delay_mean"), 1) + at_onset


def print_summary(summary: dict) -> None:
    table = new_table(
        f"Network scaling ({summary['engine']} engine, {summary['backend']} backend, slots {summary['slots']})",
        "topology", "agents", "edges (paper)", "of complete", "max ability dist", "acc H", "acc D",
        "isolated at end/degraded", "missed", "false isolations (agents)", "detection delay", "tokens/task H / D (k)",
        "wall s",
    )  # fmt: skip
    for r in summary["results"]:
        paper = PAPER_EDGES.get(r["n_agents"]) if r["topology"] == "sparse" else None
        edges = f"{r['edges']:,}" + (f" ({paper:,})" if paper else "")
        table.add_row(
            r["topology"], f"{r['n_agents']:,}", edges, f"{100 * r['edge_fraction']:.2f}%", "—" if r["max_ability_distance"] is None else str(r["max_ability_distance"]),
            fmt(r["acc_healthy"]), fmt(r["acc_degraded"]), f"{fmt(r['isolated_degraded'], 1)} / {r['degraded']}",
            fmt(r["missed"], 1), f"{fmt(r['false_isolations'], 1)} ({fmt(r.get('false_isolated_agents'), 1)})",
            detection_cell(r),
            f"{fmt(r['tokens_per_task_healthy'], 1, 1e-3)} / {fmt(r['tokens_per_task_degraded'], 1, 1e-3)}",
            f"{r['wall_s']:.1f}" + (" (resumed)" if r.get("resumed") else ""),
        )  # fmt: skip
    print_table(table)
    if any((r.get("onset_detections") or {}).get("mean") for r in summary["results"]):
        print(f"Detection delay: mean over the degraded agents detected; (x before onset): x detections per seed "
              f"were {BEFORE_ONSET}.")  # fmt: skip


def body(cfg: ScaleConfig) -> None:
    out = cfg.out or default_out("scale")
    if out.exists() and not out.is_dir():
        raise MeshHealError(f"output path {out} exists and is not a folder")
    results, engine, backend, slots = [], None, None, None
    arms = topologies(cfg)
    runner.check_arms(out, arms, "--sparse / --compare / --edges")
    experiments = {topology: experiment(cfg, topology) for topology in arms}
    runner.check_arm_folders(out, experiments)
    for topology, exp in experiments.items():
        start = time.perf_counter()
        run = runner.run(exp, out / topology, progress=not cfg.quiet, **cfg.run_options())
        wall = time.perf_counter() - start  # a resumed run's: this call's part only
        engine, backend, slots = run.summary["engine"], run.summary["backend"], run.summary["slots"]
        for r in run.summary["results"]:
            results.append({**r, "run_dir": str(run.run_dir), "wall_s": wall, "resumed": run.resumed})
    summary = {"experiment": "scale", "engine": engine, "backend": backend, "slots": slots,
               "n_agents": cfg.agents, "results": results}  # fmt: skip
    runner.write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    print_summary(summary)
    print_parse_notes(results, by_topology=True)
    print(f"results: {out}")


def cli() -> None:
    entrypoint(ScaleConfig, body, __doc__)


if __name__ == "__main__":
    cli()
