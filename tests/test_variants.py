"""MeshHeal variants (single_reviewer, no_takeover) and detectors (absolute, cusum): the JAX engine
against the reference record by record, and each mechanism on hand-built situations.

The variant and the detector are static configuration of the JAX engine (one compiled program
each), so the default subset covers every variant and every detector with two programs:
(single_reviewer, absolute) and (no_takeover, cusum). MESHHEAL_FULL_MATRIX=1 runs every
non-default (variant, detector) combination. The default (full, relative) is tests/test_engine.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import polars as pl
import pytest
from test_engine import TABLES, first_difference, main_spec

from meshheal_jax import engine, reference
from meshheal_jax.config import DETECTORS, VARIANTS, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import Pair, load_pair

N_TASKS = 168
SEEDS = (0, 1)
if os.environ.get("MESHHEAL_FULL_MATRIX"):
    CONFIGS = [(v, d) for v in VARIANTS for d in DETECTORS if (v, d) != ("full", "relative")]
else:
    CONFIGS = [("single_reviewer", "absolute"), ("no_takeover", "cusum")]


def harsh_pair() -> Pair:
    """Every review sample and committee score is 0.00: every output goes to the committee and
    is judged low (a hand-built situation where each Takeover mechanism must act)."""
    base = load_pair("default")

    def harsh(m):
        zero = {key: (1.0, 0.0, 0.0, 0.0) for key in m.review}
        return dataclasses.replace(m, review=zero, round2=dict(zero))

    return Pair("harsh", harsh(base.strong), harsh(base.weak))


def with_pair(spec: engine.StreamSpec, pair: Pair) -> engine.StreamSpec:
    return dataclasses.replace(spec, pair=pair, labels={**spec.labels, "pair": pair.name})


@dataclasses.dataclass
class Run:
    protocol: ProtocolParams
    specs: list[engine.StreamSpec]
    jax: list[dict[str, pl.DataFrame]]
    ref: list[reference.StreamRecords]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def run(request) -> Run:
    """bbh seeds 0 and 1 (default pair) and seed 0 with the harsh pair, both engines; the two
    JAX calls share one compiled program (same shapes and static configuration)."""
    variant, detector = request.param
    protocol = ProtocolParams(variant=variant, detector=detector)
    default = [main_spec("bbh", s, N_TASKS) for s in SEEDS]
    harsh = [with_pair(main_spec("bbh", 0, N_TASKS), harsh_pair())]
    results = engine.run_streams(default, protocol) + engine.run_streams(harsh, protocol)
    specs = default + harsh
    refs = [reference.run_stream(s.network, protocol, s.pair, s.stream, s.schedule, s.labels) for s in specs]
    return Run(protocol, specs, results, refs)


def frames(rows: reference.StreamRecords) -> dict[str, pl.DataFrame]:
    from meshheal_jax import metrics

    return {name: metrics.frame(name, getattr(rows, name)) for name in TABLES}


# ----------------------------------------------------------------------------------------------
# Exactness: JAX engine == reference, every table, every row
# ----------------------------------------------------------------------------------------------


def test_jax_equals_reference_record_by_record(run):
    for spec, tables, ref in zip(run.specs, run.jax, run.ref):
        for table in TABLES:
            problem = first_difference(getattr(ref, table), tables[table], table)
            assert problem is None, f"{run.protocol.variant}/{run.protocol.detector} {spec.labels}: {problem}"


def test_streams_exercise_the_detector(run):
    """The default-pair streams isolate someone and report the detector's statistic."""
    states = pl.concat([run.jax[k]["states"] for k in range(len(SEEDS))])
    assert states.filter(pl.col("to") == "isolated").height > 0
    reasons = set(states["reason"])
    if run.protocol.detector == "cusum":
        assert reasons <= {"S>=h/2", "S>=h", "S<h/2", "probe S<h"} and "S>=h" in reasons
    else:
        assert reasons <= {"z>=alpha", "consecutive z>=beta", "z<alpha", "probe z<beta"}


# ----------------------------------------------------------------------------------------------
# Mechanisms: the ablation switches remove what they name (both engines' records)
# ----------------------------------------------------------------------------------------------


