"""Several methods in one experiment: MeshHeal and baselines as streams of one run folder.

Small runs (84-task main streams, a 210-task recovery stream; MeshHeal on the reference engine,
RAPS through its compiled baseline program): summary entries and their fields, paired task order
across methods, resume per (method, stream), the printed words for what a baseline never does,
and an unknown method refused with one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import polars as pl
import pytest

from meshheal_jax import runner

TABLES = ("tasks", "reviews", "states", "calls")
STAT_KEYS = {"mean", "std", "min", "max", "n_defined"}
METHODS = ("meshheal", "raps")
MAIN_ARGS = ("--methods", *METHODS, "--seeds", "2", "--datasets", "bbh", "math", "--tasks", "84",
             "--engine", "reference", "--quiet")  # fmt: skip


def cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", f"meshheal_jax.{module}", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False,
    )  # fmt: skip


def main_experiment() -> runner.Experiment:
    """The experiment MAIN_ARGS describe (as main.experiment builds it)."""
    return runner.Experiment(
        name="main", datasets=("bbh", "math"), pairs=("default",), seeds=(0, 1), methods=METHODS,
        engine="reference", n_tasks=84, degraded=(2, 4),
    )  # fmt: skip


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, dict]:
    root = tmp_path_factory.mktemp("methods")
    out = root / "run"
    proc = cli("main", *MAIN_ARGS, "--out", str(out), cwd=root)
    assert proc.returncode == 0, proc.stderr
    return proc, out, json.loads((out / "summary.json").read_text())


def entry(summary: dict, method: str, dataset: str) -> dict:
    (r,) = [r for r in summary["results"] if (r["method"], r["dataset"]) == (method, dataset)]
    return r


def test_method_names_match_the_baselines_package():
    from meshheal_jax.baselines import run

    assert runner.BASELINES == tuple(run.METHODS)
    assert runner.METHODS == ("meshheal", *run.METHODS)
    rules = {f"{method}.{name}": getattr(run.DEFAULT_PARAMS[method](), name)
             for method, name in (key.split(".") for key in runner.BASELINE_RULES)}  # fmt: skip
    assert rules == runner.BASELINE_RULES  # what a run folder records is what the baselines run


def test_a_folder_with_baselines_from_before_their_rules_were_recorded_is_not_resumed():
    """A main run folder written before the baselines' model rules were recorded ran the earlier
    ones (decisions B0, B3): resuming it under the current rules would mix the two, so it is
    refused, naming the rules; a folder of MeshHeal alone is not concerned."""
    exp = runner.Experiment(
        name="main", datasets=("bbh",), pairs=("default",), seeds=(0,), methods=("meshheal", "raps")
    )
    old = json.loads(json.dumps(exp.to_json()))
    assert old["baseline_rules"] == runner.BASELINE_RULES and runner.changed_settings(old, exp) == []
    del old["baseline_rules"]
    assert runner.changed_settings(old, exp) == [
        f"baseline_rules.{key}" for key in sorted(runner.BASELINE_RULES)
    ]
    alone = dataclasses.replace(exp, methods=("meshheal",))
    record = json.loads(json.dumps(alone.to_json()))
    assert "baseline_rules" not in record and runner.changed_settings(record, alone) == []


def test_run_folder_has_one_part_per_method_and_stream_and_a_report(main_run):
    _, out, _ = main_run
    expected = sorted(f"{m}-{d}-default-seed{s}" for m in METHODS for d in ("bbh", "math") for s in (0, 1))
    assert sorted(p.name for p in (out / "parts").iterdir()) == expected
    assert (out / "report.md").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["experiment"]["methods"] == list(METHODS) and "method" not in config["experiment"]


def test_summary_entries_name_method_variant_detector_pair(main_run):
    _, _, summary = main_run
    assert summary["methods"] == list(METHODS)
    keys = [(r["method"], r["dataset"], r["pair"]) for r in summary["results"]]
    assert keys == [(m, d, "default") for m in METHODS for d in ("bbh", "math", "mean")]
    for r in summary["results"]:
        if r["method"] == "meshheal":
            assert (r["variant"], r["detector"]) == ("full", "relative")
        else:
            assert (r["variant"], r["detector"]) == ("full", runner.NO_DETECTOR) == ("full", "none")
        assert r["seeds"] == [0, 1]
        for key in ("missed", "false_isolations", "acc_healthy", "acc_degraded", "phase_change",
                    "calls_per_task_healthy", "tokens_per_task_degraded"):  # fmt: skip
            assert set(r[key]) == STAT_KEYS, key
            assert r[key]["n_defined"] == 2, key


def test_baseline_never_isolates(main_run):
    _, out, summary = main_run
    for dataset in ("bbh", "math"):
        r = entry(summary, "raps", dataset)
        assert r["missed"]["mean"] == 2 and r["missed"]["std"] == 0
        assert r["false_isolations"]["mean"] == 0
        assert [a["agent"] for a in r["agents"]] == [2, 4]
        for a in r["agents"]:
            assert a["detection_delay"] == {
                "mean": None,
                "std": None,
                "min": None,
                "max": None,
                "n_defined": 0,
            }
            assert a["closure_seeds"] == 0
            assert a["reintegration_delay"]["n_defined"] == 0
    states = pl.read_parquet(out / "states.parquet")
    assert states.filter(pl.col("method") == "raps").height == 0


def test_summary_entries_agree_with_each_methods_records(main_run):
    _, out, summary = main_run
    tasks = pl.read_parquet(out / "tasks.parquet")
    for method in METHODS:
        per_dataset = []
        for dataset in ("bbh", "math"):
            mine = tasks.filter((pl.col("method") == method) & (pl.col("dataset") == dataset))
            per_seed = [
                mine.filter((pl.col("seed") == s) & (pl.col("t") > 42))["correct"].mean() for s in (0, 1)
            ]
            per_dataset.append(per_seed)
            assert entry(summary, method, dataset)["acc_degraded"]["mean"] == pytest.approx(sum(per_seed) / 2)
        within_seed = [(per_dataset[0][s] + per_dataset[1][s]) / 2 for s in (0, 1)]
        assert entry(summary, method, "mean")["acc_degraded"]["mean"] == pytest.approx(sum(within_seed) / 2)
    assert tasks["calls"].sum() == pl.read_parquet(out / "calls.parquet").height


def test_paired_task_order_across_methods(main_run):
    _, out, _ = main_run
    tasks = pl.read_parquet(out / "tasks.parquet")
    columns = ("dataset", "seed", "t", "task_type", "phase", "entry")
    order = {
        m: tasks.filter(pl.col("method") == m).sort("dataset", "seed", "t").select(columns) for m in METHODS
    }
    assert order["meshheal"].height == 2 * 2 * 84
    assert order["meshheal"].equals(order["raps"])
    s0 = order["meshheal"].filter((pl.col("dataset") == "bbh") & (pl.col("seed") == 0))["task_type"]
    s1 = order["meshheal"].filter((pl.col("dataset") == "bbh") & (pl.col("seed") == 1))["task_type"]
    assert not s0.equals(s1)  # seeds differ, methods within a seed do not


def test_main_prints_tables_with_every_method_and_the_words(main_run):
    proc, out, _ = main_run
    text = proc.stdout
    assert "Persistent degradation" in text and "Detection per degraded agent" in text
    for word in ("meshheal", "raps", "bbh", "math", "mean", "never isolated", "not established"):
        assert word in text, word
    rows = [line for line in text.splitlines() if "│ raps" in line and "not established" in line]
    assert rows  # decisions R2: a baseline's agents are never isolated, in those words
    for line in rows:
        assert "never isolated" in line and "not isolated while degraded" not in line, line
    assert f"results: {out}" in text and f"report: {out / 'report.md'}" in text


def test_main_with_no_agent_degraded_says_so_and_prints_the_false_isolations(tmp_path):
    """--degraded with no agent: H is every task, and the detector's false isolations are still shown."""
    out = tmp_path / "run"
    proc = cli("main", "--methods", "meshheal", "--seeds", "1", "--datasets", "bbh", "--tasks", "84",
               "--engine", "reference", "--degraded", "--protocol.alpha", "0.5", "--out", str(out), "--quiet",
               cwd=tmp_path)  # fmt: skip  # alpha 0.5: some healthy agent is isolated in 84 tasks
    assert proc.returncode == 0, proc.stderr
    assert (
        "no agent degraded: H is all 84 tasks, D none" in proc.stdout and "H: tasks 1–42" not in proc.stdout
    )
    (result,) = [
        r for r in json.loads((out / "summary.json").read_text())["results"] if r["dataset"] == "bbh"
    ]
    assert result["false_isolations"]["mean"] > 0  # the case the table must not hide
    assert "No agent degraded: false isolations" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if "│ meshheal" in line and "bbh" in line][1:]
    assert f"{result['false_isolations']['mean']:.2f}" in line


