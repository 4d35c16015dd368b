"""The live backend of the baselines (spec/baselines.md, architecture.md "Live backend"):
real models answer every call a baseline makes (routing, selection, watchdog, evaluation,
composition, refinement, generation, chain-of-thought resamples, inference).

    frames = run_live_baselines("raps", specs, "default", LiveConfig(servers=(strong, weak)),
                                load_sample("bbh"), run_dir=Path("runs/live-raps"))

How (decisions B7): a baseline is one compiled program per method, `lax.scan` over a stream's
tasks, `vmap` over streams (`baselines.run`). With `Emu.live` set, every call site of that
program becomes a `jax.pure_callback` into `LiveBaselineHost.answer` that carries the calls of
that site for EVERY stream at once (vmap's `broadcast_all`): the host builds their prompts from
its text store, sends them all in one `SyncLiveClient.run_batch`, parses the replies and hands
back the numbers the method needs (scores, the named agent, the judged answer's id, the
inferred pair, token counts, a request id). So the request/response contract, the client, the
prompts, the cache and the records are the ones MeshHeal's live loop uses; only the loop is the
program's own scan instead of a host loop of rounds.

- Text store: per (stream, task, execution) the inferred pair, the outputs by visit and the
  accepted draft, and the execution's current final answer (SAC teams and Symphony plans are
  executions 0..4). The texts a call reads were written by calls it depends on in the program
  (`live_reply(after=...)`), so the order is the program's dataflow.
- Answers: a final answer is judged against the gold (`scoring.judge`): id 0 when correct;
  otherwise the k-th distinct wrong answer of the task gets id k >= 1, two wrong answers being
  the same when the scorer says so (option letters, normalised text, math-verify equivalence),
  and an answer that states none gets an id of its own: votes compare normalised answers
  (spec/baselines.md "Live").
- Model: the role comes from the model-backed rule inside the program (the backend's own
  function `common.role_of`, which alone reads the health schedule); the host sends to that role.
- Failures: a parse failure is retried once by the client, then the parser's fallback is used
  (a neutral 0.5 score, no named agent -> the method's own rule, the documented pair, no
  answer). A transport failure stops the run: the host records it, answers every later call
  with neutral values, and `run_live_baselines` raises it when the program returns. Every reply
  already received is in the response cache, so the same call resumes (replays from task 1 with
  cache hits).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import polars as pl

from meshheal_jax import prompts, scoring
from meshheal_jax.backends.live import (
    PARSE_FAILED,
    CallRequest,
    CallResponse,
    SyncLiveClient,
    request_seed,
    trace_rows,
)
from meshheal_jax.backends.live_loop import (
    CACHE_FILE,
    LiveConfig,
    LiveOptions,
    _finish,
    _open_client,
    _records_for,
)
from meshheal_jax.baselines import common as C
from meshheal_jax.data import Record, pick_questions, question_pool
from meshheal_jax.errors import MeshHealError


class MathJudge:
    """`fn(dataset, *args)` (a scoring function), for MATH in a child process, None past
    `limit_s` (3 x scoring.MATH_TIMEOUT_S). The host runs in XLA's callback threads, where
    math-verify's signal-based limits cannot work, and one pathological reply must not hang a live
    run: a thread cannot be stopped, and sympy's big-integer arithmetic (`\\boxed{10^{10^{10}}}`)
    holds Python's lock, so a watching thread never runs again. In the child's main thread
    math-verify's own limits work; a child past `limit_s` anyway is killed and the next MATH call
    starts another. The child is started (spawn: no copy of this process's XLA threads; Ctrl-C
    ignored, the parent stops it) at the first MATH call, and judges one answer first, within
    START_S, so an install that cannot score MATH fails there. Calls take turns (the host's
    lock): one queued behind another would count the other's time against its limit."""

    START_S = 120

    def __init__(self, limit_s: float | None = None):
        self.limit_s = 3 * scoring.MATH_TIMEOUT_S if limit_s is None else limit_s
        self._pool = None

    def __call__(self, fn, dataset: str, *args):
        if dataset != "math":
            return fn(dataset, *args)
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(
                1, signal.signal, (signal.SIGINT, signal.SIG_IGN)
            )
            try:
                self._pool.apply_async(scoring.judge, ("math", "RESULT: 1", "1")).get(self.START_S)
            except multiprocessing.TimeoutError:
                self.close()
                raise MeshHealError(f"live baselines: the MATH judging process did not answer within "
                                    f"{self.START_S} s of its start") from None  # fmt: skip
        try:
            return self._pool.apply_async(fn, (dataset, *args)).get(self.limit_s)
        except multiprocessing.TimeoutError:
            self.close()
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None


