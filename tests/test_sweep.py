"""The parameter sweep: a grid point equals a single run, one trace for the whole grid, bad grids exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from meshheal_jax import engine, runner, sweep
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair

GRID = (("alpha=1.0,1.4", "beta=1.6,2.0"),)
SEEDS = (0, 1)
TASKS = 126  # bbh, degraded from task 64; warm-up 30
TABLES = ("tasks", "reviews", "states")


def assert_same_records(ours: pl.DataFrame, single: pl.DataFrame, what: str) -> None:
    """Row by row: every column exact except float columns (z, s_u, ...), which may differ in the
    last bit (the batched-parameter program computes sqrt/divisions in another vectorised form; the
    engine compares them with the same 1e-9 tolerance in favour of crossing), so |a - b| <= 1e-9."""
    assert ours.columns == single.columns and ours.height == single.height, what
    for col in ours.columns:
        a, b = ours[col], single[col]
        if a.dtype == pl.Float64:
            assert a.is_null().equals(b.is_null()), (what, col)
            diff = (a - b).abs().fill_null(0.0)
            assert diff.max() is None or diff.max() <= 1e-9, (what, col, diff.max())
        else:
            assert a.equals(b), (what, col)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 2 x 2 grid x 2 seeds sweep, several chunks; the traces of run_rounds it caused."""
    engine.run_rounds.clear_cache()
    before = engine.TRACES["run_rounds"]
    cfg = sweep.SweepConfig(grid=GRID, seed_list=SEEDS, tasks=TASKS, datasets=("bbh",), chunk=96,
                            out=tmp_path_factory.mktemp("sweep") / "run", quiet=True)  # fmt: skip
    result = sweep.run(cfg, progress=False)
    return result, engine.TRACES["run_rounds"] - before


def test_compiled_once_for_the_whole_grid(swept):
    result, traces = swept
    assert result.summary["n_points"] == 4
    assert result.frames["tasks"]["t"].max() == TASKS  # several chunks of 96 rounds ran
    assert traces == 1


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.6), (1.4, 2.0)])
def test_grid_point_equals_a_single_run(swept, alpha, beta):
    """The grid point's tasks, reviews and states tables, record by record, equal those of an
    ordinary run (engine.run_streams through the runner) of that one configuration."""
    result, _ = swept
    exp = runner.Experiment(name="sweep", datasets=("bbh",), pairs=("default",), seeds=SEEDS, n_tasks=TASKS,
                            tables=TABLES, protocol=ProtocolParams(alpha=alpha, beta=beta))  # fmt: skip
    single = runner.run_jax_streams(exp, [("bbh", "default", seed) for seed in SEEDS])
    for seed, frames in zip(SEEDS, single):
        for table in TABLES:
            ours = result.frames[table].filter(
                (pl.col("alpha") == alpha) & (pl.col("beta") == beta) & (pl.col("seed") == seed)
            )
            assert ours.height > 0 or table == "states"
            assert_same_records(
                ours.drop("grid_point", "alpha", "beta"), frames[table], f"{table}, seed {seed}"
            )


def test_grid_points_differ(swept):
    """The swept values reach the engine: the states tables of the four points are not all equal."""
    result, _ = swept
    states = result.frames["states"]
    per_point = [
        states.filter(pl.col("grid_point") == k).drop("grid_point", "alpha", "beta") for k in range(4)
    ]
    assert any(not per_point[0].equals(other) for other in per_point[1:])


