"""The live host loop: the JAX controller driving real models (spec/live.md, architecture.md
"Live backend", "In-flight tasks", "What the controller may know").

    frames = run_live_streams(specs, protocol, LiveConfig(servers=(strong, weak)), load_sample("bbh"),
                              run_dir=Path("runs/live-x"))

One round, for ALL streams at once:

1. `begin_round` (jitted once per (cfg, params batched?) and vmapped over the stream axis, like
   `engine.run_rounds`): idle slots take their next task, then every slot emits its requests
   ((streams, S, 3) arrays with a mask).
2. Host side, for every masked call: the prompt is built from the TEXT STORE (`_TaskText`, one
   per (stream, t): the dataset question picked for the task, the outputs accepted so far (the
   draft), the output currently under review, the committee's round-1 / round-2 verdicts, the
   Takeover candidates) with `meshheal_jax.prompts`; the model role is resolved HERE, by the
   backend, from the stream's health schedule (model-backed rule, never in the controller):
   strong iff the calling agent is healthy at task t and holds the call's ability (inference,
   tied to no ability: strong iff healthy).
3. Every request of every stream goes out in ONE `SyncLiveClient.run_batch` (the three initial
   review samples are one request with n = 3); the client caches each reply as it arrives.
4. Replies are parsed into the `Responses` arrays: review scores on the anchor grid (parse
   failures: the parser's neutral 0.5), the inferred pair as the profile's pair index (failures:
   the documented pair), generated text kept in the store, final answers (Finalize generation,
   Finalize synthesis) judged against the gold with `scoring.judge` -> answer_id 0 correct /
   1 wrong; tokens from usage (an n = 3 request's usage split evenly over its three samples, so
   sums are exact); role = the model that answered.
5. The backend's latent state (`Carry.backend`, read only for the records' truth columns) gets
   what the live backend knows: the inferred pair's correctness (the profile documents the true
   pair), the role that wrote the judged part, the final answer's correctness (after Takeover
   too). A partial result's correctness has no gold: `part_correct` stays False in live records.
6. `absorb_round` (jitted, vmapped) applies the responses.

Records: tasks / reviews / states / calls from `engine.record_frames`; the calls table's
`model`, `latency_s` and `parse_status` are replaced by the real ones (`trace_rows` of every
request, mapped per sample). With `run_dir`, the raw per-request trace is appended to
`run_dir/live_trace.parquet` (a resumed call adds its rows after the earlier call's; replayed ones
are marked `from_cache`) and the response cache defaults to `run_dir/responses.sqlite`.

Resume: every HTTP reply is written to the `ResponseCache` as it arrives (decisions L2). Re-running the
same call replays the whole loop from task 1: the controller is deterministic and every prompt,
seed and sampling parameter is the same, so each request is a cache hit and nothing already
received is sent again; the run continues where the replies stop. Limits: the controller state is
not checkpointed (the replay recomputes it, cheap next to the model calls); a change to anything
in a prompt (prompt wording, dataset rows, protocol parameters that change the path, model ids,
max tokens, sampling) makes new requests; a retry-after-parse-failure or n-fallback request is
cached as well, but a round interrupted mid-way is re-sent only for what did not arrive.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import polars as pl

from meshheal_jax import engine, prompts, scoring
from meshheal_jax.backends.cache import CACHE_FILE, ResponseCache
from meshheal_jax.backends.live import (
    CallRequest,
    CallResponse,
    RetryPolicy,
    Sampling,
    ServerGroup,
    SyncLiveClient,
    request_seed,
    trace_rows,
)
from meshheal_jax.config import ProtocolParams
from meshheal_jax.data import Record, pick_questions, question_pool
from meshheal_jax.errors import MeshHealError, MeshHealWarning
from meshheal_jax.params import CALL_KINDS

ROLE_NAMES = engine.ROLE_NAMES  # ("strong", "weak"): index = engine.STRONG / engine.WEAK
TRACE_FILE = "live_trace.parquet"
DEFAULT_MAX_COMPLETION_TOKENS = {
    "infer": 1024, "generate": 4096, "review": 2048, "committee1": 2048, "committee2": 2048,
    "candidate": 4096, "synthesis": 4096,
    # the baselines' own kinds (backends/live_baselines.py)
    "router": 1024, "watchdog": 2048, "select": 1024, "compose": 4096, "evaluate": 2048, "refine": 4096,
    "cot": 4096,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LiveOptions:
    """How requests are built (independent of which servers answer them)."""

    max_completion_tokens: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_MAX_COMPLETION_TOKENS)
    )
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    inference_examples: bool = True  # one example question per task type in the inference prompt

    def tokens_for(self, kind: str) -> int:
        if kind not in self.max_completion_tokens:
            raise MeshHealError(f"live backend: no max_completion_tokens for call kind {kind!r}")
        return int(self.max_completion_tokens[kind])


@dataclasses.dataclass(frozen=True)
class LiveConfig:
    """What `run_live_streams` needs to open (and close) its own `SyncLiveClient`."""

    servers: tuple[ServerGroup, ...]
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    cache_path: Path | None = None  # None: run_dir/responses.sqlite (no cache without run_dir)
    api_key: str | None = None  # None: from MESHHEAL_API_KEY / VLLM_API_KEY / OPENAI_API_KEY
    pair: tuple[str, dict[str, str]] | None = None  # (name, role -> the model id of its file): checked


class PairModelWarning(MeshHealWarning):
    """A live run labelled with a pair whose model files name other models than the servers serve."""


def check_pair_models(pair: tuple[str, Mapping[str, str]], served: Mapping[str, str]) -> None:
    """Warn when a role's server serves another hub model than the pair's file names (a local path
    is not compared): the results would be labelled with a pair they do not come from."""
    name, expected = pair
    for role, model in expected.items():
        got = served.get(role)
        if got and not got.startswith(("/", ".")) and got.lower() != model.lower():
            warnings.warn(f"live backend: pair {name}'s {role} model is {model}, but the {role} server serves "
                          f"{got}; the results are labelled pair {name} (--pair, or --{role}-model to name it)",
                          PairModelWarning, stacklevel=2)  # fmt: skip


TRACES = {"begin": 0, "absorb": 0}  # incremented at trace time: one trace per (cfg, batched)


def append_trace(path: Path, rows: list[dict]) -> Path:
    """Append a call's per-request trace rows to the parquet file at `path`: an interrupted
    call's rows stay, and the resumed call's follow them (a replay's marked `from_cache`, so an
    identical re-run adds a full set of cached rows: select `~from_cache` for what was sent).
    Written to a temporary file and moved into place, so a crash mid-write keeps the old file.
    When the old file cannot be read or its columns do not combine with the new rows, it is left
    as it is and the rows go to a new file beside it (`live_trace.1.parquet`, ...), whose path
    is returned (a warning names it)."""
    trace = pl.DataFrame(rows, infer_schema_length=None)
    if path.exists():
        try:
            trace = pl.concat([pl.read_parquet(path), trace], how="diagonal_relaxed")
        except (OSError, pl.exceptions.PolarsError) as err:  # unreadable, or columns that do not combine
            k = 1
            while path.with_name(f"{path.stem}.{k}{path.suffix}").exists():
                k += 1
            side = path.with_name(f"{path.stem}.{k}{path.suffix}")
            warnings.warn(f"{path} not appended to ({type(err).__name__}: {err}); this call's trace is in {side}",
                          stacklevel=2)  # fmt: skip
            path = side
    partial = path.with_name(path.name + ".partial")
    trace.write_parquet(partial)
    os.replace(partial, path)
    return path


# ----------------------------------------------------------------------------------------------
# The jitted controller halves, vmapped over streams


@functools.partial(jax.jit, static_argnums=(0, 4))
def _begin(cfg: engine.EngineConfig, p, worlds, carry, params_batched: bool):
    TRACES["begin"] += 1
    return jax.vmap(
        lambda p_, w, c: engine.begin_round(cfg, p_, w, c),
        in_axes=(0 if params_batched else None, 0, 0), axis_name=engine.STREAMS,
    )(p, worlds, carry)  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 6))
def _absorb(cfg: engine.EngineConfig, p, worlds, carry, requests, responses, params_batched: bool):
    TRACES["absorb"] += 1
    return jax.vmap(
        lambda p_, w, c, rq, rs: engine.absorb_round(cfg, p_, w, c, rq, rs),
        in_axes=(0 if params_batched else None, 0, 0, 0, 0), axis_name=engine.STREAMS,
    )(p, worlds, carry, requests, responses)  # fmt: skip


def _compile_absorb(pool: ThreadPoolExecutor, cfg: engine.EngineConfig, p, worlds, carry,
                    params_batched: bool) -> Future:  # fmt: skip
    """Compile `_absorb` on a worker thread while the caller compiles `_begin` and sends the first
    round's requests (the two compiles overlap on two cores, and absorb's with the first round's
    model latency; docs/decisions.md S8). It is compiled the only way that fills the jit's own
    cache: by calling it, here on a round with no requests (mask all False) from the initial
    carry, its backend rebuilt as `_backend_state` rebuilds it, so every argument has the shape,
    dtype and weak type of the real first call's and the loop's first `_absorb` call finds it
    compiled. The call is pure and its result is dropped; the future's result is None, or the
    compile's exception."""

    def work() -> None:
        _, requests = jax.eval_shape(lambda c: _begin(cfg, p, worlds, c, params_batched), carry)
        requests = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), requests)
        n_streams, n_slots = requests.mask.shape[:2]
        empty = np.zeros((n_streams, n_slots), np.int32)
        before = dataclasses.replace(carry, backend=_backend_state(carry.backend, [], {}, empty))
        responses = engine.Responses(
            **{k: jnp.asarray(v) for k, v in _empty_responses(n_streams, n_slots).items()}
        )
        jax.block_until_ready(_absorb(cfg, p, worlds, before, requests, responses, params_batched))

    return pool.submit(work)


