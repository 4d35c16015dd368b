"""The JAX engine against the reference engine, and its own invariants."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import polars as pl
import pytest

from meshheal_jax import engine, metrics, reference, runner
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair
from meshheal_jax.streams import (
    RECOVERY_PHASES,
    HealthSchedule,
    make_stream,
    persistent_schedule,
    recovery_schedule,
)
from meshheal_jax.topology import build_network, load_profile

PROTOCOL = ProtocolParams()
PAIR = load_pair("default")
TABLES = ("tasks", "reviews", "states", "calls")


def main_spec(dataset: str, seed: int, n_tasks: int = 504, n_agents: int = 6) -> engine.StreamSpec:
    profile = load_profile(dataset)
    network = build_network(profile, n_agents)
    stream = make_stream(seed, profile.dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded"))
    schedule = persistent_schedule(n_agents, n_tasks, network.degraded_targets)
    return engine.StreamSpec(network, stream, schedule, PAIR,
                             {"method": "meshheal", "dataset": dataset, "pair": "default", "seed": seed})  # fmt: skip


def recovery_spec(seed: int) -> engine.StreamSpec:
    profile = load_profile("math")
    network = build_network(profile)
    stream = make_stream(seed, profile.dataset_id, 630, 7, (1, 127, 253, 379, 505), RECOVERY_PHASES)
    return engine.StreamSpec(network, stream, recovery_schedule(630), PAIR,
                             {"method": "meshheal", "dataset": "math", "pair": "default", "seed": seed})  # fmt: skip


def first_difference(ref_rows: list[dict], jax_rows: list[dict], table: str) -> str | None:
    """'' if equal; else the first differing row with its task and fields."""
    a = ref_rows if isinstance(ref_rows, pl.DataFrame) else metrics.frame(table, ref_rows)
    b = jax_rows if isinstance(jax_rows, pl.DataFrame) else metrics.frame(table, jax_rows)
    for i in range(min(a.height, b.height)):
        ra, rb = a.row(i, named=True), b.row(i, named=True)
        diff = {}
        for col in ra:
            x, y = ra[col], rb[col]
            if isinstance(x, float) and isinstance(y, float):
                if abs(x - y) > 1e-9:  # z and s_u: float tolerance; everything else exact
                    diff[col] = (x, y)
            elif x != y:
                diff[col] = (x, y)
        if diff:
            return f"{table} row {i} (t={ra.get('t')}): {diff}"
    if a.height != b.height:
        return f"{table}: {a.height} reference rows vs {b.height} jax rows"
    return None


def assert_equal_to_reference(
    specs: list[engine.StreamSpec], protocol: ProtocolParams = PROTOCOL
) -> list[dict[str, pl.DataFrame]]:
    """Every table of every stream equal to the reference's; returns the JAX engine's tables."""
    results = engine.run_streams(specs, protocol, lanes=1)  # one vmapped batch, whatever the cores
    for spec, tables in zip(specs, results):
        ref = reference.run_stream(spec.network, protocol, spec.pair, spec.stream, spec.schedule, spec.labels)
        for table in TABLES:
            problem = first_difference(getattr(ref, table), tables[table], table)
            assert problem is None, f"{spec.labels}: {problem}"
    return results


def test_full_streams_equal_reference_every_dataset():
    """504-task streams, 3 datasets x 2 seeds, batched in one program: record by record."""
    assert_equal_to_reference([main_spec(d, s) for d in ("bbh", "math", "mmlu_pro") for s in (0, 3)])


def test_recovery_stream_equals_reference():
    assert_equal_to_reference([recovery_spec(0), recovery_spec(1)])


PATH_6 = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
RING_6 = PATH_6 + ((5, 0),)


def sparse_spec(edges: tuple, degraded: tuple[int, ...], seed: int, n_tasks: int = 126) -> engine.StreamSpec:
    """6 math agents on `edges`; degraded[k] is degraded from task 10 + 10k to the end."""
    profile = load_profile("math")
    network = build_network(profile, 6, edges=np.array(edges))
    stream = make_stream(seed, profile.dataset_id, n_tasks, 7, (1,), ("all",))
    schedule = HealthSchedule(
        6, n_tasks, tuple((a, 10 + 10 * k, n_tasks + 1) for k, a in enumerate(degraded))
    )
    return engine.StreamSpec(network, stream, schedule, PAIR,
                             {"method": "meshheal", "dataset": "math", "pair": "default", "seed": seed})  # fmt: skip


def routing_events(tables: dict[str, pl.DataFrame], protocol: ProtocolParams) -> dict[str, int]:
    """How often the rarer routing and detector paths occurred, read from the record tables."""
    tasks, states = tables["tasks"], tables["states"]
    actions = tasks["actions"].str.split(",")
    budget = tasks.filter(pl.col("end") == "move budget")
    # a budget ending before move_limit moves was stopped by route_limit (moves since the last
    # output); with route_limit > move_limit, every budget ending is move_limit's
    by_route = budget.filter(pl.col("moves") < protocol.move_limit).height
    return {
        "route_limit ended": by_route,
        "move_limit ended": budget.height if protocol.route_limit > protocol.move_limit else 0,
        "unreachable ability": int((tasks["end"] == "unreachable ability").sum()),
        "rawrelay": int(actions.list.contains("rawrelay").sum()),  # tasks entering at an isolated agent
        "relay": int(actions.list.contains("relay").sum()),  # tasks relayed on by an isolated agent
        "probe": int(actions.list.contains("probe").sum()),  # tasks with a probe move
        "probe review": int(tables["reviews"]["probe"].sum()),  # outputs written on a probe visit
        "isolated": int((states["to"] == "isolated").sum()),
        "probe return": int((states["reason"] == "probe z<beta").sum()),  # isolated -> watched
    }


@pytest.mark.parametrize(
    "edges, degraded, seed, protocol, expected",
    [
        pytest.param(
            PATH_6, (0, 1, 5), 0,
            ProtocolParams(probe_interval=2, warmup_per_six=3, route_limit=2, move_limit=3),
            ("route_limit ended", "rawrelay", "relay", "probe", "probe review", "isolated", "probe return"),
            id="path-tight-budget",
        ),
        pytest.param(
            RING_6, (3, 5), 2,
            ProtocolParams(probe_interval=3, warmup_per_six=5, move_limit=3),
            ("move_limit ended", "unreachable ability", "rawrelay", "relay", "probe", "probe review", "isolated"),
            id="ring-short-probe",
        ),
    ],
)  # fmt: skip
def test_sparse_graphs_and_tight_budgets_equal_reference(edges, degraded, seed, protocol, expected):
    """Sparse graphs, harsh schedules and tight protocol parameters, where the complete-graph tests
    rarely go: RawRelay at entry, relays through isolated agents, probes, isolation and its probe
    return, and tasks ended unanswered by the move budget or an unreachable ability. Every table
    equals the reference's, and each case's paths really occurred (both cases share one compile:
    same agents, tasks, move_limit and neighbour-table width)."""
    tables = assert_equal_to_reference([sparse_spec(edges, degraded, seed)], protocol)[0]
    events = routing_events(tables, protocol)
    assert all(events[name] > 0 for name in expected), events


def test_lowest_index_ties_equal_reference_and_change_routes():
    """next_hop_ties="lowest" (the DECISION's alternative, protocol.md §2): both engines take the
    lowest-index neighbour among equally near ones; on a ring, where the far agent is two hops
    either way, the routes differ from random ties."""
    lowest = ProtocolParams(probe_interval=3, warmup_per_six=5, move_limit=3, next_hop_ties="lowest")
    spec = sparse_spec(RING_6, (3, 5), 2)
    tables = assert_equal_to_reference([spec], lowest)[0]
    drawn = engine.run_streams([spec], dataclasses.replace(lowest, next_hop_ties="random"), lanes=1)[0]
    assert not tables["tasks"]["route"].equals(drawn["tasks"]["route"])
    with pytest.raises(MeshHealError, match="unknown next_hop_ties 'first'"):
        ProtocolParams(next_hop_ties="first")


def test_hop_per_task_convergence_equals_reference_and_routes_on_stale_tables():
    """convergence="hop_per_task" (protocol.md §2's extension, decisions P6): both engines relax the
    tables one step per task and not when a state changes, so a task can still head for an agent
    isolated during it. Every table equals the reference's. On the ring (seed 9, the shipped model
    files) three tasks, 75, 109 and 119, take other routes than with instant convergence, with two
    more relays (on these 6-agent graphs every ability has three holders, so stale entries rarely
    change a next hop; one task, 75, with the third fit command's files)."""
    path = (sparse_spec(PATH_6, (0, 1, 5), 0),
            ProtocolParams(probe_interval=2, warmup_per_six=3, route_limit=2, move_limit=3))  # fmt: skip
    ring = (sparse_spec(RING_6, (3, 5), 9), ProtocolParams(probe_interval=3, warmup_per_six=5, move_limit=3))
    for spec, protocol in (path, ring):
        hop = dataclasses.replace(protocol, convergence="hop_per_task")
        tables = assert_equal_to_reference([spec], hop)[0]
    instant = engine.run_streams([ring[0]], ring[1], lanes=1)[0]
    differ = tables["tasks"].filter(tables["tasks"]["route"] != instant["tasks"]["route"])
    assert differ["t"].to_list() == [75, 109, 119]
    assert routing_events(tables, hop)["relay"] == routing_events(instant, ring[1])["relay"] + 2
    with pytest.raises(MeshHealError, match="unknown convergence 'slow'"):
        ProtocolParams(convergence="slow")


def test_the_matched_evidence_minimum_is_its_own_parameter_in_both_engines():
    """min_matched (§5 step 7's DECISION "enough matched evidence") moves the peer pool only: with
    it at 6, both engines agree (so both read it, not min_observations, for the pool), and z is
    formed on fewer outputs (pools fill later) than at the default 3."""
    spec = main_spec("bbh", 0, n_tasks=252)
    tables = assert_equal_to_reference([spec], dataclasses.replace(PROTOCOL, min_matched=6))[0]
    default = engine.run_streams([spec], PROTOCOL, lanes=1)[0]
    with_z = lambda t: int(t["reviews"]["z"].is_not_null().sum())
    assert with_z(tables) < with_z(default)
    with pytest.raises(MeshHealError, match="min_matched must be >= 1"):
        ProtocolParams(min_matched=0)


def test_hop_per_task_convergence_main_stream_equals_reference():
    """A 504-task MMLU-Pro stream on the complete graph: an isolation's news reaches every agent
    in one step there, and the engines still agree record by record."""
    assert_equal_to_reference(
        [main_spec("mmlu_pro", 1)], dataclasses.replace(PROTOCOL, convergence="hop_per_task")
    )


def random_graph_specs(count: int, n_tasks: int = 126) -> list[engine.StreamSpec]:
    """sparse_spec on random connected graphs (a random spanning tree, then each other edge with
    probability 0.3), 1-3 random agents degraded."""
    rng = np.random.default_rng(20261205)
    specs = []
    for seed in range(count):
        upper = np.triu(rng.random((6, 6)) < 0.3, 1)
        order = rng.permutation(6)
        for k in range(1, 6):  # agent order[k] joins the tree under an earlier one
            a, b = sorted((int(order[k]), int(order[rng.integers(0, k)])))
            upper[a, b] = True
        degraded = tuple(int(a) for a in rng.choice(6, size=int(rng.integers(1, 4)), replace=False))
        specs.append(sparse_spec(tuple(map(tuple, np.argwhere(upper).tolist())), degraded, seed, n_tasks))
    return specs


@pytest.mark.parametrize("convergence", ["instant", "hop_per_task"])
def test_random_graphs_equal_reference(convergence):
    """Eight random graphs in one batch (one neighbour-table width), a tight budget and short
    probe intervals: every table equals the reference's, with both convergence rules, and the
    rarer paths occur somewhere in the batch (the budget's endings: the fixed path and ring cases)."""
    protocol = ProtocolParams(probe_interval=3, warmup_per_six=5, route_limit=2, move_limit=4,
                              convergence=convergence)  # fmt: skip
    results = assert_equal_to_reference(random_graph_specs(8), protocol)
    events = [routing_events(tables, protocol) for tables in results]
    for name in ("unreachable ability", "rawrelay", "relay", "probe", "probe review", "isolated"):
        assert sum(e[name] for e in events) > 0, (name, events)


def test_hop_per_task_convergence_with_tasks_in_flight():
    """Slots > 1: each round's starting tasks relax the tables before they start, one step each
    (a while loop whose length differs per stream under the vmap). Every task finishes, and a
    stream's records do not depend on the stream beside it (the batch in the other order)."""
    from meshheal_jax import runner

    hop = dataclasses.replace(PROTOCOL, convergence="hop_per_task")
    exp = runner.Experiment("scale", ("bbh",), ("default",), (0, 1), n_agents=12, slots=2, n_tasks=168,
                            degraded=None, topology="sparse", protocol=hop)  # fmt: skip
    specs = []
    for seed in exp.seeds:
        network, stream, pair, labels = runner._stream_inputs(exp, "bbh", "default", seed)
        specs.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
    together = engine.run_streams(specs, hop, slots=2, lanes=1)
    alone = engine.run_streams(specs[::-1], hop, slots=2, lanes=1)[0]  # the other order: one program
    assert together[0]["tasks"]["t"].to_list() == list(range(1, 169))
    assert (together[0]["states"]["to"] == "isolated").any()
    for table in TABLES:
        assert first_difference(together[1][table], alone[table], table) is None


def test_vmap_equals_separate_runs_and_is_deterministic():
    specs = [main_spec("math", s, 84) for s in (0, 1, 2)]
    together = engine.run_streams(specs, PROTOCOL, lanes=1)
    alone = engine.run_streams([specs[1]], PROTOCOL)
    again = engine.run_streams([specs[1]], PROTOCOL)
    for table in TABLES:
        # same draws, same decisions; floats may differ in the last bit between batch widths
        # (XLA fuses differently), within the reference comparison's 1e-9
        assert first_difference(together[1][table], alone[0][table], table) is None
        assert alone[0][table].equals(again[0][table])  # same program, same inputs: bit for bit


def test_streams_of_one_dataset_with_different_pairs_each_get_their_own():
    """Batched streams read per-stream parameters whenever their pairs' files differ, not only
    their datasets (stream 1: the default pair with pair A's weak model, e.g. a sweep or a fit's
    candidate; stream 0: the default pair)."""
    swapped = dataclasses.replace(PAIR, weak=load_pair("A").weak)  # same pair name, other files
    other = dataclasses.replace(main_spec("math", 1, 84), pair=swapped)
    together = engine.run_streams([main_spec("math", 0, 84), other], PROTOCOL, lanes=1)
    alone = engine.run_streams([other], PROTOCOL)
    for table in TABLES:
        assert first_difference(together[1][table], alone[0][table], table) is None
    assert set(together[1]["calls"]["model"]) != set(together[0]["calls"]["model"])


def test_compiles_once_per_shape():
    engine.run_streams([main_spec("bbh", 0, 42)], PROTOCOL, chunk=64)
    before = engine.TRACES["run_rounds"]
    engine.run_streams([main_spec("bbh", 5, 42)], PROTOCOL, chunk=64)  # same shapes, other seed
    engine.run_streams([main_spec("bbh", 6, 42)], PROTOCOL, chunk=64)
    assert engine.TRACES["run_rounds"] == before


def test_jit_equals_no_jit_on_a_short_stretch():
    spec = main_spec("math", 0, 42)
    cfg = engine.EngineConfig(n_agents=6, n_abilities=7, n_types=7, n_tasks=42)
    params = engine.make_params(PROTOCOL, PAIR, spec.network.profile, 6)
    world = engine.make_world(spec.network, spec.stream, spec.schedule)
    carry = engine.initial_carry(cfg, world)
    step = jax.jit(lambda c: engine.round_step(cfg, params, world, c))
    jitted, plain = carry, carry
    for _ in range(6):
        jitted, rec_j = step(jitted)
        with jax.disable_jit():
            plain, rec_p = engine.round_step(cfg, params, world, plain)
    leaves_j, leaves_p = jax.tree_util.tree_leaves((jitted, rec_j)), jax.tree_util.tree_leaves((plain, rec_p))
    for x, y in zip(leaves_j, leaves_p):
        np.testing.assert_allclose(np.asarray(x, dtype=float), np.asarray(y, dtype=float), rtol=0, atol=1e-12)
    assert int(jitted.next_t) > 1  # the stretch really processed tasks


def test_scores_and_z_are_finite():
    tables = engine.run_streams([main_spec("bbh", 2, 168)], PROTOCOL)[0]
    reviews = tables["reviews"]
    for col in ("u1", "u2", "u3", "q0", "s_u", "q"):
        assert reviews[col].is_finite().all()
    assert reviews["z"].drop_nulls().is_finite().all()


def test_controller_never_reads_health_or_truth():
    """emit and absorb run with the backend-only fields removed from the world."""
    spec = main_spec("math", 0, 42)
    cfg = engine.EngineConfig(n_agents=6, n_abilities=7, n_types=7, n_tasks=42)
    params = engine.make_params(PROTOCOL, PAIR, spec.network.profile, 6)
    world = engine.make_world(spec.network, spec.stream, spec.schedule)
    blind = dataclasses.replace(world, degraded_from=None, degraded_until=None, true_pair=None)
    step = jax.jit(lambda c: engine.round_step(cfg, params, world, c)[0])
    emit_blind = jax.jit(lambda slots: engine.emit(cfg, params, blind, slots))
    emulate = jax.jit(
        lambda backend, requests, draws: engine.emulate(cfg, params, world, backend, requests, draws)[1]
    )
    absorb_blind = jax.jit(
        lambda net, slot, resp, draws_t: engine.absorb_slot(cfg, params, blind, net, slot, resp, draws_t)
    )
    emit_full = jax.jit(lambda slots: engine.emit(cfg, params, world, slots))
    carry = engine.initial_carry(cfg, world)
    for _ in range(8):
        carry = step(carry)  # advance with the full world
        requests = emit_blind(carry.slots)
        assert jax.tree_util.tree_all(
            jax.tree_util.tree_map(np.array_equal, requests, emit_full(carry.slots))
        )
        responses = emulate(carry.backend, requests, carry.draws)
        absorb_blind(carry.net, engine.at(carry.slots, 0), engine.at(responses, 0), engine.at(carry.draws, 0))


def test_slots_above_one_agree_statistically():
    """12 agents, 2 in-flight tasks vs 1: same accuracy within sampling error (6 seeds)."""
    specs = [main_spec("mmlu_pro", s, 336, n_agents=12) for s in range(6)]
    acc = {}
    for slots in (1, 2):
        results = engine.run_streams(specs, PROTOCOL, slots=slots)
        acc[slots] = np.array([res["tasks"]["correct"].mean() for res in results])
        assert all(res["tasks"]["t"].sort().to_list() == list(range(1, 337)) for res in results)
    diff = acc[2] - acc[1]
    standard_error = np.sqrt(2 * 0.85 * 0.15 / 336 / len(specs))
    assert abs(diff.mean()) < 4 * standard_error, (acc, diff)
    assert not np.array_equal(acc[1], acc[2])  # evidence order really differs with 2 slots


def test_rejects_slots_beyond_n_over_6():
    with pytest.raises(engine.MeshHealError, match="slots"):
        engine.run_streams([main_spec("math", 0, 42)], PROTOCOL, slots=2)


def test_emulate_with_lazy_call_draws_equals_the_full_block():
    """`emulate` draws only the call rows each slot's phase reads (decisions D4); given the whole
    (visits, call slots, 4) block of `draws.task_draws` instead, `emulate_slot` answers the same,
    every output leaf, over rounds that go through every phase (12 agents, 2 slots)."""
    from meshheal_jax import draws as D

    spec = main_spec("math", 0, 126, n_agents=12)
    cfg = engine.EngineConfig(n_agents=12, n_abilities=7, n_types=7, n_tasks=126, slots=2)
    params = engine.make_params(PROTOCOL, PAIR, spec.network.profile, 12)
    world = engine.make_world(spec.network, spec.stream, spec.schedule)

    def full_block(backend, requests, draws, ts):
        calls = jax.vmap(lambda t: D.task_draws(world.seed, world.dataset_id, t).calls)(ts)
        u_calls = calls[np.arange(cfg.slots), requests.visit]
        return jax.vmap(engine.emulate_slot, in_axes=(None, None, 0, 0, 0, 0))(
            params, world, backend, requests, u_calls, draws.infer)  # fmt: skip

    lazy = jax.jit(lambda b, r, d: engine.emulate(cfg, params, world, b, r, d))
    full = jax.jit(full_block)
    take = jax.jit(lambda c: engine._take_tasks(cfg, params, world, c))
    emit = jax.jit(lambda s: engine.emit(cfg, params, world, s))
    step = jax.jit(lambda c: engine.round_step(cfg, params, world, c)[0])
    carry, phases = engine.initial_carry(cfg, world), set()
    for _ in range(240):
        taken = take(carry)
        requests = emit(taken.slots)
        ts = np.maximum(np.asarray(taken.slots.t), 1).astype(np.int32)
        got, want = lazy(taken.backend, requests, taken.draws), full(taken.backend, requests, taken.draws, ts)
        assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))
        phases |= set(np.asarray(requests.phase)[np.asarray(requests.mask).any(axis=1)].tolist())
        carry = step(carry)
    assert phases >= {engine.INFER, engine.GENERATE, engine.REVIEW, engine.ROUND1, engine.ROUND2,
                      engine.CANDIDATES, engine.SYNTH}  # fmt: skip


def test_several_slots_keep_committees_on_real_agents_and_releases_to_probes(tmp_path):
    """Two things only several tasks in flight can reach (with one slot nothing changes between an
    output's review and its committee, and no isolated agent writes a non-probe output): every
    eligible reviewer turned watched or isolated by another task since the initial review (the
    committee falls back to the initial reviewer, decisions S11; it was 'agent -1', read as the last
    agent), and an author isolated while its output was under review (that output moves no state,
    S12; it released 5% of the isolations at 576 agents). 48 agents, 8 slots, 4,032 tasks."""
    exp = runner.Experiment(name="scale", datasets=("bbh",), pairs=("default",), seeds=(0,), n_agents=48,
                            n_tasks=504 * 8, degraded=None, topology="sparse", slots=8)  # fmt: skip
    run = runner.run(exp, tmp_path / "run", progress=False)
    assert run.calls["agent"].min() >= 0
    committees = run.reviews.filter(pl.col("committee"))
    assert committees.height and committees.select(pl.min("committee_a"), pl.min("committee_b")).row(0) >= (
        0,
        0,
    )
    released = run.states.filter(pl.col("from") == "isolated")
    assert released.height and released["probe"].all()
