"""When each HTTP call of section b starts and ends: a timeline of `LiveClient.run_batch` against
the fixed-latency STAND-IN of live_throughput.py (not a model), as section b drives it (one URL,
the semaphore at `--in-flight`, a dropped warm-up batch that opens the connections, no response
cache), to show where section b's host overhead comes from.

The stand-in answers every request `--latency` seconds after it has read it, so a batch of
`--waves` × in-flight requests runs in waves: a slot's next request leaves when its reply has been
read. Per batch it prints the wall time and the host overhead as section b computes them, the
client's CPU per call, each call's time inside the SDK's `post` (the latency plus what the client
and the stand-in add), and per wave when its calls started and ended. A wave's spread (its last
start after its first) is what the client's and the stand-in's work per call stretch it by; the
overhead is the first wave's start plus the last wave's spread and tail.

    python benchmarks/live_timeline.py                     # 256 in flight, 4 waves, 2 s, 2 batches
    python benchmarks/live_timeline.py --in-flight 64 --latency 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live_throughput as lt

from meshheal_jax.backends.live import LiveClient, ServerGroup


def _timed_posts(client: LiveClient, events: list[tuple[float, float]]) -> None:
    """Wrap every lane's SDK `post` to append (start, end) of each call to `events`."""
    for servers in client._servers.values():  # role -> its servers, each with its lanes
        for server in servers:
            for sdk, _http in server.lanes:
                post = sdk.post

                async def timed(*args, _post=post, **kwargs):
                    start = time.perf_counter()
                    try:
                        return await _post(*args, **kwargs)
                    finally:
                        events.append((start, time.perf_counter()))

                sdk.post = timed


def waves(events: list[tuple[float, float]], t0: float, in_flight: int) -> list[dict]:
    """The batch's calls in order of their start, cut into waves of `in_flight` (seconds after t0)."""
    starts = sorted(start - t0 for start, _ in events)
    ends = sorted(end - t0 for _, end in events)
    return [
        {"wave": w, "first_start": starts[i], "last_start": starts[min(i + in_flight, len(starts)) - 1],
         "first_end": ends[i], "last_end": ends[min(i + in_flight, len(ends)) - 1]}
        for w, i in enumerate(range(0, len(starts), in_flight))
    ]  # fmt: skip


async def timeline(url: str, latency: float, in_flight: int, n_waves: int, batches: int) -> list[dict]:
    group = ServerGroup("strong", (url,), max_in_flight=in_flight)
    out = []
    async with LiveClient([group], retry=lt.BENCH_RETRY) as client:
        await client.run_batch(lt.bench_requests(in_flight, seed_base=20_000))  # warm-up, dropped
        events: list[tuple[float, float]] = []
        _timed_posts(client, events)
        for k in range(batches):
            events.clear()
            gc.collect()
            batch = lt.bench_requests(n_waves * in_flight, seed_base=30_000 + k * 100_003)
            t0 = time.perf_counter()
            run = await lt.timed_batch(client, batch)  # section b's clocks
            wall, ideal = run["wall_s"], n_waves * latency
            posts = [end - start for start, end in events]
            out.append({
                "wall_s": wall, "host_overhead": (wall - ideal) / wall,
                "cpu_ms_per_call": 1e3 * run["cpu_s"] / len(batch),
                "post_s": (min(posts), statistics.median(posts), max(posts)),
                "waves": waves(events, t0, in_flight),
            })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in-flight", type=int, default=256, help="the semaphore (section b: 256)")
    ap.add_argument("--latency", type=float, default=2.0, help="the stand-in's seconds per request")
    ap.add_argument("--waves", type=int, default=4, help="requests per batch = waves x in flight")
    ap.add_argument("--batches", type=int, default=2, help="timed batches, after one dropped warm-up")
    args = ap.parse_args(argv)
    with lt.FixedLatencyStandIn(args.latency) as stand_in:
        runs = asyncio.run(timeline(stand_in.url, args.latency, args.in_flight, args.waves, args.batches))
    print(f"{args.in_flight} in flight, {args.waves} waves, stand-in latency {args.latency:g} s")
    for k, run in enumerate(runs):
        low, mid, high = run["post_s"]
        print(f"batch {k}: wall {run['wall_s']:.3f} s, host overhead {run['host_overhead']:.1%}, "
              f"client CPU {run['cpu_ms_per_call']:.3f} ms per call; post {low:.3f} / {mid:.3f} / {high:.3f} s "
              "(min / median / max)")  # fmt: skip
        print("| wave | first start s | last start s | spread s | first end s | last end s |")
        print("|---|---|---|---|---|---|")
        for w in run["waves"]:
            print(f"| {w['wave']} | {w['first_start']:.3f} | {w['last_start']:.3f} | "
                  f"{w['last_start'] - w['first_start']:.3f} | {w['first_end']:.3f} | {w['last_end']:.3f} |")  # fmt: skip
    return runs


if __name__ == "__main__":
    main()