# ----------------------------------------------------------------------------------------------
# The host-side text store


@dataclasses.dataclass
class _TaskText:
    """Everything textual about one in-flight task (stream, t); JAX holds only its numbers."""

    record: Record
    base: prompts.TaskText  # question, type, options (accepted filled per prompt)
    accepted: list[prompts.PriorOutput] = dataclasses.field(default_factory=list)
    pending: prompts.PriorOutput | None = None  # the output kept at this visit, not yet in the draft
    output: str = ""  # the output currently judged (author's generation, or the synthesis)
    round1: dict[int, prompts.ReviewVerdict] = dataclasses.field(default_factory=dict)
    round2: dict[int, prompts.ReviewVerdict] = dataclasses.field(default_factory=dict)
    candidates: dict[int, str] = dataclasses.field(default_factory=dict)
    next_call: int = 0  # call ids (seeds) in the order the task makes its requests
    # what the live backend knows of the truth (Carry.backend; records only)
    pair_ok: bool = False
    part_role: int = engine.STRONG
    answer_ok: bool = False
    result_ok: bool = False

    def task(self) -> prompts.TaskText:
        return dataclasses.replace(self.base, accepted=tuple(self.accepted))

    def call_id(self) -> int:
        self.next_call += 1
        return self.next_call - 1


