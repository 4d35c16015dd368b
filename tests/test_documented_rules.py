"""Rules that spec/live.md, spec/emulator.md and docs/decisions.md state for the live client and
its cache, the reply parsers, the checkpoints, the window reset under CUSUM, hop_per_task
convergence and calibration. A mutation of each (named in its test's docstring) passed every
other test (twenty-fourth session's third mutation pass)."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import polars as pl
import pytest
from test_engine import main_spec
from test_live import FAST_RETRY, ScriptedServer, gen_request, run, strong

from meshheal_jax import engine, prompts, reference, runner
from meshheal_jax.backends.cache import ResponseCache
from meshheal_jax.backends.live import LiveClient, RetryPolicy, ServerGroup, _retry_after_s
from meshheal_jax.checkpoints import Checkpoints
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError

# ----------------------------------------------------------------------------------------------
# Live client: backoff (spec/live.md "retries with jittered backoff ... 429 (honouring Retry-After)")


class _Quarter:
    """A stand-in for the client's jitter source: uniform(a, b) gives a quarter of the way."""

    def uniform(self, a: float, b: float) -> float:
        return a + 0.25 * (b - a)


def _client(retry: RetryPolicy) -> LiveClient:
    client = LiveClient([ServerGroup("strong", ("http://127.0.0.1:9/v1",))], retry=retry)  # never started
    client._jitter = _Quarter()
    return client


def test_backoff_is_a_jittered_draw_below_a_capped_exponential_ceiling():
    """Attempt k waits uniform(0, min(cap, base * 2**k)) (RetryPolicy). Mutations: no jitter (the
    ceiling itself), no exponential growth, max instead of min for the cap."""
    client = _client(RetryPolicy(backoff_base_s=0.5, backoff_cap_s=30.0))
    delays = [client._backoff_s(k, None) for k in range(9)]
    ceilings = [min(30.0, 0.5 * 2**k) for k in range(9)]
    assert delays == pytest.approx([0.25 * c for c in ceilings])
    assert ceilings[-1] == 30.0  # the cap is reached
    client._jitter = random.Random(0)  # the real source: draws within [0, ceiling]
    draws = [client._backoff_s(3, None) for _ in range(20)]
    assert all(0.0 <= d <= 4.0 for d in draws) and len(set(draws)) == 20


def test_retry_after_is_honoured_up_to_its_cap_and_read_in_milliseconds():
    """A Retry-After longer than the jittered delay is waited, at most retry_after_cap_s; the SDK's
    retry-after-ms header is milliseconds. Mutations: the cap dropped; milliseconds read as seconds."""
    client = _client(RetryPolicy(backoff_base_s=0.5, retry_after_cap_s=120.0))
    assert client._backoff_s(0, 5.0) == 5.0
    assert client._backoff_s(0, 500.0) == 120.0
    assert client._backoff_s(4, 0.0) == pytest.approx(0.25 * 8.0)  # a shorter one: the backoff's delay

    def response(**headers: str):
        return type("Reply", (), {"headers": headers})()  # lower-case names, as httpx reads them

    assert _retry_after_s(response(**{"retry-after-ms": "1500"})) == pytest.approx(1.5)
    assert _retry_after_s(response(**{"retry-after": "7"})) == 7.0
    assert _retry_after_s(response()) is None


def test_run_batch_raises_when_its_replies_cannot_be_written(tmp_path):
    """decisions L2: a flush that fails keeps its replies held; "the next flush (`run_batch` ends
    with one) tries again and raises, naming the cache file, instead of the loop only logging it".
    Mutation: run_batch without its closing flush returns as if the replies were on disk."""
    path = tmp_path / "responses.sqlite"

    async def scenario():
        async with ScriptedServer() as server:
            with ResponseCache(path) as cache:
                async with LiveClient([strong(server)], cache=cache, retry=FAST_RETRY) as client:
                    cache._db.execute("PRAGMA query_only = 1")  # every write now fails
                    with pytest.raises(
                        MeshHealError, match=re.escape(f"response cache {path}: cannot write 3 repl")
                    ):
                        await client.run_batch([gen_request(i) for i in range(3)])
                    cache._db.execute("PRAGMA query_only = 0")
                    assert len(cache) == 3  # held, not lost: written once writes work

    run(scenario())


