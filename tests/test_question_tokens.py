"""Question tokens from real questions (spec/emulator.md: "question tokens from the real questions
when a data dir is given (characters / 4 ...), else a per-dataset mean"; docs/decisions.md E7).

Tokens feed no decision, so a stream given per-task question tokens must make the same calls with
the same outcomes as the same stream at the profile's mean, every call's prompt larger by exactly
(its task's question tokens − the mean): each prompt shows the question once. Checked on both
MeshHeal engines (which must still agree exactly) and on every baseline.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import polars as pl
import pytest

from meshheal_jax import data, engine, metrics, prompts, reference, runner
from meshheal_jax.baselines import BaselineSpec, run_baseline_frames
from meshheal_jax.errors import MeshHealError

N_TASKS = 84
EXP = runner.Experiment("main", ("mmlu_pro",), ("default",), (0,), n_tasks=N_TASKS)
NETWORK, STREAM, PAIR, LABELS = runner._stream_inputs(EXP, "mmlu_pro", "default", 3)
MEAN = NETWORK.profile.question_tokens
TOKENS = np.random.default_rng(7).integers(1, 3 * MEAN, N_TASKS).astype(np.int32)
REAL = dataclasses.replace(STREAM, question_tokens=TOKENS)


def assert_only_the_question_differs(at_mean: pl.DataFrame, real: pl.DataFrame) -> None:
    """The two calls tables row for row: equal but for prompt tokens, which differ by the question's."""
    assert at_mean.height == real.height > 0
    others = [c for c in at_mean.columns if c != "prompt_tokens"]
    assert at_mean.select(others).equals(real.select(others))
    added = (real["prompt_tokens"] - at_mean["prompt_tokens"]).to_numpy()
    np.testing.assert_array_equal(added, TOKENS[real["t"].to_numpy() - 1] - MEAN)


def test_stream_without_real_questions_counts_the_mean():
    np.testing.assert_array_equal(STREAM.question_tokens_or(MEAN), np.full(N_TASKS, MEAN))
    np.testing.assert_array_equal(REAL.question_tokens_or(MEAN), TOKENS)


def test_meshheal_engines_agree_and_only_prompts_move():
    schedule = EXP.schedule()
    ref_mean = reference.run_stream(NETWORK, EXP.protocol, PAIR, STREAM, schedule, LABELS)
    ref_real = reference.run_stream(NETWORK, EXP.protocol, PAIR, REAL, schedule, LABELS)
    ref_mean, ref_real = (metrics.frame("calls", r.calls) for r in (ref_mean, ref_real))
    assert_only_the_question_differs(ref_mean, ref_real)
    specs = [engine.StreamSpec(NETWORK, s, schedule, PAIR, LABELS) for s in (STREAM, REAL)]
    jax_mean, jax_real = (out["calls"] for out in engine.run_streams(specs, EXP.protocol, slots=1))
    assert jax_real.select(ref_real.columns).equals(ref_real)  # the differential test, real tokens
    assert_only_the_question_differs(jax_mean, jax_real)


@pytest.mark.parametrize("method", ["agentnet", "raps", "autogen", "sac", "symphony"])
def test_baselines_only_prompts_move(method):
    schedule = EXP.schedule()
    specs = [BaselineSpec(NETWORK, s, schedule, dict(LABELS, method=method)) for s in (STREAM, REAL)]
    at_mean, real = (out["calls"] for out in run_baseline_frames(method, specs, PAIR))
    assert_only_the_question_differs(at_mean, real)


