"""The live backend's client: every call of a round sent concurrently to OpenAI-compatible
servers (vLLM), parsed, cached on disk (spec/live.md "Requests", architecture.md "Live backend").

The boundary with the host loop is two plain dataclasses. The host loop turns the requests
emitted by the controller into `CallRequest`s (role already resolved from health: "strong" or
"weak"; prompt messages built by `meshheal_jax.prompts`), awaits `LiveClient.run_batch`, and
reads one `CallResponse` per request back into the response arrays:

    async with LiveClient([ServerGroup("strong", ("http://127.0.0.1:8000/v1",)),
                           ServerGroup("weak", ("http://127.0.0.1:8001/v1",))],
                          cache=ResponseCache("runs/x/responses.sqlite")) as client:
        responses = await client.run_batch(requests)

(`SyncLiveClient` wraps the same for a synchronous host loop.)

Behaviour, all of it tested against a scripted stand-in server (tests/test_live.py):
- Long-lived `openai.AsyncOpenAI` clients per base URL (ceil(in flight / 32) "lanes", each with
  its own HTTP pool, a request taking the least-loaded; decisions L4), several base URLs per role
  taken in turn (round-robin per HTTP attempt), an `asyncio.Semaphore` per server capping
  requests in flight, and HTTP connections beyond the semaphore (a default pool would silently
  cap concurrency). The SDK's aiohttp transport where `openai[aiohttp]` is installed, else its
  httpx one. The SDK's telemetry headers (`X-Stainless-*`) are not sent.
- Retries with jittered exponential backoff on connection errors and timeouts, 429 (honouring
  Retry-After), 5xx and 200 replies that are not chat completions only, at most
  `RetryPolicy.max_retries` times; any other status fails at once (`RequestRejectedError`). A
  server that stays down raises `ServerUnavailableError` once the whole round has settled, so
  every response that did arrive is already in the cache.
- `n` > 1 (the three initial review samples) goes out as one request sharing the prefill; if a
  server returns fewer choices, the missing samples i are sent as separate requests with seed
  seed + i (what vLLM gives sample i of an n-request). Tokens are counted as the paper counts:
  the prompt once per sample; the prefill the server shared is reported apart
  (`prefix_shared_tokens`).
- A sample whose reply does not parse, or that stopped on `length` with empty content, is sent
  once more alone with seed + 1,000,003 (its tokens counted); if that fails too it is recorded
  as a parse failure with the parser's fallback (a neutral 0.5 review, the documented pair).
- Every HTTP call is looked up in / written to the `ResponseCache` (key: real model id,
  messages, sampling params, seed, n) as it returns (the replies of one event-loop turn in one
  commit, at the next turn; `run_batch` flushes before it returns; decisions L2): a repeated or
  resumed batch sends nothing it already has.
- `reasoning_effort` (default "medium") goes to gpt-oss models only; `max_completion_tokens`
  covers their reasoning too.
- Python's cyclic garbage collector is paused while a batch is in flight (`pause_gc`, docs/
  decisions.md L1): reference counting still frees every reply; the collector's passes found
  nothing to free and took 13-20% of the client's CPU at 256 in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import gc
import hashlib
import importlib
import json
import math
import os
import random
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Self

from meshheal_jax.backends.cache import ResponseCache, cache_key
from meshheal_jax.errors import MeshHealError, MeshHealWarning
from meshheal_jax.prompts import TEXT_PARSER, ReplyParseError, ReplyParser

KINDS = ("infer", "generate", "review", "committee1", "committee2", "candidate", "synthesis")
KINDS += ("router", "watchdog", "select", "compose", "evaluate", "refine", "cot")  # the baselines' own
ROLES = ("strong", "weak")
INITIAL_REVIEW_SAMPLES = 3  # the initial review's n
SEED_SPACING = 4  # request seeds are multiples of this, > any n: sample seeds never collide
RETRY_SEED_OFFSET = 1_000_003  # a parse-failure retry of sample i uses seed + i + this
DEFAULT_REASONING_EFFORT = "medium"  # gpt-oss only
POOL_HEADROOM = 32  # HTTP connections per server beyond its semaphore
LANE_CONNECTIONS = 32  # a server gets ceil(in flight / 32) clients, a request taking the least-loaded
# at most this many lanes: past 1,024 in flight their pools grow instead (a client costs ~2 MB to open)
MAX_LANES = 32
API_KEY_ENV_VARS = ("MESHHEAL_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY")

# CallResponse.parse_status values, per sample
PARSE_OK = "ok"
PARSE_RETRIED = "retried"  # failed once, the retry with seed + 1,000,003 parsed
PARSE_FAILED = "failed"  # failed twice: the parser's fallback was recorded
PARSE_STATUSES = (PARSE_OK, PARSE_RETRIED, PARSE_FAILED)


class LiveBackendError(MeshHealError):
    """A live-backend failure the CLIs report in one line (exit status 2)."""


class ServerUnavailableError(LiveBackendError):
    """A server stayed unreachable (or kept answering 429/5xx, or 200s that are not chat
    completions) through every retry."""


class RequestRejectedError(LiveBackendError):
    """A server refused a request outright (a 4xx other than 429): retrying cannot help."""


# ---------------------------------------------------------------------------------------------
# The boundary


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters sent with every call (explicit: servers run `--generation-config vllm`)."""

    temperature: float = 1.0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class CallRequest:
    """One model call of one in-flight task, as the host loop hands it to the client."""

    stream: int  # stream index in the batch
    t: int  # the task's index in its stream
    call_id: int  # the call's index within the task (seeds derive from it)
    kind: str  # one of KINDS
    role: str  # "strong" | "weak" (resolved by the backend from health, never by the controller)
    messages: tuple[Mapping[str, str], ...]  # chat messages (meshheal_jax.prompts builders)
    seed: int  # request_seed(...); sample i of an n-request uses seed + i
    max_completion_tokens: int
    n: int = 1  # INITIAL_REVIEW_SAMPLES for the initial review
    response_format: Mapping[str, Any] | None = None  # e.g. prompts.review_response_format(stage)
    sampling: Sampling = Sampling()
    parser: ReplyParser = TEXT_PARSER  # how replies are read; its fallback after a failed retry
    agent: int = -1  # calling agent (traces only)
    author: int = -1  # the author whose output is judged, -1 if none (traces only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        where = f"call (stream {self.stream}, t {self.t}, call {self.call_id})"
        if self.kind not in KINDS:
            raise MeshHealError(f"{where}: kind {self.kind!r} is not one of {KINDS}")
        if self.role not in ROLES:
            raise MeshHealError(f"{where}: role {self.role!r} is not one of {ROLES}")
        if not self.messages:
            raise MeshHealError(f"{where}: no messages")
        if self.n < 1 or self.n > SEED_SPACING:
            raise MeshHealError(f"{where}: n = {self.n} must be in 1..{SEED_SPACING}")
        if self.max_completion_tokens < 1:
            raise MeshHealError(f"{where}: max_completion_tokens must be positive")
        if self.seed < 0:
            raise MeshHealError(f"{where}: seed must be non-negative")


