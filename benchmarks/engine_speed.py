"""Tasks per second of the JAX engine vs the reference engine on the 6-agent main experiment.

Both run the same streams (datasets x seeds, 504 tasks, default pair, emulated backend). The JAX
engine is timed three ways: compile (first call, reported apart), simulate (the compiled rounds
until every stream is done, block_until_ready before the clock), and end to end (simulate plus
gathering the records into the reference's row format). The reference is timed on the same
streams (its own emulator and records included). Median of --repeats; warm-up dropped.

    python benchmarks/engine_speed.py --seeds 5 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax

from meshheal_jax import draws as D
from meshheal_jax import engine, reference
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import load_pair
from meshheal_jax.streams import make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

DATASETS = ("bbh", "math", "mmlu_pro")


def specs(seeds: int, n_tasks: int = 504) -> list[engine.StreamSpec]:
    pair = load_pair("default")
    out = []
    for dataset in DATASETS:
        profile = load_profile(dataset)
        network = build_network(profile)
        for seed in range(seeds):
            stream = make_stream(seed, profile.dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded"))
            out.append(engine.StreamSpec(network, stream, persistent_schedule(6, n_tasks, network.degraded_targets),
                                         pair, {"dataset": dataset, "seed": seed}))  # fmt: skip
    return out


def simulate(cfg, params, worlds, chunk: int) -> int:
    carry = jax.vmap(lambda w: engine.initial_carry(cfg, w))(worlds)
    rounds = 0
    while not engine.done(cfg, carry).all():
        carry, records = engine.run_rounds(cfg, params, worlds, carry, chunk, True)
        jax.block_until_ready(records)
        rounds += chunk
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    protocol = ProtocolParams()
    streams = specs(args.seeds)
    n_tasks = sum(s.stream.n_tasks for s in streams)
    print(f"device: {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}), "
          f"jax {jax.__version__}; {len(streams)} streams x 504 tasks = {n_tasks} tasks")  # fmt: skip

    cfg = engine.EngineConfig(n_agents=6, n_abilities=7, n_types=7, n_tasks=504)
    params = engine.stack([engine.make_params(protocol, s.pair, s.network.profile, 6) for s in streams])
    worlds = engine.stack([engine.make_world(s.network, s.stream, s.schedule,
                                             D.stream_draws(s.stream.seed, s.stream.dataset_id, 504)) for s in streams])  # fmt: skip
    t0 = time.perf_counter()
    carry = jax.vmap(lambda w: engine.initial_carry(cfg, w))(worlds)
    jax.block_until_ready(engine.run_rounds(cfg, params, worlds, carry, args.chunk, True))
    compile_s = time.perf_counter() - t0

    sim = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        simulate(cfg, params, worlds, args.chunk)
        sim.append(time.perf_counter() - t0)
    e2e = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.run_streams(streams, protocol, chunk=args.chunk)
        e2e.append(time.perf_counter() - t0)
    draws = {(s.stream.seed, s.stream.dataset_id): D.stream_draws(s.stream.seed, s.stream.dataset_id, 504) for s in streams}
    ref = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for s in streams:
            eng = reference.ReferenceEngine(s.network, protocol, s.pair, s.stream, s.schedule,
                                            draws[(s.stream.seed, s.stream.dataset_id)], s.labels)  # fmt: skip
            eng.run()
        ref.append(time.perf_counter() - t0)

    def rate(times):
        return n_tasks / statistics.median(times)

    print(f"compile (first call, one chunk): {compile_s:.1f} s")
    print("| engine | median s | tasks/s | x reference |")
    print("|---|---|---|---|")
    r_ref = rate(ref)
    for name, times in (("reference (plain Python)", ref), ("jax: simulate", sim), ("jax: end to end (+ records)", e2e)):
        print(f"| {name} | {statistics.median(times):.2f} | {rate(times):,.0f} | {rate(times) / r_ref:.2f} |")


if __name__ == "__main__":
    main()
