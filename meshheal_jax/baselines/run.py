"""Run a baseline over many streams as one compiled program: a `lax.scan` over each stream's tasks,
`vmap` over streams (seeds × datasets), then the records as `metrics.SCHEMAS` rows. The experiments
(`python -m meshheal_jax.main` / `recovery`, through `runner.run`) call this for every baseline.

    frames = run_baseline_frames("raps", specs, "default")
    frames[0]["tasks"]  # a polars frame with exactly the columns of metrics.SCHEMAS["tasks"]
    run_baseline_streams("raps", specs, "default")[0]["tasks"]  # the same as a list of row dicts
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import polars as pl

from meshheal_jax.baselines import agentnet, autogen, raps, sac, symphony
from meshheal_jax.baselines import common as C
from meshheal_jax.config import ProtocolParams
from meshheal_jax.device import stack as host_stack
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


def protocol_params(method: str, protocol: ProtocolParams):
    """The method's default parameters with the protocol settings the baselines share with MeshHeal
    (decisions B8): the H/C/F move budget (route_limit, move_limit) of every method whose tasks move
    between agents (AgentNet by its own router),
    the shared routing's next-hop tie rule, and RAPS's watchdog threshold tau_to."""
    params = DEFAULT_PARAMS[method]()
    names = {f.name for f in dataclasses.fields(params)}
    shared = {
        "budget": C.Budget(protocol.route_limit, protocol.move_limit),
        "next_hop_ties": protocol.next_hop_ties,
        "watchdog_threshold": protocol.tau_to,
    }
    return dataclasses.replace(params, **{k: v for k, v in shared.items() if k in names})


class BaselineSpec(NamedTuple):
    network: Network
    stream: Stream
    schedule: HealthSchedule
    labels: dict  # method / dataset / pair / seed


def _spec(spec: Any) -> BaselineSpec:
    if isinstance(spec, tuple) and not hasattr(spec, "network"):
        if len(spec) < 4:
            raise MeshHealError(
                f"a baseline stream is (network, stream, schedule, labels), got a tuple of {len(spec)}"
            )
        return BaselineSpec(*spec[:4])
    return BaselineSpec(spec.network, spec.stream, spec.schedule, spec.labels)


def _run_streams(method: str, params, emus: C.Emu, worlds: C.World, uniforms: C.TaskUniforms, n_tasks: int):
    """Every stream's final state and (n_tasks,) TaskOut records; leading axis = streams. The
    uniforms (n_tasks leading) are computed outside: their threefry programs compile once."""
    TRACES[method] = TRACES.get(method, 0) + 1
    module = METHODS[method]

    def one_stream(emu, world, uniforms):
        def step(carry, xs):
            state, token = carry
            t, u = xs
            if emu.live:  # task t's calls wait on every reply of task t - 1 (a data dependency)
                t = jnp.where(token < -(2**30), -1, t).astype(jnp.int32)
            state, out = module.task_step(params, emu, world, state, t, u)
            return (state, jnp.max(out.calls.request)), out

        carry = (module.init_state(params, world), jnp.int32(-1))
        (state, _), outs = jax.lax.scan(step, carry, (jnp.arange(1, n_tasks + 1, dtype=jnp.int32), uniforms))
        return state, outs

    return jax.vmap(one_stream)(emus, worlds, uniforms)


_run = C.cpu_jit(_run_streams, static_argnums=(0, 5))


def simulate(method: str, specs: list, pair: Pair | str, params=None, live=None):
    """The compiled run: (final states, TaskOut records) as numpy, leading axis = streams.
    `live`: a backends.live_baselines.LiveBaselineHost that answers every call instead of the
    emulator (its error, if a call failed, is raised here)."""
    if method not in METHODS:
        raise MeshHealError(f"unknown baseline {method!r}; known: {sorted(METHODS)}")
    if not specs:
        raise MeshHealError("no streams given")
    pair = load_pair(pair) if isinstance(pair, str) else pair
    expected = DEFAULT_PARAMS[method]
    params = expected() if params is None else params
    if not isinstance(params, expected):
        raise MeshHealError(f"{method}: parameters must be {expected.__name__}, got {type(params).__name__}")
    specs = [_spec(s) for s in specs]
    first = specs[0]
    n_tasks, n_agents = first.stream.n_tasks, first.network.n_agents
    for s in specs:
        if s.stream.n_tasks != n_tasks or s.network.n_agents != n_agents:
            raise MeshHealError("streams batched together need the same length and number of agents")
        if s.network.holds.shape != first.network.holds.shape:
            raise MeshHealError("streams batched together need the same number of abilities")
    if hasattr(params, "check"):  # every method's parameters but AgentNet's, which need none
        params.check(n_agents)
    emus = host_stack([C.make_emu(pair, s.network.profile, live=live is not None) for s in specs])
    worlds = host_stack([C.make_world(s.network, s.stream, s.schedule, k) for k, s in enumerate(specs)])
    uniforms = host_stack([C.stream_uniforms(s.stream.seed, s.stream.dataset_id, n_tasks) for s in specs])
    if live is None:
        states, outs = _run(method, params, emus, worlds, uniforms, n_tasks)
    else:
        states, outs = _run_live(live, lambda: _run(method, params, emus, worlds, uniforms, n_tasks))
    return jax.tree_util.tree_map(np.asarray, states), jax.tree_util.tree_map(np.asarray, outs)


def _run_live(host, program):
    """Run a live program in a worker thread while the main thread waits in short joins, so that
    Ctrl-C reaches Python during an hours-long run: the host then stops sending (every later call
    gets neutral values at once), the program ends, and KeyboardInterrupt is raised. Every reply
    received is in the response cache; the same call resumes."""
    result: dict = {}
    finished = threading.Event()  # not Thread.join: an interrupted join can mark a live thread stopped

    def work():
        try:
            result["out"] = jax.block_until_ready(program())
        except BaseException as err:  # noqa: BLE001 -- re-raised in the caller's thread
            result["error"] = err
        finally:
            finished.set()

    with C.live_host(host):
        threading.Thread(target=work, name="live-baseline-program", daemon=True).start()
        try:
            while not finished.wait(0.2):
                pass
        except KeyboardInterrupt:
            host.stop(
                KeyboardInterrupt(
                    "live baseline run interrupted; every reply received is in the response cache"
                )
            )
            while True:  # the program ends quickly once nothing is sent; a second Ctrl-C waits too
                try:
                    finished.wait()
                    break
                except KeyboardInterrupt:
                    continue
            raise
    if "error" in result:
        raise result["error"]
    if host.error is not None:
        raise host.error
    return result["out"]


def run_baseline_frames(
    method: str, specs: list, pair: Pair | str, params=None, live=None
) -> list[dict[str, pl.DataFrame]]:
    """Run `method` on every stream (one compiled, vmapped program); per stream the four tables
    (tasks, reviews, states, calls) as polars frames with the columns of metrics.SCHEMAS.

    specs: objects with .network, .stream, .schedule, .labels (or 4-tuples in that order); labels
    carry method / dataset / pair / seed (method defaults to the baseline's name)."""
    pair = load_pair(pair) if isinstance(pair, str) else pair
    _, outs = simulate(method, specs, pair, params, live)
    trace = None if live is None else {row["request"]: row for row in live.trace}
    results = []
    for k, spec in enumerate(_spec(s) for s in specs):
        labels = {"method": method, **spec.labels}
        one = jax.tree_util.tree_map(lambda x, k=k: x[k], outs)
        results.append(C.frames(one, spec.stream, spec.schedule, pair, labels, trace))
    return results


def run_baseline_streams(
    method: str, specs: list, pair: Pair | str, params=None, live=None
) -> list[dict[str, list[dict]]]:
    """`run_baseline_frames` with each table as a list of row dicts (every column; null as None)."""
    return as_rows(run_baseline_frames(method, specs, pair, params, live))


def as_rows(per_stream: list[dict[str, pl.DataFrame]]) -> list[dict[str, list[dict]]]:
    """Per stream, each table's frame as a list of row dicts (every column; null as None)."""
    return [{name: df.to_dicts() for name, df in frames.items()} for frames in per_stream]
