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
from jax import lax

jax.config.update("jax_enable_x64", True)
# element i of uniform(key, shape) a function of (key, i) alone: the default from JAX 0.5, set here
# for older releases, since the JAX engine's lazy call draws rely on it (LazyTaskDraws, decisions D4)
jax.config.update("jax_threefry_partitionable", True)

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
    """Every uniform task t (1-based) of stream (seed, dataset) may consume: `lazy_task_draws` with
    its calls block drawn whole."""
    lazy = lazy_task_draws(seed, dataset_id, t)
    calls = jax.random.uniform(lazy.calls_key, (N_VISITS, N_CALL_SLOTS, N_CALL_U), dtype=jnp.float64)
    return TaskDraws(entry=lazy.entry, infer=lazy.infer, route=lazy.route, calls=calls)


# ----------------------------------------------------------------------------------------------
# The same uniforms, drawn when read (the JAX engine)
# ----------------------------------------------------------------------------------------------
# A task's `calls` block is 396 uniforms, of which a round reads at most 3 rows (12 values) and a
# task ~6 rounds' worth; hashing them all was a sixth to a quarter of a 576-agent round. With JAX's
# partitionable threefry (the default, `jax_threefry_partitionable`), element i of
# `uniform(key, shape)` is a function of (key, i) alone, so `uniforms_at` computes any element
# without the others, bit for bit (tests/test_draws.py pins this against jax.random.uniform).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LazyTaskDraws:
    """TaskDraws with `calls` not yet drawn: its key instead (`call_rows` draws the rows read)."""

    entry: jax.Array  # ()
    infer: jax.Array  # (N_INFER,)
    route: jax.Array  # (N_VISITS, N_ROUTE)
    calls_key: jax.Array  # (2,) uint32: fold_in(key_t, calls field), raw threefry key data


def lazy_task_draws(seed, dataset_id, t) -> LazyTaskDraws:
    """Task t's entry, infer and route uniforms, and the key its calls block is drawn from (each
    field from fold_in(key_t, field id))."""
    key = task_key(seed, dataset_id, t)

    def uniform(field: int, shape: tuple[int, ...]) -> jax.Array:
        return jax.random.uniform(jax.random.fold_in(key, field), shape, dtype=jnp.float64)

    return LazyTaskDraws(
        entry=uniform(_FIELD_ENTRY, ()),
        infer=uniform(_FIELD_INFER, (N_INFER,)),
        route=uniform(_FIELD_ROUTE, (N_VISITS, N_ROUTE)),
        calls_key=jax.random.fold_in(key, _FIELD_CALLS),
    )


_ONE_BITS = np.array(1.0, np.float64).view(np.uint64)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x1, x2):
    """Threefry-2x32 (20 rounds), the hash behind jax.random, written out straight: JAX lowers its
    primitive on CPU as a rolled 5-iteration loop, a few small ops per iteration, which cost more
    than the hashing itself for the ~10^3 counters a round draws; unrolled, XLA fuses it into one
    elementwise kernel. Same values (tests/test_draws.py pins `uniforms_at` against
    jax.random.uniform)."""
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r)))
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def uniforms_at(key, index):
    """`jax.random.uniform(key, shape, float64).ravel()[index]` for raw uint32 key data (..., 2)
    whose leading axes broadcast against index's, computed for the flat indices asked only
    (index < 2**32): the partitionable threefry hashes the counter (0, index), and uniform keeps
    the top 52 of the 64 bits as the mantissa of a float in [1, 2), minus 1."""
    if not jax.config.read("jax_enable_x64"):
        raise RuntimeError("draws.uniforms_at needs jax_enable_x64 (float64 uniforms); it was turned off")
    key = jnp.asarray(key)
    shape = jnp.broadcast_shapes(key.shape[:-1], jnp.shape(index))
    index = jnp.broadcast_to(jnp.asarray(index, jnp.uint32), shape)
    k1, k2 = (jnp.broadcast_to(key[..., i], shape) for i in (0, 1))
    hi, lo = _threefry2x32(k1, k2, jnp.zeros_like(index), index)
    bits = (hi.astype(jnp.uint64) << jnp.uint64(32)) | lo.astype(jnp.uint64)
    mantissa = (bits >> jnp.uint64(64 - 52)) | jnp.uint64(_ONE_BITS)
    return jnp.maximum(0.0, lax.bitcast_convert_type(mantissa, jnp.float64) - 1.0)


def call_rows(calls_key, visit, rows):
    """`task_draws(...).calls[visit, rows]` from the task's calls key: rows (..., R) call slots,
    keys (..., 2) and visits (...) broadcast against them; returns (..., R, N_CALL_U)."""
    rows = jnp.asarray(rows, jnp.int32)
    flat = (jnp.asarray(visit, jnp.int32)[..., None] * N_CALL_SLOTS + rows) * N_CALL_U
    index = flat[..., None] + jnp.arange(N_CALL_U, dtype=jnp.int32)
    return uniforms_at(jnp.asarray(calls_key)[..., None, None, :], index)


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
    return jnp.minimum(jnp.sum(u[..., None] >= thresholds, axis=-1), thresholds.shape[-1] - 1).astype(
        jnp.int32
    )
