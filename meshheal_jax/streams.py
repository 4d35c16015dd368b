"""Task streams and health schedules (spec/experiments.md "Task streams", §1, §2).

A stream is a sequence of tasks in balanced blocks of 42 (6 per task type, shuffled inside the
block), seeded by (seed, dataset id). Emulated questions are ids of a type: the k-th task of a
type asks question k of that type, so phases never share a question. Task indices t are 1-based.

Every emulated question has a latent difficulty bin (spec/emulator.md; docs/decisions.md E9): a
function of (seed, dataset id, task type, question id) only, so a question keeps its bin in any
stream length, method or experiment that asks it. The emulator reads its probabilities per bin.

An emulated run given a data dir (`--data`) reads the questions the ids pick (data.pick_questions,
as the live backend does) only for their token counts (`Stream.question_tokens`); without one, every
question counts the profile's mean (spec/emulator.md; docs/decisions.md E7).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from meshheal_jax.errors import MeshHealError

BLOCK_PER_TYPE = 6
STREAM_SALT = 0x5EED  # separates stream shuffling from the per-task draws (draws.py)
DIFFICULTY_SALT = 0xD1FF  # separates the questions' difficulty from the shuffling
DIFFICULTY_BINS = 8  # equal-probability bins of a standard normal difficulty (params.DIFFICULTY_Z)


@dataclasses.dataclass(frozen=True)
class Stream:
    seed: int
    dataset_id: int
    task_type: np.ndarray  # (N,) int32, task t = index t-1
    question: np.ndarray  # (N,) int32: question id within its type
    phase: np.ndarray  # (N,) int32: phase index of task t
    phase_names: tuple[str, ...]
    question_tokens: np.ndarray | None = None  # (N,) int32 tokens of task t's real question; None: the mean

    @property
    def n_tasks(self) -> int:
        return int(self.task_type.shape[0])

    def question_tokens_or(self, mean: int) -> np.ndarray:
        """(N,) int32: the tokens of every task's question, `mean` (the profile's) when the stream
        was given no real questions."""
        if self.question_tokens is None:
            return np.full(self.n_tasks, mean, dtype=np.int32)
        return np.asarray(self.question_tokens, dtype=np.int32)

    @functools.cached_property
    def difficulty(self) -> np.ndarray:
        """(N,) int32: the difficulty bin of task t's question (index t-1)."""
        return difficulty_bins(self.seed, self.dataset_id, self.task_type, self.question)


def difficulty_bins(seed: int, dataset_id: int, task_type: np.ndarray, question: np.ndarray) -> np.ndarray:
    """Question k of type ty gets floor(u_k * DIFFICULTY_BINS), u_k the k-th uniform of the
    generator seeded (DIFFICULTY_SALT, seed, dataset_id, ty); uniforms are drawn in order, so
    question k's bin does not depend on how many questions the stream asks."""
    task_type, question = np.asarray(task_type), np.asarray(question)
    out = np.zeros(task_type.shape, dtype=np.int32)
    for ty in np.unique(task_type):
        mine = task_type == ty
        u = np.random.default_rng([DIFFICULTY_SALT, seed, dataset_id, int(ty)]).random(
            int(question[mine].max()) + 1
        )
        out[mine] = np.minimum(np.floor(u[question[mine]] * DIFFICULTY_BINS), DIFFICULTY_BINS - 1)
    return out


