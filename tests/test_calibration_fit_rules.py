"""calibration_fit's documented rules, checked without running the protocol: a stand-in evaluator
scores each candidate on one of its own parameters. The SNES step (module docstring; Schaul et al.
2011), the best candidate, the score (loss + prior, decisions R4), the settings a fit refuses, the
seeded search, what `--write` and `--no-tokens` change, and the command a written file's header
names; and two rules of its calibration_report helpers (loss, evaluate): rules a mutation of
calibration_fit or of those helpers passed every other test with (a mutation pass over
calibration_fit; the step-size refusals and a degraded_gap case it found sit in
tests/test_calibration.py's tests of the same things)."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections import defaultdict
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import tyro

from meshheal_jax import calibration_fit as fit
from meshheal_jax.calibration_report import evaluate, loss
from meshheal_jax.errors import MeshHealError

START = fit.MODEL_DIR / "fit_start"
TARGET = "pair B: accuracy, degraded phase, mean of 3"


class OneKnobEvaluator:
    """Stands in for fit.Evaluator: one row per candidate, pair B's one target measured as the strong
    model's p_infer (no protocol run); `calls`: the number of candidates of each call."""

    def __init__(self, paper: float, priority: str = "secondary"):
        self.paper, self.priority, self.calls = paper, priority, []

    def rows(self, pairs, gaps=None):
        self.calls.append(len(pairs))
        return [[self.row(p.strong.p_infer)] for p in pairs]

    def row(self, measured: float) -> dict:
        return {"priority": self.priority, "target": TARGET, "pair": "B", "paper": self.paper,
                "tolerance": 0.03, "measured": {"mean": measured, "std": None},
                "pass": abs(measured - self.paper) <= 0.03}  # fmt: skip


@pytest.fixture
def decoded(monkeypatch) -> list[np.ndarray]:
    """Every coordinate vector fit.decode is given, in order."""
    seen, real = [], fit.decode

    def spy(x, base, knobs=fit.KNOBS, sharpen=True):
        seen.append(np.array(x, float))
        return real(x, base, knobs, sharpen)

    monkeypatch.setattr(fit, "decode", spy)
    return seen


def pair_b(tmp_path, **settings) -> fit.FitConfig:
    return fit.FitConfig(
        **{"pair": "B", "start": START, "fit_seeds": (100,), "out": tmp_path / "fit", **settings}
    )


def origin_of(cfg: fit.FitConfig) -> np.ndarray:
    return fit.encode(fit.base_docs(cfg.pair, start=cfg.start), fit.knobs_for(cfg.pair, cfg.structure))


def start_p_infer(cfg: fit.FitConfig) -> float:
    return fit.base_docs(cfg.pair, start=cfg.start)["strong"]["p_infer"]


def test_a_generation_draws_mirrored_candidates_about_the_mean(tmp_path, decoded):
    """Module docstring: a Gaussian with a mean and one step size per coordinate (FitConfig.sigma at
    first); each generation draws `population` candidates (mirrored): the second half is the first
    half reflected through the mean."""
    cfg = pair_b(tmp_path, population=6, generations=1)
    fit.fit(cfg, OneKnobEvaluator(0.99))
    candidates, origin = np.array(decoded[-6:]), origin_of(cfg)
    assert not np.allclose(candidates[:3], candidates[3:])
    assert np.allclose(candidates[:3] + candidates[3:], 2 * origin, atol=1e-12)
    steps = (candidates[:3] - origin) / cfg.sigma  # 3 x 33 standard normal draws
    assert 0.8 < np.std(steps) < 1.2 and abs(np.mean(steps)) < 0.2


