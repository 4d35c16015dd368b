"""`python -m meshheal_jax.report RUN_DIR`: regenerate a run folder's plots and its report.md.

Reads config.json, summary.json and the parquet tables of a finished run, redraws the figures that
apply to its experiment (recovery: the trajectory of the first seed and per-phase accuracy bars;
main and others: per-phase accuracy bars; a scaling run: the scaling plot) and writes report.md
beside them: the summary tables, the figures, the config and the commands that reproduce the run.
Given a `scale` command's --out (its topologies' folders and the combined summary.json), it writes
the topologies' table and scaling figure there.
Experiments call `write_report(run_dir)` at the end of a run.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import tyro

from meshheal_jax import metrics, runner
from meshheal_jax.cli import entrypoint, fmt, fmt_range
from meshheal_jax.config import ProtocolParams, recorded_protocol
from meshheal_jax.errors import MeshHealError

REPORT_NAME = "report.md"
PHASES_PNG = "phase_accuracy.png"
SCALING_PNG = "scaling.png"
STATE_CHANGES_SHOWN = 400  # rows of the state-change table before it is cut (the parquet has all)


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    run_dir: tyro.conf.Positional[Path]
    """run folder written by an experiment (holds config.json, summary.json and the parquet tables)"""
    show_seed: int | None = None
    """recovery: the seed of the trajectory plot and the state-change table (default: the first seed)"""


@dataclasses.dataclass
class RunFolder:
    """A finished run as the report reads it."""

    path: Path
    config: dict  # config.json
    summary: dict  # summary.json
    tasks: pl.DataFrame
    reviews: pl.DataFrame | None  # read only where a figure needs them
    states: pl.DataFrame | None
    show_seed: int | None = None  # recovery: the seed shown (trajectory, state changes); None: the first

    @property
    def shown_seed(self) -> int:
        seeds = [int(s) for s in self.experiment.get("seeds", [0])]
        if self.show_seed is None:
            return seeds[0]
        if self.show_seed not in seeds:
            raise MeshHealError(f"--show-seed {self.show_seed} is not among the run's seeds {seeds}")
        return self.show_seed

    @property
    def experiment(self) -> dict:
        return self.config.get("experiment", {})

    @property
    def name(self) -> str:
        return str(self.experiment.get("name") or self.summary.get("experiment") or "run")


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeshHealError(f"{path.parent} has no {path.name} ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError):
        raise MeshHealError(f"{path} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise MeshHealError(f"{path} is not a run's {path.name}: JSON, but not an object")
    return doc


def read_table(run_dir: Path, name: str, columns: tuple[str, ...] = ()) -> pl.DataFrame:
    """A finished run's table, or a one-line error: missing (an unfinished run), unreadable, or
    without the `columns` the caller reads."""
    path = run_dir / f"{name}.parquet"
    if not path.is_file():
        raise MeshHealError(
            f"{run_dir} has no {name}.parquet (the run did not finish; re-run its command to resume)"
        )
    try:
        frame = pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as err:
        raise MeshHealError(f"{path} is not a readable parquet file: {type(err).__name__}") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise MeshHealError(f"{path} lacks the columns {missing} (not a {name} table?)")
    return frame


def read_run_folder(run_dir: Path | str) -> tuple[dict, dict]:
    """A finished run folder's config.json and summary.json; a missing or foreign folder is a
    MeshHealError naming what is wrong. Its tables are read by the caller (`read_table`)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise MeshHealError(f"run folder {run_dir} does not exist")
    if not run_dir.is_dir():
        raise MeshHealError(f"{run_dir} is not a folder")
    if not (run_dir / "config.json").is_file():
        inside = sorted(d.name for d in run_dir.iterdir() if (d / "config.json").is_file())
        if inside:  # scale, ablate, detectors: one run folder per arm under their --out
            raise MeshHealError(
                f"{run_dir} holds run folders, not one: give one of {inside} (e.g. {run_dir / inside[0]})"
            )
        raise MeshHealError(f"{run_dir} is not a run folder (no config.json)")
    config = _read_json(run_dir / "config.json", "the run's configuration")
    if not isinstance(config, dict) or not config.get(runner.RUN_MARKER):
        raise MeshHealError(
            f"{run_dir} is not a run folder (config.json has no {runner.RUN_MARKER!r} marker)"
        )
    if not isinstance(config.get("experiment"), dict):
        raise MeshHealError(f"{run_dir / 'config.json'} is damaged: its 'experiment' is not an object")
    summary = _read_json(run_dir / "summary.json", "the run did not finish; re-run its command to resume")
    return config, summary


