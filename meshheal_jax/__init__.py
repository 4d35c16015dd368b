"""MeshHeal-JAX: a vectorised simulator of self-healing in decentralised LLM agent networks."""

import os

# XLA's CPU copy insertion, without region analysis, copies every loop-carried buffer that a loop
# body both reads and updates in place: the detector's (N, T, A, W) windows were copied on every
# observation (O(N) per task, 10x slower at 96 agents). Set before JAX starts its CPU backend;
# a user's own XLA_FLAGS are kept.
_FLAG = "--xla_cpu_copy_insertion_use_region_analysis=true"
if "xla_cpu_copy_insertion_use_region_analysis" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