def test_a_generation_moves_the_mean_and_step_sizes_by_the_snes_update(tmp_path, decoded):
    """Module docstring (SNES, Schaul et al. 2011): candidates ranked best first get the utilities
    max(0, ln(n/2 + 1) - ln k) / sum - 1/n; mean += sigma * sum u_k s_k (eta_mu 1) and
    sigma *= exp(eta_sigma / 2 * sum u_k (s_k^2 - 1)), eta_sigma = (3 + ln d) / (5 sqrt d). The
    one scored coordinate (p_infer, below its target) moves up."""
    cfg = pair_b(tmp_path, population=4, generations=1)
    ev = OneKnobEvaluator(0.99)
    fit.fit(cfg, ev)
    origin = origin_of(cfg)
    x = np.array(decoded[-4:])
    s = (x - origin) / cfg.sigma
    measured = [fit.pair_of(fit.decode(c, fit.base_docs("B", start=START), fit.knobs_for("B")), "B").strong.p_infer
                for c in x]  # fmt: skip
    values = [
        loss([ev.row(m)], all_primary=True) + cfg.prior * np.sum((c - origin) ** 2)
        for c, m in zip(x, measured)
    ]
    raw = np.maximum(0.0, math.log(4 / 2 + 1) - np.log([1, 2, 3, 4]))
    u = np.empty(4)
    u[np.argsort(values)] = raw / raw.sum() - 1 / 4
    dim = len(origin)
    state = json.loads((cfg.out / "state.json").read_text())
    assert np.allclose(state["mean"], origin + cfg.sigma * (u @ s), atol=1e-12)
    eta_sigma = (3 + math.log(dim)) / (5 * math.sqrt(dim))
    assert np.allclose(state["sigma"], cfg.sigma * np.exp(0.5 * eta_sigma * (u @ (s * s - 1))), atol=1e-12)
    knob = [k.name for k in fit.knobs_for("B")].index("strong.p_infer")
    assert state["mean"][knob] > origin[knob]  # towards the target


def test_the_best_candidate_is_the_lowest_score_seen_the_start_included(tmp_path):
    """fit returns the best candidate seen (FitConfig.out: "the best candidate's files"): the start
    files when no candidate beats them (a target at the start's own value), else the candidate of
    the lowest score."""
    at_start = pair_b(tmp_path, population=4, generations=1)
    docs, rows, value = fit.fit(at_start, OneKnobEvaluator(start_p_infer(at_start)))
    assert docs == fit.decode(origin_of(at_start), fit.base_docs("B", start=START), fit.knobs_for("B"))
    assert value == pytest.approx(loss(rows, all_primary=True)) and value < 1e-6
    far = pair_b(tmp_path / "far", population=4, generations=1)
    docs, rows, value = fit.fit(far, OneKnobEvaluator(0.99))
    assert value < loss([OneKnobEvaluator(0.99).row(start_p_infer(far))], all_primary=True)
    assert docs["strong"]["p_infer"] > start_p_infer(far)


def test_pairs_a_and_b_score_their_target_as_primary_plus_the_prior(tmp_path, decoded):
    """docs/calibration.md "Loss" and decisions R4: pairs A and B score their one (secondary) target
    as a primary one (z^2 and the hinge), plus prior x the squared distance from the start."""
    cfg = pair_b(tmp_path, population=4, generations=1)
    docs, rows, value = fit.fit(cfg, OneKnobEvaluator(0.99))
    origin, candidates = origin_of(cfg), decoded[-4:]
    chosen = [
        c for c in candidates if fit.decode(c, fit.base_docs("B", start=START), fit.knobs_for("B")) == docs
    ]
    assert len(chosen) == 1 and rows[0]["priority"] == "secondary"
    distance = float(np.sum((chosen[0] - origin) ** 2))
    assert distance > 0.0
    assert value == pytest.approx(loss(rows, all_primary=True) + cfg.prior * distance, rel=1e-12)


