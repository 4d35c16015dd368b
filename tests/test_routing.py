"""Distance tables and next hops (spec/protocol.md §2) against an independent BFS."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshheal_jax import reference as R
from meshheal_jax import topology
from meshheal_jax.config import ProtocolParams

BBH = topology.load_profile("bbh")
N_ABILITIES = len(BBH.abilities)


def bfs(adjacency: np.ndarray, sources: list[int]) -> list[float]:
    """Multi-source BFS hop counts over the whole graph; inf where no source is reachable."""
    n = adjacency.shape[0]
    dist = [float("inf")] * n
    queue = deque()
    for s in sources:
        dist[s] = 0
        queue.append(s)
    while queue:
        i = queue.popleft()
        for j in range(n):
            if adjacency[i, j] and dist[j] == float("inf"):
                dist[j] = dist[i] + 1
                queue.append(j)
    return dist


@st.composite
def scenarios(draw):
    """A connected graph over 6, 12 or 18 agents (random spanning tree + random extra edges), and a
    random set of isolated agents."""
    n = draw(st.sampled_from([6, 12, 18]))
    order = draw(st.permutations(range(n)))
    adjacency = np.zeros((n, n), dtype=bool)
    for k in range(1, n):
        parent = order[draw(st.integers(0, k - 1))]
        adjacency[order[k], parent] = adjacency[parent, order[k]] = True
    extra = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    for i, j in extra:
        if i != j:
            adjacency[i, j] = adjacency[j, i] = True
    isolated = draw(st.sets(st.integers(0, n - 1), max_size=n))
    return adjacency, isolated


def world_for(adjacency: np.ndarray, isolated: set[int]) -> R.ReferenceNetwork:
    network = topology.build_network(BBH, adjacency.shape[0], adjacency)
    world = R.ReferenceNetwork(network, ProtocolParams(), len(BBH.task_types))
    for i in isolated:
        world.state[i] = R.ISOLATED
    world.distance = world.distance_tables()
    return world


def expected_columns(world: R.ReferenceNetwork, adjacency: np.ndarray) -> list[list[float]]:
    n = adjacency.shape[0]
    holds = world.net.holds
    columns = []
    for s in range(N_ABILITIES):
        columns.append(bfs(adjacency, [i for i in range(n) if holds[i, s] and world.state[i] != R.ISOLATED]))
    columns.append(bfs(adjacency, [i for i in range(n) if world.state[i] != R.ISOLATED]))  # 'any'
    return columns


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_distance_tables_match_bfs(scenario):
    adjacency, isolated = scenario
    world = world_for(adjacency, isolated)
    n = adjacency.shape[0]
    expected = expected_columns(world, adjacency)
    assert len(world.distance) == n
    for i in range(n):
        assert len(world.distance[i]) == N_ABILITIES + 1
        for col in range(N_ABILITIES + 1):
            want = expected[col][i]
            got = world.distance[i][col]
            if want == float("inf"):
                assert got == R.INF, (i, col)
            else:
                assert got == want, (i, col)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_next_hops_are_exactly_the_neighbours_one_hop_closer(scenario):
    adjacency, isolated = scenario
    world = world_for(adjacency, isolated)
    n = adjacency.shape[0]
    expected = expected_columns(world, adjacency)
    for i in range(n):
        neighbours = [j for j in range(n) if adjacency[i, j]]
        assert world.neighbours[i] == neighbours  # increasing index
        for col in range(N_ABILITIES + 1):
            d = expected[col][i]
            hops = world.next_hops(i, col)
            if d == float("inf") or d == 0:
                assert hops == [], (i, col)
                continue
            assert hops == [j for j in neighbours if expected[col][j] == d - 1]
            assert hops, "a finite positive distance always has a next hop"
            assert hops == sorted(hops)


def test_all_holders_isolated_is_unreachable():
    adjacency = topology.complete_graph(6)
    s = BBH.abilities.index("spatial")  # A4, A5, A6
    world = world_for(adjacency, {3, 4, 5})
    assert [world.distance[i][s] for i in range(6)] == [R.INF] * 6
    assert world.next_hops(0, s) == []
    # the 'any' column still reaches A1..A3 (0 hops) from A4..A6 (1 hop)
    assert [world.distance[i][N_ABILITIES] for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert world.next_hops(3, N_ABILITIES) == [0, 1, 2]


def test_everyone_isolated():
    world = world_for(topology.complete_graph(6), set(range(6)))
    assert all(d == R.INF for row in world.distance for d in row)


def test_isolated_agents_relay():
    # path A1 - A4 - A2: A4 isolated still carries distances through (controllers relay)
    adjacency = np.zeros((6, 6), dtype=bool)
    for i, j in [(0, 3), (3, 1), (1, 2), (2, 4), (4, 5)]:
        adjacency[i, j] = adjacency[j, i] = True
    world = world_for(adjacency, {3})
    logical = BBH.abilities.index("logical")  # A2, A5, A6
    assert world.distance[0][logical] == 2  # A1 -> A4 (isolated relay) -> A2
    assert world.next_hops(0, logical) == [3]
    linguistic = BBH.abilities.index("linguistic")  # A1, A4, A5; A4 isolated
    assert world.distance[3][linguistic] == 1


def test_tables_recomputed_on_state_change_via_observe():
    """observe() that changes a state recomputes the tables before returning."""
    world = world_for(topology.complete_graph(6), set())
    spatial = BBH.abilities.index("spatial")
    assert world.distance[0][spatial] == 1
    for j in (1, 2, 3, 4, 5):  # peers: scores 1.0 and three zero shortfalls for (type 0, spatial)
        key = (j, 0, spatial)
        world.scores[key].push(1.0)
        for _ in range(3):
            world.shortfalls[key].push(0.0)
        world.n_shortfalls[key] = 3
    world.state[4] = world.state[5] = R.ISOLATED
    world.distance = world.distance_tables()
    assert world.next_hops(0, spatial) == [3]
    for t in (100, 101, 102, 103):
        world.observe(3, 0, spatial, 0.0, t, warmup=30)
    assert world.state[3] == R.ISOLATED
    assert world.distance[0][spatial] == R.INF
