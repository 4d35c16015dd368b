"""The JAX engine: the network and every in-flight task in arrays, advanced by jitted rounds.

One round = emit (the LLM calls every in-flight task needs now) -> backend -> absorb (apply the
responses: review decisions, detector evidence, routing until the next model call). Handoff,
RawRelay and probe redirection need no model call and run inside absorb in a bounded loop.
A round is a pure function; `run_rounds` scans it; streams are a vmap on the outside.

Implements spec/protocol.md and docs/decisions.md independently of reference.py; with slots = 1
the two must agree exactly (tests/test_engine.py, tests/test_variants.py). The MeshHeal variant
and the detector are static (EngineConfig.variant / .detector): one compiled program each.

Shapes: N agents, A abilities, T task types, P documented pairs, S slots, W windows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import jax
import jax.numpy as jnp
import numpy as np
import polars as pl

from meshheal_jax import draws as D
from meshheal_jax.checkpoints import Checkpoints
from meshheal_jax.config import ProtocolParams
from meshheal_jax.device import on_device, stack
from meshheal_jax.draws import categorical, pick_from_mask, pick_index
from meshheal_jax.errors import Cancelled, MeshHealError
from meshheal_jax.metrics import SCHEMAS
from meshheal_jax.params import ANCHORS, CALL_KINDS, JUDGED_RIGHT_ON_WRONG_DRAFT, Pair, threshold_table
from meshheal_jax.streams import HealthSchedule, Stream
from meshheal_jax.topology import Network

jax.config.update("jax_enable_x64", True)

INF = 2**30
NORMAL, WATCHED, ISOLATED = 0, 1, 2
STATE_NAMES = ("normal", "watched", "isolated")
STRONG, WEAK = 0, 1
ROLE_NAMES = ("strong", "weak")

# Task phases: what the slot needs next.
IDLE, INFER, GENERATE, REVIEW, ROUND1, ROUND2, CANDIDATES, SYNTH, FINISHED = range(9)
CALLS_PER_SLOT = 3
# Request kinds (index into params.CALL_KINDS).
K_INFER, K_GENERATE, K_REVIEW, K_COMMITTEE1, K_COMMITTEE2, K_CANDIDATE, K_SYNTHESIS = range(7)
# Actions recorded per task.
ACTION_NAMES = ("rawrelay", "infer", "relay", "probe", "handoff", "contribute", "finalize")
A_RAWRELAY, A_INFER, A_RELAY, A_PROBE, A_HANDOFF, A_CONTRIBUTE, A_FINALIZE = range(7)
MAX_ACTIONS = 24
MAX_ROUTE = 10
END_NAMES = ("", "move budget", "unreachable ability", "no non-isolated agent reachable")
REASON_NAMES = (
    "",
    # relative, absolute
    "z>=alpha",
    "consecutive z>=beta",
    "z<alpha",
    "probe z<beta",
    # cusum
    "S>=h/2",
    "S>=h",
    "S<h/2",
    "probe S<h",
)


def pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def static(cls):
    return dataclasses.dataclass(frozen=True)(cls)


# ----------------------------------------------------------------------------------------------
# Configuration: static shapes, traced parameters, per-stream constants
# ----------------------------------------------------------------------------------------------


@static
class EngineConfig:
    n_agents: int
    n_abilities: int
    n_types: int
    n_tasks: int
    slots: int = 1
    window_scores: int = 8
    window_shortfalls: int = 8
    route_loop: int = 12  # bound on moves handled inside one absorb (move_limit + 4)
    variant: str = "full"  # full | single_reviewer | no_takeover (config.VARIANTS): static, one program each
    detector: str = "relative"  # relative | absolute | cusum (config.DETECTORS): static, one program each
    convergence: str = "instant"  # instant | hop_per_task (config.CONVERGENCE): static, one program each
    window_reset: str = "never"  # never | on_isolation | on_release (config.WINDOW_RESET): static


@pytree
class Params:
    """Traced: protocol thresholds and the emulator's pair (index 0 strong, 1 weak)."""

    alpha: jax.Array
    beta: jax.Array
    consecutive: jax.Array
    tau_to: jax.Array
    sigma_com: jax.Array
    min_obs: jax.Array
    min_matched: jax.Array
    z_floor: jax.Array
    probe_interval: jax.Array
    warmup: jax.Array
    route_limit: jax.Array
    tie_scale: jax.Array  # 1.0: next-hop ties by the tie draw; 0.0: the lowest index (next_hop_ties)
    move_limit: jax.Array
    tol: jax.Array
    abs_threshold: jax.Array  # absolute detector
    abs_scale: jax.Array
    cusum_target: jax.Array  # cusum detector
    cusum_k: jax.Array
    cusum_h: jax.Array
    p_infer: jax.Array  # (2,)
    p_part: jax.Array  # (2, T, DIFFICULTY_BINS)
    p_rescue: jax.Array  # (2,)
    rho_same: jax.Array  # (2,)
    p_follow: jax.Array  # (2,)
    p_fix: jax.Array  # (2,)
    p_keep: jax.Array  # (2,)
    answer_fraction: jax.Array  # (2,)
    # (2 reviewer, 2 author role, 3 judged classes (params.JUDGED_*), DIFFICULTY_BINS, 4)
    review_thr: jax.Array
    round2_thr: jax.Array  # (2, 2, 3, DIFFICULTY_BINS, 4)
    distractor_thr: jax.Array  # (2, n_distractors)
    completion: jax.Array  # (2, 7 kinds, 2 [min, max]) int
    prompt: jax.Array  # (2, 7 kinds) int


@pytree
class World:
    """Per-stream constants. `degraded_from/until` are read only by the backend."""

    holds: jax.Array  # (N, A) bool
    nbr: jax.Array  # (N, K) int32 neighbours in increasing index, -1 padding
    task_type: jax.Array  # (n_tasks,) int
    difficulty: jax.Array  # (n_tasks,) int32: the difficulty bin of each task's question [backend only]
    question_tokens: jax.Array  # (n_tasks,) int32: tokens of each task's question [backend only]
    true_pair: jax.Array  # (T,) int: documented pair of each type
    pair_abilities: jax.Array  # (P, A) bool, P padded to the number of task types
    pair_valid: jax.Array  # (P,) bool: a documented pair (not padding)
    degraded_from: jax.Array  # (N,) int32 first degraded task (0 = never)  [backend only]
    degraded_until: jax.Array  # (N,) int32 first task healthy again  [backend only]
    seed: jax.Array  # () int32: per-task draws come from (seed, dataset_id, t)
    dataset_id: jax.Array  # () int32


def make_params(protocol: ProtocolParams, pair: Pair, profile, n_agents: int) -> Params:
    f = functools.partial(on_device, dtype=np.float64)
    i = functools.partial(on_device, dtype=np.int32)
    models = (pair.strong, pair.weak)

    if pair.strong.n_distractors != pair.weak.n_distractors:
        raise MeshHealError("both models of a pair must have the same n_distractors")
    return Params(
        alpha=f(protocol.alpha), beta=f(protocol.beta), consecutive=i(protocol.consecutive_to_isolate),
        tau_to=f(protocol.tau_to), sigma_com=f(protocol.sigma_com), min_obs=i(protocol.min_observations),
        min_matched=i(protocol.min_matched),
        z_floor=f(protocol.z_scale_floor), probe_interval=i(protocol.probe_interval),
        warmup=i(protocol.warmup_tasks(n_agents)), route_limit=i(protocol.route_limit),
        move_limit=i(protocol.move_limit), tol=f(protocol.threshold_tol),
        tie_scale=f(1.0 if protocol.next_hop_ties == "random" else 0.0),
        abs_threshold=f(protocol.absolute_threshold), abs_scale=f(protocol.absolute_scale),
        cusum_target=f(protocol.cusum_target), cusum_k=f(protocol.cusum_k), cusum_h=f(protocol.cusum_h),
        p_infer=f([m.p_infer for m in models]), p_part=f([m.p_part_for(profile) for m in models]),
        p_rescue=f([m.p_rescue for m in models]), rho_same=f([m.rho_same for m in models]),
        p_follow=f([m.p_follow for m in models]), p_fix=f([m.p_fix for m in models]),
        p_keep=f([m.p_keep for m in models]), answer_fraction=f([m.answer_fraction for m in models]),
        review_thr=f(threshold_table(pair, "review")), round2_thr=f(threshold_table(pair, "round2")),
        distractor_thr=f([m.distractor_thresholds() for m in models]),
        completion=i([[m.completion_tokens[k] for k in CALL_KINDS] for m in models]),
        prompt=i([[m.prompt_tokens[k] for k in CALL_KINDS] for m in models]),
    )  # fmt: skip


def make_world(network: Network, stream: Stream, schedule: HealthSchedule, k_max: int | None = None) -> World:
    """k_max pads the neighbour table (streams batched together need one width)."""
    profile = network.profile
    pairs = profile.pairs
    n_types = len(profile.task_types)
    pair_abilities = np.zeros((n_types, len(profile.abilities)), dtype=bool)
    for k, pair in enumerate(pairs):
        pair_abilities[k, list(pair)] = True
    table = network.neighbour_table
    if k_max is not None:
        table = np.pad(table, ((0, 0), (0, k_max - table.shape[1])), constant_values=-1)
    start = np.zeros(network.n_agents, np.int32)
    until = np.zeros(network.n_agents, np.int32)
    for agent, first, end in schedule.intervals:
        start[agent], until[agent] = first, end
    i = functools.partial(on_device, dtype=np.int32)
    return World(
        holds=on_device(network.holds, bool), nbr=i(table), task_type=i(stream.task_type), difficulty=i(stream.difficulty),
        question_tokens=i(stream.question_tokens_or(profile.question_tokens)),
        true_pair=i([profile.pair_index(ty) for ty in range(len(profile.task_types))]),
        pair_abilities=on_device(pair_abilities, bool), pair_valid=on_device(np.arange(n_types) < len(pairs), bool),
        degraded_from=i(start), degraded_until=i(until), seed=i(stream.seed), dataset_id=i(stream.dataset_id),
    )  # fmt: skip


def is_degraded(world: World, agent, t):
    """Backend only: the health schedule (one interval per agent)."""
    return (world.degraded_from[agent] <= t) & (t < world.degraded_until[agent])


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


@pytree
class Net:
    state: jax.Array  # (N,) int32 NORMAL/WATCHED/ISOLATED
    consecutive: jax.Array  # (N,) int32
    probe_timer: jax.Array  # (N,) int32
    distance: jax.Array  # (N, A + 1) int32; column A = nearest non-isolated agent
    scores: jax.Array  # (N, T, A, W) float64 ring buffers
    score_count: jax.Array  # (N, T, A) int32 pushes so far
    shortfalls: jax.Array  # (N, T, A, W) float64
    shortfall_count: jax.Array  # (N, T, A) int32 (= lifetime n_x)
    cusum: jax.Array  # (N, T, A) float64 CUSUM statistic S (detector "cusum"; shape (0,) otherwise)
    # window_mean of each window as last written, kept next to it (`write_rows` writes both): an
    # observation reads each peer's mean, not its window (K values, not K x W and K x A x W)
    score_mean: jax.Array  # (N, T, A) float64
    shortfall_mean: jax.Array  # (N, T, A) float64


@pytree
class Slots:
    """In-flight tasks, leading axis (S,). Controller-visible only."""

    t: jax.Array  # task index (1-based), 0 = none
    phase: jax.Array
    agent: jax.Array
    entry: jax.Array
    moves: jax.Array
    since: jax.Array  # moves since the last output
    probe_visit: jax.Array  # bool
    pair: jax.Array  # inferred pair
    covered: jax.Array  # (S, A) bool
    ability: jax.Array  # the held ability of the current output
    finalize: jax.Array  # bool
    reviewer: jax.Array
    member_a: jax.Array
    member_b: jax.Array
    samples: jax.Array  # (S, 3) float64
    q0: jax.Array
    s_u: jax.Array
    committee: jax.Array  # bool
    round1: jax.Array  # (S, 2) float64
    round2: jax.Array  # (S, 2) float64
    q: jax.Array
    answer_id: jax.Array  # answer id returned with the final answer (controller's view)
    answered: jax.Array  # bool
    end: jax.Array  # END_NAMES index
    route: jax.Array  # (S, MAX_ROUTE) int32
    route_len: jax.Array
    actions: jax.Array  # (S, MAX_ACTIONS) int32
    n_actions: jax.Array
    calls: jax.Array
    prompt_tokens: jax.Array
    completion_tokens: jax.Array
    unreviewed: jax.Array


@pytree
class Backend:
    """The emulator's own per-slot latent state (never read by the controller)."""

    pair_ok: jax.Array  # (S,) bool
    part_ok: jax.Array
    part_role: jax.Array
    part_tokens: jax.Array
    answer_ok: jax.Array
    answer_tokens: jax.Array
    draft_ok: jax.Array
    draft_tokens: jax.Array
    explanation_tokens: jax.Array  # round-1 explanations, summed
    candidate_tokens: jax.Array  # candidates, summed
    result_ok: jax.Array  # correctness of the output the task keeps (after Takeover)
    result_tokens: jax.Array
    pending: jax.Array  # a Contribute's kept output not yet folded into the draft


def fresh_backend_slot() -> Backend:
    """One slot's backend state at the start of a task."""
    return at(initial_backend(1), 0)


