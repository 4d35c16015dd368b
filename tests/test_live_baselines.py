"""The baselines' live backend (meshheal_jax.backends.live_baselines): each baseline's compiled
program with its calls answered by a client, batched over streams.

Most tests use a SCRIPTED IN-PROCESS CLIENT (`ScriptedClient`, NOT a model, no HTTP): it answers
each CallRequest from its prompt text. The strong model answers with the gold, the weak one
with a wrong answer of its own ("zzz" + the request seed, so two weak answers never agree); a
Contribute review (RAPS watchdog) is 0.25 for an output written by the weak model and 1.0
otherwise; a router / manager names the lowest-numbered candidate; an SAC evaluation scores its
own answer 1.0 and another 0.25 when it is a weak answer. The last tests go through real sockets
and the real openai client against the scripted HTTP stand-ins of test_live_loop.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import polars as pl
import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

import tyro
from test_live_loop import PROFILE, RECORDS, stand_ins  # the scripted HTTP stand-ins

from meshheal_jax import main, prompts
from meshheal_jax.backends.live import CallResponse, ServerUnavailableError
from meshheal_jax.backends.live_baselines import (
    LiveBaselineHost,
    call_site,
    live_baseline_tables,
    run_live_baselines,
)
from meshheal_jax.baselines import BaselineSpec, raps, symphony
from meshheal_jax.baselines import common as C
from meshheal_jax.baselines import run as R
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import Stream, make_stream, persistent_schedule
from meshheal_jax.topology import build_network

pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.data.QuestionPoolWarning")

N_TASKS = 12
DEGRADED_FROM = 7
STRONG_ID, WEAK_ID = "scripted-strong", "scripted-weak"
KINDS = {
    "raps": {"infer", "generate", "watchdog"}, "agentnet": {"infer", "generate", "router"},
    "autogen": {"infer", "select", "generate", "compose"}, "sac": {"infer", "generate", "evaluate", "refine"},
    "symphony": {"infer", "generate", "cot"},
}  # fmt: skip


def _gold(content: str) -> str:
    for record in RECORDS:
        if record.question.strip() in content:
            return record.gold
    raise AssertionError("scripted client: no sample question in the prompt")


class ScriptedClient:
    """An in-process scripted client (NOT a model): `run_batch` answers from the prompt text."""

    def __init__(self, fail_at: int | None = None, all_wrong: bool = False) -> None:
        self.batches: list[list] = []
        self.fail_at = fail_at
        self.all_wrong = all_wrong  # every model answers wrong, each in its own way

    def reply(self, request) -> str:
        content = request.messages[-1]["content"]
        fmt = (request.response_format or {}).get("json_schema", {}).get("name")
        if fmt == "ability_pair":
            task_type = content.rsplit("Task type: ", 1)[1].split("\n", 1)[0].strip()
            pair = PROFILE.requires[PROFILE.task_types.index(task_type)]
            return json.dumps({"abilities": [PROFILE.abilities[a] for a in pair]})
        if fmt == "contribute_review":
            judged = content.split("Output under review:\n<<<\n", 1)[1].split("\n>>>", 1)[0]
            return prompts.review_reply(0.25 if "zzz" in judged else 1.0, "contribute", evidence="zzz")
        if fmt == "agent_choice":
            return json.dumps(
                {
                    "agent": min(
                        request.response_format["json_schema"]["schema"]["properties"]["agent"]["enum"]
                    )
                }
            )
        if fmt == "answer_evaluation":
            other = content.split("Another team's answer:\n<<<\n", 1)[1].split("\n>>>", 1)[0]
            return json.dumps({"own_score": 1.0, "other_score": 0.25 if "zzz" in other else 1.0,
                               "one_sentence_reason": "."})  # fmt: skip
        if request.role == "weak" or self.all_wrong:
            return f"COMPETENCE_MATCH:partial\nRESULT: zzz{request.seed}"
        return f"COMPETENCE_MATCH:yes\nRESULT: {_gold(content)}"

    def run_batch(self, requests):
        self.batches.append(list(requests))
        if self.fail_at is not None and len(self.batches) >= self.fail_at:
            raise ServerUnavailableError("scripted client: the strong server went away")
        out = []
        for r in requests:
            text = self.reply(r)
            out.append(CallResponse((text,), (r.parser.parse(text),), ("ok",), ("stop",), 100 + r.call_id % 7, 10, 0, 0,
                                    0.01, 0, 0, 1, False, STRONG_ID if r.role == "strong" else WEAK_ID))  # fmt: skip
        return out


def bbh_specs(seeds=(0, 1)) -> list[BaselineSpec]:
    """6 agents, complete graph, the first 12 tasks of BBH streams; A3/A5 degraded from task 7."""
    out = []
    for seed in seeds:
        full = make_stream(seed, PROFILE.dataset_id, 42, 7, (1, 22), ("healthy", "degraded"))
        phase = (np.arange(1, N_TASKS + 1) >= DEGRADED_FROM).astype(np.int32)
        stream = Stream(seed, PROFILE.dataset_id, full.task_type[:N_TASKS], full.question[:N_TASKS], phase,
                        ("healthy", "degraded"))  # fmt: skip
        schedule = persistent_schedule(6, N_TASKS, (2, 4))
        out.append(
            BaselineSpec(build_network(PROFILE, 6), stream, schedule, {"dataset": "bbh", "seed": seed})
        )
    return out


@pytest.fixture(scope="module")
def runs():
    """Every baseline, two streams, against the scripted client."""
    out = {}
    for method in KINDS:
        client = ScriptedClient()
        out[method] = (client, run_live_baselines(method, bbh_specs(), "default", client, RECORDS))
    return out


@pytest.mark.parametrize("method", list(KINDS))
def test_every_call_is_one_request_and_streams_share_batches(runs, method):
    client, frames = runs[method]
    calls = pl.concat([f["calls"] for f in frames])
    sent = [r for batch in client.batches for r in batch]
    assert calls.height == len(sent)  # one request per recorded call, none sent for a masked call
    assert set(calls["kind"].unique()) <= KINDS[method]
    assert {"infer", "generate"} <= set(calls["kind"].unique())
    # the calls of one call site of BOTH streams went out in one batch
    assert max(len({r.stream for r in batch}) for batch in client.batches) == 2
    # the calls table carries the real model id and the request's latency
    assert set(calls["model"].unique()) <= {STRONG_ID, WEAK_ID} and (calls["latency_s"] == 0.01).all()
    by_seed = {f["tasks"]["seed"][0]: f for f in frames}
    for s, frame in enumerate(by_seed[k] for k in (0, 1)):
        mine = [r for r in sent if r.stream == s]
        assert frame["calls"]["prompt_tokens"].sum() == sum(100 + r.call_id % 7 for r in mine)
        assert frame["tasks"].height == N_TASKS


@pytest.mark.parametrize("method", list(KINDS))
def test_models_follow_the_model_backed_rule_and_answers_are_judged(runs, method):
    _, frames = runs[method]
    holds = build_network(PROFILE, 6).holds
    # decisions B0: these kinds follow the model-backed rule on their ability (watchdog and
    # evaluate under judge_rule "ability"), the others are tied to no ability
    ability_bound = {"generate", "cot", "refine", "watchdog", "evaluate"}
    for frame in frames:
        calls = frame["calls"]
        for row in calls.iter_rows(named=True):  # every kind, as the emulated test checks them
            degraded = row["t"] >= DEGRADED_FROM and row["agent"] in (2, 4)
            held = row["kind"] not in ability_bound or bool(holds[row["agent"], row["ability"]])
            strong = not degraded and held
            assert row["model"] == (STRONG_ID if strong else WEAK_ID), row
            if row["kind"] in ("generate", "cot") and row["answer_id"] is not None:
                assert (row["answer_id"] == 0) == strong  # the script's gold is id 0, a weak answer not
        tasks = frame["tasks"]
        assert not (tasks["correct"] & ~tasks["answered"]).any()  # AgentNet may run out of forwards


def test_a_strong_network_is_right_and_degraded_writers_are_not(runs):
    # RAPS: a task is correct iff its finalizer used the strong model (the script's answers)
    _, frames = runs["raps"]
    for frame in frames:
        finals = frame["calls"].filter(pl.col("answer_id").is_not_null()).sort("t")
        assert frame["tasks"].sort("t")["correct"].to_list() == (finals["model"] == STRONG_ID).to_list()


def test_raps_watchdog_scores_drive_the_beta_posterior():
    specs = bbh_specs((0,))
    client = ScriptedClient()
    host = LiveBaselineHost(specs, RECORDS, client)
    states, outs = R.simulate("raps", specs, "default", live=host)
    params = raps.RAPSParams()
    x = np.full((6, 6), params.prior_x)
    y = np.full((6, 6), params.prior_y)
    watched = 0
    for k in range(N_TASKS):
        c = jax_tree_at(outs.calls, 0, k)
        for slot in np.flatnonzero(c.valid & (c.kind == C.K_WATCHDOG)):
            request = host.trace[int(c.request[slot])]
            assert request["kind"] == "watchdog" and request["scores"] == [c.score[slot]]
            s = float(c.score[slot] <= params.watchdog_threshold + C.TOL)
            o, a = int(c.agent[slot]), int(c.author[slot])
            x[o, a], y[o, a] = params.lam * x[o, a] + s, params.lam * y[o, a] + (1 - s)
            watched += 1
    assert watched > 0
    np.testing.assert_allclose(states.x[0], x)
    np.testing.assert_allclose(states.y[0], y)


def jax_tree_at(tree, *index):
    import jax

    return jax.tree_util.tree_map(lambda v: v[index], tree)


def test_agentnet_forwards_to_the_neighbour_the_router_names(runs):
    _, frames = runs["agentnet"]
    for frame in frames:
        tasks = frame["tasks"].sort("t")
        routers = frame["calls"].filter(pl.col("kind") == "router")
        first = tasks.row(0, named=True)
        route = [int(a) for a in first["route"].split("-")]
        named = routers.filter(pl.col("t") == 1).sort("visit")
        # on the complete graph nothing is pruned yet: the script names the lowest other agent
        for v, agent in enumerate(named["agent"].to_list()):
            assert route[v] == agent and route[v + 1] == min(a for a in range(6) if a != agent)


def test_autogen_manager_names_the_worker_and_composes_the_answer(runs):
    _, frames = runs["autogen"]
    holds = build_network(PROFILE, 6).holds
    for frame in frames:
        calls = frame["calls"]
        selects = calls.filter(pl.col("kind") == "select")
        assert (selects["agent"] == 2).all()  # A3 is the manager
        for row in frame["tasks"].iter_rows(named=True):
            route = [int(a) for a in row["route"].split("-")]
            assert route[0] == 2 and route[1] == 0 and route[3] == 0  # the lowest worker, named each time
            mine = selects.filter(pl.col("t") == row["t"])
            # a retry is asked exactly when the named worker does not hold the ability
            expected = sum(
                1 + (not holds[0, a]) for a in mine["ability"].unique(maintain_order=True).to_list()
            )
            assert mine.height == expected
        composed = calls.filter(pl.col("kind") == "compose").sort("t")
        assert composed["answer_id"].is_not_null().all()
        assert frame["tasks"].sort("t")["correct"].to_list() == (composed["answer_id"] == 0).to_list()


def test_sac_evaluations_filter_and_the_vote_counts_refined_answers(runs):
    client, frames = runs["sac"]
    sent = [r for batch in client.batches for r in batch]
    evaluations: dict[tuple, list] = {}
    for r in sent:
        if r.kind == "evaluate":
            site = call_site(r.call_id)
            evaluations.setdefault((r.stream, r.t, site["execution"], site["round"]), []).append(r)
    refines = [r for r in sent if r.kind == "refine"]
    assert len(refines) == 2 * N_TASKS * 3 * 2  # streams x tasks x teams x rounds
    for r in refines:
        site = call_site(r.call_id)
        mine = evaluations[(r.stream, r.t, site["execution"], site["round"])]
        weak = sum("zzz" in q.messages[-1]["content"].split("Another team's answer:")[1] for q in mine)
        kept = r.messages[-1]["content"].split("Other teams' answers you kept after evaluation:")[1]
        # a weak answer scores 0.25 < the anchor 1.0; at most F = 1 is dropped (ties: the later team)
        assert kept.count("[Answer ") == len(mine) - (weak > 0)
        assert kept.count("zzz") == max(0, weak - 1)
    for frame in frames:
        calls = frame["calls"]
        assert set(calls.filter(pl.col("kind") == "evaluate")["score"].unique()) <= {0.25, 1.0}
        for t in range(1, N_TASKS + 1):
            refined = calls.filter((pl.col("kind") == "refine") & (pl.col("t") == t))
            last = refined.tail(3)["answer_id"].to_list()  # the second round's refinements, team order
            task = frame["tasks"].filter(pl.col("t") == t).row(0, named=True)
            top = max(last.count(a) for a in last)
            # a strict majority decides; else the highest anchor (all 1.0 here): the first team
            assert task["answer_id"] == (max(set(last), key=last.count) if top >= 2 else last[0])
            assert task["correct"] == (task["answer_id"] == 0)


def test_symphony_reruns_exactly_when_the_first_votes_are_risky(runs):
    params = symphony.SymphonyParams()
    reran = 0
    # the shared run (few disagreements) and one where every plan answers differently
    disagreeing = run_live_baselines(
        "symphony", bbh_specs((0,)), "default", ScriptedClient(all_wrong=True), RECORDS
    )
    for frame in [*runs["symphony"][1], *disagreeing]:
        calls = frame["calls"]
        for t in range(1, N_TASKS + 1):
            mine = calls.filter(pl.col("t") == t)
            finals = mine.filter((pl.col("kind") == "generate") & pl.col("answer_id").is_not_null())[
                "answer_id"
            ].to_list()
            assert len(finals) == params.n_plans
            top = max(finals.count(a) for a in finals)
            risk = params.w_disagree * (1 - top / 3) + params.w_unstable * (2 * top <= 3)
            rerun = risk >= params.rerun_at - C.TOL
            assert mine.filter(pl.col("kind") == "cot").height == (2 * params.n_extra if rerun else 0)
            reran += rerun
    assert reran >= N_TASKS  # every task of the disagreeing run


class EmptyOutputs(ScriptedClient):
    """The scripted client, with every generation (generate, cot) an empty reply."""

    def run_batch(self, requests):
        out = super().run_batch(requests)
        for k, r in enumerate(requests):
            if r.kind in ("generate", "cot"):
                out[k] = dataclasses.replace(
                    out[k], texts=("",), parsed=(r.parser.fallback,), parse_status=("failed",)
                )
        return out


def test_symphony_rewards_an_empty_output_zero():
    """Reward = clip(1[non-empty output] - 0.2 sqrt(latency_norm), 0, 1): empty replies earn 0,
    so reputations fall from their start of 0.5 (the emulator's outputs are never empty: 0.8)."""
    specs = bbh_specs((0,))
    rewards = {}
    for name, client in (("text", ScriptedClient()), ("empty", EmptyOutputs())):
        host = LiveBaselineHost([R._spec(s) for s in specs], RECORDS, client)
        states, _ = R.simulate("symphony", specs, "default", live=host)
        rewards[name] = np.asarray(states.reputation[0])
    assert (rewards["empty"] < 0.5).all() and (rewards["empty"] < rewards["text"]).all()
    assert (rewards["text"] > 0.5).all()


def test_answer_ids_compare_answers_as_the_scorer_does():
    host = LiveBaselineHost(bbh_specs((0,)), RECORDS, ScriptedClient())
    host._execution(0, 1, 0)
    gold = host.streams[0].records[0].gold
    assert host._answer_id(0, 1, f"RESULT: {gold}") == 0
    first = host._answer_id(0, 1, "RESULT: Zzz  Top")
    assert first >= 1 and host._answer_id(0, 1, "RESULT: zzz top.") == first  # same normalised answer
    other = host._answer_id(0, 1, "RESULT: something else")
    assert other not in (0, first)
    none_a, none_b = host._answer_id(0, 1, "no answer line"), host._answer_id(0, 1, "still none")
    assert len({none_a, none_b, first, other}) == 4  # an answer that states none agrees with nothing


def test_answer_ids_of_option_questions_compare_letters():

    # BBH: a multiple-choice question (gold "(X)"): the same wrong option, however written, one id
    host = LiveBaselineHost(bbh_specs((0,)), RECORDS, ScriptedClient())
    t = next(k + 1 for k, rec in enumerate(host.streams[0].records) if rec.gold.startswith("("))
    gold = host.streams[0].records[t - 1].gold
    wrong = next(f"({c})" for c in "ABCDEF" if f"({c})" != gold)
    host._execution(0, t, 0)
    ids = [
        host._answer_id(0, t, f"RESULT: {text}")
        for text in (wrong, wrong, wrong[1], f"the answer is {wrong}")
    ]
    assert ids[0] >= 1 and len(set(ids)) == 1
    # MMLU-Pro: an unparsable answer, then a wrong letter twice: no error, two ids
    host = first_task_host("mmlu_pro")
    letter = next(c for c in "ABCDEFGHIJ" if c != host.streams[0].records[0].gold.strip().upper())
    garbled = host._answer_id(0, 1, "RESULT: no idea, maybe the second one")
    assert (
        host._answer_id(0, 1, f"RESULT: {letter}") == host._answer_id(0, 1, f"RESULT: ({letter})") != garbled
    )


def first_task_host(dataset: str) -> LiveBaselineHost:
    """A host for one 42-task stream of `dataset` (its packaged sample), at its first task."""
    from meshheal_jax.data import load_sample
    from meshheal_jax.topology import load_profile

    profile = load_profile(dataset)
    stream = make_stream(0, profile.dataset_id, 42, len(profile.task_types), (1, 22), ("healthy", "degraded"))
    spec = BaselineSpec(build_network(profile, 6), stream, persistent_schedule(6, 42, (2, 4)), {"seed": 0})
    host = LiveBaselineHost([spec], load_sample(dataset), ScriptedClient())
    host._execution(0, 1, 0)
    return host


def test_math_answer_ids_use_math_equivalence():
    host = first_task_host("math")
    try:
        half = host._answer_id(0, 1, "RESULT: \\frac{1}{2} + 1000")
        assert half >= 1 and host._answer_id(0, 1, "RESULT: 1000.5") == half  # equal as mathematics
        assert host._answer_id(0, 1, "RESULT: 1001") not in (0, half)
    finally:
        host.judge.close()  # its MATH judging process


def test_a_failing_server_stops_the_run_with_its_error_and_keeps_the_trace(tmp_path):
    client = ScriptedClient(fail_at=5)
    with pytest.raises(ServerUnavailableError, match="went away"):
        run_live_baselines("raps", bbh_specs(), "default", client, RECORDS, run_dir=tmp_path)
    assert len(client.batches) == 5  # nothing is sent after the failure
    trace = pl.read_parquet(tmp_path / "live_trace.parquet")
    assert trace.height == sum(len(b) for b in client.batches[:4])


def test_agentnet_records_exactly_the_router_calls_it_sends():
    from meshheal_jax.baselines import agentnet

    client = ScriptedClient()
    params = agentnet.AgentNetParams(prune_at=1.5)  # every edge pruned: no router has a candidate
    rows = live_baseline_tables("agentnet", bbh_specs(), "default", client, RECORDS, params=params)
    recorded = sum(sum(c["kind"] == "router" for c in r["calls"]) for r in rows)
    sent = sum(r.kind == "router" for batch in client.batches for r in batch)
    assert recorded == sent
    assert any(t["end"] == "no route" for r in rows for t in r["tasks"])  # the case this checks


def ctrl_c_scenario() -> int:
    """SAC live with a Ctrl-C during the 4th batch; returns the batches sent (raises
    KeyboardInterrupt as the run should). Run in a child process by the test below."""
    import _thread

    class Interrupting(ScriptedClient):
        def run_batch(self, requests):
            if len(self.batches) == 3:
                _thread.interrupt_main()  # as a Ctrl-C in the terminal, while the program runs
                deadline = time.monotonic() + 30
                while C._HOST[0].error is None and time.monotonic() < deadline:
                    time.sleep(0.01)  # a slow server: the reply comes after the Ctrl-C was seen
            return super().run_batch(requests)

    client = Interrupting()
    try:
        run_live_baselines("sac", bbh_specs(), "default", client, RECORDS)
    except KeyboardInterrupt:
        return len(client.batches)
    raise AssertionError("the run did not raise KeyboardInterrupt")


def test_ctrl_c_stops_sending_and_raises():
    # In a child process with SIGINT at its default, as in a terminal: a background job
    # (nohup ... &) starts with SIGINT ignored, and this process's handlers stay untouched.
    import subprocess
    import sys
    from pathlib import Path

    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.path.insert(0, sys.argv[1]); from test_live_baselines import ctrl_c_scenario; "
            "print('batches', ctrl_c_scenario())")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["batches", "4"]  # the batch in flight finishes; nothing after


