"""Checkpoints of unfinished streams (spec/architecture.md, "Long runs"; docs/decisions.md X1).

The JAX engine runs a batch of streams as chunks of rounds. Every `every_s` seconds, and when the
batch is stopped (Ctrl-C), each stream's engine state after the last chunk (its slice of the
`Carry`: network, slots, backend state, draws) is written with the records of the chunks since
the previous checkpoint. A rerun of the same command restores both and goes on from that chunk:
a stream's records do not depend on where its chunks end, so they equal an uninterrupted run's.

One folder per stream:

    records-00000.tasks.parquet ...   the records of the chunks up to checkpoint 1, one file per table
    records-00001.tasks.parquet ...   those of the chunks after it, up to checkpoint 2
    carry-00002.npz                   the engine state at the last checkpoint (its leaves, in order)
    state.json                        {"saved": 2, "tasks_done": ..., "layout": ...}: the commit

state.json is written last, through a rename, so a crash while saving leaves the previous
checkpoint whole: files it does not count are removed when the folder is next read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import polars as pl

STATE = "state.json"


class CheckpointWarning(UserWarning):
    """A stream's checkpoint could not be used; the stream runs from its first task."""


def layout(tree) -> dict:
    """What a carry's arrays must look like to be restored: the tree's structure, each leaf's shape
    and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return {"tree": str(treedef), "leaves": [[list(np.shape(x)), str(np.asarray(x).dtype)] for x in leaves]}


@dataclasses.dataclass
class Checkpoints:
    """The checkpoint folders of a batch's streams (`folders[m]` for stream m of the batch) and how
    often to write them (seconds; 0 = after every chunk)."""

    folders: list[Path]
    every_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.every_s >= 0:
            raise ValueError(f"checkpoint interval must be >= 0 seconds, got {self.every_s}")

    def has(self, m: int) -> bool:
        return (self.folders[m] / STATE).exists()

    def due(self, last: float) -> bool:
        return time.monotonic() - last >= self.every_s

    def restore(self, m: int, template) -> tuple[object, list[dict[str, pl.DataFrame]]] | None:
        """Stream m's carry and its records so far, or None (no checkpoint, or one this code cannot
        read: a CheckpointWarning says why and the folder is cleared). `template`: a fresh carry of
        the stream (numpy leaves), which gives the tree and the shapes to expect."""
        folder = self.folders[m]
        if not self.has(m):
            return None
        try:
            state = json.loads((folder / STATE).read_text())
            saved = int(state["saved"])
            if state["layout"] != layout(template):
                raise ValueError(
                    "its engine state has another layout (written by another version of the engine)"
                )
            with np.load(folder / f"carry-{saved:05d}.npz") as npz:
                leaves = [npz[f"arr_{k}"] for k in range(len(npz.files))]
            parts = []
            for k in range(saved):
                files = sorted(folder.glob(f"records-{k:05d}.*.parquet"))
                parts.append({f.name.split(".")[1]: pl.read_parquet(f) for f in files})
            if not all(parts) or len({tuple(sorted(p)) for p in parts}) > 1:
                raise ValueError("its records are incomplete")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            warnings.warn(f"checkpoint {folder} not used ({e}); its stream runs from its first task",
                          CheckpointWarning, stacklevel=2)  # fmt: skip
            shutil.rmtree(folder, ignore_errors=True)
            return None
        for f in folder.iterdir():  # what a save interrupted before its commit left behind
            if f.name != STATE and f.name != f"carry-{saved:05d}.npz" and not _counted(f.name, saved):
                f.unlink()
        carry = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
        return carry, parts

    def save(self, m: int, carry, parts: list[dict[str, pl.DataFrame]], tasks_done: int) -> None:
        """Checkpoint stream m: `carry` (its slice, numpy leaves) after the records `parts` (the chunks'
        record frames since its previous checkpoint)."""
        if not parts:
            raise ValueError("a checkpoint follows at least one chunk")
        folder = self.folders[m]
        folder.mkdir(parents=True, exist_ok=True)
        saved = json.loads((folder / STATE).read_text())["saved"] if (folder / STATE).exists() else 0
        for name in parts[0]:
            pl.concat([p[name] for p in parts]).write_parquet(folder / f"records-{saved:05d}.{name}.parquet")
        np.savez(folder / f"carry-{saved + 1:05d}.npz", *jax.tree_util.tree_leaves(carry))
        state = {"saved": saved + 1, "tasks_done": tasks_done, "layout": layout(carry)}
        tmp = folder / (STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(folder / STATE)  # the commit
        (folder / f"carry-{saved:05d}.npz").unlink(missing_ok=True)


def _counted(name: str, saved: int) -> bool:
    """A records file of a committed checkpoint (records-K.* with K < saved)."""
    head, _, _ = name.partition(".")
    return head.startswith("records-") and head[8:].isdigit() and int(head[8:]) < saved
