"""Stream rules and the experiment commands' tables a mutation audit could change without any test
failing: the eight difficulty bins and the int32 arrays a stream hands the engines (decisions E9,
architecture.md "Counts and indices are int32"), the messages naming a bad stream or schedule, the
recovery schedule's six agents and phase names, and what main, recovery, ablate and scale print from
a summary (synthetic summaries and stubbed runs; a few seconds, nothing is run)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import tyro
from test_pinned_experiments import captured_tables, rows  # rich tables kept, read as dicts

from meshheal_jax import ablate, main, metrics, recovery, runner, scale
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import (
    DIFFICULTY_BINS,
    RECOVERY_PHASES,
    make_stream,
    recovery_schedule,
)

stat = metrics.stat


# ----------------------------------------------------------------------------------------------
# Streams and schedules (decisions E9; architecture.md "Counts and indices are int32")
# ----------------------------------------------------------------------------------------------


def test_questions_fall_in_eight_difficulty_bins():
    # decisions E9: "a bin b in 0..7", floor(8 u_k); params.DIFFICULTY_Z has one z per bin
    assert DIFFICULTY_BINS == 8
    stream = make_stream(0, 0, 504, 7, (1,), ("all",))
    assert sorted(set(stream.difficulty.tolist())) == list(range(8))


def test_a_stream_hands_the_engines_int32_arrays():
    stream = make_stream(3, 1, 84, 7, (1, 43), ("healthy", "degraded"))
    for name in ("task_type", "question", "phase", "difficulty"):
        assert getattr(stream, name).dtype == np.int32, name
    assert stream.question_tokens_or(110).dtype == np.int32
    # real questions' token counts (a --data run) come out int32 whatever they were read as
    real = dataclasses.replace(stream, question_tokens=np.arange(84, dtype=np.int64))
    tokens = real.question_tokens_or(110)
    assert tokens.dtype == np.int32 and tokens.tolist() == list(range(84))


@pytest.mark.parametrize(
    "starts, names, message",
    [((2, 20), ("a", "b"), r"phase starts must be increasing and start at task 1: \(2, 20\)"),
     ((1, 20, 10), ("a", "b", "c"), r"phase starts must be increasing and start at task 1: \(1, 20, 10\)"),
     ((1, 1), ("a", "b"), r"phase starts must be increasing and start at task 1: \(1, 1\)"),
     ((1, 43), ("a", "b"), r"phases \(1, 43\) / \('a', 'b'\) do not fit 42 tasks"),
     ((1, 20), ("a",), r"phases \(1, 20\) / \('a',\) do not fit 42 tasks")],
)  # fmt: skip
def test_bad_phases_are_named_for_what_is_wrong(starts, names, message):
    with pytest.raises(MeshHealError, match=message):
        make_stream(0, 0, 42, 7, starts, names)


def test_a_negative_seed_is_named_by_its_value():
    with pytest.raises(MeshHealError, match=r"seeds must be >= 0, got -3$"):
        make_stream(-3, 0, 42, 7, (1,), ("all",))


def test_recovery_schedule_is_of_the_six_agent_network_with_its_phase_names():
    # spec/experiments.md §2's five phases, as recorded in tasks.parquet's phase names and summaries
    schedule = recovery_schedule(210)
    assert (schedule.n_agents, schedule.n_tasks) == (6, 210)
    assert schedule.intervals == ((4, 43, 127), (2, 85, 169))
    assert RECOVERY_PHASES == (
        "healthy", "A5 degraded", "A3+A5 degraded", "A3 degraded, A5 restored", "restored"
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# main: its tables from a summary (spec/experiments.md §1)
# ----------------------------------------------------------------------------------------------


def main_result(dataset: str, method: str, pair: str = "default", acc_h: float = 0.9, **extra) -> dict:
    """A summary entry of one (pair, dataset, method); MeshHeal detects its two degraded agents."""
    meshheal = method == "meshheal"
    agents = [{"agent": a, "profile": p, "detection_delay": stat([4.0] if meshheal else []),
               "closure_seeds": 1 if meshheal else 0, "recovered_at": None} for a, p in ((2, "A3"), (4, "A5"))]  # fmt: skip
    return {"pair": pair, "dataset": dataset, "method": method, "variant": "full",
            "detector": "relative" if meshheal else runner.NO_DETECTOR, "seeds": [0],
            "acc_healthy": stat([acc_h]), "acc_degraded": stat([0.6]), "phase_change": stat([0.6 - acc_h]),
            "calls_per_task_healthy": stat([5.0]), "calls_per_task_degraded": stat([7.0]),
            "tokens_per_task_healthy": stat([1500.0]), "tokens_per_task_degraded": stat([2500.0]),
            "agents": agents, "missed": stat([0.0 if meshheal else 2.0]), "false_isolations": stat([1.0]),
            "false_isolated_agents": stat([1.0]), **extra}  # fmt: skip


def main_summary(results: list[dict], n_tasks: int = 504) -> dict:
    return {"n_tasks": n_tasks, "backend": "emulated", "engine": "jax", "results": results}


def test_main_orders_pairs_then_datasets_with_the_mean_last_then_methods_as_run():
    # ordered(): "grouped by pair, then dataset (the mean last), then method in run order"
    results = [
        main_result(d, m, p) for p in ("B", "A") for d in ("mean", "math", "bbh") for m in ("sac", "meshheal")
    ]
    order = [(r["pair"], r["dataset"], r["method"]) for r in main.ordered(main_summary(results))]
    assert order == [
        (p, d, m) for p in ("B", "A") for d in ("math", "bbh", "mean") for m in ("sac", "meshheal")
    ]


def test_main_table_reads_each_column_and_names_the_phases(monkeypatch, capsys):
    tables = captured_tables(monkeypatch, main)
    main.print_summary(main_summary([main_result("bbh", "meshheal", acc_h=0.8), main_result("bbh", "raps")]))
    printed = capsys.readouterr().out
    assert "H: tasks 1–252, D: tasks 253–504; D − H paired within seed" in printed
    accuracy, detection = (rows(t) for t in tables)
    mesh = accuracy[0]
    assert (mesh["dataset"], mesh["method"]) == ("bbh", "meshheal")  # one pair: no pair in the label
    assert (mesh["acc H"], mesh["acc D"], mesh["D − H"]) == ("0.800", "0.600", "-0.200")
    assert (mesh["calls H"], mesh["calls D"], mesh["tokens H (k)"], mesh["tokens D (k)"]) == (
        "5.0",
        "7.0",
        "1.5",
        "2.5",
    )
    assert [r["missed"] for r in detection] == ["0.00", "2.00"]
    assert [r["A3 detection delay"] for r in detection][1] == "never isolated"
    assert "Baselines have no detector" in printed  # raps is one


def test_main_labels_recordswith_their_pair_only_when_several_ran(monkeypatch):
    tables = captured_tables(monkeypatch, main)
    main.print_summary(
        main_summary([main_result("bbh", "meshheal", "A"), main_result("bbh", "meshheal", "B")])
    )
    assert [r["dataset"] for r in rows(tables[0])] == ["bbh (A)", "bbh (B)"]


def test_main_without_degraded_agents_still_shows_false_isolations(monkeypatch, capsys):
    # --degraded with no agent (decisions X9, a control run): H is the whole stream, D none; the
    # detector's false isolations are still shown, with no missed column; no baseline note for MeshHeal
    tables = captured_tables(monkeypatch, main)
    main.print_summary(main_summary([main_result("bbh", "meshheal", agents=[])], n_tasks=84))
    printed = capsys.readouterr().out
    assert "no agent degraded: H is all 84 tasks, D none" in printed
    (false,) = rows(tables[1])
    assert set(false) == {"dataset", "method", "false isolations", "falsely isolated agents"}
    assert "Baselines have no detector" not in printed


def test_main_passes_its_flags_to_the_experiment():
    cfg = tyro.cli(
        main.MainConfig, args=["--methods", "sac", "meshheal", "--degraded", "1", "3", "--tasks", "84"]
    )
    exp = main.experiment(cfg)
    assert (exp.methods, exp.degraded, exp.n_tasks, exp.name) == (("sac", "meshheal"), (1, 3), 84, "main")


# ----------------------------------------------------------------------------------------------
# recovery: its tables from a summary (spec/experiments.md §2)
# ----------------------------------------------------------------------------------------------


def recovery_result(method: str, recovered: bool = True) -> dict:
    phases = [{"name": name, "acc": stat([0.5]), "tokens_per_task": stat([1000.0]), "calls_per_task": stat([1.0])}
              for name in RECOVERY_PHASES]  # fmt: skip
    agents = [{"agent": 4, "profile": "A5", "degraded_at": 127, "recovered_at": 379 if recovered else None,
               "detection_delay": stat([5.0]), "closure_seeds": 1, "reintegration_delay": stat([7.0])}]  # fmt: skip
    return {"method": method, "variant": "full", "detector": "relative" if method == "meshheal" else runner.NO_DETECTOR,
            "dataset": "math", "pair": "default", "seeds": [0, 1], "phases": phases, "agents": agents,
            "missed": stat([0.0]), "false_isolations": stat([2.0]), "false_isolated_agents": stat([1.0])}  # fmt: skip


def state_rows(*changes: tuple) -> pl.DataFrame:
    """states rows (seed, method, t, agent, to, z, probe, degraded) of math / default."""
    names = ("seed", "method", "t", "agent", "to", "z", "probe", "degraded")
    records = [
        {"dataset": "math", "pair": "default", "from": "normal", "reason": "z", **dict(zip(names, c))}
        for c in changes
    ]
    return pl.DataFrame(records)


def test_recovery_prints_one_seeds_state_changes_of_the_method_that_isolates(monkeypatch):
    tables = captured_tables(monkeypatch, recovery)
    states = state_rows((1, "meshheal", 130, 4, "watched", 2.345, False, True),
                        (0, "meshheal", 140, 4, "isolated", None, True, True),
                        (1, "sac", 150, 4, "isolated", 1.0, False, True))  # fmt: skip
    summary = {"n_tasks": 630, "backend": "emulated", "engine": "jax",
               "results": [recovery_result("meshheal"), recovery_result("sac")]}  # fmt: skip
    recovery.print_summary(summary, states, 1)
    changes = [t for t in tables if t.title.startswith("State changes")]
    assert [t.title for t in changes] == ["State changes of meshheal, seed 1"]  # no table for sac
    (row,) = rows(changes[0])
    assert (row["t"], row["agent"], row["to"], row["z"]) == ("130", "4", "watched", "2.35")
    assert (row["probe"], row["degraded"]) == ("", "yes")
    errors = rows(next(t for t in tables if t.title.startswith("Missed degraded agents")))
    assert errors[1] == {"method": "sac", "missed": "all (never isolated)", "false isolations": "— (no detector)",
                         "falsely isolated agents": "— (no detector)"}  # fmt: skip
    assert (errors[0]["false isolations"], errors[0]["falsely isolated agents"]) == ("2.00", "1.00")


def test_recovery_agent_never_restored_is_degraded_to_the_last_task(monkeypatch):
    tables = captured_tables(monkeypatch, recovery)
    summary = {
        "n_tasks": 630,
        "backend": "emulated",
        "engine": "jax",
        "results": [recovery_result("meshheal", False)],
    }
    recovery.print_summary(summary, pl.DataFrame(schema=metrics.SCHEMAS["states"]), 0)
    agents = rows(next(t for t in tables if t.title == "Self-healing per degraded agent"))
    assert [r["degraded"] for r in agents] == ["127–630"]
    assert agents[0]["reintegration delay"] == "— (never restored)"


def test_recovery_passes_its_flags_to_the_experiment_and_the_seed_to_the_report(tmp_path, monkeypatch):
    cfg = tyro.cli(
        recovery.RecoveryConfig, args=["--methods", "raps", "--tasks", "210", "--seed-list", "3", "4"]
    )
    exp = recovery.experiment(cfg)
    assert (exp.name, exp.methods, exp.n_tasks, exp.datasets, exp.seeds) == (
        "recovery",
        ("raps",),
        210,
        ("math",),
        (3, 4),
    )
    reported = []
    results = SimpleNamespace(summary={"results": []}, states=None, run_dir=tmp_path)
    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: results)
    monkeypatch.setattr(recovery, "print_summary", lambda *args: None)
    monkeypatch.setattr(
        recovery.report, "write_report", lambda run_dir, seed=None: reported.append(seed) or tmp_path
    )
    recovery.body(
        tyro.cli(recovery.RecoveryConfig, args=["--seed-list", "3", "4", "--show-seed", "4", "--quiet"])
    )
    assert reported == [4]
    with pytest.raises(MeshHealError, match=r"--show-seed 5 is not among the seeds run \[3, 4\]"):
        recovery.body(tyro.cli(recovery.RecoveryConfig, args=["--seed-list", "3", "4", "--show-seed", "5"]))


# ----------------------------------------------------------------------------------------------
# ablate: folders, names and rows (spec/experiments.md §4)
# ----------------------------------------------------------------------------------------------


def test_ablate_output_folder_is_refused_when_it_is_a_run_folder_or_a_file(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(MeshHealError, match="is the run folder of one experiment; choose another --out"):
        ablate.combined_out("ablate", tmp_path / "run")
    (tmp_path / "file").write_text("precious")
    with pytest.raises(MeshHealError, match="exists and is not a folder"):
        ablate.combined_out("ablate", tmp_path / "file")
    assert ablate.combined_out("ablate", tmp_path / "new") == tmp_path / "new"


def test_ablate_names_an_unknown_or_missing_variant():
    with pytest.raises(MeshHealError, match=r"^no variants given$"):
        ablate.check_names((), ("full", "no_takeover"), "variants")
    with pytest.raises(MeshHealError, match=r"^unknown variant 'half'; known: full, no_takeover$"):
        ablate.check_names(("full", "half"), ("full", "no_takeover"), "variants")


def test_ablate_combines_only_meshheal_entries_and_runs_each_arm_with_its_options(tmp_path, monkeypatch):
    config = tyro.cli(ablate.AblateConfig, args=["--seeds", "1", "--tasks", "84", "--degraded", "1", "3"])
    experiments = {"no_takeover": ablate.experiment(config, "no_takeover")}
    assert experiments["no_takeover"].degraded == (1, 3)
    calls = []

    def fake_run(exp, run_dir, **kwargs):
        calls.append(kwargs)
        results = [{"method": m, "pair": "default", "dataset": "bbh"} for m in ("sac", "meshheal")]
        summary = {
            "engine": "jax",
            "backend": "emulated",
            "slots": 1,
            "n_agents": 6,
            "n_tasks": 84,
            "results": results,
        }
        return SimpleNamespace(summary=summary, run_dir=Path(run_dir))

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr(ablate, "per_seed_detection", lambda *args: {})
    summary = ablate.run_all(
        "ablate", experiments, tmp_path / "out", False, "--variants", checkpoint_every=7.0
    )
    assert [(r["method"], r["variant"]) for r in summary["results"]] == [("meshheal", "no_takeover")]
    assert calls == [{"progress": False, "lanes": None, "checkpoint_every": 7.0}]


def test_ablate_detection_row_reads_a_dash_for_an_agent_the_variant_lacks():
    assert ablate.delay({"agents": [{"agent": 2, "detection_delay": stat([3.0])}]}, 4) == "—"


# ----------------------------------------------------------------------------------------------
# scale: arms, experiment and table (spec/experiments.md §3)
# ----------------------------------------------------------------------------------------------


def scale_config(*args: str) -> scale.ScaleConfig:
    return tyro.cli(scale.ScaleConfig, args=list(args))


def test_scale_arms_follow_the_graph_flags(tmp_path):
    assert scale.topologies(scale_config()) == ["complete"]
    assert scale.topologies(scale_config("--sparse")) == ["sparse"]
    assert scale.topologies(scale_config("--compare")) == ["complete", "sparse"]
    assert scale.topologies(scale_config("--edges", str(tmp_path / "g.csv"))) == ["file"]


def test_scale_passes_its_flags_to_the_experiment():
    cfg = scale_config(
        "--agents", "24", "--graph-seed", "7", "--tables", "tasks", "states", "--dataset", "math"
    )
    exp = scale.experiment(cfg, "sparse")
    assert (exp.n_agents, exp.n_tasks, exp.slots, exp.degraded) == (24, 2016, 4, None)
    assert (exp.graph_seed, exp.tables, exp.datasets, exp.topology) == (
        7,
        ("tasks", "states"),
        ("math",),
        "sparse",
    )
    with pytest.raises(MeshHealError, match="--agents must be a positive multiple of 6, got 0"):
        scale.experiment(scale_config("--agents", "0"), "complete")


def test_scale_table_reads_each_column(monkeypatch, capsys):
    tables = captured_tables(monkeypatch, scale)
    result = {"n_agents": 96, "topology": "sparse", "edges": 230, "edge_fraction": 0.0504, "max_ability_distance": 2,
              "acc_healthy": stat([0.9]), "acc_degraded": stat([0.7]), "isolated_degraded": stat([30.0]),
              "degraded": 32, "missed": stat([1.0]), "false_isolations": stat([3.0]),
              "false_isolated_agents": stat([2.0]), "detection_delay_mean": stat([10.0]),
              "onset_detections": stat([0]), "tokens_per_task_healthy": stat([1500.0]),
              "tokens_per_task_degraded": stat([2500.0]), "wall_s": 12.34, "resumed": True}  # fmt: skip
    scale.print_summary({"engine": "jax", "backend": "emulated", "slots": 16, "results": [result]})
    (row,) = rows(tables[0])
    assert (row["edges (paper)"], row["of complete"], row["max ability dist"]) == ("230 (228)", "5.04%", "2")
    assert (row["isolated at end/degraded"], row["missed"]) == ("30.0 / 32", "1.0")
    assert row["false isolations (agents)"] == "3.0 (2.0)"
    assert (row["tokens/task H / D (k)"], row["wall s"]) == ("1.5 / 2.5", "12.3 (resumed)")
    assert "before onset" not in capsys.readouterr().out  # no detection was before onset
