"""The shared world every baseline runs in (spec/baselines.md, spec/emulator.md).

Same task order (streams), agents and abilities (Network), model-backed rule, degradation
schedule, emulator call model (model parameter files) and distractor ids as MeshHeal. What is
shared here:

- `World` (per-stream constants, the health schedule read only by the backend functions) and
  `Emu` (the pair's emulator parameters, with token figures for the baselines' own call kinds);
- the backend functions `emulate_infer`, `emulate_generate`, `review_score` (the emulator's
  rules, spec/emulator.md and docs/decisions.md E2/E4/E6/E7/E8, written independently of
  engine.py);
- `run_path`: one H/C/F execution (Handoff / Contribute / Finalize, protocol.md §3 without
  review, isolation or probes) whose next-hop choice and on-arrival calls are the method's hooks;
- the extra per-task uniforms a baseline needs beyond `draws.TaskDraws`, each derived as
  `fold_in(draws.task_key(seed, dataset, t), field)` with a documented field id >= 100;
- `Call` / `Review` record pytrees and the host-side conversion into `metrics.SCHEMAS` rows.

Conventions (spec/architecture.md "Randomness"): Bernoulli(p) is `u < p`; a uniform pick among
n candidates in increasing index is `min(floor(u n), n - 1)`; categoricals read the cumulative
thresholds of the model files. Uniforms are float64, counts int32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import polars as pl

from meshheal_jax import draws as D
from meshheal_jax import metrics
from meshheal_jax.device import on_device
from meshheal_jax.draws import categorical, pick_from_mask, pick_index  # noqa: F401 (re-exported for the methods)
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import ANCHORS, TOKEN_KINDS, Pair, threshold_table
from meshheal_jax.streams import HealthSchedule, Stream
from meshheal_jax.topology import Network, Profile

jax.config.update("jax_enable_x64", True)

INF = 2**30  # unreachable hop distance (named sentinel, see STYLE.md)
TOL = 1e-9  # threshold tolerance in favour of crossing (spec/architecture.md)
STRONG, WEAK = 0, 1
ROLE_NAMES = ("strong", "weak")

# ------------------------------------------------------------------------------------------------
# Call kinds, actions, end reasons
# ------------------------------------------------------------------------------------------------

KINDS = ("infer", "generate", "router", "watchdog", "select", "compose", "evaluate", "refine", "cot")
K_INFER, K_GENERATE, K_ROUTER, K_WATCHDOG, K_SELECT, K_COMPOSE, K_EVALUATE, K_REFINE, K_COT = range(
    len(KINDS)
)
# The model file's token figures each kind reads (decisions B0): compose, refine and extra
# chain-of-thought samples their own (spec/emulator.md); (ours) decision calls those of
# InferAbilities, judgements those of a review sample.
TOKEN_SOURCE = {
    "infer": "infer", "generate": "generate", "router": "infer", "watchdog": "review",
    "select": "infer", "compose": "compose", "evaluate": "review", "refine": "refine",
    "cot": "cot",
}  # fmt: skip
SCORED_KINDS = (K_WATCHDOG, K_EVALUATE)

ACTIONS = (
    "infer", "contribute", "finalize", "handoff", "forward", "select", "reselect", "compose",
    "evaluate", "refine", "vote", "rerun",
)  # fmt: skip
(A_INFER, A_CONTRIBUTE, A_FINALIZE, A_HANDOFF, A_FORWARD, A_SELECT, A_RESELECT, A_COMPOSE,
 A_EVALUATE, A_REFINE, A_VOTE, A_RERUN) = range(len(ACTIONS))  # fmt: skip
ENDS = ("", "move budget", "unreachable ability", "no route", "forward limit")
E_NONE, E_BUDGET, E_UNREACHABLE, E_NO_ROUTE, E_FORWARD_LIMIT = range(len(ENDS))
REVIEW_ACTIONS = ("watchdog", "evaluate", "self_evaluate")
R_WATCHDOG, R_EVALUATE, R_SELF_EVALUATE = range(len(REVIEW_ACTIONS))
ROUTE_SEP = -2  # separates the routes of several executions of one task (SAC teams, plans)

MAX_PATH_ROUTE = D.N_VISITS + 1  # entry + at most 8 moves (+1 spare)
MAX_PATH_ACTIONS = 2 * D.N_VISITS + 2
CALLS_PER_VISIT = 3  # on-arrival call (watchdog), generation, next-hop call (router)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The shared H/C/F move budget (protocol.md §3): moves since the last output and in all."""

    route_limit: int = 4
    move_limit: int = 8


# ------------------------------------------------------------------------------------------------
# Extra per-task uniforms (field ids >= 100 never collide with draws.py's fields 0-3)
# ------------------------------------------------------------------------------------------------

