"""The live host loop (meshheal_jax.backends.live_loop) end to end against a SCRIPTED STAND-IN for
the strong and weak vLLM servers: two tiny HTTP/1.1 servers started in-process on 127.0.0.1 (a
thread each) that answer `/v1/models` and `/v1/chat/completions` in the OpenAI format with
replies decided here from the prompt text. NOT vLLM, NOT a model: real sockets, the real openai
SDK, the real prompts, parsers, scorers and JAX controller.

Well-formed script: inference names the documented pair (strong) or another documented pair
(weak); a Contribute writes a partial result; a final answer is the gold (strong) or "I cannot
tell" (weak); a strong reviewer gives 0.25 with evidence to an output saying "I cannot tell" and
1.0 otherwise, a weak reviewer 0.5. The baselines' own calls: a router or manager names the
lowest-numbered candidate; an SAC evaluation scores its own answer 1.0 and the other 0.25 when it
says "I cannot tell", else 1.0. Garbage script: every reply is plain non-JSON text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax.numpy as jnp
import numpy as np
import polars as pl
import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from meshheal_jax import engine
from meshheal_jax.backends import live_loop
from meshheal_jax.backends.live import RetryPolicy, ServerGroup, ServerUnavailableError
from meshheal_jax.backends.live_loop import LiveConfig, run_live_streams
from meshheal_jax.config import ProtocolParams
from meshheal_jax.data import load_sample
from meshheal_jax.params import load_pair
from meshheal_jax.prompts import review_reply
from meshheal_jax.streams import Stream, make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.data.QuestionPoolWarning")

STRONG_ROOT = "openai/gpt-oss-120b"
WEAK_ROOT = "meta-llama/Llama-3.2-1B-Instruct"
FAST_RETRY = RetryPolicy(
    max_retries=2, backoff_base_s=0.01, backoff_cap_s=0.02, connect_timeout_s=2.0, request_timeout_s=20.0
)
N_TASKS = 12
DEGRADED_FROM = 7  # agents 2 and 4 (A3, A5) degraded for tasks 7..12
PROFILE = load_profile("bbh")
RECORDS = load_sample("bbh")
WRONG = "I cannot tell"
CONTRIBUTE_MARK = "`HANDOFF: <what the next agent must still do>`"  # only in Contribute instructions
PARTIAL_MARK = "corrected partial result"  # only in Contribute-stage candidate / synthesis prompts


# ----------------------------------------------------------------------------------------------
# The scripted stand-in servers


def _question_type(content: str) -> str:
    return content.rsplit("Task type: ", 1)[1].split("\n", 1)[0].strip()


def _gold(content: str) -> str:
    for record in RECORDS:
        if record.question.strip() in content:
            return record.gold
    raise AssertionError("stand-in: no sample question in the prompt")


def well_formed(role: str, body: dict) -> str:
    content = body["messages"][-1]["content"]
    fmt = (body.get("response_format") or {}).get("json_schema", {}).get("name")
    if fmt == "ability_pair":
        index = PROFILE.task_types.index(_question_type(content))
        pair = PROFILE.requires[index]
        if role == "weak":  # a wrong (but documented) pair
            pair = next(p for p in PROFILE.requires if frozenset(p) != frozenset(pair))
        return json.dumps({"abilities": [PROFILE.abilities[a] for a in pair]})
    if fmt in ("contribute_review", "finalize_review"):
        judged = content.split("Output under review:\n<<<\n", 1)[1].split("\n>>>", 1)[0]
        score = 0.5 if role == "weak" else (0.25 if WRONG in judged else 1.0)
        return review_reply(score, "finalize" if fmt == "finalize_review" else "contribute", evidence=WRONG)
    if fmt == "agent_choice":  # baselines: a router / manager names the lowest-numbered candidate
        return json.dumps(
            {"agent": min(body["response_format"]["json_schema"]["schema"]["properties"]["agent"]["enum"])}
        )
    if (
        fmt == "answer_evaluation"
    ):  # baselines (SAC): the other team's answer scores low iff it is the wrong one
        other = content.split("Another team's answer:\n<<<\n", 1)[1].split("\n>>>", 1)[0]
        return json.dumps(
            {"own_score": 1.0, "other_score": 0.25 if WRONG in other else 1.0, "one_sentence_reason": "."}
        )
    if CONTRIBUTE_MARK in content or PARTIAL_MARK in content:
        return "COMPETENCE_MATCH:partial\nI did my part.\nRESULT: partial result\nHANDOFF: finish the task"
    answer = _gold(content) if role == "strong" else WRONG
    return f"COMPETENCE_MATCH:partial\nCombining the draft.\nRESULT: {answer}"


def garbage(role: str, body: dict) -> str:
    return f"lorem ipsum {role} ### no json here"


class StandIn:
    """A scripted stand-in for one vLLM server (NOT vLLM), served from a thread."""

    def __init__(self, role: str, root: str, script=well_formed) -> None:
        self.role, self.root, self.script = role, root, script
        self.chats: list[dict] = []
        self.fail_after: int | None = None  # answer HTTP 503 once this many chats were answered
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": stand_in.role, "object": "model",
                                                                  "root": stand_in.root}]})  # fmt: skip
                else:
                    self._send(404, {"error": {"message": "no route"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with stand_in.lock:
                    if stand_in.fail_after is not None and len(stand_in.chats) >= stand_in.fail_after:
                        self._send(503, {"error": {"message": "scripted outage"}})
                        return
                    stand_in.chats.append(body)
                n = int(body.get("n") or 1)
                text = stand_in.script(stand_in.role, body)
                prompt = sum(len(m["content"]) for m in body["messages"]) // 4
                completion = (len(text) // 4 + 1) * n
                with stand_in.lock:
                    stand_in.prompt_tokens += prompt * n  # as the paper counts an n-request
                    stand_in.completion_tokens += completion
                choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                           for i in range(n)]  # fmt: skip
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": choices, "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                               "total_tokens": prompt + completion}})  # fmt: skip

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stand_ins(script=well_formed) -> list[StandIn]:
    return [StandIn("strong", STRONG_ROOT, script), StandIn("weak", WEAK_ROOT, script)]


@pytest.fixture
def servers():
    pair = stand_ins()
    yield pair
    for server in pair:
        server.close()


def config(servers, cache_path=None) -> LiveConfig:
    strong, weak = servers
    return LiveConfig(
        servers=(ServerGroup("strong", (strong.url,)), ServerGroup("weak", (weak.url,))),
        retry=FAST_RETRY, cache_path=cache_path,
    )  # fmt: skip


def bbh_spec(seed: int = 0) -> engine.StreamSpec:
    """6 agents, complete graph, the first 12 tasks of a bbh stream; A3/A5 degraded from task 7."""
    network = build_network(PROFILE, 6)
    full = make_stream(seed, PROFILE.dataset_id, 42, 7, (1, 22), ("healthy", "degraded"))
    phase = (np.arange(1, N_TASKS + 1) >= DEGRADED_FROM).astype(np.int32)
    stream = Stream(seed, PROFILE.dataset_id, full.task_type[:N_TASKS], full.question[:N_TASKS], phase,
                    ("healthy", "degraded"))  # fmt: skip
    schedule = persistent_schedule(6, N_TASKS, network.degraded_targets)
    assert schedule.intervals[0][1] == DEGRADED_FROM
    return engine.StreamSpec(network, stream, schedule, load_pair("default"),
                             {"method": "meshheal", "dataset": "bbh", "pair": "default", "seed": seed})  # fmt: skip


SEEDS = (0, 1)  # two streams batched: every round's requests of both go out in one run_batch
TABLES = ("tasks", "reviews", "states", "calls")


def run(servers, run_dir) -> list[dict[str, pl.DataFrame]]:
    specs = [bbh_spec(seed) for seed in SEEDS]
    return run_live_streams(specs, ProtocolParams(), config(servers), RECORDS, run_dir=run_dir)


def same(a: list[dict], b: list[dict], drop: tuple[str, ...] = ()) -> bool:
    return all(x[name].drop(*[c for c in drop if c in x[name].columns])
               .equals(y[name].drop(*[c for c in drop if c in y[name].columns]))
               for x, y in zip(a, b, strict=True) for name in TABLES)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One well-formed run (compiles the controller once for every test of this module)."""
    pair = stand_ins()
    run_dir = tmp_path_factory.mktemp("live") / "run"
    traces = dict(live_loop.TRACES)
    try:
        frames = run(pair, run_dir)
        # begin / absorb traced once for the whole run: the carry keeps its dtypes round to round
        assert {k: live_loop.TRACES[k] - traces[k] for k in traces} == {"begin": 1, "absorb": 1}
        yield frames, run_dir, pair, sum(len(server.chats) for server in pair)
    finally:
        for server in pair:
            server.close()


