"""Ability profiles (data files), agents and graphs.

A profile maps the six base agents A1..A6 to abilities and each task type to the two abilities it
requires (spec/abilities.md). Larger networks replicate it: agent k has profile A{(k mod 6)+1}.
Profiles are validated on load against the rules of spec/abilities.md; a broken rule is reported
naming the rule and the ability or task type.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
from pathlib import Path

import numpy as np

from meshheal_jax import graphs
from meshheal_jax.errors import MeshHealError
from meshheal_jax.files import read_text
from meshheal_jax.graphs import complete_edges, edges_from_adjacency, neighbour_table

PROFILE_DIR = Path(__file__).parent / "profiles"
DATASETS = ("bbh", "math", "mmlu_pro")
BASE_AGENTS = 6
N_ABILITIES = 7
N_TASK_TYPES = 7
HOLDERS_PER_ABILITY = 3


@dataclasses.dataclass(frozen=True)
class Profile:
    """One dataset's ability mapping over the six base agents."""

    dataset: str
    dataset_id: int
    question_tokens: int  # mean question tokens (emulator, no data dir)
    abilities: tuple[str, ...]  # vocabulary order
    descriptions: tuple[str, ...]
    task_types: tuple[str, ...]
    requires: tuple[tuple[int, int], ...]  # per task type: (ability, ability) in file order
    holds: np.ndarray  # (6, n_abilities) bool: base agent a holds ability s
    degraded_targets: tuple[int, ...]  # 0-based base-agent indices

    @property
    def pairs(self) -> tuple[frozenset[int], ...]:
        """Distinct documented pairs as unordered sets, in order of first appearance."""
        seen: list[frozenset[int]] = []
        for pair in self.requires:
            if frozenset(pair) not in seen:
                seen.append(frozenset(pair))
        return tuple(seen)

    def pair_index(self, task_type: int) -> int:
        return self.pairs.index(frozenset(self.requires[task_type]))


PROFILE_KEYS = ("dataset", "dataset_id", "question_tokens", "degraded_targets", "ability", "task_type")
ROW_KEYS = {"ability": ("name", "holders", "description"), "task_type": ("name", "requires")}


def _agent_index(name: str, where: str, source: str = "profile") -> int:
    if not (isinstance(name, str) and re.fullmatch(r"A[1-9][0-9]*", name)):
        raise MeshHealError(f"{source}: {where}: agent name {name!r} is not of the form A1..A6")
    index = int(name[1:]) - 1
    if not 0 <= index < BASE_AGENTS:
        raise MeshHealError(f"{source}: {where}: agent {name!r} does not exist (A1..A6)")
    return index


def unknown_keys(table: dict, known: tuple[str, ...], where: str) -> None:
    """Refuse keys outside `known` (profiles and model files)."""
    unknown = sorted(set(table) - set(known))
    if unknown:  # a misspelt key would otherwise be read as absent
        raise MeshHealError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")


def _rows(doc: dict, key: str, source: str) -> list[dict]:
    """The [[ability]] / [[task_type]] entries: an array of tables with known keys."""
    rows = doc[key]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise MeshHealError(f"{source}: {key} must be an array of tables ([[{key}]] entries), got {rows!r}")
    for row in rows:
        unknown_keys(row, ROW_KEYS[key], f"{source}: {key} {row.get('name')!r}")
    return rows


def _names(row: dict, key: str, where: str) -> list[str]:
    """A list of names (holders, requires): a TOML array of strings, never a lone string."""
    value = row.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MeshHealError(f"{where}: {key} must be an array of names, got {value!r}")
    return value


MAX_TOKENS = 10**6  # a bound on any token count a file gives (per question or call), far above real ones


