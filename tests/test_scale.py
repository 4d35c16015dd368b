"""The network-scaling command (`python -m meshheal_jax.scale`, spec/experiments.md §3) end to end,
and the large-network metrics it relies on (metrics.scale_outcomes, metrics.any_degraded).

Compilation dominates: the JAX engine compiles once per shape (agents, neighbour-table width,
streams, slots), so every JAX run here is the 12-agent sparse graph of graph seed 0 with 2 seeds
and the default slots, in this process (the jit cache is shared); the complete-vs-sparse
comparison and --slots 1 run on the reference engine, which needs no compilation.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import scipy.sparse
import scipy.sparse.csgraph
import tyro

from meshheal_jax import graphs, metrics, runner, scale, topology
from meshheal_jax.errors import MeshHealError
from meshheal_jax.runner import Experiment
from meshheal_jax.scale import ScaleConfig
from meshheal_jax.streams import HealthSchedule, persistent_schedule, recovery_schedule

N_AGENTS = 12
REPLICAS = N_AGENTS // 6
N_TASKS = 504 * REPLICAS
MIDPOINT = N_TASKS // 2 + 1  # first degraded task
SEEDS = [0, 1]
TARGETS = (2, 4, 8, 10)  # A3 and A5 of both replicas
STAT_KEYS = {"mean", "std", "min", "max", "n_defined"}
TABLES = ("tasks", "reviews", "states", "calls")
RESULT_STATS = (
    "isolated_degraded", "false_isolations", "missed", "acc_healthy", "acc_degraded",
    "tokens_per_task_healthy", "tokens_per_task_degraded", "unreviewed_outputs", "detection_delay_mean",
)  # fmt: skip
RESULT_KEYS = {
    "n_agents", "topology", "degraded", "edges", "edge_fraction", "max_ability_distance", "run_dir", "wall_s",
    "seeds", *RESULT_STATS,
}  # fmt: skip
JAX_ARGS = ("--agents", str(N_AGENTS), "--sparse", "--seeds", "2", "--quiet")
REF_ARGS = (
    "--agents",
    str(N_AGENTS),
    "--compare",
    "--seeds",
    "2",
    "--engine",
    "reference",
    "--slots",
    "1",
    "--quiet",
)


def parse(*args: str) -> ScaleConfig:
    """The config the CLI builds from these flags."""
    return tyro.cli(ScaleConfig, args=list(args))


def run_body(cfg: ScaleConfig) -> str:
    """scale.body in this process (shares the jit cache); returns what it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        scale.body(cfg)
    return buffer.getvalue()


def cli_subprocess(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "meshheal_jax.scale", *args],
        check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )  # fmt: skip


