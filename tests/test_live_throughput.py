"""benchmarks/live_throughput.py: the fixed-latency stand-in and the stand-in-only sections (a-d) in
quick mode, no tiny model server. Behaviour, not timing: table structure, counts that must add up
(every request sent is one the stand-in received, in-flight never above the semaphore, n=3 vs
three requests), never a speed."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from meshheal_jax import prompts
from meshheal_jax.topology import load_profile

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "live_throughput.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("live_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lt = _load_bench()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run of the stand-in sections a, b, c, d, f (a small live runner in c, two baselines
    live in f), as a user runs it."""
    out = tmp_path_factory.mktemp("live-throughput") / "tables.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--sections", "a,b,c,d,f", "--no-tiny-server", "--in-flight", "64",
           "--agents", "12", "--tasks", "24", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_table_has_its_columns(quick_run):
    result, stdout = quick_run
    assert set(result["tables"]) == {"a", "b", "c", "d", "f"}
    for name, table in result["tables"].items():
        assert table["columns"] == lt.COLUMNS[name]
        assert table["rows"], name
        for row in table["rows"]:
            assert set(row) == set(lt.COLUMNS[name]), name
            assert all(v is not None for v in row.values())
        assert f"### {table['title']}" in stdout
    floor = result["tables"]["b"]["floor"]  # the SDK's CPU per call on an in-process transport
    assert floor["columns"] == lt.COLUMNS["b_floor"] and len(floor["rows"]) == 2
    assert all(set(row) == set(floor["columns"]) and row["cpu_ms_per_call"] > 0 for row in floor["rows"])
    assert f"### {floor['title']}" in stdout
    assert (
        result["machine"]["cores"] >= 1 and result["latency_s"] == 0.2 and result["ratio_latency_s"] == 0.05
    )
    # the targets are reported, but a quick run is not the configuration they are stated for
    assert [c["applies"] for c in result["targets"]] == [False] * 4
    assert stdout.count("not evaluated (another configuration)") == 4


def test_a_requests_counted_and_in_flight_bounded(quick_run):
    rows = quick_run[0]["tables"]["a"]["rows"]
    assert [r["semaphore"] for r in rows] == [1, 16, 64, 256]
    for r in rows:
        assert r["sent"] == r["requests"] == r["server_received"] == 2 * r["semaphore"]
        assert 1 <= r["client_max_in_flight"] <= r["semaphore"]
        assert 1 <= r["server_max_in_flight"] <= r["semaphore"]
        assert 0 < r["server_mean_in_flight"] <= r["server_max_in_flight"] + 1e-9
        assert r["ideal_s"] == pytest.approx(2 * 0.2)
        assert r["wall_s"] >= r["ideal_s"] * 0.99  # nothing answers faster than its latency
        assert r["host_overhead"] == pytest.approx((r["wall_s"] - r["ideal_s"]) / r["wall_s"])
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"])
    assert rows[0]["client_max_in_flight"] == rows[0]["server_max_in_flight"] == 1


def test_b_every_client_variant_sent_everything(quick_run):
    rows = quick_run[0]["tables"]["b"]["rows"]
    assert (
        len(rows) == 5
        and rows[0]["client"] == "LiveClient, no cache"
        and "pause_gc=False" in rows[1]["client"]
    )
    for r in rows:
        assert isinstance(r["cyclic_garbage"], int) and r["cyclic_garbage"] >= 0
        assert r["requests"] == r["server_received"] == 2 * 64
        assert 1 <= r["client_max_in_flight"] <= 64 and 1 <= r["server_max_in_flight"] <= 64
        assert r["cpu_s"] > 0 and r["cpu_ms_per_call"] == pytest.approx(1e3 * r["cpu_s"] / r["requests"])
        # grouped cache writes: every reply written, at least one per commit; no cache, no figure
        assert math.isnan(r["replies_per_commit"]) == ("ResponseCache" not in r["client"])
    assert 1 <= rows[2]["replies_per_commit"] <= rows[2]["requests"]
    no_cache, cache = quick_run[0]["targets"][:2]
    assert no_cache["value"] == rows[0]["host_overhead"] and "no cache" in no_cache["target"]
    assert cache["value"] == rows[2]["host_overhead"] and "ResponseCache" in cache["target"]


def test_c_batched_runner_and_its_sequential_equivalent(quick_run):
    (row,) = quick_run[0]["tables"]["c"]["rows"]
    assert (row["streams"], row["agents"], row["slots"], row["tasks"]) == (1, 12, 2, 24)
    assert row["requests"] == row["http_calls"] > row["tasks"]  # the stand-in honours n, every reply parses
    assert row["requests_per_round"] == pytest.approx(row["requests"] / row["rounds"])
    assert row["sequential_s"] == pytest.approx(row["http_calls"] * 0.05)
    assert row["ideal_batched_s"] == pytest.approx(row["rounds"] * 0.05)
    assert row["ratio"] == pytest.approx(row["sequential_s"] / row["wall_s"])
    # model calls count each initial review sample apart: more than the requests, at most 3 per request
    assert row["requests"] < row["model_calls"] <= 3 * row["requests"]
    assert row["ratio_calls"] == pytest.approx(row["model_calls"] * 0.05 / row["wall_s"])
    assert [t["value"] for t in quick_run[0]["targets"][2:]] == [row["ratio"], row["ratio_calls"]]
    assert row["wall_excl_compile_s"] <= row["wall_s"] and row["in_run_batch_s"] < row["wall_s"]
    assert 1 <= row["server_max_in_flight"] <= 3 * row["slots"]  # at most 3 calls per slot per round


