"""Simulation throughput: the JAX engine against the plain-Python reference on the same work.

Every figure is tasks per second measured in this run, on this machine, with the ratio to the
reference engine measured on the same streams (or the same prefix of them). The JAX engine is
timed on its compiled rounds only (compile reported apart, warm-up call dropped,
`block_until_ready` before every clock read); records are gathered but not written. The
reference runs one task at a time (slots = 1) with its own emulator and records.

Sections (each prints a markdown table):
  main   6 agents, complete graph, 3 datasets x seeds, full 504-task streams
  scale  96 and 576 agents, sparse graph, a prefix past the warm-up (slots 1 and N/6)
  batch  tasks/s against the number of streams (6 and 576 agents), in one lane and in --lanes
         lanes side by side (one thread each, as experiments run them by default)
  size   per-task cost against agents (sparse 6 .. 36,864; complete to 576), each size in its
         own process so its peak RSS is its own

    python benchmarks/sim_throughput.py --quick      # under a minute; last line ratio_576_sparse=...
    python benchmarks/sim_throughput.py --sections main scale batch size
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

import meshheal_jax  # noqa: F401  (sets the XLA CPU flags before JAX starts)
from meshheal_jax import draws as D
from meshheal_jax import engine, graphs, reference
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import load_pair
from meshheal_jax.streams import make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile, replicate_holds

PROTOCOL = ProtocolParams()


def network(dataset: str, n_agents: int, sparse: bool):
    profile = load_profile(dataset)
    if not sparse:
        return build_network(profile, n_agents)
    holds = replicate_holds(profile, n_agents)
    degraded = graphs.degraded_mask(profile.degraded_targets, n_agents)
    return build_network(profile, n_agents, edges=graphs.sparse_edges(holds, degraded, 0))


def make_specs(
    n_agents: int, sparse: bool, seeds: int, datasets=("bbh",), first_seed: int = 0
) -> list[engine.StreamSpec]:
    pair = load_pair("default")
    n_tasks = 504 * n_agents // 6
    out = []
    for dataset in datasets:
        net = network(dataset, n_agents, sparse)
        for seed in range(first_seed, first_seed + seeds):
            stream = make_stream(
                seed, net.profile.dataset_id, n_tasks, 7, (1, n_tasks // 2 + 1), ("healthy", "degraded")
            )
            out.append(engine.StreamSpec(net, stream, persistent_schedule(n_agents, n_tasks, net.degraded_targets), pair,
                                         {"method": "meshheal", "dataset": dataset, "pair": "default", "seed": seed}))  # fmt: skip
    return out


def engine_inputs(specs, slots: int):
    """(cfg, params, worlds, params batched) of the JAX engine for these streams."""
    cfg = engine.engine_config(specs, PROTOCOL, slots)
    batched = engine.params_per_stream(specs)
    if batched:
        params = engine.stack(
            [engine.make_params(PROTOCOL, s.pair, s.network.profile, cfg.n_agents) for s in specs]
        )
    else:
        params = engine.make_params(PROTOCOL, specs[0].pair, specs[0].network.profile, cfg.n_agents)
    k_max = max(s.network.neighbour_table.shape[1] for s in specs)
    worlds = engine.stack([engine.make_world(s.network, s.stream, s.schedule, k_max) for s in specs])
    return cfg, params, worlds, batched


def tasks_finished(cfg, carry) -> int:
    """Tasks finished so far, summed over the carry's streams (entered and no longer in a slot)."""
    active = np.asarray((carry.slots.phase != engine.IDLE).sum(axis=-1))
    return int((np.minimum(np.asarray(carry.next_t) - 1, cfg.n_tasks) - active).sum())


def timed_prefix(specs, slots: int, prefix: int | None, chunk: int):
    """once() -> (seconds, tasks finished): the compiled rounds over the first `prefix` tasks of
    every stream (all if None), from the initial carry."""
    cfg, params, worlds, batched = engine_inputs(specs, slots)
    limit = prefix or cfg.n_tasks

    def once() -> tuple[float, int]:
        carry = engine.initial_carries(cfg, worlds)
        jax.block_until_ready(carry)
        start = time.perf_counter()
        while True:
            carry, records = engine.run_rounds(cfg, params, worlds, carry, chunk, batched)
            jax.block_until_ready((carry, records))
            if engine.done(cfg, carry).all() or np.asarray(carry.next_t).min() > limit:
                break
        return time.perf_counter() - start, tasks_finished(cfg, carry)

    return once


