"""Run folders and checkpoints, a second pass (meshheal_jax/runner.py, meshheal_jax/checkpoints.py;
docs/decisions.md X1, R1; README "Outputs (run folder)"): a stream without a checkpoint starts
without a word, a save cut short at its commit leaves the previous checkpoint whole, and an output
path that is a file is named in one line."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import warnings

import numpy as np
import polars as pl
import pytest

from meshheal_jax import runner
from meshheal_jax.checkpoints import Checkpoints
from meshheal_jax.errors import MeshHealError

EXP = runner.Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0, 1), n_tasks=42,
                        engine="reference")  # fmt: skip
CARRY = {"a": np.arange(3, dtype=np.int32), "b": np.zeros((2, 2))}
TABLES = ("tasks", "calls")
NOTHING_LOST = "deleting it loses nothing"


def chunk(*ts: int) -> dict[str, pl.DataFrame]:
    return {"tasks": pl.DataFrame({"t": list(ts)}), "calls": pl.DataFrame({"t": list(ts)})}


def test_a_stream_without_a_checkpoint_starts_without_a_warning(tmp_path):
    """No folder (a fresh run), or one without its state.json (a first save cut short): no
    checkpoint, nothing to warn of (CheckpointWarning is for a checkpoint that cannot be used); the
    stray folder is removed."""
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "records-00000.tasks.parquet").write_bytes(b"half")
    saves = Checkpoints([tmp_path / "none", cut])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert saves.restore(0, CARRY, TABLES) is None
        assert saves.restore(1, CARRY, TABLES) is None
    assert not cut.exists() and not (tmp_path / "none").exists()


def test_a_save_cut_short_at_its_commit_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """checkpoints.py: every file is written before state.json is replaced, and the older carry is
    deleted only after that commit, so a crash at the commit leaves checkpoint 1 as it was."""
    saves = Checkpoints([tmp_path / "s0"], every_s=0)
    saves.save(0, CARRY, [chunk(1, 2)], tasks_entered=2)
    real_replace = pathlib.Path.replace

    def crash_at_the_commit(self, target):
        if pathlib.Path(target).name == "state.json":
            raise OSError("the machine went down")
        return real_replace(self, target)

    monkeypatch.setattr(pathlib.Path, "replace", crash_at_the_commit)
    with pytest.raises(OSError, match="went down"):
        saves.save(0, {**CARRY, "a": CARRY["a"] + 1}, [chunk(3)], tasks_entered=3)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        carry, parts = saves.restore(0, CARRY, TABLES)
    assert np.array_equal(carry["a"], CARRY["a"])
    assert [p["tasks"]["t"].to_list() for p in parts] == [[1, 2]]
    assert sorted(p.name for p in (tmp_path / "s0").iterdir()) == [  # what the cut save left: removed
        "carry-00001.npz", "records-00000.calls.parquet", "records-00000.tasks.parquet", "state.json"
    ]  # fmt: skip


def test_an_output_path_that_is_a_file_is_named_in_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("precious")
    with pytest.raises(MeshHealError, match=f"^output path {a_file} exists and is not a folder$"):
        runner.check_run_dir(EXP, a_file)
    assert a_file.read_text() == "precious"


def test_a_refusal_names_every_setting_that_differs_with_both_values(tmp_path):
    runner.prepare_run_dir(EXP, tmp_path)
    other = dataclasses.replace(EXP, n_tasks=84, seeds=(0, 1, 2))
    with pytest.raises(MeshHealError, match=r"different configuration \(n_tasks, seeds differ\)") as refused:
        runner.check_run_dir(other, tmp_path)
    assert str(refused.value).endswith(
        "; recorded n_tasks=42, seeds=[0, 1], given n_tasks=84, seeds=[0, 1, 2]"
    )


def test_a_refusal_cuts_a_long_value_to_sixty_characters(tmp_path):
    runner.prepare_run_dir(EXP, tmp_path)
    many = dataclasses.replace(EXP, seeds=tuple(range(40)))
    with pytest.raises(MeshHealError, match="different configuration") as refused:
        runner.check_run_dir(many, tmp_path)
    given = str(refused.value).split("given seeds=")[1]
    assert len(given) == 60 and given.startswith("[0, 1, 2,") and given.endswith("...")


def test_a_folder_holding_a_summary_is_never_called_safe_to_delete(tmp_path):
    """The summary is a finished run's result: a refusal must not say deleting the folder loses
    nothing (decisions R1: finished work is never lost)."""
    runner.prepare_run_dir(EXP, tmp_path)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(MeshHealError, match="different configuration") as refused:
        runner.check_run_dir(dataclasses.replace(EXP, n_tasks=84), tmp_path)
    assert NOTHING_LOST not in str(refused.value)


def test_recorded_inputs_without_their_digest_are_a_damaged_config_json(tmp_path):
    """An inputs entry that is an object but has no sha256 (a hand edit): one line naming the
    damage, not a KeyError when the contents are compared."""
    runner.prepare_run_dir(EXP, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["inputs"]["profile math"] = {"path": config["inputs"]["profile math"]["path"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MeshHealError, match=r"has a damaged config.json \(its experiment or inputs\)"):
        runner.check_run_dir(EXP, tmp_path)


def test_a_refusal_over_the_baselines_rules_alone_shows_their_values(tmp_path):
    """A folder with baselines from before their model rules were recorded is refused (decisions
    B0, B3); the refusal's values clause must not be empty."""
    exp = dataclasses.replace(EXP, methods=("meshheal", "raps"), seeds=(0,))
    runner.prepare_run_dir(exp, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["experiment"]["baseline_rules"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MeshHealError, match=r"\(baseline_rules\..*differ\)") as refused:
        runner.check_run_dir(exp, tmp_path)
    message = str(refused.value)
    assert "recorded , given " not in message
    assert re.search(
        r'; recorded baseline_rules\.[\w.]+="\w+".*, given baseline_rules\.[\w.]+="\w+"', message
    ), message


def test_config_json_records_the_experiment_its_inputs_versions_and_revision(tmp_path):
    """README "Outputs (run folder)": config.json holds the resolved experiment, package versions
    and the git revision (and, for a resume, the inputs' digests)."""
    config = json.loads((runner.prepare_run_dir(EXP, tmp_path) / "config.json").read_text())
    assert config[runner.RUN_MARKER] is True and config["experiment"] == json.loads(json.dumps(EXP.to_json()))
    assert sorted(config["inputs"]) == ["model file gpt-oss-120b", "model file llama-3.2-1b", "profile math"]
    assert {"meshheal_jax", "jax", "numpy", "polars"} <= set(config["versions"])
    assert config["versions"]["numpy"] == np.__version__
    assert "git_revision" in config and "created" in config


def test_a_setting_recorded_as_none_differs_from_a_value_given_now(tmp_path):
    """Recorded `degraded: null` (the profiles' A3/A5) and a resume giving --degraded 0 1: other
    agents degrade, so the folder is refused (a key recorded as, or missing and read as, None
    compares like any other value)."""
    runner.prepare_run_dir(dataclasses.replace(EXP, degraded=None), tmp_path)
    refused = r"\(degraded differ\).*recorded degraded=null, given degraded=\[0, 1\]"
    with pytest.raises(MeshHealError, match=refused):
        runner.check_run_dir(dataclasses.replace(EXP, degraded=(0, 1)), tmp_path)


def test_a_run_keeping_fewer_tables_resumes_its_parts_and_writes_only_those(tmp_path, capsys):
    """--tables tasks states (decisions X5): each part holds the tables kept (the reference engine
    makes all four), a rerun finds every part whole (it does not read them as damaged, which would
    run every stream again), and the tables not kept are written empty."""
    exp = dataclasses.replace(EXP, tables=("tasks", "states"))
    first = runner.run(exp, tmp_path, progress=False)
    part = runner._part_dir(tmp_path, "meshheal", "math", "default", 0)
    assert sorted(p.name for p in part.iterdir()) == ["states.parquet", "tasks.parquet"]
    assert first.calls.height == 0 and first.reviews.height == 0 and first.tasks.height == 2 * 42
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", runner.DamagedPartWarning)
        again = runner.run(exp, tmp_path, progress=False)
    assert f"resuming {tmp_path}: 2 of 2 streams already finished" in capsys.readouterr().out
    assert again.summary == first.summary


def test_a_checkpoint_left_beside_a_finished_part_is_not_counted(tmp_path, capsys):
    """A stop between writing a part and removing its checkpoint: the stream is finished, so the
    resume line counts no checkpoint, and the stray checkpoint is removed."""
    runner.run(EXP, tmp_path, progress=False)
    stray = runner._checkpoint_dir(tmp_path, "meshheal", "math", "default", 0)
    stray.mkdir(parents=True)
    (stray / "state.json").write_text("{}")
    capsys.readouterr()
    runner.run(EXP, tmp_path, progress=False)
    line = capsys.readouterr().out
    assert "2 of 2 streams already finished" in line and "with a checkpoint" not in line
    assert not (tmp_path / "checkpoints").exists()


def test_a_part_whose_write_was_killed_does_not_stop_the_rerun(tmp_path):
    """kill -9 while a part was written leaves parts/<name>.tmp: the rerun writes the part anew."""
    first = runner.run(EXP, tmp_path / "whole", progress=False)
    out = tmp_path / "run"
    runner.prepare_run_dir(EXP, out)
    half = out / "parts" / "meshheal-math-default-seed1.tmp"  # runner._write_part's temporary folder
    half.mkdir(parents=True)
    (half / "tasks.parquet").write_bytes(b"PAR1")
    assert runner.run(EXP, out, progress=False).summary == first.summary
    assert not half.exists()


def test_a_part_that_cannot_be_read_for_another_reason_is_left_as_it_is(tmp_path, monkeypatch):
    """_part_readable: only a missing table or one that is not parquet sets a part aside; any other
    error (the disk, permissions) is raised and the finished stream stays where it is."""
    runner.run(EXP, tmp_path, progress=False)
    part = runner._part_dir(tmp_path, "meshheal", "math", "default", 0)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pl, "read_parquet_schema", denied)
    with pytest.raises(PermissionError):
        runner._part_readable(part, EXP.tables)
    assert part.is_dir() and not part.with_name(part.name + ".damaged").exists()


