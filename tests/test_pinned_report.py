"""What `python -m meshheal_jax.report RUN_DIR` reads and says (a mutation audit of
meshheal_jax/report.py) that no other test held: the one-line errors for a folder that is not a run
folder or is damaged (not a folder, a damaged config.json or summary.json, a missing or unreadable
table), the seed shown by default, the commands that reproduce a run (one per dataset, the network's
edges file, a given hub revision kept, an emulated run's questions, the params folder, verbatim argv),
the facts and sections shown for a live run and an old folder, the scaling entries and table, the
parse and prefix notes, and config.json's experiment read back as tuples. Hand-built config and
summary dicts, tiny frames: no run, no JAX compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshheal_jax import metrics, report, runner
from meshheal_jax.errors import MeshHealError

MAIN = {"name": "main", "datasets": ["bbh"], "pairs": ["default"], "seeds": [0], "n_tasks": 84}


def run_folder(path: Path, experiment: dict | None = None, summary: dict | None = None) -> Path:
    """A folder with a run's config.json (its marker and `experiment`) and summary.json, no tables."""
    path.mkdir(exist_ok=True)
    config = {runner.RUN_MARKER: True, "experiment": experiment or MAIN}
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary or {"experiment": "main", "results": []}))
    return path


def folder(config: dict, summary: dict | None = None, tmp_path: Path = Path(".")) -> report.RunFolder:
    return report.RunFolder(path=tmp_path, config=config, summary=summary or {},
                            tasks=metrics.frame("tasks", []), reviews=None, states=None)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Folders that are not (finished) run folders: one line naming what is wrong
# ----------------------------------------------------------------------------------------------


