"""Pins of the live client and its response cache (meshheal_jax/backends/live.py, backends/cache.py;
spec/live.md "Requests" and "Response cache", docs/decisions.md L2 and L4) that a mutation audit
could change without any other test failing: the checks of a request, a server group and a
server's model list and their messages, the lanes and pools of a server, the sampling parameters
on the wire, the per-sample order and counts of an n-request and its fallbacks, the client's stats
and a round's failure message, and the cache's key, redaction, grouped commits and damaged-file
messages. Each test names the mutation it holds. Against the scripted stand-in server of
tests/test_live.py (real sockets, the real openai SDK)."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import re
import sqlite3
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from test_live import (
    COMPLETION_TOKENS,
    FAST_RETRY,
    PROMPT_TOKENS,
    STRONG_ROOT,
    WEAK_ROOT,
    Reply,
    ScriptedServer,
    gen_request,
    review_request,
    run,
    strong,
)

from meshheal_jax.backends import cache as cache_module
from meshheal_jax.backends import live
from meshheal_jax.backends.cache import ResponseCache, cache_key, stored_replies
from meshheal_jax.backends.live import (
    PARSE_OK,
    PARSE_RETRIED,
    LiveClient,
    RequestRejectedError,
    ServerGroup,
    ServerUnavailableError,
    _retry_after_s,
)
from meshheal_jax.errors import MeshHealError, MeshHealWarning


def completion(choices: list[tuple[int, str]], usage: dict | None = None) -> bytes:
    """A chat completion's JSON with these (index, content) choices, in the order given."""
    return json.dumps(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion",
            "created": 0,
            "model": "strong",
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": "stop"}
                for i, c in choices
            ],
            "usage": usage,
        }
    ).encode()


class ModelsServer(ScriptedServer):
    """The stand-in, with its own answer to GET /v1/models."""

    def __init__(self, models: tuple[int, dict | tuple], **kw) -> None:
        super().__init__(**kw)
        self.models = models

    async def _route(self, method: str, path: str, body: bytes):
        if method == "GET" and path == "/v1/models":
            return self.models[0], {}, self.models[1]
        return await super()._route(method, path, body)


# ----------------------------------------------------------------------------------------------
# Bad input: requests, server groups, URLs


def test_a_request_out_of_range_is_refused_naming_the_call():
    """CallRequest refuses n < 1, max_completion_tokens < 1, a negative seed and no messages, each
    naming the call. Mutations: a guard dropped or loosened by one."""
    where = r"call \(stream 0, t 0, call 0\)"
    with pytest.raises(MeshHealError, match=rf"{where}: n = 0 must be in 1\.\.4"):
        gen_request(0, n=0)
    with pytest.raises(MeshHealError, match=rf"{where}: max_completion_tokens must be positive"):
        gen_request(0, max_completion_tokens=0)
    with pytest.raises(MeshHealError, match=rf"{where}: seed must be non-negative"):
        gen_request(0, seed=-1)
    with pytest.raises(MeshHealError, match=rf"{where}: no messages"):
        gen_request(0, messages=[])
    assert gen_request(0, n=4, max_completion_tokens=1, seed=0).n == 4  # the edges themselves pass


def test_a_server_group_refuses_a_zero_semaphore_and_takes_any_base_url_spelling():
    """max_in_flight must be >= 1; `http://host:8000`, `.../` and `.../v1` all mean the /v1 API,
    and a comma-separated list may hold empty entries (a trailing comma). Mutations: `< 0`; the
    trailing slash kept (`...//v1`); empty entries parsed as URLs."""
    with pytest.raises(MeshHealError, match="max_in_flight for strong must be >= 1"):
        ServerGroup("strong", ("http://127.0.0.1:8000",), max_in_flight=0)
    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", " http://127.0.0.1:8000/v1/ "):
        assert live.normalise_base_url(url) == "http://127.0.0.1:8000/v1"
    assert live.parse_url_list("http://a:1, http://b:2/v1/,") == ("http://a:1/v1", "http://b:2/v1")
    with pytest.raises(MeshHealError, match="empty list of base URLs"):
        live.parse_url_list(" , ")