def jax_rate(specs, slots: int, prefix: int | None, chunk: int, repeats: int) -> dict:
    """tasks/s of the compiled rounds over the first `prefix` tasks of every stream (all if None)."""
    once = timed_prefix(specs, slots, prefix, chunk)
    start = time.perf_counter()
    once()  # compile + warm-up, dropped
    compile_s = time.perf_counter() - start
    runs = [once() for _ in range(repeats)]
    seconds = statistics.median(r[0] for r in runs)
    tasks = runs[0][1]
    return {"seconds": seconds, "tasks": tasks, "rate": tasks / seconds, "first_call_s": compile_s}


def reference_rate(specs, prefix: int | None) -> dict:
    tasks = 0
    start = time.perf_counter()
    for s in specs:
        n = prefix or s.stream.n_tasks
        eng = reference.ReferenceEngine(s.network, PROTOCOL, s.pair, s.stream, s.schedule,
                                        D.stream_draws(s.stream.seed, s.stream.dataset_id, n), s.labels)  # fmt: skip
        for t in range(1, n + 1):
            eng.run_task(t)
        tasks += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tasks": tasks, "rate": tasks / seconds}


def header() -> None:
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {len(jax.devices())} JAX device(s) {jax.devices()[0].device_kind}, "
          f"{__import__('os').cpu_count()} cores; jax {jax.__version__}")  # fmt: skip


def row(name: str, r: dict, ref: float | None) -> str:
    ratio = f"{r['rate'] / ref:.1f}x" if ref else "—"
    first = f"{r['first_call_s']:.1f}" if "first_call_s" in r else "—"
    return f"| {name} | {r['tasks']:,} | {r['seconds']:.2f} | {r['rate']:,.0f} | {ratio} | {first} |"


TABLE = (
    "| run | tasks | s (median) | tasks/s | x reference | first call s (compile) |\n|---|---|---|---|---|---|"
)


def section_main(seeds: int, repeats: int) -> None:
    specs = make_specs(6, False, seeds, ("bbh", "math", "mmlu_pro"))
    print(f"\n### main: 6 agents, complete, 3 datasets x {seeds} seeds x 504 tasks\n{TABLE}")
    ref = reference_rate(specs, None)
    print(row("reference (slots 1)", ref, ref["rate"]))
    print(row("jax (slots 1)", jax_rate(specs, 1, None, 512, repeats), ref["rate"]))


