"""The peer-relative detector (spec/protocol.md §5) and recovery probes (§6), reference engine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import reference as R
from meshheal_jax import topology
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError

P = ProtocolParams()
NORMAL, WATCHED, ISOLATED = R.NORMAL, R.WATCHED, R.ISOLATED
T, S = 0, 2  # task type object_counting, ability spatial (BBH)
WARMUP = P.warmup_tasks(6)


# ----------------------------------------------------------------------------------------------
# next_state: every transition rule of §5 step 9
# ----------------------------------------------------------------------------------------------


def test_defaults():
    assert (P.alpha, P.beta, P.consecutive_to_isolate, P.threshold_tol) == (1.2, 2.0, 2, 1e-9)
    assert WARMUP == 30 and P.warmup_tasks(12) == 60


def test_normal_to_watched_at_alpha_exactly():
    assert R.next_state(NORMAL, 0, 1.2, P) == (WATCHED, 0, "z>=alpha")


def test_alpha_tolerance_favours_crossing():
    assert R.next_state(NORMAL, 0, 1.2 - 1e-10, P)[0] == WATCHED
    assert R.next_state(NORMAL, 0, 1.2 - 1e-6, P) == (NORMAL, 0, "")


def test_normal_stays_below_alpha():
    assert R.next_state(NORMAL, 0, 0.0, P) == (NORMAL, 0, "")
    assert R.next_state(NORMAL, 0, -5.0, P) == (NORMAL, 0, "")


def test_watched_to_normal_when_z_below_alpha():
    assert R.next_state(WATCHED, 0, 1.2 - 1e-6, P) == (NORMAL, 0, "z<alpha")
    assert R.next_state(WATCHED, 1, 0.0, P) == (NORMAL, 0, "z<alpha")


def test_watched_stays_between_alpha_and_beta():
    assert R.next_state(WATCHED, 0, 1.2, P) == (WATCHED, 0, "")
    assert R.next_state(WATCHED, 0, 1.99, P) == (WATCHED, 0, "")


def test_first_beta_crossing_counts_but_does_not_isolate():
    assert R.next_state(NORMAL, 0, 2.0, P) == (WATCHED, 1, "z>=alpha")
    assert R.next_state(WATCHED, 0, 2.0, P) == (WATCHED, 1, "")
    assert R.next_state(WATCHED, 0, 2.0 - 1e-10, P)[1] == 1  # beta tolerance
    assert R.next_state(WATCHED, 0, 2.0 - 1e-6, P)[1] == 0


def test_two_consecutive_beta_from_normal():
    state, c, _ = R.next_state(NORMAL, 0, 2.5, P)
    assert (state, c) == (WATCHED, 1)
    assert R.next_state(state, c, 2.0, P) == (ISOLATED, 0, "consecutive z>=beta")
    # a normal agent already holding one count isolates directly
    assert R.next_state(NORMAL, 1, 2.0, P) == (ISOLATED, 0, "consecutive z>=beta")


def test_two_consecutive_beta_from_watched():
    state, c, _ = R.next_state(WATCHED, 0, 3.0, P)
    assert (state, c) == (WATCHED, 1)
    assert R.next_state(state, c, 3.0, P) == (ISOLATED, 0, "consecutive z>=beta")


def test_counter_resets_after_z_below_beta():
    state, c = WATCHED, 1
    state, c, _ = R.next_state(state, c, 1.5, P)  # z < beta: reset (still watched)
    assert (state, c) == (WATCHED, 0)
    state, c, _ = R.next_state(state, c, 2.0, P)  # only one in a row now
    assert (state, c) == (WATCHED, 1)
    state, c, _ = R.next_state(state, c, 2.0, P)
    assert (state, c) == (ISOLATED, 0)


def test_isolated_to_watched_only_below_beta():
    assert R.next_state(ISOLATED, 0, 1.99, P) == (WATCHED, 0, "probe z<beta")
    assert R.next_state(ISOLATED, 0, -1.0, P) == (WATCHED, 0, "probe z<beta")
    assert R.next_state(ISOLATED, 0, 2.0 - 1e-10, P)[0] == ISOLATED  # tolerance: crossing beta


@pytest.mark.parametrize("counter", [0, 1, 2, 5])
def test_isolated_stays_with_z_at_or_above_beta(counter):
    state, c, reason = R.next_state(ISOLATED, counter, 2.0, P)
    assert state == ISOLATED and reason == ""
    assert c == counter + 1  # the counter still counts, windows are not reset


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([NORMAL, WATCHED, ISOLATED]),
    st.integers(0, 3),
    st.floats(-10, 10, allow_nan=False),
)
def test_next_state_properties(state, counter, z):
    new, c, reason = R.next_state(state, counter, z, P)
    crossed_beta = z >= P.beta - 1e-9
    assert (reason != "") == (new != state)
    if new == ISOLATED and state != ISOLATED:
        assert c == 0  # entering isolated resets the counter
    elif not crossed_beta:
        assert c == 0
    else:
        assert c == counter + 1
    if state == NORMAL:
        assert new in (NORMAL, WATCHED, ISOLATED)
        assert (new == NORMAL) == (z < P.alpha - 1e-9)
    if state == ISOLATED:
        assert new in (ISOLATED, WATCHED)  # never straight back to normal


# ----------------------------------------------------------------------------------------------
# quantile (protocol.md §5 step 8) against numpy's linear interpolation
# ----------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=30),
    st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
)
def test_quantile_matches_numpy_linear(values, q):
    values = sorted(values)
    assert R.quantile(values, q) == pytest.approx(float(np.quantile(values, q, method="linear")), abs=1e-12)


def test_quantile_examples():
    assert R.quantile([0.0, 0.1, 0.2, 0.3, 0.4], 0.25) == pytest.approx(0.1)
    assert R.quantile([0.0, 1.0], 0.25) == 0.25
    assert R.quantile([1.0, 2.0, 4.0, 8.0], 0.5) == 3.0
    assert R.quantile([7.0], 0.25) == 7.0


# ----------------------------------------------------------------------------------------------
# observe() on a hand-built 6-agent complete network
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def world() -> R.ReferenceNetwork:
    net = topology.build_network(topology.load_profile("bbh"), 6)
    return R.ReferenceNetwork(net, P, 7)


def give_peer(world, j, score=1.0, shortfall=0.0, n_shortfalls=3, task_type=T, ability=S):
    """Peer j: a score window for (type, ability) and n shortfalls of the given value."""
    key = (j, task_type, ability)
    world.scores[key].push(score)
    for _ in range(n_shortfalls):
        world.shortfalls[key].push(shortfall)
    world.n_shortfalls[key] = n_shortfalls


def prime(world, peers=(1, 2, 3, 4, 5), **kw):
    for j in peers:
        give_peer(world, j, **kw)


def test_at_least_three_shortfalls_before_any_transition(world):
    prime(world)
    key = (0, T, S)
    results = [world.observe(0, T, S, 0.0, t, WARMUP) for t in (100, 101, 102)]
    assert [r["z"] for r in results[:2]] == [None, None]
    assert [r["to"] for r in results[:2]] == [NORMAL, NORMAL]
    assert world.n_shortfalls[key] == 3 and world.shortfalls[key].filled() == 3
    # third: xbar = 1.0, C = five zeros -> m = p25 = 0, z = 1.0 / 0.10
    assert results[2]["z"] == pytest.approx(10.0)
    assert (results[2]["from"], results[2]["to"], results[2]["reason"]) == (NORMAL, WATCHED, "z>=alpha")
    assert world.state[0] == WATCHED and world.consecutive[0] == 1


def test_isolation_sets_probe_timer_and_resets_counter(world):
    prime(world)
    for t in (50, 51, 52):
        world.observe(0, T, S, 0.0, t, WARMUP)
    assert world.state[0] == WATCHED
    out = world.observe(0, T, S, 0.0, 57, WARMUP)
    assert (out["from"], out["to"], out["reason"]) == (WATCHED, ISOLATED, "consecutive z>=beta")
    assert world.state[0] == ISOLATED
    assert world.consecutive[0] == 0
    assert world.probe_timer[0] == 57
    # probe_eligible exactly when t - timer >= 10
    assert not world.probe_eligible(0, 66)
    assert world.probe_eligible(0, 67)
    assert world.probe_eligible(0, 200)
    # isolated agents leave the peer sets of others
    assert 0 not in world.reviewers(1, [S])


def test_probe_eligibility_needs_isolated_state(world):
    assert world.probe_timer == [0] * 6
    assert not any(world.probe_eligible(i, 500) for i in range(6))  # never isolated
    world.state[2] = WATCHED
    assert not world.probe_eligible(2, 500)
    world.state[2], world.probe_timer[2] = ISOLATED, 40
    assert [world.probe_eligible(2, t) for t in (40, 49, 50, 51)] == [False, False, True, True]


def test_probe_output_below_beta_moves_isolated_to_watched(world):
    prime(world)
    world.state[0], world.probe_timer[0] = ISOLATED, 40
    for _ in range(3):  # own history: three shortfalls of 1.0
        world.shortfalls[(0, T, S)].push(1.0)
    world.n_shortfalls[(0, T, S)] = 3
    # a good probe score: x = 1.0 - 1.0 = 0, xbar = (1+1+1+0)/4 = 0.75 -> z = 7.5: stays isolated
    out = world.observe(0, T, S, 1.0, 50, WARMUP)
    assert out["z"] == pytest.approx(7.5) and out["to"] == ISOLATED
    assert world.probe_timer[0] == 40  # staying isolated does not reset the timer
    for t in range(51, 60):  # window of 8 fills with zeros
        out = world.observe(0, T, S, 1.0, t, WARMUP)
        if out["to"] != ISOLATED:
            break
    assert (out["from"], out["to"], out["reason"]) == (ISOLATED, WATCHED, "probe z<beta")
    assert out["z"] < 2.0


def test_no_shortfall_when_no_peer_has_a_score_window(world):
    out = world.observe(0, T, S, 0.25, 100, WARMUP)
    key = (0, T, S)
    assert out == {"z": None, "from": NORMAL, "to": NORMAL, "reason": ""}
    assert world.scores[key].filled() == 1 and world.scores[key].mean() == 0.25  # score pushed
    assert world.shortfalls[key].filled() == 0 and world.n_shortfalls[key] == 0  # shortfall not


def test_peer_windows_of_another_key_do_not_count(world):
    prime(world, task_type=1)  # peers have evidence for another task type only
    world.observe(0, T, S, 0.0, 100, WARMUP)
    assert world.n_shortfalls[(0, T, S)] == 0
    assert world.scores[(0, T, S)].filled() == 1


def test_watched_and_isolated_peers_are_not_in_the_reference(world):
    prime(world)
    for j in (1, 2, 3, 4, 5):
        world.state[j] = WATCHED if j % 2 else ISOLATED
    world.observe(0, T, S, 0.0, 100, WARMUP)
    assert world.n_shortfalls[(0, T, S)] == 0
    assert world.scores[(0, T, S)].filled() == 1
    # one normal peer with mean 0.5: reference = 0.5, shortfall 0.5 - 0.0
    world.state[3] = NORMAL
    world.scores[(3, T, S)].push(0.0)  # peer 3 window now {1.0, 0.0}
    world.observe(0, T, S, 0.0, 101, WARMUP)
    assert world.n_shortfalls[(0, T, S)] == 1
    assert world.shortfalls[(0, T, S)].mean() == pytest.approx(0.5)


def test_reference_is_the_mean_of_peer_means(world):
    give_peer(world, 1, score=1.0)
    give_peer(world, 2, score=0.5)
    world.scores[(2, T, S)].push(0.0)  # peer 2 mean = 0.25
    world.observe(0, T, S, 0.25, 100, WARMUP)
    # qbar = (1.0 + 0.25) / 2 = 0.625, x = 0.625 - 0.25
    assert world.shortfalls[(0, T, S)].mean() == pytest.approx(0.375)


@pytest.mark.parametrize("t, formed", [(WARMUP - 1, False), (WARMUP, False), (WARMUP + 1, True)])
def test_warmup_blocks_transitions(world, t, formed):
    prime(world)
    key = (0, T, S)
    for _ in range(3):
        world.shortfalls[key].push(1.0)
    world.n_shortfalls[key] = 3
    out = world.observe(0, T, S, 0.0, t, WARMUP)
    assert world.n_shortfalls[key] == 4  # evidence is recorded during warm-up
    if formed:
        assert out["z"] == pytest.approx(10.0) and world.state[0] == WATCHED
    else:
        assert out["z"] is None and world.state[0] == NORMAL and world.consecutive[0] == 0


def test_empty_reference_set_C_means_no_transition(world):
    prime(world, n_shortfalls=2)  # peers have score windows but fewer than 3 shortfalls each
    key = (0, T, S)
    for t in (100, 101, 102, 103, 104):
        out = world.observe(0, T, S, 0.0, t, WARMUP)
        assert out["z"] is None and out["to"] == NORMAL
    assert world.n_shortfalls[key] == 5  # shortfalls still recorded


def test_C_uses_every_ability_of_normal_neighbours(world):
    # peers' evidence for type T under OTHER abilities counts in C (s' any ability)
    prime(world, n_shortfalls=0)  # P non-empty via scores for (T, S), no shortfalls for S
    for j, x in zip((1, 2, 3, 4, 5), (0.0, 0.1, 0.2, 0.3, 0.4)):
        give_peer(world, j, shortfall=x, ability=0)
    key = (0, T, S)
    for _ in range(2):
        world.shortfalls[key].push(0.5)
    world.n_shortfalls[key] = 2
    out = world.observe(0, T, S, 0.5, 100, WARMUP)  # x = 1.0 - 0.5 = 0.5 -> xbar = 0.5
    # C = [0, .1, .2, .3, .4]: m = 0.2, p25 = 0.1, scale = max(0.1, 0.10) -> z = 3.0
    assert out["z"] == pytest.approx(3.0)


def test_z_scale_floor(world):
    prime(world, n_shortfalls=0)
    for j, x in zip((1, 2, 3, 4, 5), (0.0, 0.4, 0.8, 1.2, 1.6)):
        give_peer(world, j, shortfall=x, ability=0)
    key = (0, T, S)
    for _ in range(2):
        world.shortfalls[key].push(2.0)
    world.n_shortfalls[key] = 2
    out = world.observe(0, T, S, 0.0, 100, WARMUP)  # xbar = (2 + 2 + 1) / 3
    # m = 0.8, p25 = 0.4: scale 0.4 > floor
    assert out["z"] == pytest.approx((5.0 / 3.0 - 0.8) / 0.4)


def test_z_exactly_alpha_via_observe(world):
    prime(world)
    key = (0, T, S)
    for _ in range(2):
        world.shortfalls[key].push(0.12)
    world.n_shortfalls[key] = 2
    out = world.observe(0, T, S, 0.88, 100, WARMUP)  # x = 1.0 - 0.88: z = 0.12 / 0.10 ~ 1.2
    assert out["z"] == pytest.approx(1.2)
    assert out["to"] == WATCHED  # crossing within the 1e-9 tolerance


def test_score_window_keeps_last_eight(world):
    key = (0, T, S)
    for k in range(10):
        world.observe(0, T, S, float(k), 1, WARMUP)
    assert world.scores[key].filled() == 8
    assert world.scores[key].mean() == pytest.approx(sum(range(2, 10)) / 8)


def test_window_ring_buffer():
    w = R.Window(3)
    for x in (1.0, 2.0, 3.0, 4.0):
        w.push(x)
    assert w.slots == [4.0, 2.0, 3.0] and w.filled() == 3 and w.count == 4
    assert w.mean() == 3.0


# ----------------------------------------------------------------------------------------------
# Detector variants (baselines.md "Detector variants"): absolute and CUSUM, reference engine
# ----------------------------------------------------------------------------------------------

P_ABS = ProtocolParams(detector="absolute")
P_CUSUM = ProtocolParams(detector="cusum")


def variant_world(params: ProtocolParams) -> R.ReferenceNetwork:
    return R.ReferenceNetwork(topology.build_network(topology.load_profile("bbh"), 6), params, 7)


def test_detector_defaults_and_validation():
    assert (P.variant, P.detector) == ("full", "relative")
    assert (P.absolute_threshold, P.absolute_scale) == (0.70, 0.10)
    assert (P.cusum_target, P.cusum_k, P.cusum_h) == (0.85, 0.05, 1.0)
    with pytest.raises(MeshHealError, match="unknown detector 'page'.*relative, absolute, cusum"):
        ProtocolParams(detector="page")
    with pytest.raises(MeshHealError, match="unknown MeshHeal variant 'solo'.*single_reviewer, no_takeover"):
        ProtocolParams(variant="solo")
    with pytest.raises(MeshHealError, match="absolute_scale"):
        ProtocolParams(absolute_scale=0.0)
    with pytest.raises(MeshHealError, match="cusum_h"):
        ProtocolParams(cusum_h=0.0)


def test_absolute_isolates_at_its_threshold_exactly():
    """Own mean 0.50: z_abs = (0.70 - 0.50) / 0.10 = 1.9999999999999996 in float64, a beta
    crossing only through the 1e-9 tolerance; two in a row isolate. No peer evidence is needed."""
    world = variant_world(P_ABS)
    outs = [world.observe(0, T, S, 0.5, t, WARMUP) for t in (40, 41, 42)]
    assert [o["z"] for o in outs[:2]] == [None, None]  # fewer than 3 scores
    z = outs[2]["z"]
    assert z == (0.70 - 0.5) / 0.10 and z < 2.0  # below beta by rounding only
    assert (outs[2]["to"], outs[2]["reason"], world.consecutive[0]) == (WATCHED, "z>=alpha", 1)
    out = world.observe(0, T, S, 0.5, 43, WARMUP)
    assert (out["from"], out["to"], out["reason"]) == (WATCHED, ISOLATED, "consecutive z>=beta")
    assert world.probe_timer[0] == 43 and world.consecutive[0] == 0
    assert world.n_shortfalls[(0, T, S)] == 0  # the absolute detector records no shortfalls


def test_absolute_just_above_threshold_does_not_count():
    world = variant_world(P_ABS)
    for t in (40, 41, 42, 43):
        out = world.observe(0, T, S, 0.5 + 1e-8, t, WARMUP)  # z = 1.9999999: beyond the tolerance
    assert out["to"] == WATCHED and world.consecutive[0] == 0


def test_absolute_watched_band_and_recovery():
    world = variant_world(P_ABS)
    for t, q in zip((40, 41, 42), (1.0, 0.5, 0.25)):  # mean 0.58333: z = 1.1667 < alpha
        out = world.observe(0, T, S, q, t, WARMUP)
    assert out["z"] == pytest.approx((0.70 - 1.75 / 3) / 0.10) and out["to"] == NORMAL
    out = world.observe(0, T, S, 0.25, 44, WARMUP)  # mean 0.5: counted, watched
    assert (out["to"], world.consecutive[0]) == (WATCHED, 1)
    out = world.observe(0, T, S, 1.0, 45, WARMUP)  # mean 0.6: z = 1.0 < alpha
    assert (out["to"], out["reason"], world.consecutive[0]) == (NORMAL, "z<alpha", 0)


def test_absolute_warmup_and_window():
    world = variant_world(P_ABS)
    for t in range(1, WARMUP + 1):
        out = world.observe(0, T, S, 0.0, t, WARMUP)
        assert out["z"] is None and world.state[0] == NORMAL
    states = []
    for k in range(8):  # ones replace the warm-up zeros in the window of 8: mean (k + 1) / 8
        out = world.observe(0, T, S, 1.0, WARMUP + 1 + k, WARMUP)
        states.append(out["to"])
    assert out["z"] == pytest.approx(-3.0)
    # z = 5.75, 4.5 (isolated), 3.25, 2.0 (within tolerance: stays), 0.75 (watched), -0.5 (normal)
    assert states == [WATCHED, ISOLATED, ISOLATED, ISOLATED, WATCHED, NORMAL, NORMAL, NORMAL]


# hand computation: S_k = max(0, S_{k-1} + (0.85 - q_k) - 0.05)
CUSUM_QS = (1.0, 0.5, 0.25, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
CUSUM_S = (0.0, 0.30, 0.85, 1.65, 1.45, 1.25, 1.05, 0.85, 0.65, 0.45)
CUSUM_STATES = (NORMAL, NORMAL, WATCHED, ISOLATED, ISOLATED, ISOLATED, ISOLATED, WATCHED, WATCHED, NORMAL)
CUSUM_REASONS = ("", "", "S>=h/2", "S>=h", "", "", "", "probe S<h", "", "S<h/2")


def test_cusum_statistic_and_transitions_against_hand_computation():
    world = variant_world(P_CUSUM)
    for k, (q, s_hand, state, reason) in enumerate(zip(CUSUM_QS, CUSUM_S, CUSUM_STATES, CUSUM_REASONS)):
        out = world.observe(0, T, S, q, 50 + k, WARMUP)
        assert world.cusum[(0, T, S)] == pytest.approx(s_hand, abs=1e-12)
        assert (out["to"], out["reason"]) == (state, reason), k
        if k < 2:
            assert out["z"] is None  # fewer than 3 scores: S grows, no decision yet
        else:
            assert out["z"] == world.cusum[(0, T, S)]  # the statistic is reported as z
    assert world.probe_timer[0] == 53  # set on entering isolated
    assert world.consecutive[0] == 0  # CUSUM does not use the consecutive counter
    assert world.cusum[(0, T, 0)] == 0.0 and world.cusum[(1, T, S)] == 0.0  # per (agent, type, ability)


def test_cusum_accumulates_during_warmup_without_transitions():
    world = variant_world(P_CUSUM)
    for t in range(WARMUP - 3, WARMUP + 1):
        out = world.observe(0, T, S, 0.0, t, WARMUP)
        assert out["z"] is None and world.state[0] == NORMAL
    assert world.cusum[(0, T, S)] == pytest.approx(4 * 0.80)
    out = world.observe(0, T, S, 1.0, WARMUP + 1, WARMUP)  # S = 3.2 - 0.2 = 3.0 >= h: isolated at once
    assert (out["to"], out["reason"]) == (ISOLATED, "S>=h") and out["z"] == pytest.approx(3.0)


def test_cusum_thresholds_with_tolerance():
    assert R.next_state_cusum(NORMAL, 0.5 - 1e-10, P_CUSUM) == (WATCHED, "S>=h/2")
    assert R.next_state_cusum(NORMAL, 0.5 - 1e-6, P_CUSUM) == (NORMAL, "")
    assert R.next_state_cusum(NORMAL, 1.0 - 1e-10, P_CUSUM) == (ISOLATED, "S>=h")
    assert R.next_state_cusum(WATCHED, 0.9, P_CUSUM) == (WATCHED, "")
    assert R.next_state_cusum(WATCHED, 0.4, P_CUSUM) == (NORMAL, "S<h/2")
    assert R.next_state_cusum(ISOLATED, 1.0, P_CUSUM) == (ISOLATED, "")
    assert R.next_state_cusum(ISOLATED, 0.2, P_CUSUM) == (WATCHED, "probe S<h")  # one step at a time
    assert R.cusum_update(0.0, 1.0, P_CUSUM) == 0.0  # never below zero
