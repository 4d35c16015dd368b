"""Checkpoints of unfinished streams (meshheal_jax/checkpoints.py; docs/decisions.md X1): a batch
stopped or crashed between chunks goes on from its last checkpoint, and its streams' records equal
an uninterrupted run's."""

from __future__ import annotations

import json
import threading

import jax
import polars as pl
import pytest

from meshheal_jax import engine, runner
from meshheal_jax.checkpoints import Checkpoints, CheckpointWarning
from meshheal_jax.device import stack
from meshheal_jax.errors import Cancelled

CHUNK = 16  # rounds per compiled call: a 6-agent 84-task stream takes ~30 of them
RUN_ROUNDS = engine.run_rounds


@pytest.fixture(scope="module")
def batch():
    exp = runner.Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0, 1), n_tasks=84)
    specs = []
    for seed in exp.seeds:
        network, stream, pair, labels = runner._stream_inputs(exp, "math", "default", seed)
        specs.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
    cfg = engine.engine_config(specs, exp.protocol, 1)
    params = engine.make_params(exp.protocol, specs[0].pair, specs[0].network.profile, cfg.n_agents)
    timings: dict = {}
    whole = engine.run_batch(cfg, specs, params, False, CHUNK, lanes=1, timings=timings)
    return cfg, specs, params, whole, timings["calls"]


def template(batch):
    """A fresh carry of the batch's first stream, on the host: what a restore checks a checkpoint against."""
    cfg, specs, *_ = batch
    world = stack([engine.make_world(specs[0].network, specs[0].stream, specs[0].schedule)])
    return engine.at(jax.device_get(engine.initial_carries(cfg, world)), 0)


def run(batch, saves: Checkpoints, **kw):
    cfg, specs, params, _, _ = batch
    timings: dict = {}
    out = engine.run_batch(
        cfg, specs, params, False, CHUNK, lanes=1, timings=timings, checkpoints=saves, **kw
    )
    return out, timings["calls"]