def load_run(run_dir: Path | str) -> RunFolder:
    """Read a run folder; a missing or foreign folder is a MeshHealError naming what is wrong."""
    run_dir = Path(run_dir)
    config, summary = read_run_folder(run_dir)
    name = str(config["experiment"].get("name") or summary.get("experiment"))
    needs_records = name == "recovery"
    return RunFolder(
        path=run_dir,
        config=config,
        summary=summary,
        tasks=read_table(run_dir, "tasks"),
        reviews=read_table(run_dir, "reviews") if needs_records else None,
        states=read_table(run_dir, "states") if needs_records else None,
    )


def experiment_from_config(experiment: dict) -> runner.Experiment:
    """config.json's "experiment" block -> the runner.Experiment it was written from."""
    known = {f.name for f in dataclasses.fields(runner.Experiment)}
    fields = {k: v for k, v in experiment.items() if k in known}
    for key in ("datasets", "pairs", "seeds", "methods", "degraded", "tables"):
        if fields.get(key) is not None:  # JSON lists back to the tuples the run was written from
            fields[key] = tuple(fields[key])
    for key in ("profiles_dir", "params_dir"):
        if fields.get(key) is not None:
            fields[key] = Path(fields[key])
    try:
        if isinstance(fields.get("live"), dict):
            live = dict(fields["live"])
            for key in ("strong_urls", "weak_urls"):
                live[key] = tuple(live.get(key) or ())
            fields["live"] = runner.LiveSettings(**live)
        protocol_known = {f.name for f in dataclasses.fields(ProtocolParams)}
        recorded = recorded_protocol(experiment.get("protocol") or {})
        fields["protocol"] = ProtocolParams(**{k: v for k, v in recorded.items() if k in protocol_known})
        return runner.Experiment(**fields)
    except TypeError as err:  # a field it lacks, or one it does not know (a live block's)
        raise MeshHealError(f"config.json's experiment block does not describe a run: {err}") from None


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def _phase_names(summary: dict) -> list[str] | None:
    for result in summary.get("results", []):
        if result.get("phases"):
            return [ph["name"] for ph in result["phases"]]
    return None


def scaling_entries(summary: dict) -> list[dict]:
    """Entries for plots.scaling_plot: results that carry n_agents and topology, or the whole
    summary as one entry when n_agents/topology are top-level (one network size per run)."""
    if summary.get("experiment") != "scale":
        return []  # main / recovery results carry n_agents and topology too; one size is no curve
    results = summary.get("results", [])
    entries = [r for r in results if "n_agents" in r and "topology" in r]
    if entries:
        return entries
    if "n_agents" in summary and "topology" in summary:
        return [{"n_agents": summary["n_agents"], "topology": summary["topology"], **r} for r in results]
    return []


def make_plots(run: RunFolder) -> list[tuple[str, Path]]:
    """Redraw the figures that apply to this run: [(caption, path)]."""
    from meshheal_jax import plots  # here: matplotlib loads only when a figure is drawn

    figures: list[tuple[str, Path]] = []
    exp = run.experiment
    recovery = run.name == "recovery" and run.reviews is not None and run.states is not None
    # the trajectory is MeshHeal's (its detector's states); a run of baselines alone has none to draw
    if recovery and "meshheal" in run.tasks["method"].unique().to_list():
        schedule = experiment_from_config(exp).schedule()
        seed = run.shown_seed
        dataset, pair = exp["datasets"][0], exp["pairs"][0]
        path = plots.recovery_trajectory(
            run.reviews,
            run.states,
            run.tasks,
            schedule,
            seed,
            run.path / f"trajectory_seed{seed}.png",
            phase_names=_phase_names(run.summary),
            dataset=dataset,
            pair=pair,
            method="meshheal",
        )
        figures.append((f"Recovery trajectory, seed {seed} ({dataset}, pair {pair}, meshheal)", path))
    if run.tasks.height and "phase" in run.tasks.columns:
        path = plots.phase_accuracy_bars(run.tasks, run.path / PHASES_PNG, _phase_names(run.summary))
        figures.append(("Accuracy per phase", path))
    entries = scaling_entries(run.summary)
    if entries:
        figures.append(("Network scaling", plots.scaling_plot(entries, run.path / SCALING_PNG)))
    return figures