def test_streams_are_batched_into_one_request_list_per_round(first_run):
    results, run_dir, _, sent = first_run
    trace = pl.read_parquet(run_dir / live_loop.TRACE_FILE)
    assert len(results) == 2 and set(trace["stream"]) == {0, 1}
    per_round = trace.group_by("round").agg(pl.col("stream").n_unique().alias("streams"))
    assert per_round["streams"].max() == 2  # one run_batch carried calls of both streams
    assert sent == trace.height  # one HTTP call per request (all replies parsed, n honoured)
    assert [r["tasks"]["seed"].unique().to_list() for r in results] == [[0], [1]]


@pytest.mark.parametrize("stream", [0, 1])
def test_bbh_stream_end_to_end(first_run, stream):
    results, run_dir, servers, _ = first_run
    frames = results[stream]
    tasks, calls, reviews = frames["tasks"], frames["calls"], frames["reviews"]
    trace = pl.read_parquet(run_dir / live_loop.TRACE_FILE).filter(pl.col("stream") == stream)

    # every task ran to an end, each with one inference call
    assert tasks["t"].to_list() == list(range(1, N_TASKS + 1))
    assert calls.filter(pl.col("kind") == "infer").group_by("t").len()["len"].to_list() == [1] * N_TASKS
    assert tasks["answered"].all() and (tasks["end"] == "").all()

    # every masked request became exactly one logical call: one calls row per request sample
    assert calls.height == trace["n"].sum() == tasks["calls"].sum()
    assert (calls["parse_status"] == "ok").all()
    assert set(calls["kind"]) >= {
        "infer",
        "generate",
        "review",
        "committee1",
        "committee2",
        "candidate",
        "synthesis",
    }

    # tokens add up: tasks vs calls per task, and both vs the usage the servers reported
    per_call = calls.group_by("t").agg(
        pl.col("prompt_tokens").sum().alias("p"), pl.col("completion_tokens").sum().alias("c")
    )
    joined = tasks.join(per_call, on="t")
    assert joined.height == N_TASKS
    assert (joined["prompt_tokens"] == joined["p"]).all() and (
        joined["completion_tokens"] == joined["c"]
    ).all()
    assert calls["prompt_tokens"].sum() == trace["prompt_tokens"].sum()
    assert calls["completion_tokens"].sum() == trace["completion_tokens"].sum()
    if stream == 1:  # both streams together: exactly what the stand-ins counted
        every = pl.concat([r["calls"] for r in results])
        assert every["prompt_tokens"].sum() == sum(server.prompt_tokens for server in servers)
        assert every["completion_tokens"].sum() == sum(server.completion_tokens for server in servers)

    # the role rule: a degraded agent only ever calls the weak server, a healthy one the strong
    degraded = pl.col("agent").is_in([2, 4]) & (pl.col("t") >= DEGRADED_FROM)
    assert (calls.filter(degraded)["model"] == WEAK_ROOT).all() and calls.filter(degraded).height > 0
    assert (calls.filter(~degraded)["model"] == STRONG_ROOT).all()
    assert trace.filter(pl.col("role") == "weak").height > 0
    assert (trace.filter(pl.col("role") == "weak")["model_id"] == WEAK_ROOT).all()

    # truth columns: the final answer scored against the gold; the inferred pair against the profile
    answered = calls.filter(pl.col("answer_id").is_not_null())
    assert ((answered["answer_id"] == 0) == (answered["model"] == STRONG_ROOT)).all()
    assert (tasks["correct"] == (tasks["answer_id"] == 0)).all()
    assert tasks["correct"].any()
    infer = calls.filter(pl.col("kind") == "infer").sort("t")
    assert (infer["correct"] == (infer["model"] == STRONG_ROOT)).all()
    assert (tasks.sort("t")["pair_correct"] == infer["correct"]).all()

    # reviews: weak-authored outputs were caught by strong reviewers (committee, Takeover)
    assert (reviews["author_model"] == np.where(reviews["author_degraded"], "weak", "strong")).all()
    assert reviews["takeover"].any() and reviews["committee"].any()
    scored = calls.filter(pl.col("kind").is_in(["review", "committee1", "committee2"]))
    assert set(scored["score"].unique()) <= {0.25, 0.5, 1.0}
    assert (calls["latency_s"] > 0).all()


