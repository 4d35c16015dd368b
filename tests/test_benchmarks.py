"""benchmarks/gpu_run.sh runs on CPU with small sizes (--cpu-small) and writes its tables: the
same script a GPU node runs (behaviour only; no timing is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_run_script_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), str(tmp_path), "--cpu-small"],
                          capture_output=True, text=True, env=env, timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "gpu_table.md").read_text()
    assert "### against agents (1 stream)" in table and "### against streams" in table
    rows = json.loads((tmp_path / "gpu_rows_0.json").read_text())
    assert [(r["agents"], r["streams"]) for r in rows] == [(6, 1), (6, 2)]
    assert all(r["tasks"] > 0 and r["rate"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert "jax" in (tmp_path / "env.txt").read_text()


def test_gpu_run_refuses_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 1 and "JAX sees no GPU" in done.stderr


def test_ab_rounds_alternates_two_checkouts(tmp_path):
    """benchmarks/ab_rounds.py on this checkout against itself: both arms report, turns alternate;
    a folder that is not a checkout is named."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_rounds.py"), str(ROOT), str(ROOT), "--agents", "6",
           "--turns", "2", "--chunks", "1", "--rounds", "4", "--skip", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("6 agents x 1 stream(s), 2 turns of 1 x 4 rounds")
    rows = [line for line in lines if line.startswith(("| before", "| after"))]
    assert len(rows) == 2 and all(str(ROOT) in row for row in rows)
    assert all(float(row.split("|")[3]) > 0 for row in rows)
    assert lines[-1].startswith("change of the median:")
    bad = subprocess.run(
        [*cmd[:2], str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode != 0 and "is not a checkout of this repository" in bad.stderr


def test_pool_sort_reports_equal_values():
    """benchmarks/pool_sort.py prints a row per pool shape in each of its two tables, each with the
    same bits from both ways (the two sorts; the detector's quantiles by sort and by rank)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pool_sort.py"), "--rows", "3", "7", "--repeats", "3"],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 3 x 42", "| 7 x 42"))]
    assert len(rows) == 4 and all(row.rstrip(" |").endswith("True") for row in rows), done.stdout


def test_cache_cost_reports_its_parts():
    """benchmarks/cache_cost.py --parts-only: every part of the response cache's cost is timed."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_cost.py"), "--parts-only"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    timed = dict(line.rsplit(": ", 1) for line in done.stdout.strip().splitlines())
    assert set(timed) == {
        "key",
        "get (miss)",
        "row JSON + redaction",
        "put (own commit)",
        "insert in one transaction",
    }
    assert all(value.endswith(" µs") and float(value.split()[0]) > 0 for value in timed.values())


def test_intra_op_times_each_configuration():
    """benchmarks/intra_op.py at 6 agents, one turn: a round time for each of the four configurations,
    and the gather's time and partitioned kernels by default and with one intra-op thread (how many
    kernels XLA partitions depends on its flags: the tests' fast ones partition even with one thread)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "intra_op.py"), "--agents", "6", "--turns", "1",
           "--chunks", "1", "--rounds", "4", "--skip", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line.split("|")[2:])  # the round table comes first
    for name in ("default", "PJRT_NPROC=1", "pinned", "compiled-1"):
        assert float(rows[name][0]) > 0, done.stdout
    gathers = [
        line.split("|")
        for line in done.stdout.splitlines()
        if line.startswith(("| default |", "| PJRT_NPROC=1 |"))
    ]
    assert len(gathers) == 4  # a round row and a gather row each
    for cells in gathers[2:]:
        assert float(cells[2]) > 0 and cells[3].strip().isdigit(), done.stdout


def test_profile_round_reads_its_trace():
    """benchmarks/profile_round.py at 6 agents: a round time, an op count, and shares in each of its
    three tables (by executions per round, largest ops, by engine function: the last reads the
    compiled HLO's stack frames, which a new XLA may lay out otherwise), host events left out."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_round.py"), "--agents", "6", "--rounds", "8",
           "--skip", "1", "--timed", "2", "--top", "5", "--by-function", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert float(out.split("round: ")[1].split(" ms")[0]) > 0, out
    assert int(out.split(" op executions per round")[0].split()[-1]) > 0, out
    tables = [block for block in out.split("\n\n") if block.startswith("| ")]
    assert [t.splitlines()[0].split("|")[1].strip() for t in tables] == [
        "executions per round", "op", "part of the round (traced by)"
    ], out  # fmt: skip
    for table in tables:
        lines = table.splitlines()
        column = [cell.strip() for cell in lines[0].split("|")].index("share")
        shares = [float(line.split("|")[column].strip().rstrip("%")) for line in lines[2:]]
        assert shares and all(0 <= s <= 100 for s in shares) and sum(shares) > 0, table
    assert any("absorb_round" in line for line in tables[2].splitlines()), tables[2]
    ops = [line.split("|")[1].strip() for line in tables[1].splitlines()[2:]]
    assert not any(name.startswith(("PjRt", "CommonPjRt", "Pjit", "ThunkExecutor")) for name in ops), ops


def test_waves_replay_matches_the_engine():
    """benchmarks/waves.py at 6 agents (and 96, where waves of several observations happen): the
    replayed engine rule counts the waves the engine's own `_wave` runs in every round, and the
    rules order as they must (no fewer waves with width limits, no more with the finer rule)."""
    for agents in ("6", "96"):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "waves.py"), "--agents", agents, "--rounds", "30",
               "--skip", "1"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout
        assert "the replay matches the engine's waves in 100% of rounds" in out, out
        waves = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in out.splitlines()
                 if line.startswith("| ") and not line.startswith("| rule")}  # fmt: skip
        assert waves["by type (bound)"] <= waves["greedy"] <= waves["engine (replayed)"], out
        assert waves["engine (replayed)"] == waves["engine (its `_wave`, run)"] >= 1, out


def test_profile_client_splits_the_clients_cpu():
    """benchmarks/profile_client.py: the client's CPU per call, and the share of it inside the openai
    SDK's `post` (a share, between 0 and 1, that the profile really found), against the stand-in."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_client.py"), "--in-flight", "16",
           "--requests", "64", "--batches", "1", "--latency", "0.01", "--top", "3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("64 calls at 16 in flight"), out
    assert float(out.split("client CPU per call: ")[1].split(" ms")[0]) > 0, out
    share = float(out.split("the openai SDK's `post`: ")[1].split("(")[1].split("%")[0])
    assert 0 < share < 100, out
    parts = out.split("of the SDK's `post`: ")[1].splitlines()[0]
    build, send = (float(part.split("%")[0].split()[-1]) for part in parts.split(", "))
    assert 0 < build < 100 and 0 < send < 100 and build + send <= 100, out


def test_profile_client_ab_telemetry_prints_both_arms():
    """benchmarks/profile_client.py --ab-telemetry: one CPU-per-call figure per arm and turn."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_client.py"), "--in-flight", "8",
           "--requests", "32", "--batches", "1", "--latency", "0.01", "--ab-telemetry", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    arms = [line for line in done.stdout.splitlines() if "telemetry headers" in line and "median" in line]
    assert len(arms) == 2, done.stdout
    for line in arms:
        values = line.split(": ", 1)[1].split(" (median")[0].split(" / ")
        assert len(values) == 2 and all(float(v) > 0 for v in values), line


def test_live_timeline_cuts_a_batch_into_its_waves():
    """benchmarks/live_timeline.py: every call of a batch timed, in waves of the in-flight count,
    each call inside `post` at least the stand-in's latency."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import live_timeline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    (run,) = live_timeline.main(["--in-flight", "8", "--latency", "0.05", "--waves", "3", "--batches", "1"])
    assert [w["wave"] for w in run["waves"]] == [0, 1, 2]
    assert run["post_s"][0] >= 0.05
    for before, after in zip(run["waves"], run["waves"][1:]):
        assert after["first_start"] >= before["first_end"] - 1e-3  # a slot's next call waits for its reply
    assert run["wall_s"] >= 3 * 0.05
