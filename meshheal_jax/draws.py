"""Counter-based per-task random draws (spec/architecture.md "Randomness").

Every random number task t of a stream may consume comes from

    key_t = fold_in(fold_in(fold_in(PRNGKey(0), seed), dataset_id), t)      (t 1-based)

and never from the method, variant, grid point or anything threaded through a scan. Each named
field below is drawn from fold_in(key_t, field_id), so adding a field never shifts another.

Visit v = the task's `moves` count on arrival (entry pick = visit 0). Per visit there is one row
of routing uniforms and one block of per-call uniforms for the calls that visit can make.

Conventions (both engines): Bernoulli(p) is `u < p`; a uniform pick among n candidates listed
in increasing index is `min(floor(u * n), n - 1)`; a categorical over anchors is the first k with
`u < thresholds[k]` (thresholds precomputed in the parameter files, last = 1.0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

N_VISITS = 9  # moves <= 8, so visits 0..8

# Columns of TaskDraws.route (one row per visit).
HOP_ABILITY, HOP_TIE, PROBE, REVIEWER, COMMITTEE_A, COMMITTEE_B = range(6)
N_ROUTE = 6

# Call slots of TaskDraws.calls (per visit): the calls one Contribute/Finalize visit can make.
GENERATE = 0
REVIEW_SAMPLES = (1, 2, 3)
ROUND1 = (4, 5)  # committee A, B
ROUND2 = (6, 7)  # committee A, B
CANDIDATES = (8, 9)  # A, B
SYNTHESIS = 10
N_CALL_SLOTS = 11

# Columns of every call's uniforms.
U_MAIN = 0  # the call's outcome: correctness bit or score category
U_AUX = 1  # second decision: rescue / wrong-pair answer (generate), repeat (review), follow (round 2)
U_TOKENS = 2  # completion length
U_DISTRACTOR = 3  # which wrong answer a wrong final answer is
N_CALL_U = 4

# Columns of TaskDraws.infer.
INFER_CORRECT, INFER_WRONG_PAIR, INFER_TOKENS = range(3)
N_INFER = 3

_FIELD_ENTRY, _FIELD_INFER, _FIELD_ROUTE, _FIELD_CALLS = range(4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TaskDraws:
    """Uniforms in [0, 1), float64. Leading axes (streams, tasks) are added by batching."""

    entry: jax.Array  # () entry agent pick
    infer: jax.Array  # (N_INFER,) inference call
    route: jax.Array  # (N_VISITS, N_ROUTE) per-visit routing/reviewer choices
    calls: jax.Array  # (N_VISITS, N_CALL_SLOTS, N_CALL_U) per-visit emulator uniforms


def task_key(seed: int | jax.Array, dataset_id: int | jax.Array, t: int | jax.Array) -> jax.Array:
    key = jax.random.PRNGKey(0)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, seed), dataset_id), t)


def task_draws(seed, dataset_id, t) -> TaskDraws:
    """Every uniform task t (1-based) of stream (seed, dataset) may consume."""
    key = task_key(seed, dataset_id, t)

    def uniform(field: int, shape: tuple[int, ...]) -> jax.Array:
        return jax.random.uniform(jax.random.fold_in(key, field), shape, dtype=jnp.float64)

    return TaskDraws(
        entry=uniform(_FIELD_ENTRY, ()),
        infer=uniform(_FIELD_INFER, (N_INFER,)),
        route=uniform(_FIELD_ROUTE, (N_VISITS, N_ROUTE)),
        calls=uniform(_FIELD_CALLS, (N_VISITS, N_CALL_SLOTS, N_CALL_U)),
    )


@jax.jit
def _stream_draws(seed, dataset_id, ts):
    return jax.vmap(task_draws, in_axes=(None, None, 0))(seed, dataset_id, ts)


def stream_draws(seed: int, dataset_id: int, n_tasks: int) -> TaskDraws:
    """Draws of tasks 1..n_tasks as numpy arrays with a leading (n_tasks,) axis."""
    ts = jnp.arange(1, n_tasks + 1, dtype=jnp.int32)
    draws = _stream_draws(jnp.int32(seed), jnp.int32(dataset_id), ts)
    return jax.tree_util.tree_map(np.asarray, draws)


# ----------------------------------------------------------------------------------------------
# The conventions above as functions (the JAX engine and the baselines; the reference engine
# keeps its own plain-Python versions on purpose)
# ----------------------------------------------------------------------------------------------


def pick_index(u, n):
    """min(floor(u n), n - 1) as int32 (n >= 1)."""
    return jnp.minimum(jnp.floor(u * n).astype(jnp.int32), n - 1)


def pick_from_mask(u, mask):
    """The k-th True entry in increasing index, k = pick_index(u, count); -1 if none."""
    count = mask.sum()
    k = pick_index(u, jnp.maximum(count, 1))
    position = jnp.argmax(jnp.cumsum(mask) == k + 1)
    return jnp.where(count > 0, position, -1).astype(jnp.int32)


def categorical(u, thresholds):
    """The first k with u < thresholds[..., k] (elementwise over u's shape)."""
    u = jnp.asarray(u)
    return jnp.minimum(jnp.sum(u[..., None] >= thresholds, axis=-1), thresholds.shape[-1] - 1).astype(jnp.int32)

