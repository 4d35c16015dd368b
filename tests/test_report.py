"""Figures and report.md: real (short, reference-engine) run folders, hand-built frames, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from meshheal_jax import metrics, plots, report, runner
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import RECOVERY_PHASES, HealthSchedule, recovery_schedule

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes)"
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 300


@pytest.fixture(scope="module")
def recovery_run(tmp_path_factory) -> runner.Results:
    """A 210-task recovery stream, one seed, reference engine (a few seconds)."""
    exp = runner.Experiment(
        name="recovery", datasets=("math",), pairs=("default",), seeds=(3,), engine="reference", n_tasks=210
    )
    return runner.run(exp, tmp_path_factory.mktemp("recovery") / "run", progress=False)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> runner.Results:
    """The persistent experiment on two short BBH streams, reference engine."""
    exp = runner.Experiment(
        name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1), engine="reference", n_tasks=84
    )
    return runner.run(exp, tmp_path_factory.mktemp("main") / "run", progress=False)


# ----------------------------------------------------------------------------------------------
# report.md from real run folders
# ----------------------------------------------------------------------------------------------


def test_recovery_report(recovery_run):
    path = report.write_report(recovery_run.run_dir)
    assert path == recovery_run.run_dir / "report.md"
    text = path.read_text()
    assert text.startswith("# MeshHeal run: recovery")
    for heading in (
        "## Accuracy, calls and tokens",
        "## Per phase",
        "## Self-healing per degraded agent",
        "## State changes, seed 3",
        "## Figures",
        "## Reproduce",
        "## Config",
    ):
        assert heading in text, heading
    for name in RECOVERY_PHASES:  # per-phase table rows, with the summary's numbers
        assert f"| {name} |" in text
    result = recovery_run.summary["results"][0]
    assert f"| {report.fmt(result['phases'][0]['acc'])} |" in text
    assert "| A5 (agent 4) | 43–126 |" in text and "| A3 (agent 2) | 85–168 |" in text
    assert "![Recovery trajectory, seed 3 (math, pair default, meshheal)](trajectory_seed3.png)" in text
    assert "![Accuracy per phase](phase_accuracy.png)" in text
    assert_png(recovery_run.run_dir / "trajectory_seed3.png")
    assert_png(recovery_run.run_dir / "phase_accuracy.png")
    assert (
        "python -m meshheal_jax.recovery --seed-list 3 --pair default --methods meshheal --engine reference --slots 1 "
        "--dataset math --tasks 210" in text
    )
    config = json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert config == json.loads((recovery_run.run_dir / "config.json").read_text())


def test_recovery_report_shows_the_seed_asked_for(tmp_path):
    exp = runner.Experiment(name="recovery", methods=("meshheal",), datasets=("math",), pairs=("default",),
                            seeds=(3, 4), engine="reference", n_tasks=210)  # fmt: skip
    run_dir = runner.run(exp, tmp_path / "run", progress=False).run_dir
    text = report.write_report(run_dir, show_seed=4).read_text()
    assert "## State changes, seed 4 (math, pair default)" in text and "trajectory_seed4.png" in text
    assert (run_dir / "trajectory_seed4.png").is_file()
    assert f"python -m meshheal_jax.report {run_dir} --show-seed 4" in text
    with pytest.raises(MeshHealError, match=r"--show-seed 9 is not among the run's seeds \[3, 4\]"):
        report.write_report(run_dir, show_seed=9)


def test_show_seed_is_for_recovery_runs(main_run):
    with pytest.raises(
        MeshHealError, match="--show-seed chooses a recovery run's trajectory; .* is a main run"
    ):
        report.write_report(main_run.run_dir, show_seed=0)


def test_agent_cells_say_never_for_a_detector_and_undefined_for_none():
    """Reintegration of a restored agent: a delay over the seeds where it came back, "never" where
    it came back in none (MeshHeal: a metric, null in every seed), "undefined" without a detector."""
    delay = {"mean": 12.0, "std": 0.0, "min": 12.0, "max": 12.0, "n_defined": 1}
    never = {"mean": None, "std": None, "min": None, "max": None, "n_defined": 0}
    r = {"seeds": [0, 1, 2], "detector": "relative"}
    a = {"detection_delay": delay, "closure_seeds": 2, "recovered_at": 379}
    assert report.agent_cells(r, {**a, "reintegration_delay": delay})[2] == "12.0 ± 0.0 (12–12) n=1"
    assert report.agent_cells(r, {**a, "reintegration_delay": never})[2] == "never (0/3 seeds)"
    assert (
        report.agent_cells(r, {**a, "recovered_at": None, "reintegration_delay": never})[2]
        == "— (never restored)"
    )
    baseline = {**r, "detector": runner.NO_DETECTOR}
    assert report.agent_cells(baseline, {**a, "reintegration_delay": never}) == [
        report.NEVER_ISOLATED,
        report.NOT_ESTABLISHED,
        report.UNDEFINED,
    ]


def test_main_report(main_run):
    text = report.write_report(main_run.run_dir).read_text()
    assert "| method | dataset | pair | acc H | acc D |" in text
    result = main_run.summary["results"][0]
    acc_h, acc_d = report.fmt(result["acc_healthy"]), report.fmt(result["acc_degraded"])
    assert f"| meshheal | bbh | default | {acc_h} | {acc_d} |" in text
    assert "## Per phase" not in text  # two phases: the H/D table says it all
    assert "![Accuracy per phase](phase_accuracy.png)" in text
    assert "trajectory" not in text
    assert_png(main_run.run_dir / "phase_accuracy.png")
    assert (
        "python -m meshheal_jax.main --seeds 2 --pair default --methods meshheal --engine reference --slots 1 --datasets bbh "
        "--tasks 84 --degraded 2 4" in text
    )


def test_reproduce_commands_carry_protocol_changes_and_argv():
    exp = runner.Experiment(
        name="recovery",
        datasets=("math",),
        pairs=("A", "B"),
        seeds=(4, 7),
        n_tasks=630,
        protocol=ProtocolParams(alpha=1.5, probe_interval=5),
    )
    commands = report.reproduce_commands({"experiment": exp.to_json()}, Path("runs/x"))
    assert commands[0] == (
        "python -m meshheal_jax.recovery --seed-list 4 7 --pair A --methods meshheal --engine jax --slots 1 "
        "--protocol.alpha 1.5 --protocol.probe-interval 5 --dataset math --tasks 630"
    )
    assert commands[1].startswith("python -m meshheal_jax.recovery --seed-list 4 7 --pair B ")
    assert commands[-1] == "python -m meshheal_jax.report runs/x"
    scale = report.reproduce_commands({"experiment": {"name": "scale", "n_agents": 96, "topology": "sparse"}})
    assert scale[0].startswith("python -m meshheal_jax.scale") and scale[0].endswith(
        "--agents 96 --dataset bbh --sparse"
    )
    given = report.reproduce_commands({"experiment": {"name": "sweep"}, "argv": ["--alpha", "1", "2"]})
    assert given[0] == "python -m meshheal_jax.sweep --alpha 1 2"


def test_a_record_from_before_min_matched_reads_as_it_ran():
    """A config.json written before min_matched existed ran the pool's minimum at min_observations:
    read back, resumed and reproduced so (not at min_matched's default 3)."""
    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0,),
                            protocol=ProtocolParams(min_observations=5, min_matched=5))  # fmt: skip
    old = json.loads(json.dumps(exp.to_json()))
    del old["protocol"]["min_matched"]
    assert report.experiment_from_config(old).protocol.min_matched == 5
    assert runner.changed_settings(old, exp) == []
    assert runner.changed_settings(
        old, dataclasses.replace(exp, protocol=ProtocolParams(min_observations=5))
    ) == ["protocol.min_matched"]
    command = report.reproduce_commands({"experiment": old})[0]
    assert "--protocol.min-observations 5 --protocol.min-matched 5" in command


