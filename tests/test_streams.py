"""Task streams and health schedules (spec/experiments.md "Task streams", §1, §2)."""

from __future__ import annotations

import numpy as np
import pytest

from meshheal_jax import streams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.runner import Experiment
from meshheal_jax.streams import HealthSchedule, make_stream, persistent_schedule, recovery_schedule

MAIN_PHASES = ((1, 253), ("healthy", "degraded"))


def main_stream(seed: int = 0, dataset_id: int = 1, n_tasks: int = 504):
    phases = MAIN_PHASES if n_tasks == 504 else ((1,), ("all",))
    return make_stream(seed, dataset_id, n_tasks, 7, *phases)


# ----------------------------------------------------------------------------------------------
# Streams
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, dataset_id", [(0, 0), (3, 1), (11, 2)])
def test_every_block_of_42_is_balanced(seed, dataset_id):
    s = main_stream(seed, dataset_id)
    assert s.n_tasks == 504 and s.task_type.dtype == np.int32
    blocks = s.task_type.reshape(12, 42)
    for block in blocks:
        assert np.bincount(block, minlength=7).tolist() == [6] * 7
    # shuffled inside the block: the blocks are not all the same order and not sorted
    assert len({tuple(b) for b in blocks}) > 1
    assert not all((np.diff(b) >= 0).all() for b in blocks)


def test_question_ids_distinct_per_type_and_phases_disjoint():
    s = main_stream(seed=4)
    for ty in range(7):
        q = s.question[s.task_type == ty]
        assert q.tolist() == list(range(72))  # the k-th task of a type asks question k
    healthy = {(int(a), int(b)) for a, b, p in zip(s.task_type, s.question, s.phase) if p == 0}
    degraded = {(int(a), int(b)) for a, b, p in zip(s.task_type, s.question, s.phase) if p == 1}
    assert len(healthy) == len(degraded) == 252
    assert not healthy & degraded
    # same type mix in both phases
    assert np.bincount(s.task_type[:252], minlength=7).tolist() == [36] * 7
    assert np.bincount(s.task_type[252:], minlength=7).tolist() == [36] * 7


def test_same_seed_same_stream():
    a, b = main_stream(seed=7), main_stream(seed=7)
    assert np.array_equal(a.task_type, b.task_type)
    assert np.array_equal(a.question, b.question)
    assert np.array_equal(a.phase, b.phase)


def test_different_seed_or_dataset_different_order():
    base = main_stream(seed=0, dataset_id=1).task_type
    assert not np.array_equal(base, main_stream(seed=1, dataset_id=1).task_type)
    assert not np.array_equal(base, main_stream(seed=0, dataset_id=0).task_type)


def test_shorter_stream_is_a_prefix_of_longer():
    # one permutation per block from one generator: the first blocks do not depend on the length
    short, long = main_stream(seed=2, n_tasks=84), main_stream(seed=2, n_tasks=504)
    assert np.array_equal(short.task_type, long.task_type[:84])


def test_shuffle_follows_decision_d3():
    # D3: numpy default_rng([0x5EED, seed, dataset_id]), one permutation per 42-task block
    rng = np.random.default_rng([0x5EED, 5, 2])
    base = np.repeat(np.arange(7), 6)
    expected = np.concatenate([rng.permutation(base) for _ in range(2)])
    assert np.array_equal(main_stream(seed=5, dataset_id=2, n_tasks=84).task_type, expected)


def test_main_phases():
    exp = Experiment(name="main", datasets=("math",), pairs=("default",), seeds=(0,))
    starts, names = exp.phases()
    assert (starts, names) == ((1, 253), ("healthy", "degraded"))
    s = make_stream(0, 1, 504, 7, starts, names)
    assert s.phase_names == ("healthy", "degraded")
    assert (s.phase[:252] == 0).all() and (s.phase[252:] == 1).all()  # tasks 1..252 / 253..504


def test_recovery_phases():
    exp = Experiment(name="recovery", datasets=("math",), pairs=("default",), seeds=(0,), n_tasks=630)
    starts, names = exp.phases()
    assert starts == (1, 127, 253, 379, 505)
    assert names == streams.RECOVERY_PHASES and len(names) == 5
    s = make_stream(0, 1, 630, 7, starts, names)
    assert np.bincount(s.phase).tolist() == [126] * 5
    for k in range(5):  # five of 126
        assert (s.phase[126 * k : 126 * (k + 1)] == k).all()