def test_a_file_given_as_the_run_folder_is_named_so(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(MeshHealError, match=r"summary.json is not a folder$"):
        report.write_report(tmp_path / "summary.json")


def test_a_folder_of_arms_names_an_example_arm_folder(tmp_path):
    run_folder(tmp_path / "complete")
    with pytest.raises(MeshHealError) as err:
        report.read_run_folder(tmp_path)
    assert str(err.value) == (
        f"{tmp_path} holds run folders, not one: give one of ['complete'] (e.g. {tmp_path / 'complete'})"
    )


def test_a_missing_summary_says_the_run_did_not_finish(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    (run_dir / "summary.json").unlink()
    with pytest.raises(MeshHealError) as err:
        report.read_run_folder(run_dir)
    assert str(err.value) == (
        f"{run_dir} has no summary.json (the run did not finish; re-run its command to resume)"
    )


@pytest.mark.parametrize("name", ["config.json", "summary.json"])
def test_a_json_file_that_does_not_parse_is_named(tmp_path, name):
    run_dir = run_folder(tmp_path / "run")
    (run_dir / name).write_text('{"experiment": ')
    with pytest.raises(MeshHealError, match=rf"{name} is not valid JSON"):
        report.write_report(run_dir)


def test_a_config_whose_experiment_is_not_an_object_is_damaged(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    (run_dir / "config.json").write_text(json.dumps({runner.RUN_MARKER: True, "experiment": "main"}))
    with pytest.raises(MeshHealError, match=r"config.json is damaged: its 'experiment' is not an object"):
        report.read_run_folder(run_dir)


@pytest.mark.parametrize("config", [[], {runner.RUN_MARKER: True, "experiment": "main"}])
def test_write_report_names_a_config_json_that_is_not_a_run_configuration(tmp_path, config):
    """write_report's look at the experiment name (a sweep's folder gets the sweep's report) once
    raised AttributeError for a config.json that is a JSON list or whose experiment is no object:
    now read_run_folder's one-line message names it."""
    run_dir = run_folder(tmp_path / "run")
    (run_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(MeshHealError, match="config.json"):
        report.write_report(run_dir)


def test_a_missing_table_says_the_run_did_not_finish(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    with pytest.raises(MeshHealError) as err:
        report.load_run(run_dir)
    assert str(err.value) == (
        f"{run_dir} has no tasks.parquet (the run did not finish; re-run its command to resume)"
    )


def test_an_unreadable_table_is_named(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    (run_dir / "tasks.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(MeshHealError, match=r"tasks.parquet is not a readable parquet file"):
        report.load_run(run_dir)


def test_an_experiment_block_that_lacks_required_fields_does_not_describe_a_run():
    with pytest.raises(MeshHealError, match="config.json's experiment block does not describe a run"):
        report.experiment_from_config({"name": "main", "datasets": ["bbh"]})


def test_a_live_block_with_an_unknown_key_does_not_describe_a_run_and_null_protocol_is_the_default():
    """An audit found a raw TypeError for both: a live block's unknown key is now the one-line
    message, and `"protocol": null` reads as no protocol change (as a missing block does)."""
    block = {"name": "main", "datasets": ["bbh"], "pairs": ["default"], "seeds": [0]}
    with pytest.raises(MeshHealError, match="does not describe a run: .*bogus"):
        report.experiment_from_config({**block, "live": {"strong_urls": [], "weak_urls": [], "bogus": 1}})
    assert report.experiment_from_config({**block, "protocol": None}) == report.experiment_from_config(block)


# ----------------------------------------------------------------------------------------------
# What is shown
# ----------------------------------------------------------------------------------------------


def test_the_seed_shown_by_default_is_the_runs_first():
    """ReportConfig.show_seed: "default: the first seed" (the run's order, not the smallest)."""
    assert folder({"experiment": {"name": "recovery", "seeds": [5, 2]}}).shown_seed == 5


def test_the_facts_of_an_old_folder_come_from_its_summary_or_say_unknown(tmp_path):
    """An old config.json without n_tasks or git_revision: the summary's count, "unknown" revision."""
    exp = {"name": "main", "seeds": [0, 1]}
    summary = {"engine": "reference", "backend": "emulated", "n_agents": 6, "n_tasks": 84}
    text = report.render(folder({"experiment": exp}, summary, tmp_path), [])
    assert (
        "engine reference; backend emulated; 6 agents; 84 tasks per stream; seeds 0, 1; created ?; "
        "git revision unknown." in text
    )


@pytest.mark.parametrize("backend, shown", [("live", True), ("emulated", False)])
def test_a_live_run_shows_its_parse_failures_even_when_none_failed(tmp_path, backend, shown):
    zero = metrics.stat([0, 0])
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "parse_failed": zero,
         "parse_retried": zero}  # fmt: skip
    text = report.render(folder({"experiment": MAIN}, {"backend": backend, "results": [r]}, tmp_path), [])
    assert ("## Parse failures" in text) is shown


def test_the_parse_note_names_only_the_kind_groups_that_had_any(capsys):
    zero, some = metrics.stat([0, 0]), metrics.stat([2, 0])
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "parse_failed": some,
         "parse_failed_infer": some, "parse_failed_review": zero, "parse_retried": zero}  # fmt: skip
    assert report.parse_note(r).startswith(
        "Parse failures, bbh meshheal (default), per stream: 1.0 ± 1.4 (infer 1.0 ± 1.4) replies failed"
    )
    report.print_parse_notes([{**r, "parse_failed": zero, "parse_failed_infer": zero}])
    assert capsys.readouterr().out == ""  # no problem: no line, and no legend either


def test_a_baselines_label_is_its_method_alone():
    """method_label: "meshheal, or meshheal (variant, detector) where either differs"."""
    assert report.method_label({"method": "raps", "detector": runner.NO_DETECTOR, "variant": "x"}) == "raps"
    assert report.method_label({"method": "meshheal", "detector": "cusum"}) == "meshheal (cusum)"


def test_the_prefix_note_reads_each_share_and_is_left_out_with_no_prompt_tokens():
    s = {"requests": 1200, "prompt_tokens": 100000, "prefix_shared_tokens": 30000,
         "prefix_shared_share": 0.3, "cached_prompt_tokens": 5000, "cached_prompt_share": 0.05}  # fmt: skip
    note = report.prefix_note({"server_prefix": s})
    assert "(the 1,200 requests sent): of 100,000 prompt tokens" in note
    assert "30,000 (30.0%) were an n-request's shared prefill and 5,000 (5.0%) prefix-cache hits" in note
    assert report.prefix_note({"server_prefix": {**s, "prompt_tokens": 0}}) is None


def test_detection_text_without_a_delay_says_not_isolated():
    assert report.detection_text({"detection_delay": None}) == report.NOT_DETECTED


def test_state_changes_table_keeps_the_shown_dataset_and_pair():
    row = {"method": "meshheal", "seed": 0, "t": 5, "agent": 2, "from": "normal", "to": "isolated",
           "z": 2.0, "reason": "r", "probe": False, "degraded": True}  # fmt: skip
    frame = metrics.frame("states", [{**row, "dataset": "math", "pair": "default"},
                                     {**row, "dataset": "bbh", "pair": "default"},
                                     {**row, "dataset": "math", "pair": "A"}])  # fmt: skip
    assert report.state_changes_table(frame, 0, "math", "default")[1] == 1


def test_md_table_cells_keep_the_table_whole():
    """A cell's "|" and newline would break the markdown row: escaped and joined."""
    assert report.md_table(["a"], [["x|y\nz"]]).splitlines()[2] == "| x\\|y z |"


# ----------------------------------------------------------------------------------------------
# Scaling entries and table
# ----------------------------------------------------------------------------------------------


def test_scaling_entries_are_a_scale_runs_only():
    results = [{"n_agents": 6, "topology": "complete", "acc_healthy": 0.9}]
    assert report.scaling_entries({"experiment": "main", "results": results}) == []
    assert report.scaling_entries({"experiment": "scale", "results": results}) == results
    one = {"experiment": "scale", "n_agents": 96, "topology": "sparse", "results": [{"acc_healthy": 0.8}]}
    assert report.scaling_entries(one) == [{"n_agents": 96, "topology": "sparse", "acc_healthy": 0.8}]


def test_a_scale_summary_without_results_is_refused(tmp_path):
    with pytest.raises(MeshHealError, match="holds no scale results"):
        report.write_scale_report(tmp_path, {"experiment": "scale", "results": []})


def test_scaling_table_shows_plain_token_counts_in_thousands():
    table = report.scaling_table([{"n_agents": 6, "topology": "complete", "tokens_per_task_healthy": 2500}])
    assert table.splitlines()[2] == "| 6 | complete | 2.5 |"


# ----------------------------------------------------------------------------------------------
# Commands that reproduce the run
# ----------------------------------------------------------------------------------------------


def test_a_recovery_run_of_two_datasets_is_reproduced_per_dataset():
    exp = {"name": "recovery", "datasets": ["math", "bbh"], "pairs": ["default"], "seeds": [0],
           "n_tasks": 210}  # fmt: skip
    commands = report.reproduce_commands({"experiment": exp})
    assert len(commands) == 3
    assert "--dataset math --tasks 210" in commands[0] and "--dataset bbh --tasks 210" in commands[1]


def test_a_scale_arm_of_a_file_topology_passes_its_edges_file():
    exp = {"name": "scale", "n_agents": 12, "topology": "file", "edges_file": "/e/edges.csv"}
    assert report.reproduce_commands({"experiment": exp})[0].endswith("--edges /e/edges.csv")


def test_the_params_folder_is_passed_on():
    exp = {**MAIN, "params_dir": "/p/params", "profiles_dir": "/p/profiles"}
    command = report.reproduce_commands({"experiment": exp})[0]
    assert "--profiles-dir /p/profiles --params-dir /p/params" in command


def test_a_given_hub_revision_is_kept_over_the_commit_it_resolved_to():
    """_pinned: only a dataset read at no given revision is pinned to the recorded commit."""
    hub = {"math": {"hub_id": "m/math", "revision": "v1"}, "bbh": {"hub_id": "b/bbh"}}
    exp = {**MAIN, "backend": "live", "live": {"strong_urls": ["http://a/v1"], "weak_urls": ["http://b/v1"],
                                               "hub": hub}}  # fmt: skip
    inputs = {"questions math": {"commit": "aaa"}, "questions bbh": {"commit": "bbb"}}
    command = report.reproduce_commands({"experiment": exp, "inputs": inputs})[0]
    assert "--hub-revision math=v1 bbh=bbb" in command


def test_an_emulated_run_of_hub_questions_says_so():
    exp = {**MAIN, "live": {"strong_urls": [], "weak_urls": [], "data": "hub"}}
    assert "--data hub --datasets bbh" in report.reproduce_commands({"experiment": exp})[0]


def test_a_command_given_verbatim_gets_no_live_config_note():
    """Served names have no flag (a --live-config file sets them); a verbatim argv carries its own."""
    exp = {**MAIN, "name": "sweep", "live": {"strong_served_name": "gpt"}}
    commands = report.reproduce_commands({"experiment": exp, "argv": ["--live-config", "l.toml"]})
    assert commands[0] == "python -m meshheal_jax.sweep --live-config l.toml"


def test_config_json_reads_back_as_the_experiment_it_was_written_from():
    exp = runner.Experiment(name="main", datasets=("bbh", "math"), pairs=("default",), seeds=(0, 1),
                            backend="live", live=runner.LiveSettings(("http://a/v1",), ("http://b/v1",)),
                            profiles_dir=Path("/p"))  # fmt: skip
    back = report.experiment_from_config(json.loads(json.dumps(exp.to_json())))
    assert (back.datasets, back.seeds, back.degraded) == (("bbh", "math"), (0, 1), (2, 4))
    assert (back.live.strong_urls, back.live.weak_urls) == (("http://a/v1",), ("http://b/v1",))
    assert back.profiles_dir == Path("/p")


def test_config_json_of_a_scale_run_reads_back_whole():
    """A scale run's experiment has degraded=None (A3/A5 of every replica): it reads back (it raised
    a raw TypeError, so calibrate's twin check could not rebuild a scale run), equal to the one
    written, its lists tuples again."""
    exp = runner.Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=(0,), n_agents=96,
                            n_tasks=504 * 16, degraded=None, topology="sparse", methods=("meshheal",),
                            tables=("tasks", "reviews"))  # fmt: skip
    back = report.experiment_from_config(json.loads(json.dumps(exp.to_json())))
    assert back == exp