@dataclasses.dataclass(frozen=True)
class CallResponse:
    """What came back for one CallRequest (one entry per sample where it says "per sample")."""

    texts: tuple[str, ...]  # per sample: message.content ("" when there was none)
    parsed: tuple[Any, ...]  # per sample: the parser's value, or its fallback after a failure
    parse_status: tuple[str, ...]  # per sample: PARSE_OK | PARSE_RETRIED | PARSE_FAILED
    finish_reason: tuple[str, ...]  # per sample, of the reply finally used
    prompt_tokens: int  # counted as the paper counts: the prompt once per sample and per retry
    completion_tokens: int  # every completion token received, reasoning included, retries too
    prefix_shared_tokens: int  # of prompt_tokens, the prefill an n-request shared (server-side saving)
    cached_prompt_tokens: int  # prompt tokens the server reported as prefix-cache hits, if it reports them
    latency_s: float  # summed round-trip time of the HTTP calls used (as first measured, also from cache)
    retries: int  # transport retries (connection errors, 429, 5xx) this call needed
    parse_retries: int  # samples re-sent with seed + 1,000,003
    http_calls: int  # HTTP requests actually sent (0 when everything came from the cache)
    from_cache: bool  # every HTTP call of this request was a cache hit
    model_id: str  # the real model behind the role

    @property
    def parse_failures(self) -> int:
        return sum(status == PARSE_FAILED for status in self.parse_status)

    @property
    def scores(self) -> tuple[float, ...]:
        """Per-sample review scores (for review kinds: parsed values are prompts.ReviewVerdict)."""
        return tuple(float(value.score) for value in self.parsed)


def request_seed(stream_seed: int, dataset_id: int, t: int, call_id: int) -> int:
    """The seed of call `call_id` of task t: derived from (stream seed, dataset, task, call) only,
    a multiple of SEED_SPACING below 2**50, so seed + i (i < n) never meets another call's seed."""
    digest = hashlib.sha256(f"meshheal:{stream_seed}:{dataset_id}:{t}:{call_id}".encode()).digest()
    return int.from_bytes(digest[:6], "big") * SEED_SPACING


# ---------------------------------------------------------------------------------------------
# Configuration


def normalise_base_url(url: str) -> str:
    """`http://host:8000`, `http://host:8000/` and `http://host:8000/v1` all mean the /v1 API."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise MeshHealError(f"live backend: base URL {url!r} must start with http:// or https://")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0..65535
    except ValueError as err:  # "http://[::1" (an unclosed bracket), "http://host:80x"
        raise MeshHealError(f"live backend: base URL {url!r} is not a valid URL ({err})") from None
    if not parts.hostname:
        raise MeshHealError(f"live backend: base URL {url!r} names no host")
    return url if url.endswith("/v1") else url + "/v1"


def parse_url_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of base URLs (several servers of one model, used round-robin)."""
    urls = tuple(normalise_base_url(u) for u in text.split(",") if u.strip())
    if not urls:
        raise MeshHealError("live backend: empty list of base URLs")
    return urls


@dataclasses.dataclass(frozen=True)
class ServerGroup:
    """The servers of one role: same model behind every base URL."""

    role: str  # "strong" | "weak"
    base_urls: tuple[str, ...]
    model_id: str | None = None  # real model id (cache key); None: read from /v1/models ("root")
    served_name: str | None = None  # --served-model-name; None: the role
    max_in_flight: int = 256  # per server (serving/vllm_pair.sh's --max-num-seqs)
    reasoning_effort: str | None = "auto"  # "auto": gpt_oss_effort for gpt-oss models, none for others
    gpt_oss_effort: str = DEFAULT_REASONING_EFFORT  # what "auto" sends to a gpt-oss model

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise MeshHealError(f"live backend: role {self.role!r} is not one of {ROLES}")
        urls = (self.base_urls,) if isinstance(self.base_urls, str) else tuple(self.base_urls)
        if not urls:
            raise MeshHealError(f"live backend: no base URL for the {self.role} model")
        object.__setattr__(self, "base_urls", tuple(normalise_base_url(u) for u in urls))
        if self.served_name is None:
            object.__setattr__(self, "served_name", self.role)
        if self.max_in_flight < 1:
            raise MeshHealError(f"live backend: max_in_flight for {self.role} must be >= 1")

    def effort_for(self, model_id: str) -> str | None:
        if self.reasoning_effort == "auto":
            return self.gpt_oss_effort if "gpt-oss" in model_id.lower() else None
        return self.reasoning_effort


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 6  # extra attempts after the first, per HTTP call
    backoff_base_s: float = 0.5  # attempt k waits uniform(0, min(cap, base * 2**k))
    backoff_cap_s: float = 30.0
    retry_after_cap_s: float = 120.0  # longest Retry-After honoured
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 900.0  # one completion, reasoning included


@dataclasses.dataclass
class ServerStats:
    base_url: str
    role: str
    sent: int = 0  # HTTP attempts
    in_flight: int = 0
    max_in_flight: int = 0  # the most requests this client had in flight at once


