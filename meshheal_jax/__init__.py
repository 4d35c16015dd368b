"""MeshHeal-JAX: a vectorised simulator of self-healing in decentralised LLM agent networks."""

import os

# XLA's CPU copy insertion, without region analysis, copies every loop-carried buffer that a loop
# body both reads and updates in place: the detector's (N, T, A, W) windows were copied on every
# observation (O(N) per task, 10x slower at 96 agents). Set before JAX starts its CPU backend;
# a user's own XLA_FLAGS are kept.
#
# XLA's CPU code generation is capped at AVX2: jaxlib 0.10.2's LLVM aborts the whole process while
# compiling some of the engine's programs for AVX-512 (seen on an AMD EPYC Zen 4: "LLVM ERROR:
# Cannot select: ... X86ISD::SUBV_BROADCAST_LOAD" in a small fusion). Without AVX-512 the same
# programs compile and run; on CPUs without it nothing changes. On a CPU where AVX-512 works
# the cap may cost some speed (not measured here: on the Zen 4 where it was needed, the flagship
# ran as fast with it); `XLA_FLAGS=--xla_cpu_max_isa=AVX512` (a user's own cap is kept) lifts it.
_FLAGS = {"xla_cpu_copy_insertion_use_region_analysis": "true", "xla_cpu_max_isa": "AVX2"}
for _name, _value in _FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

# Compiled programs are kept on disk (JAX's persistent compilation cache), so a command run again
# with the same shapes skips XLA compilation (15-30 s of a 576-agent run on a laptop CPU). Set through
# JAX's own environment variables (read when JAX starts), so importing the package imports no JAX;
# MESHHEAL_JAX_CACHE=DIR chooses the folder, MESHHEAL_JAX_CACHE=off turns it off, and a cache dir the
# user configured for JAX (JAX_COMPILATION_CACHE_DIR) wins.
_CACHE = os.environ.get(
    "MESHHEAL_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "meshheal_jax", "xla")
)
if _CACHE.lower() not in ("", "0", "off", "none"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")

# glibc's malloc returns freed memory above 128 KB to the OS (and serves blocks above its mmap
# threshold with fresh mmaps), so every compiled call's output buffers (the round records, a few
# MB per chunk) are faulted in page by page again; at 576 agents x 2 streams that was ~7% of a
# round (benchmarks/README.md, sixth session). Keep freed memory in the heap instead: blocks up
# to 32 MB from the heap, no trimming below 2 GB. glibc only; a user's own MALLOC_MMAP_THRESHOLD_
# or MALLOC_TRIM_THRESHOLD_ is kept; MESHHEAL_JAX_MALLOC=off leaves malloc alone.
if os.environ.get("MESHHEAL_JAX_MALLOC", "").lower() not in ("0", "off", "none"):
    try:
        import ctypes
        import platform

        if platform.libc_ver()[0] == "glibc":
            _libc = ctypes.CDLL(None)
            if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
                _libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
            if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
                _libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass
