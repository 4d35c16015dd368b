"""The live client (meshheal_jax.backends.live) and its response cache, against a SCRIPTED
STAND-IN for a vLLM server: a tiny HTTP/1.1 server started in-process on 127.0.0.1 that answers
`/v1/models` and `/v1/chat/completions` in the OpenAI format with replies decided by each test.
Real sockets and the real openai SDK; no model, no GPU."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence

import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from typing import Self

from meshheal_jax import prompts
from meshheal_jax.backends.cache import ResponseCache, cache_key
from meshheal_jax.backends.live import (
    PARSE_FAILED,
    PARSE_OK,
    PARSE_RETRIED,
    RETRY_SEED_OFFSET,
    CallRequest,
    CallResponse,
    LiveClient,
    RequestRejectedError,
    RetryPolicy,
    ServerGroup,
    ServerUnavailableError,
    SyncLiveClient,
    gc_paused,
    normalise_base_url,
    request_seed,
    trace_rows,
)
from meshheal_jax.errors import MeshHealError
from meshheal_jax.prompts import review_reply

STRONG_ROOT = "openai/gpt-oss-120b"
WEAK_ROOT = "meta-llama/Llama-3.2-1B-Instruct"
FAST_RETRY = RetryPolicy(
    max_retries=3, backoff_base_s=0.01, backoff_cap_s=0.05, connect_timeout_s=2.0, request_timeout_s=10.0
)
HOLD_LIMIT_S = 5.0  # ScriptedServer(hold_until=): answers anyway after this long (below the timeout above)
PROMPT_TOKENS = 40
COMPLETION_TOKENS = 7
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def good_review(score: float = 1.0) -> str:
    return review_reply(score, "contribute", evidence="x = 3", reason="checked")


# ----------------------------------------------------------------------------------------------
# The scripted stand-in server


@dataclasses.dataclass
class Reply:
    """What the stand-in answers to one chat request."""

    status: int = 200
    contents: Sequence[str | None] | None = None  # one per choice; None: n copies of the default
    finish_reason: str = "stop"
    headers: dict = dataclasses.field(default_factory=dict)
    delay_s: float = 0.0
    honour_n: bool = True  # False: one choice whatever n says (as some servers do)
    raw: bytes | None = None  # sent as is instead of a chat completion
    content_type: str = "application/json"


def default_script(body: dict, index: int) -> Reply:
    if body.get("response_format"):
        return Reply(contents=None)
    return Reply(contents=None)


class ScriptedServer:
    """A scripted stand-in for a vLLM server (NOT vLLM): OpenAI-format JSON over real HTTP.

    script(body, index) -> Reply decides each chat completion; `index` counts chat requests.
    die_after: after answering that many chat requests the server closes its socket and drops
    every open connection, in-flight requests included (a server dying mid-batch).
    hold_until: no chat request is answered before that many are at the server at once (or
    HOLD_LIMIT_S has passed): a check of concurrency that does not race the client's sending.
    """

    def __init__(
        self,
        script: Callable[[dict, int], Reply] = default_script,
        served: Sequence[str] = ("strong",),
        root: str = STRONG_ROOT,
        delay_s: float = 0.0,
        die_after: int | None = None,
        api_key: str | None = None,
        hold_until: int | None = None,
    ) -> None:
        self.script, self.served, self.root = script, tuple(served), root
        self.hold_until, self._all_held = hold_until, asyncio.Event()
        self.api_key = api_key
        self.delay_s, self.die_after = delay_s, die_after
        self.chats: list[dict] = []
        self.wire: list[tuple[dict, bytes]] = []  # every chat request as received: (headers, body)
        self.in_flight = 0
        self.max_in_flight = 0
        self.dead = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, port: int = 0) -> ScriptedServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        self.dead = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while not self.dead:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
                    status, extra, payload = 401, {}, {"error": {"message": "invalid API key"}}
                else:
                    if method == "POST" and path == "/v1/chat/completions":
                        self.wire.append((headers, body))
                    status, extra, payload = await self._route(method, path, body)
                if self.dead:
                    break
                content_type = "application/json"
                if isinstance(payload, tuple):  # (raw bytes, content type)
                    data, content_type = payload
                else:
                    data = json.dumps(payload).encode()
                head_out = f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n"
                head_out += f"Content-Type: {content_type}\r\n"
                head_out += f"Content-Length: {len(data)}\r\n"
                head_out += "".join(f"{k}: {v}\r\n" for k, v in extra.items()) + "\r\n"
                writer.write(head_out.encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict, dict | tuple]:
        if method == "GET" and path == "/v1/models":
            data = [
                {"id": name, "object": "model", "owned_by": "stand-in", "root": self.root}
                for name in self.served
            ]
            return 200, {}, {"object": "list", "data": data}
        if method == "GET" and path == "/health":
            return 200, {}, {}
        if method != "POST" or path != "/v1/chat/completions":
            return 404, {}, {"error": {"message": f"no route {path}"}}
        request = json.loads(body)
        index = len(self.chats)
        if self.die_after is not None and index >= self.die_after:
            await self.stop()
            return 500, {}, {}
        self.chats.append(request)
        reply = self.script(request, index)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_until is not None:
                if self.in_flight >= self.hold_until:
                    self._all_held.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_held.wait(), HOLD_LIMIT_S)
            await asyncio.sleep(self.delay_s + reply.delay_s)
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            return (
                reply.status,
                reply.headers,
                {"error": {"message": f"scripted {reply.status}", "code": reply.status}},
            )
        if reply.raw is not None:
            return 200, {}, (reply.raw, reply.content_type)
        if request["model"] not in self.served:
            return 404, {}, {"error": {"message": f"model {request['model']} does not exist"}}
        n = int(request.get("n") or 1)
        contents = list(reply.contents) if reply.contents is not None else [self._default(request)] * n
        if not reply.honour_n:
            contents = contents[:1]
        choices = [
            {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": reply.finish_reason}
            for i, c in enumerate(contents)
        ]
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS * len(choices),
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS * len(choices),
        }
        return (
            200,
            {},
            {
                "id": f"chatcmpl-{index}",
                "object": "chat.completion",
                "created": 0,
                "model": request["model"],
                "choices": choices,
                "usage": usage,
            },
        )

    @staticmethod
    def _default(request: dict) -> str:
        if request.get("response_format"):
            return good_review(1.0)
        return f"COMPETENCE_MATCH:yes\nWorked it out (seed {request.get('seed')}).\nRESULT: (A)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Helpers


def gen_request(i: int, role: str = "strong", **kw) -> CallRequest:
    fields = {
        "stream": 0,
        "t": i,
        "call_id": 0,
        "kind": "generate",
        "role": role,
        "messages": [{"role": "user", "content": f"question {i}"}],
        "seed": request_seed(7, 0, i, 0),
        "max_completion_tokens": 256,
        "parser": prompts.execution_parser("bbh"),
    }
    fields.update(kw)
    return CallRequest(**fields)


def review_request(i: int, n: int = 3, **kw) -> CallRequest:
    fields = {
        "kind": "review",
        "n": n,
        "parser": prompts.review_parser("contribute"),
        "response_format": prompts.review_response_format("contribute"),
        "messages": [{"role": "user", "content": f"review {i}"}],
        "seed": request_seed(7, 0, i, 1),
    }
    fields.update(kw)
    return gen_request(i, **fields)


def strong(*servers: ScriptedServer, **kw) -> ServerGroup:
    return ServerGroup("strong", tuple(s.base_url for s in servers), **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=45))


# ----------------------------------------------------------------------------------------------
# Concurrency and round-robin


def test_round_sent_concurrently_and_capped_by_semaphore():
    async def scenario():
        async with ScriptedServer(delay_s=0.05) as server:
            async with LiveClient([strong(server, max_in_flight=4)], retry=FAST_RETRY) as client:
                responses = await client.run_batch([gen_request(i) for i in range(24)])
                stats = client.server_stats()[0]
            assert 1 < server.max_in_flight <= 4 and stats.max_in_flight == 4
            assert len(responses) == 24 and all(r.parse_status == (PARSE_OK,) for r in responses)
            assert [r.parsed[0].answer for r in responses] == ["(A)"] * 24

        async with ScriptedServer(hold_until=24) as server:  # a semaphore above the round: all at once
            async with LiveClient([strong(server, max_in_flight=64)], retry=FAST_RETRY) as client:
                await client.run_batch([gen_request(i) for i in range(24)])
            assert server.max_in_flight == 24  # all 24 at the server at once, none answered before

    run(scenario())


def test_a_round_s_first_call_is_written_before_the_others_are_built(monkeypatch):
    """On Python 3.11 aiohttp writes a request's body in a task of its own: with a round's calls
    all made at once, every call was built before the first was written (each waited for the
    whole round's building). run_batch gives each call a turn before making the next: a call's
    socket write comes before the next call's `post` starts (the order of events, no clock)."""
    events: list[str] = []
    write = asyncio.selector_events._SelectorSocketTransport.write

    def noted_write(transport, data):
        events.append("write")
        return write(transport, data)

    monkeypatch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", noted_write)

    async def scenario():
        # the server's own replies are written later (0.5 s), after every call of the round started
        async with (
            ScriptedServer(delay_s=0.5) as server,
            LiveClient([strong(server, max_in_flight=64)], retry=FAST_RETRY) as client,
        ):
            await client.run_batch([gen_request(i) for i in range(8)])  # opens the round's connections
            for sdk, _ in client._servers["strong"][0].lanes:
                post = sdk.post

                async def noted_post(*args, _post=post, **kwargs):
                    events.append("post")
                    return await _post(*args, **kwargs)

                sdk.post = noted_post
            events.clear()
            await client.run_batch([gen_request(i) for i in range(4, 12)])
        return events

    order = run(scenario())
    posts = [i for i, e in enumerate(order) if e == "post"]
    assert len(posts) == 8
    for first, second in itertools.pairwise(posts):
        assert "write" in order[first:second]  # each call written before the next one starts


def test_a_round_stopped_while_its_calls_are_made_leaves_none_running():
    async def scenario():
        async with (
            ScriptedServer(delay_s=5.0) as server,
            LiveClient([strong(server)], retry=FAST_RETRY) as client,
        ):
            before = asyncio.all_tasks()
            batch = asyncio.ensure_future(client.run_batch([gen_request(i) for i in range(50)]))
            for _ in range(3):  # stopped after a few of its 50 calls were made
                await asyncio.sleep(0)
            batch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batch
            return [task for task in asyncio.all_tasks() - before if not task.done()]

    assert run(scenario()) == []


def test_a_huge_max_in_flight_opens_at_most_max_lanes_clients():
    """max_in_flight 100,000 ("unlimited") opened 3,125 clients per server: minutes and gigabytes
    before the first call. The lanes stop at MAX_LANES; their pools grow instead."""
    from meshheal_jax.backends.live import MAX_LANES

    async def scenario():
        async with ScriptedServer() as server:
            async with LiveClient([strong(server, max_in_flight=100_000)], retry=FAST_RETRY) as client:
                (one,) = client._servers["strong"]
                assert len(one.lanes) == MAX_LANES
                responses = await client.run_batch([gen_request(i) for i in range(40)])
            assert [r.parsed[0].answer for r in responses] == ["(A)"] * 40

    run(scenario())


def test_cyclic_gc_paused_only_while_a_batch_is_in_flight():
    seen = []

    def script(body: dict, index: int) -> Reply:
        seen.append(gc.isenabled())
        return Reply()

    async def scenario(pause: bool) -> bool:
        async with (
            ScriptedServer(script) as server,
            LiveClient([strong(server)], retry=FAST_RETRY, pause_gc=pause) as client,
        ):
            await client.run_batch([gen_request(i) for i in range(6)])
            return gc.isenabled()

    assert gc.isenabled()
    assert run(scenario(True))
    assert seen == [False] * 6
    seen.clear()
    assert run(scenario(False))
    assert seen == [True] * 6
    gc.disable()  # a caller's own choice is kept
    try:
        assert not run(scenario(True))
    finally:
        gc.enable()


def test_gc_pause_counts_overlapping_batches_and_survives_errors():
    first, second = gc_paused(), gc_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second batch is still in flight
    second.__exit__(None, None, None)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed batch")
    assert gc.isenabled()
    with gc_paused(False):
        assert gc.isenabled()


def test_a_cancelled_or_abandoned_batch_does_not_keep_the_collector_paused():
    async def scenario() -> list[bool]:
        seen = []
        async with ScriptedServer(delay_s=5.0) as server:
            client = LiveClient([strong(server)], retry=FAST_RETRY)
            await client.start()
            task = asyncio.ensure_future(client.run_batch([gen_request(i) for i in range(3)]))
            await asyncio.sleep(0.2)
            seen.append(gc.isenabled())  # in flight: paused
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            seen.append(gc.isenabled())  # cancelled: resumed
            abandoned = asyncio.ensure_future(client.run_batch([gen_request(i) for i in range(3)]))
            await asyncio.sleep(0.2)
            seen.append(gc.isenabled())  # a batch whose caller never finishes it
            await client.aclose()  # closing its client releases its pause
            seen.append(gc.isenabled())
            abandoned.cancel()  # when the batch ends later, its own release is a no-op
            with contextlib.suppress(BaseException):
                await abandoned
            seen.append(gc.isenabled())
        return seen

    assert run(scenario()) == [False, True, False, True, True]


def test_a_stalled_round_says_where_it_waits(capsys):
    async def scenario() -> None:
        async with ScriptedServer(delay_s=0.7) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY, stall_notice_s=0.25) as client:
                responses = await client.run_batch([gen_request(i) for i in range(3)])
            assert len(responses) == 3
            notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("live: ")]
            assert notices and notices[0].startswith("live: a round of 3 calls still waiting after 0 s (3 at "
                                                     f"{server.base_url})"), notices  # fmt: skip
            assert "each attempt may take 10 s (--request-timeout-s)" in notices[0]

    run(scenario())