def outputs_with_calls(tables: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """One row per (reviewed output, call), the call's kind and agent beside the review."""
    reviews = tables["reviews"].select("t", "visit", "author", "reviewer", "committee", "committee_a",
                                       "committee_b", "takeover")  # fmt: skip
    calls = tables["calls"].filter(pl.col("author") >= 0).select("t", "visit", "author", "kind", "agent")
    return reviews.join(calls, on=["t", "visit", "author"], how="inner")


def both_engines(run: Run, k: int) -> list[dict[str, pl.DataFrame]]:
    return [run.jax[k], frames(run.ref[k])]


def test_single_reviewer_is_committee_and_synthesiser(run):
    if run.protocol.variant != "single_reviewer":
        pytest.skip("single_reviewer only")
    harsh = len(run.specs) - 1
    for tables in both_engines(run, harsh):
        reviews = tables["reviews"]
        assert reviews.height > 20
        # every output: committee of the initial reviewer alone, judged low, replaced
        assert reviews["committee"].all() and reviews["takeover"].all()
        assert (reviews["committee_a"] == reviews["reviewer"]).all()
        assert (reviews["committee_b"] == reviews["reviewer"]).all()
        joined = outputs_with_calls(tables)
        assert joined.filter(pl.col("kind") == "candidate").height == 0  # no candidates
        not_generate = joined.filter(pl.col("kind") != "generate")
        assert (not_generate["agent"] == not_generate["reviewer"]).all()  # nobody else is asked
        per_output = joined.group_by("t", "visit", "author").agg(
            (pl.col("kind") == k).sum().alias(k) for k in ("review", "committee1", "committee2", "synthesis")
        )
        assert (per_output["review"] == 3).all() and (per_output["committee1"] == 2).all()
        assert (per_output["committee2"] == 2).all() and (per_output["synthesis"] == 1).all()
    # and on the ordinary streams: committee members and synthesiser are the initial reviewer
    for k in range(len(SEEDS)):
        for tables in both_engines(run, k):
            rows = tables["reviews"].filter(pl.col("committee"))
            assert rows.height > 0 and rows["takeover"].any()
            assert (
                (rows["committee_a"] == rows["reviewer"]) & (rows["committee_b"] == rows["reviewer"])
            ).all()
            joined = outputs_with_calls(tables)
            synth = joined.filter(pl.col("kind") == "synthesis")
            assert synth.height == tables["reviews"]["takeover"].sum()
            assert (synth["agent"] == synth["reviewer"]).all()
            assert joined.filter(pl.col("kind") == "candidate").height == 0


def test_no_takeover_never_emits_candidates_or_synthesis(run):
    if run.protocol.variant != "no_takeover":
        pytest.skip("no_takeover only")
    for k in range(len(run.specs)):
        for tables in both_engines(run, k):
            kinds = set(tables["calls"]["kind"])
            assert not kinds & {"candidate", "synthesis"}
            reviews = tables["reviews"]
            assert not reviews["takeover"].any()
            assert (reviews["correct_after"] == reviews["correct_before"]).all()
            # the switch mattered: committees judged outputs low and they stayed
            assert reviews.filter(pl.col("committee") & (pl.col("q") <= 0.40 + 1e-9)).height > 0
    for tables in both_engines(run, len(run.specs) - 1):  # harsh: every output low, none replaced
        reviews = tables["reviews"]
        assert reviews["committee"].all() and (reviews["q"] == 0.0).all()
        joined = outputs_with_calls(tables)
        per_output = joined.group_by("t", "visit", "author").agg(pl.len().alias("calls"))
        assert (per_output["calls"] == 1 + 3 + 4).all()  # generate, review, committee: nothing after


# ----------------------------------------------------------------------------------------------
# The JAX detectors on hand-built situations, against the reference and a hand computation
# ----------------------------------------------------------------------------------------------

T, S, AUTHOR = 0, 2, 0


def jax_detector(detector: str, **fields):
    protocol = ProtocolParams(detector=detector, **fields)
    spec = main_spec("bbh", 0, 42)
    cfg = engine.engine_config([spec], protocol, 1)
    params = engine.make_params(protocol, spec.pair, spec.network.profile, 6)
    world = engine.make_world(spec.network, spec.stream, spec.schedule)
    ref = reference.ReferenceNetwork(spec.network, protocol, 7)
    return cfg, params, world, engine.initial_net(cfg, world), ref, protocol


@functools.cache
def jitted_observe(detector: str):
    return jax.jit(functools.partial(engine.observe, detector=detector))


def observe_both(detector: str, scores: list[float], t0: int, **fields):
    """Feed the same scores to both engines' detectors (author 0, one key; `fields`: other protocol
    parameters); yield per step (jax observation, jax net, reference outcome, reference network)."""
    cfg, params, world, net, ref, protocol = jax_detector(detector, **fields)
    warmup = protocol.warmup_tasks(6)
    for k, q in enumerate(scores):
        net, obs = jitted_observe(cfg.detector)(params, world, net, AUTHOR, T, S, jnp.float64(q),
                                                jnp.int32(t0 + k), jnp.bool_(True))  # fmt: skip
        out = ref.observe(AUTHOR, T, S, q, t0 + k, warmup)
        yield obs, net, out, ref


def check_same(obs, out) -> None:
    names = engine.STATE_NAMES
    assert (names[int(obs.before)], names[int(obs.after)]) == (out["from"], out["to"])
    assert engine.REASON_NAMES[int(obs.reason)] == out["reason"]
    assert bool(obs.z_defined) == (out["z"] is not None)
    if out["z"] is not None:
        assert float(obs.z) == out["z"]  # same formula, same float64 operations: exact


def test_jax_absolute_isolates_at_its_threshold_exactly():
    """Own mean exactly 0.50: z_abs = 1.9999999999999996, a beta crossing by the tolerance only."""
    steps = list(observe_both("absolute", [0.5, 0.5, 0.5, 0.5], 40))
    for obs, _, out, _ in steps:
        check_same(obs, out)
    (obs3, _, _, _), (obs4, net4, _, _) = steps[2], steps[3]
    assert float(obs3.z) == (0.70 - 0.5) / 0.10 < 2.0
    assert engine.STATE_NAMES[int(obs3.after)] == "watched" and int(net4.probe_timer[AUTHOR]) == 43
    assert engine.REASON_NAMES[int(obs4.reason)] == "consecutive z>=beta"
    assert engine.STATE_NAMES[int(obs4.after)] == "isolated"
    # just above the threshold: no count, so no isolation
    steps = list(observe_both("absolute", [0.5 + 1e-8] * 4, 40))
    for obs, _, out, _ in steps:
        check_same(obs, out)
    assert engine.STATE_NAMES[int(steps[-1][0].after)] == "watched"


@pytest.mark.parametrize("scale, floor", [(0.20, 0.10), (0.10, 0.30)])
def test_absolute_z_divides_by_absolute_scale_not_the_relative_floor(scale, floor):
    """decisions V4: z_abs = (absolute_threshold - window mean) / absolute_scale. Its default, 0.10,
    equals the relative detector's z_scale_floor; set apart, z_abs follows absolute_scale alone (a
    mutation reading z_scale_floor passed every test while both were 0.10)."""
    steps = list(observe_both("absolute", [0.5, 0.5, 0.5], 40, absolute_scale=scale, z_scale_floor=floor))
    for obs, _, out, _ in steps:
        check_same(obs, out)
    obs = steps[-1][0]
    assert float(obs.z) == pytest.approx((0.70 - 0.5) / scale)
    assert engine.STATE_NAMES[int(obs.after)] == ("normal" if scale == 0.20 else "watched")  # alpha 1.2


# hand computation: S_k = max(0, S_{k-1} + (0.85 - q_k) - 0.05)
CUSUM_QS = (1.0, 0.5, 0.25, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
CUSUM_S = (0.0, 0.30, 0.85, 1.65, 1.45, 1.25, 1.05, 0.85, 0.65, 0.45)
CUSUM_STATES = ("normal", "normal", "watched", "isolated", "isolated", "isolated", "isolated", "watched",
                "watched", "normal")  # fmt: skip


def test_jax_cusum_statistic_against_hand_computation():
    for k, (obs, net, out, ref) in enumerate(observe_both("cusum", list(CUSUM_QS), 50)):
        check_same(obs, out)
        s = float(net.cusum[AUTHOR, T, S])
        assert s == pytest.approx(CUSUM_S[k], abs=1e-12) and s == ref.cusum[(AUTHOR, T, S)]
        assert engine.STATE_NAMES[int(obs.after)] == CUSUM_STATES[k]
        assert int(net.consecutive[AUTHOR]) == 0
    assert int(net.probe_timer[AUTHOR]) == 53
    assert float(jnp.abs(net.cusum).sum() - net.cusum[AUTHOR, T, S]) == 0.0  # one key only


def test_detector_warmup_blocks_transitions_in_both_engines():
    for detector in ("absolute", "cusum"):
        for obs, _, out, _ in observe_both(detector, [0.0] * 5, 27):  # t = 27..31, warm-up 30
            check_same(obs, out)
        assert out["to"] != "normal" and out["z"] is not None  # formed at t = 31 only


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


def test_engine_config_carries_variant_and_detector_statically():
    spec = main_spec("bbh", 0, 42)
    default = engine.engine_config([spec], ProtocolParams(), 1)
    assert (default.variant, default.detector) == ("full", "relative")
    cfg = engine.engine_config([spec], ProtocolParams(variant="no_takeover", detector="cusum"), 1)
    assert (cfg.variant, cfg.detector) == ("no_takeover", "cusum")
    assert hash(cfg) != hash(default)  # a different compiled program
    net = engine.initial_net(default, engine.make_world(spec.network, spec.stream, spec.schedule))
    assert net.cusum.shape == (0,)  # the default carries no CUSUM state


def test_unknown_names_are_rejected():
    with pytest.raises(MeshHealError, match="unknown MeshHeal variant"):
        ProtocolParams(variant="committee_free")
    with pytest.raises(MeshHealError, match="unknown detector"):
        ProtocolParams(detector="ewma")
