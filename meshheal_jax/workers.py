"""Independent jobs in worker processes, one per CPU core (`--workers N`; docs/decisions.md S7).

XLA's CPU runtime runs a round's ~1,500 small kernels one after another: one process keeps 1.6-1.7
cores busy but only one of them with useful work (`python benchmarks/pinning.py`). Streams are
independent, so a batch split into N groups, each run in its own process pinned to its own core,
puts N cores to work. Sharding the streams over several CPU devices in one process does not: every
round's cross-stream predicates become cross-device syncs (S6).

Workers are spawned (not forked: a forked JAX runtime is unsafe) and import the package afresh, so
each compiles its own program on its one core; the split pays where rounds dominate (many
streams, large networks), not where compile does (the 576-agent flagship's five streams). Each
worker needs its own copy of the network and the program's buffers: memory grows with N.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from meshheal_jax.errors import MeshHealError


def check_workers(n: int) -> None:
    if n < 1:
        raise MeshHealError(f"--workers must be >= 1, got {n}")


def check_cpu_backend() -> None:
    """Workers split streams over CPU cores: refuse when JAX runs on an accelerator or on several
    devices (there the streams shard over the devices in one process, S6)."""
    import jax

    if jax.default_backend() != "cpu" or jax.device_count() > 1:
        raise MeshHealError(f"--workers splits streams over CPU cores, but JAX sees {jax.device_count()} "
                            f"{jax.default_backend()} device(s): run with --workers 1 (the streams shard over "
                            f"the devices; docs/decisions.md S6)")  # fmt: skip


def split(items: Sequence, n: int) -> list[list]:
    """items in at most n contiguous groups of near-equal size (the first ones one longer), none empty."""
    check_workers(n)
    n = min(n, len(items))
    groups, start = [], 0
    for k in range(n):
        stop = start + len(items) // n + (k < len(items) % n)
        groups.append(list(items[start:stop]))
        start = stop
    return groups


def usable_cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _child(send, core: int | None, fn: Callable, args: tuple) -> None:
    """A worker's body: pin, run, send ("ok", result) or ("error", message)."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    try:
        send.send(("ok", fn(*args)))
    except MeshHealError as err:
        send.send(("error", str(err)))
    except Exception as err:  # noqa: BLE001 (reported: the traceback to the worker's stderr, its last line to the caller)
        traceback.print_exc()
        send.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        send.close()


def map_pinned(fn: Callable, jobs: Sequence[tuple], what: str = "job") -> list:
    """[fn(*job) for job in jobs], each job in its own spawned process, pinned to its own core when
    there are at least as many cores as jobs (else the OS places them). `fn` must be a module-level
    function and the jobs picklable. Every worker runs to its end whatever the others do (so the
    parts a worker writes survive another's failure); then failures are raised together, each
    named by its worker's number and `what`."""
    if len(jobs) <= 1:
        return [fn(*job) for job in jobs]
    cores = usable_cores()
    pin = len(cores) >= len(jobs)
    context = multiprocessing.get_context("spawn")
    running = {}
    for k, job in enumerate(jobs):
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(target=_child, args=(send, cores[k] if pin else None, fn, job),
                               name=f"meshheal-worker-{k + 1}")  # fmt: skip
        proc.start()
        send.close()  # the child holds the sending end: its exit closes the pipe
        running[receive] = (k, proc)
    results, failures = {}, []
    while running:
        for conn in wait(list(running)):
            k, proc = running.pop(conn)
            label = f"worker {k + 1} of {len(jobs)} ({what})"
            try:
                status, value = conn.recv()
            except EOFError:  # ended without a reply: killed (out of memory?) or aborted
                status, value = "died", None
            proc.join()
            if status == "ok":
                results[k] = value
            elif status == "error":
                failures.append((k, f"{label}: {value}"))
            else:
                failures.append((k, f"{label} died without a result (exit code {proc.exitcode}; out of memory?)"))
    if failures:
        raise MeshHealError("; ".join(message for _, message in sorted(failures)))
    return [results[k] for k in range(len(jobs))]