def test_round_robin_over_two_urls():
    async def scenario():
        async with ScriptedServer() as one, ScriptedServer() as two:
            async with LiveClient([strong(one, two)], retry=FAST_RETRY) as client:
                await client.run_batch([gen_request(i) for i in range(10)])
            assert len(one.chats) == 5 and len(two.chats) == 5

    run(scenario())


def test_a_call_retries_on_the_role_s_other_server_when_one_is_down():
    """Two strong URLs, one down: each call's retry goes on to the other, so a round of 200 calls
    finishes (with one retry per call that started on the dead server). Before, every attempt took
    the next turn of a counter all calls share: about half of each call's attempts went to the dead
    server, and a round of hundreds had a call whose every attempt did (the run stopped)."""

    async def scenario():
        async with ScriptedServer() as alive, ScriptedServer() as dead:
            retry = dataclasses.replace(FAST_RETRY, max_retries=2)
            async with LiveClient([strong(dead, alive)], retry=retry) as client:
                await dead.stop()  # after the client's start-up check
                responses = await client.run_batch([gen_request(i) for i in range(200)])
                assert client.stats.transport_retries == 100  # the calls that started on the dead one
            assert len(responses) == 200 and len(alive.chats) == 200
            async with LiveClient(
                [strong(alive)], retry=dataclasses.replace(FAST_RETRY, max_retries=0)
            ) as client:
                await alive.stop()
                with pytest.raises(ServerUnavailableError) as info:
                    await client.run_batch([gen_request(0)])
            # the SDK's "Connection error." with what it stands for (refused here; cut short, ...)
            assert re.search(
                r"last error: APIConnectionError: Connection error\. \(\w+: .+\)", str(info.value)
            )

    run(scenario())


