"""`python -m meshheal_jax.detectors`: alternative detectors (spec/experiments.md §5).

BBH, 504 tasks, A3 and A5 degraded from task 253, model pairs A (gpt-oss-120b / gemma-3-4b-it)
and B (Llama-3.3-70B-Instruct / Llama-3.2-1B-Instruct). Detectors: relative (MeshHeal's peer
comparison), absolute (a fixed threshold on the agent's own mean score, same alpha/beta state
machine), cusum (Page 1954 on the agent's own score deficits). Everything else is full MeshHeal.
Prints per pair and detector the degraded agents missed (of 2) and the healthy agents falsely
isolated (of 4), per seed and in total, and the accuracy. One run folder per detector under
--out (both pairs in it) and a combined summary.json there.
"""

from __future__ import annotations

import dataclasses

from meshheal_jax import runner
from meshheal_jax.ablate import check_names, combined_out, run_all
from meshheal_jax.cli import CommonFlags, backend_fields, entrypoint, fmt, new_table, print_table
from meshheal_jax.config import DETECTORS, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.report import print_parse_notes


@dataclasses.dataclass(frozen=True)
class DetectorsConfig(CommonFlags):
    detectors: tuple[str, ...] = DETECTORS
    """detectors to run: relative | absolute | cusum"""
    pairs: tuple[str, ...] = ("A", "B")
    """model pairs (this command's --pairs replaces --pair)"""
    dataset: str = "bbh"
    """dataset (profile)"""
    tasks: int = 504
    """stream length (a multiple of 42; of 84 for both phases to have the same task-type mix); degradation starts at the midpoint"""
    degraded: tuple[int, ...] | None = None
    """agents (0-based) degraded from the midpoint; default: the profile's A3 and A5 (agents 2 and 4)"""


def experiment(cfg: DetectorsConfig, detector: str) -> runner.Experiment:
    return runner.Experiment(
        name="detectors", datasets=(cfg.dataset,), pairs=tuple(cfg.pairs), seeds=cfg.seed_tuple(),
        engine=cfg.engine, slots=cfg.slots, n_tasks=cfg.tasks, degraded=runner.degraded_or_targets(cfg.degraded, (cfg.dataset,), cfg.profiles_dir),
        protocol=dataclasses.replace(cfg.protocol, detector=detector), profiles_dir=cfg.profiles_dir,
        params_dir=cfg.params_dir, **backend_fields(cfg),
    )  # fmt: skip


def print_summary(summary: dict) -> None:
    results = sorted(summary["results"], key=lambda r: (r["pair"], DETECTORS.index(r["detector"])))
    first = results[0]
    seeds = first["seeds"]
    table = new_table(
        f"Detectors: {first['dataset']}, {len(seeds)} seeds ({summary['engine']} engine, {summary['backend']} "
        f"backend); per seed 'missed of {first['n_degraded']} / falsely isolated of {first['n_healthy']}'",
        "pair", "detector", *(f"seed {s}" for s in seeds), "missed", "falsely isolated", "false isolations",
        "acc H", "acc D", "D − H",
    )  # fmt: skip
    for r in results:
        per_seed = [
            f"{m} / {f}" for m, f in zip(r["missed_per_seed"], r["falsely_isolated_healthy_per_seed"])
        ]
        table.add_row(
            r["pair"], r["detector"], *per_seed,
            f"{r['missed_total']} of {r['n_degraded'] * len(seeds)}",
            f"{r['falsely_isolated_healthy_total']} of {r['n_healthy'] * len(seeds)}",
            fmt(r["false_isolations"], 2), fmt(r["acc_healthy"]), fmt(r["acc_degraded"]), fmt(r["phase_change"]),
        )  # fmt: skip
    print_table(table)
    print("missed: degraded agents never isolated while degraded; falsely isolated: never-degraded agents "
          "isolated at some task; false isolations: transitions to isolated of an agent healthy at that task "
          "(mean ± std per seed)")  # fmt: skip


def body(cfg: DetectorsConfig) -> None:
    check_names(tuple(cfg.detectors), DETECTORS, "detectors")
    if cfg.pair != "default":
        raise MeshHealError("this command takes --pairs (several), not --pair")
    if cfg.protocol.detector != ProtocolParams.detector:
        raise MeshHealError(
            "this command runs each of --detectors in turn: it takes --detectors, not --protocol.detector"
        )
    out = combined_out("detectors", cfg.out)
    experiments = {detector: experiment(cfg, detector) for detector in cfg.detectors}
    summary = run_all("detectors", experiments, out, not cfg.quiet, "--detectors", **cfg.run_options())
    print_summary(summary)
    print_parse_notes(summary["results"])
    print(f"results: {out}")


def cli() -> None:
    entrypoint(DetectorsConfig, body, __doc__)


if __name__ == "__main__":
    cli()