@pytest.mark.parametrize(
    "command, args, arm",
    [
        ("ablate", ["--seeds", "2", "--tasks", "84", "--dataset", "math", "--protocol.alpha", "1.1"], "no_takeover"),
        ("detectors", ["--seed-list", "3", "5", "--pairs", "A", "B", "--degraded", "1", "3"], "cusum"),
        ("scale", ["--agents", "12", "--sparse", "--graph-seed", "7", "--dataset", "math", "--tables", "tasks", "states"],
         "sparse"),
    ],
)  # fmt: skip
def test_an_arms_reproduce_command_runs_that_arm_again(command, args, arm):
    """The report of an arm's folder (ablate / detectors: a variant or detector; scale: a topology)
    gives the command that makes the same experiment again: parsed back by the command's own flags
    and built by its own `experiment`, it equals the arm's, settings and all."""
    import importlib
    import shlex

    import tyro

    module = importlib.import_module(f"meshheal_jax.{command}")
    config_type = {"ablate": "AblateConfig", "detectors": "DetectorsConfig", "scale": "ScaleConfig"}[command]
    original = module.experiment(tyro.cli(getattr(module, config_type), args=args), arm)
    commands = report.reproduce_commands({"experiment": original.to_json()})
    assert len(commands) == 2  # the arm's command, then the report's
    words = shlex.split(commands[0])
    assert words[:3] == ["python", "-m", f"meshheal_jax.{command}"]
    again = tyro.cli(getattr(module, config_type), args=words[3:])
    arms = {"ablate": again.variants if command == "ablate" else None}.get(command) or (
        again.detectors if command == "detectors" else (arm,)
    )
    assert list(arms) == [arm]
    assert module.experiment(again, arm).to_json() == original.to_json()


