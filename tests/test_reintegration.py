"""scripts/reintegration.py: what a restored agent's outputs read as after its restoration."""

import importlib.util
from pathlib import Path

import polars as pl

from meshheal_jax.config import ProtocolParams

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reintegration.py"
spec = importlib.util.spec_from_file_location("reintegration", SCRIPT)
ri = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ri)


def test_counts_well_scored_outputs_still_read_as_shortfalls():
    """Agent 4 (A5), degraded 10-19, restored at 20: ten outputs on one key, q = 1; the first eight
    (its window still holding old shortfalls) read z = 3, the last two z = 0.5. Agent 0, never
    degraded: healthy-phase outputs after the warm-up (t > 2) count as the baseline."""
    reviews = [{"seed": 0, "t": t, "visit": 1, "author": 4, "ability": 1, "q": 1.0, "z": 3.0 if t < 28 else 0.5}
               for t in range(20, 30)]  # fmt: skip
    reviews += [{"seed": 0, "t": t, "visit": 1, "author": 0, "ability": 2, "q": q, "z": z}
                for t, q, z in ((2, 1.0, 5.0), (3, 1.0, 0.0), (4, 1.0, 1.5), (5, 0.25, 4.0), (6, 1.0, None))]  # fmt: skip
    tasks = pl.DataFrame({"seed": [0] * 30, "t": list(range(1, 31)), "task_type": [0] * 30})
    states = pl.DataFrame({"agent": [4, 4, 4], "t": [15, 25, 27], "to": ["isolated", "normal", "isolated"]})
    out = ri.reintegration(pl.DataFrame(reviews), tasks, states, [(4, 10, 20)], ProtocolParams(), warmup=2)
    restored, healthy = out.row(0, named=True), out.row(1, named=True)
    assert restored["agents"] == "A5 (restored at task 20)" and restored["outputs"] == 10
    assert restored["q >= 0.75 with z"] == 10
    assert restored["of which z >= alpha"] == restored["of which z >= beta"] == "0.80"
    assert restored["on a key with < W_x outputs since"] == "0.80"  # the 9th and 10th: 8 since
    assert (restored["to normal"], restored["back to isolated"]) == (1, 1)  # t = 15 is before restoration
    assert healthy["agents"] == "never degraded, tasks 3-9"
    assert healthy["outputs"] == 4 and healthy["q >= 0.75 with z"] == 2  # t = 2 is in the warm-up
    assert healthy["of which z >= alpha"] == "0.50" and healthy["of which z >= beta"] == "0.00"