@dataclasses.dataclass
class LiveStats:
    """Counts over a client's life. http_requests / transport_retries count what went over the wire;
    the other counts are per logical call, whether its replies were sent or came from the cache."""

    http_requests: int = 0  # attempts sent, retries included
    cache_hits: int = 0
    transport_retries: int = 0
    n_fallback_calls: int = 0  # separate calls for samples a server left out of an n-request (cached too)
    parse_retries: int = 0
    parse_failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_shared_tokens: int = 0


# ---------------------------------------------------------------------------------------------
# The client


def _import_openai():
    try:
        import openai
    except ImportError:
        raise MeshHealError("the live backend needs the 'openai' package: pip install -e .[live]") from None
    return openai


# the SDK's telemetry headers, for OpenAI's API: a local server reads none of them, and the
# HTTP library's header objects cost CPU per header on every request (a small saving: decisions
# L4, `python benchmarks/profile_client.py --ab-telemetry 6`). The names are
# spelt as the SDK spells them: openai 1.x merges its default headers case-sensitively.
_PLATFORM_HEADERS = ("X-Stainless-Lang", "X-Stainless-Package-Version", "X-Stainless-OS", "X-Stainless-Async",
                     "X-Stainless-Arch", "X-Stainless-Runtime", "X-Stainless-Runtime-Version")  # fmt: skip
_PER_REQUEST_HEADERS = ("X-Stainless-Retry-Count", "X-Stainless-Read-Timeout")


def _no_telemetry(openai_module: Any, names: Sequence[str]) -> dict:
    """Headers that remove `names` from the SDK's requests (`Omit`, as its own default_headers and
    per-request headers take it)."""
    return {name: openai_module.Omit() for name in names}


def _sdk_client(openai_module: Any, base_url: str, api_key: str, http_client: Any) -> Any:
    """An `AsyncOpenAI` as LiveClient opens one: no SDK retries (LiveClient retries itself), no
    telemetry headers."""
    return openai_module.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0,
                                     default_headers=_no_telemetry(openai_module, _PLATFORM_HEADERS))  # fmt: skip


def _post_options(openai_module: Any) -> dict:
    """Request options under which the SDK's `post` authenticates as `chat.completions.create`
    does: the bearer API key only (SDKs with per-request security options default `post` to also
    sending an admin key when one is configured; older SDKs have no such option), and without the
    SDK's per-request telemetry headers."""
    options = {"headers": _no_telemetry(openai_module, _PER_REQUEST_HEADERS)}
    try:
        fields = importlib.import_module(f"{openai_module.__name__}._types").RequestOptions.__annotations__
    except (ImportError, AttributeError):
        return options
    return {**options, "security": {"bearer_auth": True}} if "security" in fields else options


