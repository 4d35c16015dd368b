"""What XLA's intra-op threads cost a one-lane round (benchmarks/README.md, twentieth session).

XLA's CPU runtime hands parts of a program to its intra-op thread pool: it splits some kernels
into partitions (`outer_dimension_partitions`, fixed when the program is compiled) and passes
ready kernels to another thread (ThunkExecutor, at run time). `PJRT_NPROC=1`, XLA's own variable,
sizes the pool to one thread. Each configuration below is its own process, an ab_rounds.py arm
(built once; one turn = `--chunks` chunks of `--rounds` rounds of `--streams` streams, default 1, from the same mid-run
state, timed with `block_until_ready`), and the arms take turns in an order that rotates:

  default        the pool XLA sizes (the cores this process may use)
  PJRT_NPROC=1   one intra-op thread: no partitions, no hand-off
  pinned         the whole process on one core (pinning.py's pin, before JAX starts)
  compiled-1     the program loaded from a persistent cache that the PJRT_NPROC=1 arm compiled
                 into, and run on the default pool: no partitions, the default pool

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
sys.path.insert(0, str(HERE))
from ab_rounds import _reply, _turn, add_arm_options, stopping
from pinning import _arm


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
    add_arm_options(ap, turns=6, skip=3)
    ap.add_argument("--gather", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gather:
        return gather_child()

    # the package on PYTHONPATH if given (another checkout), else this one; no compile cache
    base = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    base.update(PYTHONPATH=os.environ.get("PYTHONPATH") or str(HERE.parent), MESHHEAL_JAX_CACHE="off")
    one = base | {"PJRT_NPROC": "1"}
    with tempfile.TemporaryDirectory() as cache:
        cached = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        arms = {"PJRT_NPROC=1": _arm(args, None, one | cached)}  # compiles into the cache with one thread
        with stopping(arms.values()):
            _reply(arms["PJRT_NPROC=1"], "ready")
            compiled = len(os.listdir(cache))
            arms |= {"default": _arm(args, None, base), "pinned": _arm(args, min(os.sched_getaffinity(0)), base),
                     "compiled-1": _arm(args, None, base | cached)}  # fmt: skip
            for name in ("default", "pinned", "compiled-1"):
                _reply(arms[name], "ready")
            built = len(os.listdir(cache))  # more than `compiled`: the compiled-1 arm missed the cache
            names = ["default", "PJRT_NPROC=1", "pinned", "compiled-1"]
            seconds: dict[str, list[float]] = {name: [] for name in names}
            for turn in range(args.turns):
                for name in names[turn % len(names) :] + names[: turn % len(names)]:
                    seconds[name].append(_turn(arms[name]))
    print(f"{args.agents} agents x {args.streams} stream(s), slots {max(1, args.agents // 6)}: round time per process, "
          f"{args.turns} turns of {args.chunks} x {args.rounds} rounds; the one-thread cache held {compiled} "
          f"programs once its arm was built, {built} once the compiled-1 arm was (more: it missed some)")  # fmt: skip
    print("\n| configuration | round ms (median of turns) | best | vs default |\n|---|---|---|---|")
    ref = statistics.median(seconds["default"])
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"| {name} | {1e3 * med:.3f} | {1e3 * min(values):.3f} | {100 * (med / ref - 1):+.1f}% |")
    print("\n| 32-row gather | µs per gather | partitioned kernels |\n|---|---|---|")
    for name, env in (("default", base), ("PJRT_NPROC=1", one)):
        g = child(["--gather"], env)
        print(f"| {name} | {g['gather_us']:.2f} | {g['partitioned']} |")


if __name__ == "__main__":
    main()
