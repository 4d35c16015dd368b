"""The detector's peer-pool sort alone: `jnp.sort` on float64 against `engine.sort_floats` (the
same values, sorted as int64 keys), on pools shaped like a wave's (rows x 42: K = 6 neighbours x
A = 7 abilities, the masked part +inf). Each compiled as the engine compiles (optimisation level 1),
median of `--repeats` calls after one dropped. Run it pinned to one core (`taskset -c 1`) to keep
XLA's thread pool out of the figure.

    taskset -c 1 python benchmarks/pool_sort.py --rows 64 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshheal_jax import engine


def timed(fn, x, repeats: int) -> float:
    f = jax.jit(fn, compiler_options=engine.COMPILER_OPTIONS)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 12])
    ap.add_argument("--width", type=int, default=42)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(
        "| rows x width | jnp.sort, µs | engine.sort_floats, µs | speed-up | same bits |\n|---|---|---|---|---|"
    )
    for rows in args.rows:
        values = rng.normal(size=(rows, args.width))
        values[:, (3 * args.width) // 4 :] = np.inf  # masked pool entries
        x = jnp.asarray(values)
        same = np.array_equal(np.asarray(jnp.sort(x, axis=-1)).view(np.int64),  # bit for bit
                              np.asarray(engine.sort_floats(x)).view(np.int64))  # fmt: skip
        a, b = (
            timed(lambda v: jnp.sort(v, axis=-1), x, args.repeats),
            timed(engine.sort_floats, x, args.repeats),
        )
        print(f"| {rows} x {args.width} | {1e6 * a:.1f} | {1e6 * b:.1f} | {a / b:.1f}x | {same} |")


if __name__ == "__main__":
    main()
