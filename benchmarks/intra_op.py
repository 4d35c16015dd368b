"""What XLA's intra-op threads cost a one-lane round (benchmarks/README.md, twentieth session).

XLA's CPU runtime hands parts of a program to its intra-op thread pool: it splits some kernels
into partitions (`outer_dimension_partitions`, fixed when the program is compiled) and passes
ready kernels to another thread (ThunkExecutor, at run time). `PJRT_NPROC=1`, XLA's own variable,
sizes the pool to one thread. Each configuration below runs in its own process, in turns (the
order rotates from turn to turn), and times one stream's rounds from a mid-run state
(benchmarks/ab_rounds.py's arm: `--chunks` chunks of `--rounds` rounds, `block_until_ready`):

  default        the pool XLA sizes (the cores this process may use)
  PJRT_NPROC=1   one intra-op thread: no partitions, no hand-off
  pinned         the whole process on one core (`taskset`-like, before JAX starts)
  compiled-1     the program compiled with PJRT_NPROC=1 into a fresh persistent cache, then
                 loaded and run by a default process: no partitions, the default pool

Then one partitioned kernel alone: a 32-row gather from a (576, 7, 7, 8) array in a loop, µs per
gather, by default and with PJRT_NPROC=1.

    python benchmarks/intra_op.py                  # 576 agents, 6 turns
    python benchmarks/intra_op.py --agents 6 --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def round_child(agents: int, rounds: int, chunks: int, skip: int, pin: bool) -> None:
    """One configuration: the median seconds per round over 5 timed passes, as JSON on stdout."""
    if pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before JAX starts its threads
    sys.path.insert(0, str(HERE))
    import jax
    import jax.numpy as jnp
    import sim_throughput as B

    from meshheal_jax import engine

    specs = B.make_specs(agents, agents > 6, 1)
    cfg, params, worlds, batched = B.engine_inputs(specs, max(1, agents // 6))
    start = engine.initial_carries(cfg, worlds)
    for _ in range(skip):
        start, _ = engine.run_rounds(cfg, params, worlds, start, rounds, batched)
    jax.block_until_ready(start)
    times = []
    for _ in range(5):
        carry = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, start))  # run_rounds donates it
        t0 = time.perf_counter()
        for _ in range(chunks):
            carry, records = engine.run_rounds(cfg, params, worlds, carry, rounds, batched)
        jax.block_until_ready((carry, records))
        times.append((time.perf_counter() - t0) / (chunks * rounds))
    print(json.dumps({"round_s": statistics.median(times)}))


def gather_child() -> None:
    """µs per 32-row gather (8 float64 each) from a (576, 7, 7, 8) array, in a 2,000-step loop whose
    next rows depend on the last ones; the compiled program's partitioned kernels counted."""
    import jax
    import jax.numpy as jnp

    import meshheal_jax  # noqa: F401  (the package's XLA flags)

    jax.config.update("jax_enable_x64", True)
    table = jnp.arange(576 * 49 * 8, dtype=jnp.float64).reshape(576, 7, 7, 8)

    def body(k, carry):
        total, i = carry
        rows = table[i, i % 7, (i // 7) % 7]  # (32, 8)
        return total + rows.sum(), (i + rows[:, 0].astype(jnp.int32) + k) % 576

    steps = 2000
    run = jax.jit(lambda i: jax.lax.fori_loop(0, steps, body, (0.0, i)))
    i0 = jnp.arange(32, dtype=jnp.int32)
    jax.block_until_ready(run(i0))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(run(i0))
        best = min(best, time.perf_counter() - t0)
    partitioned = run.lower(i0).compile().as_text().count('outer_dimension_partitions":["2"')
    print(json.dumps({"gather_us": 1e6 * best / steps, "partitioned": partitioned}))


def child(args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=576)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument(
        "--skip", type=int, default=3, help="chunks run before the timed state (past the warm-up)"
    )
    ap.add_argument("--child", choices=["round", "gather"], help=argparse.SUPPRESS)
    ap.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "round":
        return round_child(args.agents, args.rounds, args.chunks, args.skip, args.pin)
    if args.child == "gather":
        return gather_child()

    base = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"} | {"MESHHEAL_JAX_CACHE": "off"}
    one = base | {"PJRT_NPROC": "1"}
    sizes = ["--agents", str(args.agents), "--rounds", str(args.rounds), "--chunks", str(args.chunks),
             "--skip", str(args.skip)]  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        cached = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        child(["--child", "round", *sizes], one | cached)  # compiles into the cache with one thread
        compiled = len(os.listdir(cache))
        configs = {
            "default": (["--child", "round", *sizes], base),
            "PJRT_NPROC=1": (["--child", "round", *sizes], one),
            "pinned": (["--child", "round", "--pin", *sizes], base),
            "compiled-1": (["--child", "round", *sizes], base | cached),
        }
        seconds: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for turn in range(args.turns):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                seconds[name].append(child(*configs[name])["round_s"])
        after = len(os.listdir(cache))
    print(f"{args.agents} agents, 1 stream, slots {max(1, args.agents // 6)}: round time per process, "
          f"{args.turns} turns of {args.chunks} x {args.rounds} rounds; the one-thread cache held {compiled} "
          f"programs after compiling, {after} at the end (more: compiled-1 missed it)")  # fmt: skip
    print("\n| configuration | round ms (median of turns) | best | vs default |\n|---|---|---|---|")
    ref = statistics.median(seconds["default"])
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"| {name} | {1e3 * med:.3f} | {1e3 * min(values):.3f} | {100 * (med / ref - 1):+.1f}% |")
    print("\n| 32-row gather | µs per gather | partitioned kernels |\n|---|---|---|")
    for name, env in (("default", base), ("PJRT_NPROC=1", one)):
        g = child(["--child", "gather"], env)
        print(f"| {name} | {g['gather_us']:.2f} | {g['partitioned']} |")


if __name__ == "__main__":
    main()