# ----------------------------------------------------------------------------------------------
# Tables (markdown, from summary.json; the same numbers the CLIs print)
# ----------------------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: object) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _labels(r: dict) -> list[str]:
    return [str(r.get("method", "")), str(r.get("dataset", "")), str(r.get("pair", ""))]


def results_table(summary: dict) -> str:
    rows = []
    for r in summary.get("results", []):
        if "acc_healthy" not in r:
            continue
        rows.append(
            [
                *_labels(r),
                fmt(r["acc_healthy"]),
                fmt(r["acc_degraded"]),
                fmt(r["phase_change"]),
                fmt(r["calls_per_task_healthy"], 1),
                fmt(r["calls_per_task_degraded"], 1),
                fmt(r["tokens_per_task_healthy"], 1, 1e-3),
                fmt(r["tokens_per_task_degraded"], 1, 1e-3),
                fmt(r.get("missed"), 2),
                fmt(r.get("false_isolations"), 2),
                fmt(r.get("false_isolated_agents"), 2),
            ]
        )
    headers = (
        "method",
        "dataset",
        "pair",
        "acc H",
        "acc D",
        "D − H",
        "calls H",
        "calls D",
        "tokens H (k)",
        "tokens D (k)",
        "missed",
        "false isolations",
        "falsely isolated agents",
    )
    return md_table(headers, rows) if rows else ""


def phases_table(summary: dict) -> str:
    rows = []
    n_tasks = summary.get("n_tasks")
    for r in summary.get("results", []):
        phases = r.get("phases") or []
        for k, ph in enumerate(phases):
            span = f"{k * n_tasks // len(phases) + 1}–{(k + 1) * n_tasks // len(phases)}" if n_tasks else ""
            rows.append(
                [
                    *_labels(r),
                    ph["name"],
                    span,
                    fmt(ph["acc"]),
                    fmt(ph["calls_per_task"], 1),
                    fmt(ph["tokens_per_task"], 1, 1e-3),
                ]
            )
    headers = ("method", "dataset", "pair", "phase", "tasks", "accuracy", "calls/task", "tokens/task (k)")
    return md_table(headers, rows) if rows else ""


# Parse failures of the live backend (spec/live.md; metrics.parse_counts)
PARSE_FALLBACKS = (
    "a reply that still did not parse after its one retry was recorded with its parser's fallback: "
    "inference the task type's documented pair, review a neutral 0.5, execution no answer, choice "
    "no named agent"
)


def prefix_note(summary: dict) -> str | None:
    """A live run's server-side prefix savings (summary.json's server_prefix) in one line."""
    s = summary.get("server_prefix")
    if not s or not s.get("prompt_tokens"):
        return None
    return (f"server-side prefix savings (the {s['requests']:,} requests sent): of {s['prompt_tokens']:,} prompt tokens "
            f"as counted (an n=3 review's prompt three times), {s['prefix_shared_tokens']:,} "
            f"({s['prefix_shared_share']:.1%}) were an n-request's shared prefill and {s['cached_prompt_tokens']:,} "
            f"({s['cached_prompt_share']:.1%}) prefix-cache hits the servers reported")  # fmt: skip


def _seen(r: dict, key: str) -> bool:
    """Whether some stream of the result counted any of `key` (a parse count's stats)."""
    return ((r.get(key) or {}).get("max") or 0) > 0


def parse_problems(r: dict) -> bool:
    """Whether some stream of the result had a reply that failed to parse or needed the retry."""
    return _seen(r, "parse_failed") or _seen(r, "parse_retried")


def _parse_part(r: dict, status: str) -> str:
    groups = [f"{group} {fmt(r[key], 1)}" for group in metrics.PARSE_GROUPS
              if _seen(r, key := f"parse_{status}_{group}")]  # fmt: skip
    return fmt(r.get(f"parse_{status}"), 1) + (f" ({', '.join(groups)})" if groups else "")


def method_label(r: dict) -> str:
    """meshheal, or meshheal (variant, detector) where either differs from the default."""
    extra = [x for x, default in ((r.get("variant"), "full"), (r.get("detector"), "relative"))
             if r["method"] == "meshheal" and x not in (None, default)]  # fmt: skip
    return r["method"] + (f" ({', '.join(extra)})" if extra else "")


def parse_note(r: dict, where: str = "") -> str:
    """One line for a result with parse problems: per stream, mean ± std over seeds, the replies
    that kept the fallback and those the retry rescued, with the kind groups that had any."""
    return (f"Parse failures, {where}{r['dataset']} {method_label(r)} ({r['pair']}), per stream: "
            f"{_parse_part(r, 'failed')} replies failed their retry too (fallback recorded); "
            f"{_parse_part(r, 'retried')} parsed on the retry.")  # fmt: skip