def _http_library(client_or_class: Any):
    """The HTTP library (httpx, or httpx2 for openai >= 3) a client class belongs to."""
    cls = client_or_class if isinstance(client_or_class, type) else type(client_or_class)
    for name in ("httpx2", "httpx"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if issubclass(cls, module.AsyncClient):
            return module
    raise MeshHealError("live backend: cannot tell which HTTP library this openai SDK uses")


def _transport_errors(client: Any) -> tuple[type[BaseException], ...]:
    """What a request through `client` raises where no OpenAI-compatible server answers: refused,
    DNS, timeouts (the library's TransportError, OSError); a URL it cannot use (InvalidURL); and,
    through the SDK's aiohttp transport, aiohttp's own errors (a port where another service answers
    something that is not HTTP: "Bad status line")."""
    library = _http_library(client)
    errors: tuple[type[BaseException], ...] = (library.TransportError, library.InvalidURL, OSError)
    with contextlib.suppress(ImportError):
        import aiohttp

        errors += (aiohttp.ClientError,)
    return errors


def _http_client(openai_module, connections: int, retry: RetryPolicy):
    """The SDK's own async HTTP client with a pool of `connections` and our timeouts: its aiohttp
    transport (`openai.DefaultAioHttpClient`, installed with `openai[aiohttp]`) where available, else
    its httpx client. aiohttp's connector hands out a pooled connection in O(1); the httpx pool
    walks every connection on each request and release (benchmarks/README.md, section b)."""
    aiohttp_cls = _aiohttp_client_class(openai_module)
    if aiohttp_cls is not None:
        try:
            return _pooled(aiohttp_cls, connections, retry)
        except RuntimeError:  # the SDK's placeholder class: its aiohttp adapter could not be imported
            _AIOHTTP_CLIENTS[openai_module] = None
    return _pooled(openai_module.DefaultAsyncHttpxClient, connections, retry)


def _pooled(client_cls: Any, connections: int, retry: RetryPolicy) -> Any:
    lib = _http_library(client_cls)
    return client_cls(
        limits=lib.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=lib.Timeout(retry.request_timeout_s, connect=retry.connect_timeout_s),
    )


_AIOHTTP_CLIENTS: dict[Any, Any] = {}  # openai module -> its aiohttp client class (None: unavailable)


def _aiohttp_client_class(openai_module) -> Any:
    """`openai.DefaultAioHttpClient` with connection errors classified as httpx classifies them,
    or None where the SDK has no aiohttp transport or aiohttp is not installed.

    The SDK's aiohttp adapter maps every `aiohttp.ClientConnectionError` (refused connection,
    server disconnected) to `ConnectTimeout`, so the SDK would report a server that is down as
    "APITimeoutError: Request timed out."; here only real timeouts stay timeouts, a failed connect
    is `ConnectError` and a dropped connection `ReadError` (the SDK's APIConnectionError, as
    with httpx)."""
    if openai_module in _AIOHTTP_CLIENTS:
        return _AIOHTTP_CLIENTS[openai_module]
    base = getattr(openai_module, "DefaultAioHttpClient", None)
    try:
        aiohttp = importlib.import_module("aiohttp")
        lib = _http_library(base) if isinstance(base, type) else None
    except (ImportError, MeshHealError):
        lib = None
    if lib is None:
        _AIOHTTP_CLIENTS[openai_module] = None
        return None

    class _Transport(lib.AsyncBaseTransport):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def handle_async_request(self, request: Any) -> Any:
            try:
                return await self.inner.handle_async_request(request)
            except lib.ConnectTimeout as err:
                cause = err.__cause__
                if not isinstance(cause, aiohttp.ClientConnectionError) or isinstance(cause, TimeoutError):
                    raise
                kind = lib.ConnectError if isinstance(cause, aiohttp.ClientConnectorError) else lib.ReadError
                raise kind(str(err), request=request) from cause

        async def aclose(self) -> None:
            await self.inner.aclose()

    class AioHttpClient(base):
        def _init_transport(self, *args: Any, **kwargs: Any) -> Any:
            return _Transport(super()._init_transport(*args, **kwargs))

        def _init_proxy_transport(self, *args: Any, **kwargs: Any) -> Any:
            return _Transport(super()._init_proxy_transport(*args, **kwargs))

    _AIOHTTP_CLIENTS[openai_module] = AioHttpClient
    return AioHttpClient


@dataclasses.dataclass
class _Server:
    """One base URL: its semaphore and several `openai.AsyncOpenAI` lanes (each with its own HTTP
    pool of at most ~LANE_CONNECTIONS), a request taking the lane with the fewest in flight: with
    the semaphore at M and n lanes of ceil((M + headroom) / n) connections, no lane then holds more
    requests than connections, so a request never waits for a connection while another lane has
    one free (in turn, slow requests could pile up on one lane). The httpx pool walks every pooled
    connection on each request and release, so there one pool of 256+ connections costs ~2x the
    CPU per call of eight pools of 32; with the aiohttp transport the lane size makes no
    measurable difference (16 to 256 alike), and lanes of 32 keep the httpx fallback cheap
    (benchmarks/README.md, "Live throughput", section b)."""

    stats: ServerStats
    lanes: list[tuple[Any, Any]]  # (openai.AsyncOpenAI, its HTTP client)
    semaphore: asyncio.Semaphore
    lane_load: list[int] = dataclasses.field(default_factory=list)  # requests in flight per lane

    def __post_init__(self) -> None:
        self.lane_load = [0] * len(self.lanes)

    @property
    def http(self) -> Any:
        return self.lanes[0][1]

    def take_lane(self) -> int:
        """The lane with the fewest requests in flight (the first of them); `lane_load[k] -= 1` when
        its request is back."""
        k = min(range(len(self.lanes)), key=self.lane_load.__getitem__)
        self.lane_load[k] += 1
        return k


def _retry_after_s(response: Any) -> float | None:
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return float(millis) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


_gc_lock = threading.Lock()
_gc_holds: set[object] = set()  # one token per paused batch in flight, over every client and thread
_gc_resume = False  # whether the collector was enabled when the first of them began


def _pause_gc() -> object:
    global _gc_resume
    token = object()
    with _gc_lock:
        if not _gc_holds:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_holds.add(token)
    return token


def _release_gc(token: object) -> None:
    """Idempotent: a pause released by its client's close is not released again by its batch."""
    with _gc_lock:
        if token not in _gc_holds:
            return
        _gc_holds.discard(token)
        if not _gc_holds and _gc_resume:
            gc.enable()


@contextlib.contextmanager
def gc_paused(pause: bool = True, held: set | None = None):
    """Pause Python's cyclic garbage collector while a batch is in flight (docs/decisions.md L1).

    Reference counting frees everything not held in a reference cycle, which is every request,
    reply and connection object of a batch (a 1,024-request batch left 0 objects for the
    collector); the collector's passes over them cost 13-20% of the client's CPU at 256 in
    flight. Process-wide, so counted: the collector resumes when the last paused batch ends, and
    only if it was enabled when the first began. `held`: the owner's set of its pauses in flight
    (LiveClient.aclose releases them, so a batch abandoned unfinished cannot keep the collector
    off)."""
    if not pause:
        yield
        return
    token = _pause_gc()
    if held is not None:
        held.add(token)
    try:
        yield
    finally:
        if held is not None:
            held.discard(token)
        _release_gc(token)


async def _all_settled(sends) -> list:
    """Await every send, then raise the first failure: a failed send leaves none of its siblings
    running unowned after `run_batch` returns (their replies are cached, not lost at close)."""
    results = await asyncio.gather(*sends, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


STALL_NOTICE_S = 60.0  # a round's calls outstanding this long: one line on stderr, then every as long


class LiveClient:
    """Async client of the strong and weak servers. Use `async with`, or `start()`/`aclose()`."""

    def __init__(
        self,
        servers: Sequence[ServerGroup],
        cache: ResponseCache | None = None,
        retry: RetryPolicy = RetryPolicy(),
        api_key: str | None = None,
        pause_gc: bool = True,
        stall_notice_s: float = STALL_NOTICE_S,
    ) -> None:
        self.pause_gc = pause_gc
        self.stall_notice_s = stall_notice_s
        self._gc_held: set[object] = set()  # this client's batches holding the collector paused
        self.groups: dict[str, ServerGroup] = {}
        for group in servers:
            if group.role in self.groups:
                raise MeshHealError(f"live backend: two server groups for the {group.role} role")
            self.groups[group.role] = group
        self.cache = cache
        self.retry = retry
        self._api_key = api_key or next(
            (os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), "EMPTY"
        )
        self._servers: dict[str, list[_Server]] = {}
        self._turn: dict[str, int] = {}
        self.model_ids: dict[str, str] = {}
        self.stats = LiveStats()
        self._without_usage: set[str] = set()  # roles whose server sent a reply without usage
        self._jitter = random.Random()
        self._openai = None
        self._post_options: dict = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open one client per base URL and check each server lists its served model name.

        Raises MeshHealError naming the URL when a server is unreachable or serves another name.
        """
        if self._servers:
            return
        self._openai = _import_openai()
        self._post_options = _post_options(self._openai)
        try:
            for role, group in self.groups.items():
                servers = []
                roots = set()
                for url in group.base_urls:
                    n_lanes = min(-(-group.max_in_flight // LANE_CONNECTIONS), MAX_LANES)
                    per_lane = -(-(group.max_in_flight + POOL_HEADROOM) // n_lanes)
                    lanes = []
                    for _ in range(n_lanes):
                        http = _http_client(self._openai, per_lane, self.retry)
                        lanes.append((_sdk_client(self._openai, url, self._api_key, http), http))
                    server = _Server(ServerStats(url, role), lanes, asyncio.Semaphore(group.max_in_flight))
                    servers.append(server)
                    self._servers[role] = servers
                    roots.add(await self._check_server(server, group))
                self._turn[role] = 0
                self.model_ids[role] = self._resolve_model_id(group, roots)
        except BaseException:
            await self.aclose()
            raise

    async def _check_server(self, server: _Server, group: ServerGroup) -> str | None:
        url = server.stats.base_url
        try:
            reply = await server.http.get(
                f"{url}/models",
                headers={"Authorization": f"Bearer {self._api_key}"},
                timeout=self.retry.connect_timeout_s,
            )
        except _transport_errors(server.http) as err:
            raise ServerUnavailableError(
                f"live backend: the {group.role} server at {url} is unreachable or not an HTTP server "
                f"({type(err).__name__}: {_short(err) or 'no detail'}); start it (serving/vllm_pair.sh) or "
                f"fix the {group.role} URL"
            ) from None
        if reply.status_code in (401, 403):
            raise MeshHealError(
                f"live backend: the {group.role} server at {url} refused the API key (HTTP "
                f"{reply.status_code}); set VLLM_API_KEY (or MESHHEAL_API_KEY) to the key it was started with"
            )
        if reply.status_code != 200:
            raise ServerUnavailableError(
                f"live backend: GET {url}/models answered HTTP {reply.status_code}; is this an "
                f"OpenAI-compatible server?"
            )
        try:
            entries = reply.json()["data"]
            # a root that is not text (garbage) names no model: the role's model id must then be given
            names = {str(entry["id"]): _text_or_none(entry.get("root")) for entry in entries}
        except (ValueError, KeyError, TypeError):
            raise ServerUnavailableError(
                f"live backend: GET {url}/models did not return a model list"
            ) from None
        if group.served_name not in names:
            raise MeshHealError(
                f"live backend: the {group.role} server at {url} serves {sorted(names)}, not "
                f"{group.served_name!r}; start it with --served-model-name {group.served_name} or "
                f"give the served name it uses ({group.role}_served_name in a --live-config file)"
            )
        return names[group.served_name]

    def _resolve_model_id(self, group: ServerGroup, roots: set[str | None]) -> str:
        known = {root for root in roots if root}
        if group.model_id:
            hub_ids = {root for root in known if not root.startswith(("/", "."))}  # not a local path
            if hub_ids and hub_ids != {group.model_id}:
                raise MeshHealError(
                    f"live backend: the {group.role} server serves {sorted(hub_ids)} but the {group.role} "
                    f"model id is given as {group.model_id!r}; the response cache is keyed by the real "
                    f"model id, so they must agree"
                )
            return group.model_id
        if len(known) == 1 and None not in roots:
            return known.pop()
        if len(known) > 1:
            raise MeshHealError(
                f"live backend: the {group.role} servers serve different models {sorted(known)}; "
                f"one role must be one model"
            )
        raise MeshHealError(
            f"live backend: the {group.role} server does not say which model it serves; give the "
            f"real model id (e.g. openai/gpt-oss-120b) for the {group.role} role (--{group.role}-model, or "
            f"{group.role}_model in a --live-config file)"
        )

    async def aclose(self) -> None:
        for token in list(self._gc_held):  # a batch abandoned unfinished (its loop stopped)
            _release_gc(token)
        self._gc_held.clear()
        for servers in self._servers.values():
            for server in servers:
                for client, _ in server.lanes:
                    await client.close()
        self._servers = {}

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def server_stats(self) -> list[ServerStats]:
        return [server.stats for servers in self._servers.values() for server in servers]

    # -- a round -----------------------------------------------------------------------------

    async def run_batch(self, requests: Sequence[CallRequest]) -> list[CallResponse]:
        """Send every request of a round at once; one CallResponse per request, in order.

        When some calls fail for good (a server down through every retry, a rejected request),
        the others still run to completion and are cached; then the first failure is raised.
        """
        if not self._servers:
            raise MeshHealError("live backend: LiveClient.start() was not called")
        missing = {r.role for r in requests} - set(self._servers)
        if missing:
            raise MeshHealError(f"live backend: no server configured for role(s) {sorted(missing)}")
        with gc_paused(self.pause_gc, self._gc_held):
            gathered = asyncio.gather(*await self._started(requests), return_exceptions=True)
            # a round stopped by Ctrl-C / SIGTERM ends the gather cancelled or with the stop's exception:
            # read it here, or asyncio prints "exception was never retrieved" after the run's one-line stop
            gathered.add_done_callback(lambda future: future.cancelled() or future.exception())
            try:
                results = await self._noting_stalls(gathered, len(requests))
            finally:
                if self.cache is not None:
                    self.cache.flush()
        failures = [result for result in results if isinstance(result, BaseException)]
        if not failures:
            return list(results)  # type: ignore[arg-type]
        first = failures[0]
        if not isinstance(first, LiveBackendError):
            raise first
        done = len(requests) - len(failures)
        if self.cache is not None:
            kept = f"the {done} completed call(s) and every reply received are saved in {self.cache.path}; re-run to resume"
            if isinstance(first, RequestRejectedError):  # the same request would be refused again
                kept += ", once what the server refused is changed (a rerun sends the same request)"
        else:
            kept = "no response cache is configured, so the received replies are not kept"
        raise type(first)(
            f"{first} [{len(failures)} of {len(requests)} calls of this round failed; {kept}]"
        ) from first

    async def _started(self, requests: Sequence[CallRequest]) -> list[asyncio.Task]:
        """One task per request, each given a turn of the event loop before the next is made. On
        Python 3.11, aiohttp writes a request's body in a task of its own, queued behind every
        task already ready: made all at once, a round's calls were each built before the first
        was written, and every call waited for the whole round's building (0.13-0.2 s for 256
        calls here, benchmarks/live_timeline.py). Made in turn, each call's write follows its
        building (aiohttp on Python 3.12+ writes at once anyway)."""
        tasks: list[asyncio.Task] = []
        try:
            for request in requests:
                tasks.append(asyncio.ensure_future(self._complete(request)))
                await asyncio.sleep(0)
        except BaseException:  # stopped while starting them (Ctrl-C): none is left running unowned
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return tasks

    async def _noting_stalls(self, gathered: asyncio.Future, n: int) -> list:
        """`gathered`'s results; while its calls are outstanding, a line on stderr every
        stall_notice_s saying where they wait (a server that accepts calls but never answers would
        otherwise keep a run silent for request_timeout_s x attempts)."""
        started = time.perf_counter()
        try:
            while not (await asyncio.wait({gathered}, timeout=self.stall_notice_s))[0]:
                where = ", ".join(
                    f"{s.in_flight} at {s.base_url}" for s in self.server_stats() if s.in_flight
                )
                print(f"live: a round of {n} calls still waiting after {time.perf_counter() - started:.0f} s "
                      f"({where or 'between retries'}); each attempt may take {self.retry.request_timeout_s:g} s "
                      "(--request-timeout-s)", file=sys.stderr, flush=True)  # fmt: skip
        except asyncio.CancelledError:
            gathered.cancel()  # as awaiting the gather itself would
            raise
        return gathered.result()

    async def _complete(self, request: CallRequest) -> CallResponse:
        model_id = self.model_ids[request.role]
        n = request.n
        calls = []  # (payload, from_cache, retries)
        first = await self._send(request, n, request.seed)
        calls.append(first)
        payload = first[0]
        choices = list(payload["choices"][:n])
        prompt = _usage(payload, "prompt_tokens")
        prompt_tokens = prompt * max(len(choices), 1)
        prefix_shared = prompt * max(len(choices) - 1, 0)
        completion_tokens = _usage(payload, "completion_tokens")
        cached = _usage(payload, "cached_tokens")
        if 1 < n and len(choices) < n:
            self.stats.n_fallback_calls += n - len(choices)
            extra = await _all_settled(
                self._send(request, 1, request.seed + i) for i in range(len(choices), n)
            )
            for call in extra:
                calls.append(call)
                choices.append(call[0]["choices"][0] if call[0]["choices"] else _MISSING_CHOICE)
                prompt_tokens += _usage(call[0], "prompt_tokens")
                completion_tokens += _usage(call[0], "completion_tokens")
                cached += _usage(call[0], "cached_tokens")
        if not choices:
            choices = [_MISSING_CHOICE]

        texts = [str(choice.get("content") or "") for choice in choices]
        finishes = [str(choice.get("finish_reason") or "") for choice in choices]
        parsed: list[Any] = [None] * n
        status = [PARSE_OK] * n
        failed = []
        for i in range(n):
            ok, parsed[i] = _parse(request.parser, texts[i], finishes[i])
            if not ok:
                failed.append(i)
        if failed:
            self.stats.parse_retries += len(failed)
            retried = await _all_settled(
                self._send(request, 1, request.seed + i + RETRY_SEED_OFFSET) for i in failed
            )
            for i, call in zip(failed, retried):
                calls.append(call)
                choice = call[0]["choices"][0] if call[0]["choices"] else _MISSING_CHOICE
                texts[i] = str(choice.get("content") or "")
                finishes[i] = str(choice.get("finish_reason") or "")
                prompt_tokens += _usage(call[0], "prompt_tokens")
                completion_tokens += _usage(call[0], "completion_tokens")
                cached += _usage(call[0], "cached_tokens")
                ok, value = _parse(request.parser, texts[i], finishes[i])
                if ok:
                    parsed[i], status[i] = value, PARSE_RETRIED
                else:
                    parsed[i], status[i] = request.parser.fallback, PARSE_FAILED
                    self.stats.parse_failures += 1

        self.stats.prompt_tokens += prompt_tokens
        self.stats.completion_tokens += completion_tokens
        self.stats.prefix_shared_tokens += prefix_shared
        return CallResponse(
            texts=tuple(texts),
            parsed=tuple(parsed),
            parse_status=tuple(status),
            finish_reason=tuple(finishes),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prefix_shared_tokens=prefix_shared,
            cached_prompt_tokens=cached,
            latency_s=sum(float(call[0].get("latency_s", 0.0)) for call in calls),
            retries=sum(call[2] for call in calls),
            parse_retries=len(failed),
            http_calls=sum(not call[1] for call in calls),
            from_cache=all(call[1] for call in calls),
            model_id=model_id,
        )

    # -- one HTTP call: cache, then the wire ---------------------------------------------------

    def _params(self, request: CallRequest, n: int, seed: int) -> dict[str, Any]:
        effort = self.groups[request.role].effort_for(self.model_ids[request.role])
        return request_params(request, n, seed, effort)

    async def _send(self, request: CallRequest, n: int, seed: int) -> tuple[dict, bool, int]:
        """(payload, from cache, transport retries) of one HTTP call."""
        params = self._params(request, n, seed)
        if self.cache is None:
            payload, retries = await self._post(request, params)
            return payload, False, retries
        model_id = self.model_ids[request.role]
        key = cache_key(model_id, request.messages, params)
        hit = self.cache.get(key)
        if hit is not None and not _is_stored_reply(hit):
            warnings.warn(MeshHealWarning(
                f"response cache {self.cache.path}: a row holds JSON that is not a reply "
                f"({_short(json.dumps(hit), 80)}); the call is sent again and its reply replaces the row"), stacklevel=2)  # fmt: skip
            hit = None
        if hit is not None and _unfinished(hit) is not None:
            hit = None  # an older version cached the server's failure: sent again, its reply replaces it
        if hit is not None:
            self.stats.cache_hits += 1
            self._note_usage(request.role, hit)
            return hit, True, 0
        payload, retries = await self._post(request, params)
        self.cache.put_soon(key, model_id, payload)
        return payload, False, retries

    def _note_usage(self, role: str, payload: Mapping[str, Any]) -> None:
        """Warn, once per role, of a reply without `usage`: its tokens count 0 in every table."""
        if payload.get("usage") is None and role not in self._without_usage:
            self._without_usage.add(role)
            warnings.warn(MeshHealWarning(
                f"live backend: the {role} server sent a reply without token usage; its tokens count "
                "as 0 (tokens per task, the server-side prefix savings)"), stacklevel=2)  # fmt: skip

    def _first_server(self, role: str) -> int:
        """The index of the server a call starts on: calls take the role's servers in turn (round
        robin), and a call's retries go on to the next ones (attempt k: first + k), so a call on a
        server that has gone down reaches the others on its next attempt (a turn shared by all calls
        would send each retry to the dead server as often as not)."""
        first = self._turn[role]
        self._turn[role] += 1
        return first

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.retry.backoff_cap_s, self.retry.backoff_base_s * 2**attempt)
        delay = self._jitter.uniform(0.0, ceiling)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry.retry_after_cap_s))
        return delay

    async def _post(self, request: CallRequest, params: Mapping[str, Any]) -> tuple[dict, int]:
        openai = self._openai
        group = self.groups[request.role]
        # The body goes out as plain JSON through the SDK's `post` (its documented way to call a
        # route with a body of one's own), and the reply comes back as the server's JSON
        # (`cast_to=object`): the same HTTP request as `chat.completions.create` with these typed
        # arguments, same keys in the same order, headers and auth (tests/test_live.py), without
        # the SDK's two per-call walks: the type-directed transform of the arguments (every
        # message, the review schema) and the `ChatCompletion` model built from the reply, about
        # 0.5 ms of CPU per call between them (benchmarks/README.md, section b).
        body = chat_body(group.served_name, request.messages, params)
        last_error = ""
        tried: list[str] = []
        servers, first = self._servers[request.role], self._first_server(request.role)
        for attempt in range(self.retry.max_retries + 1):
            server = servers[(first + attempt) % len(servers)]
            retry_after = None
            async with server.semaphore:
                server.stats.in_flight += 1
                lane = server.take_lane()
                server.stats.max_in_flight = max(server.stats.max_in_flight, server.stats.in_flight)
                server.stats.sent += 1
                self.stats.http_requests += 1
                started = time.monotonic()
                try:
                    # the HTTP client's timeout bounds each read; this bounds the whole call (a reply
                    # that trickles in would otherwise take as long as it keeps trickling)
                    async with asyncio.timeout(self.retry.request_timeout_s):
                        reply = await server.lanes[lane][0].post(
                            "/chat/completions", cast_to=object, body=body, options=self._post_options
                        )
                    payload = _payload(reply, time.monotonic() - started)
                except TimeoutError:
                    last_error = (
                        f"no whole reply within {self.retry.request_timeout_s:g} s (--request-timeout-s)"
                    )
                # a 200 body labelled JSON that is not JSON (or not UTF-8), or is past json's limits
                # (~1,000 levels deep, 4,300-digit integers); a message this side cannot encode is
                # raised as it is: no server ever saw it
                except (RecursionError, ValueError) as err:
                    if isinstance(err, UnicodeEncodeError):
                        raise
                    last_error = (
                        f"HTTP 200 with a body that is not valid JSON ({type(err).__name__}: {_short(err)})"
                    )
                except openai.RateLimitError as err:
                    retry_after = _retry_after_s(err.response)
                    last_error = "HTTP 429 (rate limited)"
                except openai.APIStatusError as err:
                    if err.status_code < 500:
                        raise RequestRejectedError(
                            f"live backend: the {request.role} server at {server.stats.base_url} "
                            f"rejected a {request.kind} call (stream {request.stream}, t {request.t}, "
                            f"call {request.call_id}) with HTTP {err.status_code}: {_short(err)}"
                        ) from None
                    last_error = f"HTTP {err.status_code}: " + _short(err).removeprefix(
                        f"Error code: {err.status_code} - "
                    )
                except openai.APIConnectionError as err:
                    last_error = f"{type(err).__name__}: {_short(err)}"
                    # what the SDK's "Connection error." stands for: refused, cut short mid-reply...
                    cause = err.__cause__
                    if cause is not None and str(cause):
                        last_error += f" ({type(cause).__name__}: {_short(cause)})"
                else:
                    if payload is not None:
                        self._note_usage(request.role, payload)
                        return payload, attempt
                    # a 200 that is not a chat completion (a proxy's page, a half-written body) or
                    # one the server failed to finish: retried like a 5xx, on the next server of
                    # the role if there is one
                    last_error = "HTTP 200 with " + (
                        _unfinished(reply)
                        or "something that is not a chat completion: " + _short(repr(reply), 200)
                    )
                finally:
                    server.stats.in_flight -= 1
                    server.lane_load[lane] -= 1
            if server.stats.base_url not in tried:
                tried.append(server.stats.base_url)
            if attempt < self.retry.max_retries:
                self.stats.transport_retries += 1
                await asyncio.sleep(self._backoff_s(attempt, retry_after))
        raise ServerUnavailableError(
            f"live backend: the {request.role} server ({', '.join(tried)}) failed "
            f"{self.retry.max_retries + 1} attempts of a {request.kind} call (stream {request.stream}, "
            f"t {request.t}); last error: {last_error}"
        )


_MISSING_CHOICE = {"content": "", "finish_reason": "missing"}
# finish reasons of a reply the server itself failed to finish (vLLM: "abort"; others: "error")
FAILED_FINISH_REASONS = ("abort", "error")
# the order in which the SDK's `chat.completions.create` lays out these fields (after model, messages)
_SDK_BODY_ORDER = (
    "max_completion_tokens",
    "n",
    "reasoning_effort",
    "response_format",
    "seed",
    "temperature",
    "top_p",
)


def request_params(request: CallRequest, n: int, seed: int, reasoning_effort: str | None) -> dict[str, Any]:
    """The sampling parameters of one HTTP call of `request` (the cache key's and the body's)."""
    return {
        "n": n,
        "seed": seed,
        "max_completion_tokens": request.max_completion_tokens,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "response_format": dict(request.response_format) if request.response_format else None,
        "reasoning_effort": reasoning_effort,
    }


def chat_body(served_name: str, messages, params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of a chat completion request, laid out as the SDK's typed `create` lays it
    out (`_SDK_BODY_ORDER`); parameters that are None or "" are not sent."""
    body: dict[str, Any] = {"model": served_name, "messages": list(messages)}
    for key in (*_SDK_BODY_ORDER, *params):
        if key not in body and params.get(key) not in (None, ""):
            body[key] = params[key]
    return body


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _short(err: object, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _usage(payload: Mapping[str, Any], field: str) -> int:
    usage = payload.get("usage") or {}
    return _int(usage.get(field))


def _payload(reply: Any, latency_s: float) -> dict | None:
    """The part of a chat completion's JSON kept (and cached): texts, finish reasons, usage,
    latency; None when `reply` is not a chat completion (not an object with a non-empty list of
    choices) or a choice ended in the server's own failure (FAILED_FINISH_REASONS).
    Missing or null fields read as empty (content ""), as the SDK's models read them. A reply
    without a JSON content type comes from the SDK as its text, read as JSON here."""
    if isinstance(reply, str):
        try:
            reply = json.loads(reply)
        except (ValueError, RecursionError):
            return None
    if not isinstance(reply, Mapping) or not isinstance(reply.get("choices"), list):
        return None
    if _unfinished(reply) is not None:
        return None  # no reply, or the server's own failure: retried, never cached as model output
    choices = [c for c in reply["choices"] if isinstance(c, Mapping)]
    choices.sort(key=lambda choice: _int(choice.get("index")))
    usage = reply.get("usage")
    usage = usage if isinstance(usage, Mapping) else None
    details = usage.get("prompt_tokens_details") if usage is not None else None
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
    return {
        "choices": [
            {"content": _content(choice), "finish_reason": str(choice.get("finish_reason") or "")}
            for choice in choices
        ],
        "usage": None
        if usage is None
        else {
            "prompt_tokens": _int(usage.get("prompt_tokens")),
            "completion_tokens": _int(usage.get("completion_tokens")),
            "cached_tokens": cached,
        },
        "latency_s": latency_s,
    }


def _is_stored_reply(value: Any) -> bool:
    """Whether a response cache row has the form `_payload` writes (an object whose "choices" is a
    list of objects, whose "usage", if there, is an object or null), which is all a reply is read
    through; a row that is JSON but not that (a hand-edited or foreign file) is no cached reply."""
    if not isinstance(value, Mapping) or not isinstance(value.get("choices"), list):
        return False
    usage = value.get("usage")
    return all(isinstance(c, Mapping) for c in value["choices"]) and (
        usage is None or isinstance(usage, Mapping)
    )


def _unfinished(reply: Any) -> str | None:
    """What makes a chat completion (or a cached payload) no reply at all: no choices, or a choice
    the server failed to finish (FAILED_FINISH_REASONS); None for a reply, or for what is not a
    chat completion."""
    choices = reply.get("choices") if isinstance(reply, Mapping) else None
    if not isinstance(choices, list):
        return None
    choices = [c for c in choices if isinstance(c, Mapping)]
    if not choices:
        return "no choices"
    failed = [
        str(c.get("finish_reason")) for c in choices if str(c.get("finish_reason")) in FAILED_FINISH_REASONS
    ]
    return f"a choice the server failed to finish (finish_reason {failed[0]!r})" if failed else None


def _content(choice: Mapping[str, Any]) -> str:
    """A choice's message text; "" when missing, null or not text."""
    message = choice.get("message")
    text = message.get("content") if isinstance(message, Mapping) else None
    return text if isinstance(text, str) else ""


def _int(value: Any) -> int:
    """A token count or index as the server sent it; 0 when missing or not a number."""
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def _parse(parser: ReplyParser, text: str, finish_reason: str) -> tuple[bool, Any]:
    if finish_reason == "length" and not text.strip():
        return False, None
    try:
        return True, parser.parse(text)
    except ReplyParseError:
        return False, None


# ---------------------------------------------------------------------------------------------
# Synchronous wrapper and traces


class SyncLiveClient:
    """LiveClient for a synchronous host loop: one private event loop kept for the whole run
    (the HTTP connections belong to it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self.client = LiveClient(*args, **kwargs)
        try:
            self._runner.run(self.client.start())
        except BaseException:
            self._runner.close()
            raise

    def run_batch(self, requests: Sequence[CallRequest]) -> list[CallResponse]:
        return self._runner.run(self.client.run_batch(requests))

    def close(self) -> None:
        try:
            self._runner.run(self.client.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trace_rows(requests: Sequence[CallRequest], responses: Sequence[CallResponse]) -> list[dict]:
    """One row per call for live_trace.parquet: who, which model, tokens, latency, parse status and
    the parsed score and the client's adjustment of it (reviews) or answer (executions);
    sample-level values joined in order."""
    rows = []
    for request, response in zip(requests, responses, strict=True):
        scores = [getattr(value, "score", None) for value in response.parsed]
        answers = [getattr(value, "answer", None) for value in response.parsed]
        # a review score the client moved (prompts._verdict): "unsupported_low_score" (to 0.5) or
        # "no_final_answer" (capped at 0.25); "" where the reviewer's score stands
        adjustments = [getattr(value, "adjustment", None) for value in response.parsed]
        rows.append(
            {
                "stream": request.stream,
                "t": request.t,
                "call_id": request.call_id,
                "kind": request.kind,
                "agent": request.agent,
                "author": request.author,
                "role": request.role,
                "model_id": response.model_id,
                "n": request.n,
                "prompt_tokens": response.prompt_tokens,
                "completion_tokens": response.completion_tokens,
                "prefix_shared_tokens": response.prefix_shared_tokens,
                "cached_prompt_tokens": response.cached_prompt_tokens,
                "latency_s": response.latency_s,
                "retries": response.retries,  # transport retries: a flaky server shows here
                "parse_status": ",".join(response.parse_status),
                "parse_failures": response.parse_failures,
                "scores": None
                if all(s is None for s in scores)
                else [math.nan if s is None else s for s in scores],
                "answers": None if all(a is None for a in answers) else answers,
                "adjustments": None if all(a is None for a in adjustments) else adjustments,
                "from_cache": response.from_cache,
            }
        )
    return rows
