"""Independent jobs in worker processes, one per CPU core (`--workers N`).

XLA's CPU runtime runs a round's ~1,500 small kernels one after another: a process keeps one core
busy with useful work (its second thread spins; `benchmarks/sim_throughput.py --sections batch`
measures it). Streams are independent, so a batch split into N groups, each run in its own
process pinned to its own core, does N cores' work (docs/decisions.md S7). Sharding the streams
over several CPU devices in one process does not: every round's cross-stream predicates become
cross-device syncs (S6).

Workers are spawned (not forked: a forked JAX runtime is unsafe) and import the package afresh,
so each compiles its own program; the split pays where rounds dominate (many streams, large
networks), not where compile does (the 576-agent flagship's five streams).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence

from meshheal_jax.errors import MeshHealError


def split(items: Sequence, n: int) -> list[list]:
    """items in at most n contiguous groups of near-equal size (the first ones one longer), none empty."""
    if n < 1:
        raise MeshHealError(f"workers must be >= 1, got {n}")
    n = min(n, len(items))
    size, extra = divmod(len(items), n) if n else (0, 0)
    groups, start = [], 0
    for k in range(n):
        stop = start + size + (k < extra)
        groups.append(list(items[start:stop]))
        start = stop
    return groups


def usable_cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _pinned(core: int | None, fn: Callable, args: tuple):
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    return fn(*args)


def map_pinned(fn: Callable, jobs: Sequence[tuple], what: str = "job") -> list:
    """[fn(*job) for job in jobs], each job in its own spawned process, pinned to its own core when
    there are at least as many cores as jobs (else the OS places them). `fn` must be a module-level
    function and the jobs picklable. A job that raises is reported by its index and `what`."""
    if len(jobs) == 1:
        return [fn(*jobs[0])]
    cores = usable_cores()
    pin = len(cores) >= len(jobs)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=context) as pool:
        futures = [pool.submit(_pinned, cores[k] if pin else None, fn, job) for k, job in enumerate(jobs)]
        out = []
        for k, future in enumerate(futures):
            try:
                out.append(future.result())
            except MeshHealError as err:
                raise MeshHealError(f"worker {k + 1} of {len(jobs)} ({what}): {err}") from err
            except concurrent.futures.process.BrokenProcessPool as err:
                raise MeshHealError(f"worker {k + 1} of {len(jobs)} ({what}) died (out of memory?): {err}") from err
    return out