@dataclasses.dataclass
class _Stream:
    """Per-stream constants the host loop reads."""

    spec: engine.StreamSpec
    records: tuple[Record, ...]  # (n_tasks,) the question of every task
    degraded: np.ndarray  # (n_tasks + 1, N) bool
    examples: dict[str, str]  # task type -> example question (inference prompt)
    true_pair: list[int]  # per task type: the documented pair's index

    @property
    def profile(self):
        return self.spec.network.profile


@dataclasses.dataclass
class _Pending:
    """One CallRequest of the round and the (stream, slot, calls) it answers."""

    stream: int
    slot: int
    calls: tuple[int, ...]  # call positions (0..2) of the slot this request covers (n = len)
    phase: int
    request: CallRequest


def _records_for(questions, dataset: str) -> Sequence[Record]:
    if isinstance(questions, Mapping):
        if dataset not in questions:
            raise MeshHealError(
                f"live backend: no questions given for dataset {dataset!r}; have {sorted(questions)}"
            )
        return questions[dataset]
    return questions


def _prepare_stream(spec: engine.StreamSpec, questions) -> _Stream:
    profile = spec.network.profile
    pool = question_pool(_records_for(questions, profile.dataset), profile.task_types)
    pick = pick_questions(
        pool, spec.stream.task_type, spec.stream.question, spec.stream.seed, spec.stream.dataset_id
    )
    examples = {tt: rows[0].question for tt, rows in zip(profile.task_types, pool)}
    return _Stream(
        spec=spec, records=pick.records, degraded=spec.schedule.degraded_matrix(), examples=examples,
        true_pair=[profile.pair_index(ty) for ty in range(len(profile.task_types))],
    )  # fmt: skip


