"""Experiment runner: streams -> engine -> records appended per stream -> summary.

A stream is (method, dataset, pair, seed). MeshHeal streams run on the chosen engine (jax: one
vmapped program per pair; reference: one at a time); a baseline's streams run through
`baselines.run_baseline_frames` (one compiled program per method and pair, its datasets and seeds
vmapped). With the JAX engine these batches run side by side, one thread per core (decisions R5).
Every method sees the same task order, entries and draws for a given (dataset, seed).

A run folder holds config.json, parts/<method>-<dataset>-<pair>-seed<k>/ (one finished stream
each, written atomically), the merged tasks/reviews/states/calls parquet files and summary.json.
Re-running with the same --out resumes: finished streams are kept, the rest run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from rich.progress import Progress

from meshheal_jax import graphs, metrics
from meshheal_jax.config import CHECKPOINT_EVERY_S, ProtocolParams, recorded_protocol
from meshheal_jax.data import (
    DATASETS,
    DEFAULT_HUB_IDS,
    DEFAULT_SPLITS,
    pick_questions,
    question_pool,
    question_tokens,
)
from meshheal_jax.errors import Abandoned, MeshHealError, MeshHealWarning
from meshheal_jax.files import default_out, flush
from meshheal_jax.params import PAIRS, load_pair, model_path
from meshheal_jax.streams import (
    BLOCK_PER_TYPE,
    RECOVERY_PHASES,
    HealthSchedule,
    make_stream,
    persistent_schedule,
    recovery_schedule,
)
from meshheal_jax.topology import Network, build_network, load_profile, profile_path, replicate_holds

if TYPE_CHECKING:
    from meshheal_jax.checkpoints import Checkpoints

TABLES = ("tasks", "reviews", "states", "calls")
RUN_MARKER = "meshheal_run"
BASELINES = ("agentnet", "raps", "autogen", "sac", "symphony")  # == baselines.run.METHODS (tested)
METHODS = ("meshheal", *BASELINES)
# the baselines' model rules (decisions B0, B3), recorded with a run that has baselines, so a resume
# under other rules is refused: == their parameters' defaults (tested); a run folder written before
# the rules were recorded (the twenty-sixth session) ran the earlier ones
BASELINE_RULES = {"raps.judge_rule": "ability", "sac.judge_rule": "ability", "autogen.corrupts": "weak"}
EARLIER_BASELINE_RULES = {"raps.judge_rule": "caller", "sac.judge_rule": "caller", "autogen.corrupts": "both"}
NO_DETECTOR = "none"  # the `detector` of a summary entry for a method without one (the baselines)

Stream = tuple[str, str, str, int]  # (method, dataset, pair, seed)
LOCK_FILE = ".lock"  # in a run folder: held (flock) by the process that runs in it (_exclusive)
DATA_SOURCES = ("hub", "sample")  # live questions: the Hugging Face hub, the packaged sample, or a folder
REASONING_EFFORTS = ("low", "medium", "high")  # gpt-oss's levels, spelt as the OpenAI API spells them
DEFAULT_REASONING_EFFORT = "medium"  # spec/live.md (== backends.live.DEFAULT_REASONING_EFFORT, tested)
DEFAULT_REQUEST_TIMEOUT_S = 900.0  # == backends.live.RetryPolicy's default (tested)


@dataclasses.dataclass(frozen=True)
class HubSource:
    """Where `--data hub` reads one dataset: data.load_hub's hub_id, split, config and revision
    (None: load_hub's default; `resolved` fills in the id and split it would use)."""

    dataset: str  # bbh | math | mmlu_pro
    hub_id: str | None = None  # default data.DEFAULT_HUB_IDS
    split: str | None = None  # default data.DEFAULT_SPLITS
    config: str | None = None  # None: no config, or one per task type (BBH, EleutherAI/hendrycks_math)
    revision: str | None = None  # None: the hub's main branch
    commit: str | None = None  # a resumed folder's recorded commit (`at_commits`); not a setting

    def resolved(self) -> HubSource:
        return dataclasses.replace(self, hub_id=self.hub_id or DEFAULT_HUB_IDS.get(self.dataset),
                                   split=self.split or DEFAULT_SPLITS.get(self.dataset))  # fmt: skip

    def fields(self) -> dict:
        """What config.json records of it, under live.hub.<dataset>."""
        return {"hub_id": self.hub_id, "split": self.split, "config": self.config, "revision": self.revision}


@dataclasses.dataclass(frozen=True)
class LiveSettings:
    """Where the live backend's two models are served and what it asks them (spec/live.md).

    The URLs are where, not what: a resumed run may find its servers on other ports, so they are
    left out when a run folder's configuration is compared (`comparable`)."""

    strong_urls: tuple[str, ...]
    weak_urls: tuple[str, ...]
    strong_model: str | None = None  # the served model's real id; None: read from /v1/models
    weak_model: str | None = None
    strong_served_name: str | None = None  # the name the server serves the model under; None: the role
    weak_served_name: str | None = None  # (serving/vllm_pair.sh serves them as "strong" and "weak")
    max_in_flight: int = 256  # per server (serving/vllm_pair.sh's --max-num-seqs)
    # per server of one role, where it differs: a vLLM server with --data-parallel-size D runs D
    # engines of --max-num-seqs each behind one URL (None: max_in_flight)
    strong_max_in_flight: int | None = None
    weak_max_in_flight: int | None = None
    max_tokens: int | None = None  # cap on every call's max_completion_tokens (None: live_loop defaults)
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # one HTTP call, before it is retried (RetryPolicy)
    data: str = "hub"  # questions: hub | sample | a folder of local benchmark files
    reasoning_effort: str = DEFAULT_REASONING_EFFORT  # sent to gpt-oss models only (spec/live.md)
    hub: tuple[HubSource, ...] = ()  # --data hub: the datasets not read from load_hub's defaults
    tokenizer: str | None = (
        None  # emulated --data: counts question tokens (data.load_tokenizer); None: chars / 4
    )

    def __post_init__(self) -> None:
        hub = self.hub  # config.json's form too: {dataset: {hub_id, split, config, revision}}
        items = [HubSource(d, **fields) for d, fields in hub.items()] if isinstance(hub, Mapping) else hub
        object.__setattr__(self, "hub", tuple(HubSource(**h) if isinstance(h, Mapping) else h for h in items))

    def questions_only(self) -> bool:
        """Only where the questions come from (--data, --hub-*) and what counts their tokens
        (--tokenizer) are set: all an emulated run takes (spec/emulator.md)."""
        return self == LiveSettings((), (), data=self.data, hub=self.hub, tokenizer=self.tokenizer)

    def validate(self) -> None:
        for role, urls in (("strong", self.strong_urls), ("weak", self.weak_urls)):
            if not urls:
                raise MeshHealError(f"--backend live needs the {role} model's server: --{role}-url URL "
                                    "(or a --live-config file); start them with serving/vllm_pair.sh")  # fmt: skip
        for key in ("max_in_flight", "strong_max_in_flight", "weak_max_in_flight"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise MeshHealError(f"live: {key} must be >= 1, got {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise MeshHealError(f"live: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 < self.request_timeout_s < float("inf"):
            raise MeshHealError(f"live: request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise MeshHealError(f"live: --reasoning-effort (reasoning_effort) must be one of "
                                f"{', '.join(REASONING_EFFORTS)}, got {self.reasoning_effort!r}")  # fmt: skip
        if self.tokenizer is not None:
            raise MeshHealError("--tokenizer counts an emulated run's question tokens; a live run's token "
                                "counts are the servers' usage")  # fmt: skip
        self.validate_questions()

    def validate_questions(self) -> None:
        """The checks of where the questions come from (data, hub), which emulated runs share."""
        if not self.data.strip():  # Path("") is the current folder: never read it unasked
            raise MeshHealError("--data is empty: give hub, sample or a folder of benchmark files")
        if self.data not in DATA_SOURCES and not Path(self.data).expanduser().exists():
            raise MeshHealError(f"--data must be hub, sample or an existing folder of benchmark files; "
                                f"{self.data!r} does not exist")  # fmt: skip
        if self.hub and self.data != "hub":
            raise MeshHealError(f"--hub-id, --hub-split, --hub-config and --hub-revision apply to --data hub, "
                                f"not --data {self.data}")  # fmt: skip
        datasets = [source.dataset for source in self.hub]
        for source in self.hub:
            if source.dataset not in DATASETS:
                raise MeshHealError(f"--hub-*: unknown dataset {source.dataset!r}; "
                                    f"known: {', '.join(DATASETS)}")  # fmt: skip
            if datasets.count(source.dataset) > 1:
                raise MeshHealError(f"the hub settings name {source.dataset} twice")
            if source.dataset == "bbh" and source.config is not None:
                raise MeshHealError(f"--hub-config bbh={source.config}: BBH is read one config per task "
                                    "type (as lukaemon/bbh keeps it); give no config for bbh")  # fmt: skip
        if self.tokenizer is not None:
            from meshheal_jax.data import load_tokenizer

            load_tokenizer(self.tokenizer)  # a bad one fails before anything is written

    def hub_source(self, dataset: str) -> HubSource:
        """Where `--data hub` reads `dataset`: the settings given for it, else load_hub's defaults."""
        given = next((source for source in self.hub if source.dataset == dataset), HubSource(dataset))
        return given.resolved()

    def at_commits(self, commits: Mapping[str, str]) -> LiveSettings:
        """These settings, reading each dataset of `commits` at that hub commit (HubSource.commit)
        instead of asking where its revision points now."""
        given = {source.dataset: source for source in self.hub}
        pinned = tuple(dataclasses.replace(given.get(d, HubSource(d)), commit=c) for d, c in commits.items())
        return dataclasses.replace(self, hub=(*(s for s in self.hub if s.dataset not in commits), *pinned))

    def hub_record(self, datasets: Sequence[str]) -> dict:
        """config.json's live.hub: where each dataset of the run is read from the hub (none unless --data hub)."""
        return {d: self.hub_source(d).fields() for d in datasets} if self.data == "hub" else {}

    def questions(self, dataset: str, profiles_dir: Path | None):
        """The benchmark records the live streams ask (data.load_hub / load_sample / load_local)."""
        from meshheal_jax import data

        profile = load_profile(dataset, profiles_dir)
        if self.data == "hub":
            source = self.hub_source(dataset)
            revision = hub_commit(self, dataset) or source.revision  # the commit, when the hub can be asked
            return data.load_hub(dataset, hub_id=source.hub_id, split=source.split, profile=profile,
                                 config=source.config, revision=revision)  # fmt: skip
        if self.data == "sample":
            return data.load_sample(dataset, profile)
        return data.load_local(dataset, self.data, profile)

    def in_flight(self, role: str) -> int:
        """Requests in flight per server of `role`: its own setting, else max_in_flight."""
        own = self.strong_max_in_flight if role == "strong" else self.weak_max_in_flight
        return self.max_in_flight if own is None else own

    def config(self, cache_path: Path, pair: str | None = None, params_dir: Path | None = None):
        """The live client's settings; with `pair`, its model files' ids are checked against the
        models the servers serve (a warning, live_loop.check_pair_models)."""
        from meshheal_jax.backends.live import RetryPolicy, ServerGroup
        from meshheal_jax.backends.live_loop import LiveConfig

        expected = None
        if pair is not None:
            models = load_pair(pair, params_dir)
            expected = (pair, {"strong": models.strong.model, "weak": models.weak.model})
        return LiveConfig(
            retry=RetryPolicy(request_timeout_s=self.request_timeout_s),
            servers=(ServerGroup("strong", self.strong_urls, self.strong_model, self.strong_served_name,
                           max_in_flight=self.in_flight("strong"), gpt_oss_effort=self.reasoning_effort),
                     ServerGroup("weak", self.weak_urls, self.weak_model, self.weak_served_name,
                           max_in_flight=self.in_flight("weak"), gpt_oss_effort=self.reasoning_effort)),
            cache_path=cache_path,
            pair=expected,
        )  # fmt: skip

    def options(self):
        from meshheal_jax.backends.live_loop import DEFAULT_MAX_COMPLETION_TOKENS, LiveOptions

        cap = self.max_tokens or max(DEFAULT_MAX_COMPLETION_TOKENS.values())
        return LiveOptions(
            max_completion_tokens={k: min(v, cap) for k, v in DEFAULT_MAX_COMPLETION_TOKENS.items()}
        )


class ProfileIdWarning(MeshHealWarning):
    """Datasets of one run whose profiles share a dataset_id: their streams draw the same numbers."""


class PhaseMixWarning(MeshHealWarning):
    """A stream length whose phases are not whole balanced blocks: the phases' type mixes differ."""


class NoHealthyHolderWarning(MeshHealWarning):
    """--degraded names every holder of an ability: once they degrade, no healthy agent holds it."""


def profile_targets(datasets: Sequence[str], profiles_dir: Path | None = None) -> tuple[int, ...]:
    """The profiles' A3/A5 (`degraded_targets`, 0-based), one pair for every dataset of a run."""
    check_names("datasets", datasets)
    targets = {d: load_profile(d, profiles_dir).degraded_targets for d in datasets}
    if len(set(targets.values())) > 1:
        raise MeshHealError(
            f"the profiles name different degraded_targets ({targets}): give --degraded, or run the "
            "datasets apart"
        )
    return targets[datasets[0]]


def check_names(what: str, names: Sequence[str]) -> None:
    """A run's datasets or pairs: at least one, distinct, each a bare name (a dataset names
    `<profiles dir>/<name>.toml`; the name also names the run folder's parts, so no paths)."""
    if not names:
        raise MeshHealError(f"no {what} given")
    if len(set(names)) != len(names):
        raise MeshHealError(f"{what} must be distinct, got {list(names)}")
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", name):
            raise MeshHealError(
                f"{what}: {name!r} is not a name (letters, digits, _ -); a profile of your own goes in "
                "--profiles-dir DIR as DIR/<dataset>.toml"
            )


def degraded_or_targets(
    degraded: Sequence[int] | None, datasets: Sequence[str], profiles_dir: Path | None = None
) -> tuple[int, ...]:
    """A 6-agent command's --degraded as given, else its profiles' A3/A5."""
    return tuple(degraded) if degraded is not None else profile_targets(datasets, profiles_dir)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """What one experiment runs: its streams and schedule (built per dataset)."""

    name: str  # "main" | "recovery"
    datasets: tuple[str, ...]
    pairs: tuple[str, ...]
    seeds: tuple[int, ...]
    methods: tuple[str, ...] = ("meshheal",)  # METHODS, in the order the tables show them
    engine: str = "jax"  # MeshHeal's engine; baselines always run their own vmapped JAX program
    slots: int = 1  # in-flight tasks per stream (jax engine; 1 = the paper's sequential semantics)
    backend: str = "emulated"  # emulated | live (MeshHeal only, jax engine; `live` says where the models are)
    live: LiveSettings | None = None
    n_agents: int = 6
    n_tasks: int = 504
    degraded: tuple[int, ...] | None = (2, 4)  # degraded from the midpoint; None = A3/A5 of every replica
    topology: str = "complete"  # complete | sparse (graphs.sparse_edges) | file (edges_file)
    graph_seed: int = 0
    edges_file: Path | None = None
    tables: tuple[str, ...] = ("tasks", "reviews", "states", "calls")  # record tables kept
    protocol: ProtocolParams = ProtocolParams()  # noqa: RUF009 (frozen: a shared default is safe)
    profiles_dir: Path | None = None
    params_dir: Path | None = None

    def validate(self) -> None:
        check_names("datasets", self.datasets)
        check_names("pairs", self.pairs)
        if not 0 <= self.graph_seed < 2**63:
            raise MeshHealError(f"--graph-seed must be in 0..2**63-1, got {self.graph_seed}")
        if not self.methods:
            raise MeshHealError("no methods given")
        for method in self.methods:
            if method not in METHODS:
                raise MeshHealError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise MeshHealError(f"methods must be distinct, got {list(self.methods)}")
        if not 1 <= self.slots <= max(self.n_agents // 6, 1):
            raise MeshHealError(
                f"slots must be in 1..{max(self.n_agents // 6, 1)} (at most N/6), got {self.slots}"
            )
        if self.baselines() and self.slots != 1:
            raise MeshHealError(
                "baselines run one task at a time: use --slots 1 (or only --methods meshheal)"
            )
        if not self.seeds:
            raise MeshHealError("no seeds given")
        if any(not 0 <= s < 2**31 for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            raise MeshHealError(f"seeds must be distinct and in 0..2**31-1, got {list(self.seeds)}")
        if self.engine not in ("jax", "reference"):
            raise MeshHealError(f"unknown engine {self.engine!r}; known: jax, reference")
        if self.engine == "reference" and self.slots != 1:
            raise MeshHealError("the reference engine runs one task at a time: use --slots 1 or --engine jax")
        if self.topology not in ("complete", "sparse", "file") or (self.topology == "file") != (
            self.edges_file is not None
        ):
            raise MeshHealError(
                f"topology must be complete, sparse, or file with an edges file; got {self.topology!r}"
            )
        if self.n_agents % 6 or self.n_agents <= 0:
            raise MeshHealError(f"agents must be a positive multiple of 6, got {self.n_agents}")
        if self.topology == "complete" and self.n_agents > 2304:
            raise MeshHealError(
                f"a complete graph of {self.n_agents} agents is not supported (at most 2,304); use --sparse"
            )
        if not set(self.tables) <= set(TABLES) or not {"tasks", "states"} <= set(self.tables):
            raise MeshHealError(
                f"tables must include tasks and states (the detection and false-isolation figures are read "
                f"from the state changes) and be among {TABLES}, got {self.tables}"
            )
        if self.backend not in ("emulated", "live"):
            raise MeshHealError(f"unknown backend {self.backend!r}; known: emulated, live")
        if self.backend == "live":
            if self.live is None:
                raise MeshHealError(
                    "--backend live needs --strong-url and --weak-url (or --live-config FILE)"
                )
            self.live.validate()
            if self.engine != "jax":
                raise MeshHealError("the live backend drives the jax engine's controller: use --engine jax")
        elif self.live is not None:
            if not self.live.questions_only():
                raise MeshHealError(
                    "live server settings were given but the backend is emulated: add --backend live "
                    "(an emulated run takes only --data, --hub-* and --tokenizer, to count its questions' tokens)"
                )
            self.live.validate_questions()
        for dataset in self.datasets if self.live is not None else ():  # read now (kept for the run):
            read_questions(self.live, dataset, self.profiles_dir)  # a bad source writes nothing
        profiles = [load_profile(dataset, self.profiles_dir) for dataset in self.datasets]
        ids = [profile.dataset_id for profile in profiles]
        if len(set(ids)) != len(ids):  # a task's draws are keyed by (seed, dataset_id, t)
            warnings.warn(ProfileIdWarning(
                f"profiles share a dataset_id ({dict(zip(self.datasets, ids))}): their streams draw the same "
                "numbers (common random numbers: fine for comparing an edited profile with its original)"
            ), stacklevel=2)  # fmt: skip
        for pair in self.pairs:  # every model file has a p_part for every dataset's task types
            loaded = load_pair(pair, self.params_dir)
            if (
                self.engine == "jax" or self.baselines()
            ) and loaded.strong.n_distractors != loaded.weak.n_distractors:
                raise MeshHealError(  # the reference engine draws each model's own
                    f"pair {pair}: the jax engine and the baselines need the same n_distractors in both model "
                    f"files ({loaded.strong.name}: {loaded.strong.n_distractors}, {loaded.weak.name}: "
                    f"{loaded.weak.n_distractors}); use --engine reference --methods meshheal"
                )
            for profile in profiles:
                for model in (loaded.strong, loaded.weak):
                    model.p_part_base(profile)
        if self.engine == "jax" and "meshheal" in self.methods:  # all its streams are held side by side
            shapes = [(len(profile.task_types), len(profile.abilities)) for profile in profiles]
            check_window_memory(self.protocol, self.n_agents, shapes, len(self.seeds) * len(self.pairs))
        if self.n_tasks < 1:
            raise MeshHealError(f"tasks per stream must be >= 1, got {self.n_tasks}")
        if self.name == "recovery":  # five equal phases of whole blocks: say the one number that fits
            for profile in profiles:
                block = BLOCK_PER_TYPE * len(profile.task_types)
                if self.n_tasks % (5 * block):
                    raise MeshHealError(
                        f"the recovery stream's length must be a positive multiple of {5 * block} (five equal "
                        f"phases of whole blocks of {block} tasks, 6 per {profile.dataset} task type), "
                        f"got {self.n_tasks}"
                    )
        degraded = self.schedule().ever_degraded()
        for dataset in self.datasets:
            network = self.network(dataset)
            # --degraded may name any agents (decisions X9): say so where an ability loses every healthy holder
            lost = [
                network.profile.abilities[s] for s in np.flatnonzero(~network.holds[~degraded].any(axis=0))
            ]
            if lost:
                warnings.warn(NoHealthyHolderWarning(
                    f"{dataset}: the degraded agents {np.flatnonzero(degraded).tolist()} hold every copy of "
                    f"{', '.join(map(repr, lost))}: while they are degraded no healthy agent holds it (max ability "
                    "distance unreachable)"
                ), stacklevel=2)  # fmt: skip
        starts, names = self.phases()
        for profile in profiles:  # stream length and phases, before anything is written
            n_types = len(profile.task_types)
            make_stream(0, 0, self.n_tasks, n_types, starts, names)
            # every phase whole balanced blocks: the same type mix in each (spec/experiments.md)
            block = BLOCK_PER_TYPE * n_types
            if any((start - 1) % block for start in starts):
                warnings.warn(
                    PhaseMixWarning(
                        f"--tasks {self.n_tasks} splits into {len(starts)} phases starting at tasks "
                        f"{list(starts)}, not whole blocks of {block} tasks (6 per type): the phases' "
                        f"task-type mixes differ; a multiple of {block * len(starts)} keeps them equal"
                    ),
                    stacklevel=2,
                )

    def schedule(self) -> HealthSchedule:
        if self.name == "recovery":
            if self.n_agents != 6:
                raise MeshHealError("the recovery schedule is defined for the 6-agent network")
            targets = degraded_or_targets(self.degraded, self.datasets, self.profiles_dir)
            if len(targets) != 2:
                raise MeshHealError(
                    f"the recovery schedule degrades two agents (A3, A5), got {list(targets)}"
                )
            a3, a5 = targets
            return recovery_schedule(self.n_tasks, a3=a3, a5=a5)
        degraded = self.degraded
        if degraded is None:
            targets = profile_targets(self.datasets, self.profiles_dir)
            degraded = tuple(r * 6 + a for r in range(self.n_agents // 6) for a in targets)
        return persistent_schedule(self.n_agents, self.n_tasks, tuple(sorted(degraded)))

    def network(self, dataset: str) -> Network:
        """The dataset's replicated profile over the experiment's graph (checked; cached)."""
        return _network(
            self.n_agents, self.topology, self.graph_seed, self.edges_file, dataset, self.profiles_dir
        )

    def phases(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if self.name == "recovery":
            p = self.n_tasks // 5
            return tuple(1 + k * p for k in range(5)), RECOVERY_PHASES
        return (1, self.n_tasks // 2 + 1), ("healthy", "degraded")

    @property
    def method(self) -> str:
        """The method of a one-method experiment (for callers written before `methods`)."""
        if len(self.methods) != 1:
            raise MeshHealError(f"this experiment runs several methods: {list(self.methods)}")
        return self.methods[0]

    def baselines(self) -> tuple[str, ...]:
        return tuple(m for m in self.methods if m != "meshheal")

    def streams(self) -> list[Stream]:
        return [
            (m, d, p, s) for m in self.methods for d in self.datasets for p in self.pairs for s in self.seeds
        ]

    def labels(self, method: str) -> dict:
        """The variant and detector a method's summary entries carry."""
        if method == "meshheal":
            return {"variant": getattr(self.protocol, "variant", "full"),
                    "detector": getattr(self.protocol, "detector", "relative")}  # fmt: skip
        return {"variant": "full", "detector": NO_DETECTOR}

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)  # (live settings become a nested dict)
        out["protocol"] = dataclasses.asdict(self.protocol)
        for key in PATH_SETTINGS:
            out[key] = None if out[key] is None else str(out[key])
        if self.live is not None:  # the hub sources of this run's datasets, defaults filled in
            out["live"]["hub"] = self.live.hub_record(self.datasets)
        if self.baselines():
            out["baseline_rules"] = dict(BASELINE_RULES)
        return out


@functools.lru_cache(maxsize=16)
def _network(n_agents: int, topology: str, graph_seed: int, edges_file: Path | None, dataset: str,
             profiles_dir: Path | None) -> Network:  # fmt: skip
    profile = load_profile(dataset, profiles_dir)
    if topology == "complete":
        return build_network(profile, n_agents)
    holds = replicate_holds(profile, n_agents)
    degraded = graphs.degraded_mask(profile.degraded_targets, n_agents)
    if topology == "sparse":
        edges = graphs.sparse_edges(holds, degraded, graph_seed, ability_names=profile.abilities)
    else:
        edges = graphs.load_edge_list(edges_file, n_agents)
    graphs.check_requirements(holds, degraded, edges, ability_names=profile.abilities)
    return build_network(profile, n_agents, edges=edges)


def _git_revision() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions() -> dict:
    out = {}
    for pkg in ("meshheal_jax", "jax", "jaxlib", "numpy", "polars", "tyro"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary file and a rename, so a crash never leaves it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


_LOST_CONFIG = ("; to resume, restore its config.json (the one the same command writes into a new folder "
                "serves), or choose another --out; {out} is left as it is")  # fmt: skip


def _previous_config(out: Path) -> dict:
    """The config.json of an existing run folder, or a one-line error naming what is wrong with it
    (unreadable, not JSON, not a run's layout)."""
    hint = _LOST_CONFIG.format(out=out) if (out / "parts").is_dir() else ""
    try:
        previous = json.loads((out / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise MeshHealError(f"output folder {out} has an unreadable config.json{hint}") from None
    if not isinstance(previous, dict):
        raise MeshHealError(
            f"output folder {out} has an unreadable config.json (JSON, but not an object){hint}"
        )
    if not previous.get(RUN_MARKER):
        raise MeshHealError(f"output folder {out} exists and is not a run folder")
    inputs = previous.get("inputs", {})
    if not isinstance(previous.get("experiment"), dict) or not (
        isinstance(inputs, dict)
        and all(isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in inputs.values())
    ):
        raise MeshHealError(f"output folder {out} has a damaged config.json (its experiment or inputs){hint}")
    return previous


def check_run_dir(exp: Experiment, out: Path) -> dict | None:
    """Whether `out` may hold `exp`'s run, writing nothing: None for a folder to create (absent or
    empty), the recorded config.json for a resume of the same experiment; a one-line error for
    anything else (another configuration, other input contents, not a run folder). A command of
    several arms checks every arm's folder with it before any arm runs."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise MeshHealError(f"output path {out} exists and is not a folder")
    if not (out / "config.json").exists():
        kept = [what for what, name in (("finished streams (parts/)", "parts"), ("checkpoints (checkpoints/)",
                "checkpoints")) if (out / name).is_dir()]  # fmt: skip
        if kept:
            raise MeshHealError(f"output folder {out} holds {' and '.join(kept)} but no config.json"
                                f"{_LOST_CONFIG.format(out=out)}")  # fmt: skip
        # config.json.tmp alone: a run killed while writing its first config (write_atomic) is a new one
        if any(path.name not in ("config.json.tmp", LOCK_FILE) for path in out.iterdir()):
            raise MeshHealError(f"output folder {out} exists and is not a run folder")
        return None
    previous = _previous_config(out)
    if "methods" not in previous["experiment"]:
        raise MeshHealError(
            f"output folder {out} holds a run of an older layout (one method, parts without the method); "
            "choose another --out"
        )  # fmt: skip
    settings = changed_values(previous["experiment"], exp)
    if settings:
        names = ", ".join(key for key, _, _ in settings[:6])
        # baseline_rules follow from the methods: shown only where nothing else differs
        shown = ([s for s in settings if not s[0].startswith("baseline_rules.")] or settings)[:3]
        reordered = [key for key, a, b in settings if _reordered(a, b)]
        hint = (f" ({', '.join(reordered)}: the same values in another order; give them in the recorded order, "
                "which is the order the runs and tables follow)" if reordered else "")  # fmt: skip
        raise MeshHealError(
            f"output folder {out} holds a run of a different configuration ({names} differ); choose another --out"
            f"{_no_work_yet(out)}; recorded {_settings_text(shown, 1)}, given {_settings_text(shown, 2)}{hint}"
        )
    inputs = input_digests(exp)
    changed = [
        f"{role} ({entry['path']})"
        for role, entry in inputs.items()
        if role in previous.get("inputs", {}) and previous["inputs"][role]["sha256"] != entry["sha256"]
    ]
    if changed:  # finished streams were made from the old contents: mixing them is wrong
        raise MeshHealError(
            f"output folder {out} was run with other contents of {', '.join(changed)}; "
            "choose another --out, or restore the file(s) to resume"
        )
    return previous


def _settings_text(changed: list[tuple], side: int) -> str:
    """One side (1 recorded, 2 given) of changed_values' triples as key=value, long values cut."""
    values = ((c[0], json.dumps(c[side])) for c in changed)
    return ", ".join(f"{key}={text if len(text) <= 60 else text[:57] + '...'}" for key, text in values)


def _reordered(recorded: object, given: object) -> bool:
    """Two different lists of the same values (--methods, --seed-list, --degraded given in another order)."""
    if not (isinstance(recorded, list) and isinstance(given, list)) or recorded == given:
        return False
    return sorted(map(json.dumps, recorded)) == sorted(map(json.dumps, given))


def _no_work_yet(out: Path) -> str:
    """For a refusal: that a folder holds nothing to lose (a run stopped before its first stream,
    checkpoint or model reply, e.g. a live run whose server check failed), so deleting it is safe."""
    started = any((out / name).is_dir() and any((out / name).iterdir()) for name in ("parts", "checkpoints"))
    if started or (out / "summary.json").exists() or cached_replies(out) != 0:
        return ""  # (a cache it cannot read may hold replies)
    return " (it holds no finished stream, checkpoint or model reply yet: deleting it loses nothing)"


def check_arm_folders(out: Path, experiments: dict[str, Experiment]) -> None:
    """A command of several arms (ablate, detectors, scale): every arm's configuration and its folder
    out/<arm> checked before any arm runs, so a rerun at other settings runs nothing (a resume reads
    its recorded commits, as `run` does)."""
    for key, exp in experiments.items():
        exp = with_recorded_commits(exp, out / key)
        exp.validate()
        check_run_dir(exp, out / key)


def check_window_memory(
    protocol: ProtocolParams, n_agents: int, shapes: list[tuple[int, int]], streams_per_dataset: int
) -> None:
    """The jax engine holds every detector window in full from the start: N x types x abilities x
    (window_scores + window_shortfalls) float64 per stream, and a run's MeshHeal streams (every
    dataset, seed and pair: `shapes` is each dataset's (types, abilities)) side by side. A run whose
    windows alone would not fit in this machine's memory is refused here; it would otherwise stall
    in the allocator. (A lower bound: the rest of the state, and XLA's copies, come on top.)"""
    width = protocol.window_scores + protocol.window_shortfalls
    needed = (
        sum(8 * n_agents * types * abilities * width for types, abilities in shapes) * streams_per_dataset
    )
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no check
        return
    if needed > memory:
        n_streams = len(shapes) * streams_per_dataset
        raise MeshHealError(
            f"window_scores={protocol.window_scores} and window_shortfalls={protocol.window_shortfalls}: the "
            f"detector's windows of the {n_streams} MeshHeal stream(s) held side by side would take "
            f"{needed / 2**30:,.1f} GiB (per stream: {n_agents} agents x task types x abilities x {width} x 8 "
            f"bytes); this machine has {memory / 2**30:,.1f} GiB"
        )


def prepare_run_dir(exp: Experiment, out: Path | None) -> Path:
    """Create a new run folder, or reopen one holding the same experiment (resume)."""
    if out is None:
        out = default_out(exp.name)
    config_path = out / "config.json"
    previous = check_run_dir(exp, out)
    if previous is not None:
        if "inputs" not in previous:  # a folder made before inputs were kept: from now on
            write_atomic(config_path, json.dumps({**previous, "inputs": input_digests(exp)}, indent=2))
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {RUN_MARKER: True, "experiment": exp.to_json(), "inputs": input_digests(exp), "versions": _versions(),
              "git_revision": _git_revision(), "created": datetime.datetime.now().isoformat()}  # fmt: skip
    write_atomic(config_path, json.dumps(config, indent=2))
    return out


def input_digests(exp: Experiment) -> dict[str, dict]:
    """Every input file the run reads (profiles, emulator model files, an edge list; an emulated
    or live run's questions, as the records read), by role: its path and the sha256 of its
    contents. A resumed run must read what the finished streams were made from; the folder paths
    alone are in the configuration, not what the files hold. A live run's model files are left
    out: its calls go to the servers, no emulator number is read."""
    files = {f"profile {d}": profile_path(d, exp.profiles_dir) for d in exp.datasets}
    for pair in exp.pairs if exp.backend != "live" else ():  # live calls read no emulator numbers
        files |= {f"model file {m}": model_path(m, exp.params_dir) for m in PAIRS[pair]}
    if exp.edges_file is not None:
        files["edge list"] = Path(exp.edges_file)
    out = {role: {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
           for role, path in files.items()}  # fmt: skip
    if exp.live is not None:  # the questions asked (live) or whose texts count their tokens (emulated --data)
        for d in exp.datasets:
            records = read_questions(exp.live, d, exp.profiles_dir)
            text = json.dumps([(r.question, r.task_type, r.options, r.gold) for r in records])
            out[f"questions {d}"] = {
                "path": exp.live.data,
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
            if exp.live.data == "hub":  # the commit read (None: the hub could not be asked)
                out[f"questions {d}"]["commit"] = hub_commit(exp.live, d)
        if exp.live.tokenizer is not None:  # what counts the questions' tokens (emulated --tokenizer)
            from meshheal_jax.data import load_tokenizer

            text = load_tokenizer(exp.live.tokenizer).to_str()
            out["tokenizer"] = {
                "path": exp.live.tokenizer,
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
    return out


def changed_settings(recorded: dict | None, exp: Experiment) -> list[str]:
    """The settings (dotted keys) in which `exp` differs from a run folder's recorded experiment
    (those that change results: `comparable`; a key missing before reads as None)."""
    return [key for key, _, _ in changed_values(recorded, exp)]


def changed_values(recorded: dict | None, exp: Experiment) -> list[tuple[str, object, object]]:
    """changed_settings with each setting's recorded and given value: (key, recorded, given)."""
    return differences(comparable(recorded) or {}, comparable(json.loads(json.dumps(exp.to_json()))) or {})


def differences(before: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, before, now) of each value that differs between two configurations."""
    out = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if dict in (type(a), type(b)) and all(isinstance(x, dict | None) for x in (a, b)):
            out += differences(a or {}, b or {}, f"{prefix}{key}.")  # a table given once: its keys
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


# live settings that change how a run talks to its servers, not what it computes
NOT_COMPARED = ("strong_urls", "weak_urls", "max_in_flight", "strong_max_in_flight", "weak_max_in_flight",
                "request_timeout_s")  # fmt: skip


PATH_SETTINGS = ("profiles_dir", "params_dir", "edges_file")


def _same_path(path: str) -> str:
    """A recorded path as the file it names from here (a relative one: from the current folder)."""
    return str(Path(path).expanduser().resolve())


def comparable(experiment: dict | None) -> dict | None:
    """A run configuration without what does not change results (the live servers' URLs). A folder
    written before a protocol field existed (next_hop_ties), or a live one before reasoning_effort
    and the hub sources were recorded, ran with their defaults; one with baselines written before
    their model rules were recorded ran EARLIER_BASELINE_RULES. Paths compare as the files they
    name (`--edges e.csv` and its absolute path are one setting; their contents are compared apart,
    input_digests)."""
    if experiment:
        experiment = {**experiment, **{key: _same_path(experiment[key]) for key in PATH_SETTINGS
                                       if isinstance(experiment.get(key), str)}}  # fmt: skip
    if experiment and isinstance(experiment.get("protocol"), dict):
        experiment = {**experiment, "protocol": recorded_protocol(experiment["protocol"])}
    if experiment and any(m != "meshheal" for m in experiment.get("methods") or ()):
        experiment = {"baseline_rules": dict(EARLIER_BASELINE_RULES), **experiment}
    if not experiment or not experiment.get("live"):
        return experiment
    live = {k: v for k, v in experiment["live"].items() if k not in NOT_COMPARED}
    if isinstance(live.get("data"), str) and live["data"] not in DATA_SOURCES:  # a folder of files
        live["data"] = _same_path(live["data"])
    live.setdefault("reasoning_effort", DEFAULT_REASONING_EFFORT)
    if "hub" not in live:
        defaults = LiveSettings((), (), data=live.get("data", "hub"))
        live["hub"] = defaults.hub_record(experiment.get("datasets", ()))
    return {**experiment, "live": live}


def _part_dir(run_dir: Path, method: str, dataset: str, pair: str, seed: int) -> Path:
    return run_dir / "parts" / f"{method}-{dataset}-{pair}-seed{seed}"


def _checkpoint_dir(run_dir: Path, method: str, dataset: str, pair: str, seed: int) -> Path:
    return run_dir / "checkpoints" / _part_dir(run_dir, method, dataset, pair, seed).name


def _stream_inputs(exp: Experiment, dataset: str, pair_name: str, seed: int, method: str = "meshheal"):
    profile = load_profile(dataset, exp.profiles_dir)
    network = exp.network(dataset)
    starts, names = exp.phases()
    stream = make_stream(seed, profile.dataset_id, exp.n_tasks, len(profile.task_types), starts, names)
    if exp.backend == "emulated" and exp.live is not None:  # --data: the real questions' token counts
        stream = with_question_tokens(stream, *_pool_tokens(exp.live, dataset, exp.profiles_dir))
    labels = {"method": method, "dataset": dataset, "pair": pair_name, "seed": seed}
    return network, stream, load_pair(pair_name, exp.params_dir), labels


@functools.lru_cache(maxsize=8)
def hub_commit(source: LiveSettings, dataset: str) -> str | None:
    """The hub commit `--data hub` reads `dataset` at (data.hub_commit of its id and revision), asked
    once per process: the questions are read at it and config.json's inputs record it."""
    from meshheal_jax import data

    hub = source.hub_source(dataset)
    return hub.commit or data.hub_commit(hub.hub_id, hub.revision)


def with_recorded_commits(exp: Experiment, out: Path | None) -> Experiment:
    """`exp`, reading each `--data hub` dataset at the commit its run folder `out` recorded
    (config.json's inputs), when there is one: a resume reads what the finished streams were made
    from, wherever the branch points now (docs/decisions.md L5). Only a folder holding the same
    experiment is read; another, and anything unreadable, is left to prepare_run_dir to name."""
    if out is None or exp.live is None or exp.live.data != "hub":
        return exp
    try:
        config = json.loads((Path(out) / "config.json").read_text())
        if changed_settings(config["experiment"], exp):
            return exp
        commits = {d: config["inputs"].get(f"questions {d}", {}).get("commit") for d in exp.datasets}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return exp
    commits = {d: c for d, c in commits.items() if isinstance(c, str)}
    return dataclasses.replace(exp, live=exp.live.at_commits(commits)) if commits else exp


@functools.lru_cache(maxsize=8)
def read_questions(source: LiveSettings, dataset: str, profiles_dir: Path | None) -> tuple:
    """A run's questions of one dataset (LiveSettings.questions), read once per process: when the
    run is validated, then for its input digests and every batch of its streams."""
    return tuple(source.questions(dataset, profiles_dir))


@functools.lru_cache(maxsize=8)
def _pool_tokens(source: LiveSettings, dataset: str, profiles_dir: Path | None) -> tuple[tuple, tuple]:
    """One dataset's question pool (data.question_pool, per task type) and the tokens of each pooled
    question (data.question_tokens), counted once per process for every stream and method."""
    from meshheal_jax.data import load_tokenizer

    profile = load_profile(dataset, profiles_dir)
    pool = question_pool(read_questions(source, dataset, profiles_dir), profile.task_types)
    tokenizer = None if source.tokenizer is None else load_tokenizer(source.tokenizer)
    return pool, tuple(question_tokens(records, dataset, tokenizer) for records in pool)


def with_question_tokens(stream, pool, tokens):
    """The stream with the token counts of the questions its ids pick from `pool` (the pick the live
    backend makes: data.pick_questions); `tokens`: each pooled question's, per task type
    (spec/emulator.md; docs/decisions.md E7)."""
    pick = pick_questions(pool, stream.task_type, stream.question, stream.seed, stream.dataset_id)
    first = np.cumsum([0, *(len(t) for t in tokens[:-1])])  # each type's offset in the flat array
    counts = np.concatenate(tokens)[first[stream.task_type] + pick.pool_index]
    return dataclasses.replace(stream, question_tokens=counts.astype(np.int32))


def run_one_stream(exp: Experiment, dataset: str, pair_name: str, seed: int) -> dict[str, pl.DataFrame]:
    """The reference engine, one MeshHeal stream."""
    from meshheal_jax import reference  # here: JAX (its draws) starts only once a stream runs

    network, stream, pair, labels = _stream_inputs(exp, dataset, pair_name, seed)
    records = reference.run_stream(network, exp.protocol, pair, stream, exp.schedule(), labels)
    return {name: metrics.frame(name, getattr(records, name)) for name in TABLES}


def run_jax_streams(
    exp: Experiment,
    streams: list[tuple[str, str, int]],
    on_progress=None,
    lanes: int | None = None,
    cancel: threading.Event | None = None,
    checkpoints: Checkpoints | None = None,
) -> list[dict[str, pl.DataFrame]]:
    """The JAX engine: MeshHeal streams (dataset, pair, seed) of one pair as one vmapped program,
    in `lanes` lanes side by side (engine.run_streams; default one per CPU core). `cancel`: set
    from another thread to stop at the next chunk (errors.Cancelled). `checkpoints`: the streams'
    checkpoint folders, in `streams`' order (engine.run_batch)."""
    from meshheal_jax import engine  # imported here: the reference path needs no compilation

    specs = []
    for dataset, pair_name, seed in streams:
        network, stream, pair, labels = _stream_inputs(exp, dataset, pair_name, seed)
        specs.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
    return engine.run_streams(
        specs,
        exp.protocol,
        slots=exp.slots,
        tables=exp.tables,
        on_progress=on_progress,
        lanes=lanes,
        cancel=cancel,
        checkpoints=checkpoints,
    )


def run_live_streams(
    exp: Experiment, streams: list[tuple[str, str, int]], run_dir: Path
) -> list[dict[str, pl.DataFrame]]:
    """The live backend: MeshHeal streams (dataset, pair, seed) of one pair, every round's calls of
    every stream sent together. Each reply is cached in run_dir/responses.sqlite as it arrives, so
    re-running the same command after a crash or a dead server resends nothing it already has."""
    from meshheal_jax import engine
    from meshheal_jax.backends import live_loop

    specs = []
    for dataset, pair_name, seed in streams:
        network, stream, pair, labels = _stream_inputs(exp, dataset, pair_name, seed)
        specs.append(engine.StreamSpec(network, stream, exp.schedule(), pair, labels))
    questions = {
        d: read_questions(exp.live, d, exp.profiles_dir) for d in dict.fromkeys(d for d, _, _ in streams)
    }
    (pair_name,) = {p for _, p, _ in streams}
    return live_loop.run_live_streams(
        specs, exp.protocol, exp.live.config(run_dir / live_loop.CACHE_FILE, pair_name, exp.params_dir), questions,
        slots=exp.slots,
        run_dir=run_dir / f"live-{pair_name}", options=exp.live.options(),
    )  # fmt: skip


def run_baseline_streams(
    exp: Experiment, method: str, streams: list[tuple[str, str, int]], run_dir: Path | None = None
) -> list[dict[str, pl.DataFrame]]:
    """A baseline's streams (dataset, pair, seed) of one pair: one compiled program per shape (the
    packaged profiles share one), every dataset and seed vmapped. Live backend: the program's calls
    go to the servers (backends/live_baselines.py), cached in run_dir/responses.sqlite."""
    from meshheal_jax.baselines import BaselineSpec
    from meshheal_jax.baselines import run_baseline_frames as run_baseline
    from meshheal_jax.baselines.run import protocol_params

    params = protocol_params(method, exp.protocol)  # the settings shared with MeshHeal (decisions B8)
    if exp.backend == "live":
        from meshheal_jax.backends.live_baselines import CACHE_FILE, run_live_baselines

        def run_baseline(method, specs, pair, params):  # the live variant of the same call
            questions = {d: read_questions(exp.live, d, exp.profiles_dir)
                         for d in dict.fromkeys(s.network.profile.dataset for s in specs)}  # fmt: skip
            return run_live_baselines(method, specs, pair, exp.live.config(run_dir / CACHE_FILE, pair_name,
                                                                           exp.params_dir),
                                      questions, run_dir=run_dir / f"live-{method}-{pair_name}",
                                      options=exp.live.options(), params=params)  # fmt: skip

    pairs = {p for _, p, _ in streams}
    if len(pairs) != 1:
        raise MeshHealError("a baseline batch holds the streams of one pair")
    (pair_name,) = pairs
    groups: dict[tuple, list[int]] = {}  # streams batched together need the same shapes
    specs = []
    for k, (dataset, _, seed) in enumerate(streams):
        network, stream, _, labels = _stream_inputs(exp, dataset, pair_name, seed, method)
        specs.append(BaselineSpec(network, stream, exp.schedule(), labels))
        groups.setdefault((network.holds.shape, len(network.profile.task_types)), []).append(k)
    pair = load_pair(pair_name, exp.params_dir)
    out: list[dict[str, pl.DataFrame] | None] = [None] * len(streams)
    for members in groups.values():
        for k, frames in zip(members, run_baseline(method, [specs[k] for k in members], pair, params)):
            out[k] = {name: frames[name] for name in exp.tables}
    return out


def _write_tables(folder: Path, frames: dict[str, pl.DataFrame]) -> None:
    """One parquet file per table, written side by side (polars writes without the GIL), each
    whole or not at all: a write a stop cuts short leaves the file as it was, not a file cut short."""
    with ThreadPoolExecutor(len(frames) or 1) as pool:
        for done in [
            pool.submit(_write_table, df, folder / f"{name}.parquet") for name, df in frames.items()
        ]:
            done.result()


def _write_table(df: pl.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    df.write_parquet(tmp)
    os.replace(tmp, path)


def _write_part(part: Path, frames: dict[str, pl.DataFrame]) -> None:
    """A finished stream's tables, on disk before the rename that makes the part count as finished."""
    tmp = part.with_name(part.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_tables(tmp, frames)
    for path in (*tmp.iterdir(), tmp):
        flush(path)
    tmp.rename(part)
    flush(part.parent)


class DamagedPartWarning(MeshHealWarning):
    """A finished stream's part that cannot be read back: it is set aside and the stream runs again."""


def _part_readable(part: Path, tables: Sequence[str]) -> bool:
    """Whether a stream's part is there and every table file of it is readable parquet (its footer:
    a file cut short has none). One with a table missing or unreadable as parquet is set aside as
    `<part>.damaged` (replacing an older one), with a warning, so its stream runs again (the same
    records: a stream is a pure function of its settings); any other error (the disk, permissions)
    is raised, leaving the part as it is."""
    if not part.exists():
        return False
    try:
        for table in tables:
            pl.read_parquet_schema(part / f"{table}.parquet")
    except (FileNotFoundError, pl.exceptions.PolarsError) as err:
        kept = part.with_name(part.name + ".damaged")
        shutil.rmtree(kept, ignore_errors=True)
        part.rename(kept)
        warnings.warn(DamagedPartWarning(f"finished stream {part} is damaged ({type(err).__name__}: "
                                         f"{str(err)[:200]}); set aside as {kept.name}, its stream runs again"),
                      stacklevel=2)  # fmt: skip
        return False
    return True


@dataclasses.dataclass
class Results:
    """A finished run: the four record frames and the summary."""

    run_dir: Path
    tasks: pl.DataFrame
    reviews: pl.DataFrame
    states: pl.DataFrame
    calls: pl.DataFrame
    summary: dict
    # the folder held finished streams, checkpoints or (live) cached replies when this call began
    resumed: bool = False


def check_arms(out: Path, arms: Sequence[str], flag: str) -> None:
    """A command running one run folder per arm (scale's topologies, ablate's variants, detectors'
    detectors) resumes into `out` only if every arm already there is one it runs: otherwise its
    combined summary would leave finished arms out, or mix settings the per-arm check never sees."""
    if not out.is_dir():
        return
    held = sorted(p.name for p in out.iterdir() if (p / "config.json").exists() or (p / "parts").is_dir())
    extra = [a for a in held if a not in arms]
    if extra:
        raise MeshHealError(f"{out} holds the run(s) of {', '.join(extra)}, which this command does not run "
                            f"(it runs {', '.join(arms)}): give the same {flag} to resume it, or another --out")  # fmt: skip


def check_lanes(lanes: int | None) -> None:
    """A --lanes value the JAX engine takes (engine.check_lanes), checked before anything is written."""
    if lanes is not None:
        from meshheal_jax import engine

        engine.check_lanes(lanes, engine.stream_mesh())


def run(exp: Experiment, out: Path | None = None, progress: bool = True, lanes: int | None = None,
        checkpoint_every: float = CHECKPOINT_EVERY_S) -> Results:  # fmt: skip
    """Run (or resume) an experiment; append each finished stream to the run folder. `lanes`: the
    JAX engine's MeshHeal streams of a pair run in that many lanes side by side, one thread each
    (default: one per CPU core; docs/decisions.md S7); the same records, floats up to the last bits.
    `checkpoint_every`: seconds between checkpoints of the JAX engine's unfinished MeshHeal streams
    (run_dir/checkpoints; also written when the run is stopped; 0 = after every chunk); a rerun
    goes on from them (docs/decisions.md X1)."""
    exp = with_recorded_commits(exp, out)
    exp.validate()
    check_lanes(lanes)
    if not checkpoint_every >= 0:
        raise MeshHealError(f"--checkpoint-every must be >= 0 seconds, got {checkpoint_every}")
    run_dir = prepare_run_dir(exp, out)
    with _exclusive(run_dir):
        return _run_in(exp, run_dir, progress, lanes, checkpoint_every)


@contextlib.contextmanager
def _exclusive(run_dir: Path):
    """Hold run_dir alone while a run writes in it: a second run given the same --out is refused
    (the two would write the same part and checkpoint files). An advisory lock on run_dir/.lock,
    which the system releases when the process ends, however it ends. A folder the run cannot
    write in is an OSError here, before any stream runs."""
    with open(run_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise MeshHealError(f"output folder {run_dir} is in use by another run (process {holder}); wait for "
                                "it to end, or choose another --out") from None  # fmt: skip
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        probe = run_dir / ".writable"  # a folder it cannot write in fails now, not after the computing
        probe.touch()
        probe.unlink()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_in(
    exp: Experiment, run_dir: Path, progress: bool, lanes: int | None, checkpoint_every: float
) -> Results:
    """run()'s work in its run folder, which it holds alone (`_exclusive`)."""
    streams = exp.streams()
    todo = [s for s in streams if not _part_readable(_part_dir(run_dir, *s), exp.tables)]
    kept = len(streams) - len(todo)
    # checkpoints committed (their state.json, checkpoints.STATE: imported, it would import JAX)
    saved = sum((_checkpoint_dir(run_dir, *s) / "state.json").is_file() for s in todo)
    # a live run keeps no checkpoints: what an interrupted one kept is its replies, replayed from the cache
    cached = (cached_replies(run_dir) or 0) if exp.backend == "live" and todo else 0
    if kept or saved or cached:  # also under --quiet (no progress bar): it says what was kept
        print(f"resuming {run_dir}: {kept} of {len(streams)} streams already finished"
              + (f", {saved} with a checkpoint" if saved else "")
              + (f", {cached:,} replies in responses.sqlite" if cached else ""), flush=True)  # fmt: skip
    finished: dict[tuple, dict[str, pl.DataFrame]] = {}  # this call's streams, kept to skip reading them back

    def keep(stream: tuple, frames: dict[str, pl.DataFrame]) -> None:
        frames = {name: frame for name, frame in frames.items() if name in exp.tables}  # live gives all
        part = _part_dir(run_dir, *stream)
        if not part.is_dir():  # there: written whole (renamed) by a keep that a Ctrl-C cut short after
            _write_part(part, frames)
        shutil.rmtree(_checkpoint_dir(run_dir, *stream), ignore_errors=True)  # the part holds it all now
        finished[stream] = frames

    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"{exp.name}: streams", total=len(streams), completed=kept)
        mine = [s[1:] for s in todo if s[0] == "meshheal"]
        if exp.backend == "live":
            for pair in exp.pairs:
                batch = [s for s in mine if s[1] == pair]
                if batch:
                    bar.update(
                        job,
                        description=f"{exp.name}: meshheal, live backend, pair={pair}, {len(batch)} streams",
                    )
                    for stream, frames in zip(batch, run_live_streams(exp, batch, run_dir)):
                        keep(("meshheal", *stream), frames)
                        bar.advance(job)
        elif exp.engine == "reference":
            for dataset, pair, seed in mine:
                bar.update(job, description=f"{exp.name}: meshheal {dataset} pair={pair} seed={seed}")
                keep(("meshheal", dataset, pair, seed), run_one_stream(exp, dataset, pair, seed))
                bar.advance(job)
        else:  # the JAX batches: MeshHeal's (one per pair) and every baseline's, side by side
            from meshheal_jax.checkpoints import Checkpoints  # imports JAX: here, not at the top

            jobs, cancel = [], threading.Event()
            for pair in exp.pairs:  # one compiled program per pair, all its datasets and seeds vmapped
                batch = [s for s in mine if s[1] == pair]
                if batch:

                    def tick(done: int, total: int, batch=batch, pair=pair) -> None:
                        bar.update(job, description=f"{exp.name}: meshheal, jax engine, pair={pair}, "
                                                    f"{len(batch)} streams, {done:,}/{total:,} tasks")  # fmt: skip

                    saves = Checkpoints(
                        [_checkpoint_dir(run_dir, "meshheal", *s) for s in batch], checkpoint_every
                    )
                    jobs.append(("meshheal", batch,
                                 functools.partial(run_jax_streams, exp, batch, tick, lanes, cancel, saves)))  # fmt: skip
            jobs += _baseline_jobs(exp, todo, run_dir)
            bar.update(job, description=f"{exp.name}: {len(jobs)} compiled batches (meshheal, baselines)")
            _run_side_by_side(jobs, keep, lambda: bar.advance(job), cancel)
        if exp.backend == "live" or exp.engine == "reference":
            for method, batch, run_batch in _baseline_jobs(exp, todo, run_dir):
                bar.update(job, description=f"{exp.name}: {method}, pair={batch[0][1]}, {len(batch)} streams")
                for stream, frames in zip(batch, run_batch()):
                    keep((method, *stream), frames)
                    bar.advance(job)

    def read_part(stream: tuple, name: str) -> pl.DataFrame:
        path = _part_dir(run_dir, *stream) / f"{name}.parquet"
        try:
            return pl.read_parquet(path)
        except Exception as err:  # noqa: BLE001 -- damaged inside, past the footer _part_readable reads
            raise MeshHealError(f"finished stream {path.parent} is damaged ({type(err).__name__}: "
                                f"{str(err)[:200]}); delete that folder and rerun to run its stream again") from None  # fmt: skip

    def whole(name: str) -> pl.DataFrame:
        if name not in exp.tables:
            return pl.DataFrame(schema=metrics.SCHEMAS[name])
        return pl.concat([finished[s][name] if s in finished else read_part(s, name) for s in streams])

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # every stream has its part
    frames = {name: whole(name) for name in TABLES}
    with ThreadPoolExecutor(1) as pool:  # the whole tables are written while the summary is computed
        written = pool.submit(_write_tables, run_dir, frames)
        try:
            summary = summarize(exp, frames)
        finally:
            written.result()  # a failed write surfaces (chained to a failed summary, if any)
    if exp.backend == "live":
        summary["server_prefix"] = server_prefix_savings(run_dir)
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return Results(run_dir, frames["tasks"], frames["reviews"], frames["states"], frames["calls"], summary,
                   resumed=bool(kept or saved or cached))  # fmt: skip


def cached_replies(run_dir: Path) -> int | None:
    """Replies in a run folder's response cache (`cache.stored_replies`), None where it cannot be read."""
    from meshheal_jax.backends.cache import CACHE_FILE, stored_replies  # here: asyncio loads only when asked

    try:
        return stored_replies(run_dir / CACHE_FILE)
    except sqlite3.Error:
        return None


def server_prefix_savings(run_dir: Path) -> dict:
    """spec/live.md: the tokens count every review sample's prompt (an n=3 request's prompt three
    times, as the paper counts); the server-side savings are reported apart. Over the run's live
    traces (every `live-*/live_trace*.parquet`), the requests actually sent (not replayed from the
    response cache): prompt tokens as counted, of them the prefill an n-request shared
    (`prefix_shared_tokens`) and the prefix-cache hits the servers reported (`cached_prompt_tokens`,
    0 where a server reports none or an older trace lacks the column)."""
    sums = {"prompt_tokens": 0, "prefix_shared_tokens": 0, "cached_prompt_tokens": 0, "requests": 0}
    for path in sorted(Path(run_dir).glob("live-*/live_trace*.parquet")):
        try:
            trace = pl.read_parquet(path)
        except Exception:  # noqa: BLE001 -- a trace that cannot be read is named, the summary still written
            warnings.warn(f"cannot read {path}: left out of the server-side prefix savings", stacklevel=2)
            continue
        sent = trace.filter(~pl.col("from_cache")) if "from_cache" in trace.columns else trace
        sums["requests"] += sent.height
        for key in ("prompt_tokens", "prefix_shared_tokens", "cached_prompt_tokens"):
            if key in sent.columns:
                sums[key] += int(sent[key].fill_null(0).sum())
    total = sums["prompt_tokens"]
    return {**sums, "prefix_shared_share": sums["prefix_shared_tokens"] / total if total else None,
            "cached_prompt_share": sums["cached_prompt_tokens"] / total if total else None}  # fmt: skip


def _baseline_jobs(
    exp: Experiment, todo: list[tuple], run_dir: Path
) -> list[tuple[str, list[tuple], functools.partial]]:
    """(method, streams, run) per baseline and pair with streams left to run: one compiled program each."""
    jobs = []
    for method in exp.baselines():
        for pair in exp.pairs:
            batch = [s[1:] for s in todo if s[0] == method and s[2] == pair]
            if batch:
                jobs.append(
                    (method, batch, functools.partial(run_baseline_streams, exp, method, batch, run_dir))
                )
    return jobs


def _run_side_by_side(jobs: list[tuple], keep, advance, cancel: threading.Event) -> None:
    """Run the batches `jobs` ((method, streams, run) each) in threads, as many at once as this
    process has CPU cores (docs/decisions.md R5): one batch's tracing (Python, under the GIL) runs
    while another compiles or runs (XLA, without it). Each batch's streams are kept the moment it
    ends; a failed batch does not stop the others, and the first error is raised (the others'
    added to it as notes) once they have ended and been kept. Ctrl-C sets `cancel`: batches not
    started never start, MeshHeal's stop at their next chunk (the jobs were given `cancel`), the
    batches that finish meanwhile are kept, then KeyboardInterrupt is raised; a second Ctrl-C
    stops the waiting. Each batch is one pure program, so results equal one-at-a-time runs."""
    if not jobs:
        return
    import meshheal_jax.baselines.run  # noqa: F401 -- imported here once, not by several threads at once
    from meshheal_jax import engine

    errors: list[BaseException] = []
    kept: set[tuple] = set()  # (future, stream index) written: a collect cut short by Ctrl-C goes on

    def collect(done) -> None:
        method, batch = futures[done]
        if done.cancelled():
            return
        if done.exception() is not None:
            errors.append(done.exception())
            return
        for k, (stream, frames) in enumerate(zip(batch, done.result())):
            if (done, k) not in kept:
                keep((method, *stream), frames)
                kept.add((done, k))
                advance()

    def drain() -> None:  # in short waits: a signal reaches the main thread only while it runs Python
        while waiting:
            done, _ = wait(waiting, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    collect(future)
                except KeyboardInterrupt:  # left waiting: the stop's drain writes the rest
                    raise
                except BaseException:  # a write that failed (a full disk): not tried again
                    waiting.discard(future)
                    raise
                waiting.discard(future)

    pool = ThreadPoolExecutor(engine.default_lanes(len(jobs)), thread_name_prefix="meshheal-batch")
    futures = {pool.submit(run): (method, batch) for method, batch, run in jobs}
    waiting = set(futures)
    try:
        drain()
    except BaseException:
        cancel.set()
        for future in waiting:
            future.cancel()
        try:
            drain()
        except KeyboardInterrupt as again:  # the second Ctrl-C: batches still running are abandoned
            raise Abandoned() from again
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"another batch failed too: {type(other).__name__}: {other}")
        raise errors[0]


def _without_isolation(m: dict) -> dict:
    """A method with no isolation (the baselines): no agent is ever isolated, so detection never
    happens, closure is not established and reintegration (return from isolation) is undefined."""
    agents = [
        {**a, "detection_delay": None, "closure": False, "reintegration_delay": None} for a in m["agents"]
    ]
    return {**m, "agents": agents}


def summarize(exp: Experiment, frames: dict[str, pl.DataFrame]) -> dict:
    """One result per (method, dataset, pair), and per (method, pair) the mean over datasets
    (within seed) when there are several datasets. Every result names method, variant, detector,
    dataset and pair. Parse counts (metrics.PARSE_KEYS: 0 on the emulator, which always parses)
    come from the calls table, and are left out when the run keeps none (`tables`); so is the review
    audit when it keeps no reviews table."""
    schedule = exp.schedule()
    _, phase_names = exp.phases()
    split = {name: frames[name].partition_by("method", "dataset", "pair", "seed", as_dict=True)
             for name in ("tasks", "reviews", "states")}  # fmt: skip
    with_calls = "calls" in exp.tables
    if with_calls:  # only the calls that did not parse at once: the calls table of a large network is big
        status = pl.col("parse_status")
        rows = frames["calls"].select(pl.arg_where(status.is_not_null() & (status != metrics.PARSE_OK)))
        # gathered by index: a filter would first align every column's chunks, a copy of the whole
        # table (+0.4 GiB peak at 576 agents x 5 seeds; the emulator's calls all parse)
        not_ok = frames["calls"][rows.to_series()]
        split["calls"] = not_ok.partition_by("method", "dataset", "pair", "seed", as_dict=True)
    results = []
    for method in exp.methods:
        head = {"method": method, **exp.labels(method)}
        for pair in exp.pairs:
            per_dataset: dict[str, list[dict]] = {}
            for dataset in exp.datasets:
                per_seed = []
                for seed in exp.seeds:

                    def pick(name: str, key=(method, dataset, pair, seed)) -> pl.DataFrame:
                        return split[name].get(key, frames[name].clear())

                    reviews = pick("reviews") if "reviews" in exp.tables else None
                    m = metrics.stream_metrics(pick("tasks"), reviews, pick("states"), schedule, phase_names,
                                               per_agent=exp.n_agents <= 6, scale_counts=exp.name == "scale",
                                               calls=pick("calls") if with_calls else None)  # fmt: skip
                    per_seed.append(m if method == "meshheal" else _without_isolation(m))
                per_dataset[dataset] = per_seed
                results.append(
                    {**head, "dataset": dataset, "pair": pair, **metrics.aggregate(per_seed, exp.seeds)}
                )
            if len(exp.datasets) > 1:
                results.append({**head, "dataset": "mean", "pair": pair,
                                **metrics.mean_over_datasets(per_dataset, exp.seeds)})  # fmt: skip
    for r in results:
        if r["dataset"] != "mean":
            r.update(graph_facts(exp, r["dataset"]))
    return {"experiment": exp.name, "engine": exp.engine, "backend": exp.backend, "slots": exp.slots,
            "n_agents": exp.n_agents, "n_tasks": exp.n_tasks, "methods": list(exp.methods),
            "results": results}  # fmt: skip


def graph_facts(exp: Experiment, dataset: str) -> dict:
    """n_agents, topology, degraded, edges, edge fraction and max ability distance of a result."""
    network = exp.network(dataset)
    degraded = exp.schedule().ever_degraded()  # the run's degraded agents (--degraded or the profile's)
    farthest = int(graphs.ability_distances(network.holds, degraded, network.edges).max(initial=0))
    complete = exp.n_agents * (exp.n_agents - 1) // 2
    return {"n_agents": exp.n_agents, "topology": exp.topology, "degraded": int(degraded.sum()),
            "edges": network.n_edges, "edge_fraction": network.n_edges / complete if complete else 0.0,
            # None where some agent reaches no healthy holder of an ability (NoHealthyHolderWarning)
            "max_ability_distance": None if farthest >= graphs.INF_DISTANCE else farthest}  # fmt: skip
