"""One exception type for every user-facing input problem.

CLIs catch it, print its one-line message and exit with status 2; nothing is half-written.
"""


class MeshHealError(ValueError):
    """Bad input named precisely: a profile, graph, schedule, config or data problem."""


class MeshHealWarning(UserWarning):
    """The project's own warnings (a CLI prints each as one `warning: ...` line)."""


class Cancelled(Exception):
    """A run stopped on request from another thread (the runner's Ctrl-C), not an input problem."""


def read_text(path, what: str) -> str:
    """A user's input file as text (UTF-8; a leading byte-order mark, as spreadsheet programs write,
    dropped), or a MeshHealError naming `what` and the file: missing, a folder, unreadable, or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise MeshHealError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise MeshHealError(f"{what} {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