def _role(stream: _Stream, agent: int, ability: int, t: int) -> int:
    """Model-backed rule (backend only): STRONG iff healthy at t and (no ability, or it is held)."""
    holds = stream.spec.network.holds
    held = True if ability < 0 else bool(holds[agent, ability])
    return engine.STRONG if held and not stream.degraded[t, agent] else engine.WEAK


def _abilities(stream: _Stream, ids) -> tuple[prompts.AbilityRef, ...]:
    return prompts.abilities_of(stream.profile, [int(i) for i in ids])


def _agent_abilities(stream: _Stream, agent: int) -> tuple[prompts.AbilityRef, ...]:
    return _abilities(stream, np.flatnonzero(stream.spec.network.holds[agent]))


# ----------------------------------------------------------------------------------------------
# Requests from the emitted arrays


def _request(stream: _Stream, s: int, t: int, text: _TaskText, options: LiveOptions, author: int, kind: int,
             agent: int, messages, call_ability: int, **kw) -> CallRequest:  # fmt: skip
    """One CallRequest; its role from the model-backed rule, its seed from (stream, t, call id)."""
    name = CALL_KINDS[kind]
    call_id = text.call_id()  # per task, in request order: deterministic on a replay
    return CallRequest(
        stream=s, t=t, call_id=call_id, kind=name, role=ROLE_NAMES[_role(stream, agent, call_ability, t)],
        messages=messages, seed=request_seed(stream.spec.stream.seed, stream.spec.stream.dataset_id, t, call_id),
        max_completion_tokens=options.tokens_for(name), sampling=options.sampling, agent=agent,
        author=-1 if kind == engine.K_INFER else author, **kw,
    )  # fmt: skip


