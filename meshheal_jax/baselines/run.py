"""Run a baseline over many streams as one compiled program: a `lax.scan` over each stream's tasks,
`vmap` over streams (seeds × datasets), then the records as `metrics.SCHEMAS` rows.

    tables = run_baseline_streams("raps", specs, "default")
    tables[0]["tasks"]  # list of row dicts with exactly the columns of metrics.SCHEMAS["tasks"]
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshheal_jax.baselines import agentnet, autogen, raps, sac, symphony
from meshheal_jax.baselines import common as C
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import Pair, load_pair
from meshheal_jax.streams import HealthSchedule, Stream
from meshheal_jax.topology import Network

METHODS: dict[str, ModuleType] = {m.METHOD: m for m in (agentnet, raps, autogen, sac, symphony)}
DEFAULT_PARAMS = {
    "agentnet": agentnet.AgentNetParams, "raps": raps.RAPSParams, "autogen": autogen.AutoGenParams,
    "sac": sac.SACParams, "symphony": symphony.SymphonyParams,
}  # fmt: skip
TRACES: dict[str, int] = {}  # method -> times its program was traced (tests: one trace per shape)


class BaselineSpec(NamedTuple):
    network: Network
    stream: Stream
    schedule: HealthSchedule
    labels: dict  # method / dataset / pair / seed


def _spec(spec: Any) -> BaselineSpec:
    if isinstance(spec, tuple) and not hasattr(spec, "network"):
        return BaselineSpec(*spec[:4])
    return BaselineSpec(spec.network, spec.stream, spec.schedule, spec.labels)


def _run_streams(method: str, params, emus: C.Emu, worlds: C.World, uniforms: C.TaskUniforms, n_tasks: int):
    """Every stream's final state and (n_tasks,) TaskOut records; leading axis = streams. The
    uniforms (n_tasks leading) are computed outside: their threefry programs compile once."""
    TRACES[method] = TRACES.get(method, 0) + 1
    module = METHODS[method]

    def one_stream(emu, world, uniforms):
        def step(state, xs):
            t, u = xs
            return module.task_step(params, emu, world, state, t, u)

        state = module.init_state(params, world)
        return jax.lax.scan(step, state, (jnp.arange(1, n_tasks + 1, dtype=jnp.int32), uniforms))

    return jax.vmap(one_stream)(emus, worlds, uniforms)


_run = C.cpu_jit(_run_streams, static_argnums=(0, 5))


def simulate(method: str, specs: list, pair: Pair | str, params=None):
    """The compiled run: (final states, TaskOut records) as numpy, leading axis = streams."""
    if method not in METHODS:
        raise MeshHealError(f"unknown baseline {method!r}; known: {sorted(METHODS)}")
    if not specs:
        raise MeshHealError("no streams given")
    pair = load_pair(pair) if isinstance(pair, str) else pair
    params = DEFAULT_PARAMS[method]() if params is None else params
    specs = [_spec(s) for s in specs]
    first = specs[0]
    n_tasks, n_agents = first.stream.n_tasks, first.network.n_agents
    for s in specs:
        if s.stream.n_tasks != n_tasks or s.network.n_agents != n_agents:
            raise MeshHealError("streams batched together need the same length and number of agents")
        if s.network.holds.shape != first.network.holds.shape:
            raise MeshHealError("streams batched together need the same number of abilities")
    if method == "autogen":
        params.check()
        if not 0 <= params.manager < n_agents:
            raise MeshHealError(f"AutoGen: manager {params.manager} is not an agent of 0..{n_agents - 1}")
    elif method in ("sac", "symphony"):
        params.check(n_agents)
    emus = C.stack([C.make_emu(pair, s.network.profile) for s in specs])
    worlds = C.stack([C.make_world(s.network, s.stream, s.schedule) for s in specs])
    uniforms = C.stack([C.stream_uniforms(s.stream.seed, s.stream.dataset_id, n_tasks) for s in specs])
    states, outs = _run(method, params, emus, worlds, uniforms, n_tasks)
    return jax.tree_util.tree_map(np.asarray, states), jax.tree_util.tree_map(np.asarray, outs)


def run_baseline_streams(
    method: str, specs: list, pair: Pair | str, params=None
) -> list[dict[str, list[dict]]]:
    """Run `method` on every stream (one compiled, vmapped program); per stream the four tables
    (tasks, reviews, states, calls) as lists of row dicts with the columns of metrics.SCHEMAS.

    specs: objects with .network, .stream, .schedule, .labels (or 4-tuples in that order); labels
    carry method / dataset / pair / seed (method defaults to the baseline's name)."""
    pair = load_pair(pair) if isinstance(pair, str) else pair
    _, outs = simulate(method, specs, pair, params)
    results = []
    for k, spec in enumerate(_spec(s) for s in specs):
        labels = {"method": method, **spec.labels}
        one = jax.tree_util.tree_map(lambda x, k=k: x[k], outs)
        results.append(C.tables(one, spec.stream, spec.schedule, pair, labels))
    return results


# ------------------------------------------------------------------------------------------------
# A quick table (the lead's `meshheal_jax.main --methods` is the full experiment runner)
# ------------------------------------------------------------------------------------------------


def summary_table(methods, dataset: str = "bbh", seeds=(0, 1, 2, 3, 4), pair: str = "default",
                  n_tasks: int = 504, overrides: dict | None = None) -> list[dict]:  # fmt: skip
    """Experiment 1's persistent schedule on one dataset: per method the stats over seeds of
    accuracy H / D, the paired phase change and calls / tokens per task per phase."""
    import dataclasses

    from meshheal_jax import metrics
    from meshheal_jax.streams import make_stream, persistent_schedule
    from meshheal_jax.topology import build_network, load_profile

    profile = load_profile(dataset)
    network = build_network(profile)
    schedule = persistent_schedule(network.n_agents, n_tasks, network.degraded_targets)
    phases = ((1, n_tasks // 2 + 1), ("healthy", "degraded"))
    rows = []
    for method in methods:
        params = DEFAULT_PARAMS[method]()
        fields = {f.name for f in dataclasses.fields(params)}
        params = dataclasses.replace(params, **{k: v for k, v in (overrides or {}).items() if k in fields})
        specs = [
            BaselineSpec(network, make_stream(s, profile.dataset_id, n_tasks, len(profile.task_types), *phases),
                         schedule, {"method": method, "dataset": dataset, "pair": pair, "seed": s})
            for s in seeds
        ]  # fmt: skip
        per_seed = []
        for one in run_baseline_streams(method, specs, pair, params):
            frames = {name: metrics.frame(name, one[name]) for name in one}
            per_seed.append(metrics.stream_metrics(frames["tasks"], frames["reviews"], frames["states"], schedule,
                                                   phases[1]))  # fmt: skip
        stats = metrics.aggregate(per_seed, seeds)
        rows.append({"method": method, **{k: stats[k] for k in metrics.SCALAR_KEYS}})
    return rows


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Baselines on experiment 1's schedule (emulated).")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dataset", default="bbh")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--pair", default="default")
    parser.add_argument(
        "--judge-rule", default=None, choices=("caller", "ability"), help="RAPS / SAC judge model"
    )
    args = parser.parse_args(argv)
    overrides = {} if args.judge_rule is None else {"judge_rule": args.judge_rule}
    rows = summary_table(args.methods, args.dataset, tuple(range(args.seeds)), args.pair, overrides=overrides)

    def fmt(stat, scale=1.0, digits=3):
        if stat["mean"] is None:
            return "null"
        std = "" if stat["std"] is None else f" ± {stat['std'] * scale:.{digits}f}"
        return f"{stat['mean'] * scale:.{digits}f}{std}"

    print(f"{args.dataset}, pair {args.pair}, seeds 0..{args.seeds - 1}" + (f", judge_rule {args.judge_rule}"
                                                                         if args.judge_rule else ""))  # fmt: skip
    print(f"{'method':<9} {'acc H':>15} {'acc D':>15} {'D-H':>16} {'calls H':>13} {'calls D':>13} "
          f"{'ktok H':>13} {'ktok D':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['method']:<9} {fmt(r['acc_healthy']):>15} {fmt(r['acc_degraded']):>15} "
              f"{fmt(r['phase_change']):>16} {fmt(r['calls_per_task_healthy'], 1, 2):>13} "
              f"{fmt(r['calls_per_task_degraded'], 1, 2):>13} {fmt(r['tokens_per_task_healthy'], 1e-3, 1):>13} "
              f"{fmt(r['tokens_per_task_degraded'], 1e-3, 1):>13}")  # fmt: skip


if __name__ == "__main__":
    main()