def test_roles_go_to_their_own_servers_with_served_names():
    async def scenario():
        async with ScriptedServer() as big, ScriptedServer(served=("weak",), root=WEAK_ROOT) as small:
            groups = [strong(big), ServerGroup("weak", (small.base_url.removesuffix("/v1"),))]
            async with LiveClient(groups, retry=FAST_RETRY) as client:
                out = await client.run_batch([gen_request(0), gen_request(1, role="weak")])
                assert client.model_ids == {"strong": STRONG_ROOT, "weak": WEAK_ROOT}
            assert [c["model"] for c in big.chats] == ["strong"] and [c["model"] for c in small.chats] == [
                "weak"
            ]
            assert out[0].model_id == STRONG_ROOT and out[1].model_id == WEAK_ROOT
            # reasoning_effort goes to gpt-oss only; max_completion_tokens and seed always
            assert big.chats[0]["reasoning_effort"] == "medium" and "reasoning_effort" not in small.chats[0]
            assert big.chats[0]["max_completion_tokens"] == 256 and "max_tokens" not in big.chats[0]
            assert big.chats[0]["seed"] == request_seed(7, 0, 0, 0)

    run(scenario())


# ----------------------------------------------------------------------------------------------
# Retries


def test_retry_on_429_honours_retry_after():
    def script(body, index):
        return Reply(status=429, headers={"Retry-After": "1"}) if index == 0 else Reply()

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                started = time.monotonic()
                (response,) = await client.run_batch([gen_request(0)])
                elapsed = time.monotonic() - started
            assert response.retries == 1 and response.parse_status == (PARSE_OK,)
            assert len(server.chats) == 2 and elapsed >= 0.95  # waited the Retry-After, not the 10 ms backoff

    run(scenario())


def test_retry_on_5xx_then_success():
    def script(body, index):
        return Reply(status=503 if index < 2 else 200)

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(0)])
                assert client.stats.transport_retries == 2
            assert response.retries == 2 and len(server.chats) == 3
            assert trace_rows([gen_request(0)], [response])[0]["retries"] == 2  # the trace keeps them

    run(scenario())