def initial_net(cfg: EngineConfig, world: World) -> Net:
    n, a, t, w = cfg.n_agents, cfg.n_abilities, cfg.n_types, cfg.window_scores
    state = jnp.zeros(n, jnp.int32)
    return Net(
        state=state, consecutive=jnp.zeros(n, jnp.int32), probe_timer=jnp.zeros(n, jnp.int32),
        distance=distance_tables(world.holds, world.nbr, state),
        scores=jnp.zeros((n, t, a, w)), score_count=jnp.zeros((n, t, a), jnp.int32),
        shortfalls=jnp.zeros((n, t, a, cfg.window_shortfalls)), shortfall_count=jnp.zeros((n, t, a), jnp.int32),
        cusum=jnp.zeros((n, t, a) if cfg.detector == "cusum" else (0,)),
        score_mean=jnp.zeros((n, t, a)), shortfall_mean=jnp.zeros((n, t, a)),
    )  # fmt: skip


def initial_slots(cfg: EngineConfig) -> Slots:
    s = cfg.slots
    zi = jnp.zeros(s, jnp.int32)
    zb = jnp.zeros(s, bool)
    zf = jnp.zeros(s, jnp.float64)
    return Slots(
        t=zi, phase=zi, agent=zi, entry=zi, moves=zi, since=zi, probe_visit=zb, pair=zi,
        covered=jnp.zeros((s, cfg.n_abilities), bool), ability=zi, finalize=zb, reviewer=zi,
        member_a=zi, member_b=zi, samples=jnp.zeros((s, 3)), q0=zf, s_u=zf, committee=zb,
        round1=jnp.zeros((s, 2)), round2=jnp.zeros((s, 2)), q=zf, answer_id=zi, answered=zb, end=zi,
        route=jnp.full((s, MAX_ROUTE), -1, jnp.int32), route_len=zi,
        actions=jnp.full((s, MAX_ACTIONS), -1, jnp.int32), n_actions=zi, calls=zi, prompt_tokens=zi,
        completion_tokens=zi, unreviewed=zi,
    )  # fmt: skip


def initial_backend(n_slots: int) -> Backend:
    zi = jnp.zeros(n_slots, jnp.int32)
    zb = jnp.zeros(n_slots, bool)
    return Backend(pair_ok=zb, part_ok=zb, part_role=zi, part_tokens=zi, answer_ok=zb, answer_tokens=zi,
                   draft_ok=jnp.ones(n_slots, bool), draft_tokens=zi, explanation_tokens=zi,
                   candidate_tokens=zi, result_ok=zb, result_tokens=zi, pending=zb)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Small pure helpers
# ----------------------------------------------------------------------------------------------


def _providers(holds, state):
    """(N, A + 1): eligible providers of each ability (held, not isolated); column A: not isolated."""
    active = state != ISOLATED
    return jnp.concatenate([holds & active[:, None], active[:, None]], axis=1)


def relax_tables(holds, nbr, state, dist):
    """One synchronous Bellman-Ford step over the padded neighbour table: an eligible provider is
    at 0, any other agent at 1 + its neighbours' nearest in `dist`; N or more hops is INF."""
    through = jnp.where((nbr >= 0)[:, :, None], dist[jnp.maximum(nbr, 0)], INF).min(axis=1) + 1
    through = jnp.where(through < state.shape[0], through, INF)
    return jnp.where(_providers(holds, state), 0, through).astype(jnp.int32)


def relax_steps(holds, nbr, state, dist, max_steps):
    """At most `max_steps` relax_tables steps from `dist`, ending early at the converged tables
    (which relax to themselves)."""

    def body(carry):
        k, dist, _ = carry
        new = relax_tables(holds, nbr, state, dist)
        return k + 1, new, jnp.any(new != dist)

    def more(carry):
        k, _, changed = carry
        return (k < max_steps) & changed

    return jax.lax.while_loop(more, body, (jnp.int32(0), dist, jnp.bool_(True)))[1]


def distance_tables(holds, nbr, state):
    """(N, A + 1) hop distances to the nearest eligible provider (column A: the nearest
    non-isolated agent): Bellman-Ford to convergence, from the providers alone."""
    return relax_steps(holds, nbr, state, jnp.where(_providers(holds, state), 0, INF).astype(jnp.int32), INF)


def relax_for_tasks(world: World, net: Net, n_tasks) -> Net:
    """One relaxation step per task starting ("hop_per_task" convergence, decisions P6)."""
    return dataclasses.replace(
        net, distance=relax_steps(world.holds, world.nbr, net.state, net.distance, n_tasks)
    )


STREAMS = "streams"  # the vmapped stream axis


def _over_streams(collective, x):
    """collective(x) over the stream batch (unbatched), or x when not under the stream vmap."""
    try:
        return collective(x, STREAMS)
    except NameError:
        return x


def across_streams(flag):
    """True when `flag` holds in any stream of the batch: a predicate that stays unbatched, so a
    lax.cond on it skips its branch for the whole batch (a batched predicate would run both).
    (psum, not pmax: measured 1 ms faster per 576-agent round.)"""
    return _over_streams(jax.lax.psum, flag.astype(jnp.int32)) > 0


def neighbours_of(world: World, i):
    """(K,) agent ids of i's neighbours (-1 padding), (K,) valid mask, (K,) ids safe to gather."""
    nb = world.nbr[i]
    return nb, nb >= 0, jnp.maximum(nb, 0)


def pick_neighbour(u, nb, mask):
    """pick_from_mask over a neighbour row; returns the agent id (-1 if none)."""
    k = pick_from_mask(u, mask)
    return jnp.where(k >= 0, nb[jnp.maximum(k, 0)], -1).astype(jnp.int32)


def window_mean(data, count):
    """Mean of a ring buffer's filled slots, summed in slot order."""
    w = data.shape[-1]
    filled = jnp.minimum(count, w)
    mask = jnp.arange(w) < filled[..., None]
    return jnp.sum(jnp.where(mask, data, 0.0), axis=-1) / jnp.maximum(filled, 1)


_NOT_SIGN = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def sort_floats(x):
    """jnp.sort(x) along the last axis for float64 x without NaN, as a sort of int64 keys: a
    float's bits, with a negative float's bits below the sign flipped, order like the floats
    (IEEE 754 total order). XLA's CPU sort runs a plain integer sort on them; on floats it calls
    JAX's comparator (a NaN- and zero-aware compare) for every comparison, ~6x slower on the
    detector's (slots, 42) peer pools. The same values come out (equal keys are equal bits),
    except that -0.0 sorts before +0.0 where jnp.sort keeps their order; no pool value can be
    -0.0 (means of shortfalls reference - q, with q and every peer mean >= +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int64)
    keys = jax.lax.sort(jnp.where(bits < 0, bits ^ _NOT_SIGN, bits), dimension=x.ndim - 1, is_stable=False)
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ _NOT_SIGN, keys), jnp.float64)


def quantile_sorted(sorted_values, n, q):
    pos = q * (n - 1).astype(jnp.float64)
    lo_i = jnp.floor(pos).astype(jnp.int32)
    hi_i = jnp.ceil(pos).astype(jnp.int32)
    lo, hi = sorted_values[lo_i], sorted_values[hi_i]
    return lo + (hi - lo) * (pos - jnp.floor(pos))


def median_of_3(x):
    """sort(x)[1] for a (3,) x, without a sort (exact)."""
    return jnp.maximum(jnp.minimum(x[0], x[1]), jnp.minimum(jnp.maximum(x[0], x[1]), x[2]))


ROUTE = 9  # internal phase: at an agent, deciding what to do (no model call yet)


def at(tree, i):
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def where_tree(pred, a, b):
    """jnp.where(pred, a, b) over two pytrees of one structure. A leaf that is the same object in
    both (a field neither side changed) passes through untraced: a slot has ~60 fields and a
    branch changes a few, so this keeps the traced program (and its compile time) small."""
    return jax.tree_util.tree_map(lambda x, y: x if x is y else jnp.where(pred, x, y), a, b)


def select_phase(phase, base, table: dict):
    """table[phase] if phase is one of its keys, else base, field by field: each candidate
    contributes a select only for the fields it changed (same rule as where_tree)."""
    flat, treedef = jax.tree_util.tree_flatten(base)
    out = list(flat)
    for key, candidate in table.items():
        for k, (leaf, original) in enumerate(zip(treedef.flatten_up_to(candidate), flat)):
            if leaf is not original:
                out[k] = jnp.where(phase == key, leaf, out[k])
    return treedef.unflatten(out)


def set_at(x, k, value):
    """x.at[k].set(value) along a short last axis, for k >= 0 (one past the end or beyond: x),
    as a select against the positions: under vmap (a slot's, an observation's own index) the
    indexed write is a scatter, a kernel of its own that XLA also copies its operand for; the
    select fuses with its neighbours."""
    return jnp.where(jnp.arange(x.shape[-1]) == k, jnp.asarray(value, x.dtype), x)


def put(tree, i, one):
    return jax.tree_util.tree_map(lambda x, y: x.at[i].set(jnp.asarray(y).astype(x.dtype)), tree, one)


def gt_tol(x, threshold, tol):
    """x >= threshold with the tolerance in favour of crossing."""
    return x >= threshold - tol


def le_tol(x, threshold, tol):
    return x <= threshold + tol


# ----------------------------------------------------------------------------------------------
# Detector (spec/protocol.md §5)
# ----------------------------------------------------------------------------------------------


@pytree
class Observation:
    z: jax.Array  # float64 (0 where undefined)
    z_defined: jax.Array  # bool
    before: jax.Array
    after: jax.Array
    reason: jax.Array  # REASON_NAMES index


def next_state(p: Params, state, consecutive, z):
    crossed_beta = gt_tol(z, p.beta, p.tol)
    crossed_alpha = gt_tol(z, p.alpha, p.tol)
    consecutive = jnp.where(crossed_beta, consecutive + 1, 0)
    to_isolated = (state != ISOLATED) & (consecutive >= p.consecutive)
    new = jnp.where(to_isolated, ISOLATED,
          jnp.where((state == NORMAL) & crossed_alpha, WATCHED,
          jnp.where((state == WATCHED) & ~crossed_alpha, NORMAL,
          jnp.where((state == ISOLATED) & ~crossed_beta, WATCHED, state))))  # fmt: skip
    reason = jnp.where(to_isolated, 2,
             jnp.where((state == NORMAL) & crossed_alpha, 1,
             jnp.where((state == WATCHED) & ~crossed_alpha, 3,
             jnp.where((state == ISOLATED) & ~crossed_beta, 4, 0))))  # fmt: skip
    consecutive = jnp.where(to_isolated, 0, consecutive)
    return new.astype(jnp.int32), consecutive.astype(jnp.int32), reason.astype(jnp.int32)


@pytree
class Rows:
    """What one observation writes: author i's windows at (task_type, s) and its detector state.
    The detector is split into a pure read (`observe_rows`) and a write (`write_rows`) so that
    observations that touch disjoint rows can be computed together (`observe_round`)."""

    scores: jax.Array  # (W,) i's score window of (task_type, s)
    score_count: jax.Array  # ()
    shortfalls: jax.Array  # (Ws,)
    shortfall_count: jax.Array  # ()
    score_mean: jax.Array  # () window_mean(scores, score_count)
    shortfall_mean: jax.Array  # () window_mean(shortfalls, shortfall_count)
    cusum: jax.Array  # () CUSUM statistic (0 and not written unless the detector is cusum)
    state: jax.Array  # ()
    consecutive: jax.Array  # ()
    probe_timer: jax.Array  # ()


def observe(p: Params, world: World, net: Net, i, task_type, s, q, t, evidence,
            detector: str = "relative", reset: str = "never", probe=True) -> tuple[Net, Observation]:  # fmt: skip
    """Record author i's final score q with the (static) detector; see observe_relative. `reset`
    (static; config.WINDOW_RESET): when an author loses its evidence (`clear_evidence`). `probe`:
    whether the output was a recovery probe's (only those move an isolated author, `_decide`)."""
    rows, obs = observe_rows(p, world, net, i, task_type, s, q, t, evidence, detector, probe)
    return reset_evidence(reset, write_rows(net, i, task_type, s, rows), i, obs), obs


def reset_evidence(reset: str, net: Net, authors, obs: Observation, mask=True) -> Net:
    """`net` with the evidence of each author (where `mask`) whose transition in `obs` empties it
    (`clears`) emptied; as it is for window_reset "never" (decisions P7)."""
    return net if reset == "never" else clear_evidence(net, authors, mask & clears(reset, obs))


def clears(reset: str, obs: Observation):
    """Whether an observation's transition empties its author's evidence (decisions P7): entering
    isolation ("on_isolation") or leaving it ("on_release")."""
    was, isolated = obs.before == ISOLATED, obs.after == ISOLATED
    if reset == "on_isolation":
        return isolated & ~was
    if reset == "on_release":
        return was & ~isolated
    raise ValueError(f"unknown window_reset {reset!r}")


def clear_evidence(net: Net, agents, cleared) -> Net:
    """window_reset (decisions P7): every score and shortfall window, count and mean,
    and CUSUM statistic, of each agent where `cleared` emptied, as at the start (`agents` and
    `cleared` scalars or of one shape; cleared agents distinct)."""
    target = jnp.where(cleared, agents, net.state.shape[0])  # out of range: dropped

    def empty(x):
        return x.at[target].set(0, mode="drop")

    return dataclasses.replace(
        net, scores=empty(net.scores), score_count=empty(net.score_count), shortfalls=empty(net.shortfalls),
        shortfall_count=empty(net.shortfall_count), score_mean=empty(net.score_mean),
        shortfall_mean=empty(net.shortfall_mean), cusum=empty(net.cusum) if net.cusum.ndim == 3 else net.cusum,
    )  # fmt: skip


def observe_rows(p: Params, world: World, net: Net, i, task_type, s, q, t, evidence,
                 detector: str, probe) -> tuple[Rows, Observation]:  # fmt: skip
    """The rows one observation writes and what it records, read from `net` (nothing written)."""
    if detector == "absolute":
        return observe_absolute(p, net, i, task_type, s, q, t, evidence, probe)
    if detector == "cusum":
        return observe_cusum(p, net, i, task_type, s, q, t, evidence, probe)
    return observe_relative(p, world, net, i, task_type, s, q, t, evidence, probe)