# ----------------------------------------------------------------------------------------------
# Through real sockets: the scripted HTTP stand-ins of test_live_loop, the real SyncLiveClient


def test_runner_runs_baselines_live_and_resumes_from_the_cache(tmp_path):
    pair = stand_ins()
    out = tmp_path / "run"
    argv = ["--backend", "live", "--strong-url", pair[0].url, "--weak-url", pair[1].url, "--methods", "raps",
            "sac", "--datasets", "bbh", "--seeds", "2", "--tasks", "42", "--data", "sample", "--quiet",
            "--out", str(out)]  # fmt: skip
    try:
        main.body(tyro.cli(main.MainConfig, args=argv))
        sent = sum(len(s.chats) for s in pair)
        tasks = pl.read_parquet(out / "tasks.parquet")
        calls = pl.read_parquet(out / "calls.parquet")
        assert sorted(tasks["method"].unique()) == ["raps", "sac"] and tasks.height == 2 * 2 * 42
        assert calls.height == tasks["calls"].sum()
        traces = [pl.read_parquet(out / f"live-{m}-default" / "live_trace.parquet") for m in ("raps", "sac")]
        assert sum(t.height for t in traces) == calls.height  # one request per call
        # every request not answered from the cache went out once; SAC's team 0 asks exactly what
        # RAPS's single execution asked (same agent, prompt, model and seed), so those are hits
        assert sent == sum((~t["from_cache"]).sum() for t in traces)
        assert traces[1].filter(pl.col("from_cache"))["kind"].unique().sort().to_list() == [
            "generate",
            "infer",
        ]
        assert set(calls["model"].unique()) <= {"openai/gpt-oss-120b", "meta-llama/Llama-3.2-1B-Instruct"}
        assert (out / "live-raps-default" / "live_trace.parquet").exists()
        # the stand-in's final answers: the gold from the strong model, "I cannot tell" from the weak one
        finals = calls.filter(pl.col("answer_id").is_not_null() & (pl.col("kind") == "generate"))
        assert ((finals["answer_id"] == 0) == (finals["model"] == "openai/gpt-oss-120b")).all()
        summary = json.loads((out / "summary.json").read_text())
        assert {r["method"] for r in summary["results"]} == {"raps", "sac"}
        before = tasks
        import shutil

        shutil.rmtree(out / "parts")  # as if the run had died before writing any stream
        main.body(tyro.cli(main.MainConfig, args=argv))
        assert sum(len(s.chats) for s in pair) == sent  # every reply came from the response cache
        assert pl.read_parquet(out / "tasks.parquet").equals(before)
    finally:
        for server in pair:
            server.close()