def test_5xx_storm_is_bounded():
    async def scenario():
        async with ScriptedServer(lambda body, index: Reply(status=500)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                with pytest.raises(ServerUnavailableError, match=r"failed 4 attempts.*HTTP 500"):
                    await client.run_batch([gen_request(0)])
            assert len(server.chats) == FAST_RETRY.max_retries + 1

    run(scenario())


def test_no_retry_on_400(tmp_path):
    async def scenario():
        with ResponseCache(tmp_path / "responses.sqlite") as cache:
            async with ScriptedServer(lambda body, index: Reply(status=400)) as server:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    # a rerun would send the same request: resuming needs what was refused changed
                    with pytest.raises(
                        RequestRejectedError, match="HTTP 400.*once what the server refused is changed"
                    ):
                        await client.run_batch([gen_request(0)])
                assert len(server.chats) == 1

    run(scenario())


# ----------------------------------------------------------------------------------------------
# n = 3, seeds, tokens


def test_n3_in_one_request_counts_prompt_three_times():
    async def scenario():
        async with ScriptedServer() as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([review_request(0)])
                stats = client.stats
            assert len(server.chats) == 1 and server.chats[0]["n"] == 3
            assert server.chats[0]["response_format"]["type"] == "json_schema"
            assert response.scores == (1.0, 1.0, 1.0) and response.parse_status == (PARSE_OK,) * 3
            assert response.prompt_tokens == 3 * PROMPT_TOKENS
            assert response.prefix_shared_tokens == 2 * PROMPT_TOKENS
            assert response.completion_tokens == 3 * COMPLETION_TOKENS
            assert (stats.prompt_tokens, stats.completion_tokens) == (
                3 * PROMPT_TOKENS,
                3 * COMPLETION_TOKENS,
            )

    run(scenario())


def test_n3_fallback_when_server_returns_fewer_choices():
    async def scenario():
        async with ScriptedServer(lambda body, index: Reply(honour_n=False)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                request = review_request(0)
                (response,) = await client.run_batch([request])
                assert client.stats.n_fallback_calls == 2
            assert [c["n"] for c in server.chats] == [3, 1, 1]
            assert sorted(c["seed"] for c in server.chats[1:]) == [request.seed + 1, request.seed + 2]
            assert len(response.texts) == 3 and response.scores == (1.0, 1.0, 1.0)
            assert response.http_calls == 3
            assert response.prompt_tokens == 3 * PROMPT_TOKENS and response.prefix_shared_tokens == 0
            assert response.completion_tokens == 3 * COMPLETION_TOKENS

    run(scenario())


def test_a_failed_fallback_send_leaves_no_sibling_running(tmp_path):
    """One n=3 review, a server that returns one choice: of the two fallback sends, one is
    rejected (400) and the other is slow. run_batch raises only after the slow one is back, so
    its reply is cached, not abandoned in flight."""

    async def scenario():
        base = review_request(1).seed

        def script(body, index):
            if body["seed"] == base + 1:
                return Reply(status=400)
            if body["seed"] == base + 2:
                return Reply(delay_s=0.5)
            return Reply(honour_n=False)

        async with ScriptedServer(script) as server:
            with ResponseCache(tmp_path / "c.sqlite") as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    with pytest.raises(RequestRejectedError, match="HTTP 400"):
                        await client.run_batch([review_request(1)])
                    assert server.in_flight == 0
                    assert len(cache) == 2  # the n=3 reply and the slow fallback's

    run(scenario())


@pytest.mark.parametrize("max_in_flight", [33, 64, 256])
def test_no_lane_holds_more_requests_than_its_pool(max_in_flight):
    """Requests take the least-loaded lane: whatever order requests come back in, a lane never holds
    more than ceil(M / lanes) (its pool has ceil((M + headroom) / lanes) connections), so no request
    waits for a connection while another lane has one free."""
    import random

    from meshheal_jax.backends.live import LANE_CONNECTIONS, ServerStats, _Server

    n_lanes = -(-max_in_flight // LANE_CONNECTIONS)
    server = _Server(ServerStats("http://x/v1", "strong"), [(None, None)] * n_lanes, asyncio.Semaphore(1))
    rng = random.Random(0)
    held: list[int] = []
    for _ in range(20_000):
        if len(held) < max_in_flight and (not held or rng.random() < 0.5):
            held.append(server.take_lane())
        else:  # a request comes back; lane 0's ten times as often as the others' (uneven durations)
            weights = [1 + 9 * (lane == 0) for lane in held]
            lane = held.pop(rng.choices(range(len(held)), weights)[0])
            server.lane_load[lane] -= 1
        assert max(server.lane_load) <= -(-max_in_flight // n_lanes)
        assert sum(server.lane_load) == len(held)


def test_request_seeds_are_spaced_by_n():
    seeds = {
        request_seed(s, d, t, c) for s in range(3) for d in range(3) for t in range(20) for c in range(12)
    }
    assert len(seeds) == 3 * 3 * 20 * 12
    assert all(seed % 4 == 0 and 0 <= seed < 2**50 for seed in seeds)
    assert request_seed(1, 0, 5, 2) == request_seed(1, 0, 5, 2)


# ----------------------------------------------------------------------------------------------
# Parse failures


def test_parse_failure_retried_with_new_seed():
    base = review_request(0, n=1).seed

    def script(body, index):
        return Reply(contents=["I think it is fine!"]) if body["seed"] == base else Reply()

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([review_request(0, n=1)])
            assert [c["seed"] for c in server.chats] == [base, base + RETRY_SEED_OFFSET]
            assert response.parse_status == (PARSE_RETRIED,) and response.scores == (1.0,)
            assert response.parse_retries == 1
            assert response.prompt_tokens == 2 * PROMPT_TOKENS  # the retry is real spend
            assert response.completion_tokens == 2 * COMPLETION_TOKENS

    run(scenario())


def test_parse_failure_twice_gives_neutral_score():
    def script(body, index):
        return Reply(contents=["no json here"] * int(body.get("n", 1)))

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                request = review_request(0, n=3)
                (response,) = await client.run_batch([request])
                assert client.stats.parse_failures == 3
            retry_seeds = sorted(c["seed"] for c in server.chats[1:])
            assert retry_seeds == [request.seed + i + RETRY_SEED_OFFSET for i in range(3)]
            assert response.parse_status == (PARSE_FAILED,) * 3
            assert response.scores == (0.5, 0.5, 0.5) and all(v.parse_failed for v in response.parsed)
            assert response.prompt_tokens == 3 * PROMPT_TOKENS + 3 * PROMPT_TOKENS

    run(scenario())


def test_length_with_empty_content_is_retried():
    def script(body, index):
        if index == 0:
            return Reply(contents=[""], finish_reason="length")
        return Reply()

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(0)])
            assert (
                len(server.chats) == 2 and server.chats[1]["seed"] == gen_request(0).seed + RETRY_SEED_OFFSET
            )
            assert response.parse_status == (PARSE_RETRIED,) and response.finish_reason == ("stop",)
            assert response.parsed[0].answer == "(A)"

    run(scenario())


def test_length_with_content_is_kept():
    async def scenario():
        script = lambda body, index: Reply(
            contents=["COMPETENCE_MATCH:yes\nlong work with no answer"],
            finish_reason="length",
        )
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(0)])
            assert len(server.chats) == 1 and response.parse_status == (PARSE_OK,)
            assert response.parsed[0].answer is None and response.finish_reason == ("length",)

    run(scenario())


