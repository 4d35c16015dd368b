"""`python -m meshheal_jax.calibration_fit`: fit the default pair's model files to spec/emulator.md.

A seeded, repeatable search over the parameters of the gpt-oss-120b and Llama-3.2-1B files
(`KNOBS`: every probability and review categorical the protocol reads, in unconstrained
coordinates: logits for probabilities, log-ratios for categoricals). Every candidate runs the real
protocol through the JAX engine at slots 1 (which equals the reference engine exactly), on
3 datasets × the FIT seeds (disjoint from the report's seeds 0..4), and is scored on the targets
of calibration_report.TARGETS:

    loss = Σ_primary z² + 10 Σ_primary max(|z| − 0.6, 0)² + 0.25 Σ_secondary z²,  z = (measured − paper) / tolerance

(the second term pulls every primary target well inside its tolerance, so that it survives the
report's other seeds). Outcomes (detection delays, false isolations) are never in the loss.
With `--structure`, each model's latent question difficulty (`difficulty_spread`,
`review_difficulty`; decisions E9) and its judgement of a Finalize on a wrong draft (`draft_blame`;
E10) are searched too, as plain values clipped at 0 (and 1); `--scan-spread/--scan-review/
--scan-blame` evaluates a grid of them on the shipped files instead of searching. Every file the
search writes keeps round 2 at least as sharp as round 1 (spec/emulator.md; decisions E11).
`--start DIR` begins from other files than the shipped ones (the shipped files' chain begins from
meshheal_jax/model_params/fit_start/; docs/calibration.md gives the commands); the best
candidate's files are written into OUT/model_params/, and with `--write` into the package.

The search is a separable natural evolution strategy (SNES, Schaul et al. 2011): a Gaussian
with a mean and one step size per coordinate; each generation draws `population` candidates
(mirrored), runs all of them × datasets × seeds as ONE batch of streams with a stacked parameter
pytree (one compiled program for the whole search), ranks them, and moves the mean and step
sizes. Seeded: the same command gives the same files.

    python -m meshheal_jax.calibration_fit --generations 40 --write
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import shlex
import time
import tomllib
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl

from meshheal_jax import runner
from meshheal_jax.calibration_report import (
    GAP_PARTS,
    _num,
    degraded_gap,
    evaluate,
    loss,
    print_report,
    seed_context,
)
from meshheal_jax.cli import entrypoint, new_table, print_table
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import (
    ANCHORS,
    DIFFICULTY,
    DRAFT_BLAME,
    MODEL_DIR,
    OPTIONAL,
    PAIRS,
    Pair,
    dump_model,
    parse_model,
    sharpened,
)

DATASETS = ("bbh", "math", "mmlu_pro")
# Which files each pair's fit changes (the other file of pairs A and B is the fitted default one).
FITTED = {"default": ("strong", "weak"), "A": ("weak",), "B": ("strong",)}
ROLES = ("strong_author", "weak_author")
LABELS = ("correct", "wrong")
FLOOR = 1e-3  # smallest probability a knob starts from (a logit of 0 or 1 is infinite)
# streams per Evaluator batch: 24 candidates x 3 datasets x 8 seeds (x 32 seeds ran out of 24 GiB)
MAX_STREAMS = 576


@dataclasses.dataclass(frozen=True)
class Knob:
    """One block of coordinates: a probability (1 coordinate, its logit), a categorical over the
    anchors (3 coordinates: log-ratios of the first three anchors to the last) or a clipped number
    (1 coordinate, the value itself, clipped to `clip`: the optional structure parameters, whose
    neutral value 0 the search must be able to reach exactly; difficulty >= 0, draft_blame in
    [0, 1])."""

    model: str  # "strong" | "weak"
    path: tuple[
        str, ...
    ]  # keys into the model file, e.g. ("p_part", "bbh") or ("review", "weak_author", "wrong")
    categorical: bool = False
    clip: tuple[float, float] | None = None

    @property
    def clipped(self) -> bool:
        return self.clip is not None

    @property
    def size(self) -> int:
        return len(ANCHORS) - 1 if self.categorical else 1

    @property
    def name(self) -> str:
        return f"{self.model}." + ".".join(self.path)


def _knobs(structure: bool = True) -> tuple[Knob, ...]:
    """Every coordinate of the two models; `structure`: also the optional structure parameters."""
    out = []
    for model in ("strong", "weak"):
        out += [Knob(model, ("p_part", d)) for d in DATASETS]
        out += [Knob(model, (k,)) for k in ("p_infer", "p_rescue", "rho_same", "p_follow", "p_fix", "p_keep")]
        sections = ("review", "round2") if model == "strong" else ("review",)
        out += [
            Knob(model, (sec, role, label), True) for sec in sections for role in ROLES for label in LABELS
        ]
        if structure:
            out += [Knob(model, (k,), clip=(0.0, math.inf)) for k in DIFFICULTY]
            out += [Knob(model, (DRAFT_BLAME,), clip=(0.0, 1.0))]
    return tuple(out)


KNOBS = _knobs()
DIM = sum(k.size for k in KNOBS)


def knobs_for(pair: str, structure: bool = False) -> tuple[Knob, ...]:
    return tuple(k for k in _knobs(structure) if k.model in FITTED[pair])


def _logit(p: float) -> float:
    p = min(max(p, FLOOR), 1 - FLOOR)
    return math.log(p / (1 - p))


def _get(doc: dict, path: tuple[str, ...]):
    if path[0] in OPTIONAL:
        return doc.get(path[0], 0.0)  # optional in a file: 0, the neutral structure
    value = doc
    for key in path:
        value = value[key]
    return value["default"] if isinstance(value, dict) else value


def _set(doc: dict, path: tuple[str, ...], value) -> None:
    target = doc
    for key in path[:-1]:
        target = target[key]
    if path[0] == "p_part":  # the default is searched; a start file's per-type values are kept
        kept = target.get(path[-1])
        value = {**(kept if isinstance(kept, dict) else {}), "default": value}
    target[path[-1]] = value


def encode(docs: dict[str, dict], knobs: tuple[Knob, ...] = KNOBS) -> np.ndarray:
    """Model files -> the search's coordinates."""
    x = []
    for knob in knobs:
        value = _get(docs[knob.model], knob.path)
        if knob.categorical:
            p = np.maximum(np.asarray(value, float), FLOOR)
            x += list(np.log(p[:-1] / p[-1]))
        elif knob.clipped:
            x.append(float(value))
        else:
            x.append(_logit(float(value)))
    return np.asarray(x)