def test_the_default_pair_scores_its_targets_without_a_prior(tmp_path, decoded):
    """FitConfig.prior: "pairs A and B only"; the default pair's score is the loss of its rows."""
    cfg = fit.FitConfig(population=2, generations=1, fit_seeds=(100,), out=tmp_path / "fit")
    docs, rows, value = fit.fit(cfg, OneKnobEvaluator(0.99, priority="primary"))
    assert docs != fit.decode(decoded[0], fit.base_docs(), fit.knobs_for("default"))  # a candidate won
    assert value == pytest.approx(loss(rows), rel=1e-12)


def test_zero_generations_is_a_fit_that_returns_the_start_files(tmp_path):
    """check_search: "--generations must be >= 0": 0 is allowed and evaluates the start only."""
    cfg = pair_b(tmp_path, generations=0)
    ev = OneKnobEvaluator(0.99)
    docs, _, _ = fit.fit(cfg, ev)
    assert ev.calls == [1]
    assert docs["strong"]["p_infer"] == pytest.approx(start_p_infer(cfg), abs=1e-6)


def test_the_search_seed_chooses_the_candidates(tmp_path, decoded):
    """FitConfig.search_seed: the seed of the search's own random draws (the same seed, the same
    candidates; another seed, others)."""
    for k, seed in enumerate((0, 0, 1)):
        fit.fit(
            pair_b(tmp_path / str(k), population=2, generations=1, search_seed=seed), OneKnobEvaluator(0.99)
        )
    # each fit decodes its start twice, then its 2 candidates
    first, again, other = (decoded[k * 4 + 2] for k in range(3))
    assert np.array_equal(first, again) and not np.allclose(first, other)


def test_a_rerun_with_other_settings_is_refused_not_resumed(tmp_path):
    """FitConfig.out: a rerun with the same folder resumes from its state.json, which is the search
    of the same settings only; one with other settings is refused, naming them."""
    fit.fit(pair_b(tmp_path, population=2, generations=1), OneKnobEvaluator(0.99))
    with pytest.raises(MeshHealError, match=r"other settings \(population, sigma differ\)"):
        fit.fit(pair_b(tmp_path, population=4, sigma=0.2, generations=2), OneKnobEvaluator(0.99))
    # another search seed too: a resumed search must be what its command gives ("Seeded: the same
    # command gives the same files", module docstring)
    with pytest.raises(MeshHealError, match=r"other settings \(search_seed differ\)"):
        fit.fit(pair_b(tmp_path, population=2, generations=2, search_seed=1), OneKnobEvaluator(0.99))
    state = json.loads((tmp_path / "fit" / "state.json").read_text())
    del state["config"]["start"]
    (tmp_path / "fit" / "state.json").write_text(json.dumps(state))
    with pytest.raises(MeshHealError, match=r"before --start and round-2 sharpening \(decisions E11\)"):
        fit.fit(pair_b(tmp_path, population=2, generations=2), OneKnobEvaluator(0.99))


def test_start_replaces_only_the_files_the_pair_fits():
    """base_docs and FitConfig.pair: with --start, pair B's strong file (the one its fit changes) is
    read from the start folder; its weak file is the default pair's, already fitted."""
    shipped, started = fit.base_docs("B"), fit.base_docs("B", start=START)
    assert started["weak"] == shipped["weak"]
    assert started["strong"] != shipped["strong"]
    assert started["strong"] == fit.tomllib.loads((START / "llama-3.3-70b.toml").read_text())


def test_a_round2_row_already_sharper_stays_as_it_is():
    """sharpen_round2: rows that already are at least as sharp as round 1 stay as they are
    (decisions E11: "a row that is already sharper is left as it is")."""
    doc = fit.base_docs()["strong"]
    doc["review"]["strong_author"]["correct"] = [0.1, 0.1, 0.3, 0.5]
    row = [0.0, 0.05, 0.1234567, 0.8265433]  # right verdict 0.95 >= 0.8, more than 6 decimals
    doc["round2"]["strong_author"]["correct"] = list(row)
    fit.sharpen_round2(doc)
    assert doc["round2"]["strong_author"]["correct"] == row


