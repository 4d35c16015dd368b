"""Where the live client's CPU goes: `cProfile` over `LiveClient.run_batch` against the
fixed-latency STAND-IN of live_throughput.py (not a model), as section b drives it (one URL, the
semaphore at `--in-flight`, a dropped warm-up batch that opens the connections, no response cache).

Prints the client's CPU per call with and without the profiler, then the profiled CPU (the time
inside `epoll` left out: that is waiting) split into what the openai SDK's `post` took (building
the request, sending it through its HTTP transport, reading the reply) and the rest (LiveClient's
own work, the event loop), the shares of `post` that build the request and that send it, and the
largest functions by self time. cProfile counts every resumption
of a coroutine as a call, so read the times, not the call counts.

`--ab-telemetry TURNS` instead alternates LiveClient without and with the SDK's telemetry headers
(X-Stainless-*, which LiveClient leaves out) and prints each arm's CPU per call (median of each
client's batches) per turn, no profiler.

    python benchmarks/profile_client.py                        # 256 in flight, 3 batches of 1,024
    python benchmarks/profile_client.py --in-flight 1024 --top 40
    python benchmarks/profile_client.py --ab-telemetry 4
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live_throughput as lt

from meshheal_jax.backends import live
from meshheal_jax.backends.live import LiveClient, ServerGroup


def _cumulative(stats: pstats.Stats, file_part: str, function: str) -> float:
    """Cumulative seconds of the functions named `function` in files whose path holds `file_part`
    (the outermost frame's figure: cProfile does not double count recursion)."""
    return sum(
        row[3] for (path, _, name), row in stats.stats.items() if file_part in path and name == function
    )


async def profile(stand_in, latency: float, in_flight: int, size: int, batches: int) -> dict:
    group = ServerGroup("strong", (stand_in.url,), max_in_flight=in_flight)
    async with LiveClient([group], retry=lt.BENCH_RETRY) as client:
        await client.run_batch(lt.bench_requests(in_flight, seed_base=20_000))  # warm-up, dropped
        stand_in.reset(latency)
        plain = lt.bench_requests(size * batches, seed_base=70_000)
        cpu0 = time.process_time()
        await client.run_batch(plain)
        cpu_plain = time.process_time() - cpu0
        profiler = cProfile.Profile()
        cpu0 = time.process_time()
        profiler.enable()
        for k in range(batches):
            await client.run_batch(lt.bench_requests(size, seed_base=30_000 + k * 100_003))
        profiler.disable()
        cpu_profiled = time.process_time() - cpu0
    return {
        "profiler": profiler,
        "calls": size * batches,
        "cpu_plain": cpu_plain,
        "cpu_profiled": cpu_profiled,
    }


async def cpu_per_call(stand_in, in_flight: int, size: int, batches: int, telemetry: bool) -> float:
    """ms of client CPU per call, median over `batches` batches of `size` (after a warm-up batch),
    with the SDK's telemetry headers sent (`telemetry`) or not (LiveClient's own requests)."""
    kept = live._PLATFORM_HEADERS, live._PER_REQUEST_HEADERS
    if telemetry:  # nothing to omit: the SDK's defaults go out
        live._PLATFORM_HEADERS, live._PER_REQUEST_HEADERS = (), ()
    try:
        async with LiveClient(
            [ServerGroup("strong", (stand_in.url,), max_in_flight=in_flight)], retry=lt.BENCH_RETRY
        ) as client:
            await client.run_batch(lt.bench_requests(in_flight, seed_base=20_000))  # warm-up, dropped
            out = []
            for k in range(batches):
                batch = lt.bench_requests(size, seed_base=30_000 + k * 100_003)
                cpu0 = time.process_time()
                await client.run_batch(batch)
                out.append(1e3 * (time.process_time() - cpu0) / size)
            return statistics.median(out)
    finally:
        live._PLATFORM_HEADERS, live._PER_REQUEST_HEADERS = kept


def ab_telemetry(args) -> dict:
    arms = {"without telemetry headers (LiveClient)": False, "with the SDK's telemetry headers": True}
    results: dict[str, list[float]] = {name: [] for name in arms}
    with lt.FixedLatencyStandIn(args.latency) as stand_in:  # started at that latency
        for turn in range(args.ab_telemetry):
            order = list(arms) if turn % 2 == 0 else list(reversed(arms))
            for name in order:
                results[name].append(
                    asyncio.run(
                        cpu_per_call(stand_in, args.in_flight, args.requests, args.batches, arms[name])
                    )
                )
    print(f"client CPU per call, ms ({args.in_flight} in flight, {args.batches} batches of {args.requests:,} "
          f"a client, arms alternated, {args.ab_telemetry} turns)")  # fmt: skip
    for name, values in results.items():
        print(f"{name}: {' / '.join(f'{v:.3f}' for v in values)} (median {statistics.median(values):.3f})")
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in-flight", type=int, default=256, help="the client's semaphore")
    ap.add_argument("--requests", type=int, default=1024, help="requests per batch")
    ap.add_argument("--batches", type=int, default=3, help="profiled batches (and one plain run of as many)")
    ap.add_argument("--latency", type=float, default=0.2, help="the stand-in's latency (s)")
    ap.add_argument("--top", type=int, default=25, help="functions listed by self time")
    ap.add_argument(
        "--ab-telemetry", type=int, metavar="TURNS", help="A/B: without and with telemetry headers"
    )
    args = ap.parse_args(argv)
    if args.ab_telemetry:
        return ab_telemetry(args)
    with lt.FixedLatencyStandIn(args.latency) as stand_in:
        run = asyncio.run(profile(stand_in, args.latency, args.in_flight, args.requests, args.batches))
    stats = pstats.Stats(run["profiler"])
    waiting = sum(
        row[2]
        for (_, _, name), row in stats.stats.items()
        if name == "<method 'poll' of 'select.epoll' objects>"
    )
    total = stats.total_tt - waiting
    sdk = _cumulative(stats, "openai/_base_client.py", "post")
    calls = run["calls"]
    out = {
        "cpu_ms_per_call": 1e3 * run["cpu_plain"] / calls,
        "cpu_ms_per_call_profiled": 1e3 * run["cpu_profiled"] / calls,
        "sdk_post_share": sdk / total,
    }
    print(f"{calls:,} calls at {args.in_flight} in flight, stand-in latency {args.latency:g} s")
    print(
        f"client CPU per call: {out['cpu_ms_per_call']:.3f} ms ({out['cpu_ms_per_call_profiled']:.3f} ms under cProfile)"
    )
    print(f"profiled time, epoll's waiting left out: {total:.2f} s; the openai SDK's `post`: {sdk:.2f} s "
          f"({100 * out['sdk_post_share']:.0f}%); the rest (LiveClient, the event loop): {total - sdk:.2f} s")  # fmt: skip
    build = _cumulative(stats, "openai/_base_client.py", "_build_request")
    send = _cumulative(stats, "openai/_base_client.py", "_send_request")
    out.update(build_share_of_post=build / sdk, send_share_of_post=send / sdk)
    print(f"of the SDK's `post`: building the request (`_build_request`) {100 * build / sdk:.0f}%, "
          f"sending it and reading the reply (`_send_request`) {100 * send / sdk:.0f}%")  # fmt: skip
    stats.sort_stats("tottime").print_stats(args.top)
    return out


if __name__ == "__main__":
    main()