def cli_in_process(monkeypatch, capsys, *args: str) -> tuple[int | str | None, str]:
    """scale.cli() with these argv; returns (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["meshheal_jax.scale", *args])
    with pytest.raises(SystemExit) as exit_info:
        scale.cli()
    return exit_info.value.code, capsys.readouterr().err


def assert_one_line_error(code, stderr: str, *fragments: str) -> str:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def bbh_graph() -> tuple[topology.Profile, np.ndarray, np.ndarray, np.ndarray]:
    """The BBH profile at 12 agents and the sparse graph `--sparse` builds (graph seed 0)."""
    profile = topology.load_profile("bbh")
    holds = topology.replicate_holds(profile, N_AGENTS)
    degraded = graphs.degraded_mask(profile.degraded_targets, N_AGENTS)
    return profile, holds, degraded, graphs.sparse_edges(holds, degraded, 0, ability_names=profile.abilities)


def numbers(result: dict) -> dict:
    """A result without what legitimately differs between two runs of the same streams."""
    return {k: v for k, v in result.items() if k not in ("wall_s", "run_dir", "resumed")}


def file_snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
    }


# ----------------------------------------------------------------------------------------------
# Runs shared by the tests of this module
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory) -> dict:
    """`scale --agents 12 --sparse --seeds 2` on the JAX engine, default slots."""
    out = tmp_path_factory.mktemp("scale-jax") / "run"
    cfg = parse(*JAX_ARGS, "--out", str(out))
    printed = run_body(cfg)
    return {
        "cfg": cfg,
        "out": out,
        "printed": printed,
        "summary": json.loads((out / "summary.json").read_text()),
    }


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory) -> dict:
    """`scale --agents 12 --compare --seeds 2 --engine reference --slots 1`."""
    out = tmp_path_factory.mktemp("scale-ref") / "run"
    cfg = parse(*REF_ARGS, "--out", str(out))
    printed = run_body(cfg)
    return {
        "cfg": cfg,
        "out": out,
        "printed": printed,
        "summary": json.loads((out / "summary.json").read_text()),
    }


@pytest.fixture(scope="module")
def six_agent_runs(tmp_path_factory) -> list[tuple[Experiment, runner.Results]]:
    """Real 6-agent state tables: a main (persistent, 252 tasks) and a recovery run, 2 seeds, reference engine."""
    root = tmp_path_factory.mktemp("six")
    exps = [
        Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1), engine="reference", n_tasks=252),
        Experiment(name="recovery", datasets=("math",), pairs=("default",), seeds=(0, 1), engine="reference",
                   n_tasks=630),
    ]  # fmt: skip
    return [(exp, runner.run(exp, root / exp.name, progress=False)) for exp in exps]


def check_result(result: dict, topology_name: str, n_seeds: int) -> None:
    assert RESULT_KEYS <= set(result), RESULT_KEYS - set(result)
    assert result["n_agents"] == N_AGENTS
    assert result["topology"] == topology_name
    assert result["degraded"] == N_AGENTS // 3 and isinstance(result["degraded"], int)
    assert result["seeds"] == SEEDS[:n_seeds]
    for key in RESULT_STATS:
        assert set(result[key]) == STAT_KEYS, key
    for key in ("acc_healthy", "acc_degraded", "tokens_per_task_healthy", "tokens_per_task_degraded",
                "isolated_degraded", "missed", "false_isolations"):  # fmt: skip
        assert result[key]["n_defined"] == n_seeds, key
        assert result[key]["mean"] is not None and (result[key]["std"] is not None) == (n_seeds > 1), key
    assert 0 <= result["isolated_degraded"]["min"] <= result["isolated_degraded"]["max"] <= result["degraded"]
    assert 0 <= result["missed"]["max"] <= result["degraded"]
    assert 0.0 <= result["acc_healthy"]["mean"] <= 1.0 and 0.0 <= result["acc_degraded"]["mean"] <= 1.0
    assert result["tokens_per_task_healthy"]["mean"] > 0 and result["tokens_per_task_degraded"]["mean"] > 0
    assert isinstance(result["edges"], int) and isinstance(result["max_ability_distance"], int)
    assert result["edge_fraction"] == pytest.approx(result["edges"] / (N_AGENTS * (N_AGENTS - 1) / 2))
    assert 1 <= result["max_ability_distance"] <= graphs.HOP_LIMIT
    assert Path(result["run_dir"]).is_dir() and result["wall_s"] >= 0


# ----------------------------------------------------------------------------------------------
# The JAX run: summary, stream length, schedule, slots, printed table
# ----------------------------------------------------------------------------------------------


def test_report_of_the_compare_folder_and_of_an_arm(ref_run, tmp_path):
    """`report <out>` of a --compare run: the topologies side by side, with the scaling figure; an
    arm's report shows the columns the command printed."""
    from meshheal_jax import report

    out = tmp_path / "run"
    shutil.copytree(ref_run["out"], out)
    text = report.write_report(out).read_text()
    header = ("| agents | topology | acc H | acc D | isolated at end | degraded | missed | false isolations | "
              "agents falsely isolated | detection delay |")  # fmt: skip
    assert header in text and "tokens/task H (k) | tokens/task D (k) |" in text
    rows = [line for line in text.splitlines() if line.startswith(f"| {N_AGENTS} |")]
    assert [row.split(" | ")[1] for row in rows] == ["complete", "sparse"]
    assert "![Network scaling](scaling.png)" in text and "- [`sparse/`](sparse/)" in text
    assert (out / "scaling.png").read_bytes().startswith(b"\x89PNG")
    arm = report.write_report(out / "sparse").read_text()
    assert header in arm and "--slots 1 --agents 12 --dataset bbh --sparse" in arm
    with pytest.raises(MeshHealError, match="--show-seed chooses a recovery run's trajectory"):
        report.write_report(out, show_seed=0)


