"""Shared CLI plumbing: typed flags (tyro), one-line errors with exit status 2, printed tables."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import tyro
from rich.console import Console
from rich.table import Table

from meshheal_jax.config import CHECKPOINT_EVERY_S, ProtocolParams, checks_deferred
from meshheal_jax.errors import Abandoned, MeshHealError, MeshHealWarning
from meshheal_jax.files import chosen_outs, read_text


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
    checkpoint_every: float = CHECKPOINT_EVERY_S
    """jax engine, emulated: seconds between checkpoints of MeshHeal's unfinished streams (their engine
    state and records so far, in the run folder's checkpoints/; also written when the run is stopped);
    rerunning the command goes on from them (0 = after every chunk; docs/decisions.md X1)"""
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
    strong_served_name, weak_served_name, max_in_flight (strong_max_in_flight, weak_max_in_flight: one
    role's, e.g. a vLLM server with --data-parallel-size D takes D x its --max-num-seqs), max_tokens,
    request_timeout_s, data, reasoning_effort, tokenizer (emulated runs) and the tables
    hub_id, hub_split, hub_config, hub_revision (dataset = value); flags given on the command line win"""
    data: str | None = None
    """the questions: hub (Hugging Face, live's default), sample (the packaged sample) or a folder of
    local benchmark files; an emulated run given one counts each question's tokens from its text
    (characters / 4) instead of the profile's mean"""
    tokenizer: str | None = None
    """emulated, with --data: count each question's tokens with this tokenizer (a tokenizer.json, a model
    folder holding one, or a Hugging Face model id) instead of characters / 4"""
    max_tokens: int | None = None
    """live: cap on every call's max_completion_tokens"""
    request_timeout_s: float | None = None
    """live: seconds one HTTP call may take before it is retried (up to 6 retries, then the run stops
    with an error naming the server); default 900, for long gpt-oss reasoning"""
    reasoning_effort: str | None = None
    """live: the reasoning_effort sent to gpt-oss models (no other model gets one): low | medium | high;
    medium when not given"""
    hub_id: tuple[str, ...] = ()
    """live, --data hub: a dataset's Hugging Face id, DATASET=ID (one or more), e.g. math=HuggingFaceH4/MATH-500;
    default bbh=lukaemon/bbh math=EleutherAI/hendrycks_math mmlu_pro=TIGER-Lab/MMLU-Pro"""
    hub_split: tuple[str, ...] = ()
    """live, --data hub: a dataset's split, DATASET=SPLIT (one or more); default test"""
    hub_config: tuple[str, ...] = ()
    """live, --data hub: a dataset's hub config, read as one table, DATASET=CONFIG (one or more; not bbh);
    default none (every BBH task and each MATH subject of EleutherAI/hendrycks_math is its own config)"""
    hub_revision: tuple[str, ...] = ()
    """live, --data hub: a dataset's revision (branch, tag or commit), DATASET=REVISION (one or more);
    default the hub's main branch"""

    def run_options(self) -> dict:
        """runner.run's keyword arguments from these flags (how the run is carried out, not what it computes)."""
        return {"lanes": self.lanes, "checkpoint_every": self.checkpoint_every}

    def seed_tuple(self) -> tuple[int, ...]:
        if self.seed_list is not None:
            return tuple(self.seed_list)
        if self.seeds <= 0:
            raise MeshHealError(f"--seeds must be >= 1, got {self.seeds}")
        return tuple(range(self.seeds))


LIVE_KEYS = ("strong_url", "weak_url", "strong_model", "weak_model", "strong_served_name", "weak_served_name",
             "max_in_flight", "strong_max_in_flight", "weak_max_in_flight", "max_tokens", "request_timeout_s", "data", "reasoning_effort", "hub_id", "hub_split", "hub_config",
             "hub_revision", "tokenizer")  # fmt: skip
# the --hub-* keys: the runner.HubSource field each sets and the placeholder its messages show
HUB_KEYS = {"hub_id": ("hub_id", "ID"), "hub_split": ("split", "SPLIT"), "hub_config": ("config", "CONFIG"),
            "hub_revision": ("revision", "REVISION")}  # fmt: skip


