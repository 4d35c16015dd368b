"""Where a round's time goes: a `jax.profiler` trace of one chunk of the JAX engine's rounds, read
back as self time per XLA op (a thunk's time minus the ops nested in it), plus the round's cost
and how many rounds a task takes.

The network is the scale experiment's (replicated bbh profile, sparse graph above 6 agents,
complete at 6, slots N/6); the profiled chunk starts after `--skip` chunks, so it is past the
detector's warm-up. From there, `--timed` chunks run one after another without the profiler
(the per-round figure: their median), and the first of them once more under it (the op tables;
the profiler roughly doubles the time, so read the tables' shares, not their milliseconds). The
first table groups ops by executions per round (a loop body's ops run equally often), the second
lists the largest. The profiler inflates ops that run many times per round: a share held by a loop of
tiny ops is an upper bound, to be checked by an A/B without the profiler.

A third table (`--by-function`) charges each op to the engine functions that traced it, read
from the compiled HLO's stack-frame tables: the part of a round under `round_step` that a share
belongs to (e.g. `absorb_round > observe_round`). A fusion carries its root instruction's frame,
so a fusion of code from two functions is charged to the root's; a chain can repeat frames
(inlined calls prepend their callers'), and the part is taken under its innermost `round_step`.

    python benchmarks/profile_round.py                         # 576 agents, 1 stream, 64 rounds
    python benchmarks/profile_round.py --agents 6 --streams 64 --top 25
    python benchmarks/profile_round.py --agents 576 --streams 2 --by-function 2
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_throughput as B

from meshheal_jax import engine


def self_times(trace_file: Path) -> tuple[collections.Counter, collections.Counter]:
    """Self time (µs) and count per event name of a perfetto trace (complete events only)."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    own, count = collections.Counter(), collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            own[e["name"]] += e["dur"]
            count[e["name"]] += 1
            stack.append(e)
    return own, count


