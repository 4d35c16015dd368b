"""Where the test suite's time goes: a pytest plugin that writes, per test, its wall time, the time
JAX spent tracing, lowering and compiling (XLA) in the test's process, and how many round programs
(`engine.run_rounds`) it traced, with each new one's configuration. Commands a test starts in a
subprocess are not seen (their time counts in the test's wall time only).

    PYTHONPATH=scripts python -m pytest -p compile_census -n 0 tests/test_engine.py
    python scripts/compile_census.py [CENSUS.jsonl]      # per file: wall, XLA, trace, lowering

Writes to $COMPILE_CENSUS (default compile_census.jsonl), appending: one line per test, and one
line per round program traced (key "program").
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

EVENTS = {
    "xla_s": "/jax/core/compile/backend_compile_duration",
    "trace_s": "/jax/core/compile/jaxpr_trace_duration",
    "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
}
_seconds: dict[str, float] = collections.defaultdict(float)


def _write(row: dict) -> None:
    with open(os.environ.get("COMPILE_CENSUS", "compile_census.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_configure(config) -> None:
    from jax import monitoring

    from meshheal_jax import engine

    monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **_: _seconds.__setitem__(name, _seconds[name] + seconds)
    )
    real = engine.run_rounds

    def run_rounds(cfg, p, world, carry, n_rounds, params_batched=False):
        before = engine.TRACES["run_rounds"]
        out = real(cfg, p, world, carry, n_rounds, params_batched)
        if engine.TRACES["run_rounds"] != before:
            import jax

            _write({"program": repr(cfg), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                    "streams": int(jax.tree_util.tree_leaves(world)[0].shape[0]), "n_rounds": n_rounds,
                    "params_batched": params_batched})  # fmt: skip
        return out

    for name in ("clear_cache", "lower", "trace"):
        setattr(run_rounds, name, getattr(real, name))
    engine.run_rounds = run_rounds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from meshheal_jax import engine

    before, traces, start = dict(_seconds), engine.TRACES["run_rounds"], time.perf_counter()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 2),
           "round_programs": engine.TRACES["run_rounds"] - traces}  # fmt: skip
    row.update({key: round(_seconds[event] - before.get(event, 0.0), 2) for key, event in EVENTS.items()})
    _write(row)


def summary(path: str) -> None:
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    if not os.path.isfile(path):
        sys.exit(f"error: no census at {path}: run the tests with the plugin first "
                 "(PYTHONPATH=scripts python -m pytest -p compile_census -n 0 tests/...)")  # fmt: skip
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if "wall_s" in row:
            totals[row["test"].split("::")[0]].update(
                {k: row[k] for k in ("wall_s", "round_programs", *EVENTS)}
            )
    print("| file | wall s | XLA s | trace s | lowering s | round programs |\n|---|---|---|---|---|---|")
    for name, t in [*sorted(totals.items(), key=lambda kv: -kv[1]["wall_s"]), ("all", sum(totals.values(), collections.Counter()))]:  # fmt: skip
        print(f"| {name} | {t['wall_s']:.0f} | {t['xla_s']:.0f} | {t['trace_s']:.0f} | {t['lower_s']:.0f} | "
              f"{t['round_programs']} |")  # fmt: skip


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else "compile_census.jsonl")