def _rounded(probabilities) -> list[float]:
    """6 decimals, the last set so that the row sums to exactly 1; if the others' rounding leaves it
    below 0, it is 0 and the largest entry takes the difference."""
    p = [round(float(v), 6) for v in probabilities]
    p[-1] = round(1.0 - sum(p[:-1]), 6)
    if p[-1] < 0.0:
        p[-1] = 0.0
        k = p.index(max(p))
        p[k] = round(1.0 - (sum(p) - p[k]), 6)
    return p


def sharpen_round2(doc: dict) -> None:
    """Make every round-2 row of a model file at least as sharp as round 1 (params.sharpened,
    docs/decisions.md E11); rows that already are stay as they are."""
    for role in ROLES:
        for label in LABELS:
            round1, round2 = doc["review"][role][label], doc["round2"][role][label]
            new = sharpened(tuple(round1), tuple(round2), label == "correct")
            if new != tuple(round2):
                doc["round2"][role][label] = _rounded(new)


def decode(
    x: np.ndarray, base: dict[str, dict], knobs: tuple[Knob, ...] = KNOBS, sharpen: bool = True
) -> dict[str, dict]:
    """Coordinates -> model files (copies of `base` with every knob set; 6 decimals, categoricals
    summing to exactly 1; with `sharpen`, the round-2 rows of each searched model made at least as
    sharp as its round 1, spec/emulator.md)."""
    docs = copy.deepcopy(base)
    k = 0
    for knob in knobs:
        z = x[k:k + knob.size]  # fmt: skip
        k += knob.size
        if knob.categorical:
            w = np.exp(np.append(z, 0.0) - max(z.max(), 0.0))
            _set(docs[knob.model], knob.path, _rounded(w / w.sum()))
        elif knob.clipped:
            _set(docs[knob.model], knob.path, round(min(max(float(z[0]), knob.clip[0]), knob.clip[1]), 6))
        else:
            _set(docs[knob.model], knob.path, round(1.0 / (1.0 + math.exp(-float(z[0]))), 6))
    for model in {knob.model for knob in knobs} if sharpen else ():
        sharpen_round2(docs[model])
    return docs