def test_second_identical_run_sends_nothing(first_run):
    results, run_dir, servers, sent = first_run
    traces = dict(live_loop.TRACES)
    before = pl.read_parquet(run_dir / live_loop.TRACE_FILE)
    again = run(servers, run_dir)
    assert sum(len(server.chats) for server in servers) == sent  # zero HTTP requests
    trace = pl.read_parquet(run_dir / live_loop.TRACE_FILE)  # appended: the first call's rows stay
    assert trace.height == 2 * before.height and trace.head(before.height).equals(before)
    assert trace.tail(before.height)["from_cache"].all()
    assert same(again, results)  # identical tables, latency included (as first measured)
    assert live_loop.TRACES == traces  # begin / absorb jitted once per shape, not per run or round


def test_absorb_compiled_ahead_is_the_one_the_loop_calls():
    """decisions S8: the worker's warm call fills the jit cache with the signature the loop's first
    absorb has (three streams: a batch width no other test compiles)."""
    specs = [bbh_spec(seed) for seed in (0, 1, 2)]
    cfg = engine.engine_config(specs, ProtocolParams(), 1)
    params = engine.make_params(ProtocolParams(), specs[0].pair, PROFILE, cfg.n_agents)
    k_max = 5  # complete graph, 6 agents
    worlds = engine.stack([engine.make_world(s.network, s.stream, s.schedule, k_max) for s in specs])
    carry = engine.initial_carries(cfg, worlds)
    live_loop._absorb.clear_cache()  # whatever earlier tests compiled
    before = dict(live_loop.TRACES)
    with ThreadPoolExecutor(1) as pool:
        assert live_loop._compile_absorb(pool, cfg, params, worlds, carry, False).result() is None
    assert live_loop.TRACES["absorb"] == before["absorb"] + 1
    carry, requests = live_loop._begin(cfg, params, worlds, carry, False)
    slot_t = np.asarray(requests.t)
    carry = dataclasses.replace(carry, backend=live_loop._backend_state(carry.backend, [], {}, slot_t))
    responses = engine.Responses(**{k: jnp.asarray(v) for k, v in live_loop._empty_responses(3, 1).items()})
    live_loop._absorb(cfg, params, worlds, carry, requests, responses, False)
    assert live_loop.TRACES["absorb"] == before["absorb"] + 1  # the loop's call found it compiled


