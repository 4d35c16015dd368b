"""Latent question difficulty (spec/emulator.md, docs/decisions.md E9): the bins, the model
files' two parameters, the neutral default, both engines agreeing exactly with it switched on,
and the baselines reading the same tables."""

from __future__ import annotations

import dataclasses
import itertools
import tomllib

import jax.numpy as jnp
import numpy as np
import polars as pl
import pytest
from test_engine import assert_equal_to_reference  # the differential check, record by record

from meshheal_jax import draws as D
from meshheal_jax import engine, metrics
from meshheal_jax.baselines import common as C
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import ANCHORS, DIFFICULTY_Z, Pair, dump_model, load_pair, parse_model
from meshheal_jax.streams import DIFFICULTY_BINS, difficulty_bins, make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

PAIR = load_pair("default")


def with_difficulty(pair: Pair, spread: float, tilt: float) -> Pair:
    def one(m):
        return dataclasses.replace(
            m, scalars={**m.scalars, "difficulty_spread": spread, "review_difficulty": tilt}
        )

    return Pair(pair.name, one(pair.strong), one(pair.weak))


HARD = with_difficulty(PAIR, 1.5, 2.0)
NEUTRAL = with_difficulty(PAIR, 0.0, 0.0)


def spec(dataset: str, seed: int, n_tasks: int, pair: Pair) -> engine.StreamSpec:
    profile = load_profile(dataset)
    network = build_network(profile)
    stream = make_stream(seed, profile.dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded"))
    schedule = persistent_schedule(6, n_tasks, network.degraded_targets)
    return engine.StreamSpec(network, stream, schedule, pair,
                             {"method": "meshheal", "dataset": dataset, "pair": "default", "seed": seed})  # fmt: skip


# -- the bins ------------------------------------------------------------------------------------


def test_a_question_keeps_its_bin_whatever_else_the_stream_asks():
    types = np.array([0, 0, 1, 0, 1], np.int32)
    questions = np.array([0, 1, 0, 2, 1], np.int32)
    bins = difficulty_bins(3, 1, types, questions)
    # question 2 of type 0 alone, and questions asked in another order: the same bins
    assert difficulty_bins(3, 1, np.array([0]), np.array([2]))[0] == bins[3]
    np.testing.assert_array_equal(difficulty_bins(3, 1, types[::-1], questions[::-1]), bins[::-1])
    # a longer stream of the same seed starts with the same tasks, so the same bins
    short, long = make_stream(3, 1, 84, 7, (1,), ("all",)), make_stream(3, 1, 504, 7, (1,), ("all",))
    np.testing.assert_array_equal(short.difficulty, long.difficulty[:84])


def test_bins_depend_on_seed_dataset_and_type_and_are_roughly_uniform():
    q = np.arange(4000, dtype=np.int32)
    zeros = np.zeros_like(q)
    base = difficulty_bins(0, 0, zeros, q)
    for other in (
        difficulty_bins(1, 0, zeros, q),
        difficulty_bins(0, 1, zeros, q),
        difficulty_bins(0, 0, zeros + 1, q),
    ):
        assert (other != base).mean() > 0.8  # independent bins agree 1/8 of the time
    share = np.bincount(base, minlength=DIFFICULTY_BINS) / q.size
    assert base.min() == 0 and base.max() == DIFFICULTY_BINS - 1
    assert np.all(np.abs(share - 1 / DIFFICULTY_BINS) < 0.03), share
    assert abs(np.mean(DIFFICULTY_Z)) < 1e-12 and DIFFICULTY_Z == tuple(sorted(DIFFICULTY_Z))


# -- the parameters ------------------------------------------------------------------------------


def test_neutral_default_leaves_every_probability_bit_for_bit():
    """Difficulty 0 (a file without it): every bin reads the file's own probabilities. (The shipped
    gpt-oss file has a review difficulty since 2026-12-06, so the neutral pair is built here.)"""
    profile = load_profile("math")
    assert (
        dataclasses.replace(PAIR.weak, scalars={**PAIR.weak.scalars, "difficulty_spread": 0.0}) == PAIR.weak
    )
    for m in (NEUTRAL.strong, NEUTRAL.weak):
        for row, base in zip(m.p_part_for(profile), m.p_part_base(profile)):
            assert row == (base,) * DIFFICULTY_BINS
        for key, probabilities in m.review.items():
            assert m.review_cumulative[key] == (m.thresholds(probabilities),) * DIFFICULTY_BINS


def test_harder_questions_lower_p_part_and_blur_reviews():
    profile = load_profile("bbh")
    for m in (HARD.strong, HARD.weak):
        for row, base in zip(m.p_part_for(profile), m.p_part_base(profile)):
            assert all(a > b for a, b in itertools.pairwise(row)), row  # bins in increasing difficulty
            assert row[0] > base > row[-1]
        for (role, correct), cumulative in m.review_cumulative.items():
            mean_score = [float(np.dot(np.diff(np.concatenate([[0.0], c])), ANCHORS)) for c in cumulative]
            steps = np.diff(mean_score)
            # a correct part scores lower, a wrong one higher, on a harder question
            assert np.all(steps < 0) if correct else np.all(steps > 0), (role, correct, mean_score)


def test_file_values_parse_validate_and_round_trip():
    text = dump_model(HARD.weak)
    doc = tomllib.loads(text)
    assert doc["difficulty_spread"] == 1.5 and doc["review_difficulty"] == 2.0
    again = parse_model(doc, "w", "w")
    assert again.p_part_for(load_profile("bbh")) == HARD.weak.p_part_for(load_profile("bbh"))
    del doc["difficulty_spread"]
    assert parse_model(doc, "w", "w").difficulty_spread == 0.0
    doc["review_difficulty"] = -0.5
    with pytest.raises(MeshHealError, match="review_difficulty must be a finite number >= 0"):
        parse_model(doc, "w", "file.toml")


# -- the engines ---------------------------------------------------------------------------------


def test_engines_agree_exactly_with_difficulty_on():
    """The differential backbone with both difficulty parameters switched on."""
    assert_equal_to_reference([spec("bbh", 0, 504, HARD), spec("math", 1, 504, HARD)])


def test_the_engine_reads_each_task_s_question_bin():
    """Strong-model parts on the easiest quarter of questions against the hardest quarter: far
    apart with difficulty on, close together without it."""

    def easy_minus_hard(pair: Pair) -> float:
        specs = [spec("mmlu_pro", s, 504, pair) for s in (0, 1)]
        easy, hard = [], []
        for sp, tables in zip(specs, engine.run_streams(specs, engine.ProtocolParams())):
            calls = tables["calls"]
            calls = calls if isinstance(calls, pl.DataFrame) else metrics.frame("calls", calls)
            gen = calls.filter((pl.col("kind") == "generate") & (pl.col("model") == pair.strong.model))
            bins = sp.stream.difficulty[gen["t"].to_numpy() - 1]
            ok = gen["correct"].to_numpy()
            easy.append(ok[bins < 2])
            hard.append(ok[bins >= DIFFICULTY_BINS - 2])
        return float(np.concatenate(easy).mean() - np.concatenate(hard).mean())

    assert easy_minus_hard(with_difficulty(PAIR, 2.5, 0.0)) > 0.25
    assert abs(easy_minus_hard(PAIR)) < 0.08


def test_baselines_read_the_same_tables_and_the_question_s_bin():
    profile = load_profile("bbh")
    network = build_network(profile)
    stream = make_stream(0, profile.dataset_id, 42, 7, (1,), ("all",))
    params = engine.make_params(engine.ProtocolParams(), HARD, profile, 6)
    emu = C.make_emu(HARD, profile)
    np.testing.assert_array_equal(emu.p_part, params.p_part)
    np.testing.assert_array_equal(emu.review_thr, params.review_thr)
    world = C.make_world(network, stream, persistent_schedule(6, 42, network.degraded_targets), 0)
    t_easy = int(np.argmin(stream.difficulty)) + 1
    t_hard = int(np.argmax(stream.difficulty)) + 1
    assert stream.difficulty[t_easy - 1] < stream.difficulty[t_hard - 1]
    holder = int(np.flatnonzero(network.holds[:, 0])[0])
    ty_e, ty_h = int(stream.task_type[t_easy - 1]), int(stream.task_type[t_hard - 1])
    p_easy = float(params.p_part[0, ty_e, stream.difficulty[t_easy - 1]])
    p_hard = float(params.p_part[0, ty_h, stream.difficulty[t_hard - 1]])
    u = jnp.zeros((D.N_CALL_U,), jnp.float64).at[D.U_MAIN].set((p_easy + p_hard) / 2)
    outcome = []
    for t, ty in ((t_easy, ty_e), (t_hard, ty_h)):
        gen, _ = C.emulate_generate(emu, world, t, ty, holder, 0, False, True, True, 0, u, 0)
        outcome.append(bool(gen.part_ok))
    assert p_easy > p_hard and outcome == [True, False]