def print_parse_notes(results: list[dict], by_topology: bool = False) -> None:
    """After the results table, where some live reply failed to parse or needed its retry: one line
    per such result (nothing on the emulator, which always parses); `by_topology`: scale's results,
    one per graph, each line names its graph."""
    noted = [r for r in results if parse_problems(r)]
    for r in noted:
        print(parse_note(r, f"{r['topology']} graph, " if by_topology else ""))
    if noted:
        print(f"({PARSE_FALLBACKS}; summary.json: parse_failed*, parse_retried*, also per phase.)")


def parse_table(summary: dict) -> str:
    """Per result with parse counts: samples that failed for good (in all, per kind group, per
    phase) and that parsed on the retry, per stream, mean ± std over seeds."""
    rows = []
    for r in summary.get("results", []):
        if "parse_failed" not in r:
            continue
        per_phase = " / ".join(
            f"{ph['name']} {fmt(ph.get('parse_failed'), 1)}" for ph in r.get("phases") or []
        )
        rows.append([*_labels(r), fmt(r["parse_failed"], 1),
                     *(fmt(r.get(f"parse_failed_{group}"), 1) for group in metrics.PARSE_GROUPS),
                     per_phase, fmt(r.get("parse_retried"), 1)])  # fmt: skip
    headers = ("method", "dataset", "pair", "failed", *(f"failed: {g}" for g in metrics.PARSE_GROUPS),
               "failed per phase", "parsed on retry")  # fmt: skip
    return md_table(headers, rows) if rows else ""


# The words every printed table and report.md use where a detector outcome never happened
# (docs/decisions.md R2)
NEVER_ISOLATED = "never isolated"
NOT_ESTABLISHED = "not established"
UNDEFINED = "undefined"
# a MeshHeal agent never isolated in its degraded tasks (it may have been before onset or after restoration)
NOT_DETECTED = "not isolated while degraded"


def isolates(r: dict) -> bool:
    """Whether the method has a detector that isolates agents (MeshHeal; not the baselines)."""
    return r.get("detector") != runner.NO_DETECTOR


# "k before onset" after a detection delay (decisions P5b): k of its detections were ...
BEFORE_ONSET = (
    "§7's delay 0 for an agent already isolated (falsely, while healthy) when it degraded and still "
    "isolated at the end of its first degraded task"
)


def detection_text(a: dict) -> str:
    """A degraded agent's detection delay over seeds (mean ± std (min–max) n=seeds where
    isolated), or `NOT_DETECTED`; with how many of those n detections were before onset
    (`BEFORE_ONSET`, decisions P5b)."""
    if not a["detection_delay"] or a["detection_delay"].get("n_defined", 0) == 0:
        return NOT_DETECTED
    onset = a.get("onset_detections", 0)
    return fmt_range(a["detection_delay"]) + (f", {onset} before onset" if onset else "")


def agent_cells(r: dict, a: dict) -> list[str]:
    """Detection delay, closure, reintegration delay of one degraded agent, in words where undefined."""
    seeds = len(r["seeds"])
    if not isolates(r):
        return [NEVER_ISOLATED, NOT_ESTABLISHED, UNDEFINED]
    detection = detection_text(a)
    if a.get("recovered_at") is None:
        reintegration = "— (never restored)"
    elif a["reintegration_delay"]["n_defined"] == 0:  # restored, yet isolated or watched again in every seed
        reintegration = f"never (0/{seeds} seeds)"
    else:
        reintegration = fmt_range(a["reintegration_delay"])
    return [detection, f"{a['closure_seeds']}/{seeds} seeds", reintegration]


def agents_table(summary: dict) -> str:
    rows = []
    n_tasks = summary.get("n_tasks")
    for r in summary.get("results", []):
        for a in r.get("agents") or []:
            end = a["recovered_at"] - 1 if a.get("recovered_at") else n_tasks
            rows.append(
                [*_labels(r), f"{a.get('profile', '')} (agent {a['agent']})", f"{a['degraded_at']}–{end}",
                 *agent_cells(r, a)]
            )  # fmt: skip
    headers = (
        "method",
        "dataset",
        "pair",
        "agent",
        "degraded tasks",
        "detection delay",
        "closure",
        "reintegration delay",
    )
    return md_table(headers, rows) if rows else ""


