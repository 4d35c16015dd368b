"""Live-backend throughput: the live client and the batched live runner against OpenAI-compatible
servers, measured in this run, on this machine.

Two kinds of server:
- `FixedLatencyStandIn`: a STAND-IN, not a model and not vLLM. A small asyncio HTTP/1.1 server in
  its own process (so its CPU time is not the client's) that answers `/v1/models` and
  `/v1/chat/completions` in the OpenAI format after sleeping a fixed `latency` per request
  (`asyncio.sleep`, so any number of requests wait at once). Its replies are well formed: a valid
  review JSON for review requests, a documented ability pair for inference, a `RESULT: ...` line
  otherwise; it honours `n` and reports usage. It counts what it received and how many requests
  it held at once (max and time-averaged). With the model's time fixed, what remains is the
  client's own overhead.
- The tiny random-weight Llama of tests/test_live_server.py behind a real
  `transformers serve --continuous-batching` on CPU (sections d and e; skipped with a message when
  torch / `transformers serve` is unavailable).

Sections (each prints a markdown table):
  a  requests/s and achieved in-flight requests against the client's semaphore (stand-in)
  b  host overhead at 256 in flight: wall time not explained by the stand-in's latency, and host
     CPU time per call; LiveClient with and without the response cache, and the bare openai SDK;
     then its floor: the SDK's `post` alone on an in-process transport (no socket, no server)
  c  the batched live runner (`run_live_streams`, 96 agents, 300 tasks, slots 16) against the
     stand-in at the ratio latency, vs a sequential client (calls x latency, computed, not run)
  d  one `n=3` request vs three requests (wall, HTTP calls, tokens): stand-in and tiny server
  e  the tiny `transformers serve` server: requests/s against the semaphore
  f  the baselines live (`live_baselines.run_live_baselines`, 6 agents, 42 BBH tasks per stream,
     5 streams) against the stand-in at the ratio latency: requests per batch and the batched
     wall against a sequential client (calls x latency, computed)

    python benchmarks/live_throughput.py --quick                # short; 88 s on 2 busy shared cores
    python benchmarks/live_throughput.py --out runs/live_throughput.json
    python benchmarks/live_throughput.py --sections a,b --latency 2.0

Definitions (also in benchmarks/README.md): a batch of B requests through a semaphore of C against
a stand-in of latency L has the ideal wall ceil(B / C) * L; host overhead = (wall - ideal) / wall,
the share of the wall during which the client was not waiting on the stand-in's latency. Host CPU
per call = the client process's CPU time (`time.process_time`, every thread) / HTTP calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from meshheal_jax import prompts
from meshheal_jax.backends import tiny_server as tiny
from meshheal_jax.backends.cache import ResponseCache
from meshheal_jax.backends.live import (
    CallRequest,
    LiveClient,
    RetryPolicy,
    ServerGroup,
    SyncLiveClient,
    request_seed,
)
from meshheal_jax.data import QuestionPoolWarning, load_sample
from meshheal_jax.prompts import review_reply
from meshheal_jax.topology import DATASETS, load_profile

SECTIONS = ("a", "b", "c", "d", "e", "f")
COLUMNS = {  # the tables' columns, in print order
    "a": ["semaphore", "requests", "sent", "server_received", "wall_s", "ideal_s", "requests_per_s",
          "ideal_requests_per_s", "client_max_in_flight", "server_max_in_flight", "server_mean_in_flight",
          "host_overhead", "cpu_ms_per_call"],
    "b": ["client", "requests", "server_received", "wall_s", "ideal_s", "host_overhead", "cpu_s",
          "cpu_ms_per_call", "cpu_share_of_wall", "client_max_in_flight", "server_max_in_flight",
          "server_mean_in_flight", "cyclic_garbage", "replies_per_commit"],
    "b_floor": ["client", "requests", "cpu_s", "cpu_ms_per_call"],
    "c": ["streams", "agents", "slots", "tasks", "rounds", "requests", "http_calls", "requests_per_round",
          "wall_s", "first_round_compile_s", "wall_excl_compile_s", "in_run_batch_s",
          "host_outside_batches_s", "ideal_batched_s", "sequential_s", "ratio", "ratio_excl_compile",
          "model_calls", "sequential_calls_s", "ratio_calls", "ratio_calls_excl_compile", "client_cpu_s",
          "server_max_in_flight"],
    "d": ["server", "variant", "samples", "http_calls", "n_fallback_calls", "wall_s",
          "prompt_tokens_counted", "prefill_shared_tokens", "prompt_tokens_prefilled", "completion_tokens",
          "parse_failures"],
    "e": ["server", "semaphore", "requests", "http_calls", "wall_s", "requests_per_s", "http_calls_per_s",
          "mean_latency_s", "completion_tokens", "client_max_in_flight"],
    "f": ["method", "streams", "tasks", "requests", "http_calls", "batches", "requests_per_batch",
          "max_batch", "wall_s", "in_run_batch_s", "ideal_batched_s", "sequential_s", "ratio", "accuracy"],
}  # fmt: skip
STAND_IN_ROOTS = {"strong": "stand-in/fixed-latency-strong", "weak": "stand-in/fixed-latency-weak"}
WEAK_MARK = "I cannot tell"  # in every weak execution reply; strong reviewers flag it (0.25)
CONTRIBUTE_MARK = "`HANDOFF: <what the next agent must still do>`"  # only in Contribute instructions
PARTIAL_MARK = "corrected partial result"  # only in Contribute-stage candidate / synthesis prompts
BENCH_RETRY = RetryPolicy(max_retries=2, backoff_base_s=0.05, backoff_cap_s=0.2, request_timeout_s=120.0)
POOL_SHARDS = 8  # section b: the same stand-in behind 8 client pools (the httpx2 pool scan is O(pool size))
TINY_MAX_TOKENS = 4  # CPU decoding through transformers serve: tens of ms a token


# =============================================================================================
# The fixed-latency stand-in: the server side (runs in its own process)


def _profile_pairs() -> dict[str, tuple[list[str], list[list[str]]]]:
    """task type -> (its documented pair, every documented pair of its dataset), ability names."""
    out = {}
    for dataset in DATASETS:
        profile = load_profile(dataset)
        pairs = [[profile.abilities[a] for a in sorted(p)] for p in profile.pairs]
        for ty, req in zip(profile.task_types, profile.requires, strict=True):
            out[ty] = ([profile.abilities[a] for a in sorted(req)], pairs)
    return out


def stand_in_reply(role: str, body: dict, pairs: dict) -> str:
    """The stand-in's reply text: plausible, well formed, decided by the request alone. A "strong"
    model writes sound outputs and flags outputs carrying WEAK_MARK; a "weak" one writes such
    outputs, names another documented pair and reviews everything 0.5."""
    content = body["messages"][-1]["content"]
    fmt = ((body.get("response_format") or {}).get("json_schema") or {}).get("name")
    if fmt == "ability_pair":
        task_type = content.rsplit("Task type: ", 1)[-1].split("\n", 1)[0].strip()
        pair, every = pairs.get(task_type, (None, None))
        if pair is None:
            every = next(iter(pairs.values()))[1]
            pair = every[0]
        if role == "weak":
            pair = next((p for p in every if p != pair), pair)
        return json.dumps({"abilities": pair})
    if fmt in ("contribute_review", "finalize_review"):
        judged = content.split("Output under review:\n<<<\n", 1)[-1].split("\n>>>", 1)[0]
        score = 0.5 if role == "weak" else (0.25 if WEAK_MARK in judged else 1.0)
        stage = "finalize" if fmt == "finalize_review" else "contribute"
        return review_reply(score, stage, evidence=WEAK_MARK)
    if fmt == "agent_choice":  # the baselines' router / manager: the lowest-numbered candidate
        return json.dumps(
            {"agent": min(body["response_format"]["json_schema"]["schema"]["properties"]["agent"]["enum"])}
        )
    if fmt == "answer_evaluation":  # SAC: another team's weak answer scores low
        other = content.split("Another team's answer:\n<<<\n", 1)[-1].split("\n>>>", 1)[0]
        return json.dumps({"own_score": 1.0, "other_score": 0.25 if WEAK_MARK in other else 1.0,
                           "one_sentence_reason": "."})  # fmt: skip
    if CONTRIBUTE_MARK in content or PARTIAL_MARK in content:
        body_text = WEAK_MARK if role == "weak" else "The delegated part is worked out step by step."
        return f"COMPETENCE_MATCH:partial\n{body_text}\nRESULT: partial result\nHANDOFF: finish the task"
    answer = WEAK_MARK if role == "weak" else "(A)"
    return f"COMPETENCE_MATCH:partial\nCombining the draft into one answer.\nRESULT: {answer}"


class _StandInServer:
    """The asyncio HTTP/1.1 server of the stand-in (keep-alive, Content-Length bodies)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.pairs = _profile_pairs()
        self.reset()

    def reset(self) -> None:
        self.requests = 0  # chat completions received
        self.samples = 0  # sum of their n
        self.in_flight = 0
        self.max_in_flight = 0
        self.busy_s = 0.0  # sum over requests of their time in the server
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.prefill_tokens = 0  # prompt tokens once per request (what a server prefills)
        self.prompt_tokens = 0  # prompt tokens once per sample (as the paper counts)
        self.completion_tokens = 0

    def stats(self) -> dict:
        window = (self.last_end - self.first_start) if self.first_start and self.last_end else 0.0
        return {
            "latency_s": self.latency_s, "requests": self.requests, "samples": self.samples,
            "max_in_flight": self.max_in_flight, "in_flight_now": self.in_flight,
            "busy_window_s": window, "mean_in_flight": self.busy_s / window if window > 0 else 0.0,
            "prefill_tokens": self.prefill_tokens, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }  # fmt: skip

    async def chat(self, body: dict) -> dict:
        start = time.monotonic()
        if self.first_start is None:
            self.first_start = start
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
            end = time.monotonic()
            self.busy_s += end - start
            self.last_end = end
        n = int(body.get("n") or 1)
        role = "weak" if body.get("model") == "weak" else "strong"
        text = stand_in_reply(role, body, self.pairs)
        prompt = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4 + 1
        completion = (len(text) // 4 + 1) * n
        self.samples += n
        self.prefill_tokens += prompt
        self.prompt_tokens += prompt * n
        self.completion_tokens += completion
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                   for i in range(n)]  # fmt: skip
        return {"id": f"standin-{self.requests}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "strong"), "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}  # fmt: skip

    async def route(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if method == "POST" and path == "/v1/chat/completions":
            return 200, await self.chat(json.loads(body))
        if method == "GET" and path == "/v1/models":
            data = [{"id": name, "object": "model", "owned_by": "stand-in", "root": root}
                    for name, root in STAND_IN_ROOTS.items()]  # fmt: skip
            return 200, {"object": "list", "data": data}
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path == "/stand-in/stats":
            return 200, self.stats()
        if method == "POST" and path == "/stand-in/reset":
            latency = json.loads(body or b"{}").get("latency_s")
            if latency is not None:
                self.latency_s = float(latency)
            self.reset()
            return 200, self.stats()
        return 404, {"error": {"message": f"no route {method} {path}"}}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                status, payload = await self.route(method, path.split("?", 1)[0], body)
                data = json.dumps(payload).encode()
                reason = "OK" if status == 200 else "Not Found"
                writer.write(
                    f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()


async def _serve_stand_in(latency_s: float) -> None:
    server = _StandInServer(latency_s)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, backlog=4096, limit=2**22)
    print(f"READY {listener.sockets[0].getsockname()[1]}", flush=True)
    async with listener:
        await listener.serve_forever()


# =============================================================================================
# The fixed-latency stand-in: the handle the benchmark holds


class FixedLatencyStandIn:
    """A fixed-latency OpenAI-compatible STAND-IN (not a model), served by a child process.

    with FixedLatencyStandIn(latency_s=2.0) as stand_in:
        stand_in.reset()                  # zero its counters (and optionally set a new latency)
        ... send requests to stand_in.url (served names "strong" and "weak") ...
        stand_in.stats()                  # requests, samples, max / mean in flight, tokens
    """

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-stand-in", str(latency_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"the stand-in did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.port = int(line.split()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        with urllib.request.urlopen(req, timeout=10) as reply:
            return json.loads(reply.read())

    def reset(self, latency_s: float | None = None) -> None:
        if latency_s is not None:
            self.latency_s = latency_s
        self._call("POST", "/stand-in/reset", {"latency_s": self.latency_s})

    def stats(self) -> dict:
        return self._call("GET", "/stand-in/stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# =============================================================================================
# Requests: real prompts (bbh sample), distinct seeds


def _message_sets() -> list[tuple[str, tuple, dict]]:
    """(kind, messages, CallRequest keywords) per sample question: a Contribute execution and an
    initial review of a draft, built by the project's prompt builders."""
    profile = load_profile("bbh")
    out = []
    for record in load_sample("bbh")[:8]:
        task = prompts.TaskText("bbh", record.question, record.task_type, record.options)
        held = prompts.abilities_of(
            profile, [profile.requires[profile.task_types.index(record.task_type)][0]]
        )
        out.append(("generate", tuple(prompts.execution_messages(task, held, "partial", "contribute")),
                    {"parser": prompts.execution_parser("bbh")}))  # fmt: skip
        out.append(("review", tuple(prompts.review_messages(task, "contribute", "I count 8.\nRESULT: 8", held, held)),
                    {"response_format": prompts.review_response_format("contribute"),
                     "parser": prompts.review_parser("contribute")}))  # fmt: skip
    return out


_MESSAGES: list | None = None


def bench_requests(
    count: int, kinds: Sequence[str] = ("generate", "review"), n: int = 1, seed_base: int = 0,
    max_tokens: int = 512, role: str = "strong",
) -> list[CallRequest]:  # fmt: skip
    """`count` CallRequests cycling over the sample's prompts of the given kinds; every request has
    its own seed, so none is a cache hit of another."""
    global _MESSAGES
    if _MESSAGES is None:
        _MESSAGES = _message_sets()
    sets = [m for m in _MESSAGES if m[0] in kinds]
    return [
        CallRequest(stream=0, t=i + 1, call_id=0, kind=sets[i % len(sets)][0], role=role,
                    messages=sets[i % len(sets)][1], seed=request_seed(seed_base, 0, i + 1, 0),
                    max_completion_tokens=max_tokens, n=n, **sets[i % len(sets)][2])
        for i in range(count)
    ]  # fmt: skip


# =============================================================================================
# Measuring one batch


def _reset_client_peaks(client: LiveClient) -> None:
    for stats in client.server_stats():
        stats.max_in_flight = 0


async def timed_batch(client: LiveClient, requests: list[CallRequest]) -> dict:
    """Wall and client CPU of one run_batch, with the client's peak requests in flight."""
    _reset_client_peaks(client)
    sent0 = client.stats.http_requests
    cpu0, t0 = time.process_time(), time.perf_counter()
    responses = await client.run_batch(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "wall_s": wall, "cpu_s": cpu, "http_calls": client.stats.http_requests - sent0,
        "client_max_in_flight": max(s.max_in_flight for s in client.server_stats()),
        "responses": responses,
    }  # fmt: skip


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (its own CPU and counts kept together)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return ordered[(len(ordered) - 1) // 2]


def stand_in_group(url: str, semaphore: int, role: str = "strong") -> ServerGroup:
    return ServerGroup(role, (url,), max_in_flight=semaphore)


# =============================================================================================
# Section a: requests/s and in-flight against the semaphore


def section_a(stand_in: FixedLatencyStandIn, latency: float, semaphores: Sequence[int], waves: int,
              repeats: int) -> dict:  # fmt: skip
    rows = []

    async def measure(c: int) -> dict:
        async with LiveClient([stand_in_group(stand_in.url, c)], retry=BENCH_RETRY) as client:
            await client.run_batch(bench_requests(c, seed_base=10_000 + c))  # warm-up: connections, dropped
            runs = []
            for k in range(repeats):
                batch = bench_requests(waves * c, seed_base=k * 100_003 + c)
                stand_in.reset(latency)
                run = await timed_batch(client, batch)
                run["server"] = stand_in.stats()
                runs.append(run)
            return median_run(runs)

    for c in semaphores:
        run = asyncio.run(measure(c))
        server = run["server"]
        b = waves * c
        ideal = math.ceil(b / c) * latency
        rows.append({
            "semaphore": c, "requests": b, "sent": run["http_calls"], "server_received": server["requests"],
            "wall_s": run["wall_s"], "ideal_s": ideal, "requests_per_s": b / run["wall_s"],
            "ideal_requests_per_s": c / latency, "client_max_in_flight": run["client_max_in_flight"],
            "server_max_in_flight": server["max_in_flight"], "server_mean_in_flight": server["mean_in_flight"],
            "host_overhead": (run["wall_s"] - ideal) / run["wall_s"], "cpu_ms_per_call": 1e3 * run["cpu_s"] / b,
        })  # fmt: skip
    return {
        "title": f"a: requests/s and in-flight vs semaphore (stand-in, latency {latency:g} s, "
        f"{waves} waves per batch, median of {repeats})",
        "columns": COLUMNS["a"],
        "rows": rows,
    }


# =============================================================================================
# Section b: host overhead at 256 in flight


async def live_client_batches(
    stand_in: FixedLatencyStandIn, latency: float, in_flight: int, size: int, repeats: int,
    cache_dir: Path | None = None, shards: int = 1, pause_gc: bool = True,
) -> list[dict]:  # fmt: skip
    """`repeats` timed batches of `size` requests through LiveClient as the live runner opens it
    (after a dropped warm-up batch), with a ResponseCache in `cache_dir` if given; `shards` > 1
    lists the stand-in's URL that many times (one openai client, connection pool and semaphore of
    in_flight / shards per URL); `pause_gc=False` leaves Python's cyclic collector running."""
    runs = []
    cache = ResponseCache(cache_dir / "responses.sqlite") if cache_dir is not None else None
    group = ServerGroup("strong", (stand_in.url,) * shards, max_in_flight=in_flight // shards)
    try:
        async with LiveClient([group], cache=cache, retry=BENCH_RETRY, pause_gc=pause_gc) as client:
            await client.run_batch(bench_requests(in_flight, seed_base=20_000))  # warm-up, dropped
            for k in range(repeats):
                batch = bench_requests(size, seed_base=30_000 + k * 100_003)
                stand_in.reset(latency)
                gc.collect()
                # the response cache's grouped writes (decisions L2): replies per sqlite commit (none
                # before them: an older checkout's cache, as cache_cost.py's A/B runs, has no count)
                counted = cache is not None and hasattr(cache, "commits")
                before = (cache.writes, cache.commits) if counted else None
                run = await timed_batch(client, batch)
                run["replies_per_commit"] = (
                    (cache.writes - before[0]) / max(cache.commits - before[1], 1) if counted else math.nan
                )
                run["server"] = stand_in.stats()
                del run["responses"]
                # what the batch left for the collector: its objects in reference cycles
                run["cyclic_garbage"] = gc.collect()
                runs.append(run)
    finally:
        if cache is not None:
            cache.close()
    return runs


def section_b(
    stand_in: FixedLatencyStandIn, latency: float, in_flight: int, waves: int, repeats: int
) -> dict:
    b = waves * in_flight
    ideal = math.ceil(b / in_flight) * latency
    rows = []

    async def bare_sdk() -> dict:
        """The openai SDK alone (same pool size, a semaphore, no parsing beyond the SDK's own):
        what any client built on it pays."""
        import openai

        from meshheal_jax.backends.live import POOL_HEADROOM, _http_client

        http = _http_client(openai, in_flight + POOL_HEADROOM, BENCH_RETRY)
        client = openai.AsyncOpenAI(base_url=stand_in.url, api_key="EMPTY", http_client=http, max_retries=0)
        semaphore = asyncio.Semaphore(in_flight)
        peak = {"now": 0, "max": 0}

        async def one(req: CallRequest) -> None:
            async with semaphore:
                peak["now"] += 1
                peak["max"] = max(peak["max"], peak["now"])
                try:
                    await client.chat.completions.create(
                        model="strong", messages=list(req.messages), n=req.n, seed=req.seed,
                        max_completion_tokens=req.max_completion_tokens,
                        **({"response_format": dict(req.response_format)} if req.response_format else {}),
                    )  # fmt: skip
                finally:
                    peak["now"] -= 1

        try:
            await asyncio.gather(*(one(r) for r in bench_requests(in_flight, seed_base=40_000)))
            runs = []
            for k in range(repeats):
                batch = bench_requests(b, seed_base=50_000 + k * 100_003)
                stand_in.reset(latency)
                peak["max"] = 0
                gc.collect()
                cpu0, t0 = time.process_time(), time.perf_counter()
                await asyncio.gather(*(one(r) for r in batch))
                runs.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
                             "http_calls": b, "client_max_in_flight": peak["max"], "server": stand_in.stats(),
                             "cyclic_garbage": gc.collect()})  # fmt: skip
            return median_run(runs)
        finally:
            await client.close()

    async def sdk_floor(count: int) -> list[dict]:
        """CPU per call of the SDK's `post` (the call LiveClient makes: same bodies and request
        options, `live._post_options`; median of `repeats` passes over `count` bodies) on an in-process
        transport: the HTTP library's MockTransport answers a canned chat completion at once, so
        there is no socket, no server and no waiting, only the client's own work. Then the HTTP
        library's `post` alone on the same transport. What any client built on AsyncOpenAI pays
        per call before the network; compare it with the per-call CPU that < 5% allows (above)."""
        import openai

        from meshheal_jax.backends.live import (
            _http_library,
            _post_options,
            _sdk_client,
            chat_body,
            request_params,
        )

        lib = _http_library(openai.DefaultAsyncHttpxClient)
        reply = json.dumps({"id": "floor", "object": "chat.completion", "created": 0, "model": "strong",
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "RESULT: 42"}}],
                            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}).encode()  # fmt: skip
        http = lib.AsyncClient(transport=lib.MockTransport(
            lambda _: lib.Response(200, content=reply, headers={"content-type": "application/json"})))  # fmt: skip
        client = _sdk_client(openai, "http://stand-in.invalid/v1", "EMPTY", http)
        bodies = [chat_body("strong", r.messages, request_params(r, r.n, r.seed, None))
                  for r in bench_requests(count, seed_base=60_000)]  # fmt: skip
        options = _post_options(openai)
        out = []
        try:
            for name, call in (
                ("openai SDK `post` alone, in-process transport (CPU floor, no socket)",
                 lambda body: client.post("/chat/completions", cast_to=object, body=body, options=options)),
                ("its HTTP library's `post` alone, same transport",
                 lambda body: http.post("http://stand-in.invalid/v1/chat/completions", json=body)),
            ):  # fmt: skip
                for body in bodies[:256]:  # warm-up, dropped
                    await call(body)
                passes = []
                for _ in range(repeats):
                    cpu0 = time.process_time()
                    for body in bodies:
                        await call(body)
                    passes.append(time.process_time() - cpu0)
                cpu = statistics.median(passes)
                out.append(
                    {"client": name, "requests": count, "cpu_s": cpu, "cpu_ms_per_call": 1e3 * cpu / count}
                )
        finally:
            await client.close()
        return out

    with tempfile.TemporaryDirectory(prefix="live-throughput-") as tmp:

        async def live_client(cache_dir: Path | None = None, shards: int = 1, pause_gc: bool = True) -> dict:
            runs = await live_client_batches(
                stand_in, latency, in_flight, b, repeats, cache_dir, shards, pause_gc
            )
            return median_run(runs)

        variants = [
            ("LiveClient, no cache", lambda: live_client()),
            (
                "LiveClient, cyclic collector not paused (pause_gc=False)",
                lambda: live_client(pause_gc=False),
            ),
            ("LiveClient + ResponseCache (sqlite)", lambda: live_client(Path(tmp))),
            (
                f"LiveClient, the URL listed {POOL_SHARDS}x ({POOL_SHARDS} pools of {in_flight // POOL_SHARDS})",
                lambda: live_client(shards=POOL_SHARDS),
            ),
            ("openai SDK alone (reference)", bare_sdk),
        ]
        for name, factory in variants:
            run = asyncio.run(factory())
            server = run["server"]
            rows.append({
                "client": name, "requests": b, "server_received": server["requests"], "wall_s": run["wall_s"],
                "ideal_s": ideal, "host_overhead": (run["wall_s"] - ideal) / run["wall_s"],
                "cpu_s": run["cpu_s"], "cpu_ms_per_call": 1e3 * run["cpu_s"] / b,
                "cpu_share_of_wall": run["cpu_s"] / run["wall_s"],
                "client_max_in_flight": run["client_max_in_flight"],
                "server_max_in_flight": server["max_in_flight"], "server_mean_in_flight": server["mean_in_flight"],
                "cyclic_garbage": run["cyclic_garbage"], "replies_per_commit": run.get("replies_per_commit", math.nan),
            })  # fmt: skip
    floor = {
        "title": "b (floor): the openai SDK's own CPU per call, no socket and no server (median of the passes)",
        "columns": COLUMNS["b_floor"],
        "rows": asyncio.run(sdk_floor(b)),
    }
    return {
        "title": f"b: host overhead at {in_flight} in flight (stand-in, latency {latency:g} s, {b} requests = "
        f"{waves} waves, median of {repeats})",
        "columns": COLUMNS["b"],
        "rows": rows,
        "floor": floor,
    }