def base_docs(
    pair: str = "default", model_dir: Path = MODEL_DIR, start: Path | None = None
) -> dict[str, dict]:
    """The pair's two model files as TOML documents, keyed by role; with `start`, the files the
    pair's fit changes are read from that folder instead."""
    docs = {}
    for role, name in zip(("strong", "weak"), PAIRS[pair]):
        folder = start if start is not None and role in FITTED[pair] else model_dir
        path = folder / f"{name}.toml"
        if not path.exists():
            raise MeshHealError(f"model file {path} not found (the {pair} pair's {role} model)")
        try:
            docs[role] = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise MeshHealError(f"cannot parse model parameter file {path}: {err}") from None
    return docs


def pair_of(docs: dict[str, dict], pair: str = "default") -> Pair:
    strong, weak = PAIRS[pair]
    return Pair(pair, parse_model(docs["strong"], strong, strong), parse_model(docs["weak"], weak, weak))


# ----------------------------------------------------------------------------------------------
# Evaluation: a population × datasets × seeds as one batch of streams
# ----------------------------------------------------------------------------------------------


class Evaluator:
    """Runs candidate pairs through the persistent-degradation experiment (`main`: 6 agents, 504
    tasks, agents 2 and 4 degraded from the midpoint) on the JAX engine at slots 1."""

    def __init__(self, seeds: tuple[int, ...], datasets: tuple[str, ...] = DATASETS, pair: str = "default"):
        self.exp = runner.Experiment(name="main", datasets=datasets, pairs=(pair,), seeds=seeds)
        self.seeds, self.pair = seeds, pair
        self.schedule = self.exp.schedule()
        self.phase_names = self.exp.phases()[1]
        self.streams = [
            (d, s, *runner._stream_inputs(self.exp, d, pair, s)[0:2]) for d in datasets for s in seeds
        ]

    def rows(self, pairs: list[Pair], gaps: list | None = None) -> list[list[dict]]:
        """calibration_report rows (the targets of this evaluator's pair) of each candidate pair;
        with `gaps` (a list), also appends each candidate's calibration_report.degraded_gap. Runs
        as few batches of at most MAX_STREAMS streams as hold every candidate (a batch's record
        tables are built on the host; each stream's result is its own, whatever the batch)."""
        per_batch = max(1, MAX_STREAMS // len(self.streams))
        return [row for k in range(0, len(pairs), per_batch) for row in self._rows(pairs[k:k + per_batch], gaps)]  # fmt: skip

    def _rows(self, pairs: list[Pair], gaps: list | None) -> list[list[dict]]:
        from meshheal_jax import engine, sweep

        protocol = ProtocolParams()
        specs, params = [], []
        for pair in pairs:
            for dataset, seed, network, stream in self.streams:
                labels = {"method": "meshheal", "dataset": dataset, "pair": self.pair, "seed": seed}
                specs.append(engine.StreamSpec(network, stream, self.schedule, pair, labels))
                params.append(engine.make_params(protocol, pair, network.profile, network.n_agents))
        point = sweep.GridPoint(0, {}, protocol, pairs[0])
        batch = sweep.Batch([point], specs, [0] * len(specs))
        # one call for the whole stream (~3,500 rounds at slots 1): the host builds each stream's
        # record tables once rather than once per chunk, which is most of the cost here
        frames = sweep.run_batch(batch, 1, 4096, ("tasks", "reviews", "states"), params=params)
        out, per_pair = [], len(self.streams)
        for k in range(len(pairs)):
            mine = frames[k * per_pair:(k + 1) * per_pair]  # fmt: skip
            contexts = []
            for seed in self.seeds:
                by_dataset = {d: f for (d, s, *_), f in zip(self.streams, mine) if s == seed}
                contexts.append(seed_context(by_dataset, self.schedule, self.phase_names))
            out.append([r for r in evaluate({self.pair: contexts}) if r["pair"] == self.pair])
            if gaps is not None:
                tasks, states = (pl.concat([f[table] for f in mine]) for table in ("tasks", "states"))
                gaps.append(degraded_gap(tasks, states, self.schedule))
        return out


# ----------------------------------------------------------------------------------------------
# Search
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitConfig:
    generations: int = 40
    """SNES generations (each one batch of population × datasets × seeds streams)"""
    population: int = 24
    """candidates per generation (even: mirrored pairs)"""
    sigma: float = 0.3
    """initial step size in every coordinate (logit / log-ratio units) but the clipped ones"""
    difficulty_sigma: float = 0.6
    """initial step size of the clipped structure coordinates (difficulty, draft_blame; files
    without them start at 0, where a small step mostly lands on the clip)"""
    fit_seeds: tuple[int, ...] = (100, 101, 102, 103, 104, 105, 106, 107)
    """seeds the fit evaluates on (the report uses 0..4)"""
    search_seed: int = 0
    """seed of the search's own random draws"""
    start: Path | None = None
    """folder holding the model files the search starts from (those the pair's fit changes);
    default: the shipped files. The shipped files' chain starts from meshheal_jax/model_params/
    fit_start/ (docs/calibration.md)"""
    structure: bool = False
    """also search each model's optional structure parameters (latent difficulty, draft_blame;
    decisions E9, E10) as clipped coordinates; off: they keep the start files' values"""
    out: Path = Path("runs/calibration-fit")
    """the search's folder: state.json after every generation (mean, step sizes, random state, the
    best candidate's files and rows); a rerun with the same folder resumes from it"""
    pair: Literal["default", "A", "B"] = "default"
    """default: fit gpt-oss-120b and Llama-3.2-1B to every default-pair target; A: fit gemma-3-4b to
    pair A's accuracy target; B: fit Llama-3.3-70B to pair B's (the other file of A and B is the
    default pair's, already fitted)"""
    prior: float = 0.02
    """pairs A and B only: loss += prior × Σ (x − start)², keeping the judgement values where the one
    target leaves them free"""
    tokens: bool = True
    """default pair: after the search, scale the completion-token ranges to the tokens-per-task target"""
    write: bool = False
    """also write the best candidate's files into meshheal_jax/model_params/ (they are always
    written into OUT/model_params/)"""
    scan_spread: tuple[float, ...] = ()
    """default pair only; no search when any --scan-* is given: evaluate its files with every
    (difficulty_spread, review_difficulty, draft_blame) of scan_spread x scan_review x scan_blame set
    on both models (one batch, the fit seeds; an axis left out is 0) and print a table"""
    scan_review: tuple[float, ...] = ()
    """review_difficulty values of the scan"""
    scan_blame: tuple[float, ...] = ()
    """draft_blame values of the scan"""

    def scans(self) -> bool:
        return bool(self.scan_spread or self.scan_review or self.scan_blame)


def utilities(n: int) -> np.ndarray:
    """SNES rank-based fitness shaping: best first."""
    ranks = np.arange(1, n + 1)
    raw = np.maximum(0.0, math.log(n / 2 + 1) - np.log(ranks))
    return raw / raw.sum() - 1.0 / n


def check_search(cfg: FitConfig) -> None:
    """The search settings a fit can run with, before anything is evaluated or written."""
    if cfg.population < 2 or cfg.population % 2:
        raise MeshHealError(f"--population must be even and >= 2 (mirrored sampling), got {cfg.population}")
    if cfg.generations < 0:
        raise MeshHealError(f"--generations must be >= 0, got {cfg.generations}")
    for name in ("sigma", "difficulty_sigma"):
        if not 0 < getattr(cfg, name) < math.inf:
            raise MeshHealError(
                f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(cfg, name)}"
            )
    if not 0 <= cfg.prior < math.inf:
        raise MeshHealError(f"--prior must be a finite number >= 0, got {cfg.prior}")
    if cfg.scans() and cfg.pair != "default":
        raise MeshHealError(
            f"--scan-* evaluates the default pair's targets; pair {cfg.pair} has only its accuracy target: "
            "drop --pair or the --scan-* options"
        )
    if cfg.out.exists() and not cfg.out.is_dir():
        raise MeshHealError(f"--out {cfg.out} exists and is not a folder")
    if not cfg.fit_seeds or len(set(cfg.fit_seeds)) != len(cfg.fit_seeds):
        raise MeshHealError(f"--fit-seeds must be one or more distinct seeds, got {list(cfg.fit_seeds)}")


