"""How sweep, ablate and recovery turn their flags into grid points and arms, and what their tables
print: pinned without running an experiment (synthetic summaries, stubbed runs; a few seconds)."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import tyro

from meshheal_jax import ablate, metrics, recovery, runner, sweep
from meshheal_jax.config import VARIANTS, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair

stat = metrics.stat


def captured_tables(monkeypatch, module) -> list:
    """The rich tables `module` prints, kept instead of printed."""
    tables: list = []
    monkeypatch.setattr(module, "print_table", tables.append)
    return tables


def rows(table) -> list[dict[str, str]]:
    """A rich table's rows as {header: cell}."""
    columns = table.columns
    return [{c.header: c._cells[i] for c in columns} for i in range(table.row_count)]


def one_axis_batch(grid: dict[str, tuple], protocol: ProtocolParams | None = None):
    """(points, batch, per-stream parameters) of a grid over one 42-task bbh stream per point."""
    points = sweep.grid_points(grid, protocol or ProtocolParams(), load_pair("default"))
    exp = runner.Experiment(name="sweep", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42)
    batch = sweep.build_batch(exp, points)
    return points, batch, sweep.stream_params(batch)


# ----------------------------------------------------------------------------------------------
# sweep: the grid
# ----------------------------------------------------------------------------------------------


def test_a_parameter_named_twice_is_refused():
    """parse_grid: "--grid names alpha twice", not the later list silently replacing the first."""
    with pytest.raises(MeshHealError, match="--grid names alpha twice"):
        sweep.parse_grid(["alpha=1.0,1.2", "alpha=1.4"])


def test_a_single_valued_axis_is_a_fixed_value_not_an_ineffective_one():
    """check_effect compares values of a swept name only where it has two or more: a one-value
    axis (`--grid alpha=1.2 beta=1.6,2.0`, or START:STOP:1) is accepted."""
    grid = sweep.parse_grid(["alpha=1.2", "beta=1.6,2.0"])
    points, batch, params = one_axis_batch(grid)
    assert [p.values for p in points] == [{"alpha": 1.2, "beta": 1.6}, {"alpha": 1.2, "beta": 2.0}]
    sweep.check_effect(grid, batch, params)  # no error


def test_a_relative_only_parameter_is_refused_under_the_absolute_detector():
    """DETECTOR_FIELDS: z_scale_floor is read by the relative detector only; under absolute a sweep
    of it would repeat one configuration, so it is refused naming the detector."""
    grid = sweep.parse_grid(["z_scale_floor=0.1,0.2"])
    _, batch, params = one_axis_batch(grid, ProtocolParams(detector="absolute"))
    with pytest.raises(MeshHealError, match="z_scale_floor is not read by the absolute detector"):
        sweep.check_effect(grid, batch, params)


def test_calls_table_only_with_the_calls_flag():
    """decisions X5: a sweep writes calls.parquet only with --calls."""
    plain = sweep.experiment(tyro.cli(sweep.SweepConfig, args=["--grid", "alpha=1.0,1.2"]))
    calls = sweep.experiment(tyro.cli(sweep.SweepConfig, args=["--grid", "alpha=1.0,1.2", "--calls"]))
    assert plain.tables == ("tasks", "reviews", "states")
    assert calls.tables == ("tasks", "reviews", "states", "calls")


def test_the_rebuilt_reproduce_command_gives_the_same_grid(tmp_path):
    """Without argv in config.json the command is rebuilt from the config: its --grid words parse
    back to the grid that ran (value lists, not START:STOP:COUNT ranges)."""
    grid = {"alpha": [1.0, 1.2, 1.4], "probe_interval": [5, 10]}
    exp = runner.Experiment(name="sweep", datasets=("bbh",), pairs=("default",), seeds=(0, 1), n_tasks=84)
    command, _ = sweep.reproduce_commands({"experiment": exp.to_json(), "sweep": {"grid": grid}}, tmp_path)
    again = tyro.cli(sweep.SweepConfig, args=shlex.split(command)[3:])
    parsed = sweep.parse_grid([item for group in again.grid for item in group])
    assert {k: list(v) for k, v in parsed.items()} == grid
    assert (again.tasks, again.seed_tuple(), again.datasets) == (84, (0, 1), ("bbh",))


