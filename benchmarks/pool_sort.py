"""The detector's peer-pool sort alone: `jnp.sort` on float64 against `engine.sort_floats` (the
same values, sorted as int64 keys), on pools shaped like a wave's (rows x 42: K = 6 neighbours x
A = 7 abilities, the masked part +inf). Each compiled as the engine compiles (optimisation level 1),
median of `--repeats` calls after one dropped. Run it pinned to one core (`taskset -c 1`) to keep
XLA's thread pool out of the figure.

    taskset -c 1 python benchmarks/pool_sort.py --rows 64 12

A second table times what the detector takes from the sorted pool, its median and 25th percentile
(`engine.quantile_sorted` over `engine.sort_floats`), against the same two quantiles found
without a sort: each value's rank by counting the values below it (ties by position, O(width²)
comparisons per row, all elementwise), then the values at the quantiles' ranks.
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


def quantiles_by_sort(values, n):
    """(rows, 2): the median and 25th percentile of each row's first n sorted values, as the detector."""
    ordered = engine.sort_floats(values)
    return jax.vmap(
        lambda o, k: jnp.stack([engine.quantile_sorted(o, k, 0.5), engine.quantile_sorted(o, k, 0.25)])
    )(ordered, n)


def quantiles_by_rank(values, n):
    """The same two quantiles without a sort: the value of rank r is the one with r values below it
    (equal values ranked by position), so sorted[r] is a select over the row."""

    def row(v, k):
        position = jnp.arange(v.shape[-1])
        below = (v[None, :] < v[:, None]) | (
            (v[None, :] == v[:, None]) & (position[None, :] < position[:, None])
        )
        rank = below.sum(axis=1)

        def quantile(q):
            pos = q * (k - 1).astype(jnp.float64)
            lo = jnp.max(jnp.where(rank == jnp.floor(pos).astype(jnp.int32), v, -jnp.inf))
            hi = jnp.max(jnp.where(rank == jnp.ceil(pos).astype(jnp.int32), v, -jnp.inf))
            return lo + (hi - lo) * (pos - jnp.floor(pos))

        return jnp.stack([quantile(0.5), quantile(0.25)])

    return jax.vmap(row)(values, n)


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

    print(
        "\n| rows x width | quantiles by sort, µs | by rank, µs | rank / sort | same bits |\n|---|---|---|---|---|"
    )
    for rows in args.rows:
        # a pool like the detector's: values on a quarter grid (ties), n of them, the rest +inf, shuffled
        n = rng.integers(1, args.width + 1, size=rows)
        values = np.where(np.arange(args.width) < n[:, None], np.round(4 * rng.normal(size=(rows, args.width))) / 4,
                          np.inf)  # fmt: skip
        values = rng.permuted(values, axis=1)
        x, k = jnp.asarray(values), jnp.asarray(n, jnp.int32)
        same = np.array_equal(np.asarray(quantiles_by_sort(x, k)).view(np.int64),
                              np.asarray(quantiles_by_rank(x, k)).view(np.int64))  # fmt: skip
        a = timed(lambda v, k=k: quantiles_by_sort(v, k), x, args.repeats)
        b = timed(lambda v, k=k: quantiles_by_rank(v, k), x, args.repeats)
        print(f"| {rows} x {args.width} | {1e6 * a:.1f} | {1e6 * b:.1f} | {b / a:.1f}x | {same} |")


if __name__ == "__main__":
    main()