SCALE_COLUMNS = (  # (key, header, digits, scale) in the order the scaling table shows them
    ("acc_healthy", "acc H", 3, 1.0),
    ("acc_degraded", "acc D", 3, 1.0),
    ("isolated_degraded", "isolated at end", 1, 1.0),
    ("degraded", "degraded", 0, 1.0),
    ("missed", "missed", 1, 1.0),
    ("false_isolations", "false isolations", 2, 1.0),
    ("false_isolated_agents", "agents falsely isolated", 2, 1.0),
    ("detection_delay_mean", "detection delay", 1, 1.0),
    ("onset_detections", "detections before onset", 1, 1.0),
    ("edges", "edges", 0, 1.0),
    ("edge_fraction", "edge fraction", 4, 1.0),
    ("max_ability_distance", "max ability distance", 0, 1.0),
    ("tokens_per_task_healthy", "tokens/task H (k)", 1, 1e-3),
    ("tokens_per_task_degraded", "tokens/task D (k)", 1, 1e-3),
)


def scaling_table(entries: list[dict]) -> str:
    columns, seen = [], set()
    for key, header, digits, scale in SCALE_COLUMNS:
        if header not in seen and any(key in e for e in entries):
            columns.append((key, header, digits, scale))
            seen.add(header)

    def show(value: object, digits: int, scale: float) -> str:
        if isinstance(value, dict):
            return fmt(value, digits, scale)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{value * scale:.{digits}f}"
        return "—" if value is None else str(value)

    rows = [
        [str(e["n_agents"]), str(e["topology"]), *(show(e.get(k), d, s) for k, _, d, s in columns)]
        for e in sorted(entries, key=lambda e: (str(e["topology"]), int(e["n_agents"])))
    ]
    return md_table(["agents", "topology", *(h for _, h, _, _ in columns)], rows)


def state_changes_table(states: pl.DataFrame, seed: int, dataset: str, pair: str) -> tuple[str, int]:
    changes = states.filter(
        (pl.col("seed") == seed) & (pl.col("dataset") == dataset) & (pl.col("pair") == pair)
    )
    rows = []
    for row in changes.head(STATE_CHANGES_SHOWN).iter_rows(named=True):
        z = "—" if row["z"] is None else f"{row['z']:.2f}"
        rows.append(
            [
                str(row["t"]),
                metrics.agent_label(row["agent"]),
                row["from"],
                row["to"],
                z,
                row["reason"],
                "yes" if row["probe"] else "",
                "yes" if row["degraded"] else "",
            ]
        )
    headers = ("t", "agent", "from", "to", "z", "reason", "probe", "degraded")
    return md_table(headers, rows), changes.height


# ----------------------------------------------------------------------------------------------
# Commands that reproduce the run
# ----------------------------------------------------------------------------------------------


def _seed_flags(seeds: Sequence[int]) -> list[str]:
    seeds = [int(s) for s in seeds]
    if seeds == list(range(len(seeds))):
        return ["--seeds", str(len(seeds))]
    return ["--seed-list", *map(str, seeds)]


def _common_flags(exp: dict, pair: str | None, arm_field: str | None = None) -> list[str]:
    """The flags every experiment shares; `pair` None leaves --pair out (detectors takes --pairs),
    and `arm_field` is the protocol field the command's arm flag sets (ablate's variant)."""
    flags = [*_seed_flags(exp.get("seeds", [0]))] + (["--pair", pair] if pair is not None else [])
    if exp.get("name") in ("main", "recovery") and exp.get("methods"):
        flags += ["--methods", *exp["methods"]]
    for key, flag in (("engine", "--engine"), ("slots", "--slots")):
        if key in exp:
            flags += [flag, str(exp[key])]
    for key, flag in (("profiles_dir", "--profiles-dir"), ("params_dir", "--params-dir")):
        if exp.get(key) is not None:
            flags += [flag, str(exp[key])]
    defaults = dataclasses.asdict(ProtocolParams())
    for key, value in recorded_protocol(exp.get("protocol") or {}).items():
        if key in defaults and value != defaults[key] and key != arm_field:
            flags += [f"--protocol.{key.replace('_', '-')}", str(value)]
    return flags + _backend_flags(exp)


