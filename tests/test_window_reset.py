"""window_reset (decisions P7, extensions of protocol.md §5, whose windows are never reset): an
agent entering isolation ("on_isolation") or released from it ("on_release") loses its evidence,
in both engines alike."""

from __future__ import annotations

import pytest
from test_engine import assert_equal_to_reference, random_graph_specs, recovery_spec, routing_events

from meshheal_jax import reference
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.topology import build_network, load_profile


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


def own_pushes(net: reference.ReferenceNetwork) -> dict:
    return {k: net.scores[k].count for k in net.scores if k[0] == 0 and net.scores[k].count}


def next_zs(net: reference.ReferenceNetwork, t: int, count: int = 3) -> list:
    return [net.observe(0, 0, 0, 1.0, t + k, warmup=0)["z"] for k in range(count)]


@pytest.mark.parametrize("window_reset", ["never", "on_isolation", "on_release"])
def test_isolation_and_release_clear_the_agents_evidence_only_when_asked(window_reset):
    net = isolate_agent_0(ProtocolParams(window_reset=window_reset))
    if window_reset == "on_isolation":  # only what came after: the one output on (type 1, ability 1)
        assert own_pushes(net) == {(0, 1, 1): 1} and net.n_shortfalls[(0, 0, 0)] == 0
        assert net.shortfalls[(0, 0, 0)].filled() == 0 and net.cusum[(0, 0, 0)] == 0.0
    else:  # §5: the shortfalls that isolated it stay
        assert own_pushes(net)[(0, 0, 0)] >= 6 and net.n_shortfalls[(0, 0, 0)] >= 5
    for i in range(1, 6):  # the other agents keep theirs
        assert net.scores[(i, 0, 0)].count == 4
    # good probes until released: with on_isolation none forms a z before min_observations
    # shortfalls on its key since the isolation, and the third releases it
    t, zs = 200, []
    while net.state[0] == reference.ISOLATED:
        zs += next_zs(net, t, 1)
        t += 1
        assert t < 230
    if window_reset == "on_isolation":
        assert zs == [None, None, 0.0]
    else:  # the old shortfalls leave the window one by one
        assert None not in zs and len(zs) > 3
    released = own_pushes(net)
    assert (released == {}) == (window_reset == "on_release")  # the release's own push cleared too
    zs = next_zs(net, t)
    assert (zs[:2] == [None, None]) if window_reset == "on_release" else (None not in zs)


def test_engines_agree_with_window_reset_on_release():
    """Record by record with slots = 1: recovery streams (isolations, probes, releases, restored
    agents) under the peer-relative detector, released agents losing their evidence."""
    recovery = assert_equal_to_reference(
        [recovery_spec(0), recovery_spec(1)], ProtocolParams(window_reset="on_release")
    )
    assert all((tables["states"]["from"] == "isolated").any() for tables in recovery)  # released


def test_engines_agree_with_window_reset_on_isolation():
    """Record by record with slots = 1: eight random graphs under CUSUM (its statistics emptied
    too), with isolations, probe reviews and releases somewhere in the batch."""
    cusum = ProtocolParams(probe_interval=3, warmup_per_six=5, route_limit=2, move_limit=4, detector="cusum",
                           window_reset="on_isolation")  # fmt: skip
    tables = assert_equal_to_reference(random_graph_specs(8), cusum)
    events = [routing_events(t, cusum) for t in tables]
    assert sum(e["isolated"] for e in events) > 0 and sum(e["probe review"] for e in events) > 0
    assert any((t["states"]["from"] == "isolated").any() for t in tables)  # released


def test_the_setting_changes_nothing_before_the_first_isolation_or_release():
    """Each setting's records agree with the specified ones up to the first task whose transition
    clears evidence (an isolation; a release) and differ after it."""
    spec = recovery_spec(0)
    runs = {
        name: reference.run_stream(spec.network, ProtocolParams(window_reset=name), spec.pair, spec.stream,
                                   spec.schedule, spec.labels)
        for name in ("never", "on_isolation", "on_release")
    }  # fmt: skip
    states = runs["never"].states
    first = {"on_isolation": min(r["t"] for r in states if r["to"] == "isolated"),
             "on_release": min(r["t"] for r in states if r["from"] == "isolated")}  # fmt: skip
    for name, t in first.items():
        before = [[r for r in runs[run].tasks if r["t"] <= t] for run in ("never", name)]
        after = [[r for r in runs[run].tasks if r["t"] > t] for run in ("never", name)]
        assert before[0] == before[1] and after[0] != after[1], name
    with pytest.raises(MeshHealError, match="unknown window_reset 'always'"):
        ProtocolParams(window_reset="always")
