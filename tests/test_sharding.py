"""Streams sharded over several devices (a 1-D mesh over the stream axis) give the same records
as the unsharded run (float columns up to rounding in the last bits, e.g. s_u's square root). JAX fixes its device count when it starts, so the check runs in a fresh
process with XLA_FLAGS=--xla_force_host_platform_device_count=4 (four CPU "devices")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, polars as pl
    from meshheal_jax import engine, runner
    from meshheal_jax.config import ProtocolParams

    assert jax.device_count() == 4, jax.devices()
    exp = runner.Experiment(name="main", datasets=("bbh", "math", "mmlu_pro"), pairs=("default",),
                            seeds=(0, 1), n_tasks=168)
    def specs(streams):
        out = []
        for dataset, seed in streams:
            network, stream, pair, labels = runner._stream_inputs(exp, dataset, "default", seed)
            out.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
        return out

    # five streams of three datasets: params batched (p_part per dataset), padded to 8, two per device
    five = specs([(d, s) for s in exp.seeds for d in exp.datasets][:5])
    three = specs([("bbh", s) for s in (0, 1, 2)])  # one dataset: params shared; 3 streams padded to 4
    assert engine.stream_mesh().size == 4 and engine.stream_mesh(False) is None
    for batch in (five, three):
        plain = engine.run_streams(batch, ProtocolParams(), chunk=128, shard=False)
        sharded = engine.run_streams(batch, ProtocolParams(), chunk=128)
        assert len(sharded) == len(batch)
        for a, b in zip(plain, sharded, strict=True):
            for name in engine.TABLES:
                x, y = a[name], b[name]
                floats = [c for c, dtype in x.schema.items() if dtype == pl.Float64]
                for c in floats:  # equal up to float rounding: XLA compiles the per-device program apart
                    gap = (x[c] - y[c]).abs().max()
                    assert gap is None or gap <= 1e-12, (name, c, gap)
                assert x.drop(floats).equals(y.drop(floats)), name  # every decision, state and count
        isolations = sum(int((f["states"]["to"] == "isolated").sum()) for f in plain)
        print("streams", len(batch), "tasks", sum(f["tasks"].height for f in plain), "isolations", isolations)
    print("SHARDED_EQUAL")
    """
)


def test_sharded_streams_equal_the_unsharded_run():
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4".strip()}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, env=env, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "SHARDED_EQUAL" in done.stdout
    # the detector really ran (isolations change the distance tables, the cross-stream predicate)
    counts = [int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("streams")]
    assert counts and all(c > 0 for c in counts), done.stdout