def _build_requests(
    streams: list[_Stream], store: dict, rq, options: LiveOptions
) -> list[_Pending]:  # fmt: skip
    out: list[_Pending] = []
    n_slots = rq.mask.shape[1]
    for s, stream in enumerate(streams):
        profile = stream.profile
        dataset = profile.dataset
        for k in range(n_slots):
            mask = rq.mask[s, k]
            if not mask.any():
                continue
            t = int(rq.t[s, k])
            phase = int(rq.phase[s, k])
            text = store.get((s, t))
            if text is None:
                record = stream.records[t - 1]
                base = prompts.TaskText(dataset, record.question, record.task_type, record.options)
                text = store[(s, t)] = _TaskText(record, base)
            ability = int(rq.ability[s, k])
            author = int(rq.author[s, k])
            finalize = bool(rq.finalize[s, k])
            stage = "finalize" if finalize else "contribute"
            judged = _abilities(stream, [ability])
            agents = [int(a) for a in rq.agent[s, k]]
            kinds = [int(x) for x in rq.kind[s, k]]

            request = functools.partial(_request, stream, s, t, text, options, author)

            if phase == engine.INFER:
                record = text.record
                examples = stream.examples if options.inference_examples else None
                messages = prompts.inference_messages(
                    profile, record.question, record.task_type, examples, record.options
                )
                req = request(engine.K_INFER, agents[0], messages, -1,
                              response_format=prompts.inference_response_format(profile),
                              parser=prompts.inference_parser(profile, record.task_type))  # fmt: skip
                out.append(_Pending(s, k, (0,), phase, req))
            elif phase == engine.GENERATE:
                if text.pending is not None:  # the previous Contribute's kept output joins the draft
                    text.accepted.append(text.pending)
                    text.pending = None
                text.round1, text.round2, text.candidates = {}, {}, {}
                pair = profile.pairs[int(rq.inferred_pair[s, k])]
                covered = {a for prior in text.accepted for a in prior.abilities}
                remaining = sorted(i for i in pair if profile.abilities[i] not in covered)
                if finalize and not text.accepted:
                    directive, abilities, missing = "full", _abilities(stream, remaining or [ability]), ()
                elif finalize:
                    directive, abilities, missing = "partial", _abilities(stream, remaining or [ability]), ()
                else:
                    directive, abilities = "partial", judged
                    missing = _abilities(stream, [i for i in remaining if i != ability])
                messages = prompts.execution_messages(text.task(), abilities, directive, stage, missing)
                req = request(engine.K_GENERATE, agents[0], messages, ability,
                              parser=prompts.execution_parser(dataset))  # fmt: skip
                out.append(_Pending(s, k, (0,), phase, req))
            elif phase == engine.REVIEW:
                reviewer = agents[0]
                messages = prompts.review_messages(text.task(), stage, text.output, judged,
                                                   _agent_abilities(stream, reviewer))  # fmt: skip
                req = request(engine.K_REVIEW, reviewer, messages, ability, n=3,
                              response_format=prompts.review_response_format(stage),
                              parser=prompts.review_parser(stage))  # fmt: skip
                out.append(_Pending(s, k, (0, 1, 2), phase, req))
            else:
                for c in np.flatnonzero(mask):
                    c = int(c)
                    member = agents[c]
                    mine = _agent_abilities(stream, member)
                    if phase == engine.ROUND1:
                        messages = prompts.review_messages(text.task(), stage, text.output, judged, mine)
                    elif phase == engine.ROUND2:
                        own, other = text.round1.get(c), text.round1.get(1 - c)
                        if own is None or other is None:
                            raise MeshHealError(
                                f"live backend: round 2 of (stream {s}, t {t}) without round 1"
                            )
                        messages = prompts.committee_round2_messages(
                            text.task(), stage, text.output, judged, mine,
                            prompts.RoundOneView(own.score, own.explanation),
                            prompts.RoundOneView(other.score, other.explanation),
                        )  # fmt: skip
                    elif phase == engine.CANDIDATES or (phase == engine.SYNTH and not text.candidates):
                        # a correction candidate; a synthesis without candidates is single_reviewer's
                        # one correction call (decisions V2), which writes the correction itself (the
                        # full variant's synthesis always follows its two candidate calls)
                        verdicts = [text.round2[i] for i in sorted(text.round2)] or [
                            text.round1[i] for i in sorted(text.round1)
                        ]
                        messages = prompts.candidate_messages(text.task(), stage, text.output, judged, mine,
                                                              [v.explanation for v in verdicts])  # fmt: skip
                    elif phase == engine.SYNTH:
                        candidates = [text.candidates[i] for i in sorted(text.candidates)]
                        messages = prompts.synthesis_messages(text.task(), stage, candidates, judged, mine)
                    else:
                        raise MeshHealError(f"live backend: unexpected phase {phase} with calls")
                    if phase in (engine.ROUND1, engine.ROUND2):
                        kw = {"response_format": prompts.review_response_format(stage),
                              "parser": prompts.review_parser(stage)}  # fmt: skip
                    else:
                        kw = {"parser": prompts.execution_parser(dataset)}
                    out.append(
                        _Pending(s, k, (c,), phase, request(kinds[c], member, messages, ability, **kw))
                    )
    return out