def test_degrading_every_holder_of_an_ability_is_run_with_a_warning():
    """--degraded may name any agents (decisions X9); A1-A3 hold every copy of BBH's 'mathematical'."""
    from meshheal_jax.runner import NoHealthyHolderWarning, graph_facts

    exp = dataclasses.replace(main_experiment(), datasets=("bbh",), degraded=(0, 1, 2))
    with pytest.warns(
        NoHealthyHolderWarning,
        match=r"bbh: the degraded agents \[0, 1, 2\] hold every copy of 'mathematical'",
    ):
        exp.validate()
    assert graph_facts(exp, "bbh")["max_ability_distance"] is None  # not the unreachable sentinel 2**30
    for degraded in ((2, 4), (), (2,)):  # the profile's targets; a control run with none; one holder of many
        other = dataclasses.replace(exp, degraded=degraded)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoHealthyHolderWarning)
            other.validate()
        assert graph_facts(other, "bbh")["max_ability_distance"] == 1


def test_resume_reruns_only_the_missing_method_streams(main_run, tmp_path, monkeypatch):
    _, original, summary = main_run
    out = tmp_path / "run"
    shutil.copytree(original, out)
    frames = {name: pl.read_parquet(out / f"{name}.parquet") for name in TABLES}
    for part in ("raps-bbh-default-seed1", "meshheal-math-default-seed0"):
        shutil.rmtree(out / "parts" / part)
    (out / "summary.json").unlink()
    kept = {p.name: (p / "tasks.parquet").stat().st_mtime_ns for p in (out / "parts").iterdir()}
    ran = []
    one, baseline = runner.run_one_stream, runner.run_baseline_streams
    monkeypatch.setattr(
        runner, "run_one_stream", lambda exp, *s: ran.append(("meshheal", *s)) or one(exp, *s)
    )
    monkeypatch.setattr(runner, "run_baseline_streams",
                        lambda exp, m, streams, *rest: ran.extend((m, *s) for s in streams) or baseline(exp, m, streams, *rest))  # fmt: skip
    results = runner.run(main_experiment(), out, progress=False)
    assert ran == [("meshheal", "math", "default", 0), ("raps", "bbh", "default", 1)]
    assert {p: (out / "parts" / p / "tasks.parquet").stat().st_mtime_ns for p in kept} == kept
    assert results.summary == summary
    for name, df in frames.items():
        assert pl.read_parquet(out / f"{name}.parquet").equals(df, null_equal=True), name