def test_loss_hinge_takes_the_distance_either_side_and_all_primary_weighs_secondaries():
    """calibration_fit's loss (module docstring, decisions R4): 10 max(|z| - 0.6, 0)^2 on a primary
    target below its paper value too; `all_primary` (pairs A and B) weighs a secondary row so."""
    row = {"priority": "primary", "paper": 0.5, "tolerance": 0.1, "measured": {"mean": 0.4}}
    assert loss([row]) == pytest.approx(1.0 + 10 * 0.4**2)
    secondary = dict(row, priority="secondary")
    assert loss([secondary]) == pytest.approx(0.25)
    assert loss([secondary], all_primary=True) == pytest.approx(1.0 + 10 * 0.4**2)


class FakeEvaluator(OneKnobEvaluator):
    """fit.Evaluator's stand-in for `body`: OneKnobEvaluator's row, and the default pair's token
    targets measured as 20 x the strong model's largest completion-token bound. `made`: every one
    made (the package fixture empties it)."""

    made: ClassVar[list[FakeEvaluator]] = []

    def __init__(self, seeds, pair="default"):
        super().__init__(0.99, "primary")
        FakeEvaluator.made.append(self)

    def rows(self, pairs, gaps=None):
        self.calls.append(len(pairs))
        tokens = [
            {"priority": "secondary", "target": t, "pair": "default", "paper": 51_000, "tolerance": 5_000,
             "measured": {"mean": 20.0 * max(hi for _, hi in p.strong.completion_tokens.values()), "std": None},
             "pass": False}
            for p in pairs for t in fit.TOKEN_TARGETS
        ]  # fmt: skip
        return [[self.row(p.strong.p_infer), *tokens[2 * k : 2 * k + 2]] for k, p in enumerate(pairs)]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """body with FakeEvaluator and the package's model folder moved to tmp_path / "package"."""
    monkeypatch.setattr(fit, "Evaluator", FakeEvaluator)
    monkeypatch.setattr(FakeEvaluator, "made", [])
    monkeypatch.setattr(fit, "MODEL_DIR", tmp_path / "package")
    return tmp_path / "package"


def test_write_adds_the_package_folder_to_the_search_folder(tmp_path, package):
    """FitConfig.write: the best files are always written into OUT/model_params/, and with --write
    also into the package's folder (the same text); without it the package is not touched."""
    settings = dict(generations=0, fit_seeds=(100,), tokens=False)
    fit.body(fit.FitConfig(out=tmp_path / "a", **settings))
    assert sorted(p.name for p in (tmp_path / "a" / "model_params").iterdir()) == [
        "gpt-oss-120b.toml",
        "llama-3.2-1b.toml",
    ]
    assert not package.exists()
    fit.body(fit.FitConfig(out=tmp_path / "b", write=True, **settings))
    for name in ("gpt-oss-120b.toml", "llama-3.2-1b.toml"):
        assert (package / name).read_text() == (tmp_path / "b" / "model_params" / name).read_text()


def test_the_token_ranges_are_scaled_to_the_target_unless_no_tokens(tmp_path, package):
    """FitConfig.tokens and scale_tokens: after the default pair's search, its completion-token
    ranges are scaled so that tokens per task meet their 51k target, in two fixed-point rounds
    (docs/calibration.md "Tokens"); --no-tokens keeps them."""
    shipped = fit.base_docs()["strong"]["completion_tokens"]
    for tokens in (False, True):
        out = tmp_path / str(tokens)
        fit.body(fit.FitConfig(out=out, generations=0, fit_seeds=(100,), tokens=tokens))
        written = fit.tomllib.loads((out / "model_params" / "gpt-oss-120b.toml").read_text())
        assert (written["completion_tokens"] == shipped) is not tokens
        assert FakeEvaluator.made[-1].calls == ([1, 1, 1] if tokens else [1])  # the start, then each round
    measured = 20.0 * max(hi for _, hi in written["completion_tokens"].values())
    assert measured == pytest.approx(51_000, rel=0.002)