FIELD_PARALLEL = 100  # (N_PARALLEL, PARALLEL_FLAT): draw layouts of extra parallel executions 1..4
FIELD_CONTROL = 110  # (N_CONTROL, N_CALL_U): a method's control calls (router, selection, compose, SAC)
N_PARALLEL = 4
N_CONTROL = 32
# One parallel execution's row of field 100, in order: entry (1), infer (N_INFER), route
# (N_VISITS x N_ROUTE), calls (N_VISITS x N_CALL_SLOTS x N_CALL_U) -- the TaskDraws layout.
_PARALLEL_SHAPES = ((), (D.N_INFER,), (D.N_VISITS, D.N_ROUTE), (D.N_VISITS, D.N_CALL_SLOTS, D.N_CALL_U))
PARALLEL_FLAT = sum(int(np.prod(s)) for s in _PARALLEL_SHAPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TaskUniforms:
    """Every uniform a baseline's task t may consume (leading axes added by batching)."""

    task: D.TaskDraws  # draws.task_draws(seed, dataset, t): execution 0, exactly MeshHeal's draws
    parallel: D.TaskDraws  # (N_PARALLEL,) leading axis: executions 1..4 (field 100)
    control: jax.Array  # (N_CONTROL, N_CALL_U) control-call uniforms (field 110)

    def execution(self, k: int) -> D.TaskDraws:
        """The draw layout of parallel execution k (0 = the task's own draws)."""
        if k == 0:
            return self.task
        return jax.tree_util.tree_map(lambda x: x[k - 1], self.parallel)


def _field(key, field: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.uniform(jax.random.fold_in(key, field), shape, dtype=jnp.float64)


def split_parallel(flat) -> D.TaskDraws:
    """(..., PARALLEL_FLAT) uniforms -> a TaskDraws with the same leading axes."""
    lead = flat.shape[:-1]
    parts, start = [], 0
    for shape in _PARALLEL_SHAPES:
        size = int(np.prod(shape))
        parts.append(flat[..., start : start + size].reshape(lead + shape))
        start += size
    return D.TaskDraws(*parts)


def extra_uniforms(seed, dataset_id, t) -> tuple[D.TaskDraws, jax.Array]:
    """Fields 100 (parallel executions) and 110 (control calls) of task t."""
    key = D.task_key(seed, dataset_id, t)
    return split_parallel(_field(key, FIELD_PARALLEL, (N_PARALLEL, PARALLEL_FLAT))), _field(
        key, FIELD_CONTROL, (N_CONTROL, D.N_CALL_U))  # fmt: skip


def task_uniforms(seed, dataset_id, t) -> TaskUniforms:
    parallel, control = extra_uniforms(seed, dataset_id, t)
    return TaskUniforms(D.task_draws(seed, dataset_id, t), parallel, control)


# Compile time dominates the baselines' programs (a full 504-task stream runs in well under a
# second on a CPU), so on the CPU backend XLA's LLVM optimisation and its newer fusion emitters
# are switched off: less than half the compile time, identical results.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def cpu_jit(fun, static_argnums: tuple[int, ...]):
    """jax.jit with CPU_COMPILER_OPTIONS on the CPU backend (plain jit elsewhere, or where this
    XLA build does not know the options)."""
    plain = jax.jit(fun, static_argnums=static_argnums)
    fast = jax.jit(fun, static_argnums=static_argnums, compiler_options=CPU_COMPILER_OPTIONS)

    @functools.wraps(fun)
    def call(*args):
        if jax.default_backend() == "cpu":
            try:
                return fast(*args)
            except Exception as err:  # only an unknown option falls back
                if "compile option" not in str(err):
                    raise
        return plain(*args)

    return call


def _stream_extras_impl(seed, dataset_id, n_tasks: int):
    ts = jnp.arange(1, n_tasks + 1, dtype=jnp.int32)
    return jax.vmap(extra_uniforms, in_axes=(None, None, 0))(seed, dataset_id, ts)


# Not cpu_jit: the extras are threefry bits (integer ops, the same bits at any optimisation level),
# and unoptimised they ran 7x slower (31 against 4.6 ms per 504-task stream, which every method
# pays for every stream) for 0.6 s less compile.
_stream_extras = jax.jit(_stream_extras_impl, static_argnums=(2,))


def stream_uniforms(seed: int, dataset_id: int, n_tasks: int) -> TaskUniforms:
    """Tasks 1..n_tasks' uniforms (numpy, leading (n_tasks,)); one compiled program per length,
    shared by every method; the task draws come from draws.stream_draws itself."""
    parallel, control = _stream_extras(np.int32(seed), np.int32(dataset_id), n_tasks)
    task = D.stream_draws(seed, dataset_id, n_tasks)
    return jax.tree_util.tree_map(np.asarray, TaskUniforms(task, parallel, control))


# ------------------------------------------------------------------------------------------------
# Pytrees: world, emulator parameters
# ------------------------------------------------------------------------------------------------


def pytree(cls):
    """Frozen dataclass registered as a pytree (fields with metadata static=True are static)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def static_field(default):
    return dataclasses.field(default=default, metadata={"static": True})


@pytree
class World:
    """Per-stream constants. `degraded` is read only by the backend (role_of)."""

    holds: jax.Array  # (N, A) bool
    adjacency: jax.Array  # (N, N) bool
    hop_distance: jax.Array  # (N, A) int32 hops to the nearest holder (static graph), INF if none
    task_type: jax.Array  # (n_tasks,) int32
    difficulty: jax.Array  # (n_tasks,) int32 difficulty bin of each task's question [backend only]
    question_tokens: jax.Array  # (n_tasks,) int32 tokens of each task's question [backend only]
    true_pair: jax.Array  # (T,) int32 documented pair of each task type
    pair_abilities: jax.Array  # (P, A) bool, P padded to T
    pair_valid: jax.Array  # (P,) bool
    type_abilities: jax.Array  # (T, A) bool: the abilities of each task type's documented pair
    degraded: jax.Array  # (n_tasks + 1, N) bool  [backend only]
    stream: jax.Array  # () int32 the stream's place in its batch: which stream a live call is for


@pytree
class Emu:
    """The pair's emulator parameters; axis 0 of every (2, ...) field is (strong, weak)."""

    p_infer: jax.Array  # (2,)
    p_part: jax.Array  # (2, T, DIFFICULTY_BINS)
    p_rescue: jax.Array  # (2,)
    p_decide: jax.Array  # (2,)
    p_fix: jax.Array  # (2,)
    p_keep: jax.Array  # (2,)
    answer_fraction: jax.Array  # (2,)
    # (2 reviewer, 2 author role, 3 judged classes (params.JUDGED_*), DIFFICULTY_BINS, 4 anchors)
    review_thr: jax.Array
    distractor_thr: jax.Array  # (2, n_distractors)
    completion: jax.Array  # (2, len(KINDS), 2 [min, max]) int32
    prompt: jax.Array  # (2, len(KINDS)) int32 template tokens
    live: bool = static_field(False)  # True: the calls go to the live host (`live_reply`), not the emulator


def hop_distances(holds: np.ndarray, adjacency: np.ndarray) -> np.ndarray:
    """(N, A) BFS hops from each agent to the nearest holder of each ability (INF if none)."""
    n = holds.shape[0]
    dist = np.where(holds, 0, INF).astype(np.int64)
    for _ in range(n):
        through = np.where(adjacency[:, :, None], dist[None, :, :] + 1, INF).min(axis=1)
        dist = np.minimum(dist, through)
    return np.minimum(dist, INF).astype(np.int32)


def make_world(network: Network, stream: Stream, schedule: HealthSchedule, index: int) -> World:
    """The stream's constants; `index`: its place in the batch it runs in (the live host's key)."""
    profile = network.profile
    n_types = len(profile.task_types)
    pair_abilities = np.zeros((n_types, len(profile.abilities)), dtype=bool)
    for k, pair in enumerate(profile.pairs):
        pair_abilities[k, sorted(pair)] = True
    true_pair = np.asarray([profile.pair_index(ty) for ty in range(n_types)], dtype=np.int32)
    if schedule.n_agents != network.n_agents or schedule.n_tasks != stream.n_tasks:
        raise MeshHealError(
            f"schedule is for {schedule.n_agents} agents / {schedule.n_tasks} tasks, "
            f"stream and network have {network.n_agents} / {stream.n_tasks}"
        )
    return World(
        holds=on_device(network.holds, bool), adjacency=on_device(network.adjacency, bool),
        hop_distance=on_device(hop_distances(network.holds, network.adjacency), np.int32),
        task_type=on_device(stream.task_type, np.int32), true_pair=on_device(true_pair, np.int32),
        difficulty=on_device(stream.difficulty, np.int32),
        question_tokens=on_device(stream.question_tokens_or(profile.question_tokens), np.int32),
        pair_abilities=on_device(pair_abilities, bool),
        pair_valid=on_device(np.arange(n_types) < len(profile.pairs), bool),
        type_abilities=on_device(pair_abilities[true_pair], bool),
        degraded=on_device(schedule.degraded_matrix(), bool),
        stream=on_device(index, np.int32),
    )  # fmt: skip


def make_emu(pair: Pair, profile: Profile, live: bool = False) -> Emu:
    models = (pair.strong, pair.weak)
    if pair.strong.n_distractors != pair.weak.n_distractors:
        raise MeshHealError("both models of a pair must have the same n_distractors")
    f = functools.partial(on_device, dtype=np.float64)
    return Emu(
        p_infer=f([m.p_infer for m in models]), p_part=f([m.p_part_for(profile) for m in models]),
        p_rescue=f([m.p_rescue for m in models]), p_decide=f([m.p_decide for m in models]),
        p_fix=f([m.p_fix for m in models]), p_keep=f([m.p_keep for m in models]),
        answer_fraction=f([m.answer_fraction for m in models]), review_thr=f(threshold_table(pair, "review")),
        distractor_thr=f([m.distractor_thresholds() for m in models]),
        completion=on_device([[m.completion_tokens[TOKEN_SOURCE[k]] for k in KINDS] for m in models], np.int32),
        prompt=on_device([[m.prompt_tokens[TOKEN_SOURCE[k]] for k in KINDS] for m in models], np.int32),
        live=live,
    )  # fmt: skip


assert set(TOKEN_SOURCE.values()) <= set(TOKEN_KINDS)


# ------------------------------------------------------------------------------------------------
# Small pure helpers (the draw conventions themselves live in draws.py)
# ------------------------------------------------------------------------------------------------


def first_true(mask):
    return jnp.argmax(mask).astype(jnp.int32)


def last_true(mask):
    return (mask.shape[-1] - 1 - jnp.argmax(mask[::-1])).astype(jnp.int32)


def select_tree(cond, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(cond, x, y), a, b)


# ------------------------------------------------------------------------------------------------
# The live backend's hook (emu.live): the calls of one call site, for every stream at once
# ------------------------------------------------------------------------------------------------

# What every live call returns (unused fields keep their defaults): review-like scores, the judged
# final answer's id (0 = gold, k >= 1 = the k-th distinct wrong answer of the task, decisions B7),
# a named agent, the inferred pair, the real token counts and the request id (its trace row).
REPLY_FIELDS = {
    "score": np.float64, "own_score": np.float64, "answer_id": np.int32, "choice": np.int32,
    "pair": np.int32, "prompt": np.int32, "completion": np.int32, "request": np.int32, "non_empty": np.int32,
}  # fmt: skip
LIVE_OPS = ("infer", "generate", "watchdog", "router", "select", "compose", "evaluate", "refine")


class LiveReply(NamedTuple):
    score: jax.Array
    own_score: jax.Array
    answer_id: jax.Array
    choice: jax.Array
    pair: jax.Array
    prompt: jax.Array
    completion: jax.Array
    request: jax.Array
    non_empty: jax.Array  # a generation's reply had text (Symphony's reward)


_HOST: list = [None]  # the host answering live calls while `live_host(host)` is active


@contextlib.contextmanager
def live_host(host):
    """Make `host` (backends.live_baselines.LiveBaselineHost) answer the live calls of the
    programs run inside the block."""
    if _HOST[0] is not None:
        raise MeshHealError("a live baseline run is already in progress in this process")
    _HOST[0] = host
    try:
        yield host
    finally:
        _HOST[0] = None


def _answer(op: str, valid, scalars, vectors):
    host = _HOST[0]
    if host is None:  # a program still running after its run was abandoned: send nothing
        return {k: np.full(np.shape(valid), _DEFAULTS[k], dtype) for k, dtype in REPLY_FIELDS.items()}
    out = host.answer(op, np.asarray(valid), {k: np.asarray(v) for k, v in scalars.items()},
                      {k: np.asarray(v) for k, v in vectors.items()})  # fmt: skip
    shape = np.shape(valid)
    return {k: np.broadcast_to(np.asarray(out.get(k, _DEFAULTS[k]), dtype), shape).astype(dtype)
            for k, dtype in REPLY_FIELDS.items()}  # fmt: skip


_DEFAULTS = {"score": np.nan, "own_score": np.nan, "answer_id": -1, "choice": -1, "pair": -1, "prompt": 0,
             "completion": 0, "request": -1, "non_empty": 1}  # fmt: skip


def live_reply(op: str, world: World, t, valid, *, after=0, vectors=None, **fields) -> LiveReply:
    """The live calls of one call site: one per True element of `valid` (any shape; vmap over
    streams adds leading axes and the host receives them all in one callback, so they go out as
    one batch). `fields` are per-call scalars broadcast to valid's shape; `vectors` per-call
    vectors (valid's shape + (K,)); `after` any value the call must wait for (a data dependency:
    the texts it reads were written by the calls that produced it)."""
    if op not in LIVE_OPS:
        raise MeshHealError(f"unknown live call {op!r}")
    valid = jnp.asarray(valid, bool)
    shape = valid.shape
    wait = jnp.sum(jnp.asarray(after, jnp.float64))
    scalars = {"stream": world.stream, "t": t, "after": wait, **fields}
    scalars = {k: jnp.broadcast_to(jnp.asarray(v), shape) for k, v in scalars.items()}
    vectors = {
        k: jnp.broadcast_to(jnp.asarray(v), shape + jnp.shape(v)[-1:]) for k, v in (vectors or {}).items()
    }
    result = {k: jax.ShapeDtypeStruct(shape, dtype) for k, dtype in REPLY_FIELDS.items()}
    out = jax.pure_callback(functools.partial(_answer, op), result, valid, scalars, vectors,
                            vmap_method="broadcast_all")  # fmt: skip
    return LiveReply(**out)


# ------------------------------------------------------------------------------------------------
# The backend: model-backed rule and the emulator's call model
# ------------------------------------------------------------------------------------------------


JUDGE_RULES = ("ability", "caller")  # RAPS watchdogs, SAC evaluations (decisions B0)


def check_judge_rule(method: str, rule: str) -> None:
    if rule not in JUDGE_RULES:
        raise MeshHealError(f"{method}: judge_rule must be one of {JUDGE_RULES}, got {rule!r}")


def role_of(world: World, agent, ability, t):
    """Model-backed rule: STRONG iff the agent is healthy at task t and (no ability, or held)."""
    agent = jnp.maximum(agent, 0)
    held = jnp.where(ability < 0, True, world.holds[agent, jnp.maximum(ability, 0)])
    return jnp.where(world.degraded[t, agent] | ~held, WEAK, STRONG).astype(jnp.int32)


def completion_tokens(emu: Emu, role, kind, u):
    lo, hi = emu.completion[role, kind, 0], emu.completion[role, kind, 1]
    return jnp.minimum(lo + jnp.floor(u * (hi - lo + 1).astype(jnp.float64)).astype(jnp.int32), hi)


def visible_tokens(emu: Emu, role, completion):
    return jnp.floor(completion.astype(jnp.float64) * emu.answer_fraction[role]).astype(jnp.int32)


def distractor(emu: Emu, role, u):
    """A wrong final answer's id: 1 + categorical over the writing model's distractor thresholds."""
    return 1 + categorical(u, emu.distractor_thr[role])


def review_score(emu: Emu, world: World, t, reviewer_role, author_role, correct, u):
    """One review sample on the anchors (reviewer model, author model, judged output correct?,
    task t's question difficulty)."""
    correct = jnp.asarray(correct).astype(jnp.int32)
    thresholds = emu.review_thr[reviewer_role, author_role, correct, world.difficulty[t - 1]]
    return jnp.asarray(ANCHORS)[categorical(u, thresholds)]


@pytree
class Call:
    """One model call as the calls table records it (a fixed slot; `valid` masks unused slots)."""

    valid: jax.Array  # bool
    kind: jax.Array  # KINDS index
    visit: jax.Array  # the execution's moves count on arrival at the calling agent
    agent: jax.Array  # calling agent
    author: jax.Array  # author of the judged/refined output, -1 none
    ability: jax.Array  # the ability the call is about, -1 none
    role: jax.Array  # STRONG / WEAK (which model served it)
    prompt: jax.Array  # int32
    completion: jax.Array  # int32
    score: jax.Array  # float64, NaN where the kind has no score
    answer_id: jax.Array  # final-answer id carried by the call, -1 none
    correct: jax.Array  # latent truth for the trace: 1 / 0, -1 none
    request: jax.Array  # the live host's request id (its trace row), -1 emulated


def make_call(valid, kind, visit, agent, role, prompt, completion, *, author=-1, ability=-1,
              score=jnp.nan, answer_id=-1, correct=-1, request=-1) -> Call:  # fmt: skip
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    valid = jnp.asarray(valid, dtype=bool)
    call = Call(
        valid=valid, kind=i32(kind), visit=i32(visit), agent=i32(agent), author=i32(author),
        ability=i32(ability), role=i32(role), prompt=jnp.where(valid, i32(prompt), 0),
        completion=jnp.where(valid, i32(completion), 0), score=jnp.asarray(score, jnp.float64),
        answer_id=i32(answer_id), correct=i32(correct), request=i32(request),
    )  # fmt: skip
    return broadcast(call)


def broadcast(tree):
    """Broadcast every leaf to the leaves' common shape (records built from arrays and scalars)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, jnp.broadcast_arrays(*leaves))


def no_call() -> Call:
    return make_call(False, 0, 0, -1, 0, 0, 0)


@pytree
class Review:
    """A judgement a method makes (RAPS watchdog, SAC evaluation) in the reviews table."""

    valid: jax.Array  # bool
    action: jax.Array  # REVIEW_ACTIONS index
    visit: jax.Array
    author: jax.Array
    ability: jax.Array
    reviewer: jax.Array
    score: jax.Array  # float64
    author_role: jax.Array  # which model wrote the judged output [backend, records only]
    correct: jax.Array  # bool: judged output correct [backend, records only]


def make_review(valid, action, visit, author, ability, reviewer, score, author_role, correct) -> Review:
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    return broadcast(Review(
        valid=jnp.asarray(valid, dtype=bool), action=i32(action), visit=i32(visit), author=i32(author),
        ability=i32(ability), reviewer=i32(reviewer), score=jnp.asarray(score, jnp.float64),
        author_role=i32(author_role), correct=jnp.asarray(correct, dtype=bool),
    ))  # fmt: skip


def no_review() -> Review:
    return make_review(False, 0, 0, -1, -1, -1, 0.0, 0, False)


def stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def concat(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *trees)


def flatten(tree):
    """Merge the leading two axes of every leaf."""
    return jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def emulate_infer(emu: Emu, world: World, agent, t, task_type, u_infer, visit=0, valid=True, execution=0):
    """InferAbilities by `agent` (no ability: strong iff healthy). Returns (pair, pair_ok, call)."""
    role = role_of(world, agent, -1, t)
    true_pair = world.true_pair[task_type]
    if emu.live:
        r = live_reply("infer", world, t, valid, agent=agent, role=role, execution=execution, visit=visit)
        ok = r.pair == true_pair
        call = make_call(valid, K_INFER, visit, agent, role, r.prompt, r.completion, correct=ok.astype(jnp.int32),
                         request=r.request)  # fmt: skip
        return jnp.where(r.pair >= 0, r.pair, true_pair).astype(jnp.int32), ok, call
    others = world.pair_valid & (jnp.arange(world.pair_valid.shape[0]) != true_pair)
    ok = (u_infer[D.INFER_CORRECT] < emu.p_infer[role]) | ~others.any()
    inferred = jnp.where(ok, true_pair, pick_from_mask(u_infer[D.INFER_WRONG_PAIR], others)).astype(jnp.int32)
    call = make_call(
        valid, K_INFER, visit, agent, role, emu.prompt[role, K_INFER] + world.question_tokens[t - 1],
        completion_tokens(emu, role, K_INFER, u_infer[D.INFER_TOKENS]), correct=ok.astype(jnp.int32),
    )  # fmt: skip
    return inferred, ok, call


class Generation(NamedTuple):
    part_ok: jax.Array  # bool: the part's latent bit
    answer_ok: jax.Array  # bool: final answer correct (finalize only, else False)
    answer_id: jax.Array  # int32: 0 gold, k >= 1 distractor (finalize only, else -1)
    role: jax.Array  # which model wrote it
    tokens: jax.Array  # visible output tokens (what later calls see)
    non_empty: jax.Array  # bool: the output has text (always, emulated: a gray failure answers)


def emulate_generate(emu: Emu, world: World, t, task_type, agent, ability, finalize, pair_ok, draft_ok,
                     draft_tokens, u, visit, valid=True, kind=K_GENERATE, execution=0) -> tuple[Generation, Call]:  # fmt: skip
    """A Contribute part or a Finalize answer (decisions E4, E6, E7). Live: the answer is judged
    against the gold by the host; a part has no gold (part_ok False), as in MeshHeal's live records."""
    role = role_of(world, agent, ability, t)
    if emu.live:
        finalize = jnp.asarray(finalize, bool)
        r = live_reply("generate", world, t, valid, after=draft_tokens, agent=agent, role=role, ability=ability,
                       finalize=finalize, kind=kind, execution=execution, visit=visit)  # fmt: skip
        answer_id = jnp.where(finalize, r.answer_id, -1).astype(jnp.int32)
        answer_ok = finalize & (answer_id == 0)
        call = make_call(valid, kind, visit, agent, role, r.prompt, r.completion, author=agent, ability=ability,
                         answer_id=answer_id, correct=jnp.where(finalize, answer_ok.astype(jnp.int32), -1),
                         request=r.request)  # fmt: skip
        return Generation(
            jnp.bool_(False) & finalize, answer_ok, answer_id, role, r.completion, r.non_empty > 0
        ), call
    q = world.difficulty[t - 1]  # the question's difficulty bin
    part_ok = u[D.U_MAIN] < emu.p_part[role, task_type, q]
    answer_ok = jnp.where(
        pair_ok, part_ok & (draft_ok | (u[D.U_AUX] < emu.p_rescue[role])), u[D.U_AUX] < emu.p_part[WEAK, task_type, q]
    )  # fmt: skip
    answer_ok = answer_ok & finalize
    answer_id = jnp.where(finalize, jnp.where(answer_ok, 0, distractor(emu, role, u[D.U_DISTRACTOR])), -1)
    completion = completion_tokens(emu, role, kind, u[D.U_TOKENS])
    prompt = emu.prompt[role, kind] + world.question_tokens[t - 1] + draft_tokens
    call = make_call(
        valid, kind, visit, agent, role, prompt, completion, author=agent, ability=ability, answer_id=answer_id,
        correct=jnp.where(finalize, answer_ok, part_ok).astype(jnp.int32),
    )  # fmt: skip
    return Generation(
        part_ok,
        answer_ok,
        answer_id.astype(jnp.int32),
        role,
        visible_tokens(emu, role, completion),
        jnp.bool_(True),
    ), call


# ------------------------------------------------------------------------------------------------
# One H/C/F execution with method hooks
# ------------------------------------------------------------------------------------------------


@pytree
class Path:
    """One execution's state (protocol.md §3 without review, isolation or probes)."""

    agent: jax.Array  # current agent
    covered: jax.Array  # (A,) bool
    moves: jax.Array  # moves so far (= the next visit's index)
    since: jax.Array  # moves since the last output
    done: jax.Array  # bool
    answered: jax.Array  # bool
    end: jax.Array  # ENDS index
    draft_ok: jax.Array  # bool: every accepted part correct [backend]
    draft_tokens: jax.Array  # visible tokens of the accepted parts
    pending: jax.Array  # bool: an output the next agent receives (RAPS watchdog)
    out_author: jax.Array
    out_ability: jax.Array
    out_ok: jax.Array  # [backend]
    out_role: jax.Array  # [backend]
    out_tokens: jax.Array
    out_visit: jax.Array  # visit at which the pending output was produced
    out_context: jax.Array  # draft tokens the pending output was produced on
    answer_ok: jax.Array  # [backend]
    answer_id: jax.Array
    answer_role: jax.Array  # [backend]
    answer_tokens: jax.Array
    finalizer: jax.Array  # -1 until answered
    fin_ability: jax.Array
    route: jax.Array  # (MAX_PATH_ROUTE,) agents in order, -1 padding
    route_len: jax.Array
    actions: jax.Array  # (MAX_PATH_ACTIONS,) ACTIONS indices, -1 padding
    n_actions: jax.Array


def _log(path: Path, action, cond) -> Path:
    actions = jnp.where(cond, path.actions.at[path.n_actions].set(action), path.actions)
    return dataclasses.replace(path, actions=actions, n_actions=path.n_actions + cond.astype(jnp.int32))


def start_path(n_abilities: int, entry) -> Path:
    i, b = jnp.int32(0), jnp.bool_(False)
    path = Path(
        agent=jnp.int32(entry), covered=jnp.zeros(n_abilities, bool), moves=i, since=i, done=b, answered=b,
        end=i, draft_ok=jnp.bool_(True), draft_tokens=i, pending=b, out_author=i - 1, out_ability=i - 1,
        out_ok=b, out_role=i, out_tokens=i, out_visit=i, out_context=i, answer_ok=b, answer_id=i - 1,
        answer_role=i, answer_tokens=i, finalizer=i - 1, fin_ability=i - 1,
        route=jnp.full(MAX_PATH_ROUTE, -1, jnp.int32).at[0].set(entry), route_len=jnp.int32(1),
        actions=jnp.full(MAX_PATH_ACTIONS, -1, jnp.int32), n_actions=i,
    )  # fmt: skip
    return _log(path, A_INFER, jnp.bool_(True))


class Hop(NamedTuple):
    """A next-hop decision: the agent (or -1), the end reason if none, the call it cost."""

    agent: jax.Array
    end: jax.Array
    call: Call


Arrive = Callable  # (mstate, path, visit, valid) -> (mstate, Call, Review)
Choose = Callable  # (mstate, path, visit, missing, valid) -> (mstate, Hop)
# `valid`: whether the hook's call is really made (a live hook sends only those)


def no_arrival(mstate, path, visit, valid):
    return mstate, no_call(), no_review()


def run_path(emu: Emu, world: World, t, task_type, entry, required, pair_ok, u_calls, *, choose: Choose,
             arrive: Arrive = no_arrival, mstate=None, budget: Budget = Budget(), forward_limit: int | None = None,
             move_action: int = A_HANDOFF, execution=0):  # fmt: skip
    """Route one task from `entry` until a Finalize (or a budget/route failure).

    Per visit v (= moves on arrival): the on-arrival hook (e.g. the receiver's watchdog on the
    output it just received), then Contribute/Finalize if the agent holds a missing ability
    (generation uniforms u_calls[v, GENERATE]), then, unless finished, the next hop chosen by the
    method's hook. Budget checks come before the hook is asked (a task out of budget makes no
    router call). Returns (mstate, path, calls (N_VISITS * CALLS_PER_VISIT,), reviews (N_VISITS,)).
    """

    def visit(carry, v):
        mstate, path = carry
        active = ~path.done
        # 1. the on-arrival hook sees the pending output
        new_m, call_a, review = arrive(mstate, path, v, active & path.pending)
        mstate = select_tree(active & path.pending, new_m, mstate)
        call_a = dataclasses.replace(call_a, valid=call_a.valid & active & path.pending)
        review = dataclasses.replace(review, valid=review.valid & active & path.pending)
        path = dataclasses.replace(path, pending=jnp.bool_(False))
        # 2. Contribute / Finalize
        i = path.agent
        missing = required & ~path.covered
        held = world.holds[i] & missing
        work = active & held.any()
        s = first_true(held)
        finalize = ~jnp.any(missing & ~held)
        gen, call_g = emulate_generate(emu, world, t, task_type, i, s, finalize, pair_ok, path.draft_ok,
                                       path.draft_tokens, u_calls[v, D.GENERATE], v, valid=work,
                                       execution=execution)  # fmt: skip
        finished = work & finalize
        contributed = work & ~finalize
        path = _log(path, jnp.where(finalize, A_FINALIZE, A_CONTRIBUTE), work)
        path = dataclasses.replace(
            path,
            done=path.done | finished, answered=path.answered | finished,
            answer_ok=jnp.where(finished, gen.answer_ok, path.answer_ok),
            answer_id=jnp.where(finished, gen.answer_id, path.answer_id),
            answer_role=jnp.where(finished, gen.role, path.answer_role),
            answer_tokens=jnp.where(finished, gen.tokens, path.answer_tokens),
            finalizer=jnp.where(finished, i, path.finalizer), fin_ability=jnp.where(finished, s, path.fin_ability),
            covered=jnp.where(contributed, path.covered.at[s].set(True), path.covered),
            since=jnp.where(contributed, 0, path.since),
            pending=contributed, out_author=jnp.where(contributed, i, path.out_author),
            out_ability=jnp.where(contributed, s, path.out_ability),
            out_ok=jnp.where(contributed, gen.part_ok, path.out_ok),
            out_role=jnp.where(contributed, gen.role, path.out_role),
            out_tokens=jnp.where(contributed, gen.tokens, path.out_tokens),
            out_visit=jnp.where(contributed, v, path.out_visit),
            out_context=jnp.where(contributed, path.draft_tokens, path.out_context),
            draft_ok=jnp.where(contributed, path.draft_ok & gen.part_ok, path.draft_ok),
            draft_tokens=jnp.where(contributed, path.draft_tokens + gen.tokens, path.draft_tokens),
        )  # fmt: skip
        # 3. the next hop
        need = active & ~finished
        over_budget = (path.moves + 1 > budget.move_limit) | (path.since + 1 > budget.route_limit)
        over_forwards = jnp.bool_(False) if forward_limit is None else path.moves + 1 > forward_limit
        ask = need & ~over_budget & ~over_forwards
        missing = required & ~path.covered
        new_m, hop = choose(mstate, path, v, missing, ask)
        mstate = select_tree(ask, new_m, mstate)
        call_c = dataclasses.replace(hop.call, valid=hop.call.valid & ask)
        failed = need & (over_budget | over_forwards | (hop.agent < 0))
        end = jnp.where(over_forwards, E_FORWARD_LIMIT, jnp.where(over_budget, E_BUDGET, hop.end))
        moved = ask & (hop.agent >= 0)
        path = _log(path, move_action, moved)
        path = dataclasses.replace(
            path,
            done=path.done | failed, end=jnp.where(failed, end, path.end).astype(jnp.int32),
            agent=jnp.where(moved, hop.agent, path.agent).astype(jnp.int32),
            moves=path.moves + moved, since=path.since + moved,
            route=jnp.where(moved, path.route.at[path.route_len].set(hop.agent), path.route),
            route_len=path.route_len + moved,
        )  # fmt: skip
        return (mstate, path), (stack([call_a, call_g, call_c]), review)

    path = start_path(world.holds.shape[1], entry)
    (mstate, path), (calls, reviews) = jax.lax.scan(
        visit, (mstate, path), jnp.arange(D.N_VISITS, dtype=jnp.int32)
    )
    unfinished = ~path.done  # cannot happen with move_limit <= 8; kept as a guard
    path = dataclasses.replace(path, done=jnp.bool_(True), end=jnp.where(unfinished, E_BUDGET, path.end))
    return mstate, path, flatten(calls), reviews


def shortest_path_hop(
    world: World, agent, missing, u_route_v, ties: str = "random"
) -> tuple[jax.Array, jax.Array]:
    """The shared execution layer's next hop (protocol.md §3 on the static graph, no isolation):
    a missing ability by the visit's HOP_ABILITY uniform, then a neighbour one hop closer to its
    nearest holder by HOP_TIE, or the lowest index with ties="lowest" (ProtocolParams.next_hop_ties).
    Returns (agent or -1, end reason)."""
    s = pick_from_mask(u_route_v[D.HOP_ABILITY], missing)
    d = world.hop_distance[agent, jnp.maximum(s, 0)]
    hops = world.adjacency[agent] & (world.hop_distance[:, jnp.maximum(s, 0)] == d - 1)
    j = pick_from_mask(u_route_v[D.HOP_TIE] if ties == "random" else 0.0, hops)
    bad = (d >= INF) | (s < 0) | (j < 0)
    return jnp.where(bad, -1, j).astype(jnp.int32), jnp.where(bad, E_UNREACHABLE, E_NONE).astype(jnp.int32)


def default_choose(world: World, u_route, ties: str = "random"):
    """The shared routing as a run_path hook (no model call)."""

    def choose(mstate, path, v, missing, valid):
        j, end = shortest_path_hop(world, path.agent, missing, u_route[v], ties)
        return mstate, Hop(j, end, no_call())

    return choose


# ------------------------------------------------------------------------------------------------
# A task's record
# ------------------------------------------------------------------------------------------------


@pytree
class TaskOut:
    """What one task leaves in the records (fixed shapes per method)."""

    entry: jax.Array
    route: jax.Array  # (R,) agents; ROUTE_SEP between executions; -1 padding
    actions: jax.Array  # (M,) ACTIONS indices; -1 padding
    moves: jax.Array
    answered: jax.Array
    correct: jax.Array  # [backend truth, records only]
    answer_id: jax.Array
    inferred_pair: jax.Array
    pair_correct: jax.Array
    end: jax.Array
    calls: Call  # (K,)
    reviews: Review  # (V,)


def path_route(path: Path) -> jax.Array:
    """The path's route followed by a separator."""
    return jnp.concatenate([path.route, jnp.array([ROUTE_SEP], jnp.int32)])


# ------------------------------------------------------------------------------------------------
# Host side: records -> metrics.SCHEMAS rows
# ------------------------------------------------------------------------------------------------


def frames(
    out: TaskOut,
    stream: Stream,
    schedule: HealthSchedule,
    pair: Pair,
    labels: dict,
    trace: dict | None = None,
) -> dict[str, pl.DataFrame]:
    """One stream's (n_tasks, ...) TaskOut (numpy) -> the four tables as polars frames with the
    columns of metrics.SCHEMAS, built column by column (a row is a task, a valid call slot, a
    valid review slot; rows in task order, then slot order). `trace` (live): request id -> the
    live trace row, whose model, latency and parse status the calls table takes."""
    degraded = schedule.degraded_matrix()
    c = out.calls
    k, slot = np.nonzero(c.valid)
    kind = c.kind[k, slot]
    score = c.score[k, slot].astype(np.float64)
    answer_id = c.answer_id[k, slot].astype(np.int64)
    correct = c.correct[k, slot]
    model = np.asarray((pair.strong.model, pair.weak.model), dtype=object)[c.role[k, slot]]
    latency, status = np.zeros(len(k)), np.full(len(k), "ok", dtype=object)
    if trace is not None:
        for i, request in enumerate(c.request[k, slot].tolist()):
            real = trace.get(request)
            if real is not None:
                model[i], latency[i], status[i] = real["model_id"], real["latency_s"], real["parse_status"]
    calls = {
        "t": k + 1, "visit": c.visit[k, slot], "kind": np.asarray(KINDS, dtype=object)[kind],
        "agent": c.agent[k, slot], "author": c.author[k, slot], "ability": c.ability[k, slot], "model": model,
        "prompt_tokens": c.prompt[k, slot], "completion_tokens": c.completion[k, slot], "latency_s": latency,
        "parse_status": status, "score": _nulls(score, ~np.isin(kind, SCORED_KINDS) | np.isnan(score)),
        "answer_id": _nulls(answer_id, answer_id < 0), "correct": _nulls(correct == 1, correct < 0),
    }  # fmt: skip
    r = out.reviews
    k, slot = np.nonzero(r.valid)
    author = r.author[k, slot]
    score = r.score[k, slot].astype(np.float64)
    ok = r.correct[k, slot].astype(bool)
    reviews = {
        "t": k + 1, "visit": r.visit[k, slot], "action": np.asarray(REVIEW_ACTIONS, dtype=object)[r.action[k, slot]],
        "author": author, "ability": r.ability[k, slot], "author_degraded": degraded[k + 1, author],
        "author_model": np.asarray(ROLE_NAMES, dtype=object)[r.author_role[k, slot]], "part_correct": ok,
        "probe": False, "reviewer": r.reviewer[k, slot], "u1": score, "q0": score, "committee": False,
        "committee_a": -1, "committee_b": -1, "q": score, "takeover": False, "correct_before": ok,
        "correct_after": ok,
    }  # fmt: skip
    valid = c.valid
    prompt = np.where(valid, c.prompt, 0).sum(axis=1)
    completion = np.where(valid, c.completion, 0).sum(axis=1)
    answered = out.answered.astype(bool)
    tasks = {
        "t": np.arange(1, stream.n_tasks + 1), "task_type": stream.task_type, "phase": stream.phase,
        "entry": out.entry, "route": [_route_text(route) for route in out.route.tolist()],
        "actions": [",".join(ACTIONS[a] for a in row if a >= 0) for row in out.actions.tolist()],
        "moves": out.moves, "answered": answered, "correct": out.correct.astype(bool) & answered,
        "answer_id": np.where(answered, out.answer_id, -1), "inferred_pair": out.inferred_pair,
        "pair_correct": out.pair_correct.astype(bool), "unreviewed": 0,
        "end": np.asarray(ENDS, dtype=object)[out.end], "calls": valid.sum(axis=1), "prompt_tokens": prompt,
        "completion_tokens": completion, "tokens": prompt + completion,
    }  # fmt: skip
    return {name: _frame(name, columns, labels)
            for name, columns in (("tasks", tasks), ("reviews", reviews), ("states", {}), ("calls", calls))}  # fmt: skip


def _nulls(values: np.ndarray, null: np.ndarray) -> pl.Series:
    """values with null where `null` is True."""
    return pl.Series(values).scatter(np.flatnonzero(null), None)


def _route_text(route: list[int]) -> str:
    """A task's route as text: agents joined by '-', executions (split at ROUTE_SEP) by '|'; the
    -1 padding and empty executions dropped."""
    executions, current = [], []
    for a in route:
        if a == ROUTE_SEP:
            executions.append(current)
            current = []
        elif a >= 0:
            current.append(str(a))
    executions.append(current)
    return "|".join("-".join(e) for e in executions if e)


def _frame(name: str, columns: dict, labels: dict) -> pl.DataFrame:
    """A table's frame in metrics.SCHEMAS order and types: `columns` (arrays, or scalars repeated
    on every row), the labels' values on every row, null in every other column."""
    schema = metrics.SCHEMAS[name]
    height = max((len(v) for v in columns.values() if not np.isscalar(v)), default=0)

    def column(key: str, dtype) -> pl.Series:
        value = columns[key] if key in columns else labels.get(key)
        if value is None or np.isscalar(value):
            return pl.repeat(value, height, dtype=dtype, eager=True).alias(key)
        return pl.Series(key, value).cast(dtype)

    return pl.DataFrame([column(key, dtype) for key, dtype in schema.items()])