def test_garbage_replies_are_recorded_parse_failures(tmp_path):
    pair = stand_ins(garbage)
    try:
        results = run(pair, tmp_path / "run")
    finally:
        for server in pair:
            server.close()
    frames = results[0]
    tasks, calls = frames["tasks"], frames["calls"]
    assert [r["tasks"].height for r in results] == [N_TASKS, N_TASKS]  # the run finishes
    judged = calls.filter(pl.col("kind").is_in(["review", "committee1", "committee2"]))
    assert judged.height > 0 and (judged["parse_status"] == "failed").all()
    assert (judged["score"] == 0.5).all()  # DECISION: a neutral score
    infer = calls.filter(pl.col("kind") == "infer")
    assert (infer["parse_status"] == "failed").all() and infer["correct"].all()  # the documented pair
    assert (calls.filter(pl.col("kind") == "generate")["parse_status"] == "ok").all()  # text, no answer
    assert not tasks["correct"].any()
    reviews = frames["reviews"]
    assert (reviews["q0"] == 0.5).all() and not reviews["committee"].any()
    # a failed review costs its retry: three samples answered twice
    trace = pl.read_parquet(tmp_path / "run" / live_loop.TRACE_FILE)
    assert (trace.filter(pl.col("kind") == "review")["parse_failures"] == 3).all()


