"""Scale speed: wall time, peak memory and per-task cost of the JAX engine against network size and
against the number of streams (the scale experiment's networks: replicated bbh profiles, sparse
graphs from the seeded generator, complete graphs up to 576 agents; slots N/6).

Each point runs in its own process (so its peak RSS is its own, and its compile is cold: the
persistent compilation cache is off) on the first `--prefix-per-six` x N/6 tasks of the stream,
long enough to pass the detector's warm-up. Printed per point: compile + first chunk (s), the
steady seconds and tasks/s of the compiled rounds (median of --repeats, first call dropped),
microseconds per task (per stream and summed), and peak RSS.

    python benchmarks/scale_speed.py                      # sizes 6 .. 36,864 and streams at 6 / 576
    python benchmarks/scale_speed.py --quick              # 6, 96, 576 sparse; streams 1 and 4
    python benchmarks/scale_speed.py --sizes 576 9216 --streams-at 576 --widths 1 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

SIZES = [(6, False), (96, True), (576, True), (576, False), (2304, True), (9216, True), (36864, True)]


def one_point(n: int, sparse: bool, streams: int, prefix_per_six: int, repeats: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from sim_throughput import jax_rate, make_specs  # the same measurement as sim_throughput

    specs = make_specs(n, sparse, streams)
    slots = max(n // 6, 1)
    prefix = prefix_per_six * slots if n > 6 else None  # 6 agents: the whole 504-task stream
    r = jax_rate(specs, slots, prefix, max(4, 2048 // slots), repeats)
    r.update(agents=n, graph="sparse" if sparse else "complete", streams=streams, slots=slots,
             peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # fmt: skip
    return r


def run_point(n: int, sparse: bool, streams: int, prefix_per_six: int, repeats: int) -> dict | str:
    env = {**os.environ, "MESHHEAL_JAX_CACHE": "off"}  # a cold compile every time
    args = [sys.executable, __file__, "--point", str(n), "sparse" if sparse else "complete", str(streams),
            "--prefix-per-six", str(prefix_per_six), "--repeats", str(repeats)]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        return (out.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(title: str, points: list[tuple[int, bool, int]], prefix_per_six: int, repeats: int) -> list[dict]:
    print(f"\n### {title}\n| agents | graph | streams | slots | tasks | compile + first chunk s | steady s | "
          "tasks/s (sum) | µs per task | µs per task per stream | peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    for n, sparse, streams in points:
        r = run_point(n, sparse, streams, prefix_per_six, repeats)
        if isinstance(r, str):
            print(f"| {n:,} | {'sparse' if sparse else 'complete'} | {streams} | failed: {r} |")
            continue
        rows.append(r)
        print(f"| {n:,} | {r['graph']} | {streams} | {r['slots']:,} | {r['tasks']:,} | {r['first_call_s']:.1f} | "
              f"{r['seconds']:.2f} | {r['rate']:,.0f} | {1e6 / r['rate']:.0f} | {1e6 * streams / r['rate']:.0f} | "
              f"{r['peak_rss_mib']:,.0f} |", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6, 96, 576 sparse; streams 1 and 4; one repeat")
    ap.add_argument("--sizes", type=int, nargs="*", help="agents (sparse graphs) instead of the default list")
    ap.add_argument("--no-sizes", action="store_true", help="only the streams table")
    ap.add_argument("--streams-at", type=int, nargs="*", default=[6, 576], help="sizes for the streams table")
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 4, 16], help="numbers of streams")
    ap.add_argument("--prefix-per-six", type=int, default=40, help="tasks per six agents in the prefix")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the rows as JSON")
    ap.add_argument("--point", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        n, graph, streams = args.point
        print(
            json.dumps(one_point(int(n), graph == "sparse", int(streams), args.prefix_per_six, args.repeats))
        )
        return
    sizes = [(n, True) for n in args.sizes] if args.sizes else SIZES
    widths, repeats = args.widths, args.repeats
    if args.quick:
        sizes, widths, repeats = [(6, False), (96, True), (576, True)], [1, 4], 1
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"prefix {args.prefix_per_six} x N/6 tasks (6 agents: 504), slots N/6, median of {repeats}")  # fmt: skip
    rows = [] if args.no_sizes else table("against agents (1 stream)", [(n, sparse, 1) for n, sparse in sizes],
                                          args.prefix_per_six, repeats)  # fmt: skip
    at = [n for n in args.streams_at if not args.quick or n <= 576]
    rows += table(
        "against streams", [(n, n > 6, w) for n in at for w in widths], args.prefix_per_six, repeats
    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