# ----------------------------------------------------------------------------------------------
# Cache and resume


def test_repeated_batch_is_served_from_cache(tmp_path):
    requests = [review_request(i) for i in range(3)] + [gen_request(i) for i in range(5)]

    async def scenario():
        async with ScriptedServer() as server:
            with ResponseCache(tmp_path / "responses.sqlite") as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    first = await client.run_batch(requests)
                sent = len(server.chats)
                assert sent == 8 and len(cache) == 8
            with ResponseCache(tmp_path / "responses.sqlite") as cache:  # a new run, same cache file
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    second = await client.run_batch(requests)
                    assert client.stats.http_requests == 0 and client.stats.cache_hits == 8
            assert len(server.chats) == sent  # nothing sent the second time
            assert all(r.from_cache and r.http_calls == 0 for r in second)
            assert [r.texts for r in first] == [r.texts for r in second]
            assert [r.parsed for r in first] == [r.parsed for r in second]
            assert [r.prompt_tokens for r in first] == [r.prompt_tokens for r in second]

    run(scenario())


def test_replies_of_a_batch_are_on_disk_when_it_returns(tmp_path):
    """put_soon groups the replies of one loop turn into one commit; run_batch flushes before it
    returns, so another connection sees every reply."""
    import sqlite3

    requests = [gen_request(i) for i in range(12)]

    async def scenario():
        async with ScriptedServer() as server:
            with ResponseCache(tmp_path / "responses.sqlite") as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    await client.run_batch(requests)
                    other = sqlite3.connect(tmp_path / "responses.sqlite")
                    assert other.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 12
                    other.close()
                    assert cache.writes == 12 and 1 <= cache.commits <= 12

    run(scenario())


def test_put_soon_commits_one_turn_together(tmp_path):
    payload = {"choices": [{"text": "x"}]}

    async def scenario(cache):
        for i in range(5):
            cache.put_soon(f"k{i}", "m", payload)
        assert cache.commits == 0 and cache.get("k3") == payload  # held, yet readable
        await asyncio.sleep(0)  # the loop's next turn
        assert cache.commits == 1 and cache.writes == 5

    async def left_behind(cache):
        cache.put_soon("late", "m", payload)
        asyncio.get_running_loop().stop()  # the loop stops before its next turn (an abandoned batch)
        await asyncio.sleep(3600)

    with ResponseCache(tmp_path / "c.sqlite") as cache:
        asyncio.run(scenario(cache))
        cache.put_soon("outside", "m", payload)  # no running loop: written at once
        assert cache.commits == 2 and "outside" in cache and len(cache) == 6
        loop = asyncio.new_event_loop()
        task = loop.create_task(left_behind(cache))
        loop.run_forever()  # returns at the stop
        loop.close()  # never run again: the flush scheduled on it never runs
        del task
        assert cache.commits == 2 and cache._pending

        async def next_batch(cache):
            cache.put_soon("next", "m", payload)
            await asyncio.sleep(0)

        asyncio.run(next_batch(cache))  # a new loop schedules its own flush, which takes both
        assert cache.commits == 3 and cache.writes == 8 and len(cache) == 8


def test_a_failed_grouped_write_is_raised_not_logged(tmp_path):
    """A flush at the loop's turn that fails keeps its replies held; the next flush (run_batch
    ends with one) tries again and raises, naming the cache; once writes work, nothing was lost."""

    async def scenario(cache):
        cache._db.execute("PRAGMA query_only = 1")  # every write now fails
        cache.put_soon("k", "m", {"a": 1})
        await asyncio.sleep(0)  # the loop's turn runs the flush, which fails: nothing raised here
        cache.put_soon("k2", "m", {"a": 2})
        with pytest.raises(MeshHealError, match="cannot write 2 reply"):
            cache.flush()
        cache._db.execute("PRAGMA query_only = 0")
        cache.flush()
        assert "k" in cache and "k2" in cache and cache.commits == 1

    with ResponseCache(tmp_path / "c.sqlite") as cache:
        asyncio.run(scenario(cache))