def per_dataset(value, source: str, placeholder: str) -> dict[str, str]:
    """{dataset: value} of a --hub-* setting: DATASET=VALUE strings (the flags, or a list of them in
    --live-config) or a TOML table {dataset = value}; `source` names the flag or key in messages."""
    from meshheal_jax.data import DATASETS

    if isinstance(value, dict):
        items = list(value.items())
    else:
        texts = (value,) if isinstance(value, str) else value
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise MeshHealError(f"{source} takes DATASET={placeholder} (one or more), got {value!r}")
        items = []
        for text in texts:
            dataset, sep, given = text.partition("=")
            if not sep:
                raise MeshHealError(f"{source} takes DATASET={placeholder}, e.g. math=..., got {text!r}")
            items.append((dataset.strip(), given))
    out: dict[str, str] = {}
    for dataset, given in items:
        if dataset not in DATASETS:
            raise MeshHealError(f"{source}: unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
        if not isinstance(given, str) or not given.strip():
            raise MeshHealError(f"{source}: {dataset}'s {placeholder} must be non-empty text, got {given!r}")
        if dataset in out:
            raise MeshHealError(f"{source} names {dataset} twice")
        out[dataset] = given.strip()
    return out


def live_settings(flags: CommonFlags):
    """The runner's LiveSettings from --live-config and the live flags (flags win); None when no
    live setting is given at all (the runner then says what --backend live needs)."""
    return _settings(_live_doc(flags), flags)


def _live_doc(flags: CommonFlags) -> dict:
    """The live settings given (--live-config's keys, then the flags), by LIVE_KEYS name."""
    doc: dict = {}
    if flags.live_config is not None:
        text = read_text(flags.live_config, "--live-config")
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise MeshHealError(f"--live-config {flags.live_config} is not valid TOML: {err}") from None
        unknown = sorted(set(doc) - set(LIVE_KEYS))
        if unknown:
            raise MeshHealError(
                f"--live-config {flags.live_config}: unknown keys {unknown}; known: {list(LIVE_KEYS)}"
            )
    for key, value in (("strong_url", flags.strong_url), ("weak_url", flags.weak_url), ("data", flags.data),
                       ("max_tokens", flags.max_tokens), ("request_timeout_s", flags.request_timeout_s),
                       ("strong_model", flags.strong_model),
                       ("weak_model", flags.weak_model), ("reasoning_effort", flags.reasoning_effort),
                       ("tokenizer", flags.tokenizer)):  # fmt: skip
        if value or (
            key in ("max_tokens", "request_timeout_s", "reasoning_effort", "data", "tokenizer")
            and value is not None
        ):  # reach the checks (an empty --data or --tokenizer too: "$DIR" with DIR unset)
            doc[key] = value
    for key, (_, placeholder) in HUB_KEYS.items():  # per dataset: a flag's dataset wins over the file's
        merged = {}
        if key in doc:
            merged = per_dataset(doc[key], f"--live-config {flags.live_config}: {key}", placeholder)
        if getattr(flags, key):
            merged |= per_dataset(getattr(flags, key), "--" + key.replace("_", "-"), placeholder)
        doc.pop(key, None)
        if merged:
            doc[key] = merged
    return doc


def _settings(doc: dict, flags: CommonFlags):
    from meshheal_jax.data import DATASETS
    from meshheal_jax.runner import (
        DEFAULT_REASONING_EFFORT,
        DEFAULT_REQUEST_TIMEOUT_S,
        HubSource,
        LiveSettings,
    )

    if not doc:
        return None
    source = f"--live-config {flags.live_config}" if flags.live_config is not None else "live settings"
    for key in ("max_in_flight", "strong_max_in_flight", "weak_max_in_flight", "max_tokens"):
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise MeshHealError(f"{source}: {key} must be an integer, got {value!r}")
    timeout = doc.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise MeshHealError(f"{source}: request_timeout_s must be a number of seconds, got {timeout!r}")
    for key in ("strong_model", "weak_model", "strong_served_name", "weak_served_name", "data",
                "reasoning_effort", "tokenizer"):  # fmt: skip
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise MeshHealError(f"{source}: {key} must be a string, got {doc[key]!r}")
    if doc.get("tokenizer") is not None and not doc["tokenizer"].strip():  # Path("") is the current folder
        raise MeshHealError(
            f"{source}: tokenizer is empty: give a tokenizer.json, its folder or a hub model id"
        )

    def urls(key: str) -> tuple[str, ...]:
        value = doc.get(key, ())
        values = (value,) if isinstance(value, str) else value
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
            raise MeshHealError(f"{source}: {key} must be a URL or a list of URLs, got {value!r}")
        return tuple(url.strip() for v in values for url in v.split(",") if url.strip())  # a,b or a b

    return LiveSettings(
        strong_urls=urls("strong_url"), weak_urls=urls("weak_url"), strong_model=doc.get("strong_model"),
        weak_model=doc.get("weak_model"), strong_served_name=doc.get("strong_served_name"),
        weak_served_name=doc.get("weak_served_name"), max_in_flight=int(doc.get("max_in_flight", 256)),
        strong_max_in_flight=doc.get("strong_max_in_flight"), weak_max_in_flight=doc.get("weak_max_in_flight"),
        max_tokens=doc.get("max_tokens"), request_timeout_s=float(timeout), data=str(doc.get("data", "hub")),
        reasoning_effort=doc.get("reasoning_effort", DEFAULT_REASONING_EFFORT), tokenizer=_tokenizer(doc),
        hub=tuple(HubSource(dataset, **{field: doc.get(key, {}).get(dataset) for key, (field, _) in HUB_KEYS.items()})
                  for dataset in DATASETS if any(dataset in doc.get(key, {}) for key in HUB_KEYS)),
    )  # fmt: skip


def _tokenizer(doc: dict) -> str | None:
    """--tokenizer as config.json records it: a local file or folder as an absolute path (a resume
    from another folder reads the same one), a hub model id as given."""
    spec = doc.get("tokenizer")
    if spec is None or not Path(spec).expanduser().exists():
        return spec
    return str(Path(spec).expanduser().resolve())


def backend_fields(flags: CommonFlags) -> dict:
    """The Experiment fields of the backend flags (every experiment passes them through). An
    emulated run takes only where its questions come from (--data, with --hub-* for hub) and what
    counts their tokens (--tokenizer); any other live setting given, even at its default, is refused."""
    doc = _live_doc(flags)
    if flags.backend != "live" and doc:
        served = sorted(set(doc) - {"data", "tokenizer", *HUB_KEYS})
        if served:
            raise MeshHealError(f"live server settings were given ({', '.join(served)}) but the backend is "
                                "emulated: add --backend live (an emulated run takes only --data, --hub-* and "
                                "--tokenizer)")  # fmt: skip
        if "data" not in doc and "tokenizer" in doc:
            raise MeshHealError("--tokenizer given to an emulated run without --data: add --data hub, sample or "
                                "a folder, whose questions' tokens it counts")  # fmt: skip
        if "data" not in doc:
            raise MeshHealError("--hub-* settings given to an emulated run without --data: add --data hub "
                                "to count the hub questions' tokens")  # fmt: skip
    return {"backend": flags.backend, "live": _settings(doc, flags)}


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """The project's own warnings as one line (`warning: ...`), as its errors are; others as Python
    formats them."""
    if issubclass(category, MeshHealWarning):
        return f"warning: {message}\n"
    return _PYTHON_FORMATWARNING(message, category, filename, lineno, line)


_PYTHON_FORMATWARNING = warnings.formatwarning


STOPPED = ("stopped: finished streams and MeshHeal's checkpoints (a live run: every reply received, in "
           "responses.sqlite) are kept in the run folder; rerun the same command with --out set to it "
           "(runs/<experiment>-<time> if you gave none) to resume")  # fmt: skip


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a job scheduler), raised where Ctrl-C's KeyboardInterrupt would be, so a
    run stops the same way: checkpoints written, finished streams kept."""


def _terminate(signum, frame) -> None:
    # the run is stopping: a later SIGTERM (coreutils' `timeout` signals the process and then its
    # group) must not cut short what the stop writes (checkpoints, a live call's trace) or waits
    # for (a baseline's running program, decisions R5); a Python no-op rather than SIG_IGN, which
    # child processes would inherit. Ctrl-C (SIGINT) or SIGKILL still end the wait
    signal.signal(signal.SIGTERM, _stopping)
    raise Terminated()


def _stop_dropped(unraisable) -> None:
    """sys.unraisablehook while a command runs. A Ctrl-C or SIGTERM whose exception was raised
    where Python drops exceptions (a garbage-collector callback, which JAX registers; a finaliser;
    a weakref callback: "Exception ignored in") would be lost, and a SIGTERM's later ones ignored:
    the signal is sent again in a moment, from a thread, to be raised where the run can stop.
    Anything else goes to the hook that was there."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        _UNRAISABLE_BEFORE[-1](unraisable)
        return
    signum = signal.SIGINT
    if isinstance(unraisable.exc_value, Terminated):
        signum = signal.SIGTERM
        signal.signal(signal.SIGTERM, _terminate)  # this stop has not started yet
    again = threading.Timer(0.02, os.kill, (os.getpid(), signum))
    again.daemon = True
    again.start()