def _read_state(state_file: Path) -> dict:
    """A search's state.json, or a one-line error naming what is wrong with it."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeshHealError(
            f"{state_file} cannot be read ({type(err).__name__}): use another --out"
        ) from None
    keys = ("config", "rng", "mean", "sigma", "generation", "best")
    if (
        not isinstance(state, dict)
        or not all(k in state for k in keys)
        or not isinstance(state["config"], dict)
    ):
        raise MeshHealError(
            f"{state_file} is not a search's state (it needs {', '.join(keys)}): use another --out"
        )
    return state


def fit(cfg: FitConfig, evaluator: Evaluator) -> tuple[dict[str, dict], list[dict], float]:
    check_search(cfg)
    base, knobs = base_docs(cfg.pair, start=cfg.start), knobs_for(cfg.pair, cfg.structure)
    dim = sum(k.size for k in knobs)
    origin = encode(base, knobs)
    eta_mu, eta_sigma = 1.0, (3 + math.log(dim)) / (5 * math.sqrt(dim))
    shaped = utilities(cfg.population)

    def score(x: np.ndarray, rows: list[dict]) -> float:
        prior = 0.0 if cfg.pair == "default" else cfg.prior * float(np.sum((x - origin) ** 2))
        return loss(rows, all_primary=cfg.pair != "default") + prior

    state_file = cfg.out / "state.json"
    config = {"population": cfg.population, "fit_seeds": list(cfg.fit_seeds), "sigma": cfg.sigma,
              "difficulty_sigma": cfg.difficulty_sigma,
              "search_seed": cfg.search_seed, "pair": cfg.pair, "prior": cfg.prior,
              "start": str(cfg.start.resolve()) if cfg.start else None, "knobs": [k.name for k in knobs]}  # fmt: skip
    if state_file.exists():
        state = _read_state(state_file)
        if state["config"] != config:
            old = state["config"]
            if "start" not in old:
                raise MeshHealError(f"{state_file} holds a search from before --start and round-2 sharpening "
                                    f"(decisions E11): use a new --out")  # fmt: skip
            differ = sorted(k for k in old.keys() | config.keys() if old.get(k) != config.get(k))
            raise MeshHealError(f"{state_file} holds a search with other settings ({', '.join(differ)} differ): "
                                f"use another --out, or the same settings to resume it")  # fmt: skip
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        mean, sigma, first = np.asarray(state["mean"]), np.asarray(state["sigma"]), state["generation"]
        best = (state["best"]["loss"], state["best"]["docs"], state["best"]["rows"])
        print(f"resumed {state_file} after generation {first}: best loss {best[0]:.2f}", flush=True)
    else:
        rng = np.random.default_rng(cfg.search_seed)
        steps = [cfg.difficulty_sigma if k.clipped else cfg.sigma for k in knobs for _ in range(k.size)]
        mean, sigma, first = origin, np.asarray(steps, float), 0
        start_rows = evaluator.rows([pair_of(decode(mean, base, knobs), cfg.pair)])[0]
        best = (score(mean, start_rows), decode(mean, base, knobs), start_rows)
        print(f"start: loss {best[0]:.2f}", flush=True)
    cfg.out.mkdir(parents=True, exist_ok=True)
    for gen in range(first, cfg.generations):
        clock = time.perf_counter()
        half = rng.standard_normal((cfg.population // 2, dim))
        s = np.concatenate([half, -half])
        candidates = mean + sigma * s
        docs = [decode(c, base, knobs) for c in candidates]
        rows = evaluator.rows([pair_of(d, cfg.pair) for d in docs])
        values = np.array([score(c, r) for c, r in zip(candidates, rows)])
        order = np.argsort(values, kind="stable")
        if values[order[0]] < best[0]:
            best = (float(values[order[0]]), docs[order[0]], rows[order[0]])
        u = np.empty(cfg.population)
        u[order] = shaped
        mean = mean + eta_mu * sigma * (u @ s)
        sigma = sigma * np.exp(0.5 * eta_sigma * (u @ (s * s - 1.0)))
        passing = sum(r["pass"] for r in rows[order[0]])
        state = {"generation": gen + 1, "mean": mean.tolist(), "sigma": sigma.tolist(), "rng": rng.bit_generator.state,
                 "config": config,
                 "best": {"loss": best[0], "docs": best[1], "rows": best[2]}}  # fmt: skip
        runner.write_atomic(state_file, json.dumps(state))
        print(f"generation {gen + 1}: best {values[order[0]]:.2f} ({passing}/{len(rows[0])} targets met), median "
              f"{np.median(values):.2f}, best so far {best[0]:.2f}, mean step {sigma.mean():.3f}, "
              f"{time.perf_counter() - clock:.0f} s", flush=True)  # fmt: skip
    return best[1], best[2], best[0]


TOKEN_TARGETS = ("model tokens per task, healthy", "model tokens per task, degraded")


def scale_tokens(docs: dict[str, dict], rows: list[dict], evaluator: Evaluator, pair: str,
                 rounds: int = 2) -> tuple[dict[str, dict], list[dict]]:  # fmt: skip
    """Scale the completion-token ranges of the fitted files so that tokens per task meet their
    target (51k, both phases). Tokens feed no protocol decision, so this moves no other target;
    prompts grow with the visible part of completions, hence a few fixed-point rounds."""
    for _ in range(rounds):
        measured = [r["measured"]["mean"] for r in rows if r["target"] in TOKEN_TARGETS]
        if not measured:
            break
        factor = float(
            np.mean([r["paper"] for r in rows if r["target"] in TOKEN_TARGETS]) / np.mean(measured)
        )
        docs = copy.deepcopy(docs)
        for role in FITTED[pair]:
            table = docs[role]["completion_tokens"]
            for kind, (lo, hi) in table.items():
                table[kind] = [max(1, round(lo * factor)), max(1, round(hi * factor))]
        rows = evaluator.rows([pair_of(docs, pair)])[0]
        print(f"completion tokens x {factor:.3f}: tokens per task "
              + ", ".join(f"{r['measured']['mean']:,.0f}" for r in rows if r["target"] in TOKEN_TARGETS), flush=True)  # fmt: skip
    return docs, rows


def scan_structure(cfg: FitConfig, evaluator: Evaluator) -> list[dict]:
    """The pair's files with the optional structure parameters (latent difficulty, draft blame) set
    on both models, grid by grid: accuracy per phase, primary targets met, loss, and where the
    degraded phase's accuracy goes."""
    base = base_docs(cfg.pair)
    points = list(
        itertools.product(cfg.scan_spread or (0.0,), cfg.scan_review or (0.0,), cfg.scan_blame or (0.0,))
    )
    pairs = []
    for spread, review, blame in points:
        docs = copy.deepcopy(base)
        for role in ("strong", "weak"):
            docs[role]["difficulty_spread"], docs[role]["review_difficulty"] = spread, review
            docs[role][DRAFT_BLAME] = blame
        pairs.append(pair_of(docs, cfg.pair))
    gaps: list = []
    rows = evaluator.rows(pairs, gaps)
    out = []
    table = new_table(f"Latent difficulty and draft blame on both models, the {cfg.pair} pair's files otherwise "
                      f"(fit seeds {list(cfg.fit_seeds)}, jax engine, slots 1)",
                      "spread", "review", "blame", "acc H", "acc D", "D − H", "MATH H → D", "Takeover w→r", "primary met", "loss",
                      "isolated at onset or never (share, contribution)", "after isolation, visits none")  # fmt: skip
    for (spread, review, blame), r, gap in zip(points, rows, gaps):
        value = {x["target"]: x["measured"]["mean"] for x in r}
        primary = [x for x in r if x["priority"] == "primary"]
        by_part = {g["part"]: g for g in gap}
        # a degraded agent isolated before its onset (falsely), or never: no detection in the stream
        never = {k: by_part[GAP_PARTS[0]][k] + by_part[GAP_PARTS[1]][k] for k in ("share", "contribution")}
        clean = by_part[GAP_PARTS[5]]
        h, d = (
            value["accuracy, healthy phase, mean of 3 datasets"],
            value["accuracy, degraded phase, mean of 3 datasets"],
        )
        table.add_row(f"{spread:g}", f"{review:g}", f"{blame:g}", _num(h, False), _num(d, False), f"{d - h:+.3f}",
                      f"{_num(value['MATH accuracy, healthy phase'], False)} → "
                      f"{_num(value['MATH accuracy, degraded phase'], False)}",
                      _num(value["Takeover on Finalize: wrong->right"], False),
                      f"{sum(x['pass'] for x in primary)}/{len(primary)}", f"{loss(r):.1f}",
                      f"{never['share']:.3f}, {never['contribution']:+.4f}", f"{clean['contribution']:+.4f}")  # fmt: skip
        out.append(
            {
                "difficulty_spread": spread,
                "review_difficulty": review,
                DRAFT_BLAME: blame,
                "rows": r,
                "degraded_gap": gap,
            }
        )
    print_table(table)
    return out


