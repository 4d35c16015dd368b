"""`python -m meshheal_jax.calibration_fit`: fit the default pair's model files to spec/emulator.md.

A seeded, repeatable coordinate search over a small set of named knobs of the gpt-oss-120b and
Llama-3.2-1B files. Every evaluation runs the real protocol (reference engine, 3 datasets, the
FIT seeds, which are disjoint from the report's seeds 0..4) and scores the targets of
calibration_report.TARGETS: loss = sum over primary targets of ((measured − paper) / tolerance)²
plus 0.25 × the same for the default pair's secondary targets. Outcomes (detection, false
isolations) are never in the loss. The fitted files are written with a header naming the run.

    python -m meshheal_jax.calibration_fit --rounds 3 --write
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import multiprocessing
import tomllib
from pathlib import Path

import numpy as np

from meshheal_jax import draws as D
from meshheal_jax import metrics, reference
from meshheal_jax.calibration_report import evaluate, print_report, seed_context
from meshheal_jax.cli import entrypoint
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import MODEL_DIR, Pair, dump_model, parse_model
from meshheal_jax.streams import make_stream, persistent_schedule
from meshheal_jax.topology import build_network, load_profile

DATASETS = ("bbh", "math", "mmlu_pro")
STRONG, WEAK = "gpt-oss-120b", "llama-3.2-1b"


def _clip(x: float) -> float:
    return float(min(max(x, 0.0), 1.0))


def _split(mass: float, shares: tuple[float, ...]) -> list[float]:
    return [mass * s for s in shares]


# Each knob: (name, lower, upper, initial step, setter(strong_doc, weak_doc, value)).
def _part_shift(base: dict[str, float], which: str):
    def setter(strong: dict, weak: dict, x: float) -> None:
        doc = strong if which == "strong" else weak
        for dataset, p in base.items():
            doc["p_part"][dataset] = {"default": _clip(p + x)}

    return setter


def _scalar(which: str, key: str):
    def setter(strong: dict, weak: dict, x: float) -> None:
        (strong if which == "strong" else weak)[key] = _clip(x)

    return setter


def _categorical(section: str, role: str, label: str, build):
    def setter(strong: dict, weak: dict, x: float) -> None:
        strong[section][role][label] = [round(p, 6) for p in build(_clip(x))]
        strong[section][role][label][-1] = round(1.0 - sum(strong[section][role][label][:-1]), 6)

    return setter


KNOBS = (
    ("strong_part_shift", -0.15, 0.06, 0.02, _part_shift({"bbh": 0.93, "math": 0.92, "mmlu_pro": 0.90}, "strong")),
    ("strong_p_rescue", 0.0, 0.95, 0.1, _scalar("strong", "p_rescue")),
    ("weak_p_infer", 0.2, 0.98, 0.1, _scalar("weak", "p_infer")),
    ("weak_part_shift", -0.1, 0.4, 0.05, _part_shift({"bbh": 0.20, "math": 0.15, "mmlu_pro": 0.20}, "weak")),
    # strong reviewer judging a strong author's correct part: P(0) (disagreement without alarm)
    ("review_sc_zero", 0.0, 0.3, 0.03,
     _categorical("review", "strong_author", "correct", lambda x: [x, 0.02, 0.04, 0.94 - x])),
    # ... a strong author's wrong part: P(1.0) (plausible errors pass)
    ("review_sw_pass", 0.0, 0.8, 0.08,
     _categorical("review", "strong_author", "wrong", lambda x: _split(1 - x, (0.35, 0.35, 0.30)) + [x])),
    # ... a weak author's correct part: P(1.0)
    ("review_wc_pass", 0.0, 0.8, 0.08,
     _categorical("review", "weak_author", "correct", lambda x: _split(1 - x, (0.5, 0.3, 0.2)) + [x])),
    # ... a weak author's wrong part: P(0)
    ("review_ww_zero", 0.3, 1.0, 0.05,
     _categorical("review", "weak_author", "wrong", lambda x: [x] + _split(1 - x, (0.6, 0.25, 0.15)))),
    ("strong_rho_same", 0.0, 0.95, 0.1, _scalar("strong", "rho_same")),
    ("strong_p_follow", 0.0, 0.9, 0.1, _scalar("strong", "p_follow")),
    # round 2, strong author wrong / correct: pass mass (0.5 and 1.0)
    ("round2_sw_pass", 0.0, 0.9, 0.08,
     _categorical("round2", "strong_author", "wrong", lambda x: _split(1 - x, (0.5, 0.5)) + _split(x, (0.4, 0.6)))),
    ("round2_sc_pass", 0.2, 1.0, 0.08,
     _categorical("round2", "strong_author", "correct", lambda x: _split(1 - x, (0.5, 0.5)) + _split(x, (0.2, 0.8)))),
    # round 2, weak author wrong: fail mass (0 and 0.25)
    ("round2_ww_fail", 0.5, 1.0, 0.04,
     _categorical("round2", "weak_author", "wrong", lambda x: _split(x, (0.7, 0.3)) + _split(1 - x, (0.5, 0.5)))),
    ("strong_p_fix", 0.1, 0.9, 0.08, _scalar("strong", "p_fix")),
)  # fmt: skip


def base_docs(model_dir: Path = MODEL_DIR) -> tuple[dict, dict]:
    return (tomllib.loads((model_dir / f"{STRONG}.toml").read_text()),
            tomllib.loads((model_dir / f"{WEAK}.toml").read_text()))  # fmt: skip


def docs_for(x: np.ndarray, base: tuple[dict, dict]) -> tuple[dict, dict]:
    strong, weak = copy.deepcopy(base[0]), copy.deepcopy(base[1])
    for value, (_, _, _, _, setter) in zip(x, KNOBS):
        setter(strong, weak, float(value))
    return strong, weak


@functools.lru_cache(maxsize=None)
def _stream_inputs(dataset: str, seed: int):
    profile = load_profile(dataset)
    network = build_network(profile)
    stream = make_stream(seed, profile.dataset_id, 504, 7, (1, 253), ("healthy", "degraded"))
    return network, stream, D.stream_draws(seed, profile.dataset_id, 504)


def _run_stream(args) -> dict[str, list[dict]]:
    dataset, seed, strong_doc, weak_doc = args
    network, stream, draws = _stream_inputs(dataset, seed)
    pair = Pair("default", parse_model(strong_doc, STRONG, STRONG), parse_model(weak_doc, WEAK, WEAK))
    schedule = persistent_schedule(6, 504, network.degraded_targets)
    labels = {"method": "meshheal", "dataset": dataset, "pair": "default", "seed": seed}
    engine = reference.ReferenceEngine(network, ProtocolParams(), pair, stream, schedule, draws, labels)
    records = engine.run()
    return {"tasks": records.tasks, "reviews": records.reviews, "states": records.states}


def measure(x: np.ndarray, base, seeds: tuple[int, ...], pool) -> list[dict]:
    strong, weak = docs_for(x, base)
    jobs = [(d, s, strong, weak) for s in seeds for d in DATASETS]
    outs = pool.map(_run_stream, jobs)
    schedule = persistent_schedule(6, 504, (2, 4))
    contexts = []
    for k, seed in enumerate(seeds):
        per_dataset = outs[k * len(DATASETS):(k + 1) * len(DATASETS)]
        frames = {d: {name: metrics.frame(name, o[name]) for name in ("tasks", "reviews", "states")}
                  for d, o in zip(DATASETS, per_dataset)}  # fmt: skip
        contexts.append(seed_context(frames, schedule, ("healthy", "degraded")))
    return evaluate({"default": contexts})


def loss(rows: list[dict]) -> float:
    total = 0.0
    for r in rows:
        mean = r["measured"]["mean"]
        miss = 10.0 if mean is None else (mean - r["paper"]) / r["tolerance"]
        total += (1.0 if r["priority"] == "primary" else 0.25) * miss * miss
    return total


def initial_point() -> np.ndarray:
    """The search's start: pass 1's result (from the issue-2 judgement files, loss 90 -> 31.7),
    moved by hand along the one direction pass 1 could not take in single-knob steps: more
    rescue by a correct strong finalizer with a weaker strong part (both move healthy accuracy,
    in opposite directions)."""
    return np.array([-0.04, 0.85, 0.625, -0.0375, 0.0075, 0.23, 0.28, 0.825, 0.5, 0.375, 0.18, 1.0, 0.89, 0.61])


@dataclasses.dataclass(frozen=True)
class FitConfig:
    rounds: int = 3
    """coordinate-search rounds (each tries ± step on every knob; steps halve after a round)"""
    fit_seeds: tuple[int, ...] = (100, 101, 102, 103, 104)
    """seeds the fit evaluates on (the report uses 0..4)"""
    workers: int = 2
    write: bool = False
    """write the fitted files into meshheal_jax/model_params/"""


def fit(cfg: FitConfig) -> tuple[np.ndarray, list[dict]]:
    base = base_docs()
    x = initial_point()
    steps = np.array([k[3] for k in KNOBS])
    lower, upper = np.array([k[1] for k in KNOBS]), np.array([k[2] for k in KNOBS])
    with multiprocessing.get_context("fork").Pool(cfg.workers) as pool:
        rows = measure(x, base, cfg.fit_seeds, pool)
        best = loss(rows)
        print(f"start: loss {best:.2f}", flush=True)
        for rnd in range(cfg.rounds):
            for k, (name, *_rest) in enumerate(KNOBS):
                for sign in (+1, -1):
                    trial = x.copy()
                    trial[k] = np.clip(x[k] + sign * steps[k], lower[k], upper[k])
                    if trial[k] == x[k]:
                        continue
                    trial_rows = measure(trial, base, cfg.fit_seeds, pool)
                    value = loss(trial_rows)
                    if value < best:
                        x, best, rows = trial, value, trial_rows
                        print(f"round {rnd} {name} -> {x[k]:.4f}: loss {best:.2f}", flush=True)
                        break
            steps = steps / 2
    return x, rows


def body(cfg: FitConfig) -> None:
    x, rows = fit(cfg)
    print("fitted knobs: " + ", ".join(f"{k[0]}={v:.4f}" for k, v in zip(KNOBS, x)))
    print_report(rows, f"Fit on seeds {list(cfg.fit_seeds)} (reference engine)")
    if cfg.write:
        strong, weak = docs_for(x, base_docs())
        header = ("Emulator parameters of one MODEL (spec/emulator.md); anchors [0, 0.25, 0.5, 1.0].\n"
                  f"Fitted by `python -m meshheal_jax.calibration_fit --rounds {cfg.rounds} --write` "
                  f"on seeds {list(cfg.fit_seeds)}.")  # fmt: skip
        for name, doc in ((STRONG, strong), (WEAK, weak)):
            text = dump_model(parse_model(doc, name, name), header)
            (MODEL_DIR / f"{name}.toml").write_text(text)
            print(f"wrote {MODEL_DIR / f'{name}.toml'}")


def cli() -> None:
    entrypoint(FitConfig, body, __doc__)


if __name__ == "__main__":
    cli()