def test_run_folder_and_summary(swept, capsys):
    result, _ = swept
    run_dir = result.run_dir
    for name in (
        "config.json",
        "summary.json",
        "tasks.parquet",
        "reviews.parquet",
        "states.parquet",
        "tradeoff.png",
        "grid_maps.png",
        "report.md",
    ):
        assert (run_dir / name).is_file(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config[runner.RUN_MARKER] and config["sweep"]["grid"] == {"alpha": [1.0, 1.4], "beta": [1.6, 2.0]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["values"] for r in summary["results"]] == [
        {"alpha": a, "beta": b} for a in (1.0, 1.4) for b in (1.6, 2.0)
    ]  # fmt: skip
    for r in summary["results"]:
        for key in ("acc_healthy", "acc_degraded", "detection_delay", "false_isolations", "missed",
                    "tokens_per_task_healthy", "tokens_per_task_degraded"):  # fmt: skip
            assert set(r[key]) == {"mean", "std", "min", "max", "n_defined"}, key
    tasks = pl.read_parquet(run_dir / "tasks.parquet")
    assert tasks.height == 4 * len(SEEDS) * TASKS
    assert tasks.select("grid_point", "alpha", "beta").unique().height == 4
    assert "| 3 | 1.4 | 2.0 |" in (run_dir / "report.md").read_text()  # the table row of the last point
    sweep.print_summary(summary)
    out = capsys.readouterr().out
    assert "Sweep: bbh, 4 grid points" in out and "detection delay" in out
    # `python -m meshheal_jax.report RUN_DIR` regenerates a sweep's own report
    (run_dir / "report.md").unlink()
    from meshheal_jax import report

    assert report.write_report(run_dir) == run_dir / "report.md"
    assert "| 3 | 1.4 | 2.0 |" in (run_dir / "report.md").read_text()


def test_detection_delay_says_how_many_detections_were_before_onset(swept):
    """A detection delay of 0 for an agent falsely isolated before it degraded is no detection
    (decisions P5b): the table says how many were, as report and scale do."""
    result, _ = swept
    summary = json.loads((result.run_dir / "summary.json").read_text())
    for r in summary["results"]:
        assert set(r["onset_detections"]) == {"mean", "std", "min", "max", "n_defined"}
    r = dict(summary["results"][0], detection_delay=sweep.metrics.stat([0.0, 10.0]),
             onset_detections=sweep.metrics.stat([1.0, 0.0]))  # fmt: skip
    headers, rows = sweep.summary_rows(dict(summary, results=[r]), r["dataset"])
    delay = headers.index("detection delay")
    assert rows[0][delay] == "5.0 ± 7.1 n=2 (0.5 ± 0.7 before onset)"
    r["onset_detections"] = sweep.metrics.stat([0.0, 0.0])
    _, rows = sweep.summary_rows(dict(summary, results=[r]), r["dataset"])
    assert rows[0][delay] == "5.0 ± 7.1 n=2"


def test_parse_grid_forms():
    assert sweep.parse_grid(["alpha=1.0,1.2", "probe_interval=5:15:3"]) == {
        "alpha": (1.0, 1.2), "probe_interval": (5, 10, 15)}  # fmt: skip
    assert sweep.parse_grid(["beta=1.6:2.4:5"])["beta"] == (1.6, 1.8, 2.0, 2.2, 2.4)
    assert sweep.parse_grid(["weak.p_rescue=0.1,0.2"]) == {"weak.p_rescue": (0.1, 0.2)}
    for bad in (["alpha"], ["alpha=1,x"], ["probe_interval=2.5"], ["nope=1,2"], ["alpha=1,1"]):
        with pytest.raises(MeshHealError):
            sweep.parse_grid(bad)


def swept_params(item: str):
    """(grid, points, batch, per-stream parameters) of a one-parameter grid over a 42-task stream."""
    grid = sweep.parse_grid([item])
    points = sweep.grid_points(grid, ProtocolParams(), load_pair("default"))
    exp = runner.Experiment(name="sweep", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42)
    batch = sweep.build_batch(exp, points)
    return grid, points, batch, sweep.stream_params(batch)


def test_emulator_scalar_reaches_the_parameters():
    grid, points, batch, params = swept_params("weak.p_rescue=0.1,0.3")
    assert [float(p.p_rescue[1]) for p in params] == [0.1, 0.3]
    sweep.check_effect(grid, batch, params)  # no error: the engine reads it
    assert points[0].pair.strong == points[1].pair.strong and points[1].pair.weak.p_rescue == 0.3


def test_question_difficulty_is_sweepable_and_reaches_the_parameters():
    grid, _, batch, params = swept_params("strong.difficulty_spread=0,1.5")
    flat, spread = (np.asarray(p.p_part[0, 0]) for p in params)  # the strong model, first task type, per bin
    assert np.all(flat == flat[0]) and np.all(
        np.diff(spread) < 0
    )  # 0: every bin alike; 1.5: harder bins lower
    sweep.check_effect(grid, batch, params)
    with pytest.raises(MeshHealError, match="weak.review_difficulty must be finite and >= 0"):
        sweep.grid_points(
            sweep.parse_grid(["weak.review_difficulty=-1,1"]), ProtocolParams(), load_pair("default")
        )


def test_static_parameter_exits_2_naming_the_static_ones(tmp_path):
    """A real process: exit status 2 and one line saying why windows cannot be swept."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "meshheal_jax.sweep", "--grid", "alpha=1.0,1.2", "window_scores=4,8",
                           "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: window_scores cannot be swept") and "\n" not in line, line
    for word in ("static array shape", "window_shortfalls", "--protocol.window_scores"):
        assert word in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (("--grid", "alpha=1.0,1.2", "--grid", "window_shortfalls=4,8"), ("static array shape", "window_scores")),
        (("--grid", "alpha=1.2,2.4", "beta=2.0"), ("not valid", "alpha <= beta")),
        (("--grid", "strong.p_decide=0.2,0.4"), ("no effect",)),
        (("--grid", "gamma=1,2"), ("unknown sweep parameter", "alpha")),
        (("--grid", "cusum_h=0.5,1.0"), ("not read by the relative detector",)),
        (("--grid", "weak.p_fix=0.5,1.5"), ("probability",)),
        (("--grid", "strong.difficulty_spread=0,inf"), ("must be finite and >= 0, got inf",)),
        (("--grid", "beta=2.0,inf"), ("beta must be finite, got inf",)),
        ((), ("nothing to sweep",)),
        (("--grid", "alpha=1.0,1.2", "--engine", "reference"), ("only --engine jax",)),
    ],
)  # fmt: skip
def test_bad_grids_exit_2(tmp_path, monkeypatch, capsys, args, words):
    """The same entry point in-process (no compilation happens before these checks)."""
    monkeypatch.setattr(sys, "argv", ["sweep", *args, "--out", str(tmp_path / "run"), "--quiet"])
    with pytest.raises(SystemExit) as exit_:
        sweep.cli()
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error:") and "\n" not in line, line
    for word in words:
        assert word in line, line
    assert not (tmp_path / "run").exists()  # rejected before anything is written


def test_out_must_be_a_new_or_empty_folder(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("precious")
    with pytest.raises(MeshHealError, match=f"output path {a_file} exists and is not a folder"):
        sweep.prepare_out(a_file)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(MeshHealError, match="exists and is not empty .a sweep does not resume"):
        sweep.prepare_out(tmp_path / "used")
    assert sweep.prepare_out(tmp_path / "new").is_dir() and a_file.read_text() == "precious"


def test_the_reproduce_command_leaves_out_the_used_out_folder(tmp_path):
    """A sweep does not resume: the report's command without --out runs into a new folder."""
    argv = ["--grid", "alpha=1.0,1.4", "--out", "/runs/a", "--seeds", "2", "--out=/runs/b", "--quiet"]
    sweep_command, report_command = sweep.reproduce_commands({"argv": argv}, tmp_path)
    assert sweep_command == "python -m meshheal_jax.sweep --grid alpha=1.0,1.4 --seeds 2 --quiet"
    assert report_command == f"python -m meshheal_jax.report {tmp_path}"


def test_the_footer_counts_the_cores_the_process_may_use(monkeypatch):
    """Under `taskset -c 1` the footer says 1 core, as the lanes count them (engine.usable_cores)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert sweep.jax_device() == "cpu, 1 core"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert sweep.jax_device() == "cpu, 3 cores"