# ----------------------------------------------------------------------------------------------
# Responses into the arrays


def _split(total: int, n: int) -> list[int]:
    """total over n samples, exactly (remainder to the first samples)."""
    base, rest = divmod(int(total), n)
    return [base + (i < rest) for i in range(n)]


def _final_correct(stream: _Stream, record: Record, reply: str) -> bool:
    return scoring.judge(stream.profile.dataset, reply, record.gold, record.options).correct


def _empty_responses(n_streams: int, n_slots: int) -> dict[str, np.ndarray]:
    z3 = (n_streams, n_slots, 3)
    return {
        "score": np.zeros(z3), "pair": np.zeros((n_streams, n_slots), np.int32),
        "answer_id": np.zeros((n_streams, n_slots), np.int32), "prompt_tokens": np.zeros(z3, np.int32),
        "completion_tokens": np.zeros(z3, np.int32), "parse_ok": np.zeros(z3, bool),
        "role": np.zeros(z3, np.int32), "truth": np.full(z3, -1, np.int32),
    }  # fmt: skip


def _absorb_replies(streams, store, pending: list[_Pending], replies: list[CallResponse], rows: list[dict],
                    arrays: dict, extra: dict) -> None:  # fmt: skip
    """Parse every reply into the response arrays and the text store (arrays filled in place)."""
    for item, reply, row in zip(pending, replies, rows, strict=True):
        s, k, calls = item.stream, item.slot, item.calls
        stream = streams[s]
        req = item.request
        text = store[(s, req.t)]
        role = ROLE_NAMES.index(req.role)
        n = len(calls)
        prompt, completion = _split(reply.prompt_tokens, n), _split(reply.completion_tokens, n)
        statuses = row["parse_status"].split(",")
        for i, c in enumerate(calls):
            arrays["prompt_tokens"][s, k, c] = prompt[i]
            arrays["completion_tokens"][s, k, c] = completion[i]
            arrays["parse_ok"][s, k, c] = True  # a reply was read (the parser's fallback after a failure)
            arrays["role"][s, k, c] = role
            extra["latency"][s, k, c] = row["latency_s"]
            extra["status"][s, k, c] = statuses[i]
            extra["model"][s, k, c] = row["model_id"]
        phase = item.phase
        c = calls[0]
        if phase == engine.INFER:
            pair = int(reply.parsed[0].pair_index)
            arrays["pair"][s, k] = pair
            true_pair = stream.true_pair[stream.profile.task_types.index(text.record.task_type)]
            text.pair_ok = pair == true_pair
            arrays["truth"][s, k, 0] = int(text.pair_ok)
        elif phase in (engine.GENERATE, engine.SYNTH):
            output = reply.texts[0]
            ability_name = stream.profile.abilities[int(extra["ability"][s, k])]
            finalize = bool(extra["finalize"][s, k])
            if phase == engine.GENERATE:
                text.part_role = role
            text.output = output
            if finalize:
                correct = _final_correct(stream, text.record, output)
                arrays["answer_id"][s, k] = 0 if correct else 1
                arrays["truth"][s, k, 0] = int(correct)
                if phase == engine.GENERATE:
                    text.answer_ok = correct
                text.result_ok = correct
            else:
                text.pending = prompts.PriorOutput(output, (ability_name,))
                text.result_ok = False  # a partial result has no gold
        elif phase == engine.REVIEW:
            for i, c_ in enumerate(calls):
                arrays["score"][s, k, c_] = reply.parsed[i].score
        elif phase in (engine.ROUND1, engine.ROUND2):
            verdict = reply.parsed[0]
            arrays["score"][s, k, c] = verdict.score
            (text.round1 if phase == engine.ROUND1 else text.round2)[c] = verdict
        elif phase == engine.CANDIDATES:
            text.candidates[c] = reply.texts[0]