def _backend_flags(exp: dict) -> list[str]:
    """The backend and the live settings that decide results (servers, models, questions); where
    the servers run a rerun may differ, but the flags name the ones the run used."""
    live = exp.get("live") or {}
    flags = ["--backend", "live"] if exp.get("backend") == "live" else []
    for key, flag in (("strong_urls", "--strong-url"), ("weak_urls", "--weak-url")):
        if live.get(key):
            flags += [flag, ",".join(live[key])]
    for key in ("strong_model", "weak_model", "max_tokens"):
        if live.get(key) is not None:
            flags += ["--" + key.replace("_", "-"), str(live[key])]
    if live and (exp.get("backend") != "live" or live.get("data", "hub") != "hub"):
        flags += ["--data", str(live.get("data", "hub"))]
    if live.get("tokenizer") is not None:
        flags += ["--tokenizer", str(live["tokenizer"])]
    if exp.get("backend") == "live" and live.get("reasoning_effort", "medium") != "medium":
        flags += ["--reasoning-effort", str(live["reasoning_effort"])]
    for field, flag in (("hub_id", "--hub-id"), ("split", "--hub-split"), ("config", "--hub-config"),
                        ("revision", "--hub-revision")):  # fmt: skip
        given = [f"{d}={source[field]}" for d, source in (live.get("hub") or {}).items() if source.get(field)]
        if given:
            flags += [flag, *given]
    return flags


def _pinned(config: dict) -> dict:
    """config.json's experiment with each hub dataset read at no given revision pinned to the
    commit the run read (its inputs' `questions DATASET` commit), so a rerun reads the same data."""
    exp = config.get("experiment", {})
    live = exp.get("live") or {}
    hub = {d: dict(source) for d, source in (live.get("hub") or {}).items()}
    for d, source in hub.items():
        commit = (config.get("inputs") or {}).get(f"questions {d}", {}).get("commit")
        if commit and not source.get("revision"):
            source["revision"] = commit
    return {**exp, "live": {**live, "hub": hub}} if hub else exp


def reproduce_commands(config: dict, run_dir: Path | None = None, show_seed: int | None = None) -> list[str]:
    """Shell commands that re-run the experiment of config.json (one per pair, and per dataset
    where the CLI takes one), then regenerate this report. A config carrying "argv" (the
    command-line arguments the run was started with) is reproduced from it verbatim."""
    exp = _pinned(config)
    name = str(exp.get("name", "main"))
    module = f"python -m meshheal_jax.{name}"
    commands = []
    if config.get("argv"):
        commands.append(shlex.join([*module.split(), *map(str, config["argv"])]))
    elif name == "main":
        for pair in exp.get("pairs", ["default"]):
            flags = [
                *_common_flags(exp, pair),
                "--datasets",
                *exp.get("datasets", []),
                "--tasks",
                str(exp.get("n_tasks", 504)),
                "--degraded",
                *map(str, exp.get("degraded", [])),
            ]
            commands.append(shlex.join([*module.split(), *flags]))
    elif name == "recovery":
        for pair in exp.get("pairs", ["default"]):
            for dataset in exp.get("datasets", ["math"]):
                flags = [
                    *_common_flags(exp, pair),
                    "--dataset",
                    dataset,
                    "--tasks",
                    str(exp.get("n_tasks", 630)),
                ]
                commands.append(shlex.join([*module.split(), *flags]))
    elif name in ("ablate", "detectors"):  # this arm's folder: the command run for this arm alone
        arm, field = ("--variants", "variant") if name == "ablate" else ("--detectors", "detector")
        value = (exp.get("protocol") or {}).get(field, dataclasses.asdict(ProtocolParams())[field])
        pairs = exp.get("pairs", ["default"])
        per_command = [[pair] for pair in pairs] if name == "ablate" else [pairs]  # detectors: --pairs
        for chosen in per_command:
            flags = _common_flags(exp, chosen[0] if name == "ablate" else None, field)
            if name == "detectors":
                flags += ["--pairs", *chosen]
            flags += ["--dataset", *exp.get("datasets", ["bbh"])[:1], "--tasks", str(exp.get("n_tasks", 504))]
            if exp.get("degraded"):
                flags += ["--degraded", *map(str, exp["degraded"])]
            commands.append(shlex.join([*module.split(), *flags, arm, str(value)]))
    else:  # scale (this topology's folder) and others: the shared flags, the network and its data
        for pair in exp.get("pairs", ["default"]):
            flags = _common_flags(exp, pair)
            if name == "scale" and "n_agents" in exp:
                flags += ["--agents", str(exp["n_agents"]), "--dataset", *exp.get("datasets", ["bbh"])[:1]]
                if exp.get("sparse") or exp.get("topology") == "sparse":
                    flags.append("--sparse")
                if exp.get("topology") == "file" and exp.get("edges_file"):
                    flags += ["--edges", str(exp["edges_file"])]
                if exp.get("graph_seed", 0) != 0:
                    flags += ["--graph-seed", str(exp["graph_seed"])]
                tables = list(exp.get("tables") or runner.TABLES)
                if tables != list(runner.TABLES):
                    flags += ["--tables", *tables]
            commands.append(shlex.join([*module.split(), *flags]))
    live = exp.get("live") or {}
    served = {role: live.get(f"{role}_served_name") for role in ("strong", "weak")}
    if any(served.values()) and not config.get("argv"):  # no flag: --live-config sets them
        names = ", ".join(f"{role}_served_name = {json.dumps(name)}" for role, name in served.items() if name)
        commands = [f"{c}  # and a --live-config FILE holding {names}" for c in commands]
    target = "RUN_DIR" if run_dir is None else str(run_dir)
    shown = [] if show_seed is None else ["--show-seed", str(show_seed)]
    commands.append(shlex.join(["python", "-m", "meshheal_jax.report", target, *shown]))
    return commands