def test_garbage_replies_fall_back_and_are_recorded(tmp_path):
    from test_live_loop import FAST_RETRY, config, garbage

    pair = stand_ins(garbage)
    try:
        cfg = config(pair, tmp_path / "cache.sqlite")
        cfg = type(cfg)(servers=cfg.servers, retry=FAST_RETRY, cache_path=cfg.cache_path)
        rows = live_baseline_tables("autogen", bbh_specs((0,)), "default", cfg, RECORDS)
    finally:
        for server in pair:
            server.close()
    calls = pl.DataFrame(rows[0]["calls"], infer_schema_length=None)
    selects = calls.filter(pl.col("kind") == "select")
    assert (selects["parse_status"] == "failed").all()  # retried once, then the fallback
    tasks = pl.DataFrame(rows[0]["tasks"], infer_schema_length=None)
    assert tasks.height == N_TASKS and not tasks["correct"].any()  # garbage never states the gold


def test_streams_that_share_a_seed_and_dataset_id_run_live():
    """Profiles of one run may share a dataset_id (decisions R1); the host tells their streams
    apart by their place in the batch, so each gets its own stream's answers."""
    (usual,) = bbh_specs((0,))
    other = usual._replace(schedule=persistent_schedule(6, N_TASKS, (0, 1)))  # same seed and dataset id
    alone = [
        run_live_baselines("raps", [spec], "default", ScriptedClient(), RECORDS)[0] for spec in (usual, other)
    ]
    batched = run_live_baselines("raps", [usual, other], "default", ScriptedClient(), RECORDS)
    assert not alone[0]["calls"].equals(alone[1]["calls"])  # their degraded agents answer differently
    for one, frames in zip(alone, batched, strict=True):
        for name in ("tasks", "calls"):
            assert frames[name].equals(one[name]), name