def test_recovery_says_what_a_baseline_never_does(tmp_path):
    out = tmp_path / "rec"
    proc = cli("recovery", "--methods", *METHODS, "--seeds", "1", "--tasks", "210", "--engine", "reference",
               "--quiet", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Accuracy per phase" in text and "Tokens per task (k) per phase" in text
    assert "Self-healing per degraded agent" in text and "State changes of meshheal, seed 0" in text
    raps_rows = [line for line in text.splitlines() if "│ raps" in line and "agent" in line]
    assert len(raps_rows) == 2  # A5 and A3
    for line in raps_rows:
        assert "never isolated" in line and "not established" in line and "undefined" in line
    summary = json.loads((out / "summary.json").read_text())
    raps = entry(summary, "raps", "math")
    assert (raps["variant"], raps["detector"]) == ("full", "none")
    assert {a["agent"]: (a["degraded_at"], a["recovered_at"]) for a in raps["agents"]} == {
        4: (43, 127),
        2: (85, 169),
    }
    for a in raps["agents"]:
        assert a["detection_delay"]["n_defined"] == 0 and a["closure_seeds"] == 0
        assert a["reintegration_delay"]["mean"] is None and a["reintegration_delay"]["n_defined"] == 0
    assert [len(r["phases"]) for r in summary["results"]] == [5, 5]
    assert (out / "report.md").is_file()


def test_unknown_method_exits_2_with_one_line(tmp_path):
    out = tmp_path / "out"
    proc = cli("main", "--methods", "meshheal", "nosuch", "--quiet", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == f"error: unknown method 'nosuch'; known: {', '.join(runner.METHODS)}"
    assert not out.exists()


def test_a_run_folder_of_the_one_method_layout_is_refused(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    old = {k: v for k, v in main_experiment().to_json().items() if k != "methods"}
    (out / "config.json").write_text(
        json.dumps({runner.RUN_MARKER: True, "experiment": {**old, "method": "meshheal"}})
    )
    with pytest.raises(runner.MeshHealError, match="older layout"):
        runner.prepare_run_dir(main_experiment(), out)


def test_jax_batches_side_by_side_keep_what_finished_when_one_fails(tmp_path, monkeypatch):
    """JAX engine: MeshHeal's batch and the baselines' run side by side (decisions R5). A failed
    batch does not lose the others' streams: they are written, the error is raised, and the rerun
    runs only the failed batch's streams; the result equals an uninterrupted run's."""
    exp = dataclasses.replace(
        main_experiment(), engine="jax", methods=("meshheal", "raps", "sac"), seeds=(0,)
    )
    baseline = runner.run_baseline_streams

    def failing(exp_, method, streams, *rest):
        if method == "raps":
            raise RuntimeError("raps batch failed")
        return baseline(exp_, method, streams, *rest)

    monkeypatch.setattr(runner, "run_baseline_streams", failing)
    with pytest.raises(RuntimeError, match="raps batch failed"):
        runner.run(exp, tmp_path / "run", progress=False)
    parts = sorted(p.name for p in (tmp_path / "run" / "parts").iterdir())
    assert parts == [f"{m}-{d}-default-seed0" for m in ("meshheal", "sac") for d in ("bbh", "math")]
    ran = []
    monkeypatch.setattr(runner, "run_baseline_streams",
                        lambda exp_, m, streams, *rest: ran.extend((m, *s) for s in streams) or baseline(exp_, m, streams, *rest))  # fmt: skip
    resumed = runner.run(exp, tmp_path / "run", progress=False)
    assert ran == [("raps", "bbh", "default", 0), ("raps", "math", "default", 0)]
    whole = runner.run(exp, tmp_path / "whole", progress=False)
    assert resumed.summary == whole.summary
    for name in TABLES:
        assert getattr(resumed, name).equals(getattr(whole, name), null_equal=True), name


def two_batches(until: threading.Event, other: str = "slow", seen: dict | None = None) -> list[tuple]:
    """Jobs for runner._run_side_by_side, both running at once (skipped with fewer than two lanes):
    "fast" returns once the other has started; the other returns when `until` is set, as a lane
    that sees `cancel` does (or, given another event, a baseline's program that cannot be cut
    short), noting in `seen` whether it was set."""
    from meshheal_jax import engine

    if engine.default_lanes(2) < 2:
        pytest.skip("needs two cores: both batches running at once")
    started = threading.Event()

    def other_batch():
        started.set()
        was_set = until.wait(30)
        if seen is not None:
            seen["cancel"] = was_set
        return [f"{other} frames"]

    def fast():
        started.wait(30)  # both running (two threads on any machine with two cores or more)
        return ["fast frames"]

    return [("fast", [("s",)], fast), (other, [("s",)], other_batch)]


def test_ctrl_c_cancels_the_batches_and_keeps_those_that_finish():
    """decisions R5: an interrupt in the main thread sets `cancel`; a running batch that sees it
    ends, and what it returns is kept before KeyboardInterrupt is raised."""
    cancel, kept, seen, interrupted = threading.Event(), [], {}, []
    jobs = two_batches(cancel, seen=seen)

    def keep(stream, frames):
        if stream == ("fast", "s") and not interrupted:
            interrupted.append(stream)
            raise KeyboardInterrupt  # Ctrl-C arrives while the first finished batch is written
        kept.append((stream, frames))

    with pytest.raises(KeyboardInterrupt):
        runner._run_side_by_side(jobs, keep, lambda: None, cancel)
    assert seen == {"cancel": True}
    # the batch whose writing the Ctrl-C cut short is written by the stop (it was lost before)
    assert kept == [(("fast", "s"), "fast frames"), (("slow", "s"), "slow frames")]


def test_a_batch_that_cannot_be_written_does_not_lose_the_others():
    """A write that fails (a full disk) is raised once the other batches have ended and been kept;
    it is not tried again, so the stop's wait for the others goes on."""
    cancel, kept = threading.Event(), []
    jobs = two_batches(cancel)

    def keep(stream, frames):
        if stream == ("fast", "s"):
            raise OSError(28, "No space left on device")
        kept.append(stream)

    with pytest.raises(OSError, match="No space left"):
        runner._run_side_by_side(jobs, keep, lambda: None, cancel)
    assert kept == [("slow", "s")]


def test_a_second_ctrl_c_abandons_a_batch_that_runs_on(terminal_sigint):  # interrupt_main needs it
    """A baseline's program cannot be cut short: the stop waits for it, and a second Ctrl-C during
    that wait raises errors.Abandoned (the command then exits without waiting, cli.guarded)."""
    import _thread

    from meshheal_jax.errors import Abandoned

    cancel, release, kept = threading.Event(), threading.Event(), []
    jobs = two_batches(release, other="baseline")  # it ignores cancel, as a compiled baseline program does

    def keep(stream, frames):
        kept.append(stream)
        if len(kept) == 1:
            threading.Timer(0.3, _thread.interrupt_main).start()  # the second, while the stop waits
            raise KeyboardInterrupt

    try:
        with pytest.raises(Abandoned):
            runner._run_side_by_side(jobs, keep, lambda: None, cancel)
    finally:
        release.set()
    assert cancel.is_set() and kept == [("fast", "s"), ("fast", "s")]  # written again by the stop


def test_every_failed_batch_is_named():
    def fail(message):
        def run():
            raise RuntimeError(message)

        return run

    with pytest.raises(RuntimeError) as info:
        runner._run_side_by_side([("a", [("s",)], fail("a failed")), ("b", [("s",)], fail("b failed"))],
                                 lambda *_: None, lambda: None, threading.Event())  # fmt: skip
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "a failed" in text and "b failed" in text


def test_a_path_setting_compares_as_the_file_it_names(tmp_path, monkeypatch):
    """`--edges e.csv` run from its folder and the same file's absolute path resume one run; another
    file does not (its contents are compared apart, input_digests)."""
    monkeypatch.chdir(tmp_path)
    exp = dataclasses.replace(main_experiment(), edges_file=Path("e.csv"), profiles_dir=Path("profiles"))
    recorded = json.loads(json.dumps(exp.to_json()))
    assert recorded["edges_file"] == "e.csv"  # recorded as given
    absolute = dataclasses.replace(exp, edges_file=tmp_path / "e.csv", profiles_dir=tmp_path / "profiles")
    assert runner.changed_settings(recorded, absolute) == []
    other = dataclasses.replace(absolute, edges_file=tmp_path / "other.csv", params_dir=tmp_path)
    assert runner.changed_settings(recorded, other) == ["edges_file", "params_dir"]


def test_a_run_folder_in_use_by_another_run_is_refused(tmp_path):
    """Two runs given one --out would write the same part and checkpoint files: while one holds the
    folder (runner._exclusive), another is refused, naming the holder; once it ends, the folder
    resumes as usual."""
    import fcntl

    exp = dataclasses.replace(main_experiment(), seeds=(0,), datasets=("bbh",))
    out = tmp_path / "run"
    runner.prepare_run_dir(exp, out)
    with open(out / runner.LOCK_FILE, "a+") as other:  # another process's lock (one per open file)
        other.write("4242")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(
            runner.MeshHealError, match=r"is in use by another run \(process 4242\); wait for it"
        ):
            runner.run(exp, out, progress=False)
        assert not (out / "parts").exists()
    assert runner.run(exp, out, progress=False).tasks.height > 0  # released: it runs
    assert runner.run(exp, out, progress=False).tasks.height > 0  # and resumes, holding it again


def test_the_resume_line_counts_committed_checkpoints_only(tmp_path, capsys):
    """A checkpoint folder without its state.json (a first save cut short) is no checkpoint: the
    stream starts again at task 1, and the resume line does not count it."""
    exp = dataclasses.replace(main_experiment(), engine="jax", seeds=(0,), datasets=("bbh",))
    out = tmp_path / "run"
    runner.prepare_run_dir(exp, out)
    runner._checkpoint_dir(out, "meshheal", "bbh", "default", 0).mkdir(parents=True)  # no state.json
    capsys.readouterr()
    runner.run(exp, out, progress=False)
    assert "with a checkpoint" not in capsys.readouterr().out


def test_a_table_write_cut_short_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """A stop during the final tables' write left 0-byte parquet files beside the old summary.json:
    each table is now written beside its place and moved there whole."""
    old = pl.DataFrame({"t": [1, 2]})
    runner._write_tables(tmp_path, {"tasks": old})

    def cut_short(self, path, *args, **kwargs):
        Path(path).write_bytes(b"PAR1")
        raise KeyboardInterrupt

    monkeypatch.setattr(pl.DataFrame, "write_parquet", cut_short)
    with pytest.raises(KeyboardInterrupt):
        runner._write_tables(tmp_path, {"tasks": pl.DataFrame({"t": [3]})})
    monkeypatch.undo()
    assert pl.read_parquet(tmp_path / "tasks.parquet").equals(old)
