"""The round's detector updates (`engine.observe_round`: waves of non-conflicting observations,
each read at once and written in one scatter) equal the observations taken one by one in task order
(`engine.observe` in a loop), on a network taken from the middle of a real 96-agent sparse run, for
random rounds with repeated authors, neighbours and slots without evidence; for every detector.
Observations without evidence write nothing and are never recorded, so only the network and the
observations with evidence are compared."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import engine, runner
from meshheal_jax.config import ProtocolParams

SLOTS = 16


@functools.cache
def mid_run(detector: str):
    """(params, world, net) after 2,000 rounds of a 96-agent sparse stream: past the midpoint, so degraded
    agents are flagged under every detector (before it, the absolute one may flag nobody)."""
    exp = runner.Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=(0,), n_agents=96,
                            n_tasks=504 * 16, degraded=None, topology="sparse", slots=SLOTS)  # fmt: skip
    network, stream, pair, labels = runner._stream_inputs(exp, "bbh", "default", 0)
    spec = engine.StreamSpec(network, stream, exp.schedule(), pair, labels)
    protocol = dataclasses.replace(ProtocolParams(), detector=detector)
    cfg = engine.engine_config([spec], protocol, SLOTS)
    params = engine.make_params(protocol, pair, network.profile, cfg.n_agents)
    worlds = engine.stack([engine.make_world(network, stream, exp.schedule())])
    carry = engine.initial_carries(cfg, worlds)
    carry, _ = engine.run_rounds(cfg, params, worlds, carry, 2000, False)
    net = engine.at(carry.net, 0)
    assert int((net.state != engine.NORMAL).sum()) > 0  # the detector is live
    return params, engine.at(worlds, 0), net


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10))
def both(detector, p, world, net, evidence, order, observations, width, later_width=None, reset="never",
         select_writes=engine.SELECT_WRITES):  # fmt: skip
    kept, engine.SELECT_WRITES = engine.SELECT_WRITES, select_writes  # read while tracing
    try:
        fast = engine.observe_round(
            p, world, net, evidence, order, observations, detector, width, later_width, reset
        )
    finally:
        engine.SELECT_WRITES = kept

    def one(n, state):
        net_, obs_ = state
        k = order[n]
        ev = engine.at(evidence, k)
        net_, o = engine.observe(
            p,
            world,
            net_,
            ev.author,
            ev.task_type,
            ev.ability,
            ev.q,
            ev.t,
            ev.valid,
            detector,
            reset,
            ev.probe,
        )
        return net_, engine.put(obs_, k, o)

    slow = jax.lax.fori_loop(0, order.shape[0], one, (net, observations))
    return fast, slow


# width 3: first-wave writers beyond the third wait; later width 1: the later waves one by one;
# reset: window_reset (an author entering or leaving isolation loses its evidence, decisions P7);
# select_writes 0: the waves' records reach their slots by a scatter, as in rounds with many slots
@pytest.mark.parametrize("width, later_width, reset, select_writes", [
    (SLOTS, None, "never", engine.SELECT_WRITES), (3, None, "never", engine.SELECT_WRITES),
    (3, 1, "never", engine.SELECT_WRITES), (SLOTS, None, "on_isolation", engine.SELECT_WRITES),
    (3, 1, "on_release", engine.SELECT_WRITES), (3, 1, "on_isolation", 0)])  # fmt: skip
@pytest.mark.parametrize("detector", ["relative", "absolute", "cusum"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_observe_round_equals_one_by_one(detector, width, later_width, reset, select_writes, data):
    p, world, net = mid_run(detector)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    evidence, order, observations = random_round(rng, net, world)
    (net_fast, obs_fast), (net_slow, obs_slow) = both(
        detector, p, world, net, evidence, order, observations, width, later_width, reset, select_writes
    )
    kept = np.asarray(evidence.valid)
    net_leaves = [
        (f"net.{f.name}", getattr(net_fast, f.name), getattr(net_slow, f.name), None)
        for f in dataclasses.fields(engine.Net)
    ]  # every field, the kept means included
    obs_leaves = [(f"obs.{f.name}", getattr(obs_fast, f.name), getattr(obs_slow, f.name), kept)
                  for f in dataclasses.fields(engine.Observation)]  # fmt: skip
    for name, a, b, mask in net_leaves + obs_leaves:
        a, b = np.asarray(a), np.asarray(b)
        if mask is not None:
            a, b = a[mask], b[mask]
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("reset, width, later_width", [("on_isolation", SLOTS, None), ("on_release", 3, 1)])
@pytest.mark.parametrize("detector", ["relative", "absolute", "cusum"])
def test_these_rounds_isolate_and_release(detector, reset, width, later_width):
    """The rounds above exercise the window resets: within 400 fixed rounds some observation's
    transition clears its author's evidence (entering isolation comes within a few rounds; leaving
    it is rarer, a probe must score well: the first release came at round 87 under the relative
    detector and 145 under CUSUM with the model files of 2026-12-06)."""
    p, world, net = mid_run(detector)
    cleared = 0
    for seed in range(400):
        evidence, order, observations = random_round(np.random.default_rng(seed), net, world)
        evidence = dataclasses.replace(evidence, probe=jnp.ones_like(evidence.probe))  # releases need probes
        _, (_, obs) = both(detector, p, world, net, evidence, order, observations, width, later_width, reset)
        cleared += int((np.asarray(engine.clears(reset, obs)) & np.asarray(evidence.valid)).sum())
        if cleared:
            break
    assert cleared > 0


def random_round(rng: np.random.Generator, net: engine.Net, world: engine.World):
    """(evidence, order, observations) of a random round of SLOTS slots."""
    n_agents = int(net.state.shape[0])
    # authors: a few hubs and their neighbours, so that rounds repeat authors and touch neighbours
    # and agents that are watched or isolated (their state moves most), with extreme scores
    flagged = np.flatnonzero(np.asarray(net.state) != engine.NORMAL)
    hubs = np.concatenate([rng.choice(flagged, size=2), rng.integers(0, n_agents, size=1)])
    nbrs = np.asarray(world.nbr)[hubs].ravel()
    pool = np.concatenate([hubs, nbrs[nbrs >= 0], rng.integers(0, n_agents, size=4)])
    author = rng.choice(pool, size=SLOTS)
    t = rng.permutation(np.arange(4000, 4000 + SLOTS))
    t[rng.random(SLOTS) < 0.2] = 0  # idle slots
    evidence = engine.Evidence(
        valid=jnp.asarray((rng.random(SLOTS) < 0.7) & (t > 0)), accepted=jnp.ones(SLOTS, bool),
        author=jnp.asarray(author, jnp.int32), task_type=jnp.asarray(rng.integers(0, 2, SLOTS), jnp.int32),
        ability=jnp.asarray(rng.integers(0, 2, SLOTS), jnp.int32),  # few cells: neighbours' writes collide
        q=jnp.asarray(rng.choice([0.0, 0.0, 0.25, 1.0, 1.0], SLOTS)), t=jnp.asarray(t, jnp.int32),
        probe=jnp.asarray(rng.random(SLOTS) < 0.5),  # a non-probe output moves no isolated author (S12)
    )  # fmt: skip
    order = jnp.argsort(jnp.where(jnp.asarray(t) > 0, jnp.asarray(t), jnp.iinfo(jnp.int32).max)).astype(
        jnp.int32
    )
    zi = jnp.zeros(SLOTS, jnp.int32)
    observations = engine.Observation(z=jnp.zeros(SLOTS), z_defined=jnp.zeros(SLOTS, bool), before=zi, after=zi,
                                      reason=zi)  # fmt: skip
    return evidence, order, observations


def test_first_wave_on_a_hand_built_round():
    # a path 0 - 1 - 2 - 3 (neighbour tables padded with -1); slots in task order 0..4
    world = engine.World(holds=None, nbr=jnp.asarray([[1, -1], [0, 2], [1, 3], [2, -1]], jnp.int32), task_type=None, difficulty=None,
                         question_tokens=None, true_pair=None, pair_abilities=None, pair_valid=None, degraded_from=None,
                         degraded_until=None, seed=None, dataset_id=None)  # fmt: skip
    authors = jnp.asarray([0, 2, 1, 3, 0], jnp.int32)
    evidence = jnp.asarray([True, True, True, False, False])
    order = jnp.arange(5, dtype=jnp.int32)
    # slot 2 (author 1) is next to 0 and 2, both written earlier; slots 3 and 4 have no evidence:
    # they write nothing and are not recorded, so they never wait
    assert engine.first_wave(world, order, authors, evidence).tolist() == [True, True, False, True, True]
    # the absolute / cusum detectors read no neighbour: only same-author order matters
    authors = jnp.asarray([0, 2, 1, 0, 2], jnp.int32)
    evidence = jnp.asarray([True, True, True, True, False])
    assert engine.first_wave(world, order, authors, evidence, "cusum").tolist() == [
        True,
        True,
        True,
        False,
        True,
    ]
    assert engine.first_wave(world, order, authors, evidence).tolist() == [True, True, False, False, True]
    # task order, not slot order: slot 3 (evidence on agent 0) first now, so slot 0 waits for it
    order = jnp.asarray([3, 0, 1, 2, 4], jnp.int32)
    assert engine.first_wave(world, order, authors, evidence, "cusum").tolist() == [
        False,
        True,
        True,
        True,
        True,
    ]


def test_median_of_3_equals_sorting():
    grid = np.array(np.meshgrid(*[[0.0, 0.25, 0.5, 1.0]] * 3)).reshape(3, -1).T
    for x in grid:
        assert float(engine.median_of_3(jnp.asarray(x))) == float(np.sort(x)[1])


FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=64).filter(
        lambda x: x != 0 or np.copysign(1, x) > 0
    ),
    st.sampled_from([0.0, 1.0, -1.0, 0.25, np.inf, 5e-324, -5e-324, 1.7976931348623157e308]),
)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda rows: st.integers(1, 45).flatmap(
            lambda n: st.lists(FLOATS, min_size=rows * n, max_size=rows * n).map(
                lambda v: np.reshape(v, (rows, n))
            )
        )
    )
)
def test_sort_floats_equals_sort(values):
    """The detector's pool sort (int64 keys in IEEE total order) gives np.sort's (= jnp.sort's) values,
    bit for bit, for any float64 without NaN or -0.0 (duplicates, +-inf, subnormals, the largest floats)."""
    got = np.asarray(jax.jit(engine.sort_floats)(jnp.asarray(values)))
    want = np.sort(values, axis=-1)
    assert got.dtype == np.float64
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-5, 5), min_size=3 * n, max_size=3 * n), st.lists(st.integers(0, n + 2), min_size=3, max_size=3),
    st.lists(st.integers(-9, 9), min_size=3, max_size=3), st.just(n))))  # fmt: skip
def test_set_at_equals_an_indexed_set(case):
    """engine.set_at (a per-slot write as a select) is x.at[k].set(v) for every k >= 0, one past
    the end and beyond included (dropped), row by row under vmap, as the engine uses it."""
    values, ks, vs, n = case
    x = np.reshape(values, (3, n)).astype(np.int32)
    ks, vs = np.asarray(ks, np.int32), np.asarray(vs, np.int32)
    got = jax.jit(jax.vmap(engine.set_at))(x, ks, vs)
    want = jax.vmap(lambda row, k, v: row.at[k].set(v))(x, ks, vs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == want.dtype


@pytest.mark.parametrize("detector", ["relative", "absolute", "cusum"])
def test_kept_means_equal_the_windows_means(detector):
    """Net keeps each window's mean next to it (peers read one value, not a window): after 2,000
    rounds every kept mean equals window_mean of its window, up to rounding."""
    _, _, net = mid_run(detector)
    for kept, window, count in ((net.score_mean, net.scores, net.score_count),
                                (net.shortfall_mean, net.shortfalls, net.shortfall_count)):  # fmt: skip
        want = np.asarray(engine.window_mean(window, count))
        np.testing.assert_allclose(np.asarray(kept), want, rtol=0, atol=1e-12)
    assert np.count_nonzero(np.asarray(net.score_mean)) > 100  # many windows were written
    if detector == "relative":
        assert np.count_nonzero(np.asarray(net.shortfall_mean)) > 100


@pytest.mark.parametrize("detector", ["relative", "absolute", "cusum"])
def test_only_a_probe_output_moves_an_isolated_author(detector):
    """decisions S12 (protocol.md §5, "isolated (only probe outputs reach here)"): with several
    slots an author can be isolated while one of its outputs is under review; that output's score
    is kept, its z recorded, and its state stays. A probe's output with the same score may release."""
    p, world, net = mid_run(detector)
    isolated = np.flatnonzero(np.asarray(net.state) == engine.ISOLATED)
    assert isolated.size
    released = 0
    for i in isolated[:8]:
        for ability in range(int(world.holds.shape[1])):
            args = (p, world, net, int(i), 0, ability, 1.0, 5000, True, detector)
            held_net, held = engine.observe(*args, probe=False)
            probe_net, by_probe = engine.observe(*args, probe=True)
            assert int(held.after) == engine.ISOLATED and int(held.reason) == 0
            assert bool(held.z_defined) == bool(by_probe.z_defined) and float(held.z) == float(by_probe.z)
            np.testing.assert_array_equal(held_net.scores, probe_net.scores)  # the evidence is kept alike
            released += int(by_probe.after) != engine.ISOLATED
    assert released > 0  # the same scores do move isolated authors when they come from probes