_UNRAISABLE_BEFORE: list = []  # the hooks guarded replaced, innermost last


def _stopping(signum, frame) -> None:
    """SIGTERM once a stop is under way: nothing more to do."""


def entrypoint(config_type: type, body: Callable, description: str, stopped: str = STOPPED) -> None:
    """Parse flags, run body(config), as `guarded` runs it."""
    guarded(lambda: body(parse_flags(config_type, description)), stopped)


def parse_flags(config_type: type, description: str):
    """The command's config from its flags; the protocol's range checks run after the parser, so a
    bad --protocol.* value is one error line (guarded), not a box of the parser's."""
    with checks_deferred():
        config = tyro.cli(config_type, description=description)
    _check_protocols(config)
    return config


def _check_protocols(value) -> None:
    """Run the checks of every ProtocolParams in a parsed config, at any depth."""
    if isinstance(value, ProtocolParams):
        value.check()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _check_protocols(getattr(value, field.name))


def guarded(main: Callable[[], None], stopped: str = STOPPED) -> None:
    """Run main() (a command: flags parsed inside it) with the project's exits. Its warnings print one
    line each. A MeshHealError (bad input) prints one line and exits with status 2; an OSError (a
    folder that cannot be made, a full disk) one line naming the file, status 1; running out of
    memory one line, status 1; Ctrl-C or SIGTERM one line saying what is kept (`stopped`: by
    default what an experiment's run folder keeps), status 130 or 143. Once a SIGTERM has started
    the stop, later ones are ignored until main() has returned (`_terminate`); a second Ctrl-C
    while batches still run exits at once, without them (`errors.Abandoned`). A stop signalled
    while a garbage-collector callback runs is raised a moment later (`_stop_dropped`)."""
    warnings.formatwarning = _warning_line
    main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    earlier = len(chosen_outs())  # folders chosen before this command (tests run several in one process)
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    _UNRAISABLE_BEFORE.append(sys.unraisablehook)
    sys.unraisablehook = _stop_dropped
    try:
        main()
    except MeshHealError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except MemoryError:
        print("error: out of memory (a network, stream or batch too large for this machine: fewer agents, "
              "seeds, tasks or --slots)", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    except KeyboardInterrupt as err:
        chosen = chosen_outs()[earlier:]  # the folder a command given no --out made: named, not guessed
        print(f"{stopped}; this run's folder: {chosen[0]}" if chosen else stopped, file=sys.stderr)
        status = 143 if isinstance(err, Terminated) else 130
        if isinstance(err, Abandoned):  # batches run on in threads that an exit would wait for
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        sys.exit(status)
    finally:
        if main_thread and before is not None:  # None: a handler set outside Python, left as it is
            signal.signal(signal.SIGTERM, before)
        sys.unraisablehook = _UNRAISABLE_BEFORE.pop()


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
