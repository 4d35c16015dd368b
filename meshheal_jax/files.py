"""Files: a user's input read as text, and run files made durable before they are committed."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from meshheal_jax.errors import MeshHealError

_CHOSEN: list[Path] = []  # the run folders commands of this process chose for themselves (no --out)


def default_out(name: str) -> Path:
    """runs/<name>-<timestamp>: the folder of a command given no --out (a stopped command names it,
    `chosen_outs`, so the user knows which folder the same command resumes with --out)."""
    out = Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    _CHOSEN.append(out)
    return out


def chosen_outs() -> tuple[Path, ...]:
    """The folders `default_out` chose in this process, in order."""
    return tuple(_CHOSEN)


def read_text(path: Path, what: str) -> str:
    """A user's input file as text (UTF-8; a leading byte-order mark, as spreadsheet programs write,
    dropped), or a MeshHealError naming `what` and the file: missing, a folder, unreadable, or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise MeshHealError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        line = err.object[: err.start].count(b"\n") + 1
        raise MeshHealError(
            f"{what} {path} is not UTF-8 text (line {line}, byte {err.start}: {err.reason})"
        ) from None


def flush(path: Path) -> None:
    """Make a file's contents (or a folder's entries) durable before the rename that commits them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