def test_parent_summary_has_one_result_with_every_key(jax_run):
    summary = jax_run["summary"]
    assert summary["experiment"] == "scale"
    assert summary["engine"] == "jax" and summary["backend"] == "emulated"
    assert summary["n_agents"] == N_AGENTS
    assert len(summary["results"]) == 1
    result = summary["results"][0]
    check_result(result, "sparse", 2)
    assert result["run_dir"] == str(jax_run["out"] / "sparse")
    _, _, _, edges = bbh_graph()
    assert result["edges"] == len(edges)
    # the run folder's own summary carries the same numbers
    own = json.loads((jax_run["out"] / "sparse" / "summary.json").read_text())
    assert own["results"][0] == numbers(result)
    assert own["n_tasks"] == N_TASKS
    assert result["resumed"] is False


def test_a_rerun_says_its_wall_time_is_a_resume(jax_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(jax_run["out"], out)
    printed = run_body(parse(*JAX_ARGS, "--out", str(out)))
    again = json.loads((out / "summary.json").read_text())["results"][0]
    assert again["resumed"] is True and "(resumed)" in printed
    assert numbers(again) == numbers(jax_run["summary"]["results"][0])


def test_dropping_reviews_and_calls_keeps_every_figure_but_the_review_audit(jax_run, tmp_path):
    out = tmp_path / "run"
    run_body(parse(*JAX_ARGS, "--tables", "tasks", "states", "--out", str(out)))
    lean = json.loads((out / "summary.json").read_text())["results"][0]
    full = jax_run["summary"]["results"][0]
    assert full["review_audit"] and lean["review_audit"] == {}
    drop = {"review_audit", "wall_s", "run_dir", *metrics.PARSE_KEYS}  # parse counts come from the calls

    def kept(r: dict) -> dict:
        phases = [{k: v for k, v in p.items() if k not in drop} for p in r["phases"]]
        return {**{k: v for k, v in r.items() if k not in drop}, "phases": phases}

    assert not set(lean) & set(metrics.PARSE_KEYS) and kept(lean) == kept(full)
    for name in ("reviews", "calls"):  # written empty, with their columns
        assert pl.read_parquet(out / "sparse" / f"{name}.parquet").is_empty()


def test_slots_default_to_one_task_per_six_agents(jax_run):
    assert jax_run["cfg"].slots is None
    assert jax_run["summary"]["slots"] == N_AGENTS // 6
    config = json.loads((jax_run["out"] / "sparse" / "config.json").read_text())["experiment"]
    assert config["slots"] == N_AGENTS // 6
    assert config["n_agents"] == N_AGENTS and config["n_tasks"] == N_TASKS
    assert config["topology"] == "sparse" and config["graph_seed"] == 0
    assert config["seeds"] == SEEDS
    assert "slots 2" in jax_run["printed"]


def test_slots_flag_is_accepted_up_to_n_over_6(monkeypatch, capsys, tmp_path):
    assert parse("--agents", "12", "--slots", "1").slots == 1
    assert parse("--agents", "12").slots is None
    for args, slots in ((("--slots", "1"), 1), ((), 2), (("--slots", "2"), 2)):
        exp = scale.experiment(parse("--agents", "12", *args), "complete")
        assert exp.slots == slots
        exp.validate()
    assert scale.experiment(parse("--agents", "576"), "sparse").slots == 96
    out = tmp_path / "out"
    code, err = cli_in_process(
        monkeypatch, capsys, "--agents", "12", "--slots", "3", "--quiet", "--out", str(out)
    )
    assert_one_line_error(code, err, "slots", "N/6")
    assert not out.exists()


def test_stream_is_504_per_replica_with_degradation_at_the_midpoint(jax_run):
    run_dir = jax_run["out"] / "sparse"
    tasks = pl.read_parquet(run_dir / "tasks.parquet")
    assert tasks.height == N_TASKS * len(SEEDS)
    for seed in SEEDS:
        part = tasks.filter(pl.col("seed") == seed).sort("t")
        assert part["t"].to_list() == list(range(1, N_TASKS + 1))
        assert (part["phase"] == (part["t"] >= MIDPOINT).cast(pl.Int64)).all()
        # balanced blocks: each phase has the same type mix
        counts = part.group_by("phase", "task_type").len().sort("phase", "task_type")
        assert counts["len"].n_unique() == 1
    schedule = scale.experiment(jax_run["cfg"], "sparse").schedule()
    assert schedule.n_agents == N_AGENTS and schedule.n_tasks == N_TASKS
    assert sorted(schedule.intervals) == [(a, MIDPOINT, N_TASKS + 1) for a in TARGETS]
    # the records agree: an author is degraded exactly when it is a target at or after the midpoint
    reviews = pl.read_parquet(run_dir / "reviews.parquet")
    expected = pl.col("author").is_in(list(TARGETS)) & (pl.col("t") >= MIDPOINT)
    assert reviews.height > 0
    assert (reviews["author_degraded"] == reviews.select(expected).to_series()).all()
    assert reviews.filter(pl.col("author_degraded")).height > 0


def test_summary_agrees_with_the_records(jax_run):
    run_dir = jax_run["out"] / "sparse"
    result = jax_run["summary"]["results"][0]
    tasks = pl.read_parquet(run_dir / "tasks.parquet")
    states = pl.read_parquet(run_dir / "states.parquet")
    acc_h, acc_d, isolated, false_iso = [], [], [], []
    for seed in SEEDS:
        part = tasks.filter(pl.col("seed") == seed)
        acc_h.append(part.filter(pl.col("t") < MIDPOINT)["correct"].mean())
        acc_d.append(part.filter(pl.col("t") >= MIDPOINT)["correct"].mean())
        changes = states.filter(pl.col("seed") == seed)
        matrix = metrics.state_matrix(changes, N_AGENTS, N_TASKS)
        isolated.append(sum(matrix[N_TASKS, a] == "isolated" for a in TARGETS))
        false_iso.append(changes.filter((pl.col("to") == "isolated") & ~pl.col("degraded")).height)
    assert result["acc_healthy"]["mean"] == pytest.approx(np.mean(acc_h))
    assert result["acc_degraded"]["mean"] == pytest.approx(np.mean(acc_d))
    assert result["isolated_degraded"]["mean"] == pytest.approx(np.mean(isolated))
    assert result["false_isolations"]["mean"] == pytest.approx(np.mean(false_iso))


def test_printed_table(jax_run):
    printed = jax_run["printed"]
    assert "Network scaling (jax engine, emulated backend, slots 2)" in printed
    result = jax_run["summary"]["results"][0]
    row = next(line for line in printed.splitlines() if "sparse" in line)
    assert f"{result['edges']:,}" in row and f"/ {N_AGENTS // 3}" in row
    assert not re.search(r"\(\d[\d,]*\)", printed)  # no paper edge count at 12 agents
    assert f"results: {jax_run['out']}" in printed


@pytest.mark.parametrize(
    "n_agents,topology_name,paper",
    [(96, "sparse", "(228)"), (288, "sparse", "(705)"), (576, "sparse", "(1,454)"),
     (96, "complete", None), (102, "sparse", None), (12, "sparse", None)],
)  # fmt: skip
def test_paper_edge_count_is_printed_only_for_its_sizes(jax_run, capsys, n_agents, topology_name, paper):
    result = {
        **jax_run["summary"]["results"][0],
        "n_agents": n_agents,
        "topology": topology_name,
        "edges": 1234,
    }
    scale.print_summary({**jax_run["summary"], "results": [result]})
    printed = capsys.readouterr().out
    assert "1,234" in printed
    found = re.findall(r"\(\d[\d,]*\)", printed)
    assert found == ([paper] if paper else [])


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------


def test_rerunning_the_same_command_reuses_the_streams(jax_run):
    """The same scale command with the same --out: every finished stream is kept, same numbers."""
    out = jax_run["out"]
    parts = out / "sparse" / "parts"
    assert sorted(p.name for p in parts.iterdir()) == [f"meshheal-bbh-default-seed{s}" for s in SEEDS]
    before = file_snapshot(parts)
    proc = cli_subprocess(*JAX_ARGS, "--out", str(out), cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    assert "Network scaling" in proc.stdout
    assert file_snapshot(parts) == before  # not rewritten: no stream ran again
    again = json.loads((out / "summary.json").read_text())
    assert [numbers(r) for r in again["results"]] == [numbers(r) for r in jax_run["summary"]["results"]]
    assert {k: v for k, v in again.items() if k != "results"} == {
        k: v for k, v in jax_run["summary"].items() if k != "results"
    }


def test_resume_after_losing_one_stream(ref_run, monkeypatch):
    out = ref_run["out"]
    frames = {name: pl.read_parquet(out / "sparse" / f"{name}.parquet") for name in TABLES}
    kept = file_snapshot(out / "sparse" / "parts" / "meshheal-bbh-default-seed0") | file_snapshot(
        out / "complete" / "parts"
    )
    shutil.rmtree(out / "sparse" / "parts" / "meshheal-bbh-default-seed1")
    (out / "summary.json").unlink()
    ran = []
    original = runner.run_one_stream
    monkeypatch.setattr(
        runner, "run_one_stream", lambda exp, *s: ran.append((exp.topology, *s)) or original(exp, *s)
    )
    run_body(ref_run["cfg"])
    assert ran == [("sparse", "bbh", "default", 1)]
    now = file_snapshot(out / "sparse" / "parts" / "meshheal-bbh-default-seed0") | file_snapshot(
        out / "complete" / "parts"
    )
    assert now == kept
    again = json.loads((out / "summary.json").read_text())
    assert [numbers(r) for r in again["results"]] == [numbers(r) for r in ref_run["summary"]["results"]]
    for name, df in frames.items():
        assert pl.read_parquet(out / "sparse" / f"{name}.parquet").equals(df, null_equal=True), name


# ----------------------------------------------------------------------------------------------
# --compare and --slots 1 (reference engine: no compilation)
# ----------------------------------------------------------------------------------------------


def test_compare_runs_complete_and_sparse_on_the_same_seeds(ref_run):
    summary = ref_run["summary"]
    assert summary["engine"] == "reference" and summary["slots"] == 1
    assert [r["topology"] for r in summary["results"]] == ["complete", "sparse"]
    complete, sparse = summary["results"]
    for r, name in ((complete, "complete"), (sparse, "sparse")):
        check_result(r, name, 2)
        assert r["run_dir"] == str(ref_run["out"] / name)
        config = json.loads((ref_run["out"] / name / "config.json").read_text())["experiment"]
        assert config["seeds"] == SEEDS and config["slots"] == 1 and config["topology"] == name
    assert complete["edges"] == N_AGENTS * (N_AGENTS - 1) // 2 and complete["edge_fraction"] == 1.0
    assert complete["max_ability_distance"] == 1
    assert sparse["edges"] == len(bbh_graph()[3]) and sparse["edge_fraction"] < 1.0
    # paired: the same task streams on both graphs
    cols = ["seed", "t", "task_type", "phase"]
    tasks = [pl.read_parquet(ref_run["out"] / name / "tasks.parquet").select(cols).sort("seed", "t")
             for name in ("complete", "sparse")]  # fmt: skip
    assert tasks[0].equals(tasks[1]) and tasks[0].height == N_TASKS * len(SEEDS)
    printed = ref_run["printed"]
    assert "slots 1" in printed
    assert any("complete" in line and "66" in line for line in printed.splitlines())
    assert any(line.strip().startswith("│") and "sparse" in line for line in printed.splitlines())


# ----------------------------------------------------------------------------------------------
# --edges FILE
# ----------------------------------------------------------------------------------------------


def write_edges(path: Path, edges: np.ndarray) -> Path:
    pairs = np.asarray(edges).tolist()
    if path.suffix == ".json":
        path.write_text(json.dumps(pairs))
    else:
        path.write_text("source,target\n" + "".join(f"{i},{j}\n" for i, j in pairs))
    return path


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_edges_file_runs(jax_run, tmp_path, suffix):
    _, _, _, edges = bbh_graph()
    path = write_edges(tmp_path / f"graph{suffix}", edges[::-1][:, ::-1])  # either orientation and order
    out = tmp_path / "out"
    cfg = parse("--agents", "12", "--edges", str(path), "--seeds", "2", "--quiet", "--out", str(out))
    printed = run_body(cfg)  # same graph and shapes as jax_run: no recompilation
    summary = json.loads((out / "summary.json").read_text())
    assert [r["topology"] for r in summary["results"]] == ["file"]
    result = summary["results"][0]
    check_result(result, "file", 2)
    assert "file" in printed
    config = json.loads((out / "file" / "config.json").read_text())["experiment"]
    assert config["edges_file"] == str(path) and config["topology"] == "file"
    # the sparse run's own graph, given as a file: the same simulation
    sparse = jax_run["summary"]["results"][0]
    for key in ("edges", "edge_fraction", "max_ability_distance", "degraded", *RESULT_STATS):
        assert result[key] == sparse[key], key


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_edges_file_breaking_a_requirement_exits_2(monkeypatch, capsys, tmp_path, suffix):
    profile, holds, degraded, edges = bbh_graph()
    agent = 2  # A3 of replica 0, a degraded target
    ability = int(np.flatnonzero(holds[agent])[0])
    holders = {j for j in range(N_AGENTS) if holds[j, ability] and not degraded[j]}
    links = [
        k for k, (i, j) in enumerate(edges.tolist()) if agent in (i, j) and ({i, j} - {agent}) <= holders
    ]
    assert len(links) >= 2
    broken = np.delete(edges, links[1:], axis=0)  # keep one healthy holder: a target needs two
    n_parts, _ = scipy.sparse.csgraph.connected_components(graphs.csr(broken, N_AGENTS), directed=False)
    assert n_parts == 1
    path = write_edges(tmp_path / f"broken{suffix}", broken)
    out = tmp_path / "out"
    code, err = cli_in_process(monkeypatch, capsys, "--agents", "12", "--edges", str(path), "--seeds", "2",
                               "--quiet", "--out", str(out))  # fmt: skip
    assert_one_line_error(code, err, "degraded target 2 (A3 of replica 0)", f"'{profile.abilities[ability]}'",
                          "needs at least 2")  # fmt: skip
    assert not out.exists()  # checked before anything is written


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2
# ----------------------------------------------------------------------------------------------


def test_agents_not_a_multiple_of_6_exits_2(tmp_path):
    out = tmp_path / "out"
    proc = cli_subprocess("--agents", "10", "--quiet", "--out", str(out), cwd=tmp_path)
    assert_one_line_error(proc.returncode, proc.stderr, "--agents must be a positive multiple of 6, got 10")
    assert not out.exists()


@pytest.mark.parametrize(
    "args,fragments",
    [(("--agents", "12", "--edges", "<file>", "--sparse"), ("--edges", "--sparse")),
     (("--agents", "12", "--edges", "<file>", "--compare"), ("--edges", "--compare")),
     (("--agents", "2310"), ("2310", "2,304", "--sparse")),
     (("--agents", "2310", "--compare"), ("2,304",)),
     (("--agents", "0"), ("multiple of 6",)),
     (("--agents", "12", "--tables", "tasks", "calls"), ("tables must include tasks and states",))],
)  # fmt: skip
def test_bad_combinations_exit_2(monkeypatch, capsys, tmp_path, args, fragments):
    path = write_edges(tmp_path / "graph.csv", bbh_graph()[3])
    args = tuple(str(path) if a == "<file>" else a for a in args)
    out = tmp_path / "out"
    code, err = cli_in_process(monkeypatch, capsys, *args, "--seeds", "1", "--quiet", "--out", str(out))
    assert_one_line_error(code, err, *fragments)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# scale_outcomes == agent_outcomes
# ----------------------------------------------------------------------------------------------


def assert_outcomes_agree(states: pl.DataFrame, schedule: HealthSchedule) -> dict:
    agents = metrics.agent_outcomes(states, schedule)
    scaled = metrics.scale_outcomes(states, schedule)
    delays = [a["detection_delay"] for a in agents if a["detection_delay"] is not None]
    matrix = metrics.state_matrix(states, schedule.n_agents, schedule.n_tasks)
    assert scaled["degraded"] == len(schedule.intervals)
    assert scaled["missed"] == len(agents) - len(delays)
    assert scaled["isolated_degraded"] == sum(
        matrix[end - 1, agent] == "isolated" for agent, _, end in schedule.intervals
    )
    onset = {a["agent"] for a in agents if a["isolated_at_onset"]}
    assert onset == {
        agent for agent, begin, _ in schedule.intervals if matrix[begin - 1, agent] == "isolated"
    }
    at_once = {a["agent"] for a in agents if a["detection_delay"] == 0}
    assert scaled["onset_detections"] == len(onset & at_once)
    if delays:
        assert scaled["detection_delay_mean"] == pytest.approx(float(np.mean(delays)))
        assert scaled["detection_delay_median"] == pytest.approx(float(np.median(delays)))
    else:
        assert scaled["detection_delay_mean"] is None and scaled["detection_delay_median"] is None
    return {"delays": {a["agent"]: a["detection_delay"] for a in agents}, "onset": onset, **scaled}


def test_scale_outcomes_agree_on_real_runs(jax_run, ref_run, six_agent_runs):
    cases = []
    for exp, results in six_agent_runs:
        cases += [(results.states.filter(pl.col("seed") == s), exp.schedule()) for s in exp.seeds]
    for run, names in ((jax_run, ("sparse",)), (ref_run, ("complete", "sparse"))):
        for name in names:
            states = pl.read_parquet(run["out"] / name / "states.parquet")
            schedule = scale.experiment(run["cfg"], name).schedule()
            cases += [(states.filter(pl.col("seed") == s), schedule) for s in SEEDS]
    detected = 0
    for states, schedule in cases:
        outcome = assert_outcomes_agree(states, schedule)
        detected += sum(d is not None for d in outcome["delays"].values())
    assert detected > 0  # the real tables do contain detections


def test_stream_metrics_missed_is_the_same_either_way(six_agent_runs):
    for exp, results in six_agent_runs:
        _, phase_names = exp.phases()
        for seed in exp.seeds:
            frames = [
                df.filter(pl.col("seed") == seed) for df in (results.tasks, results.reviews, results.states)
            ]
            full = metrics.stream_metrics(*frames, exp.schedule(), phase_names, per_agent=True)
            large = metrics.stream_metrics(*frames, exp.schedule(), phase_names, per_agent=False)
            assert large["missed"] == full["missed"]
            assert large["agents"] == [] and large["degraded"] == len(exp.schedule().intervals)
            for key in ("acc_healthy", "acc_degraded", "false_isolations", "tokens_per_task_healthy"):
                assert large[key] == full[key], key
            # the scale experiment at 6 agents: both the per-agent list and the counts its table reads
            both = metrics.stream_metrics(
                *frames, exp.schedule(), phase_names, per_agent=True, scale_counts=True
            )
            assert both["agents"] == full["agents"]
            assert {k: both[k] for k in metrics.SCALE_KEYS} == {k: large[k] for k in metrics.SCALE_KEYS}


def test_six_agents_print_their_table(tmp_path):
    """`scale --agents 6` (the 6-agent network as a scaling point) prints its row; its table's
    counts were missing at 6 agents (KeyError after the run)."""
    cfg = parse("--agents", "6", "--engine", "reference", "--slots", "1", "--seeds", "1", "--quiet",
                "--out", str(tmp_path / "six"))  # fmt: skip
    printed = run_body(cfg)
    assert "isolated at end/degraded" in printed and " / 2 " in printed


def states_frame(changes: list[tuple[int, int, str, str]], shuffle_seed: int | None = 0) -> pl.DataFrame:
    """Hand-built state changes (t, agent, from, to); rows of different t shuffled (changes at the
    same t keep their order: the last is the state at the end of the task)."""
    rows = [{"method": "meshheal", "dataset": "bbh", "pair": "default", "seed": 0, "t": t, "agent": agent,
             "from": src, "to": dst, "z": None, "reason": "test", "probe": False, "degraded": False}
            for t, agent, src, dst in changes]  # fmt: skip
    if shuffle_seed is not None and rows:
        ts = sorted({r["t"] for r in rows})
        rank = dict(zip(ts, np.random.default_rng(shuffle_seed).permutation(len(ts)).tolist()))
        rows = sorted(rows, key=lambda r: rank[r["t"]])  # stable: same-t order kept
    return metrics.frame("states", rows)


PERSISTENT = persistent_schedule(6, 504, (2, 4))  # agents 2 and 4 degraded from task 253
RECOVERY = recovery_schedule(630)  # agent 4: tasks 127-378, agent 2: tasks 253-504

HAND_BUILT = {
    "isolated before its degradation and kept": (PERSISTENT, [
        (100, 2, "normal", "watched"), (120, 2, "watched", "isolated"), (50, 0, "normal", "watched"),
    ], {2: 0, 4: None}, 1),
    "released at the first degraded task, isolated again": (PERSISTENT, [
        (100, 2, "normal", "isolated"), (253, 2, "isolated", "probation"), (260, 2, "probation", "isolated"),
        (253, 4, "normal", "isolated"),
    ], {2: 7, 4: 0}, 2),
    "several changes at the same t": (PERSISTENT, [
        (300, 4, "normal", "watched"), (300, 4, "watched", "isolated"),
        (270, 2, "normal", "isolated"), (270, 2, "isolated", "probation"), (290, 2, "probation", "isolated"),
        (400, 2, "isolated", "probation"), (400, 2, "probation", "normal"), (300, 1, "normal", "watched"),
    ], {2: 37, 4: 47}, 1),
    "released at the first degraded task, never again": (PERSISTENT, [
        (100, 2, "normal", "isolated"), (253, 2, "isolated", "watched"),
    ], {2: None, 4: None}, 0),
    "never isolated": (PERSISTENT, [
        (260, 2, "normal", "watched"), (270, 2, "watched", "normal"), (300, 0, "normal", "isolated"),
        (300, 4, "normal", "watched"),
    ], {2: None, 4: None}, 0),
    "no state change at all": (PERSISTENT, [], {2: None, 4: None}, 0),
    "isolated on the last degraded task": (PERSISTENT, [(504, 4, "watched", "isolated")], {2: None, 4: 251}, 1),
    "recovery: isolations at and after the end of the interval do not count": (RECOVERY, [
        (50, 4, "normal", "isolated"), (126, 4, "isolated", "probation"), (379, 4, "probation", "isolated"),
        (504, 2, "watched", "isolated"), (505, 2, "isolated", "probation"),
    ], {2: 251, 4: None}, 1),
    "recovery: isolated through the end of the interval": (RECOVERY, [
        (127, 4, "normal", "isolated"), (300, 2, "normal", "isolated"), (400, 2, "isolated", "probation"),
        (450, 2, "probation", "isolated"),
    ], {2: 47, 4: 0}, 2),
}  # fmt: skip
# the degraded agents already isolated at the end of the task before their degradation
ISOLATED_AT_ONSET = {"isolated before its degradation and kept": {2},
                     "released at the first degraded task, isolated again": {2},
                     "released at the first degraded task, never again": {2}}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HAND_BUILT))