@pytest.mark.parametrize("n_tasks", [0, 41, 43, 500, -42])
def test_stream_length_must_be_a_multiple_of_42(n_tasks):
    with pytest.raises(MeshHealError, match="multiple of 42"):
        make_stream(0, 0, n_tasks, 7, (1,), ("all",))


def test_negative_seed_rejected():
    with pytest.raises(MeshHealError, match="seeds must be >= 0"):
        make_stream(-1, 0, 42, 7, (1,), ("all",))


@pytest.mark.parametrize(
    "starts, names",
    [((2, 20), ("a", "b")), ((1, 20, 10), ("a", "b", "c")), ((1, 1), ("a", "b")), ((1, 43), ("a", "b")),
     ((1, 20), ("a",)), ((), ())],
)  # fmt: skip
def test_bad_phases_rejected(starts, names):
    with pytest.raises(MeshHealError):
        make_stream(0, 0, 42, 7, starts, names)


# ----------------------------------------------------------------------------------------------
# Health schedules
# ----------------------------------------------------------------------------------------------


def test_schedule_rejects_agent_outside_network():
    with pytest.raises(MeshHealError, match=r"degrades agent 6.*0\.\.5"):
        HealthSchedule(6, 84, ((6, 43, 85),))
    with pytest.raises(MeshHealError, match="degrades agent -1"):
        HealthSchedule(6, 84, ((-1, 43, 85),))


@pytest.mark.parametrize("start, end", [(0, 10), (10, 10), (20, 10), (43, 86), (85, 86)])
def test_schedule_rejects_bad_intervals(start, end):
    with pytest.raises(MeshHealError, match="outside tasks 1..84"):
        HealthSchedule(6, 84, ((2, start, end),))


def test_schedule_rejects_two_intervals_for_one_agent():
    with pytest.raises(MeshHealError, match="more than one interval"):
        HealthSchedule(6, 84, ((2, 1, 10), (2, 20, 30)))


def test_schedule_accepts_whole_stream():
    s = HealthSchedule(6, 84, ((0, 1, 85),))
    assert s.degraded_matrix()[1:, 0].all()


def test_degraded_matrix_agrees_with_is_degraded():
    s = HealthSchedule(6, 42, ((1, 5, 9), (3, 40, 43)))
    m = s.degraded_matrix()
    assert m.shape == (43, 6) and m.dtype == bool
    assert not m[0].any()  # row 0 unused
    for t in range(1, 43):
        for a in range(6):
            assert m[t, a] == s.is_degraded(a, t)
    assert m[:, 1].nonzero()[0].tolist() == [5, 6, 7, 8]  # start <= t < end
    assert m[:, 3].nonzero()[0].tolist() == [40, 41, 42]


def test_persistent_schedule_from_the_midpoint():
    s = persistent_schedule(6, 504, (2, 4))
    m = s.degraded_matrix()
    assert not m[252].any()
    assert m[253].tolist() == [False, False, True, False, True, False]
    assert m[504].tolist() == m[253].tolist()
    assert s.intervals == ((2, 253, 505), (4, 253, 505))


# spec/experiments.md §2: healthy; A5 degraded (127-252); A3 and A5 (253-378); A3 degraded,
# A5 restored (379-504); both restored (505-630). A3 = agent 2, A5 = agent 4.
RECOVERY_ROWS = {
    1: set(), 126: set(), 127: {4}, 252: {4}, 253: {2, 4}, 378: {2, 4}, 379: {2}, 504: {2},
    505: set(), 630: set(),
}  # fmt: skip


@pytest.mark.parametrize("t, degraded", sorted(RECOVERY_ROWS.items()))
def test_recovery_schedule_at_phase_boundaries(t, degraded):
    m = recovery_schedule(630).degraded_matrix()
    assert set(np.flatnonzero(m[t]).tolist()) == degraded


def test_recovery_schedule_counts():
    m = recovery_schedule(630).degraded_matrix()
    assert m.shape == (631, 6)
    assert m[:, 4].sum() == 252 and m[:, 2].sum() == 252
    assert m[:, [0, 1, 3, 5]].sum() == 0


def test_recovery_schedule_needs_five_phases():
    with pytest.raises(MeshHealError, match="5 phases"):
        recovery_schedule(632)
