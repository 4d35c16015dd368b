"""The main and recovery CLIs end to end: run folders, summary.json, determinism, resume, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import polars as pl
import pytest
import tyro

from meshheal_jax import metrics, params, topology
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.runner import (
    DamagedPartWarning,
    Experiment,
    ProfileIdWarning,
    _part_readable,
    input_digests,
    prepare_run_dir,
)
from meshheal_jax.streams import RECOVERY_PHASES

TABLES = ("tasks", "reviews", "states", "calls")
STAT_KEYS = {"mean", "std", "min", "max", "n_defined"}
BASE_ARGS = ("--methods", "meshheal", "--seeds", "1", "--tasks", "84", "--datasets", "math", "--quiet")


def cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", f"meshheal_jax.{module}", *args],
        check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )  # fmt: skip


def read_frames(run_dir: Path) -> dict[str, pl.DataFrame]:
    return {name: pl.read_parquet(run_dir / f"{name}.parquet") for name in TABLES}


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("main")
    out = root / "run"
    proc = cli("main", *BASE_ARGS, "--out", str(out), cwd=root)
    return proc, out


# ----------------------------------------------------------------------------------------------
# One run of the main experiment
# ----------------------------------------------------------------------------------------------


def test_main_exits_zero_and_prints_tables(main_run):
    proc, out = main_run
    assert proc.returncode == 0, proc.stderr
    assert "Persistent degradation" in proc.stdout and "Accuracy, calls and tokens per task" in proc.stdout
    assert "Detection" in proc.stdout
    assert "math" in proc.stdout
    assert f"results: {out}" in proc.stdout
    assert f"report: {out / 'report.md'}" in proc.stdout


def test_run_folder_contents(main_run):
    _, out = main_run
    for name in ("config.json", "summary.json", "report.md", *(f"{t}.parquet" for t in TABLES)):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["meshheal-math-default-seed0"]
    config = json.loads((out / "config.json").read_text())
    exp = config["experiment"]
    assert exp["name"] == "main" and exp["seeds"] == [0] and exp["n_tasks"] == 84
    assert exp["datasets"] == ["math"] and exp["pairs"] == ["default"] and exp["methods"] == ["meshheal"]
    assert exp["protocol"]["alpha"] == 1.2
    assert "versions" in config and "git_revision" in config


def test_record_tables(main_run):
    _, out = main_run
    frames = read_frames(out)
    for name, df in frames.items():
        assert df.columns == list(metrics.SCHEMAS[name]), name
    tasks = frames["tasks"]
    assert tasks["t"].to_list() == list(range(1, 85))
    assert (
        set(tasks["dataset"]) == {"math"}
        and set(tasks["seed"]) == {0}
        and set(tasks["method"]) == {"meshheal"}
    )
    assert tasks["calls"].sum() == frames["calls"].height
    assert frames["reviews"].height > 84
    assert tasks.filter(pl.col("t") <= 42)["phase"].unique().to_list() == [0]
    assert tasks.filter(pl.col("t") > 42)["phase"].unique().to_list() == [1]


def test_summary_keys(main_run):
    _, out = main_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "main"
    assert summary["engine"] == "jax"
    assert summary["backend"] == "emulated"
    assert len(summary["results"]) == 1  # one dataset: no "mean" entry
    r = summary["results"][0]
    assert (r["method"], r["dataset"], r["pair"], r["seeds"]) == ("meshheal", "math", "default", [0])
    assert (r["variant"], r["detector"]) == ("full", "relative")
    for key in ("acc_healthy", "acc_degraded", "phase_change", "calls_per_task_healthy",
                "calls_per_task_degraded", "tokens_per_task_healthy", "tokens_per_task_degraded",
                "missed", "false_isolations"):  # fmt: skip
        assert set(r[key]) == STAT_KEYS, key
        assert r[key]["n_defined"] == 1, key
    assert [ph["name"] for ph in r["phases"]] == ["healthy", "degraded"]
    for ph in r["phases"]:
        assert set(ph) >= {"name", "acc", "tokens_per_task"}
        assert set(ph["acc"]) == STAT_KEYS and set(ph["tokens_per_task"]) == STAT_KEYS
    assert [a["agent"] for a in r["agents"]] == [2, 4]
    for a in r["agents"]:
        assert set(a) >= {"agent", "degraded_at", "recovered_at", "detection_delay", "closure_seeds",
                          "reintegration_delay"}  # fmt: skip
        assert a["degraded_at"] == 43 and a["recovered_at"] is None
        assert set(a["detection_delay"]) == STAT_KEYS
        assert a["closure_seeds"] in (0, 1)
        assert a["reintegration_delay"]["n_defined"] == 0  # never recovers
    assert isinstance(r["review_audit"], dict) and "initial_recall" in r["review_audit"]
    assert set(r["review_audit"]["initial_recall"]) == STAT_KEYS


def test_summary_agents_name_their_profile(main_run):
    _, out = main_run
    agents = json.loads((out / "summary.json").read_text())["results"][0]["agents"]
    assert {a["agent"]: a["profile"] for a in agents} == {2: "A3", 4: "A5"}


def test_summary_agrees_with_the_records(main_run):
    _, out = main_run
    frames = read_frames(out)
    r = json.loads((out / "summary.json").read_text())["results"][0]
    tasks = frames["tasks"]
    healthy, degraded = tasks.filter(pl.col("t") <= 42), tasks.filter(pl.col("t") > 42)
    assert r["acc_healthy"]["mean"] == pytest.approx(healthy["correct"].cast(pl.Float64).mean())
    assert r["acc_degraded"]["mean"] == pytest.approx(degraded["correct"].cast(pl.Float64).mean())
    assert r["phase_change"]["mean"] == pytest.approx(r["acc_degraded"]["mean"] - r["acc_healthy"]["mean"])
    assert r["calls_per_task_healthy"]["mean"] == pytest.approx(healthy["calls"].mean())
    assert r["tokens_per_task_degraded"]["mean"] == pytest.approx(degraded["tokens"].mean())
    states = frames["states"]
    for a in r["agents"]:
        isolated = states.filter(
            (pl.col("agent") == a["agent"]) & (pl.col("to") == "isolated") & (pl.col("t") >= 43)
        )
        if isolated.height:
            assert a["detection_delay"]["mean"] == isolated["t"].min() - 43
        else:
            assert a["detection_delay"]["n_defined"] == 0
    assert r["missed"]["mean"] == sum(a["detection_delay"]["n_defined"] == 0 for a in r["agents"])
    false_iso = states.filter((pl.col("to") == "isolated") & ~pl.col("degraded")).height
    assert r["false_isolations"]["mean"] == false_iso


def test_same_seed_gives_identical_records(main_run, tmp_path):
    proc, out = main_run
    assert proc.returncode == 0
    again = tmp_path / "again"
    proc2 = cli("main", *BASE_ARGS, "--out", str(again), cwd=tmp_path)
    assert proc2.returncode == 0, proc2.stderr
    first, second = read_frames(out), read_frames(again)
    for name in TABLES:
        assert first[name].equals(second[name], null_equal=True), name
    s1 = json.loads((out / "summary.json").read_text())
    s2 = json.loads((again / "summary.json").read_text())
    assert s1 == s2


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------


def test_prepare_run_dir_reopens_the_same_experiment(tmp_path):
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=42)
    out = tmp_path / "run"
    assert prepare_run_dir(exp, out) == out
    config = (out / "config.json").read_text()
    assert prepare_run_dir(exp, out) == out  # resume
    assert (out / "config.json").read_text() == config


def test_prepare_run_dir_refuses_another_experiment(tmp_path):
    out = tmp_path / "run"
    prepare_run_dir(
        Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=42), out
    )
    other = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=84)
    with pytest.raises(MeshHealError, match=r"different configuration \(n_tasks differ\)") as refused:
        prepare_run_dir(other, out)
    nothing_lost = "(it holds no finished stream, checkpoint or model reply yet: deleting it loses nothing)"
    assert nothing_lost in str(refused.value)
    assert str(refused.value).endswith("; recorded n_tasks=42, given n_tasks=84")
    (out / "responses.sqlite").write_bytes(b"not a database")  # unreadable: it may hold replies
    with pytest.raises(MeshHealError, match=r"choose another --out; recorded n_tasks=42, given n_tasks=84$"):
        prepare_run_dir(other, out)
    (out / "responses.sqlite").unlink()
    (out / "parts" / "meshheal-math-default-seed0").mkdir(parents=True)  # a finished stream
    with pytest.raises(MeshHealError, match=r"choose another --out; recorded n_tasks=42, given n_tasks=84$"):
        prepare_run_dir(other, out)
    other = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=42,
                       protocol=ProtocolParams(alpha=1.5))  # fmt: skip
    with pytest.raises(
        MeshHealError,
        match=r"\(protocol.alpha differ\).*recorded protocol.alpha=1.2, given protocol.alpha=1.5$",
    ):
        prepare_run_dir(other, out)
    # the same seeds in another order would run the same streams, but the tables follow the order
    seeds = tmp_path / "seeds"
    prepare_run_dir(dataclasses.replace(other, protocol=ProtocolParams(), seeds=(0, 1)), seeds)
    with pytest.raises(MeshHealError, match=r"given seeds=\[1, 0\] \(seeds: the same values in another order; "
                                            r"give them in the recorded order"):  # fmt: skip
        prepare_run_dir(dataclasses.replace(other, protocol=ProtocolParams(), seeds=(1, 0)), seeds)
    with pytest.raises(MeshHealError, match=r"given seeds=\[0, 2\]$"):  # other values: no such hint
        prepare_run_dir(dataclasses.replace(other, protocol=ProtocolParams(), seeds=(0, 2)), seeds)


def test_a_folder_from_before_a_protocol_field_resumes_with_its_default(tmp_path):
    """next_hop_ties was added to ProtocolParams later: a folder whose config.json lacks it ran with
    the default and resumes; the other value is refused."""
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=84)
    out = prepare_run_dir(exp, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    del config["experiment"]["protocol"]["next_hop_ties"]
    (out / "config.json").write_text(json.dumps(config))
    assert prepare_run_dir(exp, out) == out
    lowest = dataclasses.replace(exp, protocol=ProtocolParams(next_hop_ties="lowest"))
    with pytest.raises(MeshHealError, match=r"\(protocol.next_hop_ties differ\)"):
        prepare_run_dir(lowest, out)


@pytest.mark.parametrize("edited", ["model file llama-3.2-1b", "profile math"])
def test_resume_refuses_input_files_whose_contents_changed(tmp_path, edited):
    """The configuration names the folders; a resumed run must also read the same file contents,
    or its finished streams (old contents) and the rest (new ones) would be mixed in one summary."""
    params_dir, profiles_dir = tmp_path / "params", tmp_path / "profiles"
    shutil.copytree(params.MODEL_DIR, params_dir)
    shutil.copytree(topology.PROFILE_DIR, profiles_dir)
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0, 1), n_tasks=42,
                     params_dir=params_dir, profiles_dir=profiles_dir)  # fmt: skip
    out = prepare_run_dir(exp, tmp_path / "run")
    assert prepare_run_dir(exp, out) == out  # unchanged files: resumes
    path = params_dir / "llama-3.2-1b.toml" if edited.startswith("model") else profiles_dir / "math.toml"
    original = path.read_text()
    path.write_text(original + "\n# an edit that changes no value still changes the file\n")
    with pytest.raises(MeshHealError, match=f"other contents of {edited} \\({path}\\)"):
        prepare_run_dir(exp, out)
    path.write_text(original)  # restored: resumes again
    assert prepare_run_dir(exp, out) == out


def test_inputs_kept_from_the_first_resume_of_an_older_folder_and_live_runs_skip_model_files(tmp_path):
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=42)
    out = prepare_run_dir(exp, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    assert sorted(config["inputs"]) == ["model file gpt-oss-120b", "model file llama-3.2-1b", "profile math"]
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "inputs"}))
    prepare_run_dir(exp, out)  # a folder from before inputs were kept resumes, and keeps them from now on
    assert json.loads((out / "config.json").read_text())["inputs"] == config["inputs"]
    live = dataclasses.replace(exp, backend="live")  # its calls read no emulator numbers
    assert sorted(input_digests(live)) == ["profile math"]


def test_resume_after_losing_a_stream_and_the_summary(tmp_path):
    out = tmp_path / "run"
    args = (
        "--methods",
        "meshheal",
        "--seeds",
        "2",
        "--tasks",
        "42",
        "--datasets",
        "math",
        "--quiet",
        "--out",
        str(out),
    )
    first = cli("main", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    summary = json.loads((out / "summary.json").read_text())
    frames = read_frames(out)
    assert sorted(frames["tasks"]["seed"].unique().to_list()) == [0, 1]
    kept = out / "parts" / "meshheal-math-default-seed0" / "tasks.parquet"
    kept_stat = kept.stat()
    (out / "summary.json").unlink()
    shutil.rmtree(out / "parts" / "meshheal-math-default-seed1")

    second = cli("main", *args[:-3], "--out", str(out), cwd=tmp_path)  # not --quiet: it says it resumes
    assert second.returncode == 0, second.stderr
    assert f"resuming {out}: 1 of 2 streams already finished" in second.stdout
    assert (out / "parts" / "meshheal-math-default-seed1").is_dir()
    assert kept.stat().st_mtime_ns == kept_stat.st_mtime_ns  # the finished stream was not re-run
    assert json.loads((out / "summary.json").read_text()) == summary
    for name, df in read_frames(out).items():
        assert df.equals(frames[name], null_equal=True), name


def test_rerun_with_another_configuration_is_refused(main_run, tmp_path):
    proc, out = main_run
    assert proc.returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    other = cli("main", "--methods", "meshheal", "--seeds", "1", "--tasks", "168", "--datasets", "math", "--quiet",
                "--out", str(out),
                cwd=tmp_path)  # fmt: skip
    assert other.returncode == 2
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and "different configuration" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # left as it was
    sample = cli("main", *BASE_ARGS, "--data", "sample", "--out", str(out), cwd=tmp_path)
    assert sample.returncode == 2 and "(live.data, live.reasoning_effort differ)" in sample.stderr, (
        sample.stderr
    )


def test_emulated_run_with_data_counts_real_question_tokens(main_run, tmp_path):
    """--data in an emulated run: the same outcomes as at the profile's mean question tokens, other
    prompt tokens (spec/emulator.md); a folder of the other kind is not resumed."""
    proc, out = main_run
    assert proc.returncode == 0
    refused = cli("main", *BASE_ARGS, "--data", "sample", "--out", str(out), cwd=tmp_path)
    assert refused.returncode == 2 and "different configuration" in refused.stderr
    real = tmp_path / "real"
    ran = cli("main", *BASE_ARGS, "--data", "sample", "--out", str(real), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert json.loads((real / "config.json").read_text())["experiment"]["live"]["data"] == "sample"
    at_mean, with_data = (pl.read_parquet(d / "tasks.parquet") for d in (out, real))
    same = ["t", "route", "answered", "correct", "calls", "completion_tokens"]
    assert at_mean.select(same).equals(with_data.select(same))
    assert (at_mean["prompt_tokens"] != with_data["prompt_tokens"]).mean() > 0.9


# ----------------------------------------------------------------------------------------------
# Bad input: exit status 2, one line on stderr, nothing written
# ----------------------------------------------------------------------------------------------


def broken_profiles_dir(root: Path) -> Path:
    folder = root / "profiles"
    folder.mkdir()
    text = (topology.PROFILE_DIR / "bbh.toml").read_text()
    broken = text.replace('holders = ["A2", "A3", "A6"]', 'holders = ["A2", "A6"]', 1)  # temporal
    assert broken != text
    (folder / "bbh.toml").write_text(broken)
    return folder


BAD_INPUTS = {
    "unknown dataset": (("--datasets", "nosuch"), "unknown dataset 'nosuch'"),
    "unknown pair": (("--datasets", "math", "--pair", "Z"), "unknown pair 'Z'"),
    "zero seeds": (("--datasets", "math", "--seeds", "0"), "--seeds must be >= 1"),
    "degraded agent 9": (("--datasets", "math", "--degraded", "9"), "agent 9"),
    "broken profile": (("--datasets", "bbh", "--profiles-dir", "<profiles>"), "'temporal'"),
    "seed past int32": (
        ("--datasets", "math", "--seed-list", "2147483648"),
        "seeds must be distinct and in 0..2**31-1",
    ),
    "no tasks": (("--datasets", "math", "--tasks", "0"), "tasks per stream must be >= 1"),
    "a dataset twice": (("--datasets", "math", "math"), "datasets must be distinct, got ['math', 'math']"),
    "no datasets": (("--datasets",), "no datasets given"),
    "empty --data": (("--datasets", "bbh", "--data", ""), "--data is empty"),  # "$DIR" with DIR unset
    # the jax engine allocates every window up front: 219 GiB once stalled in the allocator, unkillable
    "windows past memory": (
        ("--datasets", "bbh", "--protocol.window-scores", "2000000000"),
        "the detector's windows of the 5 MeshHeal stream(s) held side by side would take 21,904.7 GiB (per stream: 6",
    ),
    # a path would also name the run folder's parts (and could leave it through '..')
    "a profile path as dataset": (("--datasets", "../profiles/bbh.toml"), "is not a name"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    args, fragment = BAD_INPUTS[case]
    if "<profiles>" in args:
        args = tuple(str(broken_profiles_dir(tmp_path)) if a == "<profiles>" else a for a in args)
    out = tmp_path / "out"
    proc = cli("main", *(("--tasks", "84") if "--tasks" not in args else ()), "--quiet", "--out", str(out), *args,
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0]
    assert not out.exists()  # nothing is half-written


def test_recovery_refuses_to_show_a_seed_it_does_not_run(tmp_path):
    out = tmp_path / "out"
    proc = cli("recovery", "--seeds", "1", "--show-seed", "7", "--quiet", "--out", str(out), cwd=tmp_path)
    assert (
        proc.returncode == 2 and proc.stderr.strip() == "error: --show-seed 7 is not among the seeds run [0]"
    )
    assert not out.exists()


def two_profiles_one_id(root: Path) -> Path:
    folder = root / "clash"
    folder.mkdir()
    shutil.copy(topology.PROFILE_DIR / "math.toml", folder)
    math_id = topology.load_profile("math").dataset_id
    text = (topology.PROFILE_DIR / "bbh.toml").read_text()
    bbh_id = topology.load_profile("bbh").dataset_id
    (folder / "bbh.toml").write_text(text.replace(f"dataset_id = {bbh_id}", f"dataset_id = {math_id}", 1))
    return folder


@pytest.mark.parametrize(
    "changes, message",
    [({"pairs": ("A", "A")}, "pairs must be distinct, got ['A', 'A']"),
     ({"pairs": ()}, "no pairs given"),
     ({"graph_seed": -1}, "--graph-seed must be in 0..2**63-1, got -1"),
     ({"datasets": ("bbh.toml",)}, "'bbh.toml' is not a name")],
)  # fmt: skip
def test_run_settings_refused_before_anything_is_written(changes, message, tmp_path):
    """Experiment.validate, which runner.run calls before it makes the run folder."""
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=84)
    with pytest.raises(MeshHealError, match=re.escape(message)):
        dataclasses.replace(exp, **changes).validate()


def test_profiles_sharing_a_dataset_id_are_warned_of(tmp_path):
    exp = Experiment(name="main", datasets=("bbh", "math"), pairs=("default",), seeds=(0,), n_tasks=84,
                     profiles_dir=two_profiles_one_id(tmp_path))  # fmt: skip
    with pytest.warns(ProfileIdWarning, match="their streams draw the same numbers"):
        exp.validate()


def test_a_second_sigterm_does_not_cut_the_stop_short(monkeypatch, capsys):
    """`timeout` signals the process and then its group: the second SIGTERM arrives while the stop
    writes what it keeps (checkpoints, a live call's trace), and must not interrupt that."""
    from meshheal_jax import cli as cli_module

    written = []

    @dataclasses.dataclass
    class Nothing:
        pass

    def body(_config: Nothing) -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        finally:  # what a stop writes on its way out
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            written.append("checkpoint")

    monkeypatch.setattr(sys, "argv", ["command"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        cli_module.entrypoint(Nothing, body, "a command")
    assert written == ["checkpoint"]
    assert ended.value.code == 143 and capsys.readouterr().err.strip() == cli_module.STOPPED
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signalled_inside_a_gc_callback_is_raised_a_moment_later(
    signum, status, monkeypatch, capsys, terminal_sigint
):
    """An exception a signal handler raises inside a garbage-collector callback (JAX registers one)
    is printed and dropped ("Exception ignored in"): the stop is sent again a moment later
    (cli._stop_dropped) and stops the command, instead of being lost."""
    import gc

    from meshheal_jax import cli as cli_module

    @dataclasses.dataclass
    class Nothing:
        pass

    finished = []

    def in_a_callback(phase, info):
        if phase == "start" and not finished:
            finished.append(False)
            os.kill(os.getpid(), signum)  # its handler runs at the next Python step: in here
            sum(range(1_000))

    def body(_config: Nothing) -> None:
        gc.callbacks.append(in_a_callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(in_a_callback)
        for _ in range(500):  # 5 s: the sent-again stop ends it
            time.sleep(0.01)
        finished.append(True)

    monkeypatch.setattr(sys, "argv", ["command"])
    hook = sys.unraisablehook
    with pytest.raises(SystemExit) as ended:
        cli_module.entrypoint(Nothing, body, "a command")
    assert ended.value.code == status and finished == [False]
    assert capsys.readouterr().err.strip() == cli_module.STOPPED  # no "Exception ignored" either
    assert sys.unraisablehook is hook


def test_a_second_ctrl_c_exits_without_waiting_for_running_batches(tmp_path):
    """errors.Abandoned (a second Ctrl-C while a baseline's batch runs on): the stop line, status
    130, and no wait for the thread that an ordinary exit would join."""
    script = (
        "import threading, time\n"
        "from meshheal_jax import cli, errors\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "def main():\n"
        "    raise errors.Abandoned()\n"
        "cli.guarded(main)\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, check=False
    )
    assert proc.returncode == 130 and time.monotonic() - started < 40
    assert proc.stderr.strip().startswith("stopped: finished streams")


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "no such folder", "out of memory"])
def test_ctrl_c_sigterm_and_system_errors_print_one_line(stop, monkeypatch, capsys):
    @dataclasses.dataclass
    class Nothing:
        pass

    def body(_config: Nothing) -> None:
        if stop == "ctrl-c":
            raise KeyboardInterrupt
        if stop == "sigterm":  # what `timeout` and job schedulers send: stopped as Ctrl-C stops
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        if stop == "out of memory":
            raise MemoryError
        raise NotADirectoryError(20, "Not a directory", "/x/run")

    from meshheal_jax import cli as cli_module

    monkeypatch.setattr(sys, "argv", ["command"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        cli_module.entrypoint(Nothing, body, "a command")
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
    err = capsys.readouterr().err.strip()
    code, message = {
        "ctrl-c": (130, cli_module.STOPPED),
        "sigterm": (143, cli_module.STOPPED),
        "no such folder": (1, "error: [Errno 20] Not a directory: '/x/run'"),
        "out of memory": (1, None),
    }[stop]
    assert ended.value.code == code
    assert err == message if message else err.startswith("error: out of memory (") and "\n" not in err


def test_a_stopped_command_given_no_out_names_the_folder_it_made(monkeypatch, capsys):
    """The stop line says which runs/<experiment>-<time> folder the same command resumes with --out."""
    from meshheal_jax import cli as cli_module
    from meshheal_jax import files

    made = []

    def stopped_after_choosing(_config) -> None:
        made.append(files.default_out("main"))
        raise KeyboardInterrupt

    def stopped(_config) -> None:  # a command given --out chooses no folder
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["command"])
    nothing = dataclasses.make_dataclass("Nothing", [])
    with pytest.raises(SystemExit) as ended:
        cli_module.entrypoint(nothing, stopped_after_choosing, "a command")
    assert ended.value.code == 130
    assert capsys.readouterr().err.strip() == f"{cli_module.STOPPED}; this run's folder: {made[0]}"
    assert made[0].parent.name == "runs" and made[0].name.startswith("main-")
    with pytest.raises(SystemExit):  # the next command in this process names no earlier folder
        cli_module.entrypoint(nothing, stopped, "a command")
    assert capsys.readouterr().err.strip() == cli_module.STOPPED


def test_a_command_refuses_a_folder_holding_arms_it_does_not_run(tmp_path):
    """ablate / detectors / scale: every arm already in --out must be one the command runs, or the
    combined summary would drop it (or mix its settings with the new arms')."""
    from meshheal_jax import runner

    (tmp_path / "no_takeover").mkdir()
    (tmp_path / "no_takeover" / "config.json").write_text("{}")
    runner.check_arms(tmp_path, ["full", "single_reviewer", "no_takeover"], "--variants")  # a superset: fine
    with pytest.raises(MeshHealError, match=r"holds the run\(s\) of no_takeover.*give the same --variants"):
        runner.check_arms(tmp_path, ["full"], "--variants")
    runner.check_arms(tmp_path / "nowhere", ["full"], "--variants")  # nothing there yet
    (tmp_path / "single_reviewer" / "parts").mkdir(parents=True)  # finished streams, config.json lost
    with pytest.raises(MeshHealError, match=r"holds the run\(s\) of single_reviewer, which"):
        runner.check_arms(tmp_path, ["full", "no_takeover"], "--variants")
    shutil.rmtree(tmp_path / "single_reviewer")
    (tmp_path / "scale" / "complete").mkdir(parents=True)
    (tmp_path / "scale" / "complete" / "config.json").write_text("{}")
    for command, args in (("ablate", ("--variants", "full")), ("scale", ("--agents", "96", "--sparse"))):
        out = tmp_path if command == "ablate" else tmp_path / "scale"
        proc = cli(command, *args, "--seeds", "1", "--quiet", "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 2 and "which this command does not run" in proc.stderr, proc.stderr


def test_a_damaged_finished_stream_runs_again(main_run, tmp_path):
    """A part cut short (no parquet footer) or missing a table is removed with a one-line warning
    and its stream runs again: the same records as before."""
    proc, out = main_run
    assert proc.returncode == 0, proc.stderr
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    part = copy / "parts" / "meshheal-math-default-seed0"
    reviews = part / "reviews.parquet"
    reviews.write_bytes(reviews.read_bytes()[:100])
    (copy / "summary.json").unlink()
    again = cli("main", *BASE_ARGS, "--out", str(copy), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    warned = [line for line in again.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and f"finished stream {part} is damaged" in warned[0], again.stderr
    for name, df in read_frames(copy).items():
        assert df.equals(read_frames(out)[name], null_equal=True), name
    (part / "calls.parquet").unlink()  # a table missing: the same, without a second run here
    with pytest.warns(
        DamagedPartWarning, match="FileNotFoundError.*set aside as meshheal-math-default-seed0.damaged"
    ):
        assert not _part_readable(part, TABLES)
    assert not part.exists() and (part.parent / f"{part.name}.damaged" / "tasks.parquet").exists()
    assert _part_readable(out / "parts" / part.name, TABLES)


COMMANDS = ("main", "recovery", "scale", "sweep", "ablate", "detectors", "calibration_report", "calibrate",
            "calibration_fit", "report")  # fmt: skip


def test_commands_import_neither_jax_nor_matplotlib_before_they_run():
    """A command's flags and inputs are checked before JAX (its compiler) and matplotlib load, so a
    refused command answers at once: the modules that need them are imported where they are used."""
    probe = "import sys; " + "; ".join(f"import meshheal_jax.{m}" for m in COMMANDS)
    probe += "; print(sorted(m for m in ('jax', 'jaxlib', 'matplotlib') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "args, message",
    [(("--protocol.move-limit", "0"), "protocol parameter move_limit must be >= 1, got 0"),
     (("--protocol.tau-to", "5"), "protocol parameter tau_to must be in [0, 1], got 5.0"),
     (("--protocol.alpha", "nan"), "protocol parameter alpha must be finite, got nan"),
     (("--protocol.alpha", "3"), "need 0 < alpha <= beta, got alpha=3.0, beta=2.0")],
)  # fmt: skip
def test_protocol_values_out_of_range_are_refused(args, message, tmp_path):
    """A refused --protocol.* value is one error line naming it, exit status 2 (checked after the
    flag parser, which would show it in a panel of its own), and nothing is written."""
    out = tmp_path / "out"
    proc = cli(
        "main", "--datasets", "math", "--tasks", "84", "--quiet", "--out", str(out), *args, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message}", proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "changes, message",
    [({"alpha": float("inf"), "beta": float("inf")}, "alpha must be finite, got inf"),
     ({"cusum_h": float("nan")}, "cusum_h must be finite, got nan"),
     ({"probe_interval": 2**40}, "probe_interval must fit in int32")],
)  # fmt: skip
def test_protocol_values_must_be_finite_and_fit_the_engines(changes, message):
    with pytest.raises(MeshHealError, match=message):
        ProtocolParams(**changes)


def test_broken_profile_message_names_the_rule(tmp_path):
    folder = broken_profiles_dir(tmp_path)
    proc = cli("main", "--datasets", "bbh", "--profiles-dir", str(folder), "--quiet", "--out",
               str(tmp_path / "out"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "every ability is held by exactly three agents" in proc.stderr
    assert str(folder / "bbh.toml") in proc.stderr


def test_out_folder_with_an_unrelated_file(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    proc = cli("main", *BASE_ARGS, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a run folder" in lines[0]
    assert [p.name for p in out.iterdir()] == ["thesis.txt"]
    assert (out / "thesis.txt").read_text() == "precious"


def test_a_run_killed_writing_its_first_config_runs_again(tmp_path):
    """kill -9 between write_atomic's temporary file and its rename leaves only config.json.tmp: the
    folder is still a new one (it was refused as 'not a run folder' until deleted by hand)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json.tmp").write_text("")
    proc = cli("main", *BASE_ARGS, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").is_file() and not (out / "config.json.tmp").exists()


def test_bad_stream_length_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = cli("main", "--seeds", "1", "--tasks", "50", "--datasets", "math", "--quiet", "--out", str(out),
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "multiple of 42" in proc.stderr
    assert not out.exists()


def test_the_cli_prints_a_phase_mix_warning_as_one_line(tmp_path):
    proc = cli("main", "--methods", "meshheal", "--seeds", "1", "--tasks", "42", "--datasets", "math",
               "--engine", "reference", "--quiet", "--out", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "type mixes differ" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: --tasks 42 splits into 2 phases")
    assert "runner.py" not in proc.stderr


def test_every_warning_of_the_project_prints_as_one_line():
    from meshheal_jax import cli as cli_module
    from meshheal_jax.checkpoints import CheckpointWarning
    from meshheal_jax.data import QuestionPoolWarning
    from meshheal_jax.runner import DamagedPartWarning, PhaseMixWarning

    for kind in (PhaseMixWarning, QuestionPoolWarning, DamagedPartWarning, CheckpointWarning):
        assert cli_module._warning_line("what happened", kind, "engine.py", 9) == "warning: what happened\n"
    assert cli_module._warning_line("other", UserWarning, "x.py", 9).startswith("x.py:9: UserWarning")


def test_phases_of_unequal_type_mix_are_warned():
    """spec/experiments.md: the two phases have the same type mix. 126 tasks split 63 / 63, not whole
    blocks of 42: allowed (short runs), with a warning; 504 and 84 are whole blocks."""
    from meshheal_jax.runner import Experiment, PhaseMixWarning

    with pytest.warns(PhaseMixWarning, match="a multiple of 84 keeps them equal"):
        Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=126).validate()
    for n in (84, 504):
        with warnings.catch_warnings():
            warnings.simplefilter("error", PhaseMixWarning)
            Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=n).validate()


def test_degraded_agents_default_to_the_profiles_targets(tmp_path):
    """main's --degraded defaults to the profile's degraded_targets: here BBH relabelled (A1<->A3,
    A4<->A5), whose targets are A1 and A4 (agents 0 and 3), not agents 2 and 4."""
    import re

    from meshheal_jax import main, recovery

    swap = {"A1": "A3", "A3": "A1", "A4": "A5", "A5": "A4"}
    text = re.sub(
        r"A[1-6]", lambda m: swap.get(m.group(), m.group()), (topology.PROFILE_DIR / "bbh.toml").read_text()
    )
    assert 'degraded_targets = ["A1", "A4"]' in text
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "bbh.toml").write_text(text)
    args = ["--datasets", "bbh", "--profiles-dir", str(folder)]
    assert main.experiment(tyro.cli(main.MainConfig, args=args)).degraded == (0, 3)
    assert main.experiment(tyro.cli(main.MainConfig, args=[*args, "--degraded", "1"])).degraded == (1,)
    assert main.experiment(tyro.cli(main.MainConfig, args=["--datasets", "bbh"])).degraded == (2, 4)
    # recovery: A5 (here agent 3) degraded in phases 2-3, A3 (agent 0) in phases 3-4
    rec = recovery.experiment(
        tyro.cli(recovery.RecoveryConfig, args=["--dataset", "bbh", "--profiles-dir", str(folder)])
    )
    assert [agent for agent, _, _ in rec.schedule().intervals] == [3, 0]


# ----------------------------------------------------------------------------------------------
# Recovery experiment
# ----------------------------------------------------------------------------------------------


def test_recovery_cli(tmp_path):
    out = tmp_path / "rec"
    proc = cli("recovery", "--methods", "meshheal", "--seeds", "1", "--tasks", "210", "--quiet", "--out", str(out),
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Staggered degradation and recovery" in proc.stdout
    assert "State changes of meshheal, seed 0" in proc.stdout
    assert (out / "report.md").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "recovery" and summary["n_tasks"] == 210
    (r,) = summary["results"]
    assert r["dataset"] == "math"
    assert tuple(ph["name"] for ph in r["phases"]) == RECOVERY_PHASES
    agents = {a["agent"]: (a["degraded_at"], a["recovered_at"]) for a in r["agents"]}
    assert agents == {4: (43, 127), 2: (85, 169)}  # A5 in phases 2-3, A3 in phases 3-4 (of 42)
    tasks = pl.read_parquet(out / "tasks.parquet")
    assert tasks.height == 210
    assert tasks.group_by("phase").len().sort("phase")["len"].to_list() == [42] * 5


@pytest.mark.parametrize("command", ["calibration_report", "detectors"])
def test_commands_over_several_pairs_refuse_pair(command, tmp_path):
    out = tmp_path / "out"
    proc = cli(command, "--pair", "A", "--quiet", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: this command takes --pairs (several), not --pair"
    assert not out.exists()


def test_output_paths_that_cannot_be_written_are_refused_first(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("precious")
    proc = cli("scale", "--agents", "12", "--sparse", "--quiet", "--out", str(a_file), cwd=tmp_path)
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: output path {a_file} exists and is not a folder"
    )
    assert a_file.read_text() == "precious"
    proc = cli("calibration_report", "--json-out", str(tmp_path), "--quiet", "--out", str(tmp_path / "run"),
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "--json-out" in proc.stderr and not (tmp_path / "run").exists()


def test_a_folder_that_lost_its_config_says_how_to_resume(tmp_path):
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=42)
    out = tmp_path / "run"
    (out / "parts" / "meshheal-math-default-seed0").mkdir(parents=True)
    with pytest.raises(
        MeshHealError, match=r"holds finished streams \(parts/\) but no config.json; to resume, restore"
    ):
        prepare_run_dir(exp, out)
    (out / "config.json").write_text('{"trunc')
    with pytest.raises(MeshHealError, match=r"unreadable config.json; to resume, restore its config.json"):
        prepare_run_dir(exp, out)
    (out / "config.json").unlink()
    shutil.rmtree(out / "parts")
    (out / "checkpoints" / "meshheal-math-default-seed0").mkdir(parents=True)  # checkpoints alone
    with pytest.raises(
        MeshHealError, match=r"holds checkpoints \(checkpoints/\) but no config.json; to resume"
    ):
        prepare_run_dir(exp, out)


def test_a_multi_arm_command_checks_every_arm_folder_before_running_any(tmp_path):
    """ablate (and detectors, through the same run_all) / scale: an arm folder holding another
    configuration is refused before any arm runs, so no other arm is run at the new settings."""
    from meshheal_jax import ablate, scale

    config = tyro.cli(ablate.AblateConfig, args=["--seeds", "1", "--tasks", "84", "--protocol.alpha", "1.1"])
    prepare_run_dir(ablate.experiment(config, "full"), tmp_path / "ablate" / "full")
    proc = cli("ablate", "--variants", "no_takeover", "full", "--seeds", "1", "--tasks", "84", "--quiet",
               "--out", str(tmp_path / "ablate"), cwd=tmp_path)  # fmt: skip
    assert (
        proc.returncode == 2
        and "ablate/full holds a run of a different configuration (protocol.alpha" in proc.stderr
    )
    assert not (tmp_path / "ablate" / "no_takeover").exists()
    config = tyro.cli(scale.ScaleConfig, args=["--agents", "12", "--seeds", "1", "--protocol.alpha", "1.1"])
    prepare_run_dir(scale.experiment(config, "sparse"), tmp_path / "scale" / "sparse")
    proc = cli("scale", "--agents", "12", "--compare", "--seeds", "1", "--quiet", "--out", str(tmp_path / "scale"),
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "scale/sparse holds a run of a different configuration" in proc.stderr
    assert not (tmp_path / "scale" / "complete").exists()


@pytest.mark.parametrize(
    "config_text, message",
    [
        (b"\xff\xff", "has an unreadable config.json"),  # not UTF-8
        (b"[]", "has an unreadable config.json (JSON, but not an object); to resume, restore"),
        (b'{"meshheal_run": true, "experiment": [], "inputs": {}}', "has a damaged config.json"),
        (
            b'{"meshheal_run": true, "experiment": {}, "inputs": {"profile bbh": "x"}}',
            "has a damaged config.json",
        ),
    ],
)
def test_a_damaged_config_json_is_named_in_one_line(config_text, message, tmp_path):
    out = tmp_path / "run"
    (out / "parts").mkdir(parents=True)
    (out / "config.json").write_bytes(config_text)
    proc = cli(
        "main",
        "--datasets",
        "bbh",
        "--seeds",
        "1",
        "--tasks",
        "84",
        "--quiet",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "command, flag, value", [("ablate", "variant", "no_takeover"), ("detectors", "detector", "cusum")]
)
def test_commands_over_arms_refuse_the_arms_own_protocol_flag(command, flag, value, tmp_path):
    # each arm sets its own variant / detector: the flag would be dropped without a word
    out = tmp_path / "out"
    proc = cli(command, f"--protocol.{flag}", value, "--quiet", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"error: this command runs each of --{flag}s in turn: it takes --{flag}s, not --protocol.{flag}"
    )
    assert not out.exists()


def script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(repo / "scripts" / f"{name}.py"), *args], check=False,
                          capture_output=True, text=True, cwd=cwd, timeout=120)  # fmt: skip


def test_the_scripts_name_a_bad_run_folder_in_one_line(main_run, tmp_path):
    proc, out = main_run
    assert proc.returncode == 0, proc.stderr
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    assert script("isolation_episodes", str(copy), cwd=tmp_path).returncode == 0  # a main run is read
    assert script("stream_collapses", str(copy), cwd=tmp_path).returncode == 0
    cases = [
        ("reintegration", copy, "is not a recovery run (its experiment is 'main')"),
        ("reintegration", tmp_path / "nowhere", "does not exist"),
        ("isolation_episodes", tmp_path / "nowhere", "does not exist"),
        ("stream_collapses", tmp_path / "nowhere", "does not exist"),
    ]
    for name, folder, message in cases:
        result = script(name, str(folder), cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, (
            name,
            result.stderr,
        )
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(
        json.dumps({**config, "experiment": {**config["experiment"], "name": "sweep"}})
    )
    result = script("isolation_episodes", str(copy), cwd=tmp_path)  # its grid points would be pooled
    assert result.returncode == 2 and "is a sweep run" in result.stderr
    (copy / "tasks.parquet").write_text("garbage")
    for name in ("isolation_episodes", "stream_collapses"):
        result = script(name, str(copy), cwd=tmp_path)
        assert result.returncode == 2 and "tasks.parquet is not a readable parquet file" in result.stderr, (
            result.stderr
        )