def test_reproduce_commands_carry_the_backend_and_where_questions_come_from():
    base = dict(name="main", datasets=("math",), pairs=("default",), seeds=(0,))
    live = runner.Experiment(**base, backend="live", live=runner.LiveSettings(
        ("http://a:8000/v1", "http://b:8000/v1"), ("http://c:8001/v1",), strong_model="openai/gpt-oss-120b",
        reasoning_effort="high", max_tokens=512))  # fmt: skip
    (command, _) = report.reproduce_commands({"experiment": live.to_json()})
    assert command.endswith(
        "--backend live --strong-url http://a:8000/v1,http://b:8000/v1 --weak-url http://c:8001/v1 "
        "--strong-model openai/gpt-oss-120b --max-tokens 512 --reasoning-effort high "
        "--hub-id math=EleutherAI/hendrycks_math --hub-split math=test --datasets math --tasks 504 --degraded 2 4"
    )
    emulated = runner.Experiment(**base, live=runner.LiveSettings((), (), data="sample"))
    (command, _) = report.reproduce_commands({"experiment": emulated.to_json()})
    assert "--backend" not in command and "--data sample --datasets math" in command
    counted = runner.Experiment(
        **base, live=runner.LiveSettings((), (), data="sample", tokenizer="/t/tokenizer.json")
    )
    (command, _) = report.reproduce_commands({"experiment": counted.to_json()})
    assert "--data sample --tokenizer /t/tokenizer.json --datasets math" in command
    (command, _) = report.reproduce_commands({"experiment": runner.Experiment(**base).to_json()})
    assert "--backend" not in command and "--data " not in command
    served = runner.Experiment(**base, backend="live", live=runner.LiveSettings(("http://a/v1",), ("http://b/v1",),
                                                                                strong_served_name="gpt"))  # fmt: skip
    (command, _) = report.reproduce_commands({"experiment": served.to_json()})
    assert command.endswith('--degraded 2 4  # and a --live-config FILE holding strong_served_name = "gpt"')


def test_scale_summary_gets_scaling_plot_and_table(main_run, tmp_path):
    run_dir = tmp_path / "scale"
    run_dir.mkdir()
    config = json.loads((main_run.run_dir / "config.json").read_text())
    config["experiment"]["name"] = "scale"
    (run_dir / "config.json").write_text(json.dumps(config))
    main_run.tasks.write_parquet(run_dir / "tasks.parquet")
    base = main_run.summary["results"][0]
    results = [
        {
            **base,
            "n_agents": n,
            "topology": topo,
            "isolated_degraded": {"mean": n / 3 - 1, "std": 0.5},
            "degraded": n // 3,
            "edges": 3 * n,
        }
        for n in (6, 96, 288)
        for topo in ("complete", "sparse")
    ]
    (run_dir / "summary.json").write_text(
        json.dumps({**main_run.summary, "experiment": "scale", "results": results})
    )
    text = report.write_report(run_dir).read_text()
    assert "## Network scaling" in text and "![Network scaling](scaling.png)" in text
    assert "| agents | topology | acc H | acc D | isolated at end | degraded | missed |" in text
    assert_png(run_dir / "scaling.png")


