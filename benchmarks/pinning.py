"""How many cores one JAX engine process really uses: its round time alone and side by side,
pinned to one core each or left to the OS (docs/decisions.md S7: why the engine runs lanes).

Four processes of this checkout build the same network and mid-run state (benchmarks/ab_rounds.py's
arm: one turn = `--chunks` chunks of `--rounds` rounds, timed with `block_until_ready`): two free
to run on every core, two pinned to a core each from their start (`os.sched_setaffinity`, before
JAX starts its threads). Each turn times four scenarios, in an order that rotates from turn to
turn: one free process alone, one pinned process alone, both free processes at once, both pinned
processes at once. Prints each scenario's median round time per process, the cores each process
kept busy (its CPU time over the turn's wall time, from /proc), and its rounds per second summed
over its processes, against one free process alone.

    python benchmarks/pinning.py                      # 576 agents, 1 stream, 8 turns
    python benchmarks/pinning.py --agents 6 --streams 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab_rounds import _reply, add_arm_options, arm_command, stopping

SCENARIOS = {"one process, free": ["free0"], "one process, pinned": ["pin0"],
             "two processes, free": ["free0", "free1"], "two processes, pinned": ["pin0", "pin1"]}  # fmt: skip


def _pin(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def _arm(args: argparse.Namespace, core: int | None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """An ab_rounds.py arm (build, then one turn per 'go'), pinned to `core` unless None; `env`:
    default this checkout's package, no compile cache."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), MESHHEAL_JAX_CACHE="off") if env is None else env
    return subprocess.Popen(arm_command(args), cwd=HERE.parent, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=None if core is None else _pin(core))  # noqa: PLW1509 (no threads here yet)  # fmt: skip


def _cpu_seconds(proc: subprocess.Popen) -> float:
    """The process's user + system CPU time so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arm_options(ap, turns=8)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs two cores, this process may use {len(cores)}")
    procs = {"free0": _arm(args, None), "free1": _arm(args, None), "pin0": _arm(args, cores[0]),
             "pin1": _arm(args, cores[1])}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    busy: dict[str, list[float]] = {name: [] for name in SCENARIOS}  # cores busy per process
    with stopping(procs.values()):
        for proc in procs.values():
            _reply(proc, "ready")
        names = list(SCENARIOS)
        for turn in range(args.turns):
            for name in names[turn % 4 :] + names[: turn % 4]:
                members = [procs[m] for m in SCENARIOS[name]]
                cpu, start = [_cpu_seconds(proc) for proc in members], time.perf_counter()
                for proc in members:  # all start at once
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                times[name].extend(float(_reply(proc, "seconds")) for proc in members)
                wall = time.perf_counter() - start
                busy[name].extend((_cpu_seconds(proc) - c) / wall for proc, c in zip(members, cpu))
    base = statistics.median(times["one process, free"])
    print(f"{args.agents} agents x {args.streams} stream(s) per process, {args.turns} turns of {args.chunks} x "
          f"{args.rounds} rounds, {len(cores)} cores")  # fmt: skip
    print("| scenario | round ms per process, median | cores busy per process | rounds/s summed over processes | "
          "vs one free process |\n|---|---|---|---|---|")  # fmt: skip
    for name, members in SCENARIOS.items():
        per = statistics.median(times[name])
        summed = len(members) / per
        print(
            f"| {name} | {1e3 * per:.3f} | {statistics.median(busy[name]):.2f} | {summed:,.0f} | {summed * base:.2f}x |"
        )


if __name__ == "__main__":
    main()