def test_two_groups_for_one_role_are_refused():
    """Mutation: the second group of a role silently replacing the first."""
    groups = [ServerGroup("strong", ("http://127.0.0.1:1",)), ServerGroup("strong", ("http://127.0.0.1:2",))]
    with pytest.raises(MeshHealError, match="two server groups for the strong role"):
        LiveClient(groups)


def test_a_batch_on_a_client_never_started_is_refused():
    """Mutation: the start() check dropped (a KeyError from deep inside instead)."""
    client = LiveClient([ServerGroup("strong", ("http://127.0.0.1:1",))])
    with pytest.raises(MeshHealError, match=r"LiveClient\.start\(\) was not called"):
        run(client.run_batch([gen_request(0)]))


# ----------------------------------------------------------------------------------------------
# The start-up check of each server


@pytest.mark.parametrize(
    "models, message",
    [
        ((403, {"error": {"message": "forbidden"}}), r"refused the API key \(HTTP 403\); set VLLM_API_KEY"),
        (
            (404, {"error": {"message": "no route"}}),
            r"answered HTTP 404; is this an OpenAI-compatible server",
        ),
        ((200, (b"<html>a proxy's page</html>", "text/html")), r"/models did not return a model list"),
        ((200, {"object": "list", "data": 5}), r"/models did not return a model list"),
    ],
)
def test_a_server_whose_model_list_is_refused_or_garbage_is_named(models, message):
    """One MeshHealError naming the URL and what came back. Mutations: only 401 read as a refused
    key; the status dropped from the message; a body that is not JSON (or not a list) let through
    as a traceback."""

    async def scenario():
        async with ModelsServer(models) as server:
            with pytest.raises(MeshHealError, match=rf"{re.escape(server.base_url)}.*{message}"):
                async with LiveClient([strong(server)], retry=FAST_RETRY):
                    pass

    run(scenario())


def test_the_model_id_comes_from_the_servers_and_must_be_one():
    """ServerGroup.model_id None: read from /v1/models' root; two URLs of a role serving different
    roots, or one that names none, are refused (the cache is keyed by the real model id).
    Mutations: the disagreement check dropped; a root taken while another URL names none."""

    async def scenario():
        async with ScriptedServer(root=STRONG_ROOT) as one, ScriptedServer(root=WEAK_ROOT) as two:
            with pytest.raises(MeshHealError, match=r"strong servers serve different models"):
                async with LiveClient([strong(one, two)], retry=FAST_RETRY):
                    pass
        async with ScriptedServer(root=STRONG_ROOT) as one, ScriptedServer(root=None) as two:
            with pytest.raises(
                MeshHealError, match=r"does not say which model it serves; give the real model"
            ):
                async with LiveClient([strong(one, two)], retry=FAST_RETRY):
                    pass
            async with LiveClient([strong(one, two, model_id=STRONG_ROOT)], retry=FAST_RETRY) as client:
                assert client.model_ids == {"strong": STRONG_ROOT}

    run(scenario())


@pytest.mark.parametrize("root", [5, ["x"]])
def test_a_model_list_with_a_root_that_is_not_text_is_named(root):
    """A root that is not text names no model (an audit found it crashed start() with a raw
    AttributeError / TypeError): the one-line message asks for the real model id."""

    async def scenario():
        async with ModelsServer(
            (200, {"object": "list", "data": [{"id": "strong", "root": root}]})
        ) as server:
            with pytest.raises(
                MeshHealError, match="does not say which model it serves; give the real model id"
            ):
                async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                    await client.run_batch([gen_request(0)])

    run(scenario())


def test_the_api_key_is_read_from_the_environment(monkeypatch):
    """No api_key given: the first of MESHHEAL_API_KEY, VLLM_API_KEY, OPENAI_API_KEY that is set.
    Mutation: the environment ignored ("EMPTY" sent)."""
    for name in live.API_KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-the-env-1")

    async def scenario():
        async with ScriptedServer(api_key="sk-from-the-env-1") as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(0)])
            assert response.parse_status == (PARSE_OK,)

    run(scenario())


# ----------------------------------------------------------------------------------------------
# Lanes and pools (decisions L4)


