"""Lanes: a batch's streams split into groups of equal width, run side by side by one thread each
on one compiled program (engine.run_batch; docs/decisions.md S7).

The split changes only the batch width XLA compiles for: records equal the one-lane run's (float
columns up to rounding in the last bits), and a stream's tables do not depend on the chunk
length that follows the width.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import hypothesis.strategies as st
import polars as pl
import pytest
from hypothesis import given

from meshheal_jax import engine, runner, sweep
from meshheal_jax.errors import MeshHealError

ROOT = Path(__file__).resolve().parents[1]


@given(st.integers(1, 40), st.integers(1, 12))
def test_lane_streams_cover_every_stream_once_in_lanes_of_one_width(n, lanes):
    groups = engine.lane_streams(n, lanes)
    assert len(groups) == min(n, lanes)
    assert len({len(g) for g in groups}) == 1  # one shape: one compiled program
    real = [list(dict.fromkeys(g)) for g in groups]  # the padding repeats a lane's last stream
    assert [s for g in real for s in g] == list(range(n))
    assert max(map(len, real)) - min(map(len, real)) <= 1


def _assert_same_records(a: dict[str, pl.DataFrame], b: dict[str, pl.DataFrame]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert x.height == y.height > 0, name
        floats = [c for c, dtype in x.schema.items() if dtype == pl.Float64]
        for c in floats:
            gap = (x[c] - y[c]).abs().max()
            assert gap is None or gap <= 1e-12, (name, c, gap)
        assert x.drop(floats).equals(y.drop(floats)), name


def _specs(exp: runner.Experiment) -> list[engine.StreamSpec]:
    out = []
    for dataset in exp.datasets:
        for seed in exp.seeds:
            network, stream, pair, labels = runner._stream_inputs(exp, dataset, "default", seed)
            out.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
    return out


def test_lanes_give_the_one_lane_records():
    """Five streams with params per stream (two datasets): lanes of 3 and 2 (+ a padding copy)
    and of 2, 2, 1 (+ copies) against one batch; the lanes run on their own threads, on one
    program traced once."""
    exp = runner.Experiment(
        name="main", datasets=("bbh", "math"), pairs=("default",), seeds=(0, 1, 2), n_tasks=84
    )
    specs = _specs(exp)[:5]
    one = engine.run_streams(specs, exp.protocol, lanes=1)
    for lanes in (2, 3):
        timings: dict = {}
        threads = set()
        cfg = engine.engine_config(specs, exp.protocol, 1)
        params = [engine.make_params(exp.protocol, s.pair, s.network.profile, cfg.n_agents) for s in specs]
        engine.run_rounds.clear_cache()
        traces = engine.TRACES["run_rounds"]
        split = engine.run_batch(cfg, specs, params, True, 512, engine.TABLES, lanes, timings=timings,
                                 on_progress=lambda *_, seen=threads: seen.add(threading.current_thread().name))  # fmt: skip
        assert timings["lanes"] == lanes and timings["calls"] >= 1
        assert len(threads) == lanes and threading.current_thread().name not in threads
        assert engine.TRACES["run_rounds"] == traces + 1  # the lanes, called cold together, traced it once
        assert len(split) == len(specs)
        for a, b, spec in zip(one, split, specs, strict=True):
            _assert_same_records(a, b)
            assert (b["tasks"]["seed"] == spec.labels["seed"]).all()


def test_runner_lanes_and_the_default(tmp_path):
    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1, 2), n_tasks=84)
    one = runner.run(exp, tmp_path / "one", progress=False, lanes=1)
    default = runner.run(exp, tmp_path / "default", progress=False)  # one lane per core
    _assert_same_records(
        {n: getattr(one, n) for n in runner.TABLES}, {n: getattr(default, n) for n in runner.TABLES}
    )
    with pytest.raises(MeshHealError, match="--lanes must be >= 1"):
        runner.run(exp, tmp_path / "zero", progress=False, lanes=0)


def test_sweep_lanes_give_the_one_lane_tables(tmp_path):
    def run(lanes: int, out: Path) -> sweep.SweepResult:
        cfg = sweep.SweepConfig(grid=(("alpha=1.0,1.4",),), seed_list=(0, 1), tasks=84, datasets=("bbh",),
                                chunk=64, out=out, lanes=lanes)  # fmt: skip
        return sweep.run(cfg, progress=False)

    one, split = run(1, tmp_path / "one"), run(2, tmp_path / "split")
    assert one.summary["timing_s"]["lanes"] == 1 and split.summary["timing_s"]["lanes"] == 2
    _assert_same_records(one.frames, split.frames)


def test_a_streams_tables_do_not_depend_on_the_chunk_length():
    """With tasks in flight a task may finish in a later chunk than one started after it; the
    batch width sets the chunk length (engine.default_chunk), so the tasks table is put in task
    order over the whole stream (engine.stream_tables) and a lane's tables equal the whole's."""
    exp = runner.Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=(0,), n_agents=12, slots=2,
                            n_tasks=168, degraded=None, topology="sparse")  # fmt: skip
    specs = _specs(exp)
    short, long = (engine.run_streams(specs, exp.protocol, slots=2, chunk=c, lanes=1)[0] for c in (8, 512))
    assert short["tasks"]["t"].to_list() == list(range(1, 169))
    _assert_same_records(short, long)


def test_batch_benchmark_runs_lanes():
    """sim_throughput's batch section, 6 agents only, 2 streams: one lane and two lanes."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_throughput.py"), "--sections", "batch", "--widths", "2",
           "--batch-agents", "6", "--repeats", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert (
        len(rows) == 1 and float(rows[0][2].replace(",", "")) > 0 and float(rows[0][3].replace(",", "")) > 0
    )


def test_a_failing_lane_stops_the_others_and_raises():
    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1), n_tasks=504)
    specs = _specs(exp)
    cfg = engine.engine_config(specs, exp.protocol, 1)
    params = engine.make_params(exp.protocol, specs[0].pair, specs[0].network.profile, cfg.n_agents)
    calls: list[str] = []

    def progress(*_):  # the second lane's thread breaks at its first chunk; the first lane needs 28
        calls.append(threading.current_thread().name)
        if threading.current_thread().name.endswith("_1"):
            raise RuntimeError("a lane broke")

    with pytest.raises(RuntimeError, match="a lane broke"):
        engine.run_batch(cfg, specs, params, False, 64, engine.TABLES, 2, on_progress=progress)
    # the first lane, whose result the caller waits for first, stopped at its next chunk: after the
    # failing call at most the chunk it was running (and, racing the stop flag, one more). Counted
    # from the failure: under load the second lane's first chunk can come after several of the first's.
    failed = next(k for k, name in enumerate(calls) if name.endswith("_1"))
    assert sum(name.endswith("_0") for name in calls[failed:]) <= 2, calls
    assert sum(name.endswith("_0") for name in calls) < 28  # the first lane did not run to its end


def test_a_cancelled_batch_raises_cancelled():
    """run_batch's `cancel` (the runner sets it on Ctrl-C): the lanes stop at their next chunk."""
    from meshheal_jax.errors import Cancelled

    cancel = threading.Event()
    cancel.set()
    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1), n_tasks=84)
    specs = _specs(exp)
    with pytest.raises(Cancelled):
        engine.run_streams(specs, exp.protocol, lanes=2, cancel=cancel)