def _backend_state(carry_backend, streams, store, slot_t: np.ndarray):
    """Carry.backend with the truth the live backend knows for each slot's task."""
    b = jax.tree_util.tree_map(np.array, carry_backend)
    for s in range(slot_t.shape[0]):
        for k in range(slot_t.shape[1]):
            text = store.get((s, int(slot_t[s, k])))
            if text is None:
                continue
            b.pair_ok[s, k] = text.pair_ok
            b.part_ok[s, k] = False  # no gold for a partial result
            b.part_role[s, k] = text.part_role
            b.answer_ok[s, k] = text.answer_ok
            b.result_ok[s, k] = text.result_ok
    return jax.tree_util.tree_map(jnp.asarray, b)


# ----------------------------------------------------------------------------------------------
# The loop


def _open_client(client, run_dir: Path | None) -> tuple[SyncLiveClient, bool]:
    if isinstance(client, SyncLiveClient):
        return client, False
    if not isinstance(client, LiveConfig):
        raise MeshHealError(
            f"live backend: client must be a SyncLiveClient or a LiveConfig, got {type(client).__name__}"
        )
    cache_path = client.cache_path or (run_dir / CACHE_FILE if run_dir is not None else None)
    cache = ResponseCache(cache_path) if cache_path is not None else None
    try:
        live = SyncLiveClient(list(client.servers), cache=cache, retry=client.retry, api_key=client.api_key)
        if client.pair is not None:
            try:
                check_pair_models(client.pair, live.client.model_ids)
            except BaseException:  # the warning made an error (-W error): the client is not handed out
                live.close()
                raise
        return live, True
    except BaseException:
        if cache is not None:
            cache.close()
        raise


def _finish(run_dir: Path | None, trace: list[dict], live: SyncLiveClient, owned: bool) -> None:
    """End of a live call, however it ends: append its trace rows (`append_trace`), then close
    the client and its response cache if the call opened them (`_open_client`)."""
    try:
        if run_dir is not None and trace:
            append_trace(run_dir / TRACE_FILE, trace)
    finally:
        if owned:
            cache = live.client.cache
            live.close()
            if cache is not None:
                cache.close()


