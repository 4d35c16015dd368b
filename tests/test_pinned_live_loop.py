"""Pins of the live loops' bookkeeping (meshheal_jax.backends.live_loop, live_baselines) that the
end-to-end tests leave open: which sample's score and parse status a calls row carries, the
per-call seeds, limits and authors of the requests, the texts a prompt is built from (the kept
draft, round-2 verdicts, both Takeover candidates, the watchdog's judged visit, the composed
worker output), and where the response cache goes.

The MeshHeal loop runs against a SCRIPTED IN-PROCESS CLIENT (`ScriptedLive`, NOT a model, no
HTTP): test_live_loop's well-formed script per sample, with a marker line in every execution
output, a reason naming each committee reply, and per-sample twists in the n = 3 reviews
(stream 0: the third sample neutral; stream 1: the second sample garbage). The baselines' host is
driven call by call (`LiveBaselineHost._request`), with no compiled program.
"""

from __future__ import annotations

import json
import re
import types

import numpy as np
import polars as pl
import pytest

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from test_live_baselines import bbh_specs  # the baselines' scripted setup
from test_live_loop import (  # the scripted stand-ins and their well-formed script
    CONTRIBUTE_MARK,
    RECORDS,
    STRONG_ROOT,
    WEAK_ROOT,
    bbh_spec,
    config,
    stand_ins,
    well_formed,
)

from meshheal_jax import engine, prompts, scoring
from meshheal_jax.backends import live_loop
from meshheal_jax.backends.live import PARSE_FAILED, PARSE_OK, CallResponse, SyncLiveClient, request_seed
from meshheal_jax.backends.live_baselines import LiveBaselineHost
from meshheal_jax.baselines import common as C
from meshheal_jax.config import ProtocolParams
from meshheal_jax.data import load_sample
from meshheal_jax.params import load_pair
from meshheal_jax.streams import make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.data.QuestionPoolWarning")

SEEDS = (0, 1)
MARK = re.compile(r"MARK-\w+-\d+")  # an execution output's marker line
REASON = re.compile(r"R[12]-\d+")  # a committee reply's reason


# ----------------------------------------------------------------------------------------------
# The MeshHeal loop against a scripted client


class ScriptedLive(SyncLiveClient):
    """run_live_streams's client without servers (NOT a model, no HTTP): `run_batch` answers every
    sample from the well-formed script, parsed by the request's own parser (its fallback on garbage)."""

    def __init__(self) -> None:  # no event loop, no HTTP client: run_batch is all the loop calls
        self.batches: list[list] = []

    def sample(self, request, i: int) -> str:
        body = {"messages": request.messages, "response_format": request.response_format}
        text = well_formed(request.role, body)
        if request.kind == "review" and request.stream == 1 and i == 1:
            return "lorem ipsum ### no json here"
        if request.kind == "review" and request.stream == 0 and i == 2:
            return json.dumps({**json.loads(text), **json.loads(prompts.review_reply(0.5, _stage(text)))})
        if request.kind in ("committee1", "committee2"):
            reason = f"R{request.kind[-1]}-{request.seed}"
            return json.dumps({**json.loads(text), "one_sentence_reason": reason})
        if request.kind in ("generate", "candidate", "synthesis"):
            return text.replace("\nRESULT:", f"\nMARK-{request.kind}-{request.seed}\nRESULT:", 1)
        return text

    def run_batch(self, requests):
        self.batches.append(list(requests))
        out = []
        for r in requests:
            texts = tuple(self.sample(r, i) for i in range(r.n))
            parsed, status = [], []
            for text in texts:
                try:
                    parsed.append(r.parser.parse(text))
                    status.append(PARSE_OK)
                except prompts.ReplyParseError:
                    parsed.append(r.parser.fallback)
                    status.append(PARSE_FAILED)
            model = STRONG_ROOT if r.role == "strong" else WEAK_ROOT
            out.append(CallResponse(texts, tuple(parsed), tuple(status), ("stop",) * r.n, 100 * r.n + r.call_id,
                                    7 * r.n + 1, 0, 0, 0.01 + 0.001 * r.call_id, 0, 0, 1, False, model))  # fmt: skip
        return out