def test_interrupted_run_resumes_without_repeats(servers, first_run, tmp_path):
    results, _, _, total = first_run
    for server in servers:
        server.fail_after = 30  # each server goes down after 30 answers, mid-run
    with pytest.raises(ServerUnavailableError):
        run(servers, tmp_path / "cut")
    assert 0 < sum(len(server.chats) for server in servers) < total
    cut = pl.read_parquet(tmp_path / "cut" / live_loop.TRACE_FILE)  # the rounds finished before
    assert cut.height > 0 and not cut["from_cache"].any()
    for server in servers:
        server.fail_after = None
    resumed = run(servers, tmp_path / "cut")  # the same call again resumes from the cache
    assert sum(len(server.chats) for server in servers) == total  # nothing sent twice
    trace = pl.read_parquet(tmp_path / "cut" / live_loop.TRACE_FILE)  # the cut call's rows kept
    assert trace.head(cut.height).equals(cut)
    replay = trace.slice(cut.height)  # the resumed call's rows, replayed from round 0
    assert replay["round"][0] == 0 and replay["from_cache"].sum() >= cut.height
    assert same(resumed, results, drop=("latency_s",))  # latency measured afresh for what was re-sent


def test_a_pair_whose_files_name_other_models_than_served_warns():
    """`--pair B` against servers of the default pair: the results would carry the wrong label."""
    import warnings

    from meshheal_jax import runner

    settings = runner.LiveSettings(strong_urls=("http://s/v1",), weak_urls=("http://w/v1",))
    pair = settings.config(None, "B").pair
    assert pair == (
        "B",
        {"strong": "meta-llama/Llama-3.3-70B-Instruct", "weak": "meta-llama/Llama-3.2-1B-Instruct"},
    )
    with pytest.warns(live_loop.PairModelWarning, match="pair B's strong model is meta-llama/Llama-3.3-70B-Instruct, "
                      "but the strong server serves openai/gpt-oss-120b"):  # fmt: skip
        live_loop.check_pair_models(
            pair, {"strong": "openai/gpt-oss-120b", "weak": "meta-llama/Llama-3.2-1B-Instruct"}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same ids (any case) and a local checkpoint path are not compared
        live_loop.check_pair_models(
            pair, {"strong": "META-LLAMA/Llama-3.3-70B-Instruct", "weak": "/models/llama-1b"}
        )


ROUND2 = "\n\nThis is round 2 of a two-member committee."


def test_round_two_shows_each_member_its_own_round_one_review(tmp_path):
    """spec/live.md: round 2 shows both round-1 scores and explanations; each member's own is the one
    its round-1 call returned, the other member's the other (prompts.committee_round2_messages).
    Every review reply gets its own explanation, so a round-2 prompt says whose it shows."""
    lock, reasons = threading.Lock(), {}  # round-1 prompt text -> the explanations replied to it

    def numbered(role: str, body: dict) -> str:
        reply = well_formed(role, body)
        fmt = (body.get("response_format") or {}).get("json_schema", {}).get("name")
        content = body["messages"][-1]["content"]
        if fmt not in ("contribute_review", "finalize_review") or ROUND2 in content:
            return reply
        with lock:
            reason = f"explanation {sum(map(len, reasons.values()))}"
            reasons.setdefault(content, []).append(reason)
        return json.dumps({**json.loads(reply), "one_sentence_reason": reason})

    pair = stand_ins(numbered)
    try:
        run(pair, tmp_path / "run")
    finally:
        for server in pair:
            server.close()
    checked = 0
    for server in pair:
        for body in server.chats:
            content = body["messages"][-1]["content"]
            if ROUND2 not in content:
                continue
            own_prompt, shown = content.split(ROUND2, 1)
            own = re.search(r"Your explanation: (explanation \d+)", shown)[1]  # then any evidence quoted
            other = re.search(r"Its explanation: (explanation \d+)", shown)[1]
            mine = reasons[own_prompt]
            if other in mine:  # both members asked the same round-1 prompt: whose is whose is moot
                continue
            assert own in mine, (own, other, mine)
            checked += 1
    assert checked > 0