# =============================================================================================
# Section c: the batched live runner vs a sequential client


class TimedSyncLiveClient(SyncLiveClient):
    """SyncLiveClient that records (start, end, requests, http calls) of every run_batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[float, float, int, int]] = []

    def run_batch(self, requests):
        sent0 = self.client.stats.http_requests
        start = time.perf_counter()
        out = super().run_batch(requests)
        self.batches.append(
            (start, time.perf_counter(), len(requests), self.client.stats.http_requests - sent0)
        )
        return out


def live_specs(n_agents: int, n_tasks: int, seeds: Sequence[int]):
    """The scale experiment's network (sparse graph, the bbh profile replicated, A3 and A5 of every
    replica degraded from the stream's midpoint) on an n_tasks prefix of its stream."""
    import numpy as np

    from meshheal_jax import engine
    from meshheal_jax.params import load_pair
    from meshheal_jax.runner import Experiment
    from meshheal_jax.streams import Stream, make_stream, persistent_schedule

    exp = Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=tuple(seeds),
                     slots=max(n_agents // 6, 1), n_agents=n_agents, n_tasks=504 * n_agents // 6,
                     degraded=None, topology="sparse")  # fmt: skip
    network = exp.network("bbh")
    profile = network.profile
    targets = tuple(sorted(r * 6 + a for r in range(n_agents // 6) for a in profile.degraded_targets))
    schedule = persistent_schedule(n_agents, n_tasks, targets)  # degraded from n_tasks // 2 + 1
    starts, names = exp.phases()
    specs = []
    for seed in seeds:
        full = make_stream(seed, profile.dataset_id, exp.n_tasks, len(profile.task_types), starts, names)
        phase = (np.arange(1, n_tasks + 1) > n_tasks // 2).astype(np.int32)
        stream = Stream(
            seed, profile.dataset_id, full.task_type[:n_tasks], full.question[:n_tasks], phase, names
        )
        specs.append(engine.StreamSpec(network, stream, schedule, load_pair("default"),
                                       {"method": "meshheal", "dataset": "bbh", "pair": "default", "seed": seed}))  # fmt: skip
    return specs


def section_c(stand_in: FixedLatencyStandIn, latency: float, n_agents: int, n_tasks: int, semaphore: int,
              streams: Sequence[int]) -> dict:  # fmt: skip
    from meshheal_jax.backends.live_loop import run_live_streams
    from meshheal_jax.config import ProtocolParams

    rows = []
    for n_streams in streams:
        specs = live_specs(n_agents, n_tasks, range(n_streams))
        slots = max(n_agents // 6, 1)
        stand_in.reset(latency)
        client = TimedSyncLiveClient(
            [
                stand_in_group(stand_in.url, semaphore, "strong"),
                stand_in_group(stand_in.url, semaphore, "weak"),
            ],
            retry=BENCH_RETRY,
        )
        try:
            cpu0, t0 = time.process_time(), time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QuestionPoolWarning)
                frames = run_live_streams(specs, ProtocolParams(), client, load_sample("bbh"), slots=slots)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            client.close()
        server = stand_in.stats()
        batches = client.batches
        in_batches = sum(end - start for start, end, _, _ in batches)
        # the first round traces and compiles both jitted halves (begin before the first batch;
        # absorb on a worker thread from the start, waited for after the first batch if not yet
        # done): reported apart, replaced by the median gap of the other rounds. model_calls are
        # the calls table's rows: a retried request (parse failure) is one call, two requests
        gaps = (
            [batches[0][0] - t0]
            + [b[0] - a[1] for a, b in itertools.pairwise(batches)]
            + [t0 + wall - batches[-1][1]]
        )
        typical = statistics.median(gaps[2:-1]) if len(gaps) > 3 else 0.0
        compile_s = max(gaps[0] + gaps[1] - 2 * typical, 0.0)
        steady = wall - compile_s
        calls = server["requests"]
        sequential = calls * latency
        # model calls as spec/emulator.md counts them (each of the three review samples is a call):
        # the rows of the calls table. A client sending one call at a time sends each sample alone.
        model_calls = sum(f["calls"].height for f in frames)
        tasks = sum(f["tasks"].height for f in frames)
        rows.append({
            "streams": n_streams, "agents": n_agents, "slots": slots, "tasks": tasks, "rounds": len(batches),
            "requests": sum(b[2] for b in batches), "http_calls": calls,
            "requests_per_round": sum(b[2] for b in batches) / len(batches),
            "wall_s": wall, "first_round_compile_s": compile_s, "wall_excl_compile_s": steady,
            "in_run_batch_s": in_batches, "host_outside_batches_s": wall - compile_s - in_batches,
            "ideal_batched_s": len(batches) * latency, "sequential_s": sequential,
            "ratio": sequential / wall, "ratio_excl_compile": sequential / steady,
            "model_calls": model_calls, "sequential_calls_s": model_calls * latency,
            "ratio_calls": model_calls * latency / wall, "ratio_calls_excl_compile": model_calls * latency / steady,
            "client_cpu_s": cpu, "server_max_in_flight": server["max_in_flight"],
        })  # fmt: skip
    return {
        "title": f"c: batched live runner vs a sequential client ({n_agents} agents sparse, {n_tasks} tasks per stream, "
        f"slots {max(n_agents // 6, 1)}, stand-in latency {latency:g} s; sequential = HTTP calls x latency "
        "(an n=3 review one request) and model calls x latency (each review sample a call), computed)",
        "columns": COLUMNS["c"],
        "rows": rows,
    }


def section_f(stand_in: FixedLatencyStandIn, latency: float, n_tasks: int, n_streams: int,
              methods: Sequence[str]) -> dict:  # fmt: skip
    """Each baseline's compiled program with live callbacks: a call site's calls of every stream
    go out as one batch."""
    from meshheal_jax.backends.live_baselines import run_live_baselines
    from meshheal_jax.baselines import BaselineSpec
    from meshheal_jax.streams import make_stream, persistent_schedule
    from meshheal_jax.topology import build_network

    profile = load_profile("bbh")
    specs = [BaselineSpec(build_network(profile, 6),
                          make_stream(seed, profile.dataset_id, n_tasks, len(profile.task_types),
                                      (1, n_tasks // 2 + 1), ("healthy", "degraded")),
                          persistent_schedule(6, n_tasks, profile.degraded_targets),
                          {"dataset": "bbh", "seed": seed}) for seed in range(n_streams)]  # fmt: skip
    rows = []
    for method in methods:
        stand_in.reset(latency)
        client = TimedSyncLiveClient([stand_in_group(stand_in.url, 256, "strong"),
                                      stand_in_group(stand_in.url, 256, "weak")], retry=BENCH_RETRY)  # fmt: skip
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QuestionPoolWarning)
                frames = run_live_baselines(method, specs, "default", client, load_sample("bbh"))
            wall = time.perf_counter() - t0
        finally:
            client.close()
        calls = stand_in.stats()["requests"]
        batches = client.batches
        requests = sum(b[2] for b in batches)
        tasks = sum(f["tasks"].height for f in frames)
        rows.append({
            "method": method, "streams": n_streams, "tasks": tasks, "requests": requests, "http_calls": calls,
            "batches": len(batches), "requests_per_batch": requests / len(batches),
            "max_batch": max(b[2] for b in batches), "wall_s": wall,
            "in_run_batch_s": sum(end - start for start, end, _, _ in batches),
            "ideal_batched_s": len(batches) * latency, "sequential_s": calls * latency,
            "ratio": calls * latency / wall,
            "accuracy": sum(int(f["tasks"]["correct"].sum()) for f in frames) / tasks,
        })  # fmt: skip
    return {
        "title": f"f: the baselines live (6 agents, {n_tasks} BBH tasks per stream, {n_streams} streams, stand-in "
        f"latency {latency:g} s; the wall includes each program's trace and compile; sequential = HTTP calls x "
        "latency, computed)",
        "columns": COLUMNS["f"],
        "rows": rows,
    }


# =============================================================================================
# Section d: n=3 in one request vs three requests


async def _n_vs_three(url: str, group_kw: dict, count: int, kind: str, max_tokens: int, semaphore: int,
                      stand_in: FixedLatencyStandIn | None, latency: float) -> list[dict]:  # fmt: skip
    rows = []
    group = ServerGroup("strong", (url,), max_in_flight=semaphore, **group_kw)
    async with LiveClient([group], retry=BENCH_RETRY) as client:
        await client.run_batch(bench_requests(min(semaphore, count), kinds=(kind,), seed_base=60_000,
                                              max_tokens=max_tokens))  # warm-up, dropped  # fmt: skip
        base = bench_requests(count, kinds=(kind,), n=3, seed_base=70_000, max_tokens=max_tokens)
        three = [
            dataclasses.replace(r, n=1, seed=r.seed + i, call_id=3 * r.call_id + i)
            for r in base
            for i in range(3)
        ]
        for name, batch in (("one request, n=3", base), ("three requests, n=1", three)):
            if stand_in is not None:
                stand_in.reset(latency)
            before = dict(vars(client.stats))
            run = await timed_batch(client, batch)
            after = vars(client.stats)
            server = stand_in.stats() if stand_in is not None else None
            responses = run["responses"]
            samples = sum(len(r.texts) for r in responses)
            rows.append({
                "server": "stand-in" if stand_in is not None else "tiny transformers serve",
                "variant": name, "samples": samples, "http_calls": run["http_calls"],
                "n_fallback_calls": after["n_fallback_calls"] - before["n_fallback_calls"],
                "wall_s": run["wall_s"],
                "prompt_tokens_counted": sum(r.prompt_tokens for r in responses),
                "prefill_shared_tokens": sum(r.prefix_shared_tokens for r in responses),
                "prompt_tokens_prefilled": server["prefill_tokens"] if server else
                    sum(r.prompt_tokens - r.prefix_shared_tokens for r in responses),
                "completion_tokens": sum(r.completion_tokens for r in responses),
                "parse_failures": sum(r.parse_failures for r in responses),
            })  # fmt: skip
    return rows


def section_d(stand_in: FixedLatencyStandIn | None, latency: float, count: int, tiny: dict | None,
              tiny_count: int) -> dict:  # fmt: skip
    rows = []
    if stand_in is not None:
        rows += asyncio.run(_n_vs_three(stand_in.url, {}, count, "review", 512, 256, stand_in, latency))
    note = None
    if tiny is not None and tiny.get("url"):
        group_kw = {"model_id": tiny.TINY_MODEL_ID, "served_name": tiny["served_name"]}
        rows += asyncio.run(_n_vs_three(tiny["url"], group_kw, tiny_count, "generate", TINY_MAX_TOKENS, 16,
                                        None, 0.0))  # fmt: skip
    elif tiny is not None:
        note = tiny["skipped"]
    return {
        "title": f"d: initial review as one n=3 request vs three requests (stand-in: {count} reviews, latency "
        f"{latency:g} s; tiny server: {tiny_count} execution calls, {TINY_MAX_TOKENS} tokens)",
        "columns": COLUMNS["d"],
        "rows": rows,
        **({"skipped": note} if note else {}),
    }


# =============================================================================================
# Section e: the tiny transformers-serve server


@contextlib.contextmanager
def tiny_server(continuous_batching: bool = True):
    """Yields {"url", "served_name", "mode"} of a running `transformers serve` on the tiny model
    (meshheal_jax.backends.tiny_server), or {"skipped": why} when it cannot run here."""
    flag = "--continuous-batching" if continuous_batching else "--no-continuous-batching"
    reason = tiny.unavailable()
    if reason is not None:
        yield {"skipped": f"tiny transformers-serve server skipped: {reason}"}
        return
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        model_dir = Path(tmp) / "model"
        tiny.build_tiny_llama(model_dir)
        with contextlib.ExitStack() as stack:
            try:
                url = stack.enter_context(tiny.serve_tiny(model_dir, [flag]))
            except RuntimeError as err:
                yield {"skipped": f"tiny transformers-serve server ({flag}) skipped: {str(err)[:800]}"}
                return
            yield {"url": url, "served_name": str(model_dir), "mode": flag}


def section_e(servers: Sequence[dict], semaphores: Sequence[int], count: int) -> dict:
    rows, skipped = [], []

    async def measure(server: dict, c: int) -> dict:
        group = ServerGroup("strong", (server["url"],), model_id=tiny.TINY_MODEL_ID, served_name=server["served_name"],
                            max_in_flight=c)  # fmt: skip
        async with LiveClient([group], retry=BENCH_RETRY) as client:
            await client.run_batch(bench_requests(min(c, count), kinds=("generate",), seed_base=80_000 + c,
                                                  max_tokens=TINY_MAX_TOKENS))  # warm-up, dropped  # fmt: skip
            batch = bench_requests(
                count, kinds=("generate",), seed_base=90_000 + c, max_tokens=TINY_MAX_TOKENS
            )
            return await timed_batch(client, batch)

    for server in servers:
        if "url" not in server:
            skipped.append(server["skipped"])
            continue
        for c in semaphores:
            run = asyncio.run(measure(server, c))
            latencies = [r.latency_s for r in run["responses"]]
            rows.append({
                "server": f"transformers serve {server['mode']}", "semaphore": c, "requests": count,
                "http_calls": run["http_calls"], "wall_s": run["wall_s"], "requests_per_s": count / run["wall_s"],
                "http_calls_per_s": run["http_calls"] / run["wall_s"],
                "mean_latency_s": statistics.fmean(latencies),
                "completion_tokens": sum(r.completion_tokens for r in run["responses"]),
                "client_max_in_flight": run["client_max_in_flight"],
            })  # fmt: skip
    out = {
        "title": f"e: tiny random Llama behind transformers serve on CPU: requests/s vs semaphore ({count} execution "
        f"calls, max {TINY_MAX_TOKENS} tokens each)",
        "columns": COLUMNS["e"],
        "rows": rows,
    }
    if skipped:
        out["skipped"] = "; ".join(skipped)
    return out


# =============================================================================================
# Output


def machine() -> dict:
    import importlib.metadata

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    versions = {}
    for pkg in ("openai", "httpx2", "httpx", "transformers", "torch", "jax"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    gpu = shutil.which("nvidia-smi") is not None
    return {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "memory_gib": round(mem, 1),
        "gpu": "nvidia-smi present" if gpu else "none", "load_average": os.getloadavg(),
        "python": platform.python_version(), "versions": versions,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }  # fmt: skip


def _cell(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def print_table(table: dict) -> None:
    print(f"\n### {table['title']}")
    if table.get("skipped"):
        print(f"skipped: {table['skipped']}")
    if not table["rows"]:
        return
    cols = table["columns"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in table["rows"]:
        print("| " + " | ".join(_cell(row.get(c)) for c in cols) + " |")


def targets(tables: dict, in_flight: int, latency: float, ratio_latency: float) -> list[dict]:
    """The issue's two targets (the first for the client without and with the response cache, the
    second read two ways: HTTP requests and model calls), with whether this run used the
    configuration they are stated for."""
    out = []
    b = tables.get("b")
    if b and b["rows"]:
        # LiveClient as the live runner opens it (one pool per server), without and with the
        # response cache (a live run with a run folder opens one there)
        for row in (b["rows"][0], next(r for r in b["rows"] if "ResponseCache" in r["client"])):
            out.append({"target": f"host overhead < 5% at 256 in flight, 2 s latency ({row['client']})",
                        "value": row["host_overhead"], "met": row["host_overhead"] < 0.05,
                        "applies": in_flight == 256 and latency == 2.0, "run": f"{in_flight} in flight, {latency:g} s"})  # fmt: skip
    c = tables.get("c")
    if c and c["rows"]:
        row = c["rows"][0]
        applies = (row["agents"], row["tasks"], row["streams"], ratio_latency) == (96, 300, 1, 0.2)
        run = f"{row['agents']} agents, {row['tasks']} tasks, {row['streams']} stream, {ratio_latency:g} s"
        for counted, ratio, excl in (("HTTP requests (an n=3 review one request)", "ratio", "ratio_excl_compile"),
                                     ("model calls (each review sample a call)", "ratio_calls", "ratio_calls_excl_compile")):  # fmt: skip
            out.append({"target": "batched runner >= 20x shorter than a sequential client (96 agents, 300 tasks, "
                                  f"0.2 s; sequential = {counted} x latency)",
                        "value": row[ratio], "met": row[ratio] >= 20, "applies": applies, "run": run,
                        "excluding_compile": row[excl]})  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="short latencies, fewer requests, small runner: about a minute"
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of a,b,c,d,e,f")
    ap.add_argument(
        "--latency",
        type=float,
        default=None,
        help="stand-in latency (s) of sections a, b, d (2.0; quick 0.2)",
    )
    ap.add_argument(
        "--ratio-latency",
        type=float,
        default=None,
        help="stand-in latency (s) of section c (0.2; quick 0.05)",
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per row, median quoted (3; quick 1)"
    )
    ap.add_argument("--in-flight", type=int, default=256, help="semaphore of section b")
    ap.add_argument("--agents", type=int, default=None, help="section c network size (96; quick 12)")
    ap.add_argument("--tasks", type=int, default=None, help="section c tasks per stream (300; quick 24)")
    ap.add_argument(
        "--streams",
        default=None,
        help="section c: comma-separated stream counts, one row each (1,5; quick 1)",
    )
    ap.add_argument(
        "--no-tiny-server", action="store_true", help="skip the transformers-serve parts of d and e"
    )
    ap.add_argument("--out", type=Path, help="write every table (and the machine) to this JSON file")
    ap.add_argument("--serve-stand-in", type=float, metavar="LATENCY", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_stand_in is not None:
        asyncio.run(_serve_stand_in(args.serve_stand_in))
        return {}
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    quick = args.quick
    latency = args.latency if args.latency is not None else (0.2 if quick else 2.0)
    ratio_latency = args.ratio_latency if args.ratio_latency is not None else (0.05 if quick else 0.2)
    repeats = args.repeats or (1 if quick else 3)
    agents = args.agents or (12 if quick else 96)
    tasks = args.tasks or (24 if quick else 300)
    streams = [int(s) for s in (args.streams or ("1" if quick else "1,5")).split(",")]

    if quick and "c" in sections and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # quick: XLA's CPU optimisation off (as tests/conftest.py does), compile ~3x shorter; set
        # before JAX starts (section c imports it)
        fast = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + fast).strip()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, GPU {info['gpu']}, load "
          f"{', '.join(f'{x:.1f}' for x in info['load_average'])}; python {info['python']}; "
          + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))  # fmt: skip
    print(
        f"date: {info['date']}; command: {' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}"
    )
    tables: dict[str, dict] = {}
    need_stand_in = bool(set(sections) & {"a", "b", "c", "d", "f"})
    need_tiny = not args.no_tiny_server and bool(set(sections) & {"d", "e"})
    with contextlib.ExitStack() as stack:
        stand_in = stack.enter_context(FixedLatencyStandIn(latency)) if need_stand_in else None
        if "a" in sections:
            semaphores = (1, 16, 64, 256) if quick else (1, 16, 64, 256, 512)
            tables["a"] = section_a(stand_in, latency, semaphores, waves=2 if quick else 4, repeats=repeats)
            print_table(tables["a"])
        if "b" in sections:
            tables["b"] = section_b(
                stand_in, latency, args.in_flight, waves=2 if quick else 4, repeats=repeats
            )
            print_table(tables["b"])
            print_table(tables["b"]["floor"])
        if "c" in sections:
            tables["c"] = section_c(stand_in, ratio_latency, agents, tasks, 256, streams)
            print_table(tables["c"])
        if "f" in sections:
            methods = ("raps", "sac") if quick else ("agentnet", "raps", "autogen", "sac", "symphony")
            tables["f"] = section_f(stand_in, ratio_latency, 42, 2 if quick else 5, methods)
            print_table(tables["f"])
        if need_tiny:
            with tiny_server(True) as tiny:
                if "d" in sections:
                    tables["d"] = section_d(stand_in, latency, 32 if quick else 128, tiny, 2 if quick else 8)
                    print_table(tables["d"])
                if "e" in sections:
                    tables["e"] = section_e([tiny], (1, 4) if quick else (1, 4, 16), 4 if quick else 32)
            if "e" in sections and not quick and "url" in tiny:  # the same server without continuous batching
                with tiny_server(False) as plain:
                    more = section_e([plain], (1, 4, 16), 32)
                tables["e"]["rows"] += more["rows"]
                if more.get("skipped"):
                    tables["e"]["skipped"] = more["skipped"]
            if "e" in sections:
                print_table(tables["e"])
        else:
            if "d" in sections:
                tables["d"] = section_d(stand_in, latency, 32 if quick else 128, None, 2 if quick else 8)
                print_table(tables["d"])
            if "e" in sections:
                tables["e"] = {"title": "e: tiny transformers serve", "columns": [], "rows": [],
                               "skipped": "--no-tiny-server"}  # fmt: skip
                print_table(tables["e"])
    checks = targets(tables, args.in_flight, latency, ratio_latency)
    for check in checks:
        value = f"{100 * check['value']:.1f}%" if "overhead" in check["target"] else f"{check['value']:.1f}x"
        if "excluding_compile" in check:
            value += f" (excluding the first round's compile: {check['excluding_compile']:.1f}x)"
        verdict = (
            ("met" if check["met"] else "NOT met")
            if check["applies"]
            else "not evaluated (another configuration)"
        )
        print(f"target: {check['target']}: {value} [this run: {check['run']}] -> {verdict}")
    result = {"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "latency_s": latency, "ratio_latency_s": ratio_latency, "tables": tables, "targets": checks}  # fmt: skip
    for table in tables.values():
        for row in table["rows"]:
            row.pop("responses", None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        print(f"tables: {args.out}")
    return result


if __name__ == "__main__":
    main()
