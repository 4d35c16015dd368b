"""How many waves the detector needs per round: the observations with evidence of each round of a
JAX-engine stream, replayed in plain Python under three conflict rules (engine.observe_round takes a
round's observations in waves; the later waves are a while loop, a cost per round).

- greedy: each wave takes every pending observation that no earlier pending one (task order)
  conflicts with, the rule of `engine.first_wave` with no width limit: the fewest waves that rule
  allows;
- engine: the same rule with the engine's widths (`first_wave_width`, then `later_wave_width`,
  in slot order), what `observe_round` runs (its first wave runs even when empty); checked
  against the engine itself, whose `_wave` is run one wave at a time on the same observations;
- by type: a finer rule, not in the engine, under which a neighbour's observation conflicts only
  when it is of the same task type (the rows an observation reads are its neighbours' rows of its
  own type, and their states); a bound, since a neighbour's change of state would still conflict.

The network is the scale experiment's (replicated bbh profile, sparse graph above 6 agents, slots
N/6), one stream, after `--skip` chunks of 64 rounds (past the detector's warm-up).

    python benchmarks/waves.py --agents 576 --rounds 200
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_throughput as B

from meshheal_jax import engine


def count_waves(order, authors, types, nbr, conflict: str, widths: tuple[int, int] | None) -> int:
    """Waves to take the observations `order` (slot indices in task order) under a conflict rule
    ("agent": author or a neighbour of it; "type": author, or a neighbour with the same type)."""
    position = {k: r for r, k in enumerate(order)}
    pending, waves = set(order), 0

    def conflicts(m, k):  # an earlier pending m blocks k
        if authors[m] == authors[k]:
            return True
        near = authors[m] in nbr[authors[k]]
        return near and (conflict == "agent" or types[m] == types[k])

    while pending:
        eligible = [k for k in sorted(pending)  # slot order, as the engine takes a wave's first `width`
                    if not any(position[m] < position[k] and conflicts(m, k) for m in pending)]  # fmt: skip
        if widths is not None:
            eligible = eligible[: widths[0] if waves == 0 else widths[1]]
        pending -= set(eligible)
        waves += 1
    return waves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=200, help="rounds replayed")
    ap.add_argument("--skip", type=int, default=4, help="chunks of 64 rounds run before them")
    args = ap.parse_args()

    specs = B.make_specs(args.agents, args.agents > 6, 1)
    cfg, params, worlds, batched = B.engine_inputs(specs, max(1, args.agents // 6))
    carry = engine.initial_carries(cfg, worlds)
    for _ in range(args.skip):
        carry, _ = engine.run_rounds(cfg, params, worlds, carry, 64, batched)
    world, p, c = engine.at(worlds, 0), engine.at(params, 0) if batched else params, engine.at(carry, 0)
    nbr = [set(row[row >= 0].tolist()) for row in np.asarray(world.nbr)]
    widths = (engine.first_wave_width(cfg.slots), engine.later_wave_width(cfg.slots))

    @jax.jit
    def round_evidence(c):
        """The round's observations (as `absorb_round` makes them), their task order, the network
        they meet, and the carry after the round (`round_step`'s steps, its absorb kept apart)."""
        taken = engine._take_tasks(cfg, p, world, c)
        requests = engine.emit(cfg, p, world, taken.slots)
        backend, responses = engine.emulate(cfg, p, world, taken.backend, requests, taken.draws)
        _, evidence, reviews = jax.vmap(engine.absorb_decide, in_axes=(None,) * 4 + (0,) * 3)(
            cfg, p, world, taken.net, taken.slots, responses, taken.draws
        )
        after, _ = engine.absorb_round(
            cfg, p, world, dataclasses.replace(taken, backend=backend), requests, responses
        )
        return evidence, engine.task_order(taken.slots), taken.net, reviews.obs, after

    @functools.partial(jax.jit, static_argnums=0)
    def wave(width, net, evidence, order, observations, pending):
        return engine._wave(p, world, net, evidence, order, observations, pending, cfg.detector, width,
                            cfg.window_reset)  # fmt: skip

    def engine_waves(evidence, order, net, observations) -> int:
        """The waves `observe_round` runs, counted by running its `_wave` one at a time."""
        state, count = (net, observations, evidence.valid), 0
        while bool(state[2].any()) or count == 0:
            state = wave(
                widths[0] if count == 0 else widths[1], state[0], evidence, order, state[1], state[2]
            )
            count += 1
        return count

    rows = []
    for _ in range(args.rounds):
        evidence, order, net, observations, c = round_evidence(c)
        valid = np.asarray(evidence.valid)
        authors, types = np.asarray(evidence.author).tolist(), np.asarray(evidence.task_type).tolist()
        taken = [k for k in np.asarray(order).tolist() if valid[k]]
        rows.append((len(taken), count_waves(taken, authors, types, nbr, "agent", None),
                     max(1, count_waves(taken, authors, types, nbr, "agent", widths)),  # the first always runs
                     count_waves(taken, authors, types, nbr, "type", None),
                     engine_waves(evidence, order, net, observations)))  # fmt: skip
    r = np.array(rows, float)
    print(f"{args.agents} agents, slots {cfg.slots}, {args.rounds} rounds after {args.skip} chunks of 64; "
          f"task types {cfg.n_types}, widths {widths[0]} then {widths[1]}")  # fmt: skip
    print(f"observations with evidence per round: {r[:, 0].mean():.1f} (max {r[:, 0].max():.0f})")
    print("| rule | waves per round | rounds with more than one |\n|---|---|---|")
    for name, k in (
        ("greedy", 1),
        ("engine (replayed)", 2),
        ("engine (its `_wave`, run)", 4),
        ("by type (bound)", 3),
    ):
        print(f"| {name} | {r[:, k].mean():.2f} | {(r[:, k] > 1).mean():.2f} |")
    print(f"the replay matches the engine's waves in {(r[:, 2] == r[:, 4]).mean():.0%} of rounds")


if __name__ == "__main__":
    main()
