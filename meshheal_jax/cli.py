"""Shared CLI plumbing: typed flags (tyro), one-line errors with exit status 2, printed tables."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import tyro
from rich.console import Console
from rich.table import Table

from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError


@dataclasses.dataclass(frozen=True)
class CommonFlags:
    seeds: int = 5
    """number of seeds: runs seeds 0..N-1"""
    seed_list: tuple[int, ...] | None = None
    """explicit seeds (overrides --seeds)"""
    pair: str = "default"
    """model pair: default | A | B"""
    engine: Literal["jax", "reference"] = "jax"
    """simulation engine: jax (vectorized, default) or reference (plain Python, one task at a time)"""
    slots: int = 1
    """in-flight tasks per stream (jax engine; at most agents/6; 1 = the paper's sequential semantics)"""
    out: Path | None = None
    """run folder (default runs/<experiment>-<timestamp>); an existing run folder resumes"""
    profiles_dir: Path | None = None
    """folder of ability profile TOML files (default: the packaged ones)"""
    params_dir: Path | None = None
    """folder of emulator model parameter files (default: the packaged ones)"""
    protocol: ProtocolParams = ProtocolParams()
    quiet: bool = False
    """no progress bar"""

    def seed_tuple(self) -> tuple[int, ...]:
        if self.seed_list is not None:
            return tuple(self.seed_list)
        if self.seeds <= 0:
            raise MeshHealError(f"--seeds must be >= 1, got {self.seeds}")
        return tuple(range(self.seeds))


def entrypoint(config_type: type, body: Callable, description: str) -> None:
    """Parse flags, run body(config); a MeshHealError prints one line and exits with status 2."""
    try:
        config = tyro.cli(config_type, description=description)
        body(config)
    except MeshHealError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def fmt(s: dict | None, digits: int = 3, scale: float = 1.0) -> str:
    """mean ± std of a stat dict; '—' where undefined."""
    if not s or s.get("mean") is None:
        return "—"
    mean = s["mean"] * scale
    text = f"{mean:.{digits}f}"
    if s.get("std") is not None:
        text += f" ± {s['std'] * scale:.{digits}f}"
    return text


def fmt_range(s: dict | None, digits: int = 1) -> str:
    if not s or s.get("mean") is None:
        return "never"
    text = fmt(s, digits)
    text += f" ({s['min']:.0f}–{s['max']:.0f})"
    if s.get("n_defined") is not None:
        text += f" n={s['n_defined']}"
    return text


def print_table(table: Table) -> None:
    Console(width=200).print(table)


def new_table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="right" if col not in ("dataset", "method", "phase", "agent") else "left")
    return table