def test_tokens_are_the_shown_question_over_four():
    records = data.load_sample("mmlu_pro")[:5] + data.load_sample("bbh")[:5]
    got = np.concatenate(
        [data.question_tokens(records[:5], "mmlu_pro"), data.question_tokens(records[5:], "bbh")]
    )
    for record, dataset, tokens in zip(records, ["mmlu_pro"] * 5 + ["bbh"] * 5, got):
        shown = prompts.format_question(
            prompts.TaskText(dataset, record.question, record.task_type, record.options)
        )
        assert tokens == -(-len(shown) // 4)
    assert (got[:5] * 4 > np.array([len(r.question) for r in records[:5]]) + 8).all()  # options counted


def test_an_emulated_run_with_data_reads_the_questions_the_live_backend_would_ask():
    exp = dataclasses.replace(EXP, live=runner.LiveSettings((), (), data="sample"))
    exp.validate()
    with pytest.warns(data.QuestionPoolWarning):  # the sample holds fewer questions than 84 tasks ask
        _, stream, _, _ = runner._stream_inputs(exp, "mmlu_pro", "default", 3)
    profile = NETWORK.profile
    pool = data.question_pool(data.load_sample("mmlu_pro", profile), profile.task_types)
    pick = data.pick_questions(pool, STREAM.task_type, STREAM.question, 3, profile.dataset_id, warn=False)
    np.testing.assert_array_equal(stream.question_tokens, data.question_tokens(pick.records, "mmlu_pro"))
    assert len(set(stream.question_tokens.tolist())) > 5  # real lengths, not one mean


def test_an_emulated_run_takes_only_where_questions_come_from():
    served = dataclasses.replace(EXP, live=runner.LiveSettings(("http://x",), (), data="sample"))
    with pytest.raises(MeshHealError, match="backend is emulated.*only --data, --hub-\\* and --tokenizer"):
        served.validate()
    missing = dataclasses.replace(EXP, live=runner.LiveSettings((), (), data="/no/such/folder"))
    with pytest.raises(MeshHealError, match="--data must be hub, sample or an existing folder"):
        missing.validate()


def test_an_emulated_runs_questions_are_read_when_it_is_validated(tmp_path):
    """A malformed data file fails the run before it writes anything (validate reads the rows)."""
    (tmp_path / "mmlu_pro.jsonl").write_text('{"oops": 1}\n')
    broken = dataclasses.replace(EXP, live=runner.LiveSettings((), (), data=str(tmp_path)))
    with pytest.raises(MeshHealError, match=r"mmlu_pro.jsonl, row 1: missing field 'question'"):
        broken.validate()


def _main_flags(*args: str):
    import tyro

    from meshheal_jax import main

    return tyro.cli(main.MainConfig, args=list(args))


def test_the_cli_gives_an_emulated_run_only_where_its_questions_come_from():
    from meshheal_jax import cli

    assert cli.backend_fields(_main_flags("--data", "sample"))["live"] == runner.LiveSettings(
        (), (), data="sample"
    )
    assert cli.backend_fields(_main_flags())["live"] is None
    with pytest.raises(MeshHealError, match=r"given \(reasoning_effort\) but the backend is emulated"):
        cli.backend_fields(_main_flags("--reasoning-effort", "medium"))  # a default, given, is still given
    with pytest.raises(MeshHealError, match="without --data: add --data hub"):
        cli.backend_fields(_main_flags("--hub-id", "math=a/b"))


def test_a_sweep_refuses_data():
    import tyro

    from meshheal_jax import sweep

    with pytest.raises(MeshHealError, match="a sweep takes no --data"):
        sweep.experiment(tyro.cli(sweep.SweepConfig, args=["--grid", "alpha=1.0,1.2", "--data", "sample"]))
    with pytest.raises(MeshHealError, match="a sweep takes no --checkpoint-every"):
        sweep.experiment(
            tyro.cli(sweep.SweepConfig, args=["--grid", "alpha=1.0,1.2", "--checkpoint-every", "5"])
        )


def test_a_resume_refuses_other_question_files(tmp_path):
    """The questions' texts decide an emulated --data run's tokens: their digest is one of its inputs."""
    folder = tmp_path / "data"
    shutil.copytree(data.SAMPLE_DIR / "mmlu_pro", folder)
    exp = dataclasses.replace(EXP, live=runner.LiveSettings((), (), data=str(folder)))
    out = runner.prepare_run_dir(exp, tmp_path / "run")
    assert "questions mmlu_pro" in json.loads((out / "config.json").read_text())["inputs"]
    assert runner.prepare_run_dir(exp, out) == out  # the same files: resumes
    (file,) = [p for p in folder.rglob("*") if p.is_file() and p.suffix in data.DATA_SUFFIXES]
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    for row in rows:  # (some rows are of types the profile leaves out)
        row["question"] += " Answer with care."
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runner.read_questions.cache_clear()  # a new process would read the files again
    with pytest.raises(MeshHealError, match="other contents of questions mmlu_pro"):
        runner.prepare_run_dir(exp, out)


def test_a_folder_from_before_live_was_recorded_resumes(tmp_path):
    out = runner.prepare_run_dir(EXP, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    del config["experiment"]["live"]
    (out / "config.json").write_text(json.dumps(config))
    assert runner.prepare_run_dir(EXP, out) == out
    with pytest.raises(
        MeshHealError, match=r"different configuration \(live.data, live.reasoning_effort differ\)"
    ):
        runner.prepare_run_dir(dataclasses.replace(EXP, live=runner.LiveSettings((), (), data="sample")), out)


def test_a_live_run_reads_its_questions_when_validated_and_keeps_their_digest(tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(data.SAMPLE_DIR / "mmlu_pro", folder)
    live = runner.LiveSettings(("http://a/v1",), ("http://b/v1",), data=str(folder))
    exp = dataclasses.replace(EXP, backend="live", live=live)
    exp.validate()
    out = runner.prepare_run_dir(exp, tmp_path / "run")
    assert "questions mmlu_pro" in json.loads((out / "config.json").read_text())["inputs"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "mmlu_pro.jsonl").write_text('{"oops": 1}\n')
    with pytest.raises(MeshHealError, match="row 1: missing field 'question'"):
        dataclasses.replace(exp, live=dataclasses.replace(live, data=str(tmp_path / "bad"))).validate()


# --tokenizer: a real BPE tokenizer trained here on the packaged questions (no download)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from meshheal_jax.backends.tiny_server import train_bpe

    bpe = train_bpe((r.question for d in data.DATASETS for r in data.load_sample(d)), 300, ["<unk>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    bpe.save(str(path))
    return path


def test_a_tokenizer_counts_the_shown_question(tokenizer_file):
    from tokenizers import Tokenizer

    own = Tokenizer.from_file(str(tokenizer_file))
    records = data.load_sample("mmlu_pro")[:6]
    for spec in (str(tokenizer_file), str(tokenizer_file.parent)):  # the file, or a folder holding it
        got = data.question_tokens(records, "mmlu_pro", data.load_tokenizer(spec))
        shown = [prompts.format_question(prompts.TaskText("mmlu_pro", r.question, r.task_type, r.options))
                 for r in records]  # fmt: skip
        np.testing.assert_array_equal(got, [len(own.encode(t, add_special_tokens=False).ids) for t in shown])
    assert not np.array_equal(got, data.question_tokens(records, "mmlu_pro"))  # not characters / 4
    own.enable_padding(pad_id=0, pad_token="<unk>")  # a file that pads batches and cuts at 8 tokens
    own.enable_truncation(8)
    own.save(str(tokenizer_file.parent / "padded.json"))
    padded = data.load_tokenizer(str(tokenizer_file.parent / "padded.json"))
    np.testing.assert_array_equal(data.question_tokens(records, "mmlu_pro", padded), got)  # counts unchanged


def test_a_bad_tokenizer_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(MeshHealError, match="the folder holds no tokenizer.json"):
        data.load_tokenizer(str(tmp_path))
    (tmp_path / "broken.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(MeshHealError, match="broken.json: not a tokenizers JSON file"):
        data.load_tokenizer(str(tmp_path / "broken.json"))
    with pytest.raises(MeshHealError, match="no such file or folder"):
        data.load_tokenizer(str(tmp_path / "missing.json"))


def test_an_emulated_run_counts_its_questions_with_the_tokenizer(tokenizer_file, tmp_path):
    live = runner.LiveSettings((), (), data="sample", tokenizer=str(tokenizer_file))
    exp = dataclasses.replace(EXP, live=live)
    exp.validate()
    with pytest.warns(data.QuestionPoolWarning):
        _, stream, _, _ = runner._stream_inputs(exp, "mmlu_pro", "default", 3)
    profile = NETWORK.profile
    pool = data.question_pool(data.load_sample("mmlu_pro", profile), profile.task_types)
    pick = data.pick_questions(pool, STREAM.task_type, STREAM.question, 3, profile.dataset_id, warn=False)
    expected = data.question_tokens(pick.records, "mmlu_pro", data.load_tokenizer(str(tokenizer_file)))
    np.testing.assert_array_equal(stream.question_tokens, expected)
    out = runner.prepare_run_dir(exp, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    assert config["experiment"]["live"]["tokenizer"] == str(tokenizer_file)
    assert config["inputs"]["tokenizer"]["path"] == str(tokenizer_file)
    with pytest.raises(MeshHealError, match=r"different configuration \(live.tokenizer differ\)"):
        runner.prepare_run_dir(dataclasses.replace(EXP, live=runner.LiveSettings((), (), data="sample")), out)


def test_the_tokenizer_is_for_emulated_runs_with_data(tokenizer_file, monkeypatch):
    from meshheal_jax import cli

    flags = _main_flags("--data", "sample", "--tokenizer", str(tokenizer_file))
    assert cli.backend_fields(flags)["live"] == runner.LiveSettings(
        (), (), data="sample", tokenizer=str(tokenizer_file)
    )
    with pytest.raises(MeshHealError, match="--tokenizer given to an emulated run without --data"):
        cli.backend_fields(_main_flags("--tokenizer", str(tokenizer_file)))
    with monkeypatch.context() as m:  # a relative path is kept absolute: a resume from elsewhere finds it
        m.chdir(tokenizer_file.parent.parent)
        relative = f"{tokenizer_file.parent.name}/{tokenizer_file.name}"
        live = cli.backend_fields(_main_flags("--data", "sample", "--tokenizer", relative))["live"]
        assert live.tokenizer == str(tokenizer_file.resolve())
    live = runner.LiveSettings(
        ("http://a/v1",), ("http://b/v1",), data="sample", tokenizer=str(tokenizer_file)
    )
    with pytest.raises(MeshHealError, match="a live run's token counts are the servers' usage"):
        dataclasses.replace(EXP, backend="live", live=live).validate()