def _stage(review_json: str) -> str:
    return "finalize" if "final_answer_committed" in json.loads(review_json) else "contribute"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    client = ScriptedLive()
    run_dir = tmp_path_factory.mktemp("pinned") / "run"
    specs = [bbh_spec(seed) for seed in SEEDS]
    frames = live_loop.run_live_streams(specs, ProtocolParams(), client, RECORDS, run_dir=run_dir)
    return frames, client, pl.read_parquet(run_dir / live_loop.TRACE_FILE)


def test_every_calls_row_is_its_own_sample_of_its_own_request(scripted):
    """Per stream, the calls table's rows are the trace's requests sample by sample: each n = 3
    review sample keeps its own score and parse status, its model, its request's latency, and
    the request's tokens split over its samples."""
    frames, _, trace = scripted
    for s, frame in enumerate(frames):
        calls = frame["calls"]
        mine = trace.filter(pl.col("stream") == s)
        assert calls.height == mine["n"].sum()
        samples = mine.with_columns(pl.col("parse_status").str.split(","), request=pl.int_range(pl.len()))
        samples = samples.explode("parse_status")
        assert calls["parse_status"].to_list() == samples["parse_status"].to_list()
        assert calls["model"].to_list() == samples["model_id"].to_list()
        assert calls["latency_s"].to_list() == samples["latency_s"].to_list()
        per_request = calls.with_columns(request=samples["request"]).group_by("request", maintain_order=True)
        sums = per_request.agg(pl.col("prompt_tokens").sum(), pl.col("completion_tokens").sum())
        assert sums["prompt_tokens"].to_list() == mine["prompt_tokens"].to_list()
        assert sums["completion_tokens"].to_list() == mine["completion_tokens"].to_list()
        reviewed = pl.col("kind").is_in(["review", "committee1", "committee2"])
        scores = mine.filter(reviewed)["scores"].explode().to_list()
        assert calls.filter(reviewed)["score"].to_list() == scores
    # the twists happened: stream 1's second samples failed, stream 0's third samples differ
    assert set(frames[1]["calls"]["parse_status"]) == {PARSE_OK, PARSE_FAILED}
    first = trace.filter((pl.col("stream") == 0) & (pl.col("kind") == "review"))["scores"].to_list()
    assert any(len(set(scores)) > 1 for scores in first)


def test_a_sample_that_fell_back_still_counts_as_a_call(scripted):
    """A parse failure is a call made (its tokens were spent): tasks.calls counts every sample."""
    frames, _, _ = scripted
    for frame in frames:
        per_t = frame["calls"].group_by("t").len().sort("t")
        assert frame["tasks"].sort("t")["calls"].to_list() == per_t["len"].to_list()


def test_requests_carry_their_call_s_seed_limit_and_author(scripted):
    """spec/live.md "Seeds": per request from (stream seed, task, call), call ids 0, 1, ... in the
    order a task makes its requests; each kind's own max_completion_tokens; an inference judges
    no one's output (author -1)."""
    _, client, _ = scripted
    sent = [r for batch in client.batches for r in batch]
    options = live_loop.LiveOptions()
    spec_ids = {s: bbh_spec(seed).stream for s, seed in enumerate(SEEDS)}
    ids: dict[tuple[int, int], list[int]] = {}
    for r in sent:
        stream = spec_ids[r.stream]
        assert r.seed == request_seed(stream.seed, stream.dataset_id, r.t, r.call_id)
        assert r.max_completion_tokens == options.tokens_for(r.kind)
        assert (r.author == -1) == (r.kind == "infer")
        ids.setdefault((r.stream, r.t), []).append(r.call_id)
    assert all(calls == list(range(len(calls))) for calls in ids.values())