def assert_equal(a: list[dict[str, pl.DataFrame]], b: list[dict[str, pl.DataFrame]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].height > 0 and x[name].equals(y[name], null_equal=True), name


def test_a_stopped_batch_goes_on_from_its_checkpoints(batch, tmp_path):
    *_, whole, calls = batch
    folders = [tmp_path / "s0", tmp_path / "s1"]
    cancel = threading.Event()
    chunks = []

    def stop_after_three(done: int, total: int) -> None:
        chunks.append(done)
        if len(chunks) == 3:
            cancel.set()

    with pytest.raises(Cancelled):  # never due (an hour): the stop itself writes them
        run(batch, Checkpoints(folders, every_s=3600), on_progress=stop_after_three, cancel=cancel)
    for folder in folders:
        state = json.loads((folder / "state.json").read_text())
        assert state["saved"] == 1 and 0 < state["tasks_entered"] < 84
        assert sorted(p.name for p in folder.iterdir()) == [
            "carry-00001.npz", *(f"records-00000.{t}.parquet" for t in sorted(engine.TABLES)), "state.json"
        ]  # fmt: skip
    resumed, resumed_calls = run(batch, Checkpoints(folders, every_s=3600))
    assert resumed_calls == calls - 3  # three chunks were not run again
    assert_equal(resumed, whole)


def test_a_crashed_batch_goes_on_from_its_last_checkpoint(batch, tmp_path, monkeypatch):
    *_, whole, calls = batch
    folders = [tmp_path / "s0", tmp_path / "s1"]
    real, seen = engine.run_rounds, []

    def crash_on_the_fifth_call(*args):
        seen.append(1)
        if len(seen) == 5:
            raise RuntimeError("a crash between two chunks")
        return real(*args)

    monkeypatch.setattr(engine, "run_rounds", crash_on_the_fifth_call)
    with pytest.raises(RuntimeError, match="a crash"):
        run(batch, Checkpoints(folders, every_s=0))  # after every chunk
    monkeypatch.undo()
    assert json.loads((folders[0] / "state.json").read_text())["saved"] == 4
    # a save cut short before its commit leaves files that the next read drops
    (folders[0] / "records-00004.tasks.parquet").write_bytes(b"half")
    (folders[0] / "carry-00005.npz").write_bytes(b"half")
    (tmp_path / "first").mkdir()  # a stream whose first save was cut short: no state.json
    (tmp_path / "first" / "records-00000.tasks.parquet").write_bytes(b"half")
    saves = Checkpoints([*folders, tmp_path / "first"], every_s=3600)
    assert saves.restore(0, template(batch), engine.TABLES) is not None
    assert sorted(p.name for p in folders[0].iterdir()) == [
        "carry-00004.npz", *(f"records-0000{k}.{t}.parquet" for k in range(4) for t in sorted(engine.TABLES)),
        "state.json",
    ]  # fmt: skip
    assert saves.restore(2, template(batch), engine.TABLES) is None and not (tmp_path / "first").exists()
    resumed, resumed_calls = run(batch, Checkpoints(folders, every_s=0))
    assert resumed_calls == calls - 4
    assert_equal(resumed, whole)
    # the lane outlasted its interval (0 s): it saved at its end, so a rerun has every stream done
    again, again_calls = run(batch, Checkpoints(folders, every_s=0))
    assert again_calls == 0
    assert_equal(again, whole)


def test_a_checkpoint_of_another_layout_is_dropped_with_a_warning(batch, tmp_path):
    *_, whole, calls = batch
    folders = [tmp_path / "s0", tmp_path / "s1"]
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        run(batch, Checkpoints(folders, every_s=0), on_progress=lambda *_: cancel.set(), cancel=cancel)
    state = json.loads((folders[1] / "state.json").read_text())
    state["layout"]["leaves"][0][0] = [7]  # as if written by an engine with other shapes
    (folders[1] / "state.json").write_text(json.dumps(state))
    with pytest.warns(CheckpointWarning, match=f"checkpoint {folders[1]} not used .*another layout"):
        resumed, resumed_calls = run(batch, Checkpoints(folders, every_s=3600))
    # stream 1 ran from its first task, stream 0 from its chunk 1: the batch takes all its calls, or
    # one fewer when stream 0 is the longer one (it is with the model files of 2026-12-06)
    assert calls - 1 <= resumed_calls <= calls
    assert not folders[1].exists()
    assert_equal(resumed, whole)


@pytest.mark.parametrize("damage", ["empty carry", "cut carry", "cut records", "null count", "other tables"])
def test_a_damaged_checkpoint_is_dropped_with_a_warning(batch, tmp_path, damage):
    """What a crash of the machine (files named by the commit but not all on disk) or a hand edit
    leaves: the rerun warns, and runs that stream from its first task."""
    folders = [tmp_path / "s0", tmp_path / "s1"]
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        run(batch, Checkpoints(folders, every_s=0), on_progress=lambda *_: cancel.set(), cancel=cancel)
    carry, records = folders[1] / "carry-00001.npz", folders[1] / "records-00000.calls.parquet"
    if damage == "empty carry":
        carry.write_bytes(b"")
    elif damage == "cut carry":
        carry.write_bytes(carry.read_bytes()[:1000])
    elif damage == "cut records":
        records.write_bytes(records.read_bytes()[:100])
    elif damage == "null count":
        (folders[1] / "state.json").write_text(
            json.dumps({**json.loads((folders[1] / "state.json").read_text()), "saved": None})
        )
    tables = ("tasks", "calls") if damage == "other tables" else engine.TABLES
    with pytest.warns(CheckpointWarning, match=f"checkpoint {folders[1]} not used"):
        assert Checkpoints(folders).restore(1, template(batch), tables) is None
    assert not folders[1].exists() and folders[0].exists()  # (a rerun then: as in the layout test above)


EXP = runner.Experiment(name="main", methods=("meshheal",), datasets=("math",), pairs=("default",),
                        seeds=(0, 1), n_tasks=84)  # fmt: skip


def counted_chunks(monkeypatch, on_call=lambda n: None) -> list:
    """Count the engine's compiled calls (chunks) from now on; on_call(n) runs before the n-th."""
    seen = []

    def run_rounds(*args):
        seen.append(1)
        on_call(len(seen))
        return RUN_ROUNDS(*args)

    monkeypatch.setattr(engine, "run_rounds", run_rounds)
    monkeypatch.setattr(engine, "default_chunk", lambda *_: CHUNK)  # the program the tests above compiled
    return seen


def test_a_run_resumes_from_the_checkpoints_of_a_crashed_batch(tmp_path, monkeypatch):
    seen = counted_chunks(monkeypatch)
    whole = runner.run(EXP, tmp_path / "whole", progress=False, lanes=1)
    chunks = len(seen)

    def crash(n: int) -> None:
        if n == 2:
            raise RuntimeError("a crash between two chunks")

    seen = counted_chunks(monkeypatch, crash)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a crash"):
        runner.run(EXP, out, progress=False, lanes=1, checkpoint_every=0)
    assert not (out / "parts").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "meshheal-math-default-seed0", "meshheal-math-default-seed1"
    ]  # fmt: skip
    seen = counted_chunks(monkeypatch)
    resumed = runner.run(EXP, out, progress=False, lanes=1, checkpoint_every=0)
    assert len(seen) == chunks - 1  # on from the checkpoint after chunk 1
    assert not (out / "checkpoints").exists()
    for name in runner.TABLES:
        assert getattr(resumed, name).equals(getattr(whole, name), null_equal=True), name
    assert resumed.summary == whole.summary


def test_ctrl_c_writes_the_checkpoints_and_the_rerun_goes_on_from_them(tmp_path, monkeypatch):
    """Ctrl-C during a run (the default interval, never due here): the lanes stop at their next
    chunk and write their checkpoints on the way out (runner._run_side_by_side's cancel)."""
    import ctypes
    import time

    seen = counted_chunks(monkeypatch)
    whole = runner.run(EXP, tmp_path / "whole", progress=False, lanes=1)
    chunks = len(seen)
    caller = threading.get_ident()  # the thread running runner.run (an xdist worker may not be the main one)

    def ctrl_c(n: int) -> None:
        if n == 2:  # a KeyboardInterrupt in the caller's thread, as Ctrl-C raises it in the main thread
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(caller), ctypes.py_object(KeyboardInterrupt)
            )
            time.sleep(1.0)  # the caller sets the cancel event before this chunk ends

    seen = counted_chunks(monkeypatch, ctrl_c)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        runner.run(EXP, out, progress=False, lanes=1)
    assert len(seen) == 2
    for seed in (0, 1):
        state = json.loads(
            (out / "checkpoints" / f"meshheal-math-default-seed{seed}" / "state.json").read_text()
        )
        assert state["saved"] == 1  # one checkpoint, written on the way out, after two chunks
    seen = counted_chunks(monkeypatch)
    resumed = runner.run(EXP, out, progress=False, lanes=1)
    assert len(seen) == chunks - 2
    for name in runner.TABLES:
        assert getattr(resumed, name).equals(getattr(whole, name), null_equal=True), name
