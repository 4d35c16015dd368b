"""Lock-step A/B of the JAX engine's round time between two checkouts of this repository.

On a shared machine the speed drifts by up to ~1.5x within minutes, so two runs one after the other
compare the machine's moods as much as the code. Here each arm runs in its own process (its
checkout's package on PYTHONPATH, so the editable install cannot stand in for it) and the two
take turns: one turn = `--chunks` chunks of `--rounds` rounds from the same mid-run state, timed
with `block_until_ready`, then the other arm's turn (which arm goes first alternates from turn to
turn). A slow phase of the machine hits both alike.
Prints each arm's median and best time per round and the change.

    git worktree add /tmp/before <ref>
    python benchmarks/ab_rounds.py /tmp/before . --agents 576
    python benchmarks/ab_rounds.py /tmp/before . --agents 6 --streams 64
    python benchmarks/ab_rounds.py /tmp/before . --agents 9216 --turns 6
    python benchmarks/ab_rounds.py . . --after-xla-flags=--xla_cpu_use_multi_output_fusion=true

The network is the scale experiment's (replicated bbh profile, sparse graph above 6 agents,
slots N/6, seeds 0..streams-1), built by each checkout's own benchmarks/sim_throughput.py; the
state is taken after `--skip` chunks, past the detector's warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def arm(args: argparse.Namespace) -> None:
    """One arm: build, warm up, then one turn per 'go' line on stdin, its seconds per round on stdout."""
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import jax
    import jax.numpy as jnp
    import sim_throughput as B

    from meshheal_jax import engine

    specs = B.make_specs(args.agents, args.agents > 6, args.streams)
    cfg, params, worlds, batched = B.engine_inputs(specs, max(1, args.agents // 6))
    start = engine.initial_carries(cfg, worlds)
    for _ in range(args.skip):
        start, _ = engine.run_rounds(cfg, params, worlds, start, args.rounds, batched)
    jax.block_until_ready(start)
    print(f"ready {engine.__file__}", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        carry = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, start))  # run_rounds may donate it
        t0 = time.perf_counter()
        for _ in range(args.chunks):
            carry, records = engine.run_rounds(cfg, params, worlds, carry, args.rounds, batched)
        jax.block_until_ready((carry, records))
        print(f"seconds {(time.perf_counter() - t0) / (args.chunks * args.rounds)}", flush=True)


def add_arm_options(ap: argparse.ArgumentParser, turns: int, skip: int = 4) -> None:
    """The options an arm is built and timed with, and the turns: shared by the scripts that run
    arms (this one, pinning.py, intra_op.py)."""
    ap.add_argument("--agents", type=int, default=576)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--turns", type=int, default=turns, help="turns per arm")
    ap.add_argument("--chunks", type=int, default=4, help="chunks per turn")
    ap.add_argument("--rounds", type=int, default=32, help="rounds per chunk")
    ap.add_argument(
        "--skip", type=int, default=skip, help="chunks run before the timed state (past the warm-up)"
    )


def arm_command(args: argparse.Namespace) -> list[str]:
    """The command line of one arm built with `args`' arm options (`add_arm_options`)."""
    return [sys.executable, str(Path(__file__).resolve()), "--arm", "--agents", str(args.agents), "--streams",
            str(args.streams), "--chunks", str(args.chunks), "--rounds", str(args.rounds), "--skip", str(args.skip)]  # fmt: skip


class ArmStopped(RuntimeError):
    pass


@contextlib.contextmanager
def stopping(procs):
    """Exit with the message of an arm that stopped (ArmStopped); on the way out, kill every
    process of `procs` (a live view is fine) still running, e.g. one still building when another failed."""
    try:
        yield
    except ArmStopped as err:
        sys.exit(str(err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _reply(proc: subprocess.Popen, word: str) -> str:
    """The rest of the arm's next stdout line that starts with `word` (other lines are skipped)."""
    for line in proc.stdout:
        if line.startswith(word + " "):
            return line[len(word) + 1 :].strip()
    raise ArmStopped(f"an arm stopped before saying '{word}' (exit {proc.wait()})")


def _turn(proc: subprocess.Popen) -> float:
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    except BrokenPipeError:
        raise ArmStopped(f"an arm stopped between turns (exit {proc.wait()})") from None
    return float(_reply(proc, "seconds"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, nargs="?", help="checkout of the first arm")
    ap.add_argument("after", type=Path, nargs="?", help="checkout of the second arm")
    add_arm_options(ap, turns=15)
    ap.add_argument("--after-xla-flags", default="", help="XLA_FLAGS added to the second arm only (an XLA "
                    "flag A/B: give the same checkout twice)")  # fmt: skip
    ap.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        arm(args)
        return
    if args.before is None or args.after is None:
        ap.error("give two checkouts: BEFORE AFTER")
    arms = []
    for checkout, flags in ((args.before, ""), (args.after, args.after_xla_flags)):
        root = checkout.resolve()
        if not (root / "meshheal_jax" / "engine.py").is_file():
            ap.error(f"{checkout} is not a checkout of this repository (no meshheal_jax/engine.py)")
        # no disk cache in either arm (a JAX_COMPILATION_CACHE_DIR would win over MESHHEAL_JAX_CACHE)
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env.update(PYTHONPATH=str(root), MESHHEAL_JAX_CACHE="off")
        if flags:
            env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
        arms.append(subprocess.Popen(arm_command(args), cwd=root, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True))  # fmt: skip
    names: list[str] = []
    times: list[list[float]] = [[], []]
    with stopping(arms):
        for proc in arms:  # both build and compile at once; the timed turns alternate
            names.append(_reply(proc, "ready").removesuffix("/meshheal_jax/engine.py"))
        for turn in range(args.turns):
            for k in (0, 1) if turn % 2 == 0 else (1, 0):
                times[k].append(_turn(arms[k]))
        for proc in arms:
            proc.stdin.close()
            proc.wait()
    print(f"{args.agents} agents x {args.streams} stream(s), {args.turns} turns of {args.chunks} x {args.rounds} "
          f"rounds per arm, alternating")  # fmt: skip
    print("| arm | checkout | round ms, median | best |\n|---|---|---|---|")
    if args.after_xla_flags:
        names[1] += f" + XLA_FLAGS {args.after_xla_flags}"
    for label, name, t in zip(("before", "after"), names, times):
        print(f"| {label} | {name} | {1e3 * statistics.median(t):.3f} | {1e3 * min(t):.3f} |")
    change = statistics.median(times[1]) / statistics.median(times[0]) - 1
    print(
        f"change of the median: {100 * change:+.1f}% (best: {100 * (min(times[1]) / min(times[0]) - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