# ----------------------------------------------------------------------------------------------
# Reply parsers (spec/live.md "Prompts"; decisions L3)


def test_a_score_exactly_the_tolerance_outside_the_range_is_still_read():
    """decisions L3: "a score more than 0.125 outside [0, 1] is garbage", so 1.125 and -0.125 are
    read (as 1 and 0). Mutation: the bounds made strict."""
    assert prompts.snap_score(1.125) == 1.0 and prompts.snap_score(-0.125) == 0.0
    assert prompts.snap_score("1.125") == 1.0
    for garbage in (1.126, -0.126):
        with pytest.raises(ValueError, match="outside"):
            prompts.snap_score(garbage)


def _review(score: float, stage: str, **fields) -> str:
    reply = json.loads(prompts.review_reply(score, stage))
    reply.update(fields)
    return json.dumps(reply)


def test_a_finalize_without_a_committed_answer_is_capped_at_a_quarter_from_a_half():
    """spec/live.md, Finalize review: "no concrete answer -> at most 0.25" (a 0.5 as well as a 1.0).
    Mutation: the cap applied to scores above 0.5 only."""
    for score in (0.5, 1.0):
        verdict = prompts.parse_review(_review(score, "finalize", final_answer_committed=False), "finalize")
        assert (verdict.score, verdict.adjustment) == (0.25, "no_final_answer")
    kept = prompts.parse_review(_review(0.5, "finalize", final_answer_committed=True), "finalize")
    assert (kept.score, kept.adjustment) == (0.5, "")


def test_a_low_score_with_evidence_of_another_correctness_error_stands():
    """spec/live.md: a score <= 0.40 needs specific_failure_found with non-empty evidence of a
    correctness error; "over-reach alone never counts" (failure types none|wrong_half|over_reach|
    other: only over_reach and none are not correctness errors). Mutation: "other" not accepted."""
    fields = {"specific_failure_found": True, "failure_evidence": "2 + 2 = 5"}
    other = prompts.parse_review(_review(0.25, "contribute", failure_type="other", **fields), "contribute")
    assert (other.score, other.adjustment) == (0.25, "")
    reach = prompts.parse_review(
        _review(0.25, "contribute", failure_type="over_reach", **fields), "contribute"
    )
    assert (reach.score, reach.adjustment) == (0.5, "unsupported_low_score")


# ----------------------------------------------------------------------------------------------
# Checkpoints (checkpoints.py's layout: one carry, the last checkpoint's)


def test_a_checkpoint_keeps_only_the_last_carry(tmp_path):
    """Checkpoint K writes carry-K and drops carry-(K-1) once state.json names K. Mutation: the old
    carry kept (one more engine state left on disk at every checkpoint of a long run)."""
    saves = Checkpoints([tmp_path / "stream"], 0.0)
    carry = {"a": np.arange(3.0), "b": np.zeros(2, np.int32)}
    part = [{"tasks": pl.DataFrame({"t": [1]})}]
    for k in range(3):
        saves.save(0, {"a": carry["a"] + k, "b": carry["b"]}, part, tasks_entered=k + 1)
    names = sorted(p.name for p in (tmp_path / "stream").iterdir())
    assert [n for n in names if n.startswith("carry-")] == ["carry-00003.npz"]
    restored, parts = saves.restore(0, carry, ("tasks",))
    assert restored["a"].tolist() == [2.0, 3.0, 4.0] and len(parts) == 3


# ----------------------------------------------------------------------------------------------
# window_reset with the CUSUM detector (decisions P7: "... and its CUSUM statistics are emptied")

T, S, AUTHOR = 0, 2, 0


