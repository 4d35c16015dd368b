"""Question tokens from real questions (spec/emulator.md: "question tokens from the real questions
when a data dir is given (characters / 4 ...), else a per-dataset mean"; docs/decisions.md E7).

Tokens feed no decision, so a stream given per-task question tokens must make the same calls with
the same outcomes as the same stream at the profile's mean, every call's prompt larger by exactly
(its task's question tokens − the mean): each prompt shows the question once. Checked on both
MeshHeal engines (which must still agree exactly) and on every baseline.
"""

from __future__ import annotations

import dataclasses

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
    with pytest.raises(MeshHealError, match="backend is emulated.*only --data and --hub"):
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