def test_a_recovery_run_without_meshheal_has_no_trajectory(tmp_path):
    """The trajectory is MeshHeal's detector states; a baseline's run draws the phase bars alone."""
    exp = runner.Experiment(name="recovery", methods=("raps",), datasets=("math",), pairs=("default",),
                            seeds=(0,), engine="reference", n_tasks=210)  # fmt: skip
    run_dir = runner.run(exp, tmp_path / "run", progress=False).run_dir
    text = report.write_report(run_dir).read_text()
    assert "Recovery trajectory" not in text and not list(run_dir.glob("trajectory_seed*.png"))
    assert "![Accuracy per phase](phase_accuracy.png)" in text
    assert_png(run_dir / "phase_accuracy.png")


# ----------------------------------------------------------------------------------------------
# Plots from hand-built frames
# ----------------------------------------------------------------------------------------------


def _review(seed: int, t: int, author: int, q: float, state_after: str, probe: bool = False) -> dict:
    return {
        "method": "meshheal",
        "dataset": "math",
        "pair": "default",
        "seed": seed,
        "t": t,
        "visit": 0,
        "author": author,
        "q": q,
        "probe": probe,
        "state_before": state_after,
        "state_after": state_after,
        "author_degraded": False,
        "committee": False,
        "takeover": False,
    }


def test_trajectory_without_probes_and_never_isolated(tmp_path):
    """Two degraded agents: one watched for a while, none isolated, no probe anywhere."""
    n_tasks = 60
    schedule = HealthSchedule(6, n_tasks, ((2, 21, 41), (4, 31, n_tasks + 1)))
    rows = [
        _review(
            0,
            t,
            t % 6,
            1.0 if t < 21 or t % 6 not in (2, 4) else 0.25,
            "watched" if t % 6 == 2 and 25 <= t < 45 else "normal",
        )
        for t in range(1, n_tasks + 1)
    ]
    reviews = metrics.frame("reviews", rows)
    states = metrics.frame(
        "states",
        [
            {
                "method": "meshheal",
                "dataset": "math",
                "pair": "default",
                "seed": 0,
                "t": 25,
                "agent": 2,
                "from": "normal",
                "to": "watched",
                "z": 1.5,
                "reason": "z>=alpha",
                "probe": False,
                "degraded": True,
            },
            {
                "method": "meshheal",
                "dataset": "math",
                "pair": "default",
                "seed": 0,
                "t": 45,
                "agent": 2,
                "from": "watched",
                "to": "normal",
                "z": 0.2,
                "reason": "z<alpha",
                "probe": False,
                "degraded": False,
            },
        ],
    )
    tasks = metrics.frame(
        "tasks",
        [
            {
                "method": "meshheal",
                "dataset": "math",
                "pair": "default",
                "seed": 0,
                "t": t,
                "phase": (t - 1) // 20,
                "correct": t % 3 > 0,
                "answered": True,
                "calls": 5,
                "tokens": 1000,
            }
            for t in range(1, n_tasks + 1)
        ],
    )
    assert not reviews["probe"].any() and not (states["to"] == "isolated").any()
    out = plots.recovery_trajectory(
        reviews, states, tasks, schedule, 0, tmp_path / "traj.png", phase_names=("one", "two", "three")
    )
    assert out == tmp_path / "traj.png"
    assert_png(out)
    # an agent without a single output still gets its panel
    plots.recovery_trajectory(
        reviews.filter(pl.col("author") != 4), states, tasks, schedule, 0, tmp_path / "t2.png"
    )
    assert_png(tmp_path / "t2.png")
    bars = plots.phase_accuracy_bars(tasks, tmp_path / "bars.png", ["one", "two", "three"])
    assert_png(bars)