def traced_by(hlo_text: str) -> dict[str, list[str]]:
    """Op name -> the Python functions (outermost first) whose code emitted it, from the stack-frame
    tables at the head of a compiled module's text (FunctionNames, FileLocations, StackFrames). XLA
    prints a frame's parent as its id + 1 (1: no parent); if no chain then runs through
    `round_step`, the format has changed and this fails rather than mislabel ops."""
    head = hlo_text.split("\nENTRY", 1)[0]
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in head.splitlines()[1:]:
        if re.fullmatch(r"[A-Za-z]+", line):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\d+) (.*)", line)):
            current[int(m.group(1))] = m.group(2)
    if "StackFrames" not in tables:
        raise SystemExit("--by-function: the compiled module's text has no StackFrames table (another XLA?)")

    def fields(text: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    location = {k: functions[fields(v)["function_name_id"]] for k, v in tables["FileLocations"].items()}
    frames = {k: fields(v) for k, v in tables["StackFrames"].items()}

    def chain(frame: int) -> list[str]:
        out, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            out.append(location[frames[frame]["file_location_id"]])
            frame = frames[frame]["parent_frame_id"] - 1
        return out[::-1]

    chains = {}  # every instruction; [] for one without a frame (copies, loop control, ...)
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", hlo_text, re.MULTILINE):
        frame = re.search(r"stack_frame_id=(\d+)", m.group(2))
        chains[m.group(1)] = chain(int(frame.group(1))) if frame else []
    if not any("round_step" in c for c in chains.values()):
        raise SystemExit("--by-function: no op's stack runs through round_step; the stack-frame tables "
                         "are not read as this script expects (another XLA?)")  # fmt: skip
    return chains


def round_part(functions: list[str] | None, depth: int) -> str:
    """The first `depth` functions under the innermost round_step of a chain."""
    if functions is None:
        return "(op not found in the compiled module)"
    if not functions:
        return "(no source: copies, loop control, ...)"
    if "round_step" not in functions:
        return f"(outside round_step) {functions[-1]}"
    below = functions[len(functions) - functions[::-1].index("round_step") :]
    return " > ".join(f.replace(".<locals>.", ".") for f in below[:depth]) or "round_step"


# host-side events of the profiler and of JAX's dispatch, not XLA ops
HOST = ("$", "PjitFunction", "ThunkExecutor", "TfrtCpu", "PjRt", "CommonPjRt", "ThreadpoolListener")
END = "end: "  # the profiler's event for an op's completion: its time is charged to the op, not counted


def fold_ends(own: collections.Counter, count: collections.Counter) -> None:
    """Charge each 'end: <op>' event's time to <op> and drop it from the counts (before the sixth
    session of 2026-12-04 they were counted as ops of their own: the 'op executions per round' of
    earlier tables include them)."""
    for name in [k for k in own if k.startswith(END)]:
        own[name[len(END) :]] += own.pop(name)
        count.pop(name, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=576)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=64, help="rounds in the profiled chunk")
    ap.add_argument("--skip", type=int, default=3, help="chunks run before it (past the warm-up)")
    ap.add_argument("--timed", type=int, default=5, help="chunks timed without the profiler (median)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument(
        "--by-function",
        type=int,
        default=0,
        metavar="DEPTH",
        help="also charge ops to the engine functions under round_step, DEPTH calls deep",
    )
    args = ap.parse_args()

    n = args.agents
    specs = B.make_specs(n, n > 6, args.streams)
    cfg, params, worlds, batched = B.engine_inputs(specs, max(1, n // 6))
    carry = engine.initial_carries(cfg, worlds)
    for _ in range(args.skip):
        carry, _ = engine.run_rounds(cfg, params, worlds, carry, args.rounds, batched)
    jax.block_until_ready(carry)

    def fresh():  # run_rounds donates the carry it is given: each chunk gets its own copy
        return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, carry))

    def chunk(start_carry):
        out = engine.run_rounds(cfg, params, worlds, start_carry, args.rounds, batched)
        jax.block_until_ready(out)
        return out

    # the per-round figure: the median of `--timed` chunks run one after another, each on the last
    # one's carry (at 576 agents the first chunk on a freshly copied carry ran at 0.37-0.40 ms a
    # round, the chunks after it at 0.28-0.30: a one-time cost of a fresh carry)
    run = fresh()
    seconds_each, finished_each = [], []
    for _ in range(args.timed):
        before = B.tasks_finished(cfg, run)
        start = time.perf_counter()
        run, _ = chunk(run)
        seconds_each.append(time.perf_counter() - start)
        finished_each.append(B.tasks_finished(cfg, run) - before)
    seconds = statistics.median(seconds_each)
    finished = round(statistics.median(finished_each))

    second = fresh()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            chunk(second)
        own, count = self_times(next(Path(tmp).rglob("*.trace.json.gz")))
    fold_ends(own, count)

    ops = {k: v for k, v in own.items() if not k.startswith(HOST)}
    dispatch = sum(v for k, v in own.items() if k.startswith("ThunkExecutor::Execute") and "wait" not in k)
    total = sum(ops.values()) + dispatch
    slots = cfg.slots * args.streams
    print(f"{n} agents {'sparse' if n > 6 else 'complete'}, {args.streams} stream(s), slots {cfg.slots}, chunk of {args.rounds} rounds "
          f"after {args.skip} chunks (jax {jax.__version__})")  # fmt: skip
    print(f"round: {1e3 * seconds / args.rounds:.3f} ms without the profiler (median of {args.timed} chunks); "
          f"{finished} tasks finished in a chunk: {finished / args.rounds:.2f} tasks per round, {slots * args.rounds / max(finished, 1):.1f} "
          f"slot-rounds per task")  # fmt: skip
    # the draws made ahead, timed apart: a task's entry, infer and route uniforms and its calls key
    # (58 uniforms; decisions D4), as a window refill makes them, on 8,192 tasks (a cost per task,
    # the same at every size; a small window's call would time dispatch). The call rows a round
    # reads are drawn inside the round (`draws.call_rows`) and counted in its ops.
    world = engine.at(worlds, 0)
    width = 8192
    refill = jax.jit(lambda first: engine.draw_window(world, first, width))
    jax.block_until_ready(refill(1))
    times = []
    for k in range(5):
        start = time.perf_counter()
        jax.block_until_ready(refill(1 + k * width))
        times.append(time.perf_counter() - start)
    per_task = min(times) / width
    print(f"draws made ahead: {1e6 * per_task:.2f} µs per task (best of 5), ~{100 * per_task * finished / seconds:.0f}% "
          f"of the chunk's time (a window refill also redraws its last slots' worth)")  # fmt: skip
    print(f"\nunder the profiler: ops {sum(ops.values()) / 1e3:.1f} ms + thunk dispatch "
          f"{dispatch / 1e3:.1f} ms ({100 * dispatch / total:.0f}%), "
          f"{sum(count[k] for k in ops) / args.rounds:.0f} op executions per round")  # fmt: skip
    # ops run equally often belong together (a loop body runs once per iteration): their share by
    # executions per round shows which loop holds the time
    by_rate = collections.defaultdict(lambda: [0.0, 0])
    for name, us in ops.items():
        group = by_rate[round(count[name] / args.rounds, 1)]
        group[0] += us
        group[1] += 1
    print("\n| executions per round | ops | share |\n|---|---|---|")
    for rate, (us, n_ops) in sorted(by_rate.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"| {rate} | {n_ops} | {100 * us / total:.1f}% |")
    print("\n| op | share | executions per round | µs per execution |\n|---|---|---|---|")
    for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]:
        print(
            f"| {name[:60]} | {100 * us / total:.1f}% | {count[name] / args.rounds:.1f} | {us / count[name]:.1f} |"
        )
    if args.by_function:
        hlo = engine.run_rounds.lower(cfg, params, worlds, carry, args.rounds, batched).compile().as_text()
        chains = traced_by(hlo)
        parts = collections.defaultdict(lambda: [0.0, 0])
        for name, us in ops.items():
            part = parts[round_part(chains.get(name), args.by_function)]
            part[0] += us
            part[1] += count[name]
        print("\n| part of the round (traced by) | share | op executions per round |\n|---|---|---|")
        for part, (us, n_exec) in sorted(parts.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"| {part} | {100 * us / total:.1f}% | {n_exec / args.rounds:.1f} |")


if __name__ == "__main__":
    main()
