"""Counter-based per-task draws (spec/architecture.md "Randomness", docs/decisions.md D1)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ----------------------------------------------------------------------------------------------
# Lazy draws (the JAX engine): the same values, computed only where read
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (9, 11, 4), (2, 3, 4, 5)])
def test_uniforms_at_is_jax_random_uniform_element_by_element(shape):
    """Pins the partitionable-threefry identity the lazy draws rely on: a JAX release that changed
    how uniform hashes its counters (or turned `jax_threefry_partitionable` off) fails here."""
    key = jax.random.fold_in(D.task_key(5, 2, 99), 7)
    full = np.asarray(jax.random.uniform(key, shape, dtype=np.float64)).ravel()
    index = np.random.default_rng(len(shape)).permutation(full.size)
    np.testing.assert_array_equal(np.asarray(D.uniforms_at(key, index)), full[index])


def test_lazy_task_draws_are_task_draws_without_the_calls_block():
    ts = np.arange(1, 40, dtype=np.int32)
    full = jax.vmap(lambda t: D.task_draws(3, 1, t))(ts)
    lazy = jax.vmap(lambda t: D.lazy_task_draws(3, 1, t))(ts)
    for f in ("entry", "infer", "route"):
        np.testing.assert_array_equal(np.asarray(getattr(lazy, f)), np.asarray(getattr(full, f)), err_msg=f)
    assert lazy.calls_key.shape == (39, 2) and lazy.calls_key.dtype == np.uint32


@given(
    t=st.integers(1, 10**6),
    seed=st.integers(0, 2**31 - 1),
    dataset_id=st.integers(0, 9),
    visit=st.integers(0, D.N_VISITS - 1),
    rows=st.lists(st.integers(0, D.N_CALL_SLOTS - 1), min_size=1, max_size=4),
)
@settings(max_examples=40, deadline=None)
def test_call_rows_equal_the_calls_block(t, seed, dataset_id, visit, rows):
    full = np.asarray(D.task_draws(seed, dataset_id, t).calls)
    key = D.lazy_task_draws(seed, dataset_id, t).calls_key
    np.testing.assert_array_equal(np.asarray(D.call_rows(key, visit, np.array(rows))), full[visit, rows])


def test_call_rows_batched_under_jit():
    """(S,) slots, each its own task, visit and rows, as the engine's `emulate` asks."""
    rng = np.random.default_rng(1)
    ts = rng.integers(1, 5000, 16).astype(np.int32)
    visits = rng.integers(0, D.N_VISITS, 16).astype(np.int32)
    rows = rng.integers(0, D.N_CALL_SLOTS, (16, 3)).astype(np.int32)
    keys = jax.vmap(lambda t: D.lazy_task_draws(0, 2, t).calls_key)(ts)
    calls = np.asarray(jax.vmap(lambda t: D.task_draws(0, 2, t).calls)(ts))
    got = np.asarray(jax.jit(D.call_rows)(keys, visits, rows))
    np.testing.assert_array_equal(got, calls[np.arange(16)[:, None], visits[:, None], rows])


def test_call_rows_broadcast_batched_keys_against_one_visit_and_rows():
    ts = np.arange(1, 5, dtype=np.int32)
    keys = jax.vmap(lambda t: D.lazy_task_draws(0, 1, t).calls_key)(ts)
    calls = np.asarray(jax.vmap(lambda t: D.task_draws(0, 1, t).calls)(ts))
    got = np.asarray(D.call_rows(keys, 2, np.array([0, 3, 10])))
    np.testing.assert_array_equal(got, calls[:, 2, [0, 3, 10]])


def test_uniforms_at_refuses_without_x64():
    key = D.lazy_task_draws(0, 0, 1).calls_key
    with jax.enable_x64(False), pytest.raises(RuntimeError, match="jax_enable_x64"):
        D.uniforms_at(key, np.arange(4))