def test_trajectory_picks_the_seed_and_rejects_ambiguous_frames(recovery_run, tmp_path):
    schedule = recovery_schedule(210)
    other = recovery_run.tasks.with_columns(pl.lit("other").alias("dataset"))
    tasks = pl.concat([recovery_run.tasks, other])
    with pytest.raises(MeshHealError, match="several datasets"):
        plots.recovery_trajectory(
            recovery_run.reviews, recovery_run.states, tasks, schedule, 3, tmp_path / "x.png"
        )
    with pytest.raises(MeshHealError, match="no tasks for seed 9"):
        plots.recovery_trajectory(
            recovery_run.reviews, recovery_run.states, recovery_run.tasks, schedule, 9, tmp_path / "x.png"
        )
    out = plots.recovery_trajectory(
        recovery_run.reviews, recovery_run.states, tasks, schedule, 3, tmp_path / "ok.png", dataset="math"
    )
    assert_png(out)


def test_phase_bars_for_several_methods_and_datasets(main_run, tmp_path):
    tasks = main_run.tasks
    tasks = pl.concat(
        [
            tasks,
            tasks.with_columns(pl.lit("agentnet").alias("method")),
            tasks.with_columns(pl.lit("math").alias("dataset")),
        ]
    )
    assert_png(plots.phase_accuracy_bars(tasks, tmp_path / "bars.png", ("healthy", "degraded")))
    with pytest.raises(MeshHealError):
        plots.phase_accuracy_bars(tasks.clear(), tmp_path / "empty.png")


def test_scaling_plot_numbers_or_stat_dicts(tmp_path):
    entries = [
        {"n_agents": 6, "topology": "complete", "acc_h": 0.85, "acc_d": 0.8, "isolated_degraded": 2},
        {
            "n_agents": 96,
            "topology": "complete",
            "acc_healthy": {"mean": 0.84, "std": 0.01},
            "acc_degraded": {"mean": 0.79, "std": 0.02},
            "isolated_degraded": {"mean": 30, "std": 1.0},
            "n_degraded": 32,
            "false_isolations": {"mean": 1.0, "std": 1.0},
        },
        {"n_agents": 96, "topology": "sparse", "acc_h": 0.83, "acc_d": 0.75, "isolated_degraded": 28},
    ]
    assert_png(plots.scaling_plot(entries, tmp_path / "scaling.png"))
    with pytest.raises(MeshHealError, match="n_agents and topology"):
        plots.scaling_plot([{"n_agents": 6}], tmp_path / "bad.png")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "meshheal_jax.report", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
        check=False,
    )


def test_cli_missing_folder_exits_2(tmp_path):
    proc = run_cli(str(tmp_path / "nowhere"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: run folder {tmp_path / 'nowhere'} does not exist"
    assert proc.stdout == ""


def test_cli_rejects_folders_that_are_not_finished_runs(tmp_path, main_run):
    with pytest.raises(MeshHealError, match="no config.json"):
        report.write_report(tmp_path)
    (tmp_path / "full").mkdir()  # scale / ablate / detectors: one run folder per arm
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(MeshHealError, match=r"holds run folders, not one: give one of \['full'\]"):
        report.write_report(tmp_path)
    shutil.rmtree(tmp_path / "full")
    (tmp_path / "config.json").write_text('{"experiment": {}}')
    with pytest.raises(MeshHealError, match="not a run folder"):
        report.write_report(tmp_path)
    (tmp_path / "config.json").write_text((main_run.run_dir / "config.json").read_text())
    with pytest.raises(MeshHealError, match="no summary.json"):
        report.write_report(tmp_path)
    (tmp_path / "summary.json").write_text("[]")
    with pytest.raises(
        MeshHealError, match="summary.json is not a run's summary.json: JSON, but not an object"
    ):
        report.write_report(tmp_path)


def test_cli_writes_the_report(main_run, tmp_path):
    (main_run.run_dir / "report.md").unlink(missing_ok=True)
    proc = run_cli(str(main_run.run_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"report: {main_run.run_dir / 'report.md'}"
    assert (main_run.run_dir / "report.md").is_file()


def test_scale_parse_lines_name_their_graph(capsys):
    """scale prints one result per topology: each parse-failure line says which graph it is of."""
    failed = {"mean": 2.0, "std": None, "min": 2, "max": 2, "n_defined": 1}
    results = [{"dataset": "bbh", "method": "meshheal", "pair": "default", "topology": topology,
                "parse_failed": failed} for topology in ("complete", "sparse")]  # fmt: skip
    report.print_parse_notes(results, by_topology=True)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(", bbh")[0] for line in lines[:2]] == [
        "Parse failures, complete graph",
        "Parse failures, sparse graph",
    ]