def make_stream(
    seed: int,
    dataset_id: int,
    n_tasks: int,
    n_types: int,
    phase_starts: tuple[int, ...],
    phase_names: tuple[str, ...],
) -> Stream:
    """Balanced blocks of 6 tasks per type, shuffled within each block.

    phase_starts: 1-based first task of every phase (the first must be 1).
    """
    if n_types <= 0:
        raise MeshHealError(f"a stream needs at least one task type, got {n_types}")
    block = BLOCK_PER_TYPE * n_types
    if n_tasks <= 0 or n_tasks % block:
        raise MeshHealError(f"stream length must be a positive multiple of {block}, got {n_tasks}")
    if seed < 0:
        raise MeshHealError(f"seeds must be >= 0, got {seed}")
    if not phase_starts or phase_starts[0] != 1 or list(phase_starts) != sorted(set(phase_starts)):
        raise MeshHealError(f"phase starts must be increasing and start at task 1: {phase_starts}")
    if phase_starts[-1] > n_tasks or len(phase_names) != len(phase_starts):
        raise MeshHealError(f"phases {phase_starts} / {phase_names} do not fit {n_tasks} tasks")
    rng = np.random.default_rng([STREAM_SALT, seed, dataset_id])
    base = np.repeat(np.arange(n_types, dtype=np.int32), BLOCK_PER_TYPE)
    types = np.concatenate([rng.permutation(base) for _ in range(n_tasks // block)])
    question = np.zeros(n_tasks, dtype=np.int32)
    seen = np.zeros(n_types, dtype=np.int32)
    for i, ty in enumerate(types):
        question[i] = seen[ty]
        seen[ty] += 1
    t = np.arange(1, n_tasks + 1)
    phase = (np.searchsorted(np.asarray(phase_starts), t, side="right") - 1).astype(np.int32)
    return Stream(seed, dataset_id, types.astype(np.int32), question, phase, tuple(phase_names))


@dataclasses.dataclass(frozen=True)
class HealthSchedule:
    """Degradation intervals: agent a is degraded for start <= t < end (1-based tasks)."""

    n_agents: int
    n_tasks: int
    intervals: tuple[tuple[int, int, int], ...]  # (agent, start, end); end = n_tasks+1: never

    def __post_init__(self):
        per_agent: dict[int, int] = {}
        for agent, start, end in self.intervals:
            if not 0 <= agent < self.n_agents:
                raise MeshHealError(
                    f"schedule degrades agent {agent}, but the network has agents 0..{self.n_agents - 1}"
                )
            if not 1 <= start < end <= self.n_tasks + 1:
                raise MeshHealError(
                    f"schedule interval for agent {agent} [{start}, {end}) is outside tasks 1..{self.n_tasks}"
                )
            per_agent[agent] = per_agent.get(agent, 0) + 1
            if per_agent[agent] > 1:
                raise MeshHealError(f"schedule degrades agent {agent} in more than one interval")

    def degraded_matrix(self) -> np.ndarray:
        """(n_tasks + 1, n_agents) bool; row t says who is degraded during task t (row 0 unused)."""
        matrix = np.zeros((self.n_tasks + 1, self.n_agents), dtype=bool)
        for agent, start, end in self.intervals:
            matrix[start:end, agent] = True
        return matrix

    def ever_degraded(self) -> np.ndarray:
        """(n_agents,) bool: the agents degraded at some task."""
        mask = np.zeros(self.n_agents, dtype=bool)
        mask[[agent for agent, _, _ in self.intervals]] = True
        return mask

    def is_degraded(self, agent: int, t: int) -> bool:
        return any(a == agent and s <= t < e for a, s, e in self.intervals)


def persistent_schedule(n_agents: int, n_tasks: int, targets: tuple[int, ...]) -> HealthSchedule:
    """Targets degraded from the midpoint to the end (task 253 of 504)."""
    start = n_tasks // 2 + 1
    return HealthSchedule(n_agents, n_tasks, tuple((a, start, n_tasks + 1) for a in targets))


RECOVERY_PHASES = ("healthy", "A5 degraded", "A3+A5 degraded", "A3 degraded, A5 restored", "restored")


def recovery_schedule(n_tasks: int = 630, a3: int = 2, a5: int = 4) -> HealthSchedule:
    """Five phases of n/5: A5 degraded in phases 2-3, A3 in phases 3-4 (spec/experiments.md §2)."""
    if n_tasks <= 0 or n_tasks % 5:
        raise MeshHealError(
            f"recovery stream length must be a positive multiple of 5 (5 phases), got {n_tasks}"
        )
    p = n_tasks // 5
    return HealthSchedule(6, n_tasks, ((a5, p + 1, 3 * p + 1), (a3, 2 * p + 1, 4 * p + 1)))