def test_a_damaged_cache_is_named_when_read(tmp_path):
    """A responses.sqlite damaged past its first pages opens, then fails at a read: one error naming
    the file and what to do, not sqlite's traceback."""
    path = tmp_path / "responses.sqlite"
    with ResponseCache(path) as cache:
        for i in range(400):
            cache.put(f"key{i}", STRONG_ROOT, {"choices": [{"content": "x" * 200}], "n": i})
    with path.open("r+b") as f:  # pages in the middle, past sqlite's header and schema
        f.seek(4096 * 10)
        f.write(random.Random(0).randbytes(4096 * 10))
    with (
        ResponseCache(path) as cache,
        pytest.raises(
            MeshHealError,
            match=rf"response cache {re.escape(str(path))}: cannot read it \(.*\); move it aside",
        ),
    ):
        [cache.get(f"key{i}") for i in range(400)]


def test_cache_key_uses_real_model_id_and_sampling():
    messages = [{"role": "user", "content": "hi"}]
    params = {"n": 1, "seed": 4, "temperature": 1.0}
    key = cache_key(STRONG_ROOT, messages, params)
    assert key == cache_key(STRONG_ROOT, [dict(m) for m in messages], dict(reversed(params.items())))
    assert key != cache_key(WEAK_ROOT, messages, params)
    assert key != cache_key(STRONG_ROOT, messages, {**params, "seed": 5})
    assert key != cache_key(STRONG_ROOT, messages, {**params, "temperature": 0.5})
    assert key != cache_key(STRONG_ROOT, [{"role": "user", "content": "hi!"}], params)
    with pytest.raises(MeshHealError):
        cache_key("", messages, params)


def test_server_dying_mid_batch_keeps_received_responses(tmp_path):
    requests = [gen_request(i) for i in range(12)]

    async def scenario():
        path = tmp_path / "responses.sqlite"
        async with ScriptedServer(delay_s=0.02, die_after=5) as server:
            with ResponseCache(path) as cache:
                async with LiveClient(
                    [strong(server, max_in_flight=2)], cache=cache, retry=FAST_RETRY
                ) as client:
                    with pytest.raises(ServerUnavailableError) as info:
                        await client.run_batch(requests)
                kept = len(cache)
        message = str(info.value)
        assert server.base_url in message and "re-run to resume" in message and str(path) in message
        assert 1 <= kept <= 5
        # The server comes back on another port: the cache key has no URL, so the re-run resumes.
        async with ScriptedServer() as revived:
            with ResponseCache(path) as cache:
                async with LiveClient([strong(revived)], cache=cache, retry=FAST_RETRY) as client:
                    responses = await client.run_batch(requests)
            assert len(revived.chats) == 12 - kept
            assert sum(r.from_cache for r in responses) == kept
            assert all(r.parsed[0].answer == "(A)" for r in responses)

    run(scenario())


def test_secrets_never_reach_the_cache(tmp_path, monkeypatch):
    token, key = "hf_SuperSecretToken123", "sk-local-secret-987"
    monkeypatch.setenv("HF_TOKEN", token)

    async def scenario():
        script = lambda body, index: Reply(contents=[f"my token is {token}\nRESULT: (A)"])
        async with ScriptedServer(script) as server:
            with ResponseCache(tmp_path / "c.sqlite", extra_secrets=[key]) as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY, api_key=key) as client:
                    await client.run_batch([gen_request(0)])

    run(scenario())
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert token.encode() not in raw and key.encode() not in raw
    assert b"[redacted]" in raw


# ----------------------------------------------------------------------------------------------
# Start-up checks


def test_requests_on_the_wire_equal_the_sdks_typed_call():
    """The client posts its own JSON body (`AsyncOpenAI.post`); the bytes and the auth header on the
    wire are those of `chat.completions.create` with the same typed arguments, without the SDK's
    telemetry headers (X-Stainless-*), which the typed call sends."""
    import openai

    async def scenario():
        async with ScriptedServer(api_key="sk-wire-test") as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY, api_key="sk-wire-test") as client:
                await client.run_batch([review_request(1), gen_request(2)])
            sent = [json.loads(body) for _, body in server.wire]
            assert [b.get("reasoning_effort") for b in sent] == ["medium", "medium"]  # a gpt-oss root
            review = next(b for b in sent if b.get("n") == 3)  # the two went out together, in any order
            assert review["response_format"]["type"] == "json_schema"
            typed = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-wire-test", max_retries=0)
            for body in sent:
                await typed.chat.completions.create(**body)
            await typed.close()
            (h1, b1), (h2, b2), (h3, b3), (h4, b4) = server.wire
            assert (b1, b2) == (b3, b4)
            assert {h["authorization"] for h in (h1, h2, h3, h4)} == {"Bearer sk-wire-test"}
            assert {h["content-type"] for h in (h1, h2, h3, h4)} == {"application/json"}
            telemetry = [{name for name in h if name.startswith("x-stainless-")} for h in (h1, h2, h3, h4)]
            assert telemetry[:2] == [set(), set()]
            assert {"x-stainless-lang", "x-stainless-retry-count"} <= telemetry[2] == telemetry[3]

    run(scenario())


@pytest.mark.parametrize(
    "raw, content_type",
    [
        (b"<html>502 from a proxy</html>", "text/html"),
        (b'{"error": "overloaded"}', "application/json"),  # JSON, but no choices
        (b'{"choices": [', "application/json"),  # labelled JSON, not JSON
        (b"[" * 3000, "application/json"),  # deeper than json's recursion allows
        (b'{"id": ' + b"9" * 5000 + b"}", "application/json"),  # past int()'s 4,300 digits
        (b'{"choices": []}', "application/json"),  # no reply at all
        (b'{"choices": "\xff"}', "application/json"),  # not UTF-8
        (  # a choice the server failed to finish
            b'{"choices": [{"index": 0, "message": {"content": "RESULT: (C)"}, "finish_reason": "abort"}]}',
            "application/json",
        ),
    ],
)
def test_a_reply_that_is_not_a_chat_completion_is_retried_then_named(raw, content_type, tmp_path):
    async def scenario():
        def script(body, i):
            return Reply(raw=raw, content_type=content_type) if i < 2 else Reply()

        with ResponseCache(tmp_path / "responses.sqlite") as cache:  # twice garbage, then a good reply
            async with (
                ScriptedServer(script=script) as server,
                LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client,
            ):
                responses = await client.run_batch([gen_request(1)])
            assert responses[0].retries == 2 and responses[0].parsed[0].answer == "(A)"
            assert len(cache) == 1  # the good reply only: a rerun is served it, never the garbage
        garbage = ScriptedServer(script=lambda body, i: Reply(raw=raw, content_type=content_type))
        async with garbage as server, LiveClient([strong(server)], retry=FAST_RETRY) as client:
            with pytest.raises(ServerUnavailableError, match=r"failed 4 attempts of a generate call \(stream 0, "
                               r"t 1\); last error: HTTP 200 with (something that is not a chat completion"
                               r"|a body that is not valid JSON|no choices"
                               r"|a choice the server failed to finish \(finish_reason 'abort'\))"):  # fmt: skip
                await client.run_batch([gen_request(1)])

    run(scenario())