def test_f_baselines_send_each_call_site_of_both_streams_together(quick_run):
    rows = {r["method"]: r for r in quick_run[0]["tables"]["f"]["rows"]}
    assert set(rows) == {"raps", "sac"}
    for row in rows.values():
        assert (row["streams"], row["tasks"]) == (2, 84)
        assert row["requests"] == row["http_calls"]  # one HTTP call per request (n = 1, no cache)
        assert row["requests_per_batch"] == pytest.approx(row["requests"] / row["batches"])
        assert row["sequential_s"] == pytest.approx(row["http_calls"] * 0.05)
        assert row["ideal_batched_s"] == pytest.approx(row["batches"] * 0.05)
        assert row["in_run_batch_s"] < row["wall_s"]
    assert rows["raps"]["requests_per_batch"] == 2.0  # one call per site and stream, both streams at once
    assert rows["raps"]["requests"] == 84 * 4  # infer, contribute, watchdog, finalize on every BBH task
    assert rows["sac"]["max_batch"] == 12  # a round's evaluations: 3 teams x 2 others x 2 streams


def test_d_n3_is_one_request_with_the_same_counted_tokens(quick_run):
    rows = {r["variant"]: r for r in quick_run[0]["tables"]["d"]["rows"]}
    one, three = rows["one request, n=3"], rows["three requests, n=1"]
    assert one["server"] == three["server"] == "stand-in"
    assert one["samples"] == three["samples"] == 3 * 32
    assert (one["http_calls"], three["http_calls"]) == (32, 96)
    assert one["n_fallback_calls"] == three["n_fallback_calls"] == 0
    assert one["parse_failures"] == three["parse_failures"] == 0
    # counted as the paper counts: the prompt once per sample either way; the server prefilled it once
    assert one["prompt_tokens_counted"] == three["prompt_tokens_counted"] == three["prompt_tokens_prefilled"]
    assert one["prompt_tokens_prefilled"] * 3 == three["prompt_tokens_prefilled"]
    assert one["prefill_shared_tokens"] == one["prompt_tokens_counted"] - one["prompt_tokens_prefilled"]
    assert one["completion_tokens"] == three["completion_tokens"]


# ----------------------------------------------------------------------------------------------
# The stand-in itself


def test_stand_in_replies_parse_with_the_project_parsers():
    pairs = lt._profile_pairs()
    profile = load_profile("bbh")
    task_type = profile.task_types[0]
    infer = {"messages": [{"role": "user", "content": f"...\nTask type: {task_type}\nmore"}],
             "response_format": prompts.inference_response_format(profile)}  # fmt: skip
    strong = prompts.inference_parser(profile, task_type).parse(lt.stand_in_reply("strong", infer, pairs))
    weak = prompts.inference_parser(profile, task_type).parse(lt.stand_in_reply("weak", infer, pairs))
    assert strong == prompts.documented_pair(profile, task_type) and weak != strong
    for stage in ("contribute", "finalize"):
        for judged, role, score in (
            ("fine", "strong", 1.0),
            (lt.WEAK_MARK, "strong", 0.25),
            ("fine", "weak", 0.5),
        ):
            body = {"messages": [{"role": "user", "content": f"Output under review:\n<<<\n{judged}\n>>>\n"}],
                    "response_format": prompts.review_response_format(stage)}  # fmt: skip
            assert prompts.review_parser(stage).parse(lt.stand_in_reply(role, body, pairs)).score == score
    final = {"messages": [{"role": "user", "content": "Question"}]}
    reply = prompts.execution_parser("bbh").parse(lt.stand_in_reply("strong", final, pairs))
    assert reply.answer is not None


def test_stand_in_honours_n_and_counts_requests():
    import openai

    with lt.FixedLatencyStandIn(latency_s=0.05) as stand_in:
        client = openai.OpenAI(base_url=stand_in.url, api_key="EMPTY", max_retries=0)
        models = {m.id: m.model_dump().get("root") for m in client.models.list().data}
        assert models == lt.STAND_IN_ROOTS
        stand_in.reset(0.01)
        reply = client.chat.completions.create(
            model="weak", messages=[{"role": "user", "content": "x" * 40}], n=3
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.usage.prompt_tokens == 11 and reply.usage.completion_tokens % 3 == 0
        stats = stand_in.stats()
        assert (stats["requests"], stats["samples"], stats["max_in_flight"], stats["in_flight_now"]) == (
            1,
            3,
            1,
            0,
        )
        assert stats["latency_s"] == 0.01 and stats["prefill_tokens"] * 3 == stats["prompt_tokens"]
        assert math.isclose(stats["mean_in_flight"], 1.0, rel_tol=1e-6)
        client.close()
    assert stand_in.proc.poll() is not None  # the child process is gone