def whole_number(value, where: str, minimum: int = 0, maximum: int = 2**31 - 1) -> int:
    """An integer in minimum..maximum as the file wrote it (not a float, not a boolean); profiles and
    model files. The default maximum is what the engines' int32 arrays hold."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise MeshHealError(f"{where} must be an integer in {minimum}..{maximum}, got {value!r}")
    return value


def _row_texts(rows: list, table: str, key: str, source: str, required: bool = True) -> list[str]:
    """Each row's `key` as a non-empty string (or "" where an optional key is absent), naming the
    row (its position in the file's [[table]] rows) where one is missing or not text."""
    out = []
    for k, row in enumerate(rows, 1):
        value = row.get(key, None if required else "")
        if not isinstance(value, str) or (required and not value.strip()):
            need = "a non-empty string" if required else "a string"
            raise MeshHealError(f"{source}: [[{table}]] row {k}: {key} must be {need}, got {value!r}")
        out.append(value)
    return out


def name_key(name: str) -> str:
    """How a name from elsewhere is matched to a profile's ability or task-type name (a model's
    reply, a data file's type column, decisions X10): case, and runs of spaces, hyphens and
    underscores, do not matter ("Multi-step deduction" names multi_step_deduction)."""
    return re.sub(r"[\s\-_]+", "_", name.strip()).casefold()


def parse_profile(doc: dict, source: str = "<profile>") -> Profile:
    """Build and validate a Profile from a parsed TOML document."""
    unknown_keys(doc, PROFILE_KEYS, source)
    try:
        dataset = str(doc["dataset"])
        dataset_id = whole_number(doc["dataset_id"], f"{source}: dataset_id", 0)
        question_tokens = whole_number(
            doc.get("question_tokens", 200), f"{source}: question_tokens", 1, MAX_TOKENS
        )
        ability_rows = _rows(doc, "ability", source)
        type_rows = _rows(doc, "task_type", source)
        target_names = _names(doc, "degraded_targets", source) if "degraded_targets" in doc else ["A3", "A5"]
    except KeyError as missing:
        raise MeshHealError(f"{source}: missing key {missing}") from None
    names = _row_texts(ability_rows, "ability", "name", source)
    type_names = _row_texts(type_rows, "task_type", "name", source)
    descriptions = _row_texts(ability_rows, "ability", "description", source, required=False)
    for kind, given in (("ability", names), ("task type", type_names)):
        repeated = sorted({n for n in given if given.count(n) > 1})
        if repeated:
            raise MeshHealError(f"{source}: {kind} names must be unique: {repeated} repeated")
    keys = [name_key(n) for n in names]
    alike = sorted(n for n, key in zip(names, keys) if keys.count(key) > 1)
    if alike:
        raise MeshHealError(f"{source}: ability names {alike} differ only in case, spaces, hyphens or "
                            "underscores; a model's reply naming one could not be told from the other")  # fmt: skip
    holds = np.zeros((BASE_AGENTS, len(names)), dtype=bool)
    for s, row in enumerate(ability_rows):
        where = f"ability {names[s]!r}"
        for holder in _names(row, "holders", f"{source}: {where}"):
            agent = _agent_index(holder, where, source)
            if holds[agent, s]:
                raise MeshHealError(f"{source}: {where}: holder {holder!r} listed twice")
            holds[agent, s] = True
    requires = []
    for row in type_rows:
        req = _names(row, "requires", f"{source}: task type {row.get('name')!r}")
        for ability in req:
            if ability not in names:
                raise MeshHealError(
                    f"{source}: task type {row.get('name')!r} requires unknown ability {ability!r}"
                )
        requires.append(tuple(names.index(a) for a in req))
    profile = Profile(
        dataset=dataset,
        dataset_id=dataset_id,
        question_tokens=question_tokens,
        abilities=tuple(names),
        descriptions=tuple(descriptions),
        task_types=tuple(type_names),
        requires=tuple(requires),  # type: ignore[arg-type]
        holds=holds,
        degraded_targets=tuple(_agent_index(n, "degraded_targets", source) for n in target_names),
    )
    validate_profile(profile, source)
    return profile


def validate_profile(p: Profile, source: str = "<profile>") -> None:
    """Check every rule of spec/abilities.md; raise naming the first broken rule."""

    def fail(rule: str, detail: str) -> None:
        raise MeshHealError(f"{source}: rule '{rule}' broken: {detail}")

    if len(p.abilities) != N_ABILITIES:
        fail("7-ability vocabulary", f"{len(p.abilities)} abilities")
    if len(p.task_types) != N_TASK_TYPES or len(set(p.task_types)) != N_TASK_TYPES:
        fail("7 distinct task types", f"{list(p.task_types)}")
    for s, name in enumerate(p.abilities):
        count = int(p.holds[:, s].sum())
        if count != HOLDERS_PER_ABILITY:
            fail("every ability is held by exactly three agents", f"ability {name!r} has {count}")
    for t, (name, req) in enumerate(zip(p.task_types, p.requires)):
        if len(req) != 2 or req[0] == req[1]:
            fail("each task type requires exactly two abilities", f"task type {name!r}")
        a, b = req
        if np.any(p.holds[:, a] & p.holds[:, b]):
            fail(
                "the two abilities of a task type are held by disjoint agent sets",
                f"task type {name!r}: {p.abilities[a]!r} and {p.abilities[b]!r} share a holder",
            )
    if len(p.degraded_targets) != 2 or p.degraded_targets[0] == p.degraded_targets[1]:
        fail("two distinct degraded targets", f"{p.degraded_targets}")
    t1, t2 = p.degraded_targets
    for s, name in enumerate(p.abilities):
        if p.holds[t1, s] and p.holds[t2, s]:
            fail("no ability is held by both degraded targets", f"ability {name!r}")
        if int(p.holds[t1, s]) + int(p.holds[t2, s]) != 1:
            fail("every holder set contains exactly one degraded target", f"ability {name!r}")


def profile_path(dataset_or_path: str | Path, profile_dir: Path | None = None) -> Path:
    """The file a dataset's profile (or a .toml path) is read from."""
    path = Path(dataset_or_path)
    return path if path.suffix == ".toml" else (profile_dir or PROFILE_DIR) / f"{dataset_or_path}.toml"


def load_profile(dataset_or_path: str | Path, profile_dir: Path | None = None) -> Profile:
    """Load a dataset's profile by name (bbh, math, mmlu_pro) or from a TOML path."""
    path = profile_path(dataset_or_path, profile_dir)
    by_name = Path(dataset_or_path).suffix != ".toml"
    if by_name:
        folder = path.parent
        if not folder.is_dir():
            raise MeshHealError(f"profiles folder {folder} does not exist or is not a folder")
        if not path.exists():
            known = sorted(f.stem for f in folder.glob("*.toml"))
            raise MeshHealError(
                f"unknown dataset {str(dataset_or_path)!r} (no {path.name} in {folder}); known: {known}"
            )
    text = read_text(path, "profile")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise MeshHealError(f"cannot read profile {path}: {err}") from None
    profile = parse_profile(doc, str(path))
    if by_name and profile.dataset != str(dataset_or_path):
        raise MeshHealError(
            f"{path}: declares dataset = {profile.dataset!r}, but is the profile of {str(dataset_or_path)!r} "
            "(a profile's dataset is its file name)"
        )
    return profile


@dataclasses.dataclass(frozen=True)
class Network:
    """Agents (replicated profile) and an undirected graph, as plain numpy data.

    The graph is an edge list (E, 2), each row (i, j) with i < j, sorted and unique; the engines
    read it as a padded neighbour table (N, K), neighbours in increasing index, -1 padding.
    A dense adjacency matrix exists only for small networks (tests, the 6-agent experiments).
    """

    profile: Profile
    holds: np.ndarray  # (N, n_abilities) bool: agent k holds ability s (original set K_k)
    edges: np.ndarray  # (E, 2) int32, i < j, sorted, unique
    degraded_targets: tuple[int, ...]  # agent indices (A3/A5 of every replica)

    @property
    def n_agents(self) -> int:
        return int(self.holds.shape[0])

    @property
    def n_edges(self) -> int:
        return int(self.edges.shape[0])

    @functools.cached_property
    def neighbour_table(self) -> np.ndarray:
        """(N, K) int32, K = max degree; row i lists i's neighbours in increasing order, -1 padded."""
        return neighbour_table(self.edges, self.n_agents)

    def neighbours(self, agent: int) -> list[int]:
        row = self.neighbour_table[agent]
        return [int(j) for j in row[row >= 0]]

    @property
    def adjacency(self) -> np.ndarray:
        """(N, N) bool; small networks only."""
        return graphs.adjacency_from_edges(self.edges, self.n_agents)


def replicate_holds(profile: Profile, n_agents: int) -> np.ndarray:
    if n_agents <= 0 or n_agents % BASE_AGENTS:
        raise MeshHealError(f"agents must be a positive multiple of 6, got {n_agents}")
    return np.tile(profile.holds, (n_agents // BASE_AGENTS, 1))


def complete_graph(n_agents: int) -> np.ndarray:
    adjacency = np.ones((n_agents, n_agents), dtype=bool)
    np.fill_diagonal(adjacency, False)
    return adjacency


def validate_edges(edges: np.ndarray, n_agents: int) -> np.ndarray:
    """Structure (ids in range, no self loop or duplicate) and connectivity; canonical edges."""
    edges = graphs.check_structure(edges, n_agents)
    graphs.check_connected(edges, n_agents)
    return graphs.canonical(edges)


def validate_graph(adjacency: np.ndarray) -> None:
    validate_edges(edges_from_adjacency(adjacency), np.asarray(adjacency).shape[0])


def build_network(profile: Profile, n_agents: int = 6, adjacency: np.ndarray | None = None,
                  edges: np.ndarray | None = None) -> Network:  # fmt: skip
    """Replicate the profile to n_agents over a graph given as edges, a dense adjacency, or
    neither (complete graph); not both."""
    if adjacency is not None and edges is not None:
        raise MeshHealError("build_network: give the graph as edges or as an adjacency matrix, not both")
    holds = replicate_holds(profile, n_agents)
    if adjacency is not None:
        adjacency = np.asarray(adjacency, dtype=bool)
        if adjacency.shape[0] != n_agents:
            raise MeshHealError(f"graph has {adjacency.shape[0]} agents, profile replicated to {n_agents}")
        edges = edges_from_adjacency(adjacency)
    elif edges is None:
        edges = complete_edges(n_agents)
    edges = validate_edges(edges, n_agents)
    targets = tuple(
        r * BASE_AGENTS + a for r in range(n_agents // BASE_AGENTS) for a in profile.degraded_targets
    )
    return Network(profile, holds, edges, tuple(sorted(targets)))
