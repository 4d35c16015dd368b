"""Graph, topology and stream rules a mutation audit could change without any test failing: the
generator's documented passes (the six-agent cover, the ring over components, nearest replica first,
least-connected ring ends, the edge budget round(mean_degree N / 2)) and its seeded output, the
canonical edges and degraded targets of a built network (decisions G5, X9), the checks at the edges
of the dense adjacency and the degraded mask, the question difficulty's generator (decisions E9), a
phase that starts at the last task and the agents a schedule ever degrades."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import graphs, topology
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import (
    DIFFICULTY_BINS,
    HealthSchedule,
    difficulty_bins,
    make_stream,
    recovery_schedule,
)


def sparse(dataset: str, n_agents: int, seed: int = 0, mean_degree: float = graphs.MEAN_DEGREE) -> np.ndarray:
    """The generated graph of a packaged profile replicated to n_agents (A3/A5 of each replica degraded)."""
    profile = topology.load_profile(dataset)
    holds = topology.replicate_holds(profile, n_agents)
    degraded = graphs.degraded_mask(profile.degraded_targets, n_agents)
    return graphs.sparse_edges(holds, degraded, seed, mean_degree=mean_degree)


def as_pairs(edges: np.ndarray) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in edges.tolist()}


def cross_replica(edges: np.ndarray) -> np.ndarray:
    replica = edges // graphs.BASE_AGENTS
    return edges[replica[:, 0] != replica[:, 1]]


# ----------------------------------------------------------------------------------------------
# The generator's passes (graphs.py module doc, decisions G4)
# ----------------------------------------------------------------------------------------------


def test_six_agent_bbh_graph_is_the_documented_cover():
    # module doc: "BBH: a 4-cycle A1-A2-A6-A4 plus four links for each of A3 and A5; 12 edges". One
    # replica is one healthy component, so no chord is added although 12 < round(5 * 6 / 2) = 15.
    cycle = {(0, 1), (1, 5), (3, 5), (0, 3)}
    degraded_links = {tuple(sorted((target, j))) for target in (2, 4) for j in (0, 1, 3, 5)}
    for seed in (0, 1, 2):
        assert as_pairs(sparse("bbh", 6, seed)) == cycle | degraded_links


@pytest.mark.parametrize("n_agents, replica_pairs", [(12, [(0, 1)]), (18, [(0, 1), (0, 2), (1, 2)])])
def test_without_chords_the_replicas_are_joined_by_a_ring(n_agents, replica_pairs):
    # mean degree 0: no chord, so the graph is the local cover (12 BBH edges per replica) and the
    # backbone ring over the replicas' healthy components, closed only when there are three or more
    edges = sparse("bbh", n_agents, mean_degree=0.0)
    links = cross_replica(edges)
    assert len(edges) == 12 * (n_agents // 6) + len(replica_pairs)
    assert sorted(tuple(pair) for pair in (links // 6).tolist()) == replica_pairs


@pytest.mark.parametrize("mean_degree, n_edges", [(4.25, 26), (4.5, 27), (4.0, 25)])
def test_chords_fill_the_graph_to_round_half_mean_degree_times_n(mean_degree, n_edges):
    # decisions G4: chords "up to round(5 N / 2) edges"; 12 BBH agents: 24 cover edges, 1 ring link,
    # then round(4.25 * 6) = round(25.5) = 26 (never fewer than the cover and ring already hold)
    assert len(sparse("bbh", 12, mean_degree=mean_degree)) == n_edges


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ring_links_join_the_least_connected_healthy_members(seed):
    # module doc: "each link between the least-connected healthy members"; 12 MATH agents, no chord:
    # each replica's healthy agents are one component, joined by one link
    edges = sparse("math", 12, seed, mean_degree=0.0)
    degraded = graphs.degraded_mask((2, 4), 12)
    links = cross_replica(edges)
    local = edges[(edges // 6)[:, 0] == (edges // 6)[:, 1]]
    degree = np.bincount(local.reshape(-1), minlength=12)
    assert len(links) == 1
    for end in links[0].tolist():
        members = [k for k in range(end // 6 * 6, end // 6 * 6 + 6) if not degraded[k]]
        assert degree[end] == min(degree[k] for k in members), (end, degree.tolist())


def test_local_cover_links_the_nearest_replica_first():
    # decisions G4: "each agent linked to a healthy holder of each ability it needs, nearest replica
    # first". Agent 0 needs abilities 0 and 1, held (healthy) in replica 1 by agents 6 and 7, and both
    # by agent 12 of replica 2: the nearer replica wins over the holder covering more.
    holds = np.zeros((18, 2), dtype=bool)
    holds[[0, 6, 12], 0] = True
    holds[[0, 7, 12], 1] = True
    edges = as_pairs(graphs.sparse_edges(holds, np.zeros(18, dtype=bool), 0, mean_degree=0.0))
    assert {(0, 6), (0, 7)} <= edges and (0, 12) not in edges


def test_generated_graph_is_pinned_per_seed():
    # A run records --graph-seed and `report` rebuilds its command from it: the same seed must keep
    # building the same graph (a changed seed fold or tie-break would pass the determinism tests)
    cover = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 4), (1, 5), (2, 3), (2, 5), (3, 4), (3, 5), (4, 5)]
    replicas = cover + [(i + 6, j + 6) for i, j in cover]
    assert as_pairs(sparse("bbh", 12, seed=0)) == set(replicas) | {(1, 6), (1, 7), (5, 9)}


# ----------------------------------------------------------------------------------------------
# Networks, masks and dense adjacency (decisions G5, X9)
# ----------------------------------------------------------------------------------------------


def test_build_network_keeps_user_edges_canonical(bbh_profile):
    # Network.edges: "(E, 2) int32, i < j, sorted, unique", whatever orientation and order were given
    reversed_path = np.array([[5, 4], [1, 0], [3, 2], [2, 1], [4, 3]])
    network = topology.build_network(bbh_profile, 6, edges=reversed_path)
    assert network.edges.dtype == np.int32
    assert network.edges.tolist() == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]


def test_build_network_replicates_the_profiles_own_degraded_targets(bbh_doc):
    # decisions X9: a profile may name other degraded targets (A1 and A6 are complementary in BBH);
    # the network's targets are those of every replica, in increasing index
    bbh_doc["degraded_targets"] = ["A6", "A1"]
    network = topology.build_network(topology.parse_profile(bbh_doc), 12)
    assert network.degraded_targets == (0, 5, 6, 11)


def test_profile_without_degraded_targets_reads_a3_then_a5(bbh_doc):
    # decisions X9: `degraded_targets = ["A3", "A5"]` is the default; recovery reads (a3, a5) from it
    del bbh_doc["degraded_targets"]
    assert topology.parse_profile(bbh_doc).degraded_targets == (2, 4)


def test_degraded_mask_refuses_an_index_past_the_base_agents():
    # index 6 would mark A1 of every later replica degraded instead
    with pytest.raises(MeshHealError, match=r"degraded target index 6 is not a base agent 0\.\.5"):
        graphs.degraded_mask((2, 6), 12)


def test_dense_adjacency_names_an_agent_past_the_last_and_is_built_at_the_limit():
    with pytest.raises(MeshHealError, match=r"an edge names an agent outside 0\.\.5"):
        graphs.adjacency_from_edges(np.array([[0, 6]]), 6)
    # decisions G5: "Dense adjacency matrices exist only up to 4,096 agents": 4,096 itself is built
    adjacency = graphs.adjacency_from_edges(np.array([[0, graphs.DENSE_LIMIT - 1]]), graphs.DENSE_LIMIT)
    assert adjacency.shape == (graphs.DENSE_LIMIT,) * 2 and adjacency.sum() == 2


# ----------------------------------------------------------------------------------------------
# Streams and schedules (decisions E9)
# ----------------------------------------------------------------------------------------------


def e9_bins(seed: int, dataset_id: int, task_type: int, n_questions: int) -> np.ndarray:
    """Decisions E9, literally: question k of type ty gets floor(8 u_k), u_k the k-th uniform of
    numpy's generator seeded (0xD1FF, seed, dataset id, ty)."""
    u = np.random.default_rng([0xD1FF, seed, dataset_id, task_type]).random(n_questions)
    return np.floor(DIFFICULTY_BINS * u).astype(np.int32)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 5), st.integers(0, 6))
