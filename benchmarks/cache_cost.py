"""What the live backend's response cache costs per call, in this checkout.

1. Its parts, alone (no server): the key (canonical JSON + sha256 of a 4.5 KB prompt), a missed
   `get`, the row's JSON and secret redaction, `put` with its own commit, and the same insert in a
   transaction of many (what `put_soon` does for the replies of one event-loop turn).
2. In use: `LiveClient` without and with a `ResponseCache` against the fixed-latency STAND-IN of
   live_throughput.py (not a model: it sleeps 2 s per request), 1,024 requests at 256 in flight,
   median of 3 batches each, client CPU ms per call, and the difference.

    python benchmarks/cache_cost.py                  # this checkout
    python benchmarks/cache_cost.py --cache-first    # the cached client first (order effects)
    # A/B against another commit: git worktree add /tmp/before <ref>, then alternate
    (cd /tmp/before && PYTHONPATH=/tmp/before python /path/to/this/benchmarks/cache_cost.py)

The second part needs the stand-in's module from the checkout it runs in (benchmarks/), so an A/B
runs each arm from its own checkout directory.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

from meshheal_jax.backends.cache import (
    ResponseCache,
    _secret_values,
    cache_key,
    canonical_json,
    redact_secrets,
)


def parts(n: int = 3000) -> dict[str, float]:
    """µs per operation of each part, alone."""
    messages = [{"role": "system", "content": "x" * 1500}, {"role": "user", "content": "y" * 3000}]
    params = {"temperature": 0.7, "max_tokens": 2048, "seed": 0, "n": 1}
    payload = {"choices": [{"content": "z" * 800, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 1000, "completion_tokens": 200}, "latency_s": 2.0}  # fmt: skip

    def per_op(f) -> float:
        start = time.perf_counter()
        for i in range(n):
            f(i)
        return (time.perf_counter() - start) / n * 1e6

    with tempfile.TemporaryDirectory() as tmp, ResponseCache(Path(tmp) / "c.sqlite") as cache:
        out = {
            "key": per_op(lambda i: cache_key("m", messages, dict(params, seed=i))),
            "get (miss)": per_op(lambda i: cache.get(f"k{i}")),
            "row JSON + redaction": per_op(
                lambda i: redact_secrets(canonical_json(payload), _secret_values())
            ),
            "put (own commit)": per_op(lambda i: cache.put(f"p{i}", "m", payload)),
        }
        if hasattr(cache, "_write"):  # a checkout before the grouped writes has none
            rows = [cache._row(f"q{i}", "m", payload) for i in range(n)]
            start = time.perf_counter()
            cache._write(rows)
            out["insert in one transaction"] = (time.perf_counter() - start) / n * 1e6
    return out


def in_use(cache_first: bool) -> dict[str, float]:
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import live_throughput as lt

    from meshheal_jax.backends.live import LiveClient, ServerGroup

    async def arm(stand_in, cache_dir: str | None) -> float:
        cache = ResponseCache(Path(cache_dir) / "r.sqlite") if cache_dir else None
        per_call = []
        group = ServerGroup("strong", (stand_in.url,), max_in_flight=256)
        try:
            async with LiveClient([group], cache=cache, retry=lt.BENCH_RETRY) as client:
                await client.run_batch(lt.bench_requests(256, seed_base=20_000))  # warm-up, dropped
                for k in range(3):
                    stand_in.reset(2.0)
                    gc.collect()
                    seeds = 30_000 + k * 100_003 + (7 if cache_dir else 0)
                    run = await lt.timed_batch(client, lt.bench_requests(1024, seed_base=seeds))
                    per_call.append(run["cpu_s"] / 1024 * 1e3)
        finally:
            if cache is not None:
                cache.close()
        return statistics.median(per_call)

    with lt.FixedLatencyStandIn(2.0) as stand_in, tempfile.TemporaryDirectory() as tmp:
        if cache_first:
            cached = asyncio.run(arm(stand_in, tmp))
            plain = asyncio.run(arm(stand_in, None))
        else:
            plain = asyncio.run(arm(stand_in, None))
            cached = asyncio.run(arm(stand_in, tmp))
    return {"no cache": plain, "cache": cached, "cache - no cache": cached - plain}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-first", action="store_true", help="run the cached client first")
    ap.add_argument("--parts-only", action="store_true", help="skip the stand-in run")
    args = ap.parse_args(argv)
    for name, us in parts().items():
        print(f"{name}: {us:.1f} µs")
    if not args.parts_only:
        for name, ms in in_use(args.cache_first).items():
            print(f"{name}: {ms:.3f} ms CPU per call")


if __name__ == "__main__":
    main()
