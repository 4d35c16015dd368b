"""Shared fixtures: the packaged profiles as parsed TOML documents and as Profile objects.

The whole test session compiles with XLA's CPU backend optimisation off: tests are dominated by
compiling many small programs (about 3x faster to compile, same results; the engine-equality
tests compare against the reference with the usual tolerances). Set here, before any test module
imports JAX, so every test sees the same flags whatever the collection order; experiments and
benchmarks keep XLA's defaults.
"""

from __future__ import annotations

import os

_FAST = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST).strip()

# One compile cache for the whole test session, fresh each time: the workers and the commands the
# tests start (CLI, benchmarks, live runs: dozens of processes) compile many of the same small
# programs, which optimisation off brings under the package's 2 s threshold for caching, so here
# every program is kept. The first process to load this file (pytest's, or a lone worker's) points
# MESHHEAL_JAX_CACHE at a new folder (the package's own rule then applies it); the processes it
# starts inherit it; it removes the folder at the end. A cache the user chose or turned off
# (MESHHEAL_JAX_CACHE, JAX_COMPILATION_CACHE_DIR) is left as it is.
_OWN_CACHE = None
if "MESHHEAL_JAX_CACHE" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["MESHHEAL_JAX_CACHE"] = tempfile.mkdtemp(prefix="meshheal-test-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# The Hugging Face hub is never asked from a test (no network here; data.hub_commit then answers
# None): the hub tests answer through stubs of `datasets` and of data.hub_commit.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import tomllib

import pytest

from meshheal_jax import topology

# The slowest test files first (their summed test times in one process, 2026-12-05: engine 203 s,
# lanes 177, cli 136, live_server 135, benchmarks 83, sharding 78, live_throughput 75,
# live_baselines 73; every other file under 60). pytest-xdist's --dist loadfile hands each worker
# whole files in collection order (with --no-loadscope-reorder, pyproject.toml), so a long file
# collected last keeps one worker busy while the others have finished; taken first, the short
# files fill in around them. Within a file, and among
# the other files, the order is pytest's own.
SLOW_FIRST = ("test_engine.py", "test_lanes.py", "test_cli.py", "test_live_server.py", "test_benchmarks.py",
              "test_sharding.py", "test_live_throughput.py", "test_live_baselines.py")  # fmt: skip


def pytest_unconfigure(config) -> None:
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: k for k, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable sort


@pytest.fixture(scope="session")
def packaged_docs() -> dict[str, dict]:
    """dataset -> the packaged profile file, parsed by tomllib (never mutated: copy first)."""
    return {ds: tomllib.loads((topology.PROFILE_DIR / f"{ds}.toml").read_text()) for ds in topology.DATASETS}


@pytest.fixture
def bbh_doc(packaged_docs) -> dict:
    """A private deep copy of the BBH profile document, free to mutate."""
    return copy.deepcopy(packaged_docs["bbh"])


@pytest.fixture(scope="session")
def bbh_profile() -> topology.Profile:
    return topology.load_profile("bbh")


@pytest.fixture(scope="session")
def math_verify():
    """The math-verify package, or the test skipped where it is not installed (MATH scoring)."""
    return pytest.importorskip("math_verify")


@pytest.fixture
def terminal_sigint():
    """Python's own SIGINT handler in this process for the test's duration, as in a terminal: a
    Ctrl-C here raises KeyboardInterrupt (`_thread.interrupt_main` needs that too), and a process the
    test starts begins with SIGINT at its default, since exec resets a caught signal. pytest started
    in the background (`cmd &`) ignores SIGINT, and its xdist workers and their children inherit
    that; bash cannot even trap a signal ignored on entry. Without this, a test that stops a child
    with SIGINT passed or hung depending on how pytest was started and on whether an earlier test
    in the same worker had left a handler installed (CI88's one failure)."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
