"""One exception type for every user-facing input problem.

CLIs catch it, print its one-line message and exit with status 2; nothing is half-written.
"""


class MeshHealError(ValueError):
    """Bad input named precisely: a profile, graph, schedule, config or data problem."""


class MeshHealWarning(UserWarning):
    """The project's own warnings (a CLI prints each as one `warning: ...` line)."""


class Cancelled(Exception):
    """A run stopped on request from another thread (the runner's Ctrl-C), not an input problem."""


class Abandoned(KeyboardInterrupt):
    """A second stop while batches still run in threads (a baseline's program cannot be cut short):
    the command exits without waiting for them; what was kept before stays kept."""