def test_a_stop_while_the_summary_is_written_leaves_the_old_one_whole(tmp_path, monkeypatch):
    first = runner.run(EXP, tmp_path, progress=False)
    before = (tmp_path / "summary.json").read_text()
    real_write = pathlib.Path.write_text

    def cut_short(self, text, *args, **kwargs):
        if self.name.startswith("summary.json"):
            real_write(self, text[:10])
            raise KeyboardInterrupt
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        runner.run(EXP, tmp_path, progress=False)
    monkeypatch.undo()
    assert (tmp_path / "summary.json").read_text() == before
    assert json.loads(before) == first.summary


def test_run_validates_the_experiment_before_it_makes_the_folder(tmp_path):
    with pytest.raises(MeshHealError, match=r"seeds must be distinct and in 0..2\*\*31-1, got \[1, 1\]"):
        runner.run(dataclasses.replace(EXP, seeds=(1, 1)), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "changes, message",
    [({"graph_seed": 2**63}, "--graph-seed must be in 0..2**63-1, got 9223372036854775808"),
     ({"methods": ("meshheal", "meshheal")}, "methods must be distinct, got ['meshheal', 'meshheal']"),
     ({"methods": ()}, "no methods given"),
     ({"engine": "reference", "n_agents": 12, "slots": 2},
      "the reference engine runs one task at a time: use --slots 1 or --engine jax"),
     ({"engine": "numpy"}, "unknown engine 'numpy'; known: jax, reference"),
     ({"topology": "file"}, "topology must be complete, sparse, or file with an edges file; got 'file'"),
     ({"n_agents": 2310}, "a complete graph of 2310 agents is not supported (at most 2,304); use --sparse"),
     ({"n_agents": 0}, "agents must be a positive multiple of 6, got 0"),
     ({"backend": "grpc"}, "unknown backend 'grpc'; known: emulated, live"),
     ({"name": "recovery", "n_tasks": 210, "degraded": (0, 1, 2)},
      "the recovery schedule degrades two agents (A3, A5), got [0, 1, 2]"),
     ({"datasets": ("-math",)}, "datasets: '-math' is not a name")],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line_naming_them(changes, message):
    """Experiment.validate, which runner.run calls before it makes the run folder."""
    with pytest.raises(MeshHealError, match=re.escape(message)):
        dataclasses.replace(EXP, **changes).validate()
