"""scripts/stream_collapses.py: per group and phase, the streams that stopped answering."""

import importlib.util
from pathlib import Path

import polars as pl

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stream_collapses.py"
spec = importlib.util.spec_from_file_location("stream_collapses", SCRIPT)
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)


def tasks(
    answered_by_seed: dict[int, list[bool]], extra: dict | None = None, pair: str = "default"
) -> pl.DataFrame:
    rows = []
    for seed, answered in answered_by_seed.items():
        for t, a in enumerate(answered):
            rows.append({"method": "meshheal", "dataset": "bbh", "pair": pair, "seed": seed, "t": t + 1, "phase": t % 2,
                         "answered": a, "correct": a and t % 4 < 2, **(extra or {})})  # fmt: skip
    return pl.DataFrame(rows)


def test_counts_streams_below_the_thresholds_per_phase():
    # seed 0 answers everything; seed 1 answers nothing in phase 1 (odd t)
    frame = tasks({0: [True] * 8, 1: [True, False] * 4})
    out = sc.collapses(frame, answered=0.95, accuracy=0.7).sort("phase")
    assert out["streams"].to_list() == [2, 2]
    assert out["answered < 0.95"].to_list() == [0, 1]
    assert out["min answered"].to_list() == [1.0, 0.0]
    # phase 0: t = 0, 2, 4, 6 -> correct when t % 4 < 2 -> half right in both streams
    assert out["accuracy < 0.7"].to_list() == [2, 2]


def test_a_sweep_groups_by_grid_point_and_keeps_the_swept_columns():
    a = tasks({0: [True] * 4}, {"grid_point": 0, "min_observations": 3})
    b = tasks({0: [False] * 4}, {"grid_point": 1, "min_observations": 5})
    out = sc.collapses(pl.concat([a, b]), answered=0.95, accuracy=0.7)
    assert {"grid_point", "min_observations"} <= set(out.columns) and "method" not in out.columns
    per_point = out.group_by("grid_point").agg(pl.col("answered < 0.95").sum()).sort("grid_point")
    assert per_point["answered < 0.95"].to_list() == [0, 2]


def test_streams_of_two_pairs_are_counted_apart():
    frame = pl.concat([tasks({0: [True] * 4}, pair="A"), tasks({0: [False] * 4}, pair="B")])
    out = sc.collapses(frame, answered=0.95, accuracy=0.7).sort("pair", "phase")
    assert out["pair"].to_list() == ["A", "A", "B", "B"] and out["streams"].to_list() == [1, 1, 1, 1]
    assert out["answered < 0.95"].to_list() == [0, 0, 1, 1]