def test_takeover_prompts_show_round_two_and_both_candidates(scripted):
    """A correction candidate sees the committee's round-2 explanations (round 1's when there was
    no round 2); the synthesis sees every candidate of the visit."""
    _, client, _ = scripted
    visit: dict[tuple[int, int], dict[str, list[str]]] = {}
    checked = {"candidate": 0, "synthesis": 0}
    for batch in client.batches:
        replies = []
        for r in batch:
            key, content = (r.stream, r.t), r.messages[-1]["content"]
            if r.kind == "generate":
                visit[key] = {"R1": [], "R2": [], "candidate": []}
            elif r.kind == "candidate":
                seen = visit[key]
                assert set(REASON.findall(content)) == set(seen["R2"] or seen["R1"])
                checked["candidate"] += bool(seen["R2"])
            elif r.kind == "synthesis" and visit[key]["candidate"]:
                assert set(MARK.findall(content.split("Two reviewers each wrote", 1)[1])) == set(
                    visit[key]["candidate"]
                )
                checked["synthesis"] += 1
            replies.append(r)
        for r in replies:  # a round's replies are read after all its requests were built
            key = (r.stream, r.t)
            if r.kind in ("committee1", "committee2"):
                visit[key][f"R{r.kind[-1]}"].append(f"R{r.kind[-1]}-{r.seed}")
            elif r.kind == "candidate":
                visit[key]["candidate"].append(f"MARK-candidate-{r.seed}")
    assert checked["candidate"] > 0 and checked["synthesis"] > 0


def test_a_finalize_prompt_builds_on_the_kept_draft(scripted):
    """Contribute: the handoff names the pair's other ability, never the caller's own; Finalize
    after a Contribute: the partial directive with the kept output in the draft; a Finalize with
    no draft: the full directive (no such case in this mapping: see the baselines' host below)."""
    _, client, _ = scripted
    written: dict[tuple[int, int], set[str]] = {}
    seen = {"partial": 0, "handoff": 0}  # no agent of the paper's mapping holds a whole pair
    for batch in client.batches:
        for r in batch:
            key, content = (r.stream, r.t), r.messages[-1]["content"]
            if r.kind != "generate":
                continue
            if CONTRIBUTE_MARK in content:
                own = re.search(r"You hold only part of what this task needs: (.+?)\.", content)[1]
                handoff = re.search(r"The part that needs (.+?) is for another agent\.", content)
                assert handoff is None or own not in handoff[1].split(", ")
                seen["handoff"] += handoff is not None
            elif key in written:
                draft = content.split("Accepted earlier outputs:", 1)[1].split("Your abilities", 1)[0]
                assert "Earlier agents have covered" in content and MARK.search(draft)
                seen["partial"] += 1
            else:
                assert "You hold every ability this task still needs" in content
            written.setdefault(key, set())
    assert min(seen.values()) > 0


def test_a_finalize_takeover_keeps_the_answer_before_it_apart_from_the_one_after(scripted):
    """reviews.correct_before is the reviewed final answer's correctness, correct_after the kept
    one's: a Takeover's synthesis changes the second only (the script: the gold iff strong)."""
    frames, _, _ = scripted
    reviews = pl.concat([frame["reviews"] for frame in frames])
    final = reviews.filter((pl.col("action") == "finalize") & pl.col("takeover"))
    assert (final["correct_before"] == (final["author_model"] == "strong")).all()
    assert (final["correct_before"] != final["correct_after"]).any()


def test_trace_rows_carry_their_own_stream_s_labels(scripted):
    _, _, trace = scripted
    labels = trace.group_by("stream").agg(pl.col("label_seed").unique()).sort("stream")
    assert labels["label_seed"].to_list() == [[seed] for seed in SEEDS]


def test_the_model_backed_rule_reads_health_at_the_task_and_the_held_ability():
    """architecture.md: strong iff the calling agent is healthy at task t and holds the call's
    ability (an inference, tied to no ability: strong iff healthy), for every agent and ability."""
    spec = bbh_spec(0)
    stream = live_loop._prepare_stream(spec, RECORDS)
    holds, degraded = spec.network.holds, spec.schedule.degraded_matrix()
    for t in range(1, degraded.shape[0]):
        for agent in range(holds.shape[0]):
            for ability in range(-1, holds.shape[1]):
                held = ability < 0 or holds[agent, ability]
                expected = engine.STRONG if held and not degraded[t, agent] else engine.WEAK
                assert live_loop._role(stream, agent, ability, t) == expected