def write_rows(net: Net, i, task_type, s, rows: Rows) -> Net:
    """Write observations' rows at valid indices, unconditionally (a masked or dropping scatter
    is a select over the whole array in XLA): one observation (scalar i, task_type, s) or a
    batch ((S,) indices; cells written twice must get equal values)."""
    cell = (i, task_type, s)
    mode = "promise_in_bounds"
    cusum = net.cusum.at[cell].set(rows.cusum, mode=mode) if net.cusum.ndim == 3 else net.cusum
    return Net(state=net.state.at[i].set(rows.state, mode=mode),
               consecutive=net.consecutive.at[i].set(rows.consecutive, mode=mode),
               probe_timer=net.probe_timer.at[i].set(rows.probe_timer, mode=mode), distance=net.distance,
               scores=net.scores.at[cell].set(rows.scores, mode=mode),
               score_count=net.score_count.at[cell].set(rows.score_count, mode=mode),
               shortfalls=net.shortfalls.at[cell].set(rows.shortfalls, mode=mode),
               shortfall_count=net.shortfall_count.at[cell].set(rows.shortfall_count, mode=mode), cusum=cusum,
               score_mean=net.score_mean.at[cell].set(rows.score_mean, mode=mode),
               shortfall_mean=net.shortfall_mean.at[cell].set(rows.shortfall_mean, mode=mode))  # fmt: skip


def current_rows(net: Net, i, task_type, s) -> Rows:
    """Author i's rows as they stand (writing them back changes nothing)."""
    cell = (i, task_type, s)
    return Rows(scores=net.scores[cell], score_count=net.score_count[cell], shortfalls=net.shortfalls[cell],
                shortfall_count=net.shortfall_count[cell], score_mean=net.score_mean[cell],
                shortfall_mean=net.shortfall_mean[cell],
                cusum=net.cusum[cell] if net.cusum.ndim == 3 else jnp.float64(0.0), state=net.state[i],
                consecutive=net.consecutive[i], probe_timer=net.probe_timer[i])  # fmt: skip


def _own_score(net: Net, i, task_type, s, q, evidence):
    """q pushed into i's score window of (task_type, s) when `evidence`: (row, count, window mean)."""
    w = net.scores.shape[-1]
    count = net.score_count[i, task_type, s]
    row = net.scores[i, task_type, s]
    row = jnp.where(evidence, set_at(row, count % w, q), row)
    count = count + evidence
    return row, count, window_mean(row, count)


def _decide(net: Net, i, t, defined, z, new, consecutive, reason, probe) -> tuple[tuple, Observation]:
    """A formed decision (`defined`) -> (state, counter, probe timer on entering isolation), record.
    An isolated author's non-probe output (several slots only: isolated by another task's evidence
    while this output was under review) moves nothing: §5, "isolated (only probe outputs reach
    here)"; its score and shortfall are kept and its z recorded (decisions S12)."""
    before = net.state[i]
    moves = defined & ((before != ISOLATED) | probe)
    new = jnp.where(moves, new, before)
    reason = jnp.where(moves, reason, 0)
    consecutive = jnp.where(moves, consecutive, net.consecutive[i])
    entered = (new == ISOLATED) & (before != ISOLATED)
    timer = jnp.where(entered, t, net.probe_timer[i])
    return (new, consecutive, timer), Observation(z=jnp.where(defined, z, 0.0), z_defined=defined, before=before,
                                                  after=new, reason=reason)  # fmt: skip


def _rows(net: Net, i, task_type, s, score_row, count, mean, decision, cusum=None) -> Rows:
    """Rows of a detector that keeps no shortfall window (absolute, cusum): i's shortfalls unchanged."""
    state, consecutive, timer = decision
    return Rows(scores=score_row, score_count=count, shortfalls=net.shortfalls[i, task_type, s],
                shortfall_count=net.shortfall_count[i, task_type, s], score_mean=mean,
                shortfall_mean=net.shortfall_mean[i, task_type, s],
                cusum=jnp.float64(0.0) if cusum is None else cusum, state=state, consecutive=consecutive,
                probe_timer=timer)  # fmt: skip


def observe_absolute(p: Params, net: Net, i, task_type, s, q, t, evidence, probe) -> tuple[Rows, Observation]:
    """Absolute detector: z_abs = (threshold - own mean score of (type, s)) / scale, formed after
    warm-up from the min_obs-th score on, into the alpha/beta state machine of §5 step 9."""
    row, count, mean = _own_score(net, i, task_type, s, q, evidence)
    defined = evidence & (t > p.warmup) & (count >= p.min_obs)
    z = (p.abs_threshold - mean) / p.abs_scale
    new, consecutive, reason = next_state(p, net.state[i], net.consecutive[i], z)
    decision, obs = _decide(net, i, t, defined, z, new, consecutive, reason, probe)
    return _rows(net, i, task_type, s, row, count, mean, decision), obs


def next_state_cusum(p: Params, state, stat):
    """CUSUM transitions: watched at S >= h/2, isolated at S >= h; isolated -> watched below h,
    watched -> normal below h/2. Returns (new state, REASON_NAMES index)."""
    high = gt_tol(stat, p.cusum_h, p.tol)
    half = gt_tol(stat, p.cusum_h / 2, p.tol)
    isolate = (state != ISOLATED) & high
    watch = (state == NORMAL) & half
    relax = (state == WATCHED) & ~half
    release = (state == ISOLATED) & ~high
    new = jnp.where(isolate, ISOLATED, jnp.where(watch | release, WATCHED, jnp.where(relax, NORMAL, state)))
    reason = jnp.where(isolate, 6, jnp.where(watch, 5, jnp.where(relax, 7, jnp.where(release, 8, 0))))
    return new.astype(jnp.int32), reason.astype(jnp.int32)


def observe_cusum(p: Params, net: Net, i, task_type, s, q, t, evidence, probe) -> tuple[Rows, Observation]:
    """CUSUM detector (Page 1954): S <- max(0, S + (target - q) - k) per (agent, type, ability) on
    every final score; transitions after warm-up from the min_obs-th score on."""
    stat = net.cusum[i, task_type, s]
    stat = jnp.where(evidence, jnp.maximum(0.0, stat + (p.cusum_target - q) - p.cusum_k), stat)
    row, count, mean = _own_score(net, i, task_type, s, q, evidence)
    defined = evidence & (t > p.warmup) & (count >= p.min_obs)
    new, reason = next_state_cusum(p, net.state[i], stat)
    decision, obs = _decide(net, i, t, defined, stat, new, net.consecutive[i], reason, probe)
    return _rows(net, i, task_type, s, row, count, mean, decision, cusum=stat), obs


def observe_relative(
    p: Params, world: World, net: Net, i, task_type, s, q, t, evidence, probe
) -> tuple[Rows, Observation]:
    """The peer-relative detector (§5): author i's final score q for (task_type, s) at task t when
    `evidence` (else i's rows come back unchanged). Reads i's rows and its neighbours' rows; returns
    the rows to write (`write_rows`) and the record."""
    _, valid, nbc = neighbours_of(world, i)
    normal = valid & (net.state[nbc] == NORMAL)
    ws = net.shortfalls.shape[-1]
    # reads
    peer_counts = net.score_count[nbc, task_type, s]  # (K,)
    peer_means = net.score_mean[nbc, task_type, s]
    n_x = net.shortfall_count[i, task_type, s]
    shortfall_row = net.shortfalls[i, task_type, s]
    pool_counts = net.shortfall_count[nbc, task_type, :]  # (K, A); i is never its own neighbour
    pool_values = net.shortfall_mean[nbc, task_type, :]
    # the new score and shortfall
    peers = normal & (peer_counts > 0)
    n_peers = peers.sum()
    reference = jnp.sum(jnp.where(peers, peer_means, 0.0)) / jnp.maximum(n_peers, 1)
    record = evidence & (n_peers > 0)
    x = reference - q
    shortfall_row = jnp.where(record, set_at(shortfall_row, n_x % ws, x), shortfall_row)
    n_x = n_x + record
    own = window_mean(shortfall_row, n_x)
    score_row, score_count, score_mean = _own_score(net, i, task_type, s, q, evidence)
    pool_mask = normal[:, None] & (pool_counts >= p.min_matched)
    flat = jnp.where(pool_mask, pool_values, jnp.inf).reshape(-1)
    n_pool = pool_mask.sum()
    ordered = sort_floats(flat)
    m = quantile_sorted(ordered, n_pool, 0.5)
    p25 = quantile_sorted(ordered, n_pool, 0.25)
    defined = record & (t > p.warmup) & (n_x >= p.min_obs) & (n_pool > 0)
    z = jnp.where(
        defined,
        (own - jnp.where(defined, m, 0.0)) / jnp.maximum(jnp.where(defined, m - p25, 1.0), p.z_floor),
        0.0,
    )
    new, consecutive, reason = next_state(p, net.state[i], net.consecutive[i], z)
    (new, consecutive, timer), obs = _decide(net, i, t, defined, z, new, consecutive, reason, probe)
    rows = Rows(scores=score_row, score_count=score_count, shortfalls=shortfall_row, shortfall_count=n_x,
                score_mean=score_mean, shortfall_mean=own, cusum=jnp.float64(0.0), state=new,
                consecutive=consecutive, probe_timer=timer)  # fmt: skip
    return rows, obs


def first_wave(world: World, order, authors, evidence, detector: str = "relative"):
    """(S,) bool: the observations of a round that conflict with no earlier one in `order` (task
    order). An observation with evidence writes its author's windows and state and reads them (and,
    for the relative detector, its author's neighbours' rows): it conflicts with an earlier one
    with evidence on its author (or, relative, on a neighbour). One without evidence writes nothing
    and its record is never kept (a review record exists only with evidence), so it is always in the
    first wave. O(S·K + N): per agent the earliest position of an observation with evidence on it,
    then per slot a look at its author and, for the relative detector, its author's neighbours."""
    n_agents, n_slots = world.nbr.shape[0], order.shape[0]
    position = jnp.zeros_like(order).at[order].set(jnp.arange(n_slots, dtype=order.dtype))
    a = jnp.clip(authors, 0, n_agents - 1)
    never = jnp.full(n_agents, n_slots, order.dtype)
    first_writer = never.at[a].min(jnp.where(evidence, position, n_slots))  # earliest write on each agent
    earlier = first_writer[a] < position
    if detector == "relative":
        nb = world.nbr[a]  # (S, K), -1 padding
        earlier |= jnp.any((nb >= 0) & (first_writer[jnp.maximum(nb, 0)] < position[:, None]), axis=-1)
    return ~(evidence & earlier)


# a wave writes its records into the round's slots by a select against its rows while slots x wave
# width stays at most this (96 slots at 576 agents: 3,072 and 576), else by a scatter: the
# select saved 3.7% of a 576-agent round, but it grows with slots x width (6,144 slots x 2,048 at
# 36,864 agents: a full stream took 143 s against 80 s with the scatter)
SELECT_WRITES = 4096