def test_the_rebuilt_reproduce_command_keeps_chunk_and_calls(tmp_path):
    """The rebuilt command carries a non-default --chunk and --calls (config.json's "sweep"
    records both), so the rerun keeps the same tables and compiled-call size."""
    exp = runner.Experiment(name="sweep", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=84)
    config = {"experiment": exp.to_json(), "sweep": {"grid": {"alpha": [1.0]}, "chunk": 64, "calls": True}}
    command, _ = sweep.reproduce_commands(config, tmp_path)
    again = tyro.cli(sweep.SweepConfig, args=shlex.split(command)[3:])
    assert (again.chunk, again.calls) == (64, True)
    default = {"experiment": exp.to_json(), "sweep": {"grid": {"alpha": [1.0]}, "chunk": 512, "calls": False}}
    command, _ = sweep.reproduce_commands(default, tmp_path)
    assert "--chunk" not in command and "--calls" not in command


def test_record_tables_are_labelled_with_their_stream_s_grid_point():
    """label_frames: every stream's rows carry its own grid point's index (summarize selects a
    point's rows by it) and swept values; an integer parameter stays an integer column."""
    grid = sweep.parse_grid(["alpha=1.0,1.2", "probe_interval=5,10"])
    _, batch, _ = one_axis_batch(grid)
    per_stream = [{"tasks": pl.DataFrame({"t": [1]})} for _ in batch.specs]
    (tasks,) = sweep.label_frames(batch, grid, per_stream, ("tasks",)).values()
    assert tasks["grid_point"].to_list() == [0, 1, 2, 3]
    assert tasks["alpha"].to_list() == [1.0, 1.0, 1.2, 1.2]
    assert tasks["probe_interval"].to_list() == [5, 10, 5, 10]
    assert (tasks["alpha"].dtype, tasks["probe_interval"].dtype) == (pl.Float64, pl.Int64)


# ----------------------------------------------------------------------------------------------
# sweep: table and maps
# ----------------------------------------------------------------------------------------------


def sweep_result(point: int, alpha: float, beta: float, **stats: float) -> dict:
    """A summary entry of one grid point; every metric a one-seed stat."""
    keys = ("acc_healthy", "acc_degraded", "detection_delay", "missed", "false_isolations",
            "false_isolated_agents", "tokens_per_task_healthy", "tokens_per_task_degraded")  # fmt: skip
    return {"dataset": "bbh", "grid_point": point, "values": {"alpha": alpha, "beta": beta},
            **{k: stat([stats.get(k, 0.0)]) for k in keys}}  # fmt: skip


def test_sweep_table_missed_column_reads_missed():
    result = sweep_result(0, 1.0, 1.6, missed=0.5, false_isolations=1.0, false_isolated_agents=2.0)
    headers, table = sweep.summary_rows({"grid": {"alpha": [1.0], "beta": [1.6]}, "results": [result]}, "bbh")
    row = dict(zip(headers, table[0]))
    assert (row["missed"], row["false isol."], row["false-isol. agents"]) == ("0.50", "1.00", "2.00")


def test_grid_maps_put_the_first_parameter_down_and_the_second_across(tmp_path, monkeypatch):
    """grid_maps: "first parameter down, second across"; cell (a, b) is the point
    (first[a], second[b]); the defaults' cell (alpha 1.2, beta 2.0) outlined."""
    from meshheal_jax import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    alphas, betas = [1.0, 1.2], [1.6, 2.0, 2.4]
    results = [sweep_result(3 * a + b, alpha, beta, detection_delay=10.0 * alpha + beta)
               for a, alpha in enumerate(alphas) for b, beta in enumerate(betas)]  # fmt: skip
    summary = {"grid": {"alpha": alphas, "beta": betas}, "results": results, "seeds": [0], "n_tasks": 84}
    sweep.grid_maps(summary, tmp_path / "maps.png")
    delay_ax = figures[0].axes[0]
    assert (delay_ax.get_ylabel(), delay_ax.get_xlabel()) == ("alpha", "beta")
    cells = delay_ax.images[0].get_array()
    assert cells.shape == (2, 3)
    assert np.allclose(cells, [[10.0 * a + b for b in betas] for a in alphas])
    (outline,) = delay_ax.patches
    assert outline.get_xy() == (1 - 0.5, 1 - 0.5)  # beta 2.0 across, alpha 1.2 down