# ----------------------------------------------------------------------------------------------
# report.md
# ----------------------------------------------------------------------------------------------


def render(run: RunFolder, figures: list[tuple[str, Path]]) -> str:
    config, summary, exp = run.config, run.summary, run.experiment
    lines = [f"# MeshHeal run: {run.name} ({run.path.name})", ""]
    facts = [
        f"engine {summary.get('engine', exp.get('engine', '?'))}",
        f"backend {summary.get('backend', exp.get('backend', '?'))}",
        f"{summary.get('n_agents', exp.get('n_agents', '?'))} agents",
        f"{summary.get('n_tasks', exp.get('n_tasks', '?'))} tasks per stream",
        f"seeds {', '.join(map(str, exp.get('seeds', [])))}",
        f"created {config.get('created', '?')}",
        f"git revision {config.get('git_revision') or 'unknown'}",
    ]
    lines += [
        "; ".join(facts) + ".",
        "",
        (
            "Numbers are mean ± sample std over seeds; delays are mean ± std (min–max) with n = seeds where "
            "the event happened (“never” where it did not)."
        ),
        "",
    ]

    sections = []
    entries = scaling_entries(summary)
    if entries:
        sections.append(("Network scaling", scaling_table(entries)))
    table = results_table(summary)
    if table:
        sections.append(
            (
                "Accuracy, calls and tokens",
                "H: tasks with no agent degraded; D: tasks with some agent degraded; D − H is paired "
                "within seed; tokens in thousands per task.\n\n" + table,
            )
        )
    if any(len(r.get("phases") or []) > 2 for r in summary.get("results", [])):
        sections.append(("Per phase", phases_table(summary)))
    table = parse_table(summary)
    if table and (
        summary.get("backend") == "live" or any(parse_problems(r) for r in summary.get("results", []))
    ):
        sections.append(
            (
                "Parse failures",
                "Model replies per stream (samples: an initial review counts three), mean ± std over seeds; "
                f"{PARSE_FALLBACKS}. Parsed on retry: the first reply did not parse, the retry did.\n\n"
                + table,
            )
        )
    table = agents_table(summary)
    if table:
        sections.append(
            (
                "Self-healing per degraded agent",
                "Detection delay: tasks from degradation to the first isolation (k before onset: k of the "
                f"n detections were {BEFORE_ONSET}); closure: seeds where "
                "the agent stays isolated to the end of its degradation; reintegration delay: tasks "
                "from restoration to the start of its final run in state normal.\n\n" + table,
            )
        )
    for title, body in sections:
        lines += [f"## {title}", "", body, ""]

    if figures:
        lines += ["## Figures", ""]
        for caption, path in figures:
            lines += [f"### {caption}", "", f"![{caption}]({path.relative_to(run.path).as_posix()})", ""]

    if run.name == "recovery" and run.states is not None and exp.get("seeds"):
        seed, dataset, pair = run.shown_seed, exp["datasets"][0], exp["pairs"][0]
        table, n = state_changes_table(run.states, seed, dataset, pair)
        cut = (
            f" (first {STATE_CHANGES_SHOWN} of {n}; all in states.parquet)" if n > STATE_CHANGES_SHOWN else ""
        )
        lines += [
            f"## State changes, seed {seed} ({dataset}, pair {pair})",
            "",
            f"<details><summary>{n} state changes{cut}</summary>",
            "",
            table,
            "",
            "</details>",
            "",
        ]

    lines += [
        "## Reproduce",
        "",
        (
            "Re-run the experiment (a new run folder under `runs/`; add `--out DIR` to choose it), then "
            "regenerate this report:"
        ),
        "",
        "```bash",
        *reproduce_commands(config, run.path, run.show_seed),
        "```",
        "",
    ]
    lines += [
        "## Files",
        "",
        "- `config.json`: the resolved configuration (below)",
        "- `summary.json`: every statistic of the tables above",
        (
            "- `tasks.parquet`, `reviews.parquet`, `states.parquet`, `calls.parquet`: one row per task, "
            "reviewed output, state change and model call (every seed)"
        ),
        "",
    ]
    lines += ["## Config", "", "```json", json.dumps(config, indent=2), "```", ""]
    return "\n".join(lines)