def _one_call(profile_name: str, phase: int, kind: int):
    """A stream of `profile_name`'s packaged sample and one slot's emitted call at task 1 (the
    arrays `begin_round` hands the host: streams x slots (x 3 calls)), by an agent holding it."""
    profile = load_profile(profile_name)
    network = build_network(profile, 6)
    stream = make_stream(0, profile.dataset_id, 42, len(profile.task_types), (1, 22), ("healthy", "degraded"))
    spec = engine.StreamSpec(network, stream, persistent_schedule(6, 42, network.degraded_targets),
                             load_pair("default"), {"seed": 0})  # fmt: skip
    agent, ability = (int(x) for x in np.argwhere(network.holds)[0])
    rq = _slot(phase, kind, agent, ability, finalize=True)
    return live_loop._prepare_stream(spec, load_sample(profile_name)), rq


def _slot(phase: int, kind: int, agent: int, ability: int, finalize: bool, pair: int = 0, t: int = 1):
    """One slot's emitted arrays at task t (streams x slots (x 3 calls)), as `begin_round` hands them."""
    return types.SimpleNamespace(
        mask=np.array([[[True, False, False]]]), t=np.array([[t]]), phase=np.array([[phase]]),
        ability=np.array([[ability]]), author=np.array([[agent]]), finalize=np.array([[finalize]]),
        agent=np.array([[[agent, -1, -1]]]), kind=np.array([[[kind, -1, -1]]]), inferred_pair=np.array([[pair]]),
    )  # fmt: skip


def test_an_mmlu_pro_prompt_lists_the_question_s_options():
    """The text store keeps the record's options: MMLU-Pro's lettered options reach the prompt."""
    stream, rq = _one_call("mmlu_pro", engine.GENERATE, engine.K_GENERATE)
    (pending,) = live_loop._build_requests([stream], {}, rq, live_loop.LiveOptions())
    options = stream.records[0].options
    assert options and f"A. {options[0]}" in pending.request.messages[-1]["content"]


def test_inference_examples_follow_the_option():
    stream, rq = _one_call("bbh", engine.INFER, engine.K_INFER)
    shown = []
    for examples in (True, False):
        options = live_loop.LiveOptions(inference_examples=examples)
        (pending,) = live_loop._build_requests([stream], {}, rq, options)
        shown.append("Example question:" in pending.request.messages[-1]["content"])
    assert shown == [True, False]


def test_a_config_s_cache_path_wins_over_the_run_folder(tmp_path):
    pair = stand_ins()
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        live, owned = live_loop._open_client(config(pair, tmp_path / "mine.sqlite"), run_dir)
        live_loop._finish(None, [], live, owned)
    finally:
        for server in pair:
            server.close()
    assert owned and (tmp_path / "mine.sqlite").exists()
    assert not (run_dir / live_loop.CACHE_FILE).exists()


# ----------------------------------------------------------------------------------------------
# The baselines' host, call by call


def _reply(text: str, parsed=None, prompt: int = 10, completion: int = 5) -> CallResponse:
    """A reply parsed ok (prompt / completion tokens as given), as the live client hands it back."""
    return CallResponse((text,), (parsed if parsed is not None else text,), (PARSE_OK,), ("stop",), prompt,
                        completion, 0, 0, 0.01, 0, 0, 1, False, "scripted-strong")  # fmt: skip


def _host(seeds=(0,)) -> LiveBaselineHost:
    return LiveBaselineHost(bbh_specs(seeds), RECORDS, client=None)


def _holder(host: LiveBaselineHost, held: bool = True) -> tuple[int, int]:
    """An (agent, ability) of stream 0 with the agent holding the ability (or not)."""
    agent, ability = np.argwhere(host.streams[0].spec.network.holds == held)[0]
    return int(agent), int(ability)


def _call(**fields):
    return {"stream": 0, "t": 1, "agent": 0, "role": 0, **fields}


def _generate(host, agent, ability, visit, finalize=False, **fields):
    return host._request("generate", _call(agent=agent, ability=ability, visit=visit, finalize=finalize,
                                           kind=C.KINDS.index("generate"), **fields), {})  # fmt: skip


