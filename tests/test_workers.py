"""`--workers N`: streams split over processes pinned to their own cores (meshheal_jax.workers).

The split changes only where a stream runs: records equal the one-process run's (the JAX engine's
float columns up to rounding in the last bits, as XLA compiles a program per batch width; the
reference engine's exactly), parts land in the run folder as usual, and a failing worker is named.
"""

from __future__ import annotations

import operator
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import polars as pl
import pytest
from hypothesis import given

from meshheal_jax import runner, sweep, workers
from meshheal_jax.errors import MeshHealError

ROOT = Path(__file__).resolve().parents[1]


@given(st.lists(st.integers(), max_size=40), st.integers(1, 12))
def test_split_keeps_order_and_balances(items, n):
    groups = workers.split(items, n)
    assert [x for g in groups for x in g] == items
    assert len(groups) == min(n, len(items))
    assert all(groups) and (not groups or max(map(len, groups)) - min(map(len, groups)) <= 1)


def test_split_refuses_no_workers():
    with pytest.raises(MeshHealError, match="workers must be >= 1"):
        workers.split([1, 2], 0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(workers.usable_cores()) < 2,
                    reason="needs two cores and sched_setaffinity")  # fmt: skip
def test_map_pinned_gives_each_job_its_own_core_and_names_a_failure():
    cores = workers.usable_cores()
    pinned = workers.map_pinned(os.sched_getaffinity, [(0,), (0,)])
    assert pinned == [{cores[0]}, {cores[1]}]
    assert workers.map_pinned(operator.call, [(os.getpid,), (os.getpid,)]) != [os.getpid()] * 2  # other processes
    with pytest.raises(MeshHealError, match=r"^worker 2 of 2 \(test jobs\): --workers must be >= 1, got 0$"):
        workers.map_pinned(workers.split, [([1], 1), ([2], 0)], "test jobs")
    with pytest.raises(MeshHealError, match=r"^worker 1 of 2 \(test jobs\): ZeroDivisionError: division by zero$"):
        workers.map_pinned(operator.truediv, [(1, 0), (1, 1)], "test jobs")
    with pytest.raises(MeshHealError, match=r"^worker 2 of 3 \(test jobs\) died without a result \(exit code 3"):
        workers.map_pinned(operator.call, [(os.getpid,), (os._exit, 3), (os.getpid,)], "test jobs")


def _assert_same_records(a: dict[str, pl.DataFrame], b: dict[str, pl.DataFrame], exact: bool) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert x.height == y.height > 0, name
        floats = [] if exact else [c for c, dtype in x.schema.items() if dtype == pl.Float64]
        for c in floats:
            gap = (x[c] - y[c]).abs().max()
            assert gap is None or gap <= 1e-12, (name, c, gap)
        assert x.drop(floats).equals(y.drop(floats)), name


def _frames(results: runner.Results) -> dict[str, pl.DataFrame]:
    return {name: getattr(results, name) for name in runner.TABLES}


@pytest.mark.parametrize("engine", ["jax", "reference"])
def test_workers_give_the_one_process_records(tmp_path, monkeypatch, engine):
    exp = runner.Experiment(name="main", datasets=("bbh", "math"), pairs=("default",), seeds=(0, 1, 2),
                            engine=engine, n_tasks=84)  # fmt: skip
    one = runner.run(exp, tmp_path / "one", progress=False)
    splits = []

    def counted(fn, jobs, what="job"):
        splits.append([[stream for stream in job[1]] for job in jobs])
        return workers.map_pinned(fn, jobs, what)

    monkeypatch.setattr(runner, "map_pinned", counted)
    split = runner.run(exp, tmp_path / "split", progress=False, workers=2)
    streams = [(d, "default", s) for d in exp.datasets for s in exp.seeds]
    assert splits == [[streams[:3], streams[3:]]]  # two worker processes, three streams each
    _assert_same_records(_frames(one), _frames(split), exact=engine == "reference")
    if engine == "reference":
        assert one.summary["results"] == split.summary["results"]
    parts = sorted(p.name for p in (tmp_path / "split" / "parts").iterdir())
    assert parts == sorted(f"meshheal-{d}-default-seed{s}" for d, _, s in streams)
    # resumed with another split: the streams whose parts are gone run again, in one process here
    for gone in ("meshheal-bbh-default-seed1", "meshheal-math-default-seed2"):
        shutil.rmtree(tmp_path / "split" / "parts" / gone)
    again = runner.run(exp, tmp_path / "split", progress=False, workers=3)
    assert splits[1] == [[("bbh", "default", 1)], [("math", "default", 2)]]
    _assert_same_records(_frames(split), _frames(again), exact=engine == "reference")


def test_workers_refuse_the_live_backend_and_nonsense(tmp_path):
    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42)
    with pytest.raises(MeshHealError, match="--workers must be >= 1"):
        runner.run(exp, tmp_path / "zero", progress=False, workers=0)
    live = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42,
                             backend="live", live=runner.LiveSettings(strong_urls=("http://127.0.0.1:9/v1",),
                                                                      weak_urls=("http://127.0.0.1:9/v1",)))  # fmt: skip
    with pytest.raises(MeshHealError, match="live backend batches every stream's calls in one process"):
        runner.run(live, tmp_path / "live", progress=False, workers=2)


def test_sweep_workers_give_the_one_process_tables(tmp_path):
    def run(workers_: int, out: Path) -> sweep.SweepResult:
        cfg = sweep.SweepConfig(grid=(("alpha=1.0,1.4",),), seed_list=(0, 1), tasks=84, datasets=("bbh",),
                                chunk=64, out=out, workers=workers_)  # fmt: skip
        return sweep.run(cfg, progress=False)

    one, split = run(1, tmp_path / "one"), run(2, tmp_path / "split")
    assert split.summary["timing_s"]["workers"] == 2
    _assert_same_records(one.frames, split.frames, exact=False)


def test_batch_benchmark_splits_streams_over_pinned_workers():
    """sim_throughput's batch section, 6 agents only, 2 streams: one process and two pinned workers."""
    if len(workers.usable_cores()) < 2:
        pytest.skip("needs two cores")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_throughput.py"), "--sections", "batch", "--widths", "2",
           "--batch-agents", "6", "--repeats", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and float(rows[0][2].replace(",", "")) > 0 and float(rows[0][3].replace(",", "")) > 0


def test_a_streams_tables_do_not_depend_on_the_chunk_length():
    """With tasks in flight a task may finish in a later chunk than one started after it; the
    batch width sets the chunk length (engine.default_chunk), so the tasks table is put in task
    order over the whole stream (engine.stream_tables) and a split run's tables equal the whole's."""
    from meshheal_jax import engine

    exp = runner.Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=(0,), n_agents=12, slots=2,
                            n_tasks=168, degraded=None, topology="sparse")  # fmt: skip
    network, stream, pair, labels = runner._stream_inputs(exp, "bbh", "default", 0)
    specs = [engine.StreamSpec(network, stream, exp.schedule(), pair, labels)]
    short, long = (engine.run_streams(specs, exp.protocol, slots=2, chunk=c)[0] for c in (8, 512))
    assert short["tasks"]["t"].to_list() == list(range(1, 169))
    _assert_same_records(short, long, exact=False)