def test_a_chat_completion_without_a_json_content_type_is_read():
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "strong", "usage": {"prompt_tokens": 5},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "RESULT: (B)"}, "finish_reason": "stop"}]}  # fmt: skip

    async def scenario():
        raw = json.dumps(body).encode()
        async with ScriptedServer(script=lambda b, i: Reply(raw=raw, content_type="text/plain")) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(1)])
            assert (
                response.parsed[0].answer == "(B)" and response.prompt_tokens == 5 and response.retries == 0
            )

    run(scenario())


def test_a_failure_an_older_version_cached_is_sent_again(tmp_path):
    request = gen_request(1)

    async def scenario():
        async with ScriptedServer() as server:
            with ResponseCache(tmp_path / "responses.sqlite") as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    params = client._params(request, 1, request.seed)
                    key = cache_key(client.model_ids["strong"], request.messages, params)
                    cache.put(
                        key, client.model_ids["strong"], {"choices": [], "usage": None, "latency_s": 0.1}
                    )
                    (response,) = await client.run_batch([request])
                assert response.parsed[0].answer == "(A)" and not response.from_cache
                assert len(server.chats) == 1 and cache.get(key)["choices"]  # replaced by the reply

    run(scenario())


def test_a_request_that_cannot_be_encoded_is_raised_not_retried():
    # a lone surrogate cannot be UTF-8: the request never leaves, so no server is blamed for it
    async def scenario():
        async with ScriptedServer() as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                bad = gen_request(1, messages=[{"role": "user", "content": "q \ud800 x"}])
                with pytest.raises(UnicodeEncodeError):
                    await client.run_batch([bad])
                assert client.stats.transport_retries == 0
            assert server.chats == []

    run(scenario())


def test_a_server_without_token_usage_is_warned_of_once(recwarn):
    body = {"choices": [{"index": 0, "message": {"content": "RESULT: (B)"}, "finish_reason": "stop"}]}

    async def scenario():
        raw = json.dumps(body).encode()
        async with ScriptedServer(script=lambda b, i: Reply(raw=raw)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                responses = await client.run_batch([gen_request(i) for i in range(3)])
            assert [r.prompt_tokens for r in responses] == [0, 0, 0]

    run(scenario())
    said = [str(w.message) for w in recwarn if "token usage" in str(w.message)]
    expected = ("live backend: the strong server sent a reply without token usage; its tokens count as 0 "
                "(tokens per task, the server-side prefix savings)")  # fmt: skip
    assert said == [expected]


def test_a_reply_that_trickles_in_is_cut_at_the_request_timeout():
    """--request-timeout-s bounds a whole call, not each read: a server that sends its reply a few
    bytes at a time (each read well within the limit) is given up on at the limit and retried."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET"):  # the client's start-up check: the served model, at once
            body = json.dumps({"object": "list", "data": [{"id": "strong", "root": STRONG_ROOT}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))  # fmt: skip
            await writer.drain()
            return
        length = int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        await reader.readexactly(length)
        body = b" " * 200  # JSON whitespace, never finished in time
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        with contextlib.suppress(ConnectionError):
            for k in range(len(body)):
                writer.write(body[k : k + 1])
                await writer.drain()
                await asyncio.sleep(0.05)  # 10 s in all

    async def scenario() -> tuple[str, float]:
        service = await asyncio.start_server(trickle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{service.sockets[0].getsockname()[1]}/v1"
        retry = dataclasses.replace(FAST_RETRY, max_retries=1, request_timeout_s=0.5)
        try:
            async with LiveClient(
                [ServerGroup("strong", (url,), model_id=STRONG_ROOT)], retry=retry
            ) as client:
                started = time.monotonic()
                with pytest.raises(ServerUnavailableError) as info:
                    await client.run_batch([gen_request(0)])
                return str(info.value), time.monotonic() - started
        finally:
            service.close()

    message, took = run(scenario())
    assert (
        "failed 2 attempts" in message
        and "last error: no whole reply within 0.5 s (--request-timeout-s)" in message
    )
    assert took < 4.0  # two attempts of 0.5 s and a backoff, not the 10 s the reply would take


def test_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}/v1"

    async def scenario():
        with pytest.raises(MeshHealError, match=rf"strong server at {url} is unreachable"):
            async with LiveClient([ServerGroup("strong", (url,))], retry=FAST_RETRY):
                pass

    run(scenario())


def test_a_port_where_another_service_answers_is_named():
    """A TCP service that answers something other than HTTP (an SSH banner): the server check names
    the URL and what came back, one error, instead of the transport's traceback."""

    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1000)
        writer.write(b"SSH-2.0-OpenSSH_9\r\n")
        await writer.drain()
        writer.close()

    async def scenario():
        service = await asyncio.start_server(banner, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{service.sockets[0].getsockname()[1]}/v1"
        try:
            with pytest.raises(
                ServerUnavailableError, match=rf"strong server at {url} is unreachable or not an HTTP"
            ):
                async with LiveClient([ServerGroup("strong", (url,))], retry=FAST_RETRY):
                    pass
        finally:
            service.close()

    run(scenario())


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://[::1", "is not a valid URL"),
        ("http://host:80x", "is not a valid URL"),
        ("http://:8000", "names no host"),
    ],
)
def test_a_malformed_base_url_is_refused_when_given(url, problem):
    with pytest.raises(MeshHealError, match=re.escape(f"base URL {url!r} {problem}")):
        normalise_base_url(url)