def test_a_watchdog_judges_the_visit_it_names_after_the_draft_before_it():
    host = _host()
    agent, ability = _holder(host)
    for visit in (0, 1):
        _, finish = _generate(host, agent, ability, visit)
        finish(_reply(f"COMPETENCE_MATCH:partial\nRESULT: part of visit {visit}"))
    request, _ = host._request("watchdog", _call(agent=agent, ability=ability, visit=2,
                                                 judged_visit=1, author=3), {})  # fmt: skip
    draft, judged = request.messages[-1]["content"].split("Output under review:", 1)
    assert "part of visit 0" in draft and "part of visit 1" not in draft
    assert "part of visit 1" in judged
    assert request.author == 3


def test_compose_reads_the_worker_output_it_names():
    host = _host()
    execution = host._execution(0, 1, 0)
    execution.outputs[1], execution.answer = "WORKER-ONE", "EARLIER-ANSWER"
    request, _ = host._request("compose", _call(agent=2, judged_visit=1), {})
    assert "WORKER-ONE" in request.messages[-1]["content"]
    assert "EARLIER-ANSWER" not in request.messages[-1]["content"]


def test_generation_directives_follow_holding_and_the_draft():
    host = _host()
    outsider, foreign = _holder(host, held=False)
    request, _ = _generate(host, outsider, foreign, 0, finalize=True)
    assert "None of your abilities covers this task" in request.messages[-1]["content"]
    agent, ability = _holder(host)
    request, _ = _generate(host, agent, ability, 0, finalize=True)
    assert "You hold every ability this task still needs" in request.messages[-1]["content"]
    _, finish = _generate(host, agent, ability, 1)
    finish(_reply("COMPETENCE_MATCH:partial\nRESULT: a part"))
    request, _ = _generate(host, agent, ability, 2, finalize=True)
    assert "Earlier agents have covered" in request.messages[-1]["content"]


def test_an_execution_without_its_own_inference_works_on_team_zero_s_pair():
    """SAC: teams 1..4 generate on the pair execution 0 inferred, not the documented one."""
    host = _host()
    profile, record = host.streams[0].profile, host.streams[0].records[0]
    documented = set(profile.requires[profile.task_types.index(record.task_type)])
    index, mine, other = next((i, a, b) for i, pair in enumerate(profile.pairs)
                              for a, b in (sorted(pair), sorted(pair)[::-1]) if b not in documented)  # fmt: skip
    host._execution(0, 1, 0).pair = index
    agent = int(np.flatnonzero(host.streams[0].spec.network.holds[:, mine])[0])
    request, _ = _generate(host, agent, mine, 0, execution=1)
    handoff = re.search(r"The part that needs (.+?) is for another agent\.", request.messages[-1]["content"])
    assert handoff[1] == profile.abilities[other]


def test_only_a_repeated_selection_says_the_worker_declined():
    host = _host()
    workers = {"workers": np.array([True, True, False, True, True, True])}
    first, _ = host._request("select", _call(agent=2, ability=0, attempt=0), workers)
    again, _ = host._request("select", _call(agent=2, ability=0, attempt=1), workers)
    declined = "declined the turn"
    assert declined not in first.messages[-1]["content"] and declined in again.messages[-1]["content"]
    assert first.seed != again.seed


def test_a_math_answer_past_the_judging_limit_is_wrong_and_agrees_with_nothing():
    from test_live_baselines import first_task_host

    host = first_task_host("math")
    host.judge = lambda fn, dataset, *args: None if fn is scoring.judge else fn(dataset, *args)
    late = host._answer_id(0, 1, "RESULT: \\boxed{10^{10^{10}}}")
    assert late >= 1 and host._answer_id(0, 1, "RESULT: \\boxed{10^{10^{11}}}") not in (0, late)


def test_host_trace_rows_carry_their_own_stream_s_labels():
    class Echo:
        def run_batch(self, requests):
            return [_reply(json.dumps({"abilities": ["x", "y"]}), r.parser.fallback) for r in requests]

    host = _host(SEEDS)
    host.client = Echo()
    ones = np.ones(2, np.int64)
    host.answer("infer", np.ones(2, bool), {"stream": np.arange(2), "t": ones, "agent": 0 * ones, "role": 0 * ones},
                {})  # fmt: skip
    assert host.error is None
    assert [row["label_seed"] for row in host.trace] == list(SEEDS)