def test_a_refused_live_run_closes_the_client_it_opened(tmp_path, monkeypatch):
    """The host refuses questions without the profile's task types; the client and response cache
    it opened are closed all the same (no 'Unclosed client session' after the error)."""
    from test_live_loop import config

    from meshheal_jax.backends import live_baselines

    closed, opened = [], live_baselines._open_client

    def watched(*args):
        live, owned = opened(*args)
        close = live.close
        live.close = lambda: (closed.append(True), close())[1]
        return live, owned

    monkeypatch.setattr(live_baselines, "_open_client", watched)
    pair = stand_ins()
    try:
        with pytest.raises(MeshHealError):
            run_live_baselines(
                "raps", bbh_specs((0,)), "default", config(pair, tmp_path / "cache.sqlite"), RECORDS[:1]
            )
    finally:
        for server in pair:
            server.close()
    assert closed == [True]


def test_math_judging_is_bounded_off_the_main_thread():
    """A reply whose check never ends in a thread (sympy's power 10^(10^10) holds Python's lock, so
    a thread watching it never runs again) is judged in a child process: None once past the
    limit, the child killed, and the next MATH call starts another. Other datasets are judged here."""
    from meshheal_jax import scoring
    from meshheal_jax.backends import live_baselines

    judge = live_baselines.MathJudge(limit_s=1.0)  # under math-verify's own 5 s: the kill is tried
    results = []

    def off_the_main_thread():
        results.append(judge(scoring.judge, "math", "RESULT: \\boxed{10^{10^{10}}}", "5", None))
        results.append(judge(scoring.judge, "math", "RESULT: \\frac{1}{2}", "0.5", None))

    try:
        worker = threading.Thread(target=off_the_main_thread)
        worker.start()
        worker.join(120)
        assert not worker.is_alive()
        assert results[0] is None  # past the limit: no verdict
        assert results[1] == scoring.Judgement(True, scoring.OK, "\\frac{1}{2}")  # a new child judged it
        assert judge(scoring.same_answer, "bbh", "(B)", "(B)") is True
        assert judge._pool is not None
    finally:
        judge.close()
    assert judge._pool is None