# ----------------------------------------------------------------------------------------------
# ablate
# ----------------------------------------------------------------------------------------------


def ablate_result(variant: str, **values) -> dict:
    return {"variant": variant, "dataset": "bbh", "pair": "default", "seeds": [0, 1],
            "acc_healthy": stat([0.9]), "acc_degraded": stat([0.6]), "phase_change": stat([-0.3]),
            "calls_per_task_healthy": stat([values.get("calls_h", 5.0)]),
            "calls_per_task_degraded": stat([values.get("calls_d", 7.0)]),
            "tokens_per_task_healthy": stat([1000.0]), "tokens_per_task_degraded": stat([3000.0]),
            "review_audit": {"takeovers": stat([4.0]), "probe_takeovers": stat([1.0])},
            "agents": [{"agent": 2, "detection_delay": stat([]), "closure_seeds": 0},
                       {"agent": 4, "detection_delay": stat([]), "closure_seeds": 1}],
            "n_degraded": 2, "n_healthy": 4, "missed_total": 3, "falsely_isolated_healthy_total": 1,
            "false_isolations": stat([0.5])}  # fmt: skip


def test_ablate_tables_read_their_columns(monkeypatch):
    tables = captured_tables(monkeypatch, ablate)
    ablate.print_summary({"engine": "jax", "backend": "emulated", "results": [ablate_result("no_takeover")]})
    (components,), (detection,) = rows(tables[0]), rows(tables[1])
    assert components["variant"] == "no_takeover"
    assert (components["calls H"], components["calls D"]) == ("5.0", "7.0")
    assert (components["takeovers/seed"], components["on probes/seed"]) == ("4.0", "1.0")
    assert detection["missed (total)"] == "3 of 4"  # of 2 degraded agents x 2 seeds
    assert detection["falsely isolated healthy (total)"] == "1 of 8"  # of 4 healthy agents x 2 seeds
    assert detection["closure seeds (per agent)"] == "0/1 of 2"


def test_ablate_arms_run_their_variant():
    config = tyro.cli(ablate.AblateConfig, args=["--seeds", "1", "--tasks", "84"])
    assert [ablate.experiment(config, v).protocol.variant for v in VARIANTS] == list(VARIANTS)


