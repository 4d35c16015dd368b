"""window_reset="on_isolation" (decisions P7, an extension of protocol.md §5, whose windows are
never reset): an agent entering isolation loses its evidence, in both engines alike."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine import assert_equal_to_reference, random_graph_specs, recovery_spec, routing_events

from meshheal_jax import reference
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.topology import build_network, load_profile

RESET = ProtocolParams(window_reset="on_isolation")


def isolate_agent_0(params: ProtocolParams) -> reference.ReferenceNetwork:
    """Six agents; every agent scores 1.0 on (type 0, ability 0) four times, then agent 0 scores 0
    until it is isolated (its shortfalls far above its peers', z >= beta twice in a row)."""
    profile = load_profile("math")
    net = reference.ReferenceNetwork(build_network(profile), params, len(profile.task_types))
    t = 1
    for _ in range(4):
        for i in range(6):
            net.observe(i, 0, 0, 1.0, t, warmup=0)
            t += 1
    while net.state[0] != reference.ISOLATED:
        out = net.observe(0, 0, 0, 0.0, t, warmup=0)
        assert out["z"] is not None and t < 100
        t += 1
    net.observe(0, 1, 1, 0.0, t, warmup=0)  # an isolated agent's output (a probe) on another key
    return net


@pytest.mark.parametrize("window_reset", ["never", "on_isolation"])
def test_isolation_clears_the_agents_evidence_only_when_asked(window_reset):
    net = isolate_agent_0(ProtocolParams(window_reset=window_reset))
    own = [k for k in net.scores if k[0] == 0]
    pushed = {k: net.scores[k].count for k in own if net.scores[k].count}
    if window_reset == "never":  # §5: the shortfalls that isolated it stay
        assert pushed[(0, 0, 0)] >= 6 and net.n_shortfalls[(0, 0, 0)] >= 2
    else:  # only what came after: the one output on (type 1, ability 1)
        assert pushed == {(0, 1, 1): 1} and net.n_shortfalls[(0, 0, 0)] == 0
        assert net.shortfalls[(0, 0, 0)].filled() == 0 and net.cusum[(0, 0, 0)] == 0.0
    for i in range(1, 6):  # the other agents keep theirs
        assert net.scores[(i, 0, 0)].count == 4
    # released only on fresh evidence: with on_isolation a probe forms no z before min_observations
    # shortfalls on its key since the isolation
    t = 200
    zs = [net.observe(0, 0, 0, 1.0, t + k, warmup=0)["z"] for k in range(3)]
    if window_reset == "on_isolation":
        assert zs[:2] == [None, None] and zs[2] is not None
    else:
        assert None not in zs


def test_engines_agree_with_window_reset():
    """Record by record with slots = 1: the recovery stream (isolations, probes, releases and
    restored agents) under the peer-relative detector, and eight random graphs under CUSUM."""
    recovery = assert_equal_to_reference([recovery_spec(0), recovery_spec(1)], RESET)
    assert all((tables["states"]["to"] == "isolated").any() for tables in recovery)
    cusum = ProtocolParams(probe_interval=3, warmup_per_six=5, route_limit=2, move_limit=4, detector="cusum",
                           window_reset="on_isolation")  # fmt: skip
    events = [
        routing_events(tables, cusum) for tables in assert_equal_to_reference(random_graph_specs(8), cusum)
    ]
    assert sum(e["isolated"] for e in events) > 0 and sum(e["probe review"] for e in events) > 0


def test_the_setting_changes_nothing_before_the_first_isolation():
    """The two settings' records agree up to the first isolation and differ after it."""
    spec = recovery_spec(0)
    runs = {
        name: reference.run_stream(spec.network, dataclasses.replace(RESET, window_reset=name), spec.pair,
                                   spec.stream, spec.schedule, spec.labels)
        for name in ("never", "on_isolation")
    }  # fmt: skip
    first = min(r["t"] for r in runs["never"].states if r["to"] == "isolated")
    before = [[r for r in runs[name].tasks if r["t"] <= first] for name in runs]
    after = [[r for r in runs[name].tasks if r["t"] > first] for name in runs]
    assert before[0] == before[1] and after[0] != after[1]
    with pytest.raises(MeshHealError, match="unknown window_reset 'always'"):
        ProtocolParams(window_reset="always")