def first_wave_width(n_slots: int) -> int:
    """Rows the first wave computes at once: every slot in small rounds, a third of them in large
    ones (writers beyond wait for a later wave)."""
    return n_slots if n_slots <= 16 else max(16, n_slots // 3)


def later_wave_width(n_slots: int) -> int:
    """Rows each later wave computes at once: a round's later waves hold few observations (about
    6 of 96 slots' at 576 agents, 82 of 1,536 at 9,216), so a narrower program than the first."""
    return min(n_slots, max(4, n_slots // 16))


def _wave(p: Params, world: World, net: Net, evidence, order, observations: Observation, pending, detector: str,
          width: int, reset: str = "never") -> tuple[Net, Observation, jax.Array]:  # fmt: skip
    """One wave: the pending observations that conflict with no earlier pending one in task order
    (`first_wave`), at most `width` of them in slot order, read from `net` together and written in
    one scatter. Returns the network, the observations with theirs filled in, and what is left."""
    n, n_slots = net.state.shape[0], order.shape[0]
    eligible = first_wave(world, order, evidence.author, pending, detector) & pending
    picked = eligible & (jnp.cumsum(eligible) <= width)
    slot_of = jnp.nonzero(picked, size=width, fill_value=0)[0]  # (width,) slots; padding repeats slot 0
    used = jnp.arange(width) < picked.sum()
    ev = at(evidence, slot_of)
    rows, obs = jax.vmap(lambda e: observe_rows(p, world, net, e.author, e.task_type, e.ability, e.q, e.t, e.valid,
                                                detector, e.probe))(ev)  # fmt: skip
    # padding rows write the first writer's cell with its rows (equal values written twice), or,
    # with no writer, an unchanged cell: every scatter index is valid
    cell = (jnp.clip(ev.author[0], 0, n - 1), ev.task_type[0], ev.ability[0])
    lead_rows = jax.tree_util.tree_map(
        lambda r, c: jnp.where(used[0], r[0], c), rows, current_rows(net, *cell)
    )
    rows = jax.tree_util.tree_map(
        lambda r, c: jnp.where(used.reshape((-1,) + (1,) * (r.ndim - 1)), r, c), rows, lead_rows)  # fmt: skip
    index = tuple(jnp.where(used, x, c) for x, c in zip((ev.author, ev.task_type, ev.ability), cell))
    net = write_rows(net, *index, rows)
    net = reset_evidence(reset, net, ev.author, obs, used)  # a wave's authors are distinct (they conflict)
    # each slot takes the record of the wave row that observed it, if any (a wave's slots are
    # distinct; padding rows observe none: slot 0 may be a real writer)
    if n_slots * width <= SELECT_WRITES:  # a select against the wave's rows: O(slots x width)
        hit = (slot_of[None, :] == jnp.arange(n_slots)[:, None]) & used[None, :]
        row_of = jnp.argmax(hit, axis=1)
        observations = jax.tree_util.tree_map(
            lambda o, new: jnp.where(hit.any(axis=1), new[row_of], o), observations, obs
        )
    else:  # a scatter: O(width)
        target = jnp.where(used, slot_of, n_slots)
        observations = jax.tree_util.tree_map(
            lambda o, new: o.at[target].set(new, mode="drop"), observations, obs
        )
    return net, observations, pending & ~picked


def observe_round(p: Params, world: World, net: Net, evidence, order, observations: Observation,
                  detector: str = "relative", width: int | None = None,
                  later_width: int | None = None, reset: str = "never") -> tuple[Net, Observation]:  # fmt: skip
    """Every slot's observation of one round (`evidence` with a leading slot axis), with the result
    of taking them one by one in `order` (task order), in waves (`_wave`): each wave takes the
    observations with evidence not yet taken that conflict with no earlier such one in task order
    (at most `width` in the first wave, default `first_wave_width`, `later_width` in each later
    one, default `later_wave_width`), reads them together and writes them in one scatter, until
    none is left. Exact for every observation with evidence (the only ones recorded): conflict
    is symmetric (an author's neighbour's author is its neighbour), so a wave's observation
    conflicts with no observation still waiting that precedes it in task order, nor with another
    of its wave, and everything it conflicts with that precedes it was taken in an earlier wave.
    Each wave takes at least one (the first eligible in slot order; the earliest waiting one in
    task order is always eligible). Observations without evidence write nothing and are left as
    given. `reset` (static, config.WINDOW_RESET): when an author loses its evidence (`clear_evidence`)."""
    n_slots = order.shape[0]
    width = first_wave_width(n_slots) if width is None else min(width, n_slots)
    later_width = later_wave_width(n_slots) if later_width is None else max(1, min(later_width, n_slots))
    state = _wave(p, world, net, evidence, order, observations, evidence.valid, detector, width, reset)
    net, observations, _ = jax.lax.while_loop(
        lambda s: across_streams(s[2].any()),
        lambda s: _wave(p, world, s[0], evidence, order, s[1], s[2], detector, later_width, reset),
        state,
    )
    return net, observations


def refresh_distances(world: World, net: Net, moved) -> Net:
    """Distance tables after the round's observations, when some agent entered or left isolation
    (only isolation changes them). One cond per round, its predicate shared by all streams."""
    distance = jax.lax.cond(across_streams(moved), lambda: distance_tables(world.holds, world.nbr, net.state),
                            lambda: net.distance)  # fmt: skip
    return dataclasses.replace(net, distance=distance)


def isolation_changed(obs: Observation):
    return (obs.after == ISOLATED) != (obs.before == ISOLATED)


# ----------------------------------------------------------------------------------------------
# Routing inside absorb (spec/protocol.md §2, §3)
# ----------------------------------------------------------------------------------------------


def _log_action(slot: Slots, action) -> Slots:
    return dataclasses.replace(
        slot, actions=set_at(slot.actions, slot.n_actions, action), n_actions=slot.n_actions + 1
    )


def _finish(slot: Slots, answered, end) -> Slots:
    return dataclasses.replace(slot, phase=jnp.int32(FINISHED), answered=answered, end=jnp.int32(end))


def _move(p: Params, slot: Slots, to, action) -> Slots:
    over = (slot.moves + 1 > p.move_limit) | (slot.since + 1 > p.route_limit)
    moved = _log_action(dataclasses.replace(
        slot, moves=slot.moves + 1, since=slot.since + 1, agent=to,
        route=set_at(slot.route, slot.route_len, to), route_len=slot.route_len + 1), action)  # fmt: skip
    return where_tree(over, _finish(slot, False, 1), moved)


def reach(cfg: EngineConfig, net: Net, i, valid, nbc, column):
    """How far agent i reads `column`'s nearest provider to be: its own table's entry, or, with
    hop_per_task convergence, one more than its nearest neighbour's (reference.ReferenceNetwork.reach)."""
    if cfg.convergence == "instant":
        return net.distance[i, column]
    return jnp.where(valid, net.distance[nbc, column], INF).min() + 1


def _toward(cfg: EngineConfig, p: Params, world: World, net: Net, i, column, u_tie):
    """A next hop from agent i toward `column`'s nearest provider (the neighbours one hop closer,
    tie drawn by u_tie or the lowest index: next_hop_ties), and whether there is none (INF)."""
    nb, valid, nbc = neighbours_of(world, i)
    d = reach(cfg, net, i, valid, nbc, column)
    return pick_neighbour(u_tie * p.tie_scale, nb, valid & (net.distance[nbc, column] == d - 1)), d >= INF


def _next_hop(
    cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, missing, u_route, action
) -> Slots:
    s = pick_from_mask(u_route[D.HOP_ABILITY], missing)
    j, unreachable = _toward(cfg, p, world, net, slot.agent, s, u_route[D.HOP_TIE])
    return where_tree(unreachable, _finish(slot, False, 2), _move(p, slot, j, action))


def _route_step(
    cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, t, draws_t
) -> tuple[Net, Slots]:
    """One decision at the current agent: relay, probe, handoff, or stop for a model call."""
    i = slot.agent
    u_route = draws_t.route[jnp.minimum(slot.moves, D.N_VISITS - 1)]
    required = world.pair_abilities[slot.pair]
    missing = required & ~slot.covered
    isolated_relay = (net.state[i] == ISOLATED) & ~slot.probe_visit
    nb, valid, nbc = neighbours_of(world, i)
    # (K,): not all N
    eligible = (net.state[nbc] == ISOLATED) & (t - net.probe_timer[nbc] >= p.probe_interval)
    candidates = valid & eligible & jnp.any(world.holds[nbc] & missing[None, :], axis=1)
    within = (slot.moves + 1 <= p.move_limit) & (slot.since + 1 <= p.route_limit)
    probing = ~isolated_relay & ~slot.probe_visit & candidates.any() & within
    j = pick_neighbour(u_route[D.PROBE], nb, candidates)
    held = world.holds[i] & missing
    handoff = ~isolated_relay & ~probing & ~held.any()

    # a relay and a handoff are the same next hop, logged as different actions (one traced copy:
    # a relay starts from a non-probe visit, so both leave probe_visit False)
    hop_slot = dataclasses.replace(
        _next_hop(cfg, p, world, net, slot, missing, u_route, jnp.where(isolated_relay, A_RELAY, A_HANDOFF)),
        probe_visit=jnp.bool_(False))  # fmt: skip
    probe_slot = dataclasses.replace(_move(p, slot, j, A_PROBE), probe_visit=jnp.bool_(True))
    work_slot = dataclasses.replace(slot, phase=jnp.int32(GENERATE), ability=jnp.argmax(held).astype(jnp.int32),
                                    finalize=jnp.all(held == missing))  # fmt: skip

    # probing excludes a relay; a handoff excludes both
    new_slot = where_tree(probing, probe_slot, where_tree(isolated_relay | handoff, hop_slot, work_slot))
    return jnp.where(probing, j, -1).astype(jnp.int32), new_slot


def _route(
    cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, t, draws_t
) -> tuple[jax.Array, Slots]:
    """Route until the slot needs a model call or finishes. Returns the agent probed on the way
    (-1 if none; at most one: a probe move always ends at a holder that works) and the slot."""

    def body(carry):
        n, probed, slot = carry
        j, stepped = _route_step(cfg, p, world, net, slot, t, draws_t)
        active = slot.phase == ROUTE
        probed = jnp.where(active & (j >= 0), j, probed)
        return n + 1, probed, where_tree(active, stepped, slot)

    def more(carry):
        n, _, slot = carry
        return (slot.phase == ROUTE) & (n < cfg.route_loop)

    _, probed, slot = jax.lax.while_loop(more, body, (jnp.int32(0), jnp.int32(-1), slot))
    return probed, slot


def stamp_probes(net: Net, probed, t) -> Net:
    """Probe timers of the agents probed (probed -1 = none; several: the latest task wins)."""
    n = net.probe_timer.shape[0]
    index = jnp.where(probed >= 0, probed, n)  # n = out of bounds, dropped
    return dataclasses.replace(net, probe_timer=net.probe_timer.at[index].max(t, mode="drop"))


def _start(cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, t, draws_t) -> Slots:
    """Entry pick and RawRelay toward a non-isolated agent; then the slot needs InferAbilities."""
    entry = pick_index(draws_t.entry, cfg.n_agents)
    slot = dataclasses.replace(
        at(initial_slots(dataclasses.replace(cfg, slots=1)), 0), t=t, phase=jnp.int32(INFER), agent=entry,
        entry=entry, route=jnp.full(MAX_ROUTE, -1, jnp.int32).at[0].set(entry), route_len=jnp.int32(1),
    )  # fmt: skip
    column = cfg.n_abilities

    def body(carry):
        n, slot = carry
        i = slot.agent
        relay = (slot.phase == INFER) & (net.state[i] == ISOLATED)
        u_tie = draws_t.route[jnp.minimum(slot.moves, D.N_VISITS - 1), D.HOP_TIE]
        j, unreachable = _toward(cfg, p, world, net, i, column, u_tie)
        moved = where_tree(unreachable, _finish(slot, False, 3), _move(p, slot, j, A_RAWRELAY))
        return n + 1, where_tree(relay, moved, slot)

    def more(carry):
        n, slot = carry
        return (slot.phase == INFER) & (net.state[slot.agent] == ISOLATED) & (n < cfg.route_loop)

    return jax.lax.while_loop(more, body, (jnp.int32(0), slot))[1]


# ----------------------------------------------------------------------------------------------
# emit -> backend -> absorb
# ----------------------------------------------------------------------------------------------


@pytree
class Requests:
    """The calls every slot needs now: (S,) per-slot context, (S, 3) per call."""

    phase: jax.Array  # (S,) what the calls are for (INFER ... SYNTH)
    t: jax.Array  # (S,)
    visit: jax.Array  # (S,) moves on arrival = per-visit draw row
    task_type: jax.Array  # (S,)
    author: jax.Array  # (S,) the agent whose output is judged
    ability: jax.Array  # (S,)
    finalize: jax.Array  # (S,)
    inferred_pair: jax.Array  # (S,) (generate needs it only for the context it shows)
    kind: jax.Array  # (S, 3) K_* index
    agent: jax.Array  # (S, 3) calling agent
    other_score: jax.Array  # (S, 3) round 2: the other member's round-1 score
    mask: jax.Array  # (S, 3) bool


@pytree
class Responses:
    score: jax.Array  # (S, 3) float64
    pair: jax.Array  # (S,) inferred pair (infer)
    answer_id: jax.Array  # (S,) final answer id (finalize generate / synthesis)
    prompt_tokens: jax.Array  # (S, 3)
    completion_tokens: jax.Array  # (S, 3)
    parse_ok: jax.Array  # (S, 3) bool
    role: jax.Array  # (S, 3) which model answered (STRONG / WEAK)
    truth: jax.Array  # (S, 3) int32 latent correctness for the trace (-1 none) [records only]


_PHASE_CALLS = {  # phase -> kinds of its calls (K_* or -1)
    INFER: (K_INFER, -1, -1), GENERATE: (K_GENERATE, -1, -1), REVIEW: (K_REVIEW, K_REVIEW, K_REVIEW),
    ROUND1: (K_COMMITTEE1, K_COMMITTEE1, -1), ROUND2: (K_COMMITTEE2, K_COMMITTEE2, -1),
    CANDIDATES: (K_CANDIDATE, K_CANDIDATE, -1), SYNTH: (K_SYNTHESIS, -1, -1),
}  # fmt: skip
_KIND_TABLE = np.full((10, 3), -1, np.int32)
for _phase, _kinds in _PHASE_CALLS.items():
    _KIND_TABLE[_phase] = _kinds

# phase -> the call slots (rows of the visit's TaskDraws.calls block) its calls read, padded with
# its first; infer reads TaskDraws.infer, the other phases none
_PHASE_ROWS = {GENERATE: (D.GENERATE,), REVIEW: D.REVIEW_SAMPLES, ROUND1: D.ROUND1, ROUND2: D.ROUND2,
               CANDIDATES: D.CANDIDATES, SYNTH: (D.SYNTHESIS,)}  # fmt: skip


def _call_row_tables() -> tuple[np.ndarray, np.ndarray]:
    """(phase, k) -> the k-th row drawn; (phase, call slot) -> which drawn row holds it."""
    drawn, position = np.zeros((10, 3), np.int32), np.zeros((10, D.N_CALL_SLOTS), np.int32)
    for phase, read in _PHASE_ROWS.items():
        drawn[phase] = read + (read[0],) * (3 - len(read))
        position[phase, list(read)] = range(len(read))
    return drawn, position


_ROWS_TABLE, _ROW_POSITION = _call_row_tables()


def emit(cfg: EngineConfig, p: Params, world: World, slots: Slots) -> Requests:
    kind = jnp.asarray(_KIND_TABLE)[slots.phase]
    member = jnp.stack([slots.member_a, slots.member_b, slots.member_a], axis=1)
    reviewer = jnp.broadcast_to(slots.reviewer[:, None], (cfg.slots, 3))
    caller = jnp.where((slots.phase == REVIEW)[:, None], reviewer,
             jnp.where(((slots.phase >= ROUND1) & (slots.phase <= SYNTH))[:, None], member,
                       jnp.broadcast_to(slots.agent[:, None], (cfg.slots, 3))))  # fmt: skip
    other = jnp.stack([slots.round1[:, 1], slots.round1[:, 0], slots.round1[:, 0]], axis=1)
    return Requests(
        phase=slots.phase, t=slots.t, visit=jnp.minimum(slots.moves, D.N_VISITS - 1),
        task_type=world.task_type[jnp.maximum(slots.t - 1, 0)], author=slots.agent, ability=slots.ability,
        finalize=slots.finalize, inferred_pair=slots.pair, kind=kind, agent=caller, other_score=other,
        mask=kind >= 0,
    )  # fmt: skip


def _role(world: World, agent, ability, t):
    """Model-backed rule (backend only): STRONG iff healthy and (no ability or ability held)."""
    held = jnp.where(ability < 0, True, world.holds[agent, jnp.maximum(ability, 0)])
    return jnp.where(is_degraded(world, agent, t) | ~held, WEAK, STRONG).astype(jnp.int32)


def _completion(p: Params, role, kind: int, u):
    lo, hi = (
        jnp.where(role == STRONG, p.completion[STRONG, kind, k], p.completion[WEAK, kind, k]) for k in (0, 1)
    )
    return jnp.minimum(lo + jnp.floor(u * (hi - lo + 1).astype(jnp.float64)).astype(jnp.int32), hi)


def _visible(p: Params, role, completion):
    return jnp.floor(completion.astype(jnp.float64) * p.answer_fraction[role]).astype(jnp.int32)


def _distractor(p: Params, role, u):
    return 1 + categorical(u, p.distractor_thr[role])


def emulate_slot(p: Params, world: World, b: Backend, r: Requests, u_calls, u_infer):
    """One slot's calls. u_calls: (N_CALL_SLOTS, N_CALL_U) of the visit; returns (backend, response)."""
    t, ty, author, s = r.t, r.task_type, r.author, r.ability
    q = world.difficulty[jnp.maximum(t - 1, 0)]  # the question's difficulty bin
    question = world.question_tokens[jnp.maximum(t - 1, 0)]
    roles = _role(world, r.agent, s, t)  # (3,) the reviewers' / committee members' models, once
    fold = (r.phase == GENERATE) & b.pending  # the previous Contribute's output joins the draft
    b = dataclasses.replace(b, draft_ok=jnp.where(fold, b.draft_ok & b.result_ok, b.draft_ok),
                            draft_tokens=jnp.where(fold, b.draft_tokens + b.result_tokens, b.draft_tokens),
                            pending=b.pending & ~fold)  # fmt: skip
    ctx = question + b.draft_tokens  # question + accepted draft
    judged = ctx + b.part_tokens
    zeros3f, zeros3i = jnp.zeros(3), jnp.zeros(3, jnp.int32)
    none3 = jnp.full(3, -1, jnp.int32)
    out = dict(
        score=zeros3f,
        pair=jnp.int32(0),
        answer_id=jnp.int32(0),
        prompt=zeros3i,
        completion=zeros3i,
        role=zeros3i,
        truth=none3,
    )

    # infer
    role_i = _role(world, author, -1, t)
    true_pair = world.true_pair[ty]
    others = world.pair_valid & (jnp.arange(world.pair_valid.shape[0]) != true_pair)
    wrong = pick_from_mask(u_infer[D.INFER_WRONG_PAIR], others)
    ok_infer = (u_infer[D.INFER_CORRECT] < p.p_infer[role_i]) | ~others.any()
    inferred = jnp.where(ok_infer, true_pair, wrong)
    infer_out = dict(out, pair=inferred, role=zeros3i.at[0].set(role_i),
                     truth=none3.at[0].set((inferred == true_pair).astype(jnp.int32)),
                     prompt=zeros3i.at[0].set(p.prompt[role_i, K_INFER] + question),
                     completion=zeros3i.at[0].set(_completion(p, role_i, K_INFER, u_infer[D.INFER_TOKENS])))  # fmt: skip
    infer_b = dataclasses.replace(fresh_backend_slot(), pair_ok=inferred == true_pair)

    # generate
    ug = u_calls[D.GENERATE]
    role_g = _role(world, author, s, t)
    part_ok = ug[D.U_MAIN] < p.p_part[role_g, ty, q]
    comp_g = _completion(p, role_g, K_GENERATE, ug[D.U_TOKENS])
    answer_ok = jnp.where(b.pair_ok, part_ok & (b.draft_ok | (ug[D.U_AUX] < p.p_rescue[role_g])),
                          ug[D.U_AUX] < p.p_part[WEAK, ty, q])  # fmt: skip
    answer_id = jnp.where(answer_ok, 0, _distractor(p, role_g, ug[D.U_DISTRACTOR]))
    part_tokens = _visible(p, role_g, comp_g)
    gen_out = dict(out, answer_id=jnp.where(r.finalize, answer_id, 0), role=zeros3i.at[0].set(role_g),
                   truth=none3.at[0].set(jnp.where(r.finalize, answer_ok, part_ok).astype(jnp.int32)),
                   prompt=zeros3i.at[0].set(p.prompt[role_g, K_GENERATE] + ctx), completion=zeros3i.at[0].set(comp_g))  # fmt: skip
    gen_b = dataclasses.replace(
        b, part_ok=part_ok, part_role=role_g, part_tokens=part_tokens, answer_ok=answer_ok & r.finalize,
        answer_tokens=part_tokens, result_ok=jnp.where(r.finalize, answer_ok, part_ok), result_tokens=part_tokens,
        pending=~r.finalize, candidate_tokens=jnp.int32(0))  # fmt: skip

    # review samples (3) / committee rounds (2); a Finalize's own right part on a wrong draft is
    # its own judged class (params.JUDGED_RIGHT_ON_WRONG_DRAFT, decisions E10)
    judged_class = jnp.where(r.finalize & b.part_ok & ~b.draft_ok, JUDGED_RIGHT_ON_WRONG_DRAFT,
                             b.part_ok.astype(jnp.int32))  # fmt: skip

    def sample(kind, k, thr_table, repeat_of, use_repeat, p_repeat):
        role = roles[k]
        u = u_calls[kind_slot(kind, k)]
        drawn = jnp.asarray(ANCHORS)[categorical(u[D.U_MAIN], thr_table[role, b.part_role, judged_class, q])]
        score = jnp.where(use_repeat & (u[D.U_AUX] < p_repeat[role]), repeat_of, drawn)
        comp = _completion(p, role, kind, u[D.U_TOKENS])
        return score, comp, role

    def kind_slot(kind, k):
        return {K_REVIEW: D.REVIEW_SAMPLES, K_COMMITTEE1: D.ROUND1, K_COMMITTEE2: D.ROUND2}[kind][k]

    judged_truth = jnp.full(3, b.part_ok.astype(jnp.int32))
    s0, c0, _ = sample(K_REVIEW, 0, p.review_thr, 0.0, False, p.rho_same)
    s1, c1, _ = sample(K_REVIEW, 1, p.review_thr, s0, True, p.rho_same)
    s2, c2, _ = sample(K_REVIEW, 2, p.review_thr, s0, True, p.rho_same)
    role_r = roles[0]
    rev_out = dict(out, score=jnp.stack([s0, s1, s2]), role=jnp.full(3, role_r), truth=judged_truth,
                   prompt=jnp.full(3, p.prompt[role_r, K_REVIEW] + judged, jnp.int32), completion=jnp.stack([c0, c1, c2]))  # fmt: skip

    def committee_round(kind, thr_table, repeat_of, use_repeat, p_repeat, context):
        """Members A and B's samples of one committee round, as the slot's response and (role,
        completion) per member."""
        (x0, c0, r0), (x1, c1, r1) = (
            sample(kind, k, thr_table, repeat_of[k], use_repeat, p_repeat) for k in (0, 1)
        )
        prompt = jnp.stack([p.prompt[r0, kind], p.prompt[r1, kind], 0]) + context
        response = dict(out, score=jnp.stack([x0, x1, 0.0]), prompt=prompt.at[2].set(0),
                        completion=jnp.stack([c0, c1, 0]), role=jnp.stack([r0, r1, 0]), truth=judged_truth)  # fmt: skip
        return response, ((r0, c0), (r1, c1))

    r1_out, members = committee_round(K_COMMITTEE1, p.review_thr, (0.0, 0.0), False, p.rho_same, judged)
    r1_b = dataclasses.replace(b, explanation_tokens=_visible(p, *members[0]) + _visible(p, *members[1]))
    r2_out, _ = committee_round(K_COMMITTEE2, p.round2_thr, r.other_score, True, p.p_follow,
                                judged + b.explanation_tokens)  # fmt: skip

    # takeover: candidates, then synthesis by member A
    def candidate(k):
        role = roles[k]
        comp = _completion(p, role, K_CANDIDATE, u_calls[D.CANDIDATES[k], D.U_TOKENS])
        return p.prompt[role, K_CANDIDATE] + judged, comp, _visible(p, role, comp), role

    pa, ca, va, rca = candidate(0)
    pb, cb, vb, rcb = candidate(1)
    cand_out = dict(
        out, prompt=jnp.stack([pa, pb, 0]), completion=jnp.stack([ca, cb, 0]), role=jnp.stack([rca, rcb, 0])
    )
    cand_b = dataclasses.replace(b, candidate_tokens=va + vb)

    us = u_calls[D.SYNTHESIS]
    role_s = roles[0]
    original_ok = jnp.where(r.finalize, b.answer_ok, b.part_ok)
    synth_ok = us[D.U_MAIN] < jnp.where(original_ok, p.p_keep[role_s], p.p_fix[role_s])
    comp_s = _completion(p, role_s, K_SYNTHESIS, us[D.U_TOKENS])
    synth_id = jnp.where(synth_ok, 0, _distractor(p, role_s, us[D.U_DISTRACTOR]))
    synth_out = dict(out, answer_id=jnp.where(r.finalize, synth_id, 0),
                     prompt=zeros3i.at[0].set(p.prompt[role_s, K_SYNTHESIS] + judged + b.candidate_tokens),
                     completion=zeros3i.at[0].set(comp_s), role=zeros3i.at[0].set(role_s),
                     truth=none3.at[0].set(synth_ok.astype(jnp.int32)))  # fmt: skip
    synth_b = dataclasses.replace(b, result_ok=synth_ok, result_tokens=_visible(p, role_s, comp_s))

    branches = {INFER: (infer_b, infer_out), GENERATE: (gen_b, gen_out), REVIEW: (b, rev_out),
                ROUND1: (r1_b, r1_out), ROUND2: (b, r2_out), CANDIDATES: (cand_b, cand_out),
                SYNTH: (synth_b, synth_out)}  # fmt: skip
    new_b = select_phase(r.phase, b, {ph: bb for ph, (bb, _) in branches.items()})
    resp = select_phase(r.phase, out, {ph: oo for ph, (_, oo) in branches.items()})
    mask = r.mask
    return new_b, Responses(
        score=resp["score"], pair=resp["pair"], answer_id=resp["answer_id"],
        prompt_tokens=jnp.where(mask, resp["prompt"], 0), completion_tokens=jnp.where(mask, resp["completion"], 0),
        parse_ok=mask, role=resp["role"], truth=jnp.where(mask, resp["truth"], -1),
    )  # fmt: skip


def emulate(cfg: EngineConfig, p: Params, world: World, backend: Backend, requests: Requests,
            draws: D.LazyTaskDraws):  # fmt: skip
    """The emulated backend for all slots of one stream (draws: the slots' tasks, leading (S,)).
    Each slot's (N_CALL_SLOTS, N_CALL_U) block of its visit holds the rows its phase reads, drawn
    now (`D.call_rows`, equal to `task_draws(...).calls[visit, row]`); the other rows repeat them
    and are read only by the phase branches `emulate_slot` discards."""
    rows = D.call_rows(draws.calls_key, requests.visit, jnp.asarray(_ROWS_TABLE)[requests.phase])  # (S, 3, 4)
    position = jnp.asarray(_ROW_POSITION)[requests.phase][:, :, None]
    u_calls = jnp.take_along_axis(rows, position, axis=1)  # (S, 11, 4)
    u_infer = draws.infer  # (S, 3)
    return jax.vmap(emulate_slot, in_axes=(None, None, 0, 0, 0, 0))(
        p, world, backend, requests, u_calls, u_infer
    )


@pytree
class ReviewRecord:
    valid: jax.Array
    t: jax.Array
    visit: jax.Array
    finalize: jax.Array
    author: jax.Array
    ability: jax.Array
    probe: jax.Array
    reviewer: jax.Array
    samples: jax.Array  # (3,)
    q0: jax.Array
    s_u: jax.Array
    committee: jax.Array
    member_a: jax.Array
    member_b: jax.Array
    round1: jax.Array  # (2,)
    round2: jax.Array  # (2,)
    q: jax.Array
    takeover: jax.Array
    obs: Observation


def _reviewers(world: World, net: Net, author, ability):
    """(K,) mask over the author's neighbour row: normal holders of the ability."""
    _, valid, nbc = neighbours_of(world, author)
    return valid & (net.state[nbc] == NORMAL) & world.holds[nbc, ability]


@pytree
class Evidence:
    """A slot's final score this round, if any (applied to the detector in task order)."""

    valid: jax.Array  # bool
    accepted: jax.Array  # bool: the output stands (evidence, or no reviewer at all)
    author: jax.Array
    task_type: jax.Array
    ability: jax.Array
    q: jax.Array
    t: jax.Array
    probe: jax.Array  # bool: a recovery probe's output


def absorb_decide(
    cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, resp: Responses, draws_t
):
    """Apply one slot's responses (review, committee, Takeover decisions) on the network as it
    stands; returns (slot, evidence, record without the detector's observation)."""
    t, phase, ty = slot.t, slot.phase, world.task_type[jnp.maximum(slot.t - 1, 0)]
    u_route = draws_t.route[jnp.minimum(slot.moves, D.N_VISITS - 1)]
    n_calls = jnp.sum(resp.parse_ok)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    slot = dataclasses.replace(slot, calls=i32(slot.calls + n_calls),
                               prompt_tokens=i32(slot.prompt_tokens + resp.prompt_tokens.sum()),
                               completion_tokens=i32(slot.completion_tokens + resp.completion_tokens.sum()))  # fmt: skip
    author, s = slot.agent, slot.ability
    nb = world.nbr[author]
    reviewers = _reviewers(world, net, author, s)

    # INFER -> routing
    after_infer = dataclasses.replace(_log_action(slot, A_INFER), pair=resp.pair, phase=jnp.int32(ROUTE))
    # GENERATE -> initial review (or accept unreviewed)
    no_reviewer = ~reviewers.any()
    after_gen = dataclasses.replace(
        slot, answer_id=jnp.where(slot.finalize, resp.answer_id, slot.answer_id),
        reviewer=pick_neighbour(u_route[D.REVIEWER], nb, reviewers), phase=jnp.int32(REVIEW),
        unreviewed=slot.unreviewed + no_reviewer)  # fmt: skip
    # REVIEW -> committee or done
    x = resp.score
    q0 = median_of_3(x)
    mean = (x[0] + x[1] + x[2]) / 3.0
    s_u = jnp.sqrt(((x[0] - mean) ** 2 + (x[1] - mean) ** 2 + (x[2] - mean) ** 2) / 2.0)
    committee = (le_tol(q0, p.tau_to, p.tol) | gt_tol(s_u, p.sigma_com, p.tol)
                 | (net.state[author] == WATCHED) | slot.probe_visit)  # fmt: skip
    n_rev = reviewers.sum()
    ka = pick_from_mask(u_route[D.COMMITTEE_A], reviewers)
    others = set_at(reviewers, ka, False)  # read only where n_rev >= 2, so ka >= 0
    kb = jnp.where(n_rev >= 2, pick_from_mask(u_route[D.COMMITTEE_B], others), ka)
    # no eligible reviewer left since the initial review (several slots only: another task's
    # evidence changed the states in between): its reviewer sits alone, A = B (decisions S11)
    a = jnp.where(ka >= 0, nb[jnp.maximum(ka, 0)], slot.reviewer)
    b = jnp.where(kb >= 0, nb[jnp.maximum(kb, 0)], slot.reviewer)
    if cfg.variant == "single_reviewer":  # the initial reviewer in two isolated contexts
        a = b = slot.reviewer
    after_review = dataclasses.replace(slot, samples=x, q0=q0, s_u=s_u, committee=committee, q=q0,
                                       member_a=jnp.where(committee, a, -1), member_b=jnp.where(committee, b, -1),
                                       phase=jnp.where(committee, ROUND1, phase).astype(jnp.int32))  # fmt: skip
    after_r1 = dataclasses.replace(slot, round1=x[:2], phase=jnp.int32(ROUND2))
    q = (x[0] + x[1]) / 2.0
    low = le_tol(q, p.tau_to, p.tol)
    if cfg.variant == "no_takeover":  # a low score leaves the output in place
        low = jnp.bool_(False)
    takeover_phase = SYNTH if cfg.variant == "single_reviewer" else CANDIDATES  # one correction call
    after_r2 = dataclasses.replace(
        slot, round2=x[:2], q=q, phase=jnp.where(low, takeover_phase, phase).astype(jnp.int32)
    )
    after_cand = dataclasses.replace(slot, phase=jnp.int32(SYNTH))
    after_synth = dataclasses.replace(
        slot, answer_id=jnp.where(slot.finalize, resp.answer_id, slot.answer_id)
    )

    table = {INFER: after_infer, GENERATE: after_gen, REVIEW: after_review, ROUND1: after_r1,
             ROUND2: after_r2, CANDIDATES: after_cand, SYNTH: after_synth}  # fmt: skip
    new = select_phase(phase, slot, table)

    evidence = ((phase == REVIEW) & ~committee) | ((phase == ROUND2) & ~low) | (phase == SYNTH)
    accepted = evidence | ((phase == GENERATE) & no_reviewer)
    record = ReviewRecord(
        valid=evidence, t=t, visit=slot.moves, finalize=slot.finalize, author=author, ability=s,
        probe=slot.probe_visit, reviewer=new.reviewer, samples=new.samples, q0=new.q0, s_u=new.s_u,
        committee=new.committee, member_a=new.member_a, member_b=new.member_b, round1=new.round1,
        round2=new.round2, q=new.q, takeover=new.committee & (phase == SYNTH), obs=_empty_review().obs,
    )  # fmt: skip
    return new, Evidence(evidence, accepted, author, ty, s, new.q, t, slot.probe_visit), record


def absorb_route(
    cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, new: Slots, accepted, draws_t
):
    """After the round's evidence: an accepted output finalizes or hands off; then route until
    the next model call. Returns (probed agent or -1, slot)."""
    t, s = slot.t, slot.ability
    u_route = draws_t.route[jnp.minimum(slot.moves, D.N_VISITS - 1)]

    # An accepted output: Finalize answers; Contribute covers its ability and hands off.
    finished = _finish(_log_action(new, A_FINALIZE), True, 0)
    contributed = _log_action(new, A_CONTRIBUTE)
    covered = set_at(contributed.covered, s, True)
    contributed = dataclasses.replace(
        contributed, covered=covered, since=jnp.int32(0), probe_visit=jnp.bool_(False)
    )
    missing = world.pair_abilities[contributed.pair] & ~covered
    handed = _next_hop(cfg, p, world, net, contributed, missing, u_route, A_HANDOFF)
    handed = dataclasses.replace(
        handed, phase=jnp.where(handed.phase == FINISHED, FINISHED, ROUTE).astype(jnp.int32)
    )
    new = where_tree(accepted, where_tree(slot.finalize, finished, handed), new)
    return _route(cfg, p, world, net, new, t, draws_t)


def absorb_slot(cfg: EngineConfig, p: Params, world: World, net: Net, slot: Slots, resp: Responses, draws_t):
    """One slot, start to end: decide, observe, route. Returns (net, slot, record)."""
    new, ev, record = absorb_decide(cfg, p, world, net, slot, resp, draws_t)
    net, obs = observe(p, world, net, ev.author, ev.task_type, ev.ability, ev.q, ev.t, ev.valid, cfg.detector,
                       cfg.window_reset, ev.probe)  # fmt: skip
    if cfg.convergence == "instant":  # (hop_per_task: the tables move when tasks start)
        net = refresh_distances(world, net, isolation_changed(obs))
    probed, new = absorb_route(cfg, p, world, net, slot, new, ev.accepted, draws_t)
    return stamp_probes(net, probed, slot.t), new, dataclasses.replace(record, obs=obs)


# ----------------------------------------------------------------------------------------------
# One round, scanned; the driver
# ----------------------------------------------------------------------------------------------


@pytree
class DrawWindow:
    """The draws of tasks first .. first + W - 1, made in one batched call (per-task threefry
    calls inside the scan cost more than the whole round). It travels in the carry and is redrawn
    when a round could pass its end (`refill_window`), so every task a round starts lies inside it."""

    first: jax.Array  # () int32
    draws: D.LazyTaskDraws  # leading (W,)


def draw_window(world: World, first, width: int) -> DrawWindow:
    ts = first + jnp.arange(width, dtype=jnp.int32)
    return DrawWindow(first, jax.vmap(lambda t: D.lazy_task_draws(world.seed, world.dataset_id, t))(ts))


@pytree
class Carry:
    net: Net
    slots: Slots
    backend: Backend
    draws: D.LazyTaskDraws  # (S, ...) the draws of each slot's task (calls drawn when read)
    next_t: jax.Array  # next task to enter
    window: DrawWindow  # the draws of the next tasks (`window_width`; refilled as tasks are taken)


@pytree
class RoundRecords:
    requests: Requests
    responses: Responses
    reviews: ReviewRecord  # (S,)
    review_truth: jax.Array  # (S, 4) backend: part_ok, part_role, correct before, correct after
    author_degraded: jax.Array  # (S,)
    finished: Slots  # (S,) snapshot of slots that finished this round
    finished_mask: jax.Array  # (S,)
    finished_truth: jax.Array  # (S, 2) backend: answer correct, pair correct


# The draw window holds WINDOW_SLOTS * slots tasks; it is redrawn from the next task when a round
# could pass its end, ~every (WINDOW_SLOTS - 1) * 6 rounds. (A window drawn at each chunk's start,
# slots * rounds / 6 wide, drew up to twice what a degraded-phase chunk uses and ran past its end
# in the healthy phase, where the tasks beyond it were drawn on the spot for every slot: threefry
# was a fifth of a 576-agent round.)
WINDOW_SLOTS = 8


def window_width(cfg: EngineConfig) -> int:
    return min(cfg.n_tasks, WINDOW_SLOTS * cfg.slots)


def initial_carry(cfg: EngineConfig, world: World) -> Carry:
    window = draw_window(world, jnp.int32(1), window_width(cfg))
    draws = slot_draws(window, jnp.ones(cfg.slots, jnp.int32))  # idle slots' placeholder: task 1's
    return Carry(initial_net(cfg, world), initial_slots(cfg), initial_backend(cfg.slots), draws, jnp.int32(1),
                 window)  # fmt: skip


def refill_window(world: World, window: DrawWindow, next_t, slots: int) -> DrawWindow:
    """The window, redrawn from next_t when this round's tasks (at most next_t .. next_t +
    slots - 1) could pass its end. One stream's need redraws every stream's (the predicate stays
    unbatched); the draws are a function of t alone, so which window holds them changes nothing."""
    width = window.draws.entry.shape[0]
    return jax.lax.cond(across_streams(next_t + slots > window.first + width),
                        lambda: draw_window(world, next_t, width), lambda: window)  # fmt: skip


def slot_draws(window: DrawWindow, ts) -> D.LazyTaskDraws:
    """(S,) tasks' draws, gathered from a window that holds them (`refill_window`)."""
    return at(window.draws, ts - window.first)


def _take_tasks(cfg: EngineConfig, p: Params, world: World, carry: Carry) -> Carry:
    """Idle slots take the next tasks, in slot order (continuous batching); RawRelay from the
    entry agent reads the network as it stands (vectorised over slots)."""
    slots = carry.slots
    window = refill_window(world, carry.window, carry.next_t, cfg.slots)
    idle = slots.phase == IDLE
    ts = (carry.next_t + jnp.cumsum(idle) - 1).astype(jnp.int32)
    wants = idle & (ts <= cfg.n_tasks)
    ts = jnp.minimum(ts, cfg.n_tasks)
    net = carry.net
    if cfg.convergence == "hop_per_task":  # the round's starting tasks' steps, before they start
        net = relax_for_tasks(world, net, wants.sum())

    def start():
        # busy slots' ts are placeholders (next_t - 1 before the first idle slot: index -1 of the
        # window, wrapped); their draws are discarded by `pick`, only the wanted slots' are read
        draws = slot_draws(window, ts)
        started = jax.vmap(lambda slot, t, d: dataclasses.replace(_start(cfg, p, world, net, slot, t, d),
                                                                  pair=jnp.int32(-1)))(slots, ts, draws)  # fmt: skip

        def pick(new, old):
            return jax.tree_util.tree_map(
                lambda a, b: jnp.where(wants.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old
            )

        fresh = jax.vmap(lambda _: fresh_backend_slot())(jnp.arange(cfg.slots))
        return pick(started, slots), pick(fresh, carry.backend), pick(draws, carry.draws)

    slots, backend, draws = jax.lax.cond(across_streams(wants.any()), start,
                                         lambda: (slots, carry.backend, carry.draws))  # fmt: skip
    return dataclasses.replace(carry, net=net, slots=slots, backend=backend, draws=draws, window=window,
                               next_t=(carry.next_t + wants.sum()).astype(jnp.int32))  # fmt: skip


def round_step(cfg: EngineConfig, p: Params, world: World, carry: Carry) -> tuple[Carry, RoundRecords]:
    # 1. idle slots take the next tasks
    carry = _take_tasks(cfg, p, world, carry)
    # 2. emit -> backend
    requests = emit(cfg, p, world, carry.slots)
    backend, responses = emulate(cfg, p, world, carry.backend, requests, carry.draws)
    # 3. absorb
    return absorb_round(cfg, p, world, dataclasses.replace(carry, backend=backend), requests, responses)


def begin_round(cfg: EngineConfig, p: Params, world: World, carry: Carry) -> tuple[Carry, Requests]:
    """Live backends: idle slots take tasks, then the round's requests (one stream, no vmap)."""
    carry = _take_tasks(cfg, p, world, carry)
    return carry, emit(cfg, p, world, carry.slots)


def task_order(slots: Slots):
    """(S,) the slots in task order (idle slots last): the order a round's evidence is taken in."""
    return jnp.argsort(jnp.where(slots.t > 0, slots.t, jnp.iinfo(jnp.int32).max))


def absorb_round(cfg: EngineConfig, p: Params, world: World, carry: Carry, requests: Requests,
                 responses: Responses) -> tuple[Carry, RoundRecords]:  # fmt: skip
    """Absorb every slot's responses in task order. `carry.backend` is the backend's latent state
    after the calls (read only for the records' truth columns)."""
    net, slots, backend, draws = carry.net, carry.slots, carry.backend, carry.draws
    # decisions of every slot on the network as it stands (vectorised over slots)
    decided, evidence, reviews = jax.vmap(absorb_decide, in_axes=(None, None, None, None, 0, 0, 0))(
        cfg, p, world, net, slots, responses, draws)  # fmt: skip
    # the detector takes the round's evidence in task order (computed in waves of independent observations)
    order = task_order(slots)
    net, observations = observe_round(
        p, world, net, evidence, order, reviews.obs, cfg.detector, reset=cfg.window_reset
    )
    if cfg.convergence == "instant":  # (hop_per_task: the tables move when tasks start)
        net = refresh_distances(world, net, jnp.any(isolation_changed(observations)))
    reviews = dataclasses.replace(reviews, obs=observations)
    # then every slot routes on the updated network (vectorised); probes stamp their timers
    probed, slots = jax.vmap(absorb_route, in_axes=(None, None, None, None, 0, 0, 0, 0))(
        cfg, p, world, net, slots, decided, evidence.accepted, draws)  # fmt: skip
    net = stamp_probes(net, probed, slots.t)
    review_truth = jnp.stack([backend.part_ok.astype(jnp.int32), backend.part_role,
                              jnp.where(reviews.finalize, backend.answer_ok, backend.part_ok).astype(jnp.int32),
                              backend.result_ok.astype(jnp.int32)], axis=1)  # fmt: skip
    author_degraded = is_degraded(world, jnp.maximum(reviews.author, 0), jnp.maximum(slots.t, 1))
    finished_mask = slots.phase == FINISHED
    finished_truth = jnp.stack([(slots.answered & backend.result_ok).astype(jnp.int32),
                                backend.pair_ok.astype(jnp.int32)], axis=1)  # fmt: skip
    records = RoundRecords(requests, responses, reviews, review_truth, author_degraded, slots, finished_mask,
                           finished_truth)  # fmt: skip
    slots = dataclasses.replace(slots, phase=jnp.where(finished_mask, IDLE, slots.phase).astype(jnp.int32),
                                t=jnp.where(finished_mask, 0, slots.t))  # fmt: skip
    return dataclasses.replace(carry, net=net, slots=slots, backend=backend, draws=draws), records


def _empty_review() -> ReviewRecord:
    zi, zf, zb = jnp.int32(0), jnp.float64(0), jnp.bool_(False)
    return ReviewRecord(valid=zb, t=zi, visit=zi, finalize=zb, author=zi, ability=zi, probe=zb, reviewer=zi,
                        samples=jnp.zeros(3), q0=zf, s_u=zf, committee=zb, member_a=zi, member_b=zi,
                        round1=jnp.zeros(2), round2=jnp.zeros(2), q=zf, takeover=zb,
                        obs=Observation(z=zf, z_defined=zb, before=zi, after=zi, reason=zi))  # fmt: skip


TRACES = {"run_rounds": 0}  # incremented at trace time: tests check one trace per shape

# XLA's CPU backend at optimisation level 1 instead of 2: the 576-agent program compiles in 10-13.5 s
# instead of 14 s and runs as fast (benchmarks/README.md, "second session"). Floating-point semantics
# are unchanged (no fast math at any level), so results are identical. A level the user set in
# XLA_FLAGS wins (an option passed to jit would override it): the test suite compiles at level 0.
COMPILER_OPTIONS = (
    {}
    if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    else {"xla_backend_optimization_level": 1}
)


# The carry is donated (decisions S9): XLA updates the network's windows and the slots in place
# instead of copying the whole carry in at every call; a caller must not read a carry it passed.
@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(3,), compiler_options=COMPILER_OPTIONS)
def run_rounds(
    cfg: EngineConfig, p: Params, world: World, carry: Carry, n_rounds: int, params_batched: bool = False
):
    """n_rounds rounds of every stream (leading stream axis on world and carry; on p too when
    params_batched, as when datasets differ in p_part or a parameter grid is swept). The carry
    passed in is donated: its buffers are reused for the returned carry and must not be read again
    (copy it first to keep it)."""
    TRACES["run_rounds"] += 1

    def step(p, world, carry):
        carry, records = round_step(cfg, p, world, carry)
        return carry, pack_records(cfg, records)

    def one_stream(p, world, carry):
        return jax.lax.scan(lambda c, _: step(p, world, c), carry, None, length=n_rounds)

    return jax.vmap(one_stream, in_axes=(0 if params_batched else None, 0, 0), axis_name=STREAMS)(
        p, world, carry
    )


# A round's records leave the scan as one (S, columns) array per dtype, not ~80 arrays: each
# stacked output is its own dynamic-update-slice kernel, compiled and launched every round.
# `host_records` takes them apart on the host (numpy views).
# The layout depends on the EngineConfig alone (record shapes are (S, ...) with fields sized by
# cfg); a trace that finds another layout for the same cfg is an error, not a silent overwrite.
_RECORD_LAYOUTS: dict = {}  # EngineConfig -> (treedef, per leaf (group, start, stop, trailing shape))


def pack_records(cfg: EngineConfig, records: RoundRecords) -> tuple[jax.Array, ...]:
    leaves, treedef = jax.tree_util.tree_flatten(records)
    dtypes = tuple(sorted({str(x.dtype) for x in leaves}))
    columns: dict[str, list] = {d: [] for d in dtypes}
    layout = []
    for x in leaves:
        group = columns[str(x.dtype)]
        start = sum(c.shape[1] for c in group)
        group.append(x.reshape(cfg.slots, -1))
        layout.append((dtypes.index(str(x.dtype)), start, start + group[-1].shape[1], x.shape[1:]))
    entry = (treedef, tuple(layout))
    if _RECORD_LAYOUTS.setdefault(cfg, entry) != entry:
        raise AssertionError(f"round records of one EngineConfig traced with two layouts: {cfg}")
    return tuple(jnp.concatenate(columns[d], axis=1) for d in dtypes)


def host_records(cfg: EngineConfig, packed) -> RoundRecords:
    """`run_rounds`' packed records as a RoundRecords of numpy arrays, leading (streams, rounds, S)."""
    treedef, layout = _RECORD_LAYOUTS[cfg]
    arrays = [np.asarray(a) for a in packed]
    leaves = [arrays[g][..., a:b].reshape(arrays[g].shape[:-1] + shape) for g, a, b, shape in layout]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# Run once per stream batch, so its speed does not matter: XLA's fastest compile (level 0).
@functools.partial(jax.jit, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0})
def initial_carries(cfg: EngineConfig, worlds: World) -> Carry:
    return jax.vmap(lambda w: initial_carry(cfg, w))(worlds)


def done(cfg: EngineConfig, carry: Carry) -> np.ndarray:
    """(streams,) bool: every task entered and every slot idle."""
    return (np.asarray(carry.next_t) > cfg.n_tasks) & np.all(np.asarray(carry.slots.phase) == IDLE, axis=-1)


# ----------------------------------------------------------------------------------------------
# Host side: build inputs, run chunks, gather records into the reference's tables
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StreamSpec:
    network: Network
    stream: Stream
    schedule: HealthSchedule
    pair: Pair
    labels: dict


TABLES = ("tasks", "reviews", "states", "calls")


def engine_config(specs: list[StreamSpec], protocol: ProtocolParams, slots: int) -> EngineConfig:
    """Static shapes for a batch of streams; rejects what cannot run, naming the fix."""
    first = specs[0]
    profile = first.network.profile
    n_tasks = first.stream.n_tasks
    cap = max(first.network.n_agents // 6, 1)
    if not 1 <= slots <= min(cap, n_tasks):
        raise MeshHealError(f"slots must be in 1..{min(cap, n_tasks)} (at most N/6 = {cap} and at most the "
                            f"{n_tasks} tasks), got {slots}")  # fmt: skip
    for spec in specs:
        if (
            spec.stream.n_tasks != n_tasks
            or spec.network.n_agents != first.network.n_agents
            or spec.pair.name != first.pair.name
        ):
            raise MeshHealError("streams batched together need the same length, agents and pair")
    return EngineConfig(
        n_agents=first.network.n_agents, n_abilities=len(profile.abilities), n_types=len(profile.task_types),
        n_tasks=n_tasks, slots=slots, window_scores=protocol.window_scores,
        window_shortfalls=protocol.window_shortfalls, route_loop=protocol.move_limit + 4,
        variant=protocol.variant, detector=protocol.detector, convergence=protocol.convergence,
        window_reset=protocol.window_reset,
    )  # fmt: skip


def params_per_stream(specs: list[StreamSpec]) -> bool:
    """Whether batched streams need one parameter pytree each: their datasets (p_part) or their
    pairs' files differ (the pair NAME may be shared by different files: a sweep, a fit's candidate)."""
    first = specs[0]
    return any(
        s.network.profile.dataset != first.network.profile.dataset or s.pair != first.pair for s in specs
    )


def stream_mesh(shard: bool | None = None) -> jax.sharding.Mesh | None:
    """A 1-D device mesh over the stream axis when streams should be sharded: shard=None shards
    whenever several devices are visible (GPUs, or CPU with
    XLA_FLAGS=--xla_force_host_platform_device_count=N), False never, True always (one device: a
    mesh of one)."""
    devices = jax.devices()
    if shard is False or (shard is None and len(devices) == 1):
        return None
    return jax.sharding.Mesh(np.array(devices), (STREAMS,))


def shard_streams(tree, mesh: jax.sharding.Mesh | None):
    """Place a pytree with a leading stream axis (a multiple of the mesh size) across the mesh:
    each device holds its block of streams. The compiled program is the same vmapped one; XLA
    partitions it along the stream axis (the one cross-stream value, `across_streams`' psum for
    the distance-refresh predicate, becomes a cross-device reduction), so results do not change."""
    if mesh is None:
        return tree
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(STREAMS))
    return jax.device_put(tree, sharding)


def default_chunk(slots: int, n_streams: int) -> int:
    """Rounds per compiled call: 512, fewer for wide batches so one call's records (~1 KB per slot
    and round, gathered to the host after the call) stay near 256 MB. Sized per lane (n_streams =
    a lane's width): lanes side by side hold that much each."""
    return int(min(512, max(8, 2**18 // max(slots * n_streams, 1))))


def pad_streams(items: list, mesh: jax.sharding.Mesh | None) -> list:
    """items (one per stream) with the last repeated up to a multiple of the mesh size (its copies'
    records are dropped)."""
    return items if mesh is None else list(items) + [items[-1]] * (-len(items) % mesh.size)


def default_lanes(n_streams: int, mesh: jax.sharding.Mesh | None = None) -> int:
    """Lanes for a batch (`run_batch`): on one CPU device, one per CPU core this process may use
    (at most one per stream); with a mesh or on an accelerator, 1 (docs/decisions.md S7)."""
    if mesh is not None or jax.default_backend() != "cpu" or jax.device_count() > 1:
        return 1
    return max(1, min(usable_cores(), n_streams))


def usable_cores() -> int:
    """The CPU cores this process may run on (a `taskset` or a job scheduler's limit counted)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def lane_streams(n_streams: int, lanes: int) -> list[list[int]]:
    """Stream indices of each lane: contiguous groups of near-equal size (the first ones one
    longer), the shorter ones padded with a copy of their last stream so every lane has the same
    shapes (one compiled program); a copy's records are dropped."""
    lanes = max(1, min(lanes, n_streams))
    width = -(-n_streams // lanes)
    groups, start = [], 0
    for k in range(lanes):
        stop = start + n_streams // lanes + (k < n_streams % lanes)
        groups.append(list(range(start, stop)) + [stop - 1] * (width - (stop - start)))
        start = stop
    return groups


def check_lanes(lanes: int, mesh: jax.sharding.Mesh | None) -> None:
    if lanes < 1 or (mesh is not None and lanes > 1):
        raise MeshHealError(f"--lanes must be >= 1, and 1 when the streams are sharded over several devices; "
                            f"got {lanes}")  # fmt: skip


def run_batch(cfg: EngineConfig, specs: list[StreamSpec], params, batched: bool, chunk: int | None = None,
              tables: tuple[str, ...] = TABLES, lanes: int | None = None, mesh: jax.sharding.Mesh | None = None,
              on_progress=None, timings: dict | None = None, cancel: threading.Event | None = None,
              checkpoints: Checkpoints | None = None) -> list[dict[str, pl.DataFrame]]:  # fmt: skip
    """The host loop: the streams' rounds, `chunk` per compiled call, until every stream is done;
    per stream the record tables named in `tables`. `cancel`: set by another thread to stop the
    lanes at their next chunk; the call then raises errors.Cancelled.

    params: one Params for every stream, or (batched) a list with one per stream. chunk: default
    `default_chunk` of a lane's width. The streams are split into `lanes` (default `default_lanes`) groups of equal width (`lane_streams`) run side by side, each by its own
    thread with its own carry: one program's small kernels keep about one core busy with useful
    work (XLA's hand-offs to its intra-op threads cost more than they gain on 2 cores), so each lane adds a
    core, and lanes of the same shapes share one compiled program
    (decisions S7). With a mesh (several devices) use one lane; its streams are padded to the mesh
    and sharded over it. `on_progress(done, total)` is called with the tasks done in all lanes;
    `timings`, when given, receives the slowest lane's seconds: first_call (trace, compile, chunk
    1), other_calls (the other chunks), records (arrays -> record tables) and calls (count).
    `checkpoints`: each stream starts from its checkpoint when it has one, and is checkpointed
    every `checkpoints.every_s` seconds, when its lane is stopped by `cancel` or another lane's
    failure (not by a KeyboardInterrupt raised in the lane's own thread: the runner runs lanes off
    the main thread and turns Ctrl-C into `cancel`), and at the end of a lane that ran longer than
    the interval (docs/decisions.md X1)."""
    lanes = default_lanes(len(specs), mesh) if lanes is None else lanes
    check_lanes(lanes, mesh)
    k_max = max(s.network.neighbour_table.shape[1] for s in specs)  # one shape for every lane
    groups = lane_streams(len(specs), lanes)
    chunk = default_chunk(cfg.slots, len(groups[0])) if chunk is None else chunk
    done_tasks = [0] * len(groups)
    lock = threading.Lock()
    stop = threading.Event()  # another lane failed or the caller was interrupted

    def lane(k: int, members: list[int]):
        try:
            return run_lane(k, members)
        except BaseException:
            stop.set()  # the other lanes stop at their next chunk
            raise

    def run_lane(k: int, members: list[int]):
        real = len(dict.fromkeys(members))  # the padding repeats the last member
        members = pad_streams(members, mesh)
        p = shard_streams(stack([params[m] for m in members]), mesh) if batched else params
        world = shard_streams(stack([make_world(specs[m].network, specs[m].stream, specs[m].schedule, k_max)
                                     for m in members]), mesh)  # fmt: skip
        carry = initial_carries(cfg, world)
        kept: list[list[dict]] = [[] for _ in range(real)]
        if checkpoints is not None:
            carry = restore(checkpoints, carry, members, kept, tables)
        carry = shard_streams(carry, mesh)
        unsaved = [0] * real  # chunks kept since each stream's last checkpoint
        started = saved_at = time.monotonic()

        def save() -> None:
            host = jax.device_get(carry)  # before the next call: run_rounds donates the carry
            entered = np.minimum(np.asarray(host.next_t) - 1, cfg.n_tasks)
            for s in range(real):
                if unsaved[s]:
                    checkpoints.save(members[s], at(host, s), kept[s][-unsaved[s] :], int(entered[s]))
                    unsaved[s] = 0

        clock = {"first_call": 0.0, "other_calls": 0.0, "records": 0.0, "calls": 0}
        while not (streams_done := done(cfg, carry)).all():
            if stop.is_set() or (cancel is not None and cancel.is_set()):
                if checkpoints is not None:
                    save()
                return None
            start = time.perf_counter()
            carry, records = run_rounds(cfg, p, world, carry, chunk, batched)
            records = jax.block_until_ready(records)
            clock["first_call" if clock["calls"] == 0 else "other_calls"] += time.perf_counter() - start
            clock["calls"] += 1
            start = time.perf_counter()
            records = host_records(cfg, records)
            for s in range(real):
                if not streams_done[s]:  # a stream done before this chunk has no records in it
                    kept[s].append(record_frames(specs[members[s]], at(records, s), tables))
                    unsaved[s] += 1
            clock["records"] += time.perf_counter() - start
            if checkpoints is not None and checkpoints.due(saved_at):
                save()
                saved_at = time.monotonic()
            if on_progress is not None:
                with lock:
                    done_tasks[k] = int(np.minimum(np.asarray(carry.next_t)[:real] - 1, cfg.n_tasks).sum())
                    on_progress(sum(done_tasks), cfg.n_tasks * len(specs))
        if checkpoints is not None and checkpoints.due(started):
            save()  # a lane that outlasted the interval: its records survive the other lanes' stop
        return [stream_tables(parts, tables) for parts in kept], clock

    if len(groups) == 1:
        finished = [lane(0, groups[0])]
    else:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="meshheal-lane") as pool:
            try:
                futures = [pool.submit(lane, k, members) for k, members in enumerate(groups)]
                while futures_wait(futures, timeout=0.2).not_done:
                    pass  # short waits: Ctrl-C reaches the main thread only while it runs Python
                finished = [future.result() for future in futures]
            # Ctrl-C: the lanes stop at their next chunk (a failing lane stops them itself)
            except BaseException:
                stop.set()
                raise
    if any(lane_out is None for lane_out in finished):
        raise Cancelled(f"run_batch cancelled before its {len(specs)} streams were done")
    if timings is not None:
        stages = ("first_call", "other_calls", "records")
        timings.update(
            max((c for _, c in finished), key=lambda c: sum(c[k] for k in stages)), lanes=len(groups)
        )
    return [frames for per_stream, _ in finished for frames in per_stream]


def restore(checkpoints: Checkpoints, carry: Carry, members: list[int], kept: list[list],
            tables: tuple[str, ...] = TABLES) -> Carry:  # fmt: skip
    """A lane's first carry with each stream that has a checkpoint (`checkpoints.restore`) set to
    it, that stream's records so far (of `tables`) added to `kept` (members: the lane's streams,
    padding copies included; kept: one list per real stream)."""
    committed = [checkpoints.committed(m) for m in members]  # every folder looked at (stray ones removed)
    if not any(committed):
        return carry
    host = jax.tree.map(np.array, jax.device_get(carry))  # writable copies
    restored = {}
    for s, m in enumerate(members):
        if m not in restored:
            restored[m] = checkpoints.restore(m, at(host, s), tables)
            if restored[m] is not None:
                kept[s].extend(restored[m][1])
        if restored[m] is not None:
            for leaf, value in zip(
                jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(restored[m][0])
            ):
                leaf[s] = value
    return jax.tree.map(jnp.asarray, host)


def run_streams(specs: list[StreamSpec], protocol: ProtocolParams, slots: int = 1, chunk: int | None = None,
                tables: tuple[str, ...] = TABLES, on_progress=None, shard: bool | None = None,
                lanes: int | None = None, cancel: threading.Event | None = None,
                checkpoints: Checkpoints | None = None) -> list[dict[str, pl.DataFrame]]:  # fmt: skip
    """Run streams of one shape, `chunk` rounds per compiled call, in `lanes` lanes side by side
    (`run_batch`'s defaults: `default_chunk` of a lane's width, `default_lanes`, one per CPU core).

    Returns per stream the record tables named in `tables` (polars frames with metrics.SCHEMAS).
    With several devices (`stream_mesh(shard)`), the streams are sharded over them in one lane;
    when their number is not a multiple of the devices, the last stream is repeated to fill the
    mesh and its copies are dropped. `cancel`, `checkpoints`: as `run_batch`'s."""
    cfg = engine_config(specs, protocol, slots)
    batched = params_per_stream(specs)
    if batched:
        params = [make_params(protocol, s.pair, s.network.profile, cfg.n_agents) for s in specs]
    else:
        params = make_params(protocol, specs[0].pair, specs[0].network.profile, cfg.n_agents)
    return run_batch(cfg, specs, params, batched, chunk, tables, lanes, stream_mesh(shard), on_progress,
                     cancel=cancel, checkpoints=checkpoints)  # fmt: skip


def _empty(table: str) -> pl.DataFrame:
    return pl.DataFrame(schema=SCHEMAS[table])


def stream_tables(
    parts: list[dict[str, pl.DataFrame]], tables: tuple[str, ...] = TABLES
) -> dict[str, pl.DataFrame]:
    """One stream's chunk frames joined. The tasks table is put in task order over the whole stream
    (a chunk's is in task order; with tasks in flight, one that starts earlier may finish in a later
    chunk), so a stream's tables do not depend on the chunk length, which follows the batch width;
    the other tables are in round order, which chunks keep."""
    out = {name: pl.concat([f[name] for f in parts]) if parts else _empty(name) for name in tables}
    if "tasks" in out:
        out["tasks"] = out["tasks"].sort("t", maintain_order=True)
    return out


def _labelled(spec: StreamSpec, table: str, columns: dict) -> pl.DataFrame:
    """Columns (numpy arrays or polars series) + the stream's labels -> a frame with the table's schema."""
    schema = SCHEMAS[table]
    frame = pl.DataFrame({k: v for k, v in columns.items()}).with_columns(
        pl.lit(v).alias(k) for k, v in spec.labels.items())  # fmt: skip
    return frame.select(pl.col(k).cast(dtype) for k, dtype in schema.items())


def _names(names, index) -> pl.Series:
    """names[index] as a string column (a gather, not a Python loop; a numpy string array would
    cost polars ~50 ms per 66,000 rows to convert)."""
    return pl.Series(list(names), dtype=pl.String).gather(np.asarray(index, dtype=np.int64))


def _where(mask, values):
    """A nullable column: values where mask, null elsewhere."""
    return (
        pl.Series(values).set(pl.Series(~np.asarray(mask, dtype=bool)), None)
        if len(values)
        else pl.Series(values)
    )


def record_frames(
    spec: StreamSpec, rec: RoundRecords, tables: tuple[str, ...] = TABLES
) -> dict[str, pl.DataFrame]:
    """One stream's (rounds, S, ...) records -> the record tables, vectorised (no per-row Python)."""
    out = {}
    models = (spec.pair.strong.model, spec.pair.weak.model)
    if "calls" in tables:
        rq, rs = rec.requests, rec.responses
        r_, k_, c_ = np.nonzero(rq.mask)
        kind = rq.kind[r_, k_, c_]
        infer = kind == K_INFER
        truth = rs.truth[r_, k_, c_]
        scored = np.isin(kind, (K_REVIEW, K_COMMITTEE1, K_COMMITTEE2))
        answers = rq.finalize[r_, k_] & np.isin(kind, (K_GENERATE, K_SYNTHESIS))
        out["calls"] = _labelled(spec, "calls", dict(
            t=rq.t[r_, k_], visit=rq.visit[r_, k_], kind=_names(CALL_KINDS, kind), agent=rq.agent[r_, k_, c_],
            author=np.where(infer, -1, rq.author[r_, k_]), ability=np.where(infer, -1, rq.ability[r_, k_]),
            model=_names(models, rs.role[r_, k_, c_]), prompt_tokens=rs.prompt_tokens[r_, k_, c_],
            completion_tokens=rs.completion_tokens[r_, k_, c_], latency_s=np.zeros(len(kind)),
            parse_status=_names(("ok",), np.zeros(len(kind), np.int64)), score=_where(scored, rs.score[r_, k_, c_]),
            answer_id=_where(answers, rs.answer_id[r_, k_]), correct=_where(truth >= 0, truth == 1),
        ))  # fmt: skip
    rv = rec.reviews
    r_, k_ = np.nonzero(rv.valid)
    committee = rv.committee[r_, k_]
    before, after = rv.obs.before[r_, k_], rv.obs.after[r_, k_]  # state indices (names: _names)
    z = _where(rv.obs.z_defined[r_, k_], rv.obs.z[r_, k_])
    truth = rec.review_truth[r_, k_]
    if "reviews" in tables:
        out["reviews"] = _labelled(spec, "reviews", dict(
            t=rv.t[r_, k_], visit=rv.visit[r_, k_], action=_names(("contribute", "finalize"), rv.finalize[r_, k_]),
            author=rv.author[r_, k_], ability=rv.ability[r_, k_], author_degraded=rec.author_degraded[r_, k_],
            author_model=_names(ROLE_NAMES, truth[:, 1]), part_correct=truth[:, 0] == 1, probe=rv.probe[r_, k_],
            reviewer=rv.reviewer[r_, k_], u1=rv.samples[r_, k_, 0], u2=rv.samples[r_, k_, 1], u3=rv.samples[r_, k_, 2],
            q0=rv.q0[r_, k_], s_u=rv.s_u[r_, k_], committee=committee,
            committee_a=np.where(committee, rv.member_a[r_, k_], -1), committee_b=np.where(committee, rv.member_b[r_, k_], -1),
            v_a1=_where(committee, rv.round1[r_, k_, 0]), v_b1=_where(committee, rv.round1[r_, k_, 1]),
            v_a=_where(committee, rv.round2[r_, k_, 0]), v_b=_where(committee, rv.round2[r_, k_, 1]),
            q=rv.q[r_, k_], takeover=rv.takeover[r_, k_], correct_before=truth[:, 2] == 1,
            correct_after=truth[:, 3] == 1, z=z, state_before=_names(STATE_NAMES, before), state_after=_names(STATE_NAMES, after),
        ))  # fmt: skip
    if "states" in tables:
        changed = before != after
        out["states"] = _labelled(spec, "states", {
            "t": rv.t[r_, k_][changed], "agent": rv.author[r_, k_][changed], "from": _names(STATE_NAMES, before[changed]),
            "to": _names(STATE_NAMES, after[changed]), "z": z.filter(pl.Series(changed)) if len(changed) else z,
            "reason": _names(REASON_NAMES, rv.obs.reason[r_, k_][changed]), "probe": rv.probe[r_, k_][changed],
            "degraded": rec.author_degraded[r_, k_][changed],
        })  # fmt: skip
    if "tasks" in tables:
        fs = rec.finished
        r_, k_ = np.nonzero(rec.finished_mask)
        t = fs.t[r_, k_]
        answered = fs.answered[r_, k_]
        prompt, completion = fs.prompt_tokens[r_, k_], fs.completion_tokens[r_, k_]
        names = dict(enumerate(ACTION_NAMES))
        paths = pl.DataFrame({"route": fs.route[r_, k_], "route_len": fs.route_len[r_, k_],
                              "actions": fs.actions[r_, k_], "n_actions": fs.n_actions[r_, k_]}).select(
            pl.col("route").arr.to_list().list.head(pl.col("route_len"))
            .list.eval(pl.element().cast(pl.String)).list.join("-"),
            pl.col("actions").arr.to_list().list.head(pl.col("n_actions"))
            .list.eval(pl.element().replace_strict(names, return_dtype=pl.String)).list.join(","),
        )  # fmt: skip
        frame = _labelled(spec, "tasks", dict(
            t=t, task_type=np.asarray(spec.stream.task_type)[t - 1], phase=np.asarray(spec.stream.phase)[t - 1],
            entry=fs.entry[r_, k_], route=paths["route"], actions=paths["actions"], moves=fs.moves[r_, k_],
            answered=answered, correct=rec.finished_truth[r_, k_, 0] == 1,
            answer_id=np.where(answered, fs.answer_id[r_, k_], -1), inferred_pair=fs.pair[r_, k_],
            pair_correct=rec.finished_truth[r_, k_, 1] == 1, unreviewed=fs.unreviewed[r_, k_],
            end=_names(END_NAMES, fs.end[r_, k_]), calls=fs.calls[r_, k_], prompt_tokens=prompt,
            completion_tokens=completion, tokens=prompt + completion,
        ))  # fmt: skip
        out["tasks"] = frame.sort("t")
    return out
