"""Run folders that keep finished work and refuse bad input (meshheal_jax/runner.py,
meshheal_jax/checkpoints.py; docs/decisions.md X1): the lock, what a resume counts and says, which
folders are new or refused, checkpoints whose layout does not fit, and a stop that lands right after
a part was written."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import polars as pl
import pytest

from meshheal_jax import metrics, runner
from meshheal_jax.checkpoints import Checkpoints, CheckpointWarning
from meshheal_jax.errors import MeshHealError

EXP = runner.Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0, 1), n_tasks=42,
                        engine="reference")  # fmt: skip
NOTHING_LOST = "deleting it loses nothing"


def test_a_second_holder_of_a_run_folder_is_refused_naming_the_first(tmp_path):
    """The lock is exclusive (one per open file, as two processes hold it), records the holder's
    process id in place of a stale one, and is free again once its run ends."""
    (tmp_path / runner.LOCK_FILE).write_text("99999999 (a run that ended)")
    with runner._exclusive(tmp_path):
        assert (tmp_path / runner.LOCK_FILE).read_text() == str(os.getpid())
        with (
            pytest.raises(MeshHealError, match=rf"is in use by another run \(process {os.getpid()}\); wait"),
            runner._exclusive(tmp_path),
        ):
            pass
    with runner._exclusive(tmp_path):  # released
        pass


def test_a_resume_says_what_it_kept_and_counts_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    first = runner.run(EXP, out, progress=False)
    assert not first.resumed
    capsys.readouterr()
    again = runner.run(EXP, out, progress=False)
    assert f"resuming {out}: 2 of 2 streams already finished" in capsys.readouterr().out
    assert again.resumed and again.summary == first.summary
    for seed in (0, 1):  # no finished stream, one committed checkpoint: still a resume
        shutil.rmtree(runner._part_dir(out, "meshheal", "math", "default", seed))
    checkpoint = runner._checkpoint_dir(out, "meshheal", "math", "default", 0)
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    third = runner.run(EXP, out, progress=False)
    assert "0 of 2 streams already finished, 1 with a checkpoint" in capsys.readouterr().out
    assert third.resumed and not (out / "checkpoints").exists()
    assert third.summary == first.summary and third.summary["n_tasks"] == 42


def test_a_bad_checkpoint_interval_is_refused_before_anything_is_written(tmp_path):
    for every in (-1.0, float("nan")):
        with pytest.raises(MeshHealError, match="--checkpoint-every must be >= 0 seconds"):
            runner.run(EXP, tmp_path / "run", progress=False, checkpoint_every=every)
    assert not (tmp_path / "run").exists()


def test_a_folder_holding_only_its_lock_is_a_new_one(tmp_path):
    """`rm -rf run/*` leaves the hidden lock file: the folder is as good as empty."""
    (tmp_path / runner.LOCK_FILE).write_text("4242")
    assert runner.prepare_run_dir(EXP, tmp_path) == tmp_path
    assert json.loads((tmp_path / "config.json").read_text())[runner.RUN_MARKER]


def test_a_config_json_without_the_run_marker_is_not_a_run_folder(tmp_path):
    recorded = {"experiment": EXP.to_json(), "inputs": runner.input_digests(EXP)}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(MeshHealError, match=f"output folder {tmp_path} exists and is not a run folder$"):
        runner.check_run_dir(EXP, tmp_path)


def test_a_refusal_never_calls_a_folder_holding_checkpoints_safe_to_delete(tmp_path):
    runner.prepare_run_dir(EXP, tmp_path)
    other = dataclasses.replace(EXP, n_tasks=84)
    with pytest.raises(MeshHealError, match=NOTHING_LOST):
        runner.check_run_dir(other, tmp_path)
    checkpoint = runner._checkpoint_dir(tmp_path, "meshheal", "math", "default", 0)
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")  # a committed checkpoint: work a deletion would lose
    with pytest.raises(MeshHealError, match="different configuration") as refused:
        runner.check_run_dir(other, tmp_path)
    assert NOTHING_LOST not in str(refused.value)


def saved(tmp_path, carry) -> Checkpoints:
    """A checkpoint of `carry` after one chunk, its tables in the engine's order (not sorted)."""
    saves = Checkpoints([tmp_path / "s0"], every_s=0)
    chunk = {"tasks": pl.DataFrame({"t": [1, 2]}), "calls": pl.DataFrame({"t": [1]})}
    saves.save(0, carry, [chunk], tasks_entered=2)
    return saves


def test_a_checkpoint_restores_only_into_a_carry_of_its_layout(tmp_path):
    carry = {"a": np.arange(3, dtype=np.int32), "b": np.zeros((2, 2))}
    saves = saved(tmp_path, carry)
    restored, parts = saves.restore(0, carry, ("tasks", "calls"))
    assert np.array_equal(restored["a"], carry["a"]) and parts[0]["tasks"]["t"].to_list() == [1, 2]
    saves.save(0, carry, [{"tasks": pl.DataFrame({"t": [3]}), "calls": pl.DataFrame({"t": [2]})}], 3)
    assert sorted(p.name for p in (tmp_path / "s0").iterdir()) == [  # the older carry is gone
        "carry-00002.npz", *(f"records-0000{k}.{t}.parquet" for k in (0, 1) for t in ("calls", "tasks")),
        "state.json",
    ]  # fmt: skip
    restored, parts = saves.restore(0, carry, ("tasks", "calls"))
    assert [p["tasks"]["t"].to_list() for p in parts] == [[1, 2], [3]]
    shutil.rmtree(tmp_path / "s0")
    other = {"a": np.arange(4, dtype=np.int32), "b": np.zeros((2, 2))}  # another engine's shapes
    with pytest.warns(CheckpointWarning, match="another layout"):
        assert saved(tmp_path, carry).restore(0, other, ("tasks", "calls")) is None
    assert not (tmp_path / "s0").exists()


def test_a_checkpoint_whose_arrays_differ_from_its_commit_is_dropped(tmp_path):
    carry = {"a": np.arange(3, dtype=np.int32)}
    saves = saved(tmp_path, carry)
    np.savez(tmp_path / "s0" / "carry-00001.npz", np.arange(5, dtype=np.int32))  # not what state.json says
    with pytest.warns(CheckpointWarning, match="arrays do not match its layout"):
        assert saves.restore(0, carry, ("tasks", "calls")) is None
    assert not (tmp_path / "s0").exists()


def test_a_stop_right_after_a_part_is_written_stops_without_writing_it_twice(tmp_path, monkeypatch):
    """A Ctrl-C that lands after a stream's part was renamed into place but before the batch runner
    marked it kept: the stop's drain keeps that stream again, which must find the part there and not
    write it a second time (a rename onto it fails), so the run stops with KeyboardInterrupt and the
    part stays whole (decisions X1: finished work is never lost). The baseline batch is a stand-in
    returning empty tables, so nothing compiles."""
    exp = dataclasses.replace(EXP, methods=("agentnet",), engine="jax", seeds=(0,))
    empty = {name: pl.DataFrame(schema=metrics.SCHEMAS[name]) for name in runner.TABLES}
    monkeypatch.setattr(
        runner, "run_baseline_streams", lambda exp, method, batch, run_dir: [empty] * len(batch)
    )
    writes, real_write = [], runner._write_part

    def write_then_stop(part, frames):
        writes.append(part)
        real_write(part, frames)
        if len(writes) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_write_part", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        runner.run(exp, tmp_path / "run", progress=False)
    part = runner._part_dir(tmp_path / "run", "agentnet", "math", "default", 0)
    assert writes == [part]
    assert runner._part_readable(part, exp.tables)