def test_entering_isolation_empties_the_cusum_statistic_in_both_engines():
    """Scores 1.0, 0.5, 0.25, 0.0 take S to 1.65 >= h: isolated; with window_reset "on_isolation"
    S is 0 right after, in both engines. Mutation: clear_evidence leaves the CUSUM statistic."""
    protocol = ProtocolParams(detector="cusum", window_reset="on_isolation")
    spec = main_spec("bbh", 0, 42)
    cfg = engine.engine_config([spec], protocol, 1)
    params = engine.make_params(protocol, spec.pair, spec.network.profile, 6)
    world = engine.make_world(spec.network, spec.stream, spec.schedule)
    net = engine.initial_net(cfg, world)
    ref = reference.ReferenceNetwork(spec.network, protocol, 7)
    observe = jax.jit(functools.partial(engine.observe, detector="cusum", reset="on_isolation"))
    warmup = protocol.warmup_tasks(6)
    for k, q in enumerate((1.0, 0.5, 0.25, 0.0)):
        net, obs = observe(
            params, world, net, AUTHOR, T, S, jnp.float64(q), jnp.int32(50 + k), jnp.bool_(True)
        )
        out = ref.observe(AUTHOR, T, S, q, 50 + k, warmup)
    assert out["to"] == reference.ISOLATED and out["z"] == pytest.approx(1.65)
    assert engine.STATE_NAMES[int(obs.after)] == "isolated" and float(obs.z) == pytest.approx(1.65)
    assert ref.cusum[(AUTHOR, T, S)] == 0.0 and float(net.cusum[AUTHOR, T, S]) == 0.0
    assert float(jnp.abs(net.cusum).sum()) == 0.0


# ----------------------------------------------------------------------------------------------
# hop_per_task (decisions P6: "each task's start takes one synchronous Bellman-Ford step")


def test_every_task_starting_in_a_round_takes_its_own_relaxation_step():
    """Two slots: the round's two starting tasks relax the tables twice before they start.
    Mutation: one step per round, whatever the number of tasks starting."""
    protocol = ProtocolParams(convergence="hop_per_task")
    exp = runner.Experiment("scale", ("bbh",), ("default",), (0,), n_agents=12, slots=2, n_tasks=42,
                            degraded=None, topology="sparse", protocol=protocol)  # fmt: skip
    network, stream, pair, labels = runner._stream_inputs(exp, "bbh", "default", 0)
    spec = engine.StreamSpec(network, stream, exp.schedule(), pair, labels)
    cfg = engine.engine_config([spec], protocol, 2)
    params = engine.make_params(protocol, pair, network.profile, 12)
    world = engine.make_world(network, stream, spec.schedule)
    carry = engine.initial_carry(cfg, world)

    def relaxed(isolated: list[int], steps: int):
        ref = reference.ReferenceNetwork(network, protocol, len(network.profile.task_types))
        for i in isolated:
            ref.state[i] = reference.ISOLATED
        for _ in range(steps):
            ref.distance = ref.relax()
        return ref.distance

    isolated = [0, 1]  # their isolation takes more than one step to travel on this sparse graph
    assert relaxed(isolated, 1) != relaxed(isolated, 2)
    state = carry.net.state.at[jnp.array(isolated)].set(engine.ISOLATED)
    carry = dataclasses.replace(carry, net=dataclasses.replace(carry.net, state=state))  # tables stale
    taken = engine._take_tasks(cfg, params, world, carry)
    assert int(taken.next_t) == 3  # both slots took a task
    assert np.asarray(taken.net.distance).tolist() == relaxed(isolated, 2)


# ----------------------------------------------------------------------------------------------
# Calibration (decisions: "A value is identified with >= --min-n (20) observations"; emulator.md:
# the samples repeat the first judgement "with prob `rho_same`")


def test_a_value_is_identified_from_exactly_min_n_observations():
    """Mutation: identified only above min_n."""
    from meshheal_jax import calibrate

    reps = np.array([0.5, 0.4, 0.6])
    assert calibrate.judge(reps, 20, 20).identified
    assert not calibrate.judge(reps, 19, 20).identified
    assert "too few observations (n=19 < min_n=20)" in calibrate.judge(reps, 19, 20).note


def test_rho_same_is_a_probability_even_when_samples_agree_less_than_chance():
    """Fewer matches than kappa predicts (or more than all) gives rho 0 (or 1), not a value outside
    [0, 1] that the model file would take as a probability. Mutation: the clip dropped."""
    from meshheal_jax import calibrate

    probs = np.array([[[0.25, 0.25, 0.25, 0.25]]])  # kappa = 0.25
    pairs = np.array([[1000.0]])
    assert calibrate.rho_same(probs, pairs, pairs * 0.10).tolist() == [0.0]
    assert calibrate.rho_same(probs, pairs, pairs * 1.50).tolist() == [1.0]