def run_live_streams(
    specs: list[engine.StreamSpec],
    protocol: ProtocolParams,
    client: SyncLiveClient | LiveConfig,
    questions: Sequence[Record] | Mapping[str, Sequence[Record]],
    slots: int = 1,
    run_dir: Path | str | None = None,
    options: LiveOptions = LiveOptions(),
) -> list[dict[str, pl.DataFrame]]:
    """Run streams of one shape against live models; per stream the four record tables.

    `client`: an open SyncLiveClient (left open; its own cache, if any, is used) or a LiveConfig
    (a client is opened with a ResponseCache at `cache_path` or run_dir/responses.sqlite, and
    closed at the end). `questions`: benchmark records (`data.load_sample/load_local/load_hub`),
    one list for every stream or a dict dataset -> records; each stream's task t asks the
    question its (task type, question id) picks (`data.pick_questions`).
    Raises the client's ServerUnavailableError when a server stays down: every reply received
    is cached, and calling again with the same arguments resumes.
    """
    if not specs:
        raise MeshHealError("live backend: no streams to run")
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    cfg = engine.engine_config(specs, protocol, slots)
    first = specs[0]
    batched = engine.params_per_stream(specs)
    if batched:
        params = engine.stack(
            [engine.make_params(protocol, s.pair, s.network.profile, cfg.n_agents) for s in specs]
        )
    else:
        params = engine.make_params(protocol, first.pair, first.network.profile, cfg.n_agents)
    k_max = max(s.network.neighbour_table.shape[1] for s in specs)
    worlds = engine.stack([engine.make_world(s.network, s.stream, s.schedule, k_max) for s in specs])
    streams = [_prepare_stream(spec, questions) for spec in specs]
    carry = engine.initial_carries(cfg, worlds)
    n_streams, n_slots = len(specs), cfg.slots

    live, owned = _open_client(client, run_dir)
    compiling = ThreadPoolExecutor(1, thread_name_prefix="meshheal-compile")
    absorb_ready = _compile_absorb(compiling, cfg, params, worlds, carry, batched)
    rounds: list = []  # per round: records with a leading stream axis (numpy)
    real: list[dict] = []  # per round: latency / parse status / model per call (streams, S, 3)
    trace: list[dict] = []
    store: dict[tuple[int, int], _TaskText] = {}
    try:
        while not engine.done(cfg, carry).all():
            carry, requests = _begin(cfg, params, worlds, carry, batched)
            rq = jax.tree_util.tree_map(np.asarray, requests)
            pending = _build_requests(streams, store, rq, options)
            replies = live.run_batch([p.request for p in pending]) if pending else []
            rows = trace_rows([p.request for p in pending], replies)
            arrays = _empty_responses(n_streams, n_slots)
            shape = (n_streams, n_slots, 3)
            extra = {"latency": np.zeros(shape), "status": np.full(shape, "", object),
                     "model": np.full(shape, "", object), "ability": rq.ability, "finalize": rq.finalize}  # fmt: skip
            _absorb_replies(streams, store, pending, replies, rows, arrays, extra)
            responses = engine.Responses(**{name: jnp.asarray(value) for name, value in arrays.items()})
            carry = dataclasses.replace(carry, backend=_backend_state(carry.backend, streams, store, rq.t))
            absorb_ready.result()  # compiled (or its error raised) before the first round's absorb
            carry, records = _absorb(cfg, params, worlds, carry, requests, responses, batched)
            records = jax.tree_util.tree_map(np.asarray, records)
            rounds.append(records)
            real.append({key: extra[key] for key in ("latency", "status", "model")})
            for row, p in zip(rows, pending, strict=True):
                labels = {f"label_{key}": value for key, value in streams[p.stream].spec.labels.items()}
                trace.append({**row, "round": len(rounds) - 1, **labels})
            for s, k in zip(*np.nonzero(records.finished_mask)):  # finished tasks leave the store
                store.pop((int(s), int(records.finished.t[s, k])), None)
    finally:
        try:
            _finish(run_dir, trace, live, owned)  # first: the trace and the client do not wait on a compile
        finally:
            compiling.shutdown(wait=True)  # an interrupted run leaves no compile thread behind

    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs, axis=1), *rounds)  # (streams, rounds, S, ...)
    real_stacked = {key: np.stack([r[key] for r in real], axis=1) for key in real[0]}
    out = []
    for s, spec in enumerate(specs):
        rec = engine.at(stacked, s)
        frames = engine.record_frames(spec, rec)
        r_, k_, c_ = np.nonzero(rec.requests.mask)
        frames["calls"] = frames["calls"].with_columns(
            pl.Series("model", real_stacked["model"][s][r_, k_, c_].astype(str), dtype=pl.String),
            pl.Series("latency_s", real_stacked["latency"][s][r_, k_, c_], dtype=pl.Float64),
            pl.Series("parse_status", real_stacked["status"][s][r_, k_, c_].astype(str), dtype=pl.String),
        )
        out.append(frames)
    return out