def test_difficulty_bins_follow_decision_e9(seed, dataset_id, task_type):
    question = np.arange(40, dtype=np.int32)
    bins = difficulty_bins(seed, dataset_id, np.full(40, task_type, dtype=np.int32), question)
    np.testing.assert_array_equal(bins, e9_bins(seed, dataset_id, task_type, 40))


def test_a_streams_difficulty_is_its_questions_e9_bins():
    stream = make_stream(5, 1, 84, 7, (1,), ("all",))  # seed and dataset id differ: an order is seen
    expected = np.zeros(84, dtype=np.int32)
    for ty in range(7):
        mine = stream.task_type == ty
        expected[mine] = e9_bins(5, 1, ty, 12)[stream.question[mine]]
    np.testing.assert_array_equal(stream.difficulty, expected)


def test_a_phase_may_start_at_the_last_task():
    stream = make_stream(0, 0, 42, 7, (1, 42), ("first", "last"))
    assert stream.phase.tolist() == [0] * 41 + [1]


def test_ever_degraded_marks_every_scheduled_agent():
    schedule = HealthSchedule(6, 42, ((1, 5, 6), (3, 1, 43)))  # one task, and the whole stream
    assert schedule.ever_degraded().tolist() == [False, True, False, True, False, False]
    assert not HealthSchedule(6, 42, ()).ever_degraded().any()


def test_bad_stream_and_graph_arguments_are_named():
    """Arguments the CLI cannot produce but a script can: no task types, an empty recovery stream,
    and a graph given both ways get a message naming the problem (not ZeroDivisionError, not a
    message about a schedule interval, not one of the two graphs silently dropped)."""
    with pytest.raises(MeshHealError, match="at least one task type, got 0"):
        make_stream(0, 0, 42, 0, (1,), ("all",))
    with pytest.raises(MeshHealError, match="positive multiple of 5"):
        recovery_schedule(0)
    profile = topology.load_profile("bbh")
    with pytest.raises(MeshHealError, match="not both"):
        topology.build_network(profile, 6, adjacency=np.ones((6, 6), dtype=bool), edges=np.array([[0, 1]]))