def test_ablate_refuses_protocol_variant_and_repeated_variants(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("ran")

    monkeypatch.setattr(ablate, "run_all", no_run)
    out = ["--out", str(tmp_path)]
    with pytest.raises(MeshHealError, match="it takes --variants, not --protocol.variant"):
        ablate.body(tyro.cli(ablate.AblateConfig, args=["--protocol.variant", "no_takeover", *out]))
    with pytest.raises(MeshHealError, match=r"variants must be distinct, got \['full', 'full'\]"):
        ablate.body(tyro.cli(ablate.AblateConfig, args=["--variants", "full", "full", *out]))


def test_run_all_labels_each_entry_with_its_arm(tmp_path, monkeypatch):
    """Each combined entry names the variant and detector its arm ran (ablate: the variant is the
    key; detectors: the detector is)."""
    config = tyro.cli(ablate.AblateConfig, args=["--seeds", "1", "--tasks", "84"])
    experiments = {v: ablate.experiment(config, v) for v in ("full", "no_takeover")}

    def fake_run(exp, run_dir, **kwargs):
        summary = {"engine": "jax", "backend": "emulated", "slots": 1, "n_agents": 6, "n_tasks": 84,
                   "results": [{"method": "meshheal", "pair": "default", "dataset": "bbh"}]}  # fmt: skip
        return SimpleNamespace(summary=summary, run_dir=Path(run_dir))

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr(ablate, "per_seed_detection", lambda *args: {})
    summary = ablate.run_all("ablate", experiments, tmp_path / "out", False, "--variants")
    labels = [(r["variant"], r["detector"], Path(r["run_dir"]).name) for r in summary["results"]]
    assert labels == [("full", "relative", "full"), ("no_takeover", "relative", "no_takeover")]


# ----------------------------------------------------------------------------------------------
# recovery
# ----------------------------------------------------------------------------------------------


def recovery_result(method: str, detector: str) -> dict:
    names = ("healthy", "A5 degraded", "A3+A5 degraded", "A3 degraded, A5 restored", "both restored")
    phases = [{"name": name, "acc": stat([0.5 + 0.1 * k]), "tokens_per_task": stat([1000.0 * (k + 1)]),
               "calls_per_task": stat([float(k + 1)])} for k, name in enumerate(names)]  # fmt: skip
    agents = [{"agent": 4, "profile": "A5", "degraded_at": 127, "recovered_at": 379, "detection_delay": stat([5.0]),
               "closure_seeds": 1, "reintegration_delay": stat([7.0])},
              {"agent": 2, "profile": "A3", "degraded_at": 253, "recovered_at": 505, "detection_delay": stat([6.0]),
               "closure_seeds": 1, "reintegration_delay": stat([8.0])}]  # fmt: skip
    return {"method": method, "variant": "full", "detector": detector, "dataset": "math", "pair": "default",
            "seeds": [0], "phases": phases, "agents": agents, "missed": stat([0.0]),
            "false_isolations": stat([2.0]), "false_isolated_agents": stat([1.0])}  # fmt: skip


def test_recovery_tables_read_their_phase_and_columns(monkeypatch):
    """spec/experiments.md §2: five phases of 126 tasks, 1–126 ... 505–630; A5 degraded 127–378,
    A3 253–504; tokens in thousands; missed and false isolations in their own columns."""
    tables = captured_tables(monkeypatch, recovery)
    summary = {"n_tasks": 630, "backend": "emulated", "engine": "jax",
               "results": [recovery_result("meshheal", "relative"), recovery_result("raps", "none")]}  # fmt: skip
    states = pl.DataFrame(schema=metrics.SCHEMAS["states"])
    recovery.print_summary(summary, states, 0)
    accuracy, tokens, calls, agents, errors = (rows(t) for t in tables[:5])
    assert [r["tasks"] for r in accuracy] == ["1–126", "127–252", "253–378", "379–504", "505–630"]
    assert [r["meshheal"] for r in accuracy] == ["0.500", "0.600", "0.700", "0.800", "0.900"]
    assert [r["raps"] for r in tokens] == ["1.0", "2.0", "3.0", "4.0", "5.0"]
    assert [r["meshheal"] for r in calls] == ["1.0", "2.0", "3.0", "4.0", "5.0"]
    assert [r["degraded"] for r in agents if r["method"] == "meshheal"] == ["127–378", "253–504"]
    mesh = next(r for r in errors if r["method"] == "meshheal")
    assert (mesh["missed"], mesh["false isolations"]) == ("0.00", "2.00")
    assert mesh["falsely isolated agents"] == "1.00"


def test_recovery_shows_the_first_seed_by_default(tmp_path, monkeypatch):
    """--show-seed: "default: the first" of the seeds run."""
    shown = []
    results = SimpleNamespace(summary={"results": []}, states=None, run_dir=tmp_path)
    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: results)
    monkeypatch.setattr(recovery, "print_summary", lambda summary, states, seed: shown.append(seed))
    monkeypatch.setattr(recovery.report, "write_report", lambda run_dir, seed: tmp_path / "report.md")
    monkeypatch.setattr(recovery.report, "prefix_note", lambda summary: None)
    seeds = ["--seed-list", "5", "3", "--quiet"]
    recovery.body(tyro.cli(recovery.RecoveryConfig, args=seeds))
    recovery.body(tyro.cli(recovery.RecoveryConfig, args=[*seeds, "--show-seed", "3"]))
    assert shown == [5, 3]
