"""The live client against a REAL OpenAI-compatible server: `transformers serve` on a tiny
random-weight Llama built here (tokenizer trained locally, 2 layers of width 64), on CPU, offline.
Real HTTP, real chat templates and tokenization, real usage counts. Its replies are garbage, which
is the point: parse failures and their retries, the n=3 fallback (this server ignores `n` and
`response_format`), exact token accounting, the response cache and resuming an interrupted round.

Marked `server` (deselect with `-m "not server"`); skipped with the reason when torch or
`transformers serve` is not installed (`pip install -e .[test]` brings both)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from meshheal_jax import prompts
from meshheal_jax.backends import tiny_server as tiny
from meshheal_jax.backends.cache import ResponseCache
from meshheal_jax.backends.live import (
    PARSE_FAILED,
    PARSE_OK,
    CallRequest,
    LiveClient,
    RetryPolicy,
    ServerGroup,
    request_seed,
)

FAST_RETRY = RetryPolicy(max_retries=2, backoff_base_s=0.05, backoff_cap_s=0.2, request_timeout_s=60.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


# ----------------------------------------------------------------------------------------------
# A real OpenAI-compatible server: `transformers serve` on a tiny random-weight Llama (CPU, offline)

TINY_MAX_TOKENS = 4  # CPU decoding through transformers serve costs ~40 ms a token


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    reason = tiny.unavailable()
    if reason is not None:
        pytest.skip(f"the real-server test needs transformers[serving] and torch: {reason}")
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    tiny.build_tiny_llama(model_dir)
    try:
        # continuous batching serves a round's concurrent requests together, and one torch thread
        # keeps the server from fighting the client and the other test worker for the two cores. Its
        # start-up (imports, model load) took over 120 s once, with the suite's two workers sharing
        # the cores with a third busy process (CI91): 300 s, a wait that costs nothing when it starts
        with tiny.serve_tiny(model_dir, ["--continuous-batching"], timeout_s=300, threads=1) as base_url:
            yield base_url, model_dir
    except RuntimeError as err:
        pytest.fail(str(err))


def tiny_round(model_dir: Path) -> list[CallRequest]:
    """One round of a live run on two real BBH questions: inference, execution, initial review
    (n=3) and committee round 2, built by the real prompt builders."""
    from meshheal_jax import data
    from meshheal_jax.topology import load_profile

    profile = load_profile("bbh")
    requests = []
    for t, record in enumerate(data.load_sample("bbh")[:2]):
        task = prompts.TaskText("bbh", record.question, record.task_type, record.options)
        held = prompts.abilities_of(
            profile, [profile.requires[profile.task_types.index(record.task_type)][0]]
        )
        seeds = [request_seed(11, 0, t, call) for call in range(4)]
        base = {"stream": 0, "t": t, "role": "weak", "max_completion_tokens": TINY_MAX_TOKENS, "agent": 3}
        requests += [
            CallRequest(
                **base, call_id=0, kind="infer", seed=seeds[0],
                messages=prompts.inference_messages(profile, record.question, record.task_type),
                response_format=prompts.inference_response_format(profile),
                parser=prompts.inference_parser(profile, record.task_type),
            ),
            CallRequest(
                **base, call_id=1, kind="generate", seed=seeds[1],
                messages=prompts.execution_messages(task, held, "partial", "contribute"),
                parser=prompts.execution_parser("bbh"),
            ),
            CallRequest(
                **base, call_id=2, kind="review", seed=seeds[2], n=3, author=1,
                messages=prompts.review_messages(task, "contribute", "I count 8.\nRESULT: 8", held, held),
                response_format=prompts.review_response_format("contribute"),
                parser=prompts.review_parser("contribute"),
            ),
            CallRequest(
                **base, call_id=3, kind="committee2", seed=seeds[3], author=1,
                messages=prompts.committee_round2_messages(
                    task, "contribute", "I count 8.\nRESULT: 8", held, held,
                    own=prompts.RoundOneView(0.25, "Lamps are not instruments."),
                    other=prompts.RoundOneView(1.0, "Correct."),
                ),
                response_format=prompts.review_response_format("contribute"),
                parser=prompts.review_parser("contribute"),
            ),
        ]  # fmt: skip
    return requests


@pytest.mark.server
def test_real_transformers_server_end_to_end(tiny_server, tmp_path):
    from transformers import AutoTokenizer

    base_url, model_dir = tiny_server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    group = ServerGroup(
        "weak", (base_url,), model_id=tiny.TINY_MODEL_ID, served_name=str(model_dir), max_in_flight=4
    )
    requests = tiny_round(model_dir)
    half = [r for r in requests if r.t == 0]
    cache_path = tmp_path / "responses.sqlite"

    async def one_run(batch):
        with ResponseCache(cache_path) as cache:
            async with LiveClient([group], cache=cache, retry=FAST_RETRY) as client:
                responses = await client.run_batch(batch)
                return responses, dataclasses.replace(client.stats)

    # A run interrupted after the first task's calls, then resumed: only the second task's are sent.
    partial, stats1 = run(one_run(half))
    full, stats2 = run(one_run(requests))
    assert [r.from_cache for r in full] == [q.t == 0 for q in requests]
    assert stats2.http_requests == sum(r.http_calls for r, q in zip(full, requests, strict=True) if q.t == 1)
    fresh = partial + [r for r, q in zip(full, requests, strict=True) if q.t == 1]
    for request, response in zip(requests, fresh, strict=True):
        rendered = tokenizer.apply_chat_template(
            list(request.messages), add_generation_prompt=True, return_dict=True
        )
        prompt = len(rendered["input_ids"])  # what the server's usage must report per call
        if request.kind == "review":
            # the server ignores n: two more requests (seed + 1, + 2); garbage JSON: three retries
            assert response.parse_status == (PARSE_FAILED,) * 3 and response.scores == (0.5, 0.5, 0.5)
            assert response.http_calls == 6 and response.prompt_tokens == 6 * prompt
        elif request.kind == "committee2":
            assert response.parse_status == (PARSE_FAILED,) and response.scores == (0.5,)
            assert response.http_calls == 2 and response.prompt_tokens == 2 * prompt
        elif request.kind == "infer":
            assert response.parse_status == (PARSE_FAILED,)
            assert response.parsed[0] == request.parser.fallback  # the documented pair of the task type
            assert response.prompt_tokens == 2 * prompt
        elif response.parse_status == (PARSE_OK,):  # random text is still an execution reply, without answer
            assert response.http_calls == 1 and response.prompt_tokens == prompt
            assert response.parsed[0].text == response.texts[0] and response.parsed[0].answer is None
        assert 0 < response.completion_tokens <= TINY_MAX_TOKENS * response.http_calls
        assert response.model_id == tiny.TINY_MODEL_ID and not response.from_cache
    assert (stats1.n_fallback_calls, stats2.n_fallback_calls) == (2, 4)  # logical counts include cache hits
    assert stats2.parse_failures >= 2 * (3 + 1 + 1)

    # The same round again: everything from the cache, nothing sent, identical results.
    again, stats3 = run(one_run(requests))
    assert stats3.http_requests == 0 and all(r.from_cache for r in again)
    assert [r.texts for r in again] == [r.texts for r in fresh]
    assert [r.parsed for r in again] == [r.parsed for r in fresh]
    assert [(r.prompt_tokens, r.completion_tokens) for r in again] == [
        (r.prompt_tokens, r.completion_tokens) for r in fresh
    ]


@pytest.mark.server
def test_live_experiment_through_the_real_server(tiny_server, tmp_path):
    """`python -m meshheal_jax.main --backend live` end to end through `transformers serve` (both
    roles on the one tiny model): real HTTP, tokenization and usage; garbage replies recorded as
    parse failures; then the same command again resends nothing and reproduces the run."""
    base_url, model_dir = tiny_server
    config = tmp_path / "live.toml"
    config.write_text(
        f'strong_url = ["{base_url}"]\nweak_url = ["{base_url}"]\nstrong_served_name = "{model_dir}"\n'
        f'weak_served_name = "{model_dir}"\nstrong_model = "{tiny.TINY_MODEL_ID}"\nweak_model = "{tiny.TINY_MODEL_ID}"\n'
        f'max_tokens = {TINY_MAX_TOKENS}\ndata = "sample"\nmax_in_flight = 8\n'
    )
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "meshheal_jax.main", "--backend", "live", "--live-config", str(config),
            "--methods", "meshheal", "--datasets", "bbh", "--seeds", "1", "--tasks", "42", "--quiet",
            "--out", str(out)]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    import polars as pl

    tasks = pl.read_parquet(out / "tasks.parquet")
    calls = pl.read_parquet(out / "calls.parquet")
    trace = pl.read_parquet(out / "live-default" / "live_trace.parquet")
    assert tasks.height == 42 and calls.height == tasks["calls"].sum()
    assert (calls["completion_tokens"] <= TINY_MAX_TOKENS * 6).all()  # review: up to 3 retries x n fallback
    assert calls["parse_status"].str.contains("failed").any()  # random text is not a review JSON
    assert trace["prompt_tokens"].sum() == calls["prompt_tokens"].sum()  # usage split exactly over samples
    assert not trace["from_cache"].any()

    import shutil

    shutil.rmtree(out / "parts")  # as if it had died before finishing the stream
    again = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    replay = pl.read_parquet(out / "live-default" / "live_trace.parquet")  # appended to the first
    assert replay.height == 2 * trace.height and replay.head(trace.height).equals(trace)
    assert replay.tail(trace.height)["from_cache"].all()  # nothing was sent again
    assert pl.read_parquet(out / "tasks.parquet").equals(tasks)


def test_a_baseline_through_the_real_server(tiny_server, tmp_path):
    """AutoGen (manager selection, worker generations, composition) live on 12 BBH tasks: real
    HTTP and tokenization; the tiny model's text is never a valid choice, so every selection
    falls back to the emulator's failure branch (a uniform worker) after its retry."""
    import polars as pl
    from test_live_baselines import bbh_specs

    from meshheal_jax.backends.live_baselines import live_baseline_tables
    from meshheal_jax.backends.live_loop import LiveConfig, LiveOptions
    from meshheal_jax.data import load_sample

    base_url, model_dir = tiny_server
    groups = tuple(ServerGroup(role, (base_url,), model_id=tiny.TINY_MODEL_ID, served_name=str(model_dir),
                               max_in_flight=8) for role in ("strong", "weak"))  # fmt: skip
    options = LiveOptions(
        max_completion_tokens=dict.fromkeys(LiveOptions().max_completion_tokens, TINY_MAX_TOKENS)
    )
    rows = live_baseline_tables("autogen", bbh_specs((0,)), "default", LiveConfig(groups, retry=FAST_RETRY),
                                load_sample("bbh"), run_dir=tmp_path, options=options)  # fmt: skip
    calls = pl.DataFrame(rows[0]["calls"], infer_schema_length=None)
    trace = pl.read_parquet(tmp_path / "live_trace.parquet")
    assert len(rows[0]["tasks"]) == 12 and calls.height == trace.height
    assert calls["prompt_tokens"].sum() == trace["prompt_tokens"].sum() > 0  # real usage, per call
    assert (calls.filter(pl.col("kind") == "select")["parse_status"] == "failed").all()
    assert set(calls["model"].unique()) == {tiny.TINY_MODEL_ID}


# A stand-in for the `transformers` command (not a model server): it binds the port it is given
# and answers /health, or exits as transformers serve does when the port is taken.
FAKE_SERVE = """#!PYTHON
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    sys.exit(f"ERROR: [Errno 98] error while attempting to bind on address: address already in use ({e})")
server.serve_forever()
"""


def test_the_tiny_server_takes_another_port_when_its_port_is_taken(tmp_path, monkeypatch):
    import socket
    import urllib.request

    exe = tmp_path / "transformers"
    exe.write_text(FAKE_SERVE.replace("PYTHON", sys.executable))
    exe.chmod(0o755)
    monkeypatch.setattr(tiny, "transformers_command", lambda: str(exe))
    with socket.socket() as taken:  # another process got the picked port first
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks, free = iter([busy]), tiny.free_port
        monkeypatch.setattr(tiny, "free_port", lambda: next(picks, None) or free())
        with tiny.serve_tiny(tmp_path / "model", timeout_s=30) as url:
            assert f":{busy}/" not in url
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as reply:
                assert reply.status == 200
    assert "address already in use" in (tmp_path / f"transformers-serve-{busy}.log").read_text()