def make_call_id(op: str, execution: int, visit: int, round_: int = 0, other: int = 0) -> int:
    """A call's id within its task (request seeds derive from it): unique per (call site,
    execution, visit, round, other team / retry) while execution < 8, visit < 64, round < 8,
    other < 8 (at most 5 executions, 10 visits, 2 rounds and 4 others occur)."""
    return ((C.LIVE_OPS.index(op) * 8 + execution) * 64 + visit) * 64 + 8 * round_ + other


def call_site(call_id: int) -> dict[str, int | str]:
    """make_call_id's fields back from an id (traces, tests)."""
    rest, sub = divmod(call_id, 64)
    rest, visit = divmod(rest, 64)
    op, execution = divmod(rest, 8)
    return {"op": C.LIVE_OPS[op], "execution": execution, "visit": visit, "round": sub // 8, "other": sub % 8}


@dataclasses.dataclass
class _Execution:
    """The text of one execution of one task (host side)."""

    pair: int | None = None  # the inferred pair's index in the profile
    outputs: dict[int, str] = dataclasses.field(default_factory=dict)  # visit -> output text
    # (visit, output)
    accepted: list[tuple[int, prompts.PriorOutput]] = dataclasses.field(default_factory=list)
    answer: str = ""  # the execution's current final answer (after refinement, for SAC)


@dataclasses.dataclass
class _Stream:
    spec: object  # baselines.BaselineSpec
    records: tuple[Record, ...]
    examples: dict[str, str]

    @property
    def profile(self):
        return self.spec.network.profile


class LiveBaselineHost:
    """Answers a baseline program's live calls (see the module docstring)."""

    def __init__(
        self, specs: Sequence, questions, client: SyncLiveClient, options: LiveOptions | None = None
    ):
        self.client = client
        self.options = options if options is not None else LiveOptions()
        self.streams: list[_Stream] = []  # in the order of the program's batch (World.stream)
        for spec in specs:
            profile = spec.network.profile
            pool = question_pool(_records_for(questions, profile.dataset), profile.task_types)
            pick = pick_questions(pool, spec.stream.task_type, spec.stream.question, spec.stream.seed,
                                  spec.stream.dataset_id)  # fmt: skip
            examples = {tt: rows[0].question for tt, rows in zip(profile.task_types, pool)}
            self.streams.append(_Stream(spec, pick.records, examples))
        self.texts: dict[tuple[int, int, int], _Execution] = {}
        self.wrong_answers: dict[tuple[int, int], list[str | None]] = {}  # id k = entry k - 1
        self.latest: dict[int, int] = {}  # stream -> latest task seen (older texts are dropped)
        self.trace: list[dict] = []  # one row per request; row["request"] = the id the records carry
        self.error: BaseException | None = None
        self.judge = MathJudge()  # the scorer, MATH in a child process under a time limit
        self._lock = threading.Lock()

    # -- the callback ------------------------------------------------------------------------

    def answer(self, op: str, valid: np.ndarray, scalars: Mapping[str, np.ndarray],
               vectors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:  # fmt: skip
        """The replies of one call site for every stream (arrays of valid's shape)."""
        with self._lock:  # XLA may run two data-independent call sites at once, on two threads
            return self._answer(op, valid, scalars, vectors)

    def stop(self, reason: BaseException) -> None:
        """Send nothing more: every later call gets neutral values (the run then raises `reason`)."""
        if self.error is None:
            self.error = reason

    def _answer(self, op, valid, scalars, vectors) -> dict[str, np.ndarray]:
        shape = valid.shape
        out = {k: np.full(shape, C._DEFAULTS[k], dtype) for k, dtype in C.REPLY_FIELDS.items()}
        if self.error is not None or not valid.any():
            return out
        try:
            calls = []
            for idx in zip(*np.nonzero(valid)):
                one = {k: v[idx].item() for k, v in scalars.items()}
                vec = {k: v[idx] for k, v in vectors.items()}
                calls.append((idx, one, *self._request(op, one, vec)))
            replies = self.client.run_batch([request for _, _, request, _ in calls]) if calls else []
            rows = trace_rows([request for _, _, request, _ in calls], replies)
            for (idx, one, request, finish), reply, row in zip(calls, replies, rows, strict=True):
                row["request"] = len(self.trace)
                row.update(
                    {f"label_{k}": value for k, value in self.streams[request.stream].spec.labels.items()}
                )
                self.trace.append(row)
                out["request"][idx] = row["request"]
                out["prompt"][idx] = reply.prompt_tokens
                out["completion"][idx] = reply.completion_tokens
                for name, value in finish(reply).items():
                    out[name][idx] = value
        except BaseException as err:  # noqa: BLE001 -- re-raised by run_live_baselines after the program
            self.error = err
        return out

    # -- requests ----------------------------------------------------------------------------

    def _execution(self, s: int, t: int, e: int) -> _Execution:
        if self.latest.get(s, 0) < t:  # a new task of this stream: the older ones are finished
            self.latest[s] = t
            for key in [key for key in self.texts if key[0] == s and key[1] < t]:
                del self.texts[key]
            for key in [key for key in self.wrong_answers if key[0] == s and key[1] < t]:
                del self.wrong_answers[key]
        return self.texts.setdefault((s, t, e), _Execution())

    def _task(self, stream: _Stream, t: int, accepted=()) -> prompts.TaskText:
        record = stream.records[t - 1]
        return prompts.TaskText(stream.profile.dataset, record.question, record.task_type, record.options,
                                tuple(accepted))  # fmt: skip

    def _abilities(self, stream: _Stream, ids) -> tuple[prompts.AbilityRef, ...]:
        return prompts.abilities_of(stream.profile, [int(i) for i in ids])

    def _agent_abilities(self, stream: _Stream, agent: int) -> tuple[prompts.AbilityRef, ...]:
        return self._abilities(stream, np.flatnonzero(stream.spec.network.holds[agent]))

    def _answer_id(self, s: int, t: int, text: str) -> int:
        """0 for a correct answer; a wrong one takes the id of the first earlier wrong answer of the
        task the scorer's normalisation finds equal to it (`scoring.same_answer`: option letters,
        text, numbers, math-verify equivalence), else the next id; an answer that states none
        agrees with nothing."""
        stream = self.streams[s]
        record = stream.records[t - 1]
        dataset = stream.profile.dataset
        judged = self.judge(scoring.judge, dataset, text, record.gold, record.options)
        if judged is None:  # math-verify ran past its limit: an answer nobody can agree with
            judged = scoring.Judgement(False, scoring.UNPARSABLE, None)
        if judged.correct:
            return 0
        wrong = self.wrong_answers.setdefault((s, t), [])
        for k, earlier in enumerate(wrong, start=1):
            if self.judge(scoring.same_answer, dataset, judged.answer, earlier):
                return k
        wrong.append(judged.answer)
        return len(wrong)

    def _request(self, op: str, a: dict, v: dict):
        """(CallRequest, finish(reply) -> reply fields) of one call."""
        s = int(a["stream"])
        if not 0 <= s < len(self.streams):
            raise MeshHealError(f"live baselines: a call for stream {s}, the host has {len(self.streams)}")
        stream, t, e = self.streams[s], int(a["t"]), int(a.get("execution", 0))
        profile, ex = stream.profile, self._execution(s, int(a["t"]), int(a.get("execution", 0)))
        agent, role = int(a["agent"]), C.ROLE_NAMES[int(a["role"])]
        visit = int(a.get("visit", 0))
        call_id = make_call_id(op, e, visit, int(a.get("round", 0)), int(a.get("other", a.get("attempt", 0))))
        dataset = profile.dataset
        record = stream.records[t - 1]
        accepted = [prior for _, prior in ex.accepted]

        def request(kind: str, messages, **kw) -> CallRequest:
            return CallRequest(
                stream=s, t=t, call_id=call_id, kind=kind, role=role, messages=messages,
                seed=request_seed(stream.spec.stream.seed, stream.spec.stream.dataset_id, t, call_id),
                max_completion_tokens=self.options.tokens_for(kind), sampling=self.options.sampling,
                agent=agent, author=int(a.get("author", -1)), **kw,
            )  # fmt: skip

        if op == "infer":
            examples = stream.examples if self.options.inference_examples else None
            messages = prompts.inference_messages(
                profile, record.question, record.task_type, examples, record.options
            )
            req = request("infer", messages, response_format=prompts.inference_response_format(profile),
                          parser=prompts.inference_parser(profile, record.task_type))  # fmt: skip

            def finish(reply: CallResponse) -> dict:
                ex.pair = int(reply.parsed[0].pair_index)
                return {"pair": ex.pair}

            return req, finish

        if op == "generate":
            ability, finalize = int(a["ability"]), bool(a["finalize"])
            pair_index = ex.pair if ex.pair is not None else self.texts.get((s, t, 0), _Execution()).pair
            pair = (
                profile.pairs[pair_index]
                if pair_index is not None
                else profile.requires[profile.task_types.index(record.task_type)]
            )
            covered = {name for prior in accepted for name in prior.abilities}
            remaining = sorted(i for i in pair if profile.abilities[i] not in covered)
            stage = "finalize" if finalize else "contribute"
            if not stream.spec.network.holds[
                agent, ability
            ]:  # a non-holder asked to work (AutoGen, Symphony)
                directive, abilities, missing = "none", self._agent_abilities(stream, agent), ()
            elif finalize:
                directive = "partial" if accepted else "full"
                abilities, missing = self._abilities(stream, remaining or [ability]), ()
            else:
                directive, abilities = "partial", self._abilities(stream, [ability])
                missing = self._abilities(stream, [i for i in remaining if i != ability])
            task = self._task(stream, t, accepted)
            messages = prompts.execution_messages(task, abilities, directive, stage, missing)
            req = request(C.KINDS[int(a["kind"])], messages, parser=prompts.execution_parser(dataset))

            def finish(reply: CallResponse) -> dict:
                text = reply.texts[0]
                ex.outputs[visit] = text
                # Symphony's reward: 1[non-empty output]; the execution parser fails only on an empty reply
                non_empty = int(reply.parse_status[0] != PARSE_FAILED)
                if not finalize:
                    ex.accepted.append((visit, prompts.PriorOutput(text, (profile.abilities[ability],))))
                    return {"non_empty": non_empty}
                ex.answer = text
                return {"answer_id": self._answer_id(s, t, text), "non_empty": non_empty}

            return req, finish

        if op == "watchdog":
            judged_visit, ability = int(a["judged_visit"]), int(a["ability"])
            context = [prior for vv, prior in ex.accepted if vv < judged_visit]
            messages = prompts.review_messages(self._task(stream, t, context), "contribute",
                                               ex.outputs.get(judged_visit, ""), self._abilities(stream, [ability]),
                                               self._agent_abilities(stream, agent))  # fmt: skip
            req = request("watchdog", messages, response_format=prompts.review_response_format("contribute"),
                          parser=prompts.review_parser("contribute"))  # fmt: skip
            return req, lambda reply: {"score": reply.parsed[0].score}

        if op in ("router", "select"):
            ability = max(int(a["ability"]), 0)
            needed = self._abilities(stream, [ability])[0]
            if op == "router":
                ids = np.flatnonzero(v["usable"])
                candidates = [prompts.Candidate(int(j), self._agent_abilities(stream, int(j)),
                                                f"ability estimate {v['estimate'][j]:.2f}, success rate "
                                                f"{v['rate'][j]:.2f}, load 0") for j in ids]  # fmt: skip
                messages = prompts.router_messages(self._task(stream, t, accepted), agent, needed, candidates)
            else:
                ids = np.flatnonzero(v["workers"])
                candidates = [prompts.Candidate(int(j), self._agent_abilities(stream, int(j))) for j in ids]
                messages = prompts.select_messages(self._task(stream, t, accepted), needed, candidates,
                                                   retry=int(a["attempt"]) > 0)  # fmt: skip
            req = request(op, messages, response_format=prompts.choice_response_format(ids),
                          parser=prompts.choice_parser(ids))  # fmt: skip
            return req, lambda reply: {"choice": int(reply.parsed[0])}

        if op == "compose":
            worker_answer = ex.outputs.get(int(a["judged_visit"]), "")
            messages = prompts.compose_messages(self._task(stream, t, accepted), worker_answer)
            req = request("compose", messages, parser=prompts.execution_parser(dataset))

            def finish(reply: CallResponse) -> dict:
                ex.answer = reply.texts[0]
                return {"answer_id": self._answer_id(s, t, reply.texts[0])}

            return req, finish

        if op == "evaluate":
            other = self.texts.get((s, t, int(a["other"])), _Execution())
            messages = prompts.evaluation_messages(self._task(stream, t), ex.answer, other.answer,
                                                   self._agent_abilities(stream, agent))  # fmt: skip
            req = request("evaluate", messages, response_format=prompts.evaluation_response_format(),
                          parser=prompts.evaluation_parser())  # fmt: skip
            return req, lambda reply: {"own_score": reply.parsed[0][0], "score": reply.parsed[0][1]}

        if op == "refine":
            kept = [self.texts.get((s, t, int(j)), _Execution()).answer for j in np.flatnonzero(v["kept"])]
            messages = prompts.refine_messages(self._task(stream, t), ex.answer, kept,
                                               self._agent_abilities(stream, agent))  # fmt: skip
            req = request("refine", messages, parser=prompts.execution_parser(dataset))

            def finish(reply: CallResponse) -> dict:
                # every team refines from the round's start answers: answer() builds every request
                # of the batch before any finish runs
                ex.answer = reply.texts[0]
                return {"answer_id": self._answer_id(s, t, reply.texts[0])}

            return req, finish

        raise MeshHealError(f"live baselines: unknown call {op!r}")


# ------------------------------------------------------------------------------------------------
# A run


def run_live_baselines(
    method: str,
    specs: list,
    pair,
    client: SyncLiveClient | LiveConfig,
    questions: Sequence[Record] | Mapping[str, Sequence[Record]],
    run_dir: Path | str | None = None,
    options: LiveOptions | None = None,
    params=None,
) -> list[dict[str, pl.DataFrame]]:
    """Run a baseline's streams against live models; per stream the four record tables as polars
    frames (metrics.SCHEMAS columns, as `baselines.run_baseline_frames`).

    `client`: an open SyncLiveClient (or any object with its `run_batch`; left open) or a
    LiveConfig (opened with a ResponseCache at `cache_path` or run_dir/responses.sqlite, closed
    at the end). With `run_dir`, the per-request trace is appended to run_dir/live_trace.parquet
    (`request` numbers the rows of one call; a resumed call adds its replayed rows, marked
    `from_cache`). Raises the client's error when a server stays down: every reply received is
    cached, and calling again with the same arguments resumes."""
    from meshheal_jax.baselines import run as R

    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    # a LiveConfig opens its own client; anything else with run_batch (a SyncLiveClient, a
    # test's scripted client) is used as it is and left open
    live, owned = _open_client(client, run_dir) if isinstance(client, LiveConfig) else (client, False)
    host = None
    try:  # the host's own checks (the questions) may refuse the run: the client is closed all the same
        host = LiveBaselineHost([R._spec(s) for s in specs], questions, live, options)
        return R.run_baseline_frames(method, specs, pair, params, live=host)
    finally:  # the trace is appended: a resumed run keeps the earlier rows
        if host is not None:
            host.judge.close()
        _finish(run_dir, host.trace if host else [], live, owned)


def live_baseline_tables(*args, **kwargs) -> list[dict[str, list[dict]]]:
    """`run_live_baselines` with each table as a list of row dicts (as `baselines.run_baseline_streams`)."""
    from meshheal_jax.baselines import run as R

    return R.as_rows(run_live_baselines(*args, **kwargs))


__all__ = ["CACHE_FILE", "LiveBaselineHost", "live_baseline_tables", "run_live_baselines"]
