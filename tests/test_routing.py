"""Distance tables and next hops (spec/protocol.md §2) against an independent BFS."""

from __future__ import annotations

import dataclasses
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


# -- convergence="hop_per_task" (protocol.md §2's extension; decisions P6) -----------------------


def ring_6(closed: bool = True) -> np.ndarray:
    """A1 - A2 - ... - A6 (and A6 - A1 when closed): the adjacency of a ring, or of a path."""
    adjacency = np.zeros((6, 6), dtype=bool)
    for i in range(6 if closed else 5):
        adjacency[i, (i + 1) % 6] = adjacency[(i + 1) % 6, i] = True
    return adjacency


def hop_world(adjacency: np.ndarray, isolated: set[int]) -> R.ReferenceNetwork:
    world = world_for(adjacency, isolated)
    world.p = ProtocolParams(convergence="hop_per_task")
    return world


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sets(st.integers(0, 17)))
def test_one_hop_per_task_reaches_the_converged_tables(scenario, now_isolated):
    """From the tables of one set of isolated agents, after the set changes: each relaxation step
    is the JAX engine's (engine.relax_tables), the converged tables relax to themselves, and at most
    N steps reach them (news travels a hop per step; a value counting up reaches INF at N hops)."""
    import jax.numpy as jnp

    from meshheal_jax import engine

    adjacency, isolated = scenario
    n = adjacency.shape[0]
    world = hop_world(adjacency, isolated)
    world.state = [R.ISOLATED if i in now_isolated else R.NORMAL for i in range(n)]
    converged = world.distance_tables()
    holds = jnp.asarray(world.net.holds)
    nbr = world.net.neighbour_table
    state = jnp.asarray([engine.ISOLATED if s == R.ISOLATED else engine.NORMAL for s in world.state])
    for _ in range(n):
        relaxed = world.relax()
        jax_relaxed = engine.relax_tables(
            holds, jnp.asarray(nbr), state, jnp.asarray(world.distance, jnp.int32)
        )
        assert np.asarray(jax_relaxed).tolist() == relaxed
        world.distance = relaxed
    assert world.distance == converged
    assert world.relax() == converged


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_hop_per_task_routes_as_instant_on_converged_tables(scenario):
    """On converged tables the rule for stale ones (next hops: the nearest neighbours, reach: one
    more than theirs) picks exactly the instant rule's next hops."""
    adjacency, isolated = scenario
    instant, hop = world_for(adjacency, isolated), hop_world(adjacency, isolated)
    for i in range(adjacency.shape[0]):
        for col in range(N_ABILITIES + 1):
            d = instant.distance[i][col]
            if d == 0:  # a source: the engines never ask it for a next hop
                continue
            assert min(hop.reach(i, col), R.INF) == d, (i, col)  # INF: the task ends unanswered
            if d < R.INF:
                assert hop.next_hops(i, col) == instant.next_hops(i, col), (i, col)


def test_an_isolation_travels_one_hop_per_task():
    """Path A1 - A2 - A3 - A4 - A5 - A6, 'spatial' held by A4, A5, A6: isolating A4 and A5 moves A1's
    nearest holder from 3 to 5 hops, and A1 learns it one step at a time."""
    adjacency = ring_6(closed=False)
    s = BBH.abilities.index("spatial")
    world = hop_world(adjacency, set())
    assert [row[s] for row in world.distance] == [3, 2, 1, 0, 0, 0]
    world.state[3] = world.state[4] = R.ISOLATED
    seen = []
    for _ in range(4):
        world.distance = world.relax()
        seen.append([row[s] for row in world.distance])
    assert seen == [[3, 2, 1, 1, 1, 0], [3, 2, 2, 2, 1, 0], [3, 3, 3, 2, 1, 0], [4, 4, 3, 2, 1, 0]]
    assert world.reach(0, s) == 5  # A1 reads A2's 4, one more: the converged distance


def test_a_stale_table_sends_a_task_toward_the_isolated_agent():
    """Ring A1 .. A6, 'spatial' held by A4, A5, A6. Isolating A4 and A5 leaves A6, three hops from
    A3 either way round; one step after, A3 still reads A4 as one hop closer and sends the task to
    it alone; a step later, both ways, as the converged tables do."""
    adjacency = ring_6()
    s = BBH.abilities.index("spatial")
    world = hop_world(adjacency, set())
    world.state[3] = world.state[4] = R.ISOLATED
    world.distance = world.relax()
    assert [row[s] for row in world.distance] == [1, 2, 1, 1, 1, 0]
    assert world.next_hops(2, s) == [3]
    world.distance = world.relax()
    assert world.next_hops(2, s) == [1, 3] == world_for(adjacency, {3, 4}).next_hops(2, s)


def test_relax_for_tasks_takes_one_step_per_starting_task_per_stream():
    """engine.relax_for_tasks under the stream vmap, two streams asking 1 and 3 steps: each gets
    exactly that many reference steps (fewer once the tables relax to themselves)."""
    import jax
    import jax.numpy as jnp

    from meshheal_jax import engine
    from meshheal_jax.streams import make_stream, persistent_schedule

    adjacency = ring_6(closed=False)
    network = topology.build_network(BBH, 6, adjacency)
    world = engine.make_world(
        network, make_stream(0, 0, 42, 7, (1,), ("all",)), persistent_schedule(6, 42, ())
    )
    cfg = engine.EngineConfig(n_agents=6, n_abilities=N_ABILITIES, n_types=len(BBH.task_types), n_tasks=42)
    net = engine.initial_net(cfg, world)
    net = dataclasses.replace(net, state=net.state.at[jnp.array([3, 4])].set(engine.ISOLATED))
    both = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), (world, net))
    relaxed = jax.vmap(engine.relax_for_tasks)(*both, jnp.array([1, 3]))
    for stream, steps in enumerate((1, 3)):
        ref = hop_world(adjacency, set())
        ref.state[3] = ref.state[4] = R.ISOLATED
        for _ in range(steps):
            ref.distance = ref.relax()
        assert np.asarray(relaxed.distance[stream]).tolist() == ref.distance, steps
    many = engine.relax_for_tasks(world, net, jnp.int32(50))  # converged after at most N steps
    assert np.asarray(many.distance).tolist() == ref.distance_tables()
