"""What the live backend's response cache costs per call, in this checkout.

1. Its parts, alone (no server): the key (canonical JSON + sha256 of a 4.5 KB prompt), a missed
   `get`, the row's JSON and secret redaction, `put` with its own commit, and the same insert in a
   transaction of many (what `put_soon` does for the replies of one event-loop turn).
2. In use: `LiveClient` without and with a `ResponseCache` against the fixed-latency STAND-IN of
   live_throughput.py (not a model: it sleeps 2 s per request), 1,024 requests at 256 in flight,
   median of 3 batches each, client CPU ms per call, and the difference.

    python benchmarks/cache_cost.py                  # this checkout
    python benchmarks/cache_cost.py --cache-first    # the cached client first (order effects)
    # A/B against another commit's package (this file's harness, the other checkout's client):
    git worktree add /tmp/before <ref>
    PYTHONPATH=/tmp/before python benchmarks/cache_cost.py     # alternate with the line above
"""

from __future__ import annotations

import argparse
import asyncio
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
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness beside this file
    import live_throughput as lt

    def cpu_ms_per_call(stand_in, cache_dir: str | None) -> float:
        runs = asyncio.run(lt.live_client_batches(stand_in, 2.0, 256, 1024, 3, cache_dir and Path(cache_dir)))
        return statistics.median(run["cpu_s"] / 1024 * 1e3 for run in runs)

    with lt.FixedLatencyStandIn(2.0) as stand_in, tempfile.TemporaryDirectory() as tmp:
        if cache_first:
            cached = cpu_ms_per_call(stand_in, tmp)
            plain = cpu_ms_per_call(stand_in, None)
        else:
            plain = cpu_ms_per_call(stand_in, None)
            cached = cpu_ms_per_call(stand_in, tmp)
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
