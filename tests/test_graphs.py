"""Sparse graphs for the scaling experiment (spec/experiments.md section 3): generator, checker,
distances, edge-list files and the padded neighbour table."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.csgraph
from hypothesis import given, settings
from hypothesis import strategies as st

from meshheal_jax import graphs, topology
from meshheal_jax.errors import MeshHealError

PAPER_EDGES = {96: 228, 288: 705, 576: 1454}  # spec/experiments.md section 3


def network(dataset: str, n_agents: int) -> tuple[topology.Profile, np.ndarray, np.ndarray]:
    profile = topology.load_profile(dataset)
    holds = topology.replicate_holds(profile, n_agents)
    return profile, holds, graphs.degraded_mask(profile.degraded_targets, n_agents)


def without(edges: np.ndarray, *pairs: tuple[int, int]) -> np.ndarray:
    drop = {tuple(sorted(p)) for p in pairs}
    kept = [tuple(e) for e in edges.tolist() if tuple(e) not in drop]
    assert len(kept) == len(edges) - len(drop), "an edge to drop is not in the graph"
    return np.array(kept, dtype=np.int32).reshape(-1, 2)


def assert_canonical(edges: np.ndarray) -> None:
    assert edges.dtype == np.int32 and edges.ndim == 2 and edges.shape[1] == 2
    assert np.all(edges[:, 0] < edges[:, 1])
    keys = edges[:, 0].astype(np.int64) * (edges.max(initial=0) + 1) + edges[:, 1]
    assert np.all(np.diff(keys) > 0)  # sorted lexicographically and unique


# ----------------------------------------------------------------------------------------------
# A slow, obvious reference: per-agent BFS and neighbour counts in plain Python
# ----------------------------------------------------------------------------------------------


def reference_distances(holds, degraded, edges) -> np.ndarray:
    n, a = holds.shape
    nbrs = collections.defaultdict(set)
    for i, j in edges.tolist():
        nbrs[i].add(j)
        nbrs[j].add(i)
    dist = np.full((n, a), graphs.INF_DISTANCE, dtype=np.int64)
    for i in range(n):
        for s in range(a):
            if not degraded[i] and holds[i, s]:
                dist[i, s] = 0
                continue
            seen, frontier, hops = {i}, [i], 0
            while frontier and dist[i, s] == graphs.INF_DISTANCE:
                hops += 1
                nxt = []
                for u in frontier:
                    for v in sorted(nbrs[u]):
                        if v in seen or degraded[v]:  # never through or to a degraded target
                            continue
                        seen.add(v)
                        nxt.append(v)
                        if holds[v, s]:
                            dist[i, s] = hops
                frontier = nxt
    return dist


def reference_ok(holds, degraded, edges, hop_limit=3) -> bool:
    n, a = holds.shape
    nbrs = collections.defaultdict(set)
    for i, j in edges.tolist():
        nbrs[i].add(j)
        nbrs[j].add(i)
    seen, frontier = {0}, [0]
    while frontier:
        frontier = [v for u in frontier for v in nbrs[u] if v not in seen and not seen.add(v)]
    if len(seen) != n:
        return False
    for i in range(n):
        for s in range(a):
            if holds[i, s]:
                count = sum(1 for j in nbrs[i] if holds[j, s] and not degraded[j])
                if count < (2 if degraded[i] else 1):
                    return False
    return bool((reference_distances(holds, degraded, edges) <= hop_limit).all())


@st.composite
def small_graphs(draw):
    n = draw(st.integers(2, 14))
    a = draw(st.integers(1, 4))
    holds = np.array(draw(st.lists(st.lists(st.booleans(), min_size=a, max_size=a), min_size=n, max_size=n)))
    degraded = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    pairs = draw(
        st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] < p[1]))
    )
    edges = np.array(sorted(pairs), dtype=np.int32).reshape(-1, 2)
    return holds, degraded, edges


# ----------------------------------------------------------------------------------------------
# The generator on the packaged profiles
# ----------------------------------------------------------------------------------------------

SIZES = [(ds, n) for ds in topology.DATASETS for n in (96, 288)] + [("bbh", 576)]


@pytest.mark.parametrize("dataset,n_agents", SIZES)
def test_sparse_graph_meets_every_requirement(dataset, n_agents):
    profile, holds, degraded = network(dataset, n_agents)
    edges = graphs.sparse_edges(holds, degraded, seed=0, ability_names=profile.abilities)
    assert_canonical(edges)
    stats = graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)
    assert stats.n_agents == n_agents and stats.n_edges == len(edges)
    # edge count within +-25% of the paper's (generator aims at mean degree 5: exactly 2.5 N here)
    assert abs(stats.n_edges - PAPER_EDGES[n_agents]) <= 0.25 * PAPER_EDGES[n_agents]
    assert stats.n_edges == round(2.5 * n_agents)
    assert stats.edge_fraction == pytest.approx(len(edges) / (n_agents * (n_agents - 1) / 2))
    assert stats.max_ability_distance <= 3 and stats.max_degree <= 8
    # the healthy subgraph alone is connected: isolating every degraded target splits nothing
    healthy = ~degraded
    keep = healthy[edges[:, 0]] & healthy[edges[:, 1]]
    sub = scipy.sparse.coo_matrix((np.ones(keep.sum()), (edges[keep, 0], edges[keep, 1])), (n_agents,) * 2)
    _, labels = scipy.sparse.csgraph.connected_components(sub, directed=False)
    assert len(set(labels[healthy].tolist())) == 1
    # and the brute-force reference agrees on every requirement
    assert reference_ok(holds, degraded, edges)


def test_generator_is_deterministic_per_seed():
    _, holds, degraded = network("bbh", 96)
    first = graphs.sparse_edges(holds, degraded, seed=7)
    again = graphs.sparse_edges(holds, degraded, seed=7)
    other = graphs.sparse_edges(holds, degraded, seed=8)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    graphs.check_requirements(holds, degraded, other)


@pytest.mark.parametrize("dataset", topology.DATASETS)
def test_six_and_twelve_agents(dataset):
    for n_agents in (6, 12):
        _, holds, degraded = network(dataset, n_agents)
        edges = graphs.sparse_edges(holds, degraded, seed=1)
        assert_canonical(edges)
        stats = graphs.check_requirements(holds, degraded, edges)
        assert stats.n_edges <= n_agents * (n_agents - 1) // 2
        assert reference_ok(holds, degraded, edges)


def test_36864_agents_generate_and_validate():
    profile, holds, degraded = network("bbh", 36864)
    edges = graphs.sparse_edges(holds, degraded, seed=0)
    stats = graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)
    assert stats.n_edges == 92160 and stats.max_ability_distance <= 3


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_generator_on_random_satisfiable_holdings(data):
    n = data.draw(st.integers(2, 30))
    a = data.draw(st.integers(1, 5))
    degraded = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    healthy_idx = np.flatnonzero(~degraded)
    if healthy_idx.size < 2:
        degraded[:2] = False
        healthy_idx = np.flatnonzero(~degraded)
    holds = np.array(
        data.draw(st.lists(st.lists(st.booleans(), min_size=a, max_size=a), min_size=n, max_size=n))
    )
    for s in range(a):  # each ability: at least two healthy holders, so every rule can be met
        two = data.draw(st.lists(st.sampled_from(healthy_idx.tolist()), min_size=2, max_size=2, unique=True))
        holds[two, s] = True
    seed = data.draw(st.integers(0, 2**32 - 1))
    edges = graphs.sparse_edges(holds, degraded, seed)
    assert_canonical(edges)
    graphs.check_requirements(holds, degraded, edges)
    assert reference_ok(holds, degraded, edges)


def test_generator_names_an_unsatisfiable_rule():
    holds = np.zeros((6, 1), dtype=bool)
    holds[[0, 1], 0] = True  # one healthy holder (0) next to a degraded holder (1)
    degraded = np.array([False, True, False, False, False, False])
    with pytest.raises(
        MeshHealError, match=r"agent 0 \(A1 of replica 0\) has no non-degraded neighbour holding ability 'x'"
    ):
        graphs.sparse_edges(holds, degraded, 0, ability_names=("x",))


def test_degraded_mask():
    mask = graphs.degraded_mask((2, 4), 18)
    assert np.flatnonzero(mask).tolist() == [2, 4, 8, 10, 14, 16]
    with pytest.raises(MeshHealError, match="multiple of 6"):
        graphs.degraded_mask((2, 4), 10)


# ----------------------------------------------------------------------------------------------
# The checker and distances against the reference
# ----------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(small_graphs())
def test_ability_distances_match_reference_bfs(graph):
    holds, degraded, edges = graph
    np.testing.assert_array_equal(
        graphs.ability_distances(holds, degraded, edges), reference_distances(holds, degraded, edges)
    )


@settings(max_examples=150, deadline=None)
@given(small_graphs(), st.integers(1, 4))
def test_checker_accepts_exactly_what_the_reference_accepts(graph, hop_limit):
    holds, degraded, edges = graph
    try:
        graphs.check_requirements(holds, degraded, edges, hop_limit=hop_limit)
        accepted = True
    except MeshHealError:
        accepted = False
    assert accepted == reference_ok(holds, degraded, edges, hop_limit)


def test_distance_rule_excludes_degraded_targets():
    # 0 - 1 - 2 - 3: ability 0 held by agents 1 (degraded) and 3
    holds = np.array([[False], [True], [False], [True]])
    degraded = np.array([False, True, False, False])
    edges = np.array([[0, 1], [1, 2], [2, 3]], dtype=np.int32)
    dist = graphs.ability_distances(holds, degraded, edges)[:, 0].tolist()
    # agent 0 cannot pass through 1; agent 1 does not count as its own holder: 1 + dist(2)
    assert dist == [graphs.INF_DISTANCE, 2, 1, 0]


def test_stats_of_a_complete_six_agent_network():
    _, holds, degraded = network("bbh", 6)
    stats = graphs.check_requirements(holds, degraded, graphs.complete_edges(6))
    assert stats == graphs.GraphStats(
        n_agents=6, n_edges=15, edge_fraction=1.0, max_degree=5, max_ability_distance=1
    )
    assert stats.mean_degree == 5.0


# ----------------------------------------------------------------------------------------------
# Each broken requirement is named with its agent and ability
# ----------------------------------------------------------------------------------------------


def test_missing_healthy_neighbour_is_named():
    profile, holds, degraded = network("bbh", 6)
    edges = without(graphs.complete_edges(6), (0, 1))  # A1 and A2 are the only healthy mathematical holders
    with pytest.raises(
        MeshHealError,
        match=re.escape(
            "graph: agent 0 (A1 of replica 0) has no non-degraded neighbour holding ability 'mathematical'"
        ),
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)
    with pytest.raises(MeshHealError, match=re.escape("neighbour holding ability 0")):
        graphs.check_requirements(holds, degraded, edges)  # indices without names


def test_degraded_target_with_one_healthy_neighbour_is_named():
    profile, holds, degraded = network("math", 6)
    edges = without(graphs.complete_edges(6), (0, 2))  # A3 keeps only A2 for symbolic_manipulation
    with pytest.raises(
        MeshHealError,
        match=re.escape(
            "graph: degraded target 2 (A3 of replica 0) has only 1 non-degraded neighbour holding "
            "ability 'symbolic_manipulation' (needs at least 2)"
        ),
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)


def test_degraded_target_with_no_healthy_neighbour_is_named():
    profile, holds, degraded = network("bbh", 6)
    edges = without(graphs.complete_edges(6), (3, 4), (4, 5))  # A5 loses A4 and A6: no spatial
    with pytest.raises(
        MeshHealError,
        match=re.escape(
            "graph: degraded target 4 (A5 of replica 0) has no non-degraded neighbour holding ability 'spatial'"
        ),
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)


def test_ability_only_reachable_through_a_degraded_target_is_named():
    # MMLU-Pro: A1-A3 hold the knowledge abilities, A4-A6 the others; link the halves only via A3-A5
    profile, holds, degraded = network("mmlu_pro", 6)
    edges = np.array([[0, 1], [0, 2], [1, 2], [2, 4], [3, 4], [3, 5], [4, 5]], dtype=np.int32)
    with pytest.raises(
        MeshHealError,
        match=re.escape(
            "graph: agent 0 (A1 of replica 0) cannot reach a non-degraded holder of ability "
            "'text_comprehension' without passing through a degraded target"
        ),
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)


def test_ability_too_many_hops_away_is_named():
    # MMLU-Pro over 12 agents: both replicas' local edges, linked by a long healthy detour
    profile, holds, degraded = network("mmlu_pro", 12)
    local = [(0, 1), (0, 2), (1, 2), (3, 4), (3, 5), (4, 5)]
    edges = np.array(
        sorted({(i + r, j + r) for r in (0, 6) for i, j in local} | {(1, 7), (6, 9), (5, 11)}), dtype=np.int32
    )
    # agent 0 -> 1 -> 7 -> 6 -> 9 holds text_comprehension: 4 hops
    assert (
        graphs.ability_distances(holds, degraded, edges)[0, profile.abilities.index("text_comprehension")]
        == 4
    )
    with pytest.raises(
        MeshHealError,
        match=re.escape(
            "graph: agent 0 (A1 of replica 0) is 4 hops from the nearest non-degraded holder of ability "
            "'text_comprehension' (limit 3; paths through degraded targets excluded)"
        ),
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)
    graphs.check_requirements(holds, degraded, edges, hop_limit=4)


def test_generated_graph_broken_by_removing_an_agents_needed_edges():
    profile, holds, degraded = network("bbh", 96)
    edges = graphs.sparse_edges(holds, degraded, seed=3, ability_names=profile.abilities)
    agent, ability = 20, profile.abilities.index("mathematical")  # A3 of replica 3, degraded
    assert degraded[agent]
    needed = [(agent, j) for j in range(96) if holds[j, ability] and not degraded[j]]
    present = {tuple(e) for e in edges.tolist()}
    edges = without(edges, *[tuple(sorted(p)) for p in needed if tuple(sorted(p)) in present])
    with pytest.raises(
        MeshHealError,
        match=r"degraded target 20 \(A3 of replica 3\) has no non-degraded neighbour holding ability 'mathematical'",
    ):
        graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)


def test_disconnected_graph_names_an_unreachable_agent():
    _, holds, degraded = network("bbh", 12)
    halves = np.concatenate([graphs.complete_edges(6), graphs.complete_edges(6) + 6])
    with pytest.raises(
        MeshHealError, match=re.escape("not connected: agent 6 (A1 of replica 1) is unreachable from agent 0")
    ):
        graphs.check_requirements(holds, degraded, halves)


@pytest.mark.parametrize(
    "edges,message",
    [
        ([[0, 1], [1, 6]], "edge 1 (1, 6) names agent 6, outside 0..5"),
        ([[0, 1], [-1, 2]], "edge 1 (-1, 2) names agent -1, outside 0..5"),
        ([[0, 1], [3, 3]], "edge 1 is a self loop at agent 3 (A4 of replica 0)"),
        ([[0, 1], [2, 3], [1, 0]], "edge (0, 1) appears twice (rows 0 and 2)"),
        ([[0, 1, 2]], "edge list must have shape (E, 2)"),
        ([[0.0, 1.0]], "edge ids must be integers"),
    ],
)
def test_structural_errors(edges, message):
    _, holds, degraded = network("bbh", 6)
    with pytest.raises(MeshHealError, match=re.escape(message)):
        graphs.check_requirements(holds, degraded, np.array(edges))


# ----------------------------------------------------------------------------------------------
# Edge-list files
# ----------------------------------------------------------------------------------------------


def test_load_csv_with_header_comments_and_either_orientation(tmp_path):
    path = tmp_path / "g.csv"
    path.write_text("source,target\n# a comment\n3,1\n\n0, 2  # trailing\n1 4\n")
    np.testing.assert_array_equal(graphs.load_edge_list(path, 6), [[0, 2], [1, 3], [1, 4]])


def test_load_json_list_and_object(tmp_path):
    as_list, as_object = tmp_path / "a.json", tmp_path / "b.json"
    as_list.write_text("[[5, 0], [1, 2]]")
    as_object.write_text(json.dumps({"edges": [[1, 2], [0, 5]]}))
    expected = [[0, 5], [1, 2]]
    np.testing.assert_array_equal(graphs.load_edge_list(as_list, 6), expected)
    np.testing.assert_array_equal(graphs.load_edge_list(as_object, 6), expected)
    assert graphs.load_edge_list(as_list, 6).dtype == np.int32


def test_generated_graph_round_trips_through_both_formats(tmp_path):
    _, holds, degraded = network("math", 96)
    edges = graphs.sparse_edges(holds, degraded, seed=2)
    csv, js = tmp_path / "g.csv", tmp_path / "g.json"
    csv.write_text("source,target\n" + "".join(f"{j},{i}\n" for i, j in edges.tolist()))
    js.write_text(json.dumps({"edges": edges.tolist()}))
    np.testing.assert_array_equal(graphs.load_edge_list(csv, 96), edges)
    np.testing.assert_array_equal(graphs.load_edge_list(js, 96), edges)


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("g.csv", "0,1\n1,x\n", "g.csv, line 2: expected two integer agent ids, got '1,x'"),
        ("g.csv", "source,target\n0,1\n1,2,3\n", "line 3: expected two integer agent ids, got '1,2,3'"),
        ("g.csv", "0,1\n\n2.5,3\n", "line 3: expected two integer agent ids"),
        ("g.csv", "0,1\n1,9\n", "line 2: agent id 9 outside 0..5"),
        ("g.csv", "0,1\n-1,2\n", "line 2: agent id -1 outside 0..5"),
        ("g.csv", "0,1\n--1,2\n", "line 2: expected two integer agent ids, got '--1,2'"),
        ("g.csv", "0,1\n0,\u00b2\n", "line 2: expected two integer agent ids"),  # a superscript two
        ("g.csv", "0,1\n4,4\n", "line 2: self loop at agent 4"),
        (
            "g.csv",
            "# c\n0,1\n2,3\n1,0\n",
            "line 4: edge (0, 1) repeats line 2 (list each undirected pair once)",
        ),
        ("g.csv", "0,1\nsource,target\n", "line 2: expected two integer agent ids"),  # header only first
        ("g.json", "[[0, 1], [1]]", "g.json, entry 1: expected two integer agent ids, got '[1]'"),
        ("g.json", '[[0, 1], ["1", 2]]', "entry 1: expected two integer agent ids"),
        ("g.json", "[[0, 1], [true, 2]]", "entry 1: expected two integer agent ids"),
        ("g.json", "[[0, 1], [2, 1.5]]", "entry 1: expected two integer agent ids"),
        ("g.json", "[[0, 1], [1, 0]]", "entry 1: edge (0, 1) repeats entry 0"),
        ("g.json", "[[0, 1], [2, 6]]", "entry 1: agent id 6 outside 0..5"),
        ("g.json", "[[0, 1], [2, 2]]", "entry 1: self loop at agent 2"),
        ("g.json", '{"links": []}', "a JSON object needs an 'edges' list"),
        ("g.json", '"edges"', "expected a list of [i, j] pairs"),
        ("g.json", "[[0, 1],", "not valid JSON"),
        ("g.json", "[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
        ("g.json", "[[0, " + "9" * 5000 + "]]", "not valid JSON: Exceeds the limit (4300 digits)"),
    ],
)
def test_load_rejects_bad_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MeshHealError, match=re.escape(message)) as err:
        graphs.load_edge_list(path, 6)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(
        MeshHealError, match=re.escape(f"cannot read graph file {tmp_path / 'nope.csv'}: No such")
    ):
        graphs.load_edge_list(tmp_path / "nope.csv", 6)


def test_load_an_edge_list_with_a_byte_order_mark(tmp_path):
    (tmp_path / "excel.csv").write_bytes("source,target\n0,1\n1,2\n".encode("utf-8-sig"))
    assert graphs.load_edge_list(tmp_path / "excel.csv", 6).tolist() == [[0, 1], [1, 2]]


def test_load_an_edge_list_that_is_not_utf8(tmp_path):
    (tmp_path / "latin1.csv").write_bytes("0,1\n1,2 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        MeshHealError, match=re.escape(f"graph file {tmp_path / 'latin1.csv'} is not UTF-8 text")
    ):
        graphs.load_edge_list(tmp_path / "latin1.csv", 6)


def test_load_sniffs_json_without_the_suffix(tmp_path):
    path = tmp_path / "edges.txt"
    path.write_text(' {"edges": [[0, 1]]}')
    np.testing.assert_array_equal(graphs.load_edge_list(path, 2), [[0, 1]])


# ----------------------------------------------------------------------------------------------
# Conversions
# ----------------------------------------------------------------------------------------------


def test_complete_edges():
    edges = graphs.complete_edges(5)
    assert_canonical(edges)
    assert len(edges) == 10 and edges.tolist()[:4] == [[0, 1], [0, 2], [0, 3], [0, 4]]
    assert graphs.complete_edges(1).shape == (0, 2)


def test_neighbour_table_round_trip():
    _, holds, degraded = network("bbh", 288)
    edges = graphs.sparse_edges(holds, degraded, seed=0)
    table = graphs.neighbour_table(edges, 288)
    degree = np.bincount(edges.reshape(-1), minlength=288)
    assert table.dtype == np.int32 and table.shape == (288, degree.max())
    assert np.array_equal((table >= 0).sum(axis=1), degree)
    for row, d in zip(table, degree):  # increasing neighbours, then -1 padding
        assert np.all(np.diff(row[:d]) > 0) and np.all(row[d:] == -1)
    np.testing.assert_array_equal(graphs.edges_from_neighbour_table(table), edges)
    adjacency = graphs.adjacency_from_edges(edges, 288)
    for i in range(288):
        assert table[i][table[i] >= 0].tolist() == np.flatnonzero(adjacency[i]).tolist()
    np.testing.assert_array_equal(graphs.edges_from_adjacency(adjacency), edges)


def test_neighbour_table_of_no_edges_has_one_padding_column():
    table = graphs.neighbour_table(np.zeros((0, 2), dtype=np.int32), 3)
    assert table.shape == (3, 1) and np.all(table == -1)


def test_dense_adjacency_is_refused_for_large_networks():
    with pytest.raises(MeshHealError, match="not built"):
        graphs.adjacency_from_edges(np.zeros((0, 2), dtype=np.int32), graphs.DENSE_LIMIT + 1)


def test_edges_from_adjacency_rejects_bad_matrices():
    adjacency = graphs.adjacency_from_edges(graphs.complete_edges(6), 6)
    adjacency[1, 4] = False
    with pytest.raises(MeshHealError, match=re.escape("edge (1, 4) is not undirected")):
        graphs.edges_from_adjacency(adjacency)
    adjacency[1, 1] = True
    with pytest.raises(MeshHealError, match="self loop at agent 1"):
        graphs.edges_from_adjacency(adjacency)
    with pytest.raises(MeshHealError, match="square"):
        graphs.edges_from_adjacency(np.zeros((6, 5), dtype=bool))