def command_line(cfg: FitConfig) -> str:
    """The search's flags as a command line (what a written file's header names): every setting that
    changes the files, a --start inside this folder written relative to it."""
    start = ""
    if cfg.start is not None:
        where = cfg.start.resolve()
        here = Path.cwd().resolve()
        shown = where.relative_to(here) if where.is_relative_to(here) else where
        start = f" --start {shlex.quote(str(shown))}"
    structure = f" --structure --difficulty-sigma {cfg.difficulty_sigma}" if cfg.structure else ""
    prior = f" --prior {cfg.prior}" if cfg.pair != "default" and cfg.prior != FitConfig.prior else ""
    tokens = " --no-tokens" if cfg.pair == "default" and not cfg.tokens else ""
    return (f"--pair {cfg.pair} --generations {cfg.generations} --population {cfg.population} --sigma {cfg.sigma}"
            f"{structure}{start}{prior}{tokens} --fit-seeds {' '.join(map(str, cfg.fit_seeds))} "
            f"--search-seed {cfg.search_seed}")  # fmt: skip


def body(cfg: FitConfig) -> None:
    check_search(cfg)
    evaluator = Evaluator(cfg.fit_seeds, pair=cfg.pair)
    if cfg.scans():
        result = scan_structure(cfg, evaluator)
        cfg.out.mkdir(parents=True, exist_ok=True)
        runner.write_atomic(cfg.out / "difficulty_scan.json", json.dumps(result, indent=2))
        print(f"wrote {cfg.out / 'difficulty_scan.json'}")
        return
    docs, rows, value = fit(cfg, evaluator)
    if cfg.tokens and cfg.pair == "default":
        docs, rows = scale_tokens(docs, rows, evaluator, cfg.pair)
    print_report(
        rows, f"Best candidate (loss {value:.2f}) on fit seeds {list(cfg.fit_seeds)} (jax engine, slots 1)"
    )
    header = ("Emulator parameters of one MODEL (spec/emulator.md); anchors [0, 0.25, 0.5, 1.0].\n"
              f"Fitted by `python -m meshheal_jax.calibration_fit {command_line(cfg)}`.")  # fmt: skip
    folders = [cfg.out / "model_params"] + ([MODEL_DIR] if cfg.write else [])
    for role in FITTED[cfg.pair]:
        name = PAIRS[cfg.pair][role == "weak"]
        text = dump_model(parse_model(docs[role], name, name), header)
        for folder in folders:  # the search's own folder always; the package's with --write
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.toml").write_text(text)
            print(f"wrote {folder / f'{name}.toml'}")


def cli() -> None:
    entrypoint(
        FitConfig,
        body,
        __doc__,
        "stopped: finished generations are kept in --out (runs/calibration-fit "
        "if you gave none); rerun the same command to resume",
    )


if __name__ == "__main__":
    cli()
