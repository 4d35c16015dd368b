"""Checkpoints of unfinished streams (spec/architecture.md, "Long runs"; docs/decisions.md X1).

The JAX engine runs a batch of streams as chunks of rounds. Every `every_s` seconds, and when the
batch is stopped through its cancel or stop event (the runner's Ctrl-C, another lane's failure),
each stream's engine state after the last chunk (its slice of the `Carry`: network, slots,
backend state, draws) is written with the records of the chunks since the previous checkpoint. A
rerun of the same command restores both and goes on from that chunk: a stream's records do not
depend on where its chunks end, so they equal an uninterrupted run's.

One folder per stream; checkpoint K (K = 1, 2, ...) wrote:

    records-00000.tasks.parquet ...   checkpoint 1: the records of its chunks, one file per table
    records-00001.tasks.parquet ...   checkpoint 2: those of the chunks after checkpoint 1
    carry-00002.npz                   the engine state at the last checkpoint, K = 2 (its leaves)
    state.json                        {"saved": 2, "tables": [...], "layout": ...}: the commit

Every file is flushed to disk before state.json is replaced through a rename, so a crash while
saving leaves the previous checkpoint whole; files it does not count are removed when the folder
is next read (a folder without state.json, from a first save cut short, is removed whole). A
checkpoint that cannot be read back (damaged files, another engine's layout) is dropped with a
`CheckpointWarning`, and its stream runs from its first task.
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

from meshheal_jax.config import CHECKPOINT_EVERY_S
from meshheal_jax.errors import MeshHealWarning
from meshheal_jax.files import flush

STATE = "state.json"


class CheckpointWarning(MeshHealWarning):
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
    every_s: float = CHECKPOINT_EVERY_S  # (runner.run checks it, with the flag's name)

    def committed(self, m: int) -> bool:
        """Whether stream m has a checkpoint; a folder without its commit (a first save cut short)
        is removed."""
        if (self.folders[m] / STATE).exists():
            return True
        shutil.rmtree(self.folders[m], ignore_errors=True)
        return False

    def due(self, last: float) -> bool:
        return time.monotonic() - last >= self.every_s

    def restore(
        self, m: int, template, tables: tuple[str, ...]
    ) -> tuple[object, list[dict[str, pl.DataFrame]]] | None:
        """Stream m's carry and its records so far (the tables named in `tables`), or None: no
        checkpoint, or one that cannot be used (a CheckpointWarning says why; the folder is
        removed). `template`: a fresh carry of the stream (numpy leaves), the tree and shapes to
        expect."""
        folder = self.folders[m]
        if not self.committed(m):
            return None
        try:
            state = json.loads((folder / STATE).read_text())
            saved = int(state["saved"])
            if state["layout"] != layout(template):
                raise ValueError(
                    "its engine state has another layout (written by another version of the engine)"
                )
            if state["tables"] != sorted(tables):
                raise ValueError(f"it holds the tables {state['tables']}, this run keeps {sorted(tables)}")
            with np.load(folder / f"carry-{saved:05d}.npz") as npz:
                leaves = [npz[f"arr_{k}"] for k in range(len(npz.files))]
            if layout(leaves)["leaves"] != state["layout"]["leaves"]:
                raise ValueError("its engine state's arrays do not match its layout")
            parts = [
                {name: pl.read_parquet(folder / f"records-{k:05d}.{name}.parquet") for name in tables}
                for k in range(saved)
            ]
        except Exception as e:  # noqa: BLE001 -- damaged files raise many types (zip, parquet, json, EOF)
            warnings.warn(f"checkpoint {folder} not used ({type(e).__name__}: {e}); its stream runs from its "
                          "first task", CheckpointWarning, stacklevel=2)  # fmt: skip
            shutil.rmtree(folder, ignore_errors=True)
            return None
        for f in folder.iterdir():  # what a save cut short before its commit left behind
            if f.name != STATE and f.name != f"carry-{saved:05d}.npz" and not _counted(f.name, saved):
                f.unlink()
        carry = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
        return carry, parts

    def save(self, m: int, carry, parts: list[dict[str, pl.DataFrame]], tasks_entered: int) -> None:
        """Checkpoint stream m: `carry` (its slice, numpy leaves) after the records `parts` (the chunks'
        record frames since its previous checkpoint, one dict of tables each)."""
        if not parts:
            raise ValueError("a checkpoint follows at least one chunk")
        folder = self.folders[m]
        folder.mkdir(parents=True, exist_ok=True)
        saved = json.loads((folder / STATE).read_text())["saved"] if (folder / STATE).exists() else 0
        written = []
        for name in parts[0]:
            path = folder / f"records-{saved:05d}.{name}.parquet"
            pl.concat([p[name] for p in parts]).write_parquet(path)
            written.append(path)
        written.append(folder / f"carry-{saved + 1:05d}.npz")
        np.savez(written[-1], *jax.tree_util.tree_leaves(carry))
        state = {"saved": saved + 1, "tasks_entered": tasks_entered, "tables": sorted(parts[0]),
                 "layout": layout(carry)}  # fmt: skip
        tmp = folder / (STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        for path in (*written, tmp):
            flush(path)
        tmp.replace(folder / STATE)  # the commit
        flush(folder)
        (folder / f"carry-{saved:05d}.npz").unlink(missing_ok=True)


def _counted(name: str, saved: int) -> bool:
    """A records file of a committed checkpoint (records-K.* with K < saved)."""
    head, _, _ = name.partition(".")
    return head.startswith("records-") and head[8:].isdigit() and int(head[8:]) < saved