def scale_root_summary(out: Path) -> dict | None:
    """The combined summary.json of a `scale` command's --out (its arms' folders beside it), or
    None where `out` is not one."""
    if (out / "config.json").exists() or not (out / "summary.json").is_file():
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return summary if isinstance(summary, dict) and summary.get("experiment") == "scale" else None


def write_scale_report(out: Path, summary: dict) -> Path:
    """report.md and scaling.png of a `scale` command's --out: its topologies side by side, from
    the combined summary.json (each arm's folder has its own report: `report <out>/<topology>`)."""
    from meshheal_jax import plots

    entries = scaling_entries(summary)
    if not entries:
        raise MeshHealError(f"{out / 'summary.json'} holds no scale results")
    figure = plots.scaling_plot(entries, out / SCALING_PNG)
    arms = [Path(str(r.get("run_dir", ""))).name or str(r["topology"]) for r in summary["results"]]
    lines = [
        f"# scale: {', '.join(str(e['topology']) for e in entries)}",
        "",
        (
            f"engine {summary.get('engine', '?')}; backend {summary.get('backend', '?')}; slots {summary.get('slots', '?')}; "
            f"{summary.get('n_agents', '?')} agents."
        ),
        "",
        (
            "Numbers are mean ± sample std over seeds; detection delay is the mean over the degraded agents "
            f"detected; detections before onset: those per seed that were {BEFORE_ONSET}."
        ),
        "",
        "## Network scaling",
        "",
        scaling_table(entries),
        "",
        "## Figures",
        "",
        f"![Network scaling]({figure.relative_to(out).as_posix()})",
        "",
        "## Arms",
        "",
        (
            "Each topology's run folder (its config, tables and summary); `python -m meshheal_jax.report "
            "FOLDER` writes its report, with the command that runs it again:"
        ),
        "",
        *(f"- [`{arm}/`]({arm}/)" for arm in arms),
        "",
    ]
    path = out / REPORT_NAME
    runner.write_atomic(path, "\n".join(lines))
    return path


def write_report(run_dir: Path | str, show_seed: int | None = None) -> Path:
    """Redraw the run's figures and write report.md in the run folder; returns its path. A sweep's
    run folder gets the sweep's report (`sweep.write_report`: the table per grid point and the
    trade-off figures), and a scale command's --out the table and figure of its topologies
    (`write_scale_report`). `show_seed`: a recovery run's seed shown (default its first)."""
    scale_root = scale_root_summary(Path(run_dir))
    if scale_root is not None:
        if show_seed is not None:
            raise MeshHealError(f"--show-seed chooses a recovery run's trajectory; {run_dir} is a scale run")
        return write_scale_report(Path(run_dir), scale_root)
    config_path = Path(run_dir) / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError:
            config = None  # load_run names the problem, as it does a config that is not a run's
        experiment = config.get("experiment") if isinstance(config, dict) else None
        name = experiment.get("name") if isinstance(experiment, dict) else None
        if name == "sweep":
            from meshheal_jax import sweep

            return sweep.write_report(run_dir)
    run = dataclasses.replace(load_run(run_dir), show_seed=show_seed)
    if show_seed is not None and run.name != "recovery":
        raise MeshHealError(f"--show-seed chooses a recovery run's trajectory; {run_dir} is a {run.name} run")
    run.shown_seed  # noqa: B018 -- a seed the run lacks is refused before anything is drawn
    figures = make_plots(run)
    path = run.path / REPORT_NAME
    runner.write_atomic(path, render(run, figures))
    return path


def body(cfg: ReportConfig) -> None:
    path = write_report(cfg.run_dir, cfg.show_seed)
    print(f"report: {path}")


def cli() -> None:
    entrypoint(ReportConfig, body, __doc__, "stopped")


if __name__ == "__main__":
    cli()