def test_wrong_served_model_name():
    async def scenario():
        async with ScriptedServer(served=("llama",)) as server:
            with pytest.raises(
                MeshHealError, match=r"serves \['llama'\], not 'strong'.*--served-model-name strong"
            ):
                async with LiveClient([strong(server)], retry=FAST_RETRY):
                    pass

    run(scenario())


def test_configured_model_id_wins_and_unknown_role_is_refused():
    async def scenario():
        async with (
            ScriptedServer(root="/models/local-copy") as server,
            LiveClient([strong(server, model_id=STRONG_ROOT)], retry=FAST_RETRY) as client,
        ):
            assert client.model_ids["strong"] == STRONG_ROOT
            with pytest.raises(MeshHealError, match="no server configured"):
                await client.run_batch([gen_request(0, role="weak")])

    run(scenario())


def test_api_key_is_sent_and_a_wrong_one_is_named():
    async def scenario():
        async with ScriptedServer(api_key="sk-right-key-123") as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY, api_key="sk-right-key-123") as client:
                (response,) = await client.run_batch([gen_request(0)])
                assert response.parse_status == (PARSE_OK,)
            with pytest.raises(MeshHealError, match="refused the API key"):
                async with LiveClient([strong(server)], retry=FAST_RETRY, api_key="sk-wrong-key-456"):
                    pass

    run(scenario())


def test_model_id_disagreeing_with_the_server_is_refused():
    async def scenario():
        async with ScriptedServer(root=STRONG_ROOT) as server:
            with pytest.raises(
                MeshHealError, match=r"serves \['openai/gpt-oss-120b'\] but the strong model id"
            ):
                async with LiveClient([strong(server, model_id=WEAK_ROOT)], retry=FAST_RETRY):
                    pass

    run(scenario())


def test_bad_requests_are_refused_before_sending():
    with pytest.raises(MeshHealError, match="kind"):
        gen_request(0, kind="chat")
    with pytest.raises(MeshHealError, match="role"):
        gen_request(0, role="medium")
    with pytest.raises(MeshHealError, match="n = 9"):
        gen_request(0, n=9)
    with pytest.raises(MeshHealError, match="http"):
        ServerGroup("strong", ("localhost:8000",))


def test_backoff_is_jittered_exponential_capped_and_floored_by_retry_after():
    """Attempt k waits uniform(0, min(cap, base * 2**k)) (full jitter), at least a Retry-After
    (itself capped), as RetryPolicy says."""
    client = LiveClient([ServerGroup("strong", ("http://127.0.0.1:1/v1",))],
                        retry=RetryPolicy(backoff_base_s=0.5, backoff_cap_s=30.0, retry_after_cap_s=120.0))  # fmt: skip
    for attempt, ceiling in ((0, 0.5), (1, 1.0), (3, 4.0), (6, 30.0), (9, 30.0)):
        delays = [client._backoff_s(attempt, None) for _ in range(2_000)]
        assert 0.0 <= min(delays) and max(delays) <= ceiling
        assert min(delays) < 0.05 * ceiling and max(delays) > 0.95 * ceiling  # spread over the range
        assert abs(sum(delays) / len(delays) - ceiling / 2) < 0.05 * ceiling  # uniform's mean
    assert all(client._backoff_s(0, 7.0) == 7.0 for _ in range(100))  # the server's wait wins
    assert all(client._backoff_s(0, 1e6) == 120.0 for _ in range(100))  # up to its cap
    assert all(1.0 <= client._backoff_s(3, 1.0) <= 4.0 for _ in range(100))  # a short one floors it


def test_trace_rows_say_which_review_scores_the_client_moved():
    """A low score with no evidence is read as 0.5 and a reviewer's own 0.25 stands: the trace
    keeps the score used and says which one the client moved, so the two can be told apart."""
    texts = (prompts.review_reply(0.0, "contribute", evidence=""), prompts.review_reply(0.25, "contribute"))
    response = CallResponse(
        texts=texts, parsed=tuple(prompts.parse_review(t, "contribute") for t in texts),
        parse_status=(PARSE_OK, PARSE_OK), finish_reason=("stop", "stop"), prompt_tokens=2,
        completion_tokens=2, prefix_shared_tokens=0, cached_prompt_tokens=0, latency_s=0.1, retries=0,
        parse_retries=0, http_calls=1, from_cache=False, model_id=STRONG_ROOT,
    )  # fmt: skip
    (row,) = trace_rows([review_request(0, n=2)], [response])
    assert row["scores"] == [0.5, 0.25] and row["adjustments"] == ["unsupported_low_score", ""]


# ----------------------------------------------------------------------------------------------
# Synchronous host loop and traces


def test_sync_client_and_trace_rows():
    loop = asyncio.new_event_loop()
    server = ScriptedServer()
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        requests = [review_request(0), gen_request(1)]
        with SyncLiveClient([strong(server)], retry=FAST_RETRY) as client:
            first = client.run_batch(requests)
            second = client.run_batch(requests)  # the same long-lived connections, a second round
        assert [r.texts for r in first] == [r.texts for r in second]
        rows = trace_rows(requests, first)
        assert rows[0]["kind"] == "review" and rows[0]["scores"] == [1.0, 1.0, 1.0]
        assert rows[0]["adjustments"] == ["", "", ""] and rows[1]["adjustments"] is None
        assert rows[1]["answers"] == ["(A)"] and rows[1]["model_id"] == STRONG_ROOT
        assert rows[0]["prompt_tokens"] == 3 * PROMPT_TOKENS
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