@pytest.mark.parametrize(
    "settings",
    [
        dict(structure=True, difficulty_sigma=0.9, search_seed=3, fit_seeds=(100, 104)),
        dict(pair="B", prior=0.05, population=16, generations=12, sigma=0.2, start=START),
        dict(tokens=False, generations=8, sigma=0.1),
        dict(pair="A", start=Path("/tmp/fit start's files")),  # quoted: a space and a quote parse back
    ],
)
def test_a_written_files_command_gives_the_same_settings(settings):
    """command_line: the header of a written file names "every setting that changes the files", so
    the command it names parses back to the same search (output folder and --write aside)."""
    cfg = fit.FitConfig(**settings)
    parsed = tyro.cli(fit.FitConfig, args=shlex.split(fit.command_line(cfg)))
    assert (parsed.start and parsed.start.resolve()) == (cfg.start and cfg.start.resolve())
    assert dataclasses.replace(parsed, start=cfg.start) == cfg


def test_encode_floors_certain_probabilities_and_reads_absent_structure_as_neutral():
    """docs/calibration.md: the search decodes its start "zero probabilities floored at 0.001" (FLOOR:
    a logit of 0 or 1 is infinite), at either end and in a categorical; decisions E9, E10: a file
    without difficulty_spread, review_difficulty or draft_blame holds 0, the independent model."""
    docs = fit.base_docs()
    docs["strong"].update(p_infer=1.0, p_rescue=0.0)
    docs["strong"]["review"]["strong_author"]["correct"] = [0.0, 0.0, 0.2, 0.8]
    for key in ("difficulty_spread", "review_difficulty", "draft_blame"):
        docs["strong"].pop(key, None)
    knobs = fit.knobs_for("default", structure=True)
    x = {}
    for knob, value in zip(knobs, np.split(fit.encode(docs, knobs), np.cumsum([k.size for k in knobs])[:-1])):
        x[knob.name] = list(value)
    assert x["strong.p_infer"] == pytest.approx([math.log(0.999 / 0.001)])
    assert x["strong.p_rescue"] == pytest.approx([math.log(0.001 / 0.999)])
    assert [x[f"strong.{k}"] for k in ("difficulty_spread", "review_difficulty", "draft_blame")] == [
        [0.0]
    ] * 3
    assert x["strong.review.strong_author.correct"] == pytest.approx(
        np.log([0.001 / 0.8, 0.001 / 0.8, 0.2 / 0.8])
    )


class Stop(Exception):
    pass


class Recorder:
    """An evaluator that keeps the pairs it is given and stops the command there."""

    def __init__(self):
        self.pairs = []

    def rows(self, pairs, gaps=None):
        self.pairs += pairs
        raise Stop


@pytest.mark.parametrize(
    "axes, point",
    [(dict(scan_spread=(0.5,)), (0.5, 0.0, 0.0)), (dict(scan_blame=(0.3,)), (0.0, 0.0, 0.3))],
)
def test_a_scan_sets_its_point_on_both_models_and_an_axis_left_out_to_0(axes, point):
    """FitConfig.scan_spread: the pair's files with every (difficulty_spread, review_difficulty,
    draft_blame) of the grid set on both models; an axis left out is 0 (the shipped files hold
    gpt-oss review_difficulty 1.91 and Llama-1B draft_blame 0.24: docs/calibration.md)."""
    ev = Recorder()
    with pytest.raises(Stop):
        fit.scan_structure(fit.FitConfig(fit_seeds=(100,), **axes), ev)
    (pair,) = ev.pairs
    for model in (pair.strong, pair.weak):
        assert (model.difficulty_spread, model.review_difficulty, model.draft_blame) == point, model.name


