"""Counter-based per-task draws (spec/architecture.md "Randomness", docs/decisions.md D1)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshheal_jax import draws as D

FIELDS = ("entry", "infer", "route", "calls")
SHAPES = {"entry": (), "infer": (3,), "route": (9, 6), "calls": (9, 11, 4)}


def as_numpy(td: D.TaskDraws) -> dict[str, np.ndarray]:
    return {f: np.asarray(getattr(td, f)) for f in FIELDS}


@pytest.fixture(scope="module")
def stream42() -> D.TaskDraws:
    return D.stream_draws(3, 1, 42)


def test_layout_constants_match_decisions():
    assert (D.N_VISITS, D.N_ROUTE, D.N_CALL_SLOTS, D.N_CALL_U, D.N_INFER) == (9, 6, 11, 4, 3)
    assert (D.HOP_ABILITY, D.HOP_TIE, D.PROBE, D.REVIEWER, D.COMMITTEE_A, D.COMMITTEE_B) == tuple(range(6))
    assert D.GENERATE == 0 and D.REVIEW_SAMPLES == (1, 2, 3)
    assert D.ROUND1 == (4, 5) and D.ROUND2 == (6, 7) and D.CANDIDATES == (8, 9) and D.SYNTHESIS == 10


def test_shapes_and_dtype():
    got = as_numpy(D.task_draws(0, 0, 1))
    for f in FIELDS:
        assert got[f].shape == SHAPES[f], f
        assert got[f].dtype == np.float64, f


@pytest.mark.parametrize("seed, dataset_id, t", [(0, 0, 1), (4, 2, 504), (123, 1, 77)])
def test_same_key_same_draws(seed, dataset_id, t):
    a, b = as_numpy(D.task_draws(seed, dataset_id, t)), as_numpy(D.task_draws(seed, dataset_id, t))
    for f in FIELDS:
        assert np.array_equal(a[f], b[f])


def test_all_uniforms_in_unit_interval(stream42):
    for f in FIELDS:
        values = np.asarray(getattr(stream42, f))
        assert values.min() >= 0.0 and values.max() < 1.0, f
    calls = np.asarray(stream42.calls).ravel()
    # roughly uniform: 42 * 396 values
    assert 0.48 < calls.mean() < 0.52
    assert abs((calls < 0.25).mean() - 0.25) < 0.01


@pytest.mark.parametrize("other", [(0, 0, 2), (1, 0, 1), (0, 1, 1)])
def test_different_t_seed_or_dataset_differ(other):
    base = as_numpy(D.task_draws(0, 0, 1))
    changed = as_numpy(D.task_draws(*other))
    for f in FIELDS:
        assert not np.any(base[f] == changed[f]), f  # no shared value anywhere


def test_fields_are_independent_of_each_other():
    got = as_numpy(D.task_draws(5, 1, 9))
    values = np.concatenate([got[f].ravel() for f in FIELDS])
    assert len(np.unique(values)) == values.size


def test_key_derivation_is_the_documented_one():
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), 7), 2), 13)
    assert np.array_equal(np.asarray(D.task_key(7, 2, 13)), np.asarray(key))


def test_stream_draws_shapes(stream42):
    for f in FIELDS:
        arr = getattr(stream42, f)
        assert isinstance(arr, np.ndarray)
        assert arr.shape == (42, *SHAPES[f])
        assert arr.dtype == np.float64


@pytest.mark.parametrize("k", [0, 1, 20, 41])
def test_stream_row_k_is_task_k_plus_one(stream42, k):
    single = as_numpy(D.task_draws(3, 1, k + 1))
    for f in FIELDS:
        assert np.array_equal(np.asarray(getattr(stream42, f))[k], single[f]), f


def test_stream_rows_do_not_depend_on_length(stream42):
    # counter-based: task t's draws are the same whatever the stream length
    longer = D.stream_draws(3, 1, 84)
    for f in FIELDS:
        assert np.array_equal(getattr(longer, f)[:42], getattr(stream42, f))