def section_scale(
    sizes, seeds: int, prefix_per_six: int, repeats: int, slots_one: bool = True
) -> float | None:
    ratio = None
    for n in sizes:
        specs = make_specs(n, True, seeds)
        prefix = prefix_per_six * n // 6
        print(f"\n### {n} agents, sparse, {seeds} seed(s), first {prefix:,} tasks per stream "
              f"(warm-up {PROTOCOL.warmup_tasks(n):,})\n{TABLE}")  # fmt: skip
        ref = reference_rate(specs[:1], prefix)  # the reference's rate is per task: one stream suffices
        print(row("reference (slots 1, 1 stream)", ref, ref["rate"]))
        if slots_one:  # the sequential semantics: another compiled program
            print(row("jax (slots 1)", jax_rate(specs, 1, prefix, 256, repeats), ref["rate"]))
        default = jax_rate(specs, n // 6, prefix, max(8, 2048 // (n // 6)), repeats)
        print(row(f"jax (slots {n // 6} = N/6, default)", default, ref["rate"]))
        if n == 576:
            ratio = default["rate"] / ref["rate"]
    return ratio


def lanes_rate(n: int, width: int, lanes: int, repeats: int) -> dict:
    """tasks/s summed over `width` streams run in `lanes` lanes side by side (engine.run_batch's
    lanes: one thread each, one carry each, one compiled program), timed like `jax_rate`: every
    pass starts all lanes at once and ends when the last is done (median of `repeats`)."""
    groups = [make_specs(n, n > 6, len(g), first_seed=g[0]) for g in engine.lane_streams(width, lanes)]
    if any(len(g) != len(groups[0]) for g in groups):
        raise SystemExit(f"{width} streams do not split evenly into {lanes} lanes")
    onces = [
        timed_prefix(g, max(n // 6, 1), BATCH_PREFIX_PER_SIX[n] * n // 6, BATCH_CHUNK[n]) for g in groups
    ]

    def one_pass() -> tuple[float, int]:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(onces)) as pool:
            done = [future.result() for future in [pool.submit(once) for once in onces]]
        return time.perf_counter() - start, sum(tasks for _, tasks in done)

    one_pass()  # compile (once: the lanes share the program) + warm-up, dropped
    passes = [one_pass() for _ in range(repeats)]
    return {"rate": statistics.median(tasks / seconds for seconds, tasks in passes), "tasks": passes[0][1]}


BATCH_PREFIX_PER_SIX = {6: 504, 576: 40}
BATCH_CHUNK = {6: 256, 576: 32}


def section_batch(widths, repeats: int, lanes: int = 2, sizes=(6, 576)) -> None:
    """tasks/s against streams in one lane (one vmapped batch), and (where the streams divide) in
    `lanes` lanes side by side."""
    for n in sizes:
        per_six = BATCH_PREFIX_PER_SIX[n]
        print(f"\n### batch scaling: {n} agents ({'complete' if n == 6 else 'sparse'}), slots {max(n // 6, 1)}, "
              f"first {per_six * n // 6:,} tasks per stream\n"
              f"| streams | tasks/s, one lane | tasks/s, {lanes} lanes |\n|---|---|---|")  # fmt: skip
        for width in widths:
            specs = make_specs(n, n > 6, width)
            r = jax_rate(specs, max(n // 6, 1), per_six * n // 6, BATCH_CHUNK[n], repeats)
            w = lanes_rate(n, width, lanes, repeats)["rate"] if lanes > 1 and width % lanes == 0 else None
            print(f"| {width} | {r['rate']:,.0f} | {'—' if w is None else f'{w:,.0f}'} |")


def one_size(n: int, sparse: bool, prefix_per_six: int) -> dict:
    specs = make_specs(n, sparse, 1)
    r = jax_rate(specs, max(n // 6, 1), prefix_per_six * n // 6, max(4, 2048 // max(n // 6, 1)), 1)
    r["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return r


def section_size(sizes, prefix_per_six: int) -> None:
    print("\n### size scaling: 1 stream, slots N/6, first "
          f"{prefix_per_six} x N/6 tasks\n| agents | graph | tasks | s | tasks/s | us per task | peak RSS MiB |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for n, sparse in sizes:
        out = subprocess.run([sys.executable, __file__, "--one-size", str(n), "--sparse" if sparse else "--complete",
                              "--prefix-per-six", str(prefix_per_six)], check=False, capture_output=True, text=True)  # fmt: skip
        if out.returncode:
            print(
                f"| {n:,} | {'sparse' if sparse else 'complete'} | failed: {out.stderr.strip().splitlines()[-1]} |"
            )
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {n:,} | {'sparse' if sparse else 'complete'} | {r['tasks']:,} | {r['seconds']:.1f} | {r['rate']:,.0f} | "
              f"{1e6 / r['rate']:.0f} | {r['peak_rss_mib']:,.0f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="576 sparse only, 1 seed: the reference once, the JAX engine at slots 1 and at the default slots (median of 5 repeats each); under a minute",
    )
    ap.add_argument("--sections", nargs="*", default=["main", "scale", "batch", "size"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--lanes", type=int, default=2, help="batch: also run each width in this many lanes side by side"
    )
    ap.add_argument(
        "--widths", type=int, nargs="*", default=[1, 2, 4, 16, 64, 256], help="batch: numbers of streams"
    )
    ap.add_argument(
        "--batch-agents", type=int, nargs="*", default=[6, 576], choices=[6, 576], help="batch: network sizes"
    )
    ap.add_argument("--one-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sparse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--complete", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--prefix-per-six", type=int, default=40, help="tasks per six agents in the scale/size prefix"
    )
    args = ap.parse_args()
    if args.one_size:
        print(json.dumps(one_size(args.one_size, args.sparse, args.prefix_per_six)))
        return
    header()
    if args.quick:  # the JAX runs take well under a second each: their median over 5 repeats is cheap
        ratio = section_scale([576], 1, args.prefix_per_six, 5)
        print(f"ratio_576_sparse={ratio:.1f}")
        return
    ratio = None
    if "main" in args.sections:
        section_main(args.seeds, args.repeats)
    if "scale" in args.sections:
        ratio = section_scale([96, 576], args.seeds, args.prefix_per_six, args.repeats)
    if "batch" in args.sections:
        section_batch(args.widths, max(1, args.repeats // 2), args.lanes, args.batch_agents)
    if "size" in args.sections:
        section_size([(6, False), (96, True), (576, True), (576, False), (2304, True), (9216, True), (36864, True)],
                     args.prefix_per_six)  # fmt: skip
    if ratio is not None:
        print(f"ratio_576_sparse={ratio:.1f}")


if __name__ == "__main__":
    main()
