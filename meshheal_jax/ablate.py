"""`python -m meshheal_jax.ablate`: MeshHeal's components (spec/experiments.md §4).

BBH, 504 tasks, A3 and A5 degraded from task 253: full MeshHeal; single_reviewer (the initial
reviewer is the whole committee, in two isolated contexts, and writes the Takeover alone: one
correction call); no_takeover (review, committee, detection and rerouting kept; a low-scoring
output stays). Same seeds, task order and draws for every variant (paired). One run folder per
variant under --out, and a combined summary.json there; prints accuracy H / D, the paired phase
change, calls and tokens per task, and detection.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from meshheal_jax import runner
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, fmt, new_table, print_table
from meshheal_jax.config import CHECKPOINT_EVERY_S, VARIANTS, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.files import default_out
from meshheal_jax.report import BEFORE_ONSET, detection_text, print_parse_notes


@dataclasses.dataclass(frozen=True)
class AblateConfig(CommonFlags):
    variants: tuple[str, ...] = VARIANTS
    """MeshHeal variants to run: full | single_reviewer | no_takeover"""
    dataset: str = "bbh"
    """dataset (profile)"""
    tasks: int = 504
    """stream length (a multiple of 42; of 84 for both phases to have the same task-type mix); degradation starts at the midpoint"""
    degraded: tuple[int, ...] | None = None
    """agents (0-based) degraded from the midpoint; default: the profile's A3 and A5 (agents 2 and 4)"""


def combined_out(name: str, out: Path | None) -> Path:
    """The folder holding one run folder per variant/detector and the combined summary.json."""
    if out is None:
        return default_out(name)
    if (out / "config.json").exists():
        raise MeshHealError(f"output folder {out} is the run folder of one experiment; choose another --out")
    if out.exists() and not out.is_dir():
        raise MeshHealError(f"output path {out} exists and is not a folder")
    return out


def check_names(given: tuple[str, ...], known: tuple[str, ...], what: str) -> None:
    if not given:
        raise MeshHealError(f"no {what} given")
    for name in given:
        if name not in known:
            raise MeshHealError(f"unknown {what[:-1]} {name!r}; known: {', '.join(known)}")
    if len(set(given)) != len(given):
        raise MeshHealError(f"{what} must be distinct, got {list(given)}")


def run_all(
    name: str,
    experiments: dict[str, runner.Experiment],
    out: Path,
    progress: bool,
    arm_flag: str,
    lanes: int | None = None,
    checkpoint_every: float = CHECKPOINT_EVERY_S,
) -> dict:
    """Run (or resume) each experiment in out/<key>/; write and return the combined summary
    (`lanes`, `checkpoint_every`: runner.run's). A folder holding another key's run is refused
    (runner.check_arms; `arm_flag`: the command's flag that names its keys)."""
    runner.check_lanes(lanes)
    runner.check_arms(out, list(experiments), arm_flag)
    runner.check_arm_folders(out, experiments)
    out.mkdir(parents=True, exist_ok=True)
    entries, first = [], None
    for key, exp in experiments.items():
        results = runner.run(
            exp, out / key, progress=progress, lanes=lanes, checkpoint_every=checkpoint_every
        )
        first = first or results.summary
        for r in results.summary["results"]:
            if r.get("method", "meshheal") != "meshheal":
                continue
            entry = {**r, "variant": exp.protocol.variant, "detector": exp.protocol.detector,
                     "run_dir": str(results.run_dir)}  # fmt: skip
            entry.update(per_seed_detection(results, exp, r["pair"], r["dataset"]))
            entries.append(entry)
    summary = {"experiment": name, "engine": first["engine"], "backend": first["backend"], "slots": first["slots"],
               "n_agents": first["n_agents"], "n_tasks": first["n_tasks"], "results": entries}  # fmt: skip
    runner.write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def per_seed_detection(results: runner.Results, exp: runner.Experiment, pair: str, dataset: str) -> dict:
    """Per seed: degraded agents never isolated while degraded (`missed`) and never-degraded
    agents isolated at some task (`falsely_isolated_healthy`, of the healthy ones); totals over seeds."""
    from meshheal_jax import metrics

    schedule = exp.schedule()
    degraded = {agent for agent, _, _ in schedule.intervals}
    healthy = exp.n_agents - len(degraded)
    states = results.states
    if "method" in states.columns:
        states = states.filter(states["method"] == "meshheal")
    missed, false_agents = [], []
    for seed in exp.seeds:
        mine = states.filter(
            (states["pair"] == pair) & (states["dataset"] == dataset) & (states["seed"] == seed)
        )
        outcomes = metrics.agent_outcomes(mine, schedule)
        missed.append(sum(o["detection_delay"] is None for o in outcomes))
        isolated = set(mine.filter(mine["to"] == "isolated")["agent"].to_list())
        false_agents.append(len(isolated - degraded))
    return {
        "n_degraded": len(degraded), "n_healthy": healthy,
        "missed_per_seed": missed, "missed_total": sum(missed),
        "falsely_isolated_healthy_per_seed": false_agents, "falsely_isolated_healthy_total": sum(false_agents),
        "falsely_isolated_healthy": metrics.stat(false_agents),
    }  # fmt: skip


