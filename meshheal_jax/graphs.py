"""Sparse agent graphs for the network-scaling experiment (spec/experiments.md section 3).

A graph is an undirected edge list ``edges: (E, 2) int32``, each row ``(i, j)`` with ``i < j``, rows
sorted lexicographically and unique. Nothing here builds a dense ``N x N`` matrix (networks reach
36,864 agents) except ``adjacency_from_edges``, which refuses more than ``DENSE_LIMIT`` agents.

Requirements (``check_requirements``), for holdings ``holds (N, A)`` and the degraded targets
``degraded (N,)`` (A3/A5 of every replica), checked in this order, the first broken one reported
with the agent and ability it concerns:

1. structure: ids in ``0..N-1``, no self loop, no duplicate (undirected) edge;
2. the graph is connected;
3. every agent has, for each ability it holds, at least one neighbour holding that ability that is
   not a degraded target (a "healthy holder");
4. every degraded target has at least two such neighbours for each ability it holds;
5. every agent is within ``hop_limit`` (3) hops of a healthy holder of every ability.

Distance rule for 5 (and for ``GraphStats.max_ability_distance``): hops are counted on the initial
graph, and a path may neither pass through nor end at a degraded target. Only the first node, the
agent measured, may be degraded. So a healthy holder is at distance 0 from itself; a degraded agent
is never at distance 0 (its own holding does not count), its distance is one more than that of its
nearest healthy neighbour. These are exactly the paths that survive once the detector has isolated
every degraded target, so the bound holds before and after isolation. A pair with no such path is
at distance ``INF_DISTANCE``.

The generator (``sparse_edges``) is seeded and deterministic; it builds, in four passes:

1. local cover: agents in index order (healthy ones first, then degraded targets) repeatedly link
   to the healthy holder that is nearest in replica (block of 6 consecutive agents), then covers
   most of the agent's still-missing abilities plus the candidate's own missing abilities the
   agent can serve, then nearest in index, then a seeded random priority, until rules 3 and 4
   hold for that agent. On a replicated profile this yields a self-contained sparse copy of the
   six-agent network per replica (e.g. BBH: a 4-cycle A1-A2-A6-A4 plus four links for each of
   A3 and A5; 12 edges);
2. backbone: a ring over the connected components of the healthy subgraph (in index order, so
   neighbouring replicas are linked), each link between the least-connected healthy members, and
   any degraded agent without a healthy neighbour linked to one; the healthy subgraph is then
   connected, so the whole graph stays connected after every degraded target is isolated;
3. chords: random links between least-connected healthy agents of different local components
   until the graph has ``mean_degree * N / 2`` edges (default 5: 240 / 720 / 1440 edges at
   96 / 288 / 576 agents vs the paper's 228 / 705 / 1454); they make the healthy backbone an
   expander, with a logarithmic diameter;
4. repair: any agent farther than ``hop_limit`` from a healthy holder of some ability is linked
   directly to the nearest healthy holder(s) covering the most such abilities; repeated until
   none is left. Finally ``check_requirements`` verifies everything; a holdings table that cannot
   meet a rule (e.g. an ability with a single healthy holder, so a degraded target cannot have
   two) raises ``MeshHealError`` naming it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph

from meshheal_jax.errors import MeshHealError
from meshheal_jax.files import read_text

BASE_AGENTS = 6  # agents per replica of a profile (spec/abilities.md "Larger networks")
HOP_LIMIT = 3  # one hop of slack under the routing limit of 4
MEAN_DEGREE = 5.0  # target average degree of generated graphs (the paper's ~228/705/1454 edges)
DENSE_LIMIT = 4096  # largest N for which a dense adjacency is built
INF_DISTANCE = 2**30  # unreachable (a large int, safe to add 1 to in int32)
_WINDOW = 3  # candidate holders examined on each side of an agent's index in the local cover

Edges = np.ndarray  # (E, 2) int32, rows (i, j) with i < j, sorted lexicographically, unique


@dataclasses.dataclass(frozen=True)
class GraphStats:
    """Summary of a graph that met every requirement."""

    n_agents: int
    n_edges: int
    edge_fraction: float  # n_edges / (N (N - 1) / 2), the share of the complete graph
    max_degree: int
    max_ability_distance: int  # max over agents and abilities, distance rule of the module doc

    @property
    def mean_degree(self) -> float:
        return 2.0 * self.n_edges / self.n_agents if self.n_agents else 0.0


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def agent_label(agent: int, n_agents: int) -> str:
    """'agent 17 (A6 of replica 2)' (the replica part only when N is a multiple of 6)."""
    if n_agents % BASE_AGENTS == 0:
        return f"agent {agent} (A{agent % BASE_AGENTS + 1} of replica {agent // BASE_AGENTS})"
    return f"agent {agent}"


def check_connected(edges: np.ndarray, n_agents: int) -> None:
    """MeshHealError naming the first agent unreachable from agent 0, if any (checked edges)."""
    if n_agents > 1:
        n_parts, labels = scipy.sparse.csgraph.connected_components(csr(edges, n_agents), directed=False)
        if n_parts > 1:
            missing = int(np.flatnonzero(labels != labels[0])[0])
            raise MeshHealError(
                f"graph: not connected: {agent_label(missing, n_agents)} is unreachable from agent 0 "
                f"({n_parts} components)"
            )


def _ability_label(ability: int, ability_names: tuple[str, ...] | None) -> str:
    if ability_names is not None and 0 <= ability < len(ability_names):
        return f"ability {ability_names[ability]!r}"
    return f"ability {ability}"


def degraded_mask(degraded_targets: tuple[int, ...], n_agents: int) -> np.ndarray:
    """(N,) bool: the degraded targets of a replicated network, ``r * 6 + a`` for each base-agent
    index ``a`` in ``degraded_targets`` (a Profile's field, A3/A5 = (2, 4))."""
    if n_agents <= 0 or n_agents % BASE_AGENTS:
        raise MeshHealError(f"agents must be a positive multiple of 6, got {n_agents}")
    mask = np.zeros(n_agents, dtype=bool)
    for a in degraded_targets:
        if not 0 <= a < BASE_AGENTS:
            raise MeshHealError(f"degraded target index {a} is not a base agent 0..5")
        mask[a::BASE_AGENTS] = True
    return mask


def _check_agents(holds: np.ndarray, degraded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    holds = np.asarray(holds)
    degraded = np.asarray(degraded)
    if holds.ndim != 2:
        raise MeshHealError(f"graph: holds must have shape (N, A), got {holds.shape}")
    if degraded.shape != (holds.shape[0],):
        raise MeshHealError(f"graph: degraded mask must have shape ({holds.shape[0]},), got {degraded.shape}")
    return holds.astype(bool), degraded.astype(bool)


def canonical(pairs: np.ndarray) -> np.ndarray:
    """Rows (min, max), sorted lexicographically, duplicates dropped; int32."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    pairs = np.sort(pairs, axis=1)
    return np.unique(pairs, axis=0).astype(np.int32).reshape(-1, 2)


def csr(edges: np.ndarray, n_agents: int, keep: np.ndarray | None = None) -> scipy.sparse.csr_matrix:
    """Symmetric 0/1 CSR matrix of the edges (only those with ``keep`` True, when given)."""
    if keep is not None:
        edges = edges[keep]
    rows = np.concatenate([edges[:, 0], edges[:, 1]])
    cols = np.concatenate([edges[:, 1], edges[:, 0]])
    data = np.ones(rows.size, dtype=np.int32)
    return scipy.sparse.csr_matrix((data, (rows, cols)), shape=(n_agents, n_agents))


# ----------------------------------------------------------------------------------------------
# Conversions
# ----------------------------------------------------------------------------------------------


def complete_edges(n_agents: int) -> Edges:
    """Every pair (i, j), i < j: N (N - 1) / 2 rows, already sorted. Meant for small N."""
    if n_agents < 0:
        raise MeshHealError(f"agents must be non-negative, got {n_agents}")
    i, j = np.triu_indices(n_agents, k=1)
    return np.stack([i, j], axis=1).astype(np.int32)


def neighbour_table(edges: Edges, n_agents: int) -> np.ndarray:
    """(N, K) int32, K = max degree (at least 1): row i lists i's neighbours in increasing order,
    padded with -1. The layout the JAX engine gathers from."""
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    both = np.concatenate([edges, edges[:, ::-1]])
    order = np.lexsort((both[:, 1], both[:, 0]))
    src, dst = both[order, 0], both[order, 1]
    degree = np.bincount(src, minlength=n_agents)
    k = max(int(degree.max(initial=0)), 1)
    starts = np.concatenate([[0], np.cumsum(degree)[:-1]])
    column = np.arange(src.size) - starts[src]
    table = np.full((n_agents, k), -1, dtype=np.int32)
    table[src, column] = dst
    return table


def edges_from_neighbour_table(table: np.ndarray) -> Edges:
    """Inverse of ``neighbour_table`` (for a symmetric table)."""
    table = np.asarray(table)
    src = np.repeat(np.arange(table.shape[0]), table.shape[1]).reshape(table.shape)
    keep = (table >= 0) & (src < table)
    return canonical(np.stack([src[keep], table[keep]], axis=1))


def adjacency_from_edges(edges: Edges, n_agents: int) -> np.ndarray:
    """(N, N) bool symmetric adjacency; small networks only (N <= DENSE_LIMIT)."""
    if n_agents > DENSE_LIMIT:
        raise MeshHealError(
            f"a dense adjacency of {n_agents} agents is not built (limit {DENSE_LIMIT}); use neighbour_table"
        )
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    if edges.size and (edges.min() < 0 or edges.max() >= n_agents):
        raise MeshHealError(f"graph: an edge names an agent outside 0..{n_agents - 1}")
    adjacency = np.zeros((n_agents, n_agents), dtype=bool)
    adjacency[edges[:, 0], edges[:, 1]] = True
    return adjacency | adjacency.T


def edges_from_adjacency(adjacency: np.ndarray) -> Edges:
    """Checks a dense adjacency (square, no self loop, symmetric) and returns its edge list."""
    adjacency = np.asarray(adjacency, dtype=bool)
    n = adjacency.shape[0] if adjacency.ndim else 0
    if adjacency.shape != (n, n):
        raise MeshHealError(f"graph: adjacency must be square, got {adjacency.shape}")
    if np.any(np.diag(adjacency)):
        raise MeshHealError(f"graph: self loop at agent {int(np.flatnonzero(np.diag(adjacency))[0])}")
    if not np.array_equal(adjacency, adjacency.T):
        i, j = np.argwhere(adjacency != adjacency.T)[0]
        raise MeshHealError(f"graph: edge ({i}, {j}) is not undirected")
    i, j = np.nonzero(np.triu(adjacency, k=1))
    return np.stack([i, j], axis=1).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Distances and the requirement checker
# ----------------------------------------------------------------------------------------------


def ability_distances(holds: np.ndarray, degraded: np.ndarray, edges: Edges) -> np.ndarray:
    """(N, A) int32: hops from each agent to the nearest healthy holder of each ability, on paths
    that neither pass through nor end at a degraded target (module doc); INF_DISTANCE if none.

    One multi-source BFS per ability over the healthy subgraph (scipy's unweighted Dijkstra with
    ``min_only``), then each degraded agent takes one more than its best healthy neighbour.
    """
    holds, degraded = _check_agents(holds, degraded)
    n, a = holds.shape
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    healthy = ~degraded
    dist = np.full((n, a), INF_DISTANCE, dtype=np.int64)
    if n == 0:
        return dist.astype(np.int32)
    both_healthy = healthy[edges[:, 0]] & healthy[edges[:, 1]]
    graph = csr(edges, n, both_healthy)
    for s in range(a):
        sources = np.flatnonzero(holds[:, s] & healthy)
        if sources.size == 0:
            continue
        d = scipy.sparse.csgraph.dijkstra(
            graph, directed=False, indices=sources, unweighted=True, min_only=True
        )
        reached = np.isfinite(d) & healthy
        dist[reached, s] = d[reached].astype(np.int64)
    # degraded agent u: 1 + min over healthy neighbours v of dist[v]
    directed = np.concatenate([edges, edges[:, ::-1]])
    into_degraded = directed[degraded[directed[:, 0]] & healthy[directed[:, 1]]]
    if into_degraded.size:
        best = np.full((n, a), INF_DISTANCE, dtype=np.int64)
        np.minimum.at(best, into_degraded[:, 0], dist[into_degraded[:, 1]])
        step = np.where(best < INF_DISTANCE, best + 1, INF_DISTANCE)
        dist[degraded] = step[degraded]
    return dist.astype(np.int32)


def healthy_neighbour_counts(holds: np.ndarray, degraded: np.ndarray, edges: Edges) -> np.ndarray:
    """(N, A) int: for each agent and ability, how many neighbours hold it and are not degraded."""
    holds, degraded = _check_agents(holds, degraded)
    n = holds.shape[0]
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    healthy_holds = (holds & ~degraded[:, None]).astype(np.int32)
    return np.asarray(csr(edges, n) @ healthy_holds)


def check_structure(edges: np.ndarray, n: int) -> np.ndarray:
    edges = np.asarray(edges)
    if edges.size == 0:
        edges = edges.reshape(0, 2)
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise MeshHealError(f"graph: edge list must have shape (E, 2), got {edges.shape}")
    if edges.size and not np.issubdtype(edges.dtype, np.integer):
        raise MeshHealError(f"graph: edge ids must be integers, got dtype {edges.dtype}")
    edges = edges.astype(np.int64)
    outside = (edges < 0) | (edges >= n)
    bad = np.flatnonzero(outside.any(axis=1))
    if bad.size:
        row = int(bad[0])
        agent = int(edges[row][outside[row]][0])
        raise MeshHealError(
            f"graph: edge {row} ({edges[row, 0]}, {edges[row, 1]}) names agent {agent}, outside 0..{n - 1}"
        )
    loops = np.flatnonzero(edges[:, 0] == edges[:, 1])
    if loops.size:
        row = int(loops[0])
        raise MeshHealError(f"graph: edge {row} is a self loop at {agent_label(int(edges[row, 0]), n)}")
    lo, hi = edges.min(axis=1), edges.max(axis=1)
    key = lo * n + hi
    order = np.argsort(key, kind="stable")
    same = np.flatnonzero(np.diff(key[order]) == 0)
    if same.size:
        first, second = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        raise MeshHealError(
            f"graph: edge ({lo[first]}, {hi[first]}) appears twice (rows {first} and {second})"
        )
    return edges


def check_requirements(
    holds: np.ndarray,
    degraded: np.ndarray,
    edges: Edges,
    hop_limit: int = HOP_LIMIT,
    ability_names: tuple[str, ...] | None = None,
) -> GraphStats:
    """Check every requirement of spec/experiments.md section 3 (module doc); raise MeshHealError
    naming the first broken one with its agent and ability, else return the graph's stats."""
    holds, degraded = _check_agents(holds, degraded)
    n = holds.shape[0]
    edges = check_structure(edges, n)
    check_connected(edges, n)
    counts = healthy_neighbour_counts(holds, degraded, edges)
    lacking = holds & (counts < 1)
    if lacking.any():
        i, s = (int(x) for x in np.argwhere(lacking)[0])
        role = "degraded target" if degraded[i] else "agent"
        raise MeshHealError(
            f"graph: {role} {agent_label(i, n).removeprefix('agent ')} has no non-degraded neighbour "
            f"holding {_ability_label(s, ability_names)}"
        )
    lacking = holds & degraded[:, None] & (counts < 2)
    if lacking.any():
        i, s = (int(x) for x in np.argwhere(lacking)[0])
        raise MeshHealError(
            f"graph: degraded target {agent_label(i, n).removeprefix('agent ')} has only {counts[i, s]} "
            f"non-degraded neighbour holding {_ability_label(s, ability_names)} (needs at least 2)"
        )
    dist = ability_distances(holds, degraded, edges)
    far = dist > hop_limit
    if far.any():
        i, s = (int(x) for x in np.argwhere(far)[0])
        what = _ability_label(s, ability_names)
        if dist[i, s] >= INF_DISTANCE:
            detail = f"cannot reach a non-degraded holder of {what} without passing through a degraded target"
        else:
            detail = (
                f"is {dist[i, s]} hops from the nearest non-degraded holder of {what} "
                f"(limit {hop_limit}; paths through degraded targets excluded)"
            )
        raise MeshHealError(f"graph: {agent_label(i, n)} {detail}")
    degree = np.bincount(edges.reshape(-1), minlength=n) if n else np.zeros(0, dtype=np.int64)
    complete = n * (n - 1) // 2
    return GraphStats(
        n_agents=n,
        n_edges=int(edges.shape[0]),
        edge_fraction=edges.shape[0] / complete if complete else 0.0,
        max_degree=int(degree.max(initial=0)),
        max_ability_distance=int(dist.max(initial=0)),
    )


# ----------------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------------


class _Builder:
    """Mutable edge set with per-agent neighbour sets and remaining needs (plain Python: the local
    cover is a sequential greedy; ints as ability bitmasks keep it fast)."""

    def __init__(self, holds: np.ndarray, degraded: np.ndarray, block: int, priority: np.ndarray):
        n, a = holds.shape
        self.n, self.block = n, block
        self.healthy = ~degraded
        bits = holds.astype(np.int64) @ (np.int64(1) << np.arange(a, dtype=np.int64))
        self.serve = np.where(self.healthy, bits, 0).tolist()  # abilities agent j counts for
        need = holds.astype(np.int64) * np.where(degraded, 2, 1)[:, None]
        self.need = need.tolist()  # (N, A) remaining healthy holders wanted
        self.need_mask = bits.tolist()  # abilities with need > 0
        self.holders = [np.flatnonzero(holds[:, s] & self.healthy).tolist() for s in range(a)]
        self.priority = priority.tolist()
        self.nbrs: list[set[int]] = [set() for _ in range(n)]
        self.edges: list[tuple[int, int]] = []

    def add(self, i: int, j: int) -> None:
        self.nbrs[i].add(j)
        self.nbrs[j].add(i)
        self.edges.append((min(i, j), max(i, j)))
        self._served(i, self.serve[j])
        self._served(j, self.serve[i])

    def _served(self, i: int, offered: int) -> None:
        common = self.need_mask[i] & offered
        while common:
            s = (common & -common).bit_length() - 1
            common &= common - 1
            self.need[i][s] -= 1
            if self.need[i][s] <= 0:
                self.need_mask[i] &= ~(1 << s)

    def _candidates(self, i: int, wanted: int, window: int | None) -> set[int]:
        found: set[int] = set()
        nbrs = self.nbrs[i]
        while wanted:
            s = (wanted & -wanted).bit_length() - 1
            wanted &= wanted - 1
            holders = self.holders[s]
            if window is not None:
                p = bisect.bisect_left(holders, i)
                holders = holders[max(0, p - window) : p + window]
            found.update(j for j in holders if j != i and j not in nbrs)
        return found

    def best_holder(self, i: int, wanted: int, mutual: bool) -> int | None:
        """The healthy holder of some ability in ``wanted`` to link i to (key in the module doc)."""
        start = (i // self.block) * self.block
        nbrs, serve_all = self.nbrs[i], self.serve
        cands = [
            j for j in range(start, min(start + self.block, self.n))
            if serve_all[j] & wanted and j != i and j not in nbrs
        ]  # fmt: skip
        cands = cands or self._candidates(i, wanted, _WINDOW) or self._candidates(i, wanted, None)
        if not cands:
            return None
        bi, block, serve, prio = i // self.block, self.block, self.serve, self.priority
        offer_i = serve[i] if mutual else 0
        need_mask = self.need_mask

        def key(j: int) -> tuple[int, int, int, int]:
            gain = (wanted & serve[j]).bit_count() + (need_mask[j] & offer_i).bit_count()
            return (abs(bi - j // block), -gain, abs(i - j), prio[j])

        return min(cands, key=key)

    def degree(self) -> np.ndarray:
        return np.fromiter((len(s) for s in self.nbrs), dtype=np.int64, count=self.n)


def _healthy_components(builder: _Builder) -> tuple[int, np.ndarray]:
    """Components of the healthy subgraph; degraded agents get label -1."""
    n = builder.n
    edges = np.asarray(builder.edges, dtype=np.int64).reshape(-1, 2)
    healthy = builder.healthy
    keep = healthy[edges[:, 0]] & healthy[edges[:, 1]]
    _, labels = scipy.sparse.csgraph.connected_components(csr(edges, n, keep), directed=False)
    labels = np.where(healthy, labels, -1)
    # relabel healthy components 0..C-1 in order of their smallest member
    firsts = np.unique(labels[healthy], return_index=True)[1] if healthy.any() else np.zeros(0, np.int64)
    old = labels[healthy][np.sort(firsts)]
    remap = np.full(n + 1, -1, dtype=np.int64)
    remap[old] = np.arange(old.size)
    return old.size, np.where(healthy, remap[labels], -1)


def _backbone(builder: _Builder, n_parts: int, labels: np.ndarray) -> None:
    """Ring over the healthy components, then every degraded agent without a healthy neighbour
    linked to the least-connected healthy agent of the nearest replica."""
    degree = builder.degree()
    prio = np.asarray(builder.priority)
    if n_parts > 1:
        members = np.argsort(labels, kind="stable")[np.sum(labels < 0) :]
        bounds = np.searchsorted(labels[members], np.arange(n_parts + 1))
        parts = [members[bounds[c] : bounds[c + 1]] for c in range(n_parts)]

        def endpoint(c: int) -> int:
            m = parts[c]
            j = int(m[np.lexsort((prio[m], degree[m]))[0]])
            degree[j] += 1
            return j

        links = [(c, c + 1) for c in range(n_parts - 1)] + ([(n_parts - 1, 0)] if n_parts > 2 else [])
        for c, d in links:
            i, j = endpoint(c), endpoint(d)
            if j not in builder.nbrs[i]:
                builder.add(i, j)
    healthy_idx = np.flatnonzero(builder.healthy)
    if healthy_idx.size == 0:
        for i in range(builder.n - 1):  # nothing healthy: a path, so at least rule 2 holds
            if i + 1 not in builder.nbrs[i]:
                builder.add(i, i + 1)
        return
    for i in np.flatnonzero(~builder.healthy).tolist():
        if any(builder.healthy[j] for j in builder.nbrs[i]):
            continue
        block = builder.block
        dist = np.abs(healthy_idx // block - i // block)
        j = int(healthy_idx[np.lexsort((prio[healthy_idx], degree[healthy_idx], dist))[0]])
        degree[j] += 1
        builder.add(i, j)


def _chords(builder: _Builder, labels: np.ndarray, target: int, rng: np.random.Generator) -> None:
    """Random links between least-connected healthy agents of different local components."""
    n = builder.n
    healthy_idx = np.flatnonzero(builder.healthy)
    prio = np.asarray(builder.priority)
    for _ in range(16):
        missing = target - len(builder.edges)
        if missing <= 0 or healthy_idx.size < 2:
            return
        degree = builder.degree()[healthy_idx]
        take = min(2 * missing + 16, healthy_idx.size - healthy_idx.size % 2)  # a few spare pairs
        ends = healthy_idx[np.lexsort((prio[healthy_idx], degree))[:take]]
        ends = rng.permutation(ends).reshape(-1, 2)
        lo, hi = ends.min(axis=1), ends.max(axis=1)
        existing = np.asarray(builder.edges, dtype=np.int64).reshape(-1, 2)
        keys = lo * n + hi
        ok = (labels[lo] != labels[hi]) & ~np.isin(keys, existing[:, 0] * n + existing[:, 1])
        _, first = np.unique(keys, return_index=True)
        unique = np.zeros(keys.size, dtype=bool)
        unique[first] = True
        ok &= unique
        chosen = np.flatnonzero(ok)[:missing]
        if chosen.size == 0:
            return
        for i, j in zip(lo[chosen].tolist(), hi[chosen].tolist()):
            builder.add(i, j)


def _repair(builder: _Builder, holds: np.ndarray, degraded: np.ndarray, hop_limit: int) -> None:
    """Link each agent still too far from a healthy holder of some ability to the holder covering
    the most of those abilities (nearest first), until no such agent is left."""
    for _ in range(8):
        edges = canonical(np.asarray(builder.edges).reshape(-1, 2))
        far = ability_distances(holds, degraded, edges) > hop_limit
        rows = np.flatnonzero(far.any(axis=1))
        if rows.size == 0:
            return
        added = 0
        weights = np.int64(1) << np.arange(holds.shape[1], dtype=np.int64)
        for i, wanted in zip(rows.tolist(), (far[rows].astype(np.int64) @ weights).tolist()):
            while wanted:
                j = builder.best_holder(i, wanted, mutual=False)
                if j is None:
                    break
                builder.add(i, j)
                added += 1
                wanted &= ~builder.serve[j]
        if added == 0:
            return


def sparse_edges(
    holds: np.ndarray,
    degraded: np.ndarray,
    seed: int,
    *,
    mean_degree: float = MEAN_DEGREE,
    hop_limit: int = HOP_LIMIT,
    block: int = BASE_AGENTS,
    ability_names: tuple[str, ...] | None = None,
) -> Edges:
    """A seeded sparse graph meeting every requirement (module doc) for ``holds (N, A)`` and
    ``degraded (N,)``; same inputs give identical edges. ``block`` is the replica size used for
    locality; ``ability_names`` only improve the error message when a rule cannot be met."""
    holds, degraded = _check_agents(holds, degraded)
    n = holds.shape[0]
    if n == 0:
        raise MeshHealError("graph: no agents")
    if block < 1:
        raise MeshHealError(f"graph: block must be positive, got {block}")
    rng = np.random.default_rng(seed)
    priority = rng.permutation(n)
    builder = _Builder(holds, degraded, block, priority)
    order = np.concatenate([np.flatnonzero(~degraded), np.flatnonzero(degraded)]).tolist()
    for i in order:
        while builder.need_mask[i]:
            j = builder.best_holder(i, builder.need_mask[i], mutual=bool(builder.healthy[i]))
            if j is None:
                break  # too few healthy holders: the checker below names the rule
            builder.add(i, j)
    n_parts, labels = _healthy_components(builder)
    _backbone(builder, n_parts, labels)
    _chords(builder, labels, round(mean_degree * n / 2), rng)
    _repair(builder, holds, degraded, hop_limit)
    edges = canonical(np.asarray(builder.edges).reshape(-1, 2))
    check_requirements(holds, degraded, edges, hop_limit, ability_names)
    return edges


# ----------------------------------------------------------------------------------------------
# Edge-list files
# ----------------------------------------------------------------------------------------------


def _as_id(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?[0-9]+", text):  # ASCII digits only: str.isdigit also takes "²"
            return int(text)
    return None


def _json_pairs(text: str, where: str) -> list[tuple[str, object]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise MeshHealError(f"{where}: not valid JSON: {err}") from None
    except RecursionError:
        raise MeshHealError(f"{where}: not valid JSON: nested too deeply") from None
    except ValueError as err:  # an integer of more than 4,300 digits
        raise MeshHealError(f"{where}: not valid JSON: {err}") from None
    if isinstance(doc, dict):
        if "edges" not in doc:
            raise MeshHealError(f"{where}: a JSON object needs an 'edges' list of [i, j] pairs")
        doc = doc["edges"]
    if not isinstance(doc, list):
        raise MeshHealError(f'{where}: expected a list of [i, j] pairs or {{"edges": [...]}}')
    return [(f"entry {k}", entry) for k, entry in enumerate(doc)]


def _csv_pairs(text: str) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")] if "," in line else line.split()
        if not rows and len(fields) == 2 and all(_as_id(f) is None for f in fields):
            rows.append(("header", None))  # e.g. "source,target"
            continue
        rows.append((f"line {number}", fields))
    return [row for row in rows if row[0] != "header"]


def load_edge_list(path: str | Path, n_agents: int) -> Edges:
    """Read an undirected edge list: CSV (two integer columns, comma or whitespace separated, an
    optional header line such as ``source,target``, ``#`` comments) or JSON (``[[i, j], ...]`` or
    ``{"edges": [[i, j], ...]}``). Each pair must be given once, in either orientation; a self loop,
    a repeated pair, an id outside ``0..n_agents-1`` or a malformed row is an error naming the file
    and the line (CSV) or entry (JSON). Returns canonical edges (i < j, sorted)."""
    path = Path(path)
    text = read_text(path, "graph file")
    where = f"graph file {path}"
    is_json = path.suffix.lower() == ".json" or text.lstrip()[:1] in ("[", "{")
    rows = _json_pairs(text, where) if is_json else _csv_pairs(text)
    seen: dict[tuple[int, int], str] = {}
    for place, entry in rows:
        ids: list[int | None] = [None]
        if isinstance(entry, list) and len(entry) == 2:
            # CSV fields are strings to parse; JSON ids must be JSON integers, not strings
            ids = [None if is_json and isinstance(x, str) else _as_id(x) for x in entry]
        if None in ids:
            shown = json.dumps(entry) if is_json else ",".join(entry)  # type: ignore[arg-type]
            raise MeshHealError(f"{where}, {place}: expected two integer agent ids, got {shown!r}")
        i, j = ids  # type: ignore[misc]
        for agent in (i, j):
            if not 0 <= agent < n_agents:
                raise MeshHealError(f"{where}, {place}: agent id {agent} outside 0..{n_agents - 1}")
        if i == j:
            raise MeshHealError(f"{where}, {place}: self loop at agent {i}")
        pair = (min(i, j), max(i, j))
        if pair in seen:
            raise MeshHealError(
                f"{where}, {place}: edge {pair} repeats {seen[pair]} (list each undirected pair once)"
            )
        seen[pair] = place
    if not seen:
        return np.zeros((0, 2), dtype=np.int32)
    return canonical(np.array(list(seen), dtype=np.int64))