@pytest.mark.parametrize("shuffle_seed", [None, 0, 1])
def test_scale_outcomes_agree_on_hand_built_tables(case, shuffle_seed):
    schedule, changes, delays, isolated_at_end = HAND_BUILT[case]
    outcome = assert_outcomes_agree(states_frame(changes, shuffle_seed), schedule)
    assert outcome["delays"] == delays
    assert outcome["isolated_degraded"] == isolated_at_end
    assert outcome["missed"] == sum(d is None for d in delays.values())
    assert outcome["onset"] == ISOLATED_AT_ONSET.get(case, set())


# ----------------------------------------------------------------------------------------------
# any_degraded
# ----------------------------------------------------------------------------------------------


def random_schedule(seed: int) -> HealthSchedule:
    rng = np.random.default_rng(seed)
    n_agents, n_tasks = 12, 84
    agents = rng.choice(n_agents, size=rng.integers(0, 5), replace=False)
    intervals = []
    for agent in agents.tolist():
        start = int(rng.integers(1, n_tasks + 1))
        intervals.append((agent, start, int(rng.integers(start + 1, n_tasks + 2))))
    return HealthSchedule(n_agents, n_tasks, tuple(intervals))


ANY_DEGRADED = {
    "persistent 6": persistent_schedule(6, 504, (2, 4)),
    "persistent 12": persistent_schedule(12, 1008, TARGETS),
    "recovery 630": recovery_schedule(630),
    "recovery 210": recovery_schedule(210),
    "none": HealthSchedule(6, 42, ()),
    "whole stream": HealthSchedule(6, 42, ((0, 1, 43),)),
    "adjacent and gapped": HealthSchedule(6, 42, ((1, 5, 6), (3, 6, 10), (5, 20, 21), (0, 42, 43))),
    **{f"random {k}": random_schedule(k) for k in range(8)},
}


@pytest.mark.parametrize("case", sorted(ANY_DEGRADED))
def test_any_degraded_matches_the_degraded_matrix(case):
    schedule = ANY_DEGRADED[case]
    got = metrics.any_degraded(schedule)
    assert got.shape == (schedule.n_tasks,) and got.dtype == bool
    np.testing.assert_array_equal(got, schedule.degraded_matrix()[1:].any(axis=1))


def test_any_degraded_on_the_recovery_phases():
    got = metrics.any_degraded(recovery_schedule(630))
    assert not got[:126].any() and got[126:504].all() and not got[504:].any()


def test_detection_cell_counts_the_detections_before_onset():
    r = {"detection_delay_mean": metrics.stat([10.0, 20.0]), "onset_detections": metrics.stat([1, 0])}
    assert scale.detection_cell(r) == "15.0 ± 7.1 (0.5 ± 0.7 before onset)"
    assert scale.detection_cell({**r, "onset_detections": metrics.stat([0, 0])}) == "15.0 ± 7.1"
    assert scale.detection_cell({"detection_delay_mean": metrics.stat([None])}) == "—"