def experiment(cfg: AblateConfig, variant: str) -> runner.Experiment:
    return runner.Experiment(
        name="ablate", datasets=(cfg.dataset,), pairs=(cfg.pair,), seeds=cfg.seed_tuple(), engine=cfg.engine,
        slots=cfg.slots, n_tasks=cfg.tasks, degraded=runner.degraded_or_targets(cfg.degraded, (cfg.dataset,), cfg.profiles_dir),
        protocol=dataclasses.replace(cfg.protocol, variant=variant), profiles_dir=cfg.profiles_dir,
        params_dir=cfg.params_dir, **backend_fields(cfg),
    )  # fmt: skip


def delay(r: dict, agent: int) -> str:
    for a in r.get("agents", []):
        if a["agent"] == agent:
            return detection_text(a)
    return "—"


def print_summary(summary: dict) -> None:
    results = summary["results"]
    first = results[0]
    n_seeds = len(first["seeds"])
    table = new_table(
        f"MeshHeal components: {first['dataset']}, pair {first['pair']}, {n_seeds} seeds "
        f"({summary['engine']} engine, {summary['backend']} backend); mean ± std over seeds",
        "variant", "acc H", "acc D", "D − H", "calls H", "calls D", "tokens H (k)", "tokens D (k)", "takeovers/seed",
        "on probes/seed",
    )  # fmt: skip
    for r in results:
        audit = r.get("review_audit", {})
        table.add_row(
            r["variant"], fmt(r["acc_healthy"]), fmt(r["acc_degraded"]), fmt(r["phase_change"]),
            fmt(r["calls_per_task_healthy"], 1), fmt(r["calls_per_task_degraded"], 1),
            fmt(r["tokens_per_task_healthy"], 1, 1e-3), fmt(r["tokens_per_task_degraded"], 1, 1e-3),
            fmt(audit.get("takeovers"), 1), fmt(audit.get("probe_takeovers"), 1),
        )  # fmt: skip
    print_table(table)
    agents = [a["agent"] for a in first.get("agents", [])]
    detect = new_table(
        "Detection: delay in tasks after degradation, mean ± std (min–max) n=seeds where detected",
        "variant", *(f"delay agent {a}" for a in agents), "closure seeds (per agent)", "missed (total)",
        "falsely isolated healthy (total)", "false isolations",
    )  # fmt: skip
    for r in results:
        closure = "/".join(str(a["closure_seeds"]) for a in r.get("agents", []))
        detect.add_row(
            r["variant"], *(delay(r, a) for a in agents), f"{closure} of {n_seeds}",
            f"{r['missed_total']} of {r['n_degraded'] * n_seeds}",
            f"{r['falsely_isolated_healthy_total']} of {r['n_healthy'] * n_seeds}", fmt(r["false_isolations"], 2),
        )  # fmt: skip
    print_table(detect)
    if any(a.get("onset_detections") for r in results for a in r.get("agents", [])):
        print(f"k before onset: k of the n detections were {BEFORE_ONSET}.")


def body(cfg: AblateConfig) -> None:
    check_names(tuple(cfg.variants), VARIANTS, "variants")
    if cfg.protocol.variant != ProtocolParams.variant:
        raise MeshHealError(
            "this command runs each of --variants in turn: it takes --variants, not --protocol.variant"
        )
    out = combined_out("ablate", cfg.out)
    experiments = {variant: experiment(cfg, variant) for variant in cfg.variants}
    summary = run_all("ablate", experiments, out, not cfg.quiet, "--variants", **cfg.run_options())
    print_summary(summary)
    print_parse_notes(summary["results"])
    print(f"results: {out}")


def cli() -> None:
    entrypoint(AblateConfig, body, __doc__)


if __name__ == "__main__":
    cli()
