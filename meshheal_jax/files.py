"""Files: a user's input read as text, and run files made durable before they are committed."""

from __future__ import annotations

import os
from pathlib import Path

from meshheal_jax.errors import MeshHealError


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