@pytest.mark.parametrize("max_in_flight, lanes", [(32, 1), (33, 2), (64, 2)])
def test_a_server_gets_ceil_m_over_32_lanes_with_pools_above_the_semaphore(max_in_flight, lanes, monkeypatch):
    """min(ceil(M / 32), 32) clients, each with a pool of ceil((M + 32) / lanes) connections, so the
    pools together exceed the semaphore; every lane idle again once a batch is back. Mutations:
    floor + 1 lanes; the headroom dropped from the pools; a lane's load not given back."""
    pools: list[int] = []
    real = live._http_client

    def noted(openai_module, connections, retry):
        pools.append(connections)
        return real(openai_module, connections, retry)

    monkeypatch.setattr(live, "_http_client", noted)

    async def scenario():
        async with (
            ScriptedServer() as server,
            LiveClient([strong(server, max_in_flight=max_in_flight)], retry=FAST_RETRY) as client,
        ):
            (one,) = client._servers["strong"]
            assert len(one.lanes) == lanes
            await client.run_batch([gen_request(i) for i in range(6)])
            assert one.lane_load == [0] * lanes and one.stats.in_flight == 0

    run(scenario())
    assert pools == [-(-(max_in_flight + live.POOL_HEADROOM) // lanes)] * lanes
    assert sum(pools) > max_in_flight


# ----------------------------------------------------------------------------------------------
# What goes on the wire


def test_sampling_parameters_are_sent_explicitly():
    """temperature 1.0 and top_p 1.0 go with every call (servers run --generation-config vllm, so
    a server default must never decide). Mutations: the default temperature changed; temperature
    left out of the parameters."""

    async def scenario():
        async with ScriptedServer() as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                await client.run_batch([gen_request(0)])
            assert (server.chats[0]["temperature"], server.chats[0]["top_p"]) == (1.0, 1.0)

    run(scenario())


def test_reasoning_effort_auto_reads_the_model_id_in_any_case_and_a_given_one_is_sent():
    """ "auto" sends gpt_oss_effort to a gpt-oss model whatever the case of its id (a local path),
    nothing to others; a given effort goes to any model; "" sends nothing. Mutations: the id
    compared case-sensitively; a given effort dropped; "" sent."""

    async def scenario():
        async with (
            ScriptedServer(root="/models/GPT-OSS-120B") as big,
            ScriptedServer(served=("weak",), root=WEAK_ROOT) as small,
        ):
            groups = [
                strong(big, gpt_oss_effort="low"),
                ServerGroup("weak", (small.base_url,), reasoning_effort="high"),
            ]
            async with LiveClient(groups, retry=FAST_RETRY) as client:
                await client.run_batch([gen_request(0), gen_request(1, role="weak")])
            assert big.chats[0]["reasoning_effort"] == "low" and small.chats[0]["reasoning_effort"] == "high"
            async with LiveClient([strong(big, reasoning_effort="")], retry=FAST_RETRY) as client:
                await client.run_batch([gen_request(2)])
            assert "reasoning_effort" not in big.chats[1]

    run(scenario())


# ----------------------------------------------------------------------------------------------
# Samples of an n-request: order, fallbacks, tokens


def test_samples_are_read_in_their_index_order_and_extra_choices_are_dropped():
    """Sample i is the choice with index i, whatever order the server lists them in; choices past
    n are not samples (neither texts nor tokens). Mutations: choices taken in the listed order;
    every choice the server sent kept."""
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 4 * COMPLETION_TOKENS}
    raw = completion([(3, "RESULT: (D)"), (2, "RESULT: (C)"), (1, "RESULT: (B)"), (0, "RESULT: (A)")], usage)

    async def scenario():
        async with ScriptedServer(lambda body, i: Reply(raw=raw)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (response,) = await client.run_batch([gen_request(0, n=3)])
            assert [v.answer for v in response.parsed] == ["(A)", "(B)", "(C)"]
            assert len(response.texts) == 3 and len(server.chats) == 1
            assert response.prompt_tokens == 3 * PROMPT_TOKENS
            assert response.prefix_shared_tokens == 2 * PROMPT_TOKENS

    run(scenario())


def test_a_server_returning_two_of_three_samples_gets_one_fallback_for_the_third():
    """The missing sample i = 2 alone, seed + 2, and it is sample 2 of the response. Mutations:
    a fallback only when two are missing; a fallback's reply put before the others."""

    def script(body, index):
        if body["n"] == 3:  # two choices, each naming the seed of its sample
            return Reply(contents=[f"sample seed {body['seed'] + i}\nRESULT: (A)" for i in range(2)])
        return Reply()

    async def scenario():
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                request = gen_request(0, n=3)
                (response,) = await client.run_batch([request])
                assert client.stats.n_fallback_calls == 1
            assert [(c["n"], c["seed"]) for c in server.chats] == [(3, request.seed), (1, request.seed + 2)]
            assert f"seed {request.seed}\n" in response.texts[0]
            assert f"seed {request.seed + 1}\n" in response.texts[1]
            assert f"(seed {request.seed + 2})" in response.texts[2]
            assert response.http_calls == 2 and response.parse_status == (PARSE_OK,) * 3

    run(scenario())


def test_cached_prompt_tokens_sum_the_servers_reports_over_every_call():
    """cached_prompt_tokens: usage.prompt_tokens_details.cached_tokens, summed over the n-request
    and its fallbacks. Mutations: the field not read; the fallbacks' left out."""
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    raw = completion([(0, "RESULT: (A)")], usage)

    async def scenario():
        async with ScriptedServer(lambda body, i: Reply(raw=raw)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                (one, three) = await client.run_batch([gen_request(0), gen_request(1, n=3)])
            assert one.cached_prompt_tokens == 32
            assert three.cached_prompt_tokens == 3 * 32 and three.http_calls == 3

    run(scenario())


# ----------------------------------------------------------------------------------------------
# The client's counts and a response's provenance


def test_stats_count_parse_retries_prefix_savings_and_retries_not_attempts():
    """LiveStats.parse_retries and prefix_shared_tokens add up every call's; transport_retries
    counts retries (a call failing 4 attempts made 3). Mutations: those counts not kept; the last
    failed attempt counted as a retry."""
    base = review_request(0, n=1).seed

    def script(body, index):
        return Reply(contents=["not a review"]) if body["seed"] == base else Reply()

    async def scenario():
        async with ScriptedServer(script) as server, LiveClient([strong(server)], retry=FAST_RETRY) as client:
            await client.run_batch([review_request(0, n=1), review_request(1, n=3)])
            assert client.stats.parse_retries == 1
            assert client.stats.prefix_shared_tokens == 2 * PROMPT_TOKENS
        async with (
            ScriptedServer(lambda body, index: Reply(status=503)) as server,
            LiveClient([strong(server)], retry=FAST_RETRY) as client,
        ):
            with pytest.raises(ServerUnavailableError):
                await client.run_batch([gen_request(0)])
            assert client.stats.transport_retries == FAST_RETRY.max_retries
            assert client.stats.http_requests == FAST_RETRY.max_retries + 1

    run(scenario())


def test_a_response_only_partly_from_the_cache_is_not_from_cache(tmp_path):
    """from_cache holds only when every HTTP call of the request was a hit: here the first was (a
    reply that does not parse), its parse retry was sent. Mutation: from_cache when any call was."""
    request = review_request(0, n=1)

    async def scenario():
        with ResponseCache(tmp_path / "responses.sqlite") as cache:
            async with (
                ScriptedServer() as server,
                LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client,
            ):
                params = client._params(request, 1, request.seed)
                key = cache_key(STRONG_ROOT, request.messages, params)
                garbage = {"choices": [{"content": "not a review", "finish_reason": "stop"}]}
                cache.put(key, STRONG_ROOT, {**garbage, "usage": None, "latency_s": 0.5})
                (mixed,) = await client.run_batch([request])
            assert mixed.parse_status == (PARSE_RETRIED,) and mixed.http_calls == 1
            assert not mixed.from_cache

    run(scenario())


def test_a_reply_without_usage_from_the_cache_is_warned_of_too(tmp_path, recwarn):
    """A resumed run whose cached replies have no token usage is told their tokens count 0, as the
    run that sent them was. Mutation: only replies off the wire checked."""
    raw = completion([(0, "RESULT: (B)")])

    async def scenario():
        with ResponseCache(tmp_path / "responses.sqlite") as cache:
            async with ScriptedServer(lambda body, i: Reply(raw=raw)) as server:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    await client.run_batch([gen_request(0)])
                recwarn.clear()
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    (response,) = await client.run_batch([gen_request(0)])
            assert response.from_cache

    run(scenario())
    assert [str(w.message) for w in recwarn if "without token usage" in str(w.message)]


# ----------------------------------------------------------------------------------------------
# Failures: what is retried, what the message says


def test_a_408_is_rejected_at_once_as_every_4xx_but_429():
    """Retries on 429 and 5xx only; any other status fails at once. Mutation: 408 retried."""

    async def scenario():
        async with ScriptedServer(lambda body, i: Reply(status=408)) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                with pytest.raises(RequestRejectedError, match="HTTP 408"):
                    await client.run_batch([gen_request(0)])
            assert len(server.chats) == 1

    run(scenario())


def test_a_failed_round_says_how_many_calls_completed_and_names_each_server_once(tmp_path):
    """The round's message: how many calls failed and completed, and where the replies are (or that
    no cache keeps them); a call's message names the servers it tried, each once. Mutations: the
    completed count taken as the round's size; the no-cache notice dropped; a server named per
    attempt."""

    def script(body, index):
        return Reply(status=500) if "question 1" in body["messages"][0]["content"] else Reply()

    async def scenario():
        requests = [gen_request(i) for i in range(3)]
        async with ScriptedServer(script) as server:
            async with LiveClient([strong(server)], retry=FAST_RETRY) as client:
                with pytest.raises(ServerUnavailableError) as info:
                    await client.run_batch(requests)
            message = str(info.value)
            assert f"the strong server ({server.base_url}) failed 4 attempts of a generate call" in message
            assert (
                "[1 of 3 calls of this round failed; no response cache is configured, so the received "
                in message
            )
            with ResponseCache(tmp_path / "c.sqlite") as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    with pytest.raises(
                        ServerUnavailableError, match=r"the 2 completed call\(s\) and every reply"
                    ):
                        await client.run_batch(requests)

    run(scenario())


def test_a_cached_row_that_is_json_but_not_a_reply_is_sent_again_with_a_warning(tmp_path):
    """A row that is JSON but not a reply (a hand-edited or foreign file) is no cached reply: the
    call is sent again, with a warning naming the cache file, and the reply replaces the row (an
    audit found a raw KeyError from run_batch)."""
    path = tmp_path / "responses.sqlite"
    request = gen_request(0)

    async def scenario():
        with ResponseCache(path) as cache:
            async with (
                ScriptedServer() as server,
                LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client,
            ):
                key = cache_key(STRONG_ROOT, request.messages, client._params(request, 1, request.seed))
                for row in ({"x": 1}, {"choices": [5]}, {"choices": [], "usage": 3}):
                    cache.put(key, STRONG_ROOT, row)
                    with pytest.warns(
                        MeshHealWarning, match=f"response cache {re.escape(str(path))}: a row holds"
                    ):
                        (response,) = await client.run_batch([request])
                    assert not response.from_cache and response.parsed[0].answer == "(A)"
                    assert cache.get(key)["choices"][0]["content"] == response.texts[0]

    run(scenario())


def test_a_retry_after_date_is_read_as_seconds_from_now():
    """Retry-After may be an HTTP date (RFC 9110): the wait is the time until it, never negative.
    Mutation: only the delta-seconds form read."""

    class Response:
        def __init__(self, value: str) -> None:
            self.headers = {"retry-after": value}

    soon = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 30.0 < _retry_after_s(Response(soon)) <= 60.0
    assert _retry_after_s(Response(email.utils.formatdate(time.time() - 60, usegmt=True))) == 0.0
    assert _retry_after_s(Response("soon")) is None


# ----------------------------------------------------------------------------------------------
# The response cache


def test_a_cache_format_bump_changes_every_key(monkeypatch):
    """CACHE_FORMAT is part of every key: bumping it invalidates old entries. Mutation: the format
    left out of the key material."""
    messages, params = [{"role": "user", "content": "hi"}], {"n": 1, "seed": 4}
    before = cache_key(STRONG_ROOT, messages, params)
    monkeypatch.setattr(cache_module, "CACHE_FORMAT", cache_module.CACHE_FORMAT + 1)
    assert cache_key(STRONG_ROOT, messages, params) != before


@pytest.mark.parametrize("variable", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", *live.API_KEY_ENV_VARS])
def test_every_secret_variable_and_extra_secret_is_redacted_and_short_values_are_not(
    variable, tmp_path, monkeypatch
):
    """A Hugging Face token or any API key the client reads (spec/live.md "Secrets"), or an extra
    secret given to the cache, never reaches the file; values shorter than 6 characters ("EMPTY")
    are not secrets and stay. Mutations: a variable left off SECRET_ENV_VARS; extra_secrets
    ignored; every non-empty value redacted."""
    for name in {*cache_module.SECRET_ENV_VARS, *live.API_KEY_ENV_VARS}:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "hf_env_secret_value_1")
    payload = {"choices": [{"content": "hf_env_secret_value_1 sk-cli-secret-2 EMPTY"}]}
    with ResponseCache(tmp_path / "c.sqlite", extra_secrets=["sk-cli-secret-2", "EMPTY"]) as cache:
        cache.put("k", STRONG_ROOT, payload)
        assert cache.get("k")["choices"][0]["content"] == "[redacted] [redacted] EMPTY"
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert b"hf_env_secret_value_1" not in raw and b"sk-cli-secret-2" not in raw
    monkeypatch.setenv(variable, "EMPTY")
    with ResponseCache(tmp_path / "c.sqlite") as cache:
        cache.put("k2", STRONG_ROOT, {"text": "an EMPTY box"})
        assert cache.get("k2") == {"text": "an EMPTY box"}


def test_put_soon_commits_at_each_next_turn_and_held_replies_count(tmp_path):
    """decisions L2: the first reply held schedules a flush at the loop's next turn, in every turn
    of a loop, not only its first; a held reply is in the cache and counted. Mutations: a flush
    scheduled once per loop; `in` and len reading the file only."""

    async def scenario(cache):
        cache.put_soon("a", "m", {"x": 1})
        assert len(cache) == 1
        cache.put_soon("b", "m", {"x": 2})
        assert "b" in cache
        cache.put_soon("c", "m", {"x": 3})
        commits = cache.commits
        await asyncio.sleep(0)
        assert cache.commits == commits + 1
        cache.put_soon("d", "m", {"x": 4})
        await asyncio.sleep(0)  # a later turn of the same loop flushes too
        assert cache.commits == commits + 2 and not cache._pending

    with ResponseCache(tmp_path / "c.sqlite") as cache:
        asyncio.run(scenario(cache))
    assert stored_replies(tmp_path / "c.sqlite") == 4


def test_close_writes_the_replies_still_held(tmp_path):
    """A cache closed in the turn its replies arrived keeps them (decisions L2: `close` flushes).
    Mutation: close without a flush (the replies lost)."""

    async def scenario():
        cache = ResponseCache(tmp_path / "c.sqlite")
        cache.put_soon("k", STRONG_ROOT, {"choices": [{"content": "RESULT: (A)"}]})
        cache.close()

    asyncio.run(scenario())
    with ResponseCache(tmp_path / "c.sqlite") as cache:
        assert cache.get("k") == {"choices": [{"content": "RESULT: (A)"}]}


def test_the_cache_file_is_in_wal_mode_and_counted_read_only(tmp_path):
    """sqlite3 in WAL mode (several processes may share the file); stored_replies reads 0 where
    there is no file, without making one. Mutations: WAL dropped; the missing file opened."""
    path = tmp_path / "responses.sqlite"
    assert stored_replies(path) == 0 and not path.exists()
    with ResponseCache(path) as cache:
        cache.put("k", STRONG_ROOT, {"x": 1})
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert stored_replies(path) == 1


def test_a_cache_that_is_not_sqlite_or_holds_a_reply_that_is_not_json_is_named(tmp_path):
    """Each a MeshHealError naming the file (and what to do), not sqlite's or json's traceback.
    Mutations: either error let through unnamed."""
    path = tmp_path / "responses.sqlite"
    path.write_bytes(b"not a database, " * 512)
    with pytest.raises(MeshHealError, match=rf"response cache {re.escape(str(path))}: cannot open \("):
        ResponseCache(path)
    path.unlink()
    with ResponseCache(path) as cache:
        cache.put("k", STRONG_ROOT, {"x": 1})
        cache._db.execute("UPDATE responses SET payload = '{half'")
        with pytest.raises(
            MeshHealError, match=r"cannot read it \(a reply that is not JSON: .*\); move it aside"
        ):
            cache.get("k")
