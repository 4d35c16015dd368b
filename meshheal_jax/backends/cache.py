"""On-disk response cache of the live backend (spec/live.md "Response cache").

One row per HTTP chat-completion call, keyed by the sha256 of (real model id, messages, sampling
parameters, seed, n). The real model id (e.g. `openai/gpt-oss-120b`), never the served alias
(`strong`) nor the server's URL, so a re-run against another server of the same model, or after a
restart on another port, re-sends nothing it already has. A response is written as it arrives
(sqlite3 in WAL mode): `put` commits its row alone; the live client's `put_soon` commits the
replies that arrive in one turn of its event loop together, at the loop's next turn (decisions
L2), so a run killed mid-batch loses at most the replies of that turn.

Nothing secret goes in: the key material has no headers or API key, the stored payload is the
reply's text, finish reasons, usage and latency; any value of a known secret variable that
would still appear in it (a model echoing a token put in a prompt) is redacted before writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from meshheal_jax.errors import MeshHealError

CACHE_FORMAT = 1  # part of every key: bump to invalidate old entries after a payload change
SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY",
    "VLLM_API_KEY",
    "MESHHEAL_API_KEY",
)
REDACTED = "[redacted]"
_MIN_SECRET_LENGTH = 6  # shorter values (e.g. "EMPTY") are not secrets worth scanning for

CACHE_FILE = "responses.sqlite"  # a run folder's response cache
_COUNT = "SELECT COUNT(*) FROM responses"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    model_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    created REAL NOT NULL
)
"""


def stored_replies(path: Path) -> int:
    """Replies in the response cache at `path`, read without opening it for writing: 0 where there
    is none; sqlite3.Error where it cannot be read (damaged, or locked past sqlite's timeout)."""
    if not path.is_file():
        return 0
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
        return int(db.execute(_COUNT).fetchone()[0])


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def cache_key(model_id: str, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> str:
    """sha256 hex of (format, real model id, messages, sampling params incl. seed and n)."""
    if not model_id:
        raise MeshHealError("response cache: a key needs the real model id")
    material = {
        "format": CACHE_FORMAT,
        "model": model_id,
        "messages": [dict(m) for m in messages],
        "params": dict(params),
    }
    return hashlib.sha256(canonical_json(material).encode("utf-8")).hexdigest()


def _secret_values() -> list[str]:
    values = [os.environ.get(name, "") for name in SECRET_ENV_VARS]
    return [v for v in values if len(v) >= _MIN_SECRET_LENGTH]


def redact_secrets(text: str, secrets: Sequence[str] | None = None) -> str:
    for secret in _secret_values() if secrets is None else secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


class ResponseCache:
    """sqlite3 (WAL) map: cache key -> response payload (a JSON-able dict).

    Used by one thread at a time (the live client's event loop; the baselines' live host calls it
    from XLA's callback threads, one call at a time under its lock); several processes may share
    the file.
    `extra_secrets`: more values to redact (e.g. an API key given on the command line).
    """

    def __init__(self, path: str | Path, extra_secrets: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
        except sqlite3.DatabaseError as err:
            raise MeshHealError(f"response cache {self.path}: cannot open ({err})") from None
        self._secrets = [s for s in extra_secrets if len(s) >= _MIN_SECRET_LENGTH]
        self._pending: dict[str, tuple] = {}  # put_soon's rows, key -> row, until the next flush
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # where a flush is scheduled
        self.hits = 0
        self.misses = 0
        self.writes = 0  # rows written
        self.commits = 0

    def get(self, key: str) -> dict | None:
        pending = self._pending.get(key)
        if pending is not None:
            self.hits += 1
            return json.loads(pending[2])
        row = self._read("SELECT payload FROM responses WHERE key = ?", (key,))
        if row is None:
            self.misses += 1
            return None
        self.hits += 1
        try:
            return json.loads(row[0])
        except (TypeError, ValueError) as err:
            raise self._damaged(f"a reply that is not JSON: {err}") from None

    def _read(self, sql: str, args: tuple = ()) -> tuple | None:
        try:
            return self._db.execute(sql, args).fetchone()
        except sqlite3.DatabaseError as err:  # a file damaged past its header (opening it worked)
            raise self._damaged(str(err)) from None

    def _damaged(self, what: str) -> MeshHealError:
        return MeshHealError(
            f"response cache {self.path}: cannot read it ({what}); move it aside to run on without its "
            "replies (they are asked again), or restore it from a copy"
        )

    def put(self, key: str, model_id: str, payload: Mapping[str, Any]) -> None:
        """Write one reply now, in its own commit."""
        self._write([self._row(key, model_id, payload)])

    def put_soon(self, key: str, model_id: str, payload: Mapping[str, Any]) -> None:
        """Write one reply with the others put in the same turn of the running event loop: one commit
        for them all, at the loop's next turn. Without a running loop, as `put`. If that write fails,
        the replies stay held and the next `flush` (`run_batch` ends with one) tries again and raises
        (a loop callback's exception would only be logged)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.put(key, model_id, payload)
            return
        if self._flush_loop is not loop:  # none scheduled on this loop yet (an ended loop runs none)
            loop.call_soon(self._flush_soon)
            self._flush_loop = loop
        self._pending[key] = self._row(key, model_id, payload)

    def flush(self) -> None:
        """Commit the replies `put_soon` holds (MeshHealError if the write fails: they stay held)."""
        self._flush_loop = None
        if self._pending:
            self._write(list(self._pending.values()))
            self._pending = {}

    def _flush_soon(self) -> None:
        with contextlib.suppress(MeshHealError):  # held; the next flush tries again and raises
            self.flush()

    def _row(self, key: str, model_id: str, payload: Mapping[str, Any]) -> tuple:
        text = redact_secrets(canonical_json(payload), _secret_values() + self._secrets)
        return key, model_id, text, time.time()

    def _write(self, rows: list[tuple]) -> None:
        try:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO responses (key, model_id, payload, created) VALUES (?, ?, ?, ?)", rows
            )
            self._db.execute("COMMIT")
        except sqlite3.Error as err:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise MeshHealError(
                f"response cache {self.path}: cannot write {len(rows)} reply(ies) ({err})"
            ) from None
        self.writes += len(rows)
        self.commits += 1

    def __contains__(self, key: str) -> bool:
        self.flush()
        return self._read("SELECT 1 FROM responses WHERE key = ?", (key,)) is not None

    def __len__(self) -> int:
        self.flush()
        return int(self._read(_COUNT)[0])

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