def test_a_generation_runs_in_as_few_batches_of_at_most_max_streams_as_hold_it(monkeypatch):
    """Evaluator.rows: "as few batches of at most MAX_STREAMS streams as hold every candidate" (a
    batch of 32 fit seeds x 24 candidates ran out of memory: docs/calibration.md "Evaluation")."""
    ev = fit.Evaluator((100, 101), ("bbh",))  # 2 streams a candidate
    batches = []
    monkeypatch.setattr(ev, "_rows", lambda pairs, gaps: batches.append(len(pairs)) or [[k] for k in pairs])
    monkeypatch.setattr(fit, "MAX_STREAMS", 5)  # 2 candidates a batch
    assert ev.rows(list(range(5))) == [[k] for k in range(5)]
    assert batches == [2, 2, 1]


def test_decode_sharpens_the_searched_models_only():
    """decode: "with `sharpen`, the round-2 rows of each searched model made at least as sharp as its
    round 1" (decisions E11); pair B's weak file is the default pair's, evaluated as it is."""
    base = fit.base_docs("B")
    blunt = [0.0, 0.0, 0.5, 0.5]  # never flags a wrong output
    base["weak"]["round2"]["weak_author"]["wrong"] = blunt
    base["strong"]["round2"]["weak_author"]["wrong"] = blunt
    knobs = tuple(k for k in fit.knobs_for("B") if k.path[0] != "round2")  # strong round 2: no coordinate
    docs = fit.decode(fit.encode(base, knobs), base, knobs)
    assert docs["weak"]["round2"]["weak_author"]["wrong"] == blunt
    assert docs["strong"]["round2"]["weak_author"]["wrong"] != blunt


def test_the_coordinates_are_the_documented_ones():
    """docs/calibration.md "Coordinates": 54 for the default pair (per model p_part of each dataset,
    p_infer, p_rescue, rho_same, p_follow, p_fix, p_keep, the review categoricals, the strong model's
    round-2 ones: the weak model's round-2 rows are not fitted, only sharpened); with --structure 60."""
    knobs = fit.knobs_for("default")
    assert sum(k.size for k in knobs) == 54
    assert sum(k.size for k in fit.knobs_for("default", structure=True)) == fit.DIM == 60
    names = {k.name for k in knobs}
    assert {f"{m}.p_part.{d}" for m in ("strong", "weak") for d in ("bbh", "math", "mmlu_pro")} <= names
    assert not [n for n in names if n.startswith("weak.round2")]


def test_the_structure_coordinates_start_with_their_own_step_size(tmp_path, decoded):
    """FitConfig.difficulty_sigma: the initial step size of the clipped structure coordinates (sigma:
    of every other one): the same seed with twice the difficulty step moves those twice as far."""
    steps = []
    for k, difficulty_sigma in enumerate((0.6, 1.2)):
        cfg = pair_b(
            tmp_path / str(k), population=2, generations=1, structure=True, difficulty_sigma=difficulty_sigma
        )
        fit.fit(cfg, OneKnobEvaluator(0.99))
        steps.append(decoded[-2] - origin_of(cfg))
    clipped = np.concatenate([[k.clipped] * k.size for k in fit.knobs_for("B", structure=True)])
    assert clipped.sum() == 3 and np.all(steps[0][clipped] != 0.0)
    assert np.allclose(steps[1][clipped], 2 * steps[0][clipped]) and np.allclose(
        steps[1][~clipped], steps[0][~clipped]
    )


def test_a_target_met_at_the_edge_of_its_tolerance_passes():
    """calibration_report (module docstring): a target passes when the mean is within its tolerance;
    0.86 against 0.89 +- 0.03 is (0.89 - 0.86 is 0.030000000000000027 in floating point)."""
    context = {"audit": defaultdict(lambda: 0.86), "streams": {"bbh": defaultdict(lambda: 0.86)}}
    rows = {r["target"]: r for r in evaluate({"default": [context]})}
    assert rows["mean q0, healthy-author outputs"]["pass"]
    assert not rows["mean q0, degraded-author outputs"]["pass"]  # 0.08 +- 0.03
