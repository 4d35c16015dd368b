"""Shared CLI plumbing: typed flags (tyro), one-line errors with exit status 2, printed tables."""

from __future__ import annotations

import dataclasses
import sys
import tomllib
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
    protocol: ProtocolParams = dataclasses.field(default_factory=ProtocolParams)
    """protocol parameters (spec/protocol.md; the spec's DECISIONs among them)"""
    quiet: bool = False
    """no progress bar"""
    lanes: int | None = None
    """jax engine: run MeshHeal's streams in this many lanes side by side, one thread each sharing one
    compiled program (default: one per CPU core on one CPU device, else 1; 1 = one batch; more than 1 is
    refused with several devices; the same records, floats up to the last bits; docs/decisions.md S7)"""
    backend: Literal["emulated", "live"] = "emulated"
    """emulated (the embedded calibrated emulator) or live (real models behind OpenAI-compatible servers,
    e.g. serving/vllm_pair.sh; every method, the baselines included)"""
    strong_url: tuple[str, ...] = ()
    """live: base URL(s) of the strong model's server(s), e.g. http://127.0.0.1:8000/v1 (round-robin)"""
    weak_url: tuple[str, ...] = ()
    """live: base URL(s) of the weak model's server(s)"""
    strong_model: str | None = None
    """live: the strong server's real model id (default: read from its /v1/models)"""
    weak_model: str | None = None
    """live: the weak server's real model id (default: read from its /v1/models)"""
    live_config: Path | None = None
    """live: a TOML file with any of strong_url, weak_url (lists), strong_model, weak_model (real model ids),
    strong_served_name, weak_served_name, max_in_flight, max_tokens, data; flags given on the command line win"""
    data: str | None = None
    """live: the questions: hub (Hugging Face, the default), sample (the packaged sample) or a folder of
    local benchmark files"""
    max_tokens: int | None = None
    """live: cap on every call's max_completion_tokens"""

    def seed_tuple(self) -> tuple[int, ...]:
        if self.seed_list is not None:
            return tuple(self.seed_list)
        if self.seeds <= 0:
            raise MeshHealError(f"--seeds must be >= 1, got {self.seeds}")
        return tuple(range(self.seeds))


LIVE_KEYS = ("strong_url", "weak_url", "strong_model", "weak_model", "strong_served_name", "weak_served_name",
             "max_in_flight", "max_tokens", "data")  # fmt: skip


def live_settings(flags: CommonFlags):
    """The runner's LiveSettings from --live-config and the live flags (flags win); None when no
    live setting is given at all (the runner then says what --backend live needs)."""
    from meshheal_jax.runner import LiveSettings

    doc: dict = {}
    if flags.live_config is not None:
        try:
            doc = tomllib.loads(flags.live_config.read_text())
        except OSError as err:
            raise MeshHealError(f"cannot read --live-config {flags.live_config}: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise MeshHealError(f"--live-config {flags.live_config} is not valid TOML: {err}") from None
        unknown = sorted(set(doc) - set(LIVE_KEYS))
        if unknown:
            raise MeshHealError(
                f"--live-config {flags.live_config}: unknown keys {unknown}; known: {list(LIVE_KEYS)}"
            )
    for key, value in (("strong_url", flags.strong_url), ("weak_url", flags.weak_url), ("data", flags.data),
                       ("max_tokens", flags.max_tokens), ("strong_model", flags.strong_model),
                       ("weak_model", flags.weak_model)):  # fmt: skip
        if value or (key == "max_tokens" and value is not None):  # --max-tokens 0 reaches the >= 1 check
            doc[key] = value
    if not doc:
        return None
    source = f"--live-config {flags.live_config}" if flags.live_config is not None else "live settings"
    for key in ("max_in_flight", "max_tokens"):
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise MeshHealError(f"{source}: {key} must be an integer, got {value!r}")
    for key in ("strong_model", "weak_model", "strong_served_name", "weak_served_name", "data"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise MeshHealError(f"{source}: {key} must be a string, got {doc[key]!r}")

    def urls(key: str) -> tuple[str, ...]:
        value = doc.get(key, ())
        values = (value,) if isinstance(value, str) else value
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
            raise MeshHealError(f"{source}: {key} must be a URL or a list of URLs, got {value!r}")
        return tuple(url.strip() for v in values for url in v.split(",") if url.strip())  # a,b or a b

    return LiveSettings(
        strong_urls=urls("strong_url"), weak_urls=urls("weak_url"), strong_model=doc.get("strong_model"),
        weak_model=doc.get("weak_model"), strong_served_name=doc.get("strong_served_name"),
        weak_served_name=doc.get("weak_served_name"), max_in_flight=int(doc.get("max_in_flight", 128)),
        max_tokens=doc.get("max_tokens"), data=str(doc.get("data", "hub")),
    )  # fmt: skip


def backend_fields(flags: CommonFlags) -> dict:
    """The Experiment fields of the backend flags (every experiment passes them through)."""
    return {"backend": flags.backend, "live": live_settings(flags)}


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
        table.add_column(
            col, justify="right" if col not in ("dataset", "method", "phase", "agent") else "left"
        )
    return table
