"""`meshheal_jax.calibrate`: the round trip (perturbed files -> emulated trace -> fit -> twin),
a live-like trace (latent truth stripped: the proxy path), bad input, and the estimators alone.

The round trip runs the JAX engine once per run (6 agents, bbh, 6 seeds x 504 tasks): about
30 s of compilation and a few seconds of simulation; the fit itself takes about a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import scipy.stats
import tyro

from meshheal_jax import calibrate as C
from meshheal_jax import draws as D
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import ANCHORS, MODEL_DIR, PAIRS, load_model, load_pair, parse_model
from meshheal_jax.topology import load_profile

SEEDS = tuple(range(6))
N_TASKS = 504
COVERAGE_95 = 0.85  # share of fitted values inside their 95% interval (nominal 0.95; ~100 values, correlated)


@pytest.fixture(scope="module")
def trip(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("calibrate") / "roundtrip"
    return out, C.roundtrip(out, dataset="bbh", seeds=SEEDS, n_tasks=N_TASKS, n_boot=200, seed=0)


def strip_truth(src: Path, dst: Path) -> Path:
    """What a live run of the same protocol would have written: no latent correctness for parts
    (review and committee calls, Contribute generations / syntheses), part_correct False and
    Contribute correct_before / after False (live_loop's convention); gold-scored final answers
    and the pair's correctness kept."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    shutil.copy(src / "tasks.parquet", dst / "tasks.parquet")
    gold = (pl.col("kind") == "infer") | pl.col("answer_id").is_not_null()
    calls = pl.read_parquet(src / "calls.parquet")
    calls.with_columns(pl.when(gold).then(pl.col("correct")).alias("correct")).write_parquet(
        dst / "calls.parquet"
    )
    finalize = pl.col("action") == "finalize"
    reviews = pl.read_parquet(src / "reviews.parquet").with_columns(
        pl.lit(False).alias("part_correct"),
        pl.when(finalize).then(pl.col("correct_before")).otherwise(False).alias("correct_before"),
        pl.when(finalize).then(pl.col("correct_after")).otherwise(False).alias("correct_after"),
    )
    reviews.write_parquet(dst / "reviews.parquet")
    return dst


# ----------------------------------------------------------------------------------------------
# The round trip


def test_roundtrip_intervals_cover_the_true_values(trip):
    _, report = trip
    rows = report["parameters"]
    elements = sum(r["elements"] for r in rows)
    covered = sum(r["elements_covered"] for r in rows)
    assert elements >= 80  # both models: scalars, categoricals, tokens
    assert covered / elements >= COVERAGE_95, [r for r in rows if not r["covered"]]
    perturbed = {(r["model"], r["parameter"]) for r in rows if r["perturbed"]}
    changes = C.perturbation("bbh")
    estimated = {(m, n) for m, names in changes.items() for n in names if n not in C.OPTIONAL}
    assert (
        perturbed == estimated
    )  # every shift is identified (the structure, 0 in the truth, is not estimated)


def test_intervals_cover_at_their_level_over_independent_round_trips(tmp_path):
    """The intervals are honest: over 20 round trips on disjoint seed sets (8 seeds each, the
    CLI's default), the values inside their 95% interval, pooled and per band of expected events.
    Each bound is three binomial standard errors below 0.95 for the band's count of values
    (~60-850). Measured (`calibrate --roundtrip --roundtrip-repeats 20`): with C4's percentile
    intervals and the third fit command's files, shares from 5-20 events were covered 0.879 of
    the time (239 values: this fails); with decisions C11 0.954. With the current files: 0.953
    with C4's, 0.987 with C11's (all values 0.953 -> 0.966). One trace cannot test this: a 99.9%
    check of its ~100 values would miss one by chance alone in about 1 - 0.999^100 ~ 10% of seed
    sets, even with exact intervals."""
    coverage = C.roundtrip_coverage(tmp_path / "coverage", 20, seeds_per=8, n_boot=200)
    assert coverage["values"] >= 1500
    assert coverage["covered"] / coverage["values"] >= 0.93
    for band in coverage["bands"]:
        sd = np.sqrt(0.95 * 0.05 / band["values"])
        assert band["coverage"] >= 0.95 - 3 * sd, band


def test_roundtrip_twin_reproduces_the_traced_run(trip):
    _, report = trip
    names = {a["quantity"] for a in report["aggregates"]}
    assert {"accuracy (all)", "calls/task (all)", "tokens/task (all)"} <= names
    # twin - traced is within the two runs' sampling noise over streams (one isolation reroutes every
    # later task, so a stream's aggregates, not its tasks, are the independent unit)
    assert all(a["consistent"] for a in report["aggregates"]), report["aggregates"]
    overall = [a for a in report["aggregates"] if a["quantity"].endswith("(all)")]
    for a in overall:  # and close in relative terms over the whole run (a phase alone is noisier)
        assert abs(a["twin"] - a["traced"]) <= 0.05 * abs(a["traced"]), a
    # (`inside`, the twin's point inside the traced run's own interval, is reported, not asserted: it
    # ignores the twin's sampling noise; with these 6 seeds calls and tokens per task land just outside)


def test_twin_check_emulates_the_traced_configuration(trip, tmp_path, capsys):
    """spec/calibrate.md's check on a run folder: the traced run's configuration, read from its
    config.json, emulated with the fitted files; the round trip's own comparison is the same one."""
    out, report = trip
    fitted = shutil.copytree(out / "fitted", tmp_path / "fitted")
    check = C.twin_check([out / "traced"], fitted, n_boot=200, seed=0)
    assert len(check) == 1 and check[0]["experiment"] == "main"
    assert check[0]["aggregates"] == report["aggregates"]
    assert json.loads((fitted / "calibration.json").read_text())["twin_check"] == check
    C.print_twin_check(check, 0.95)
    assert "Twin check" in capsys.readouterr().out and check[0]["streams"] == len(SEEDS) > 1
    one = [{**check[0], "streams": 1, "undetermined": True}]  # one traced stream: intervals of width 0
    C.print_twin_check(one, 0.95)
    said = capsys.readouterr().out
    assert "undetermined: " in said and "holds one stream" in said and "not reproduced" not in said
    assert " NO " not in said and " yes " not in said and " — " in said  # no verdict from width-0 intervals
    bare = tmp_path / "no-config"
    bare.mkdir()
    shutil.copy(out / "traced" / "tasks.parquet", bare)
    with pytest.raises(MeshHealError, match="config.json not found"):
        C.twin_check([bare], fitted)
    # the command checks the configurations before it fits anything
    with pytest.raises(
        MeshHealError, match=r"twin check of .*no-config: its configuration cannot be emulated"
    ):
        C.body(C.CalibrateConfig(run_dirs=(out / "traced", bare), out=tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()


def test_traced_review_scores_are_the_truths_categorical_of_their_uniforms(trip):
    """What the review fits assume, checked on the trace itself: every initial review's first
    sample is the true file's categorical (reviewer model, author role, the part's correctness) of
    the uniform draws.py gives that call (decisions C11: the round trip's misses are not a draw
    that departs from its file)."""
    out, _ = trip
    calls = pl.read_parquet(out / "traced" / "calls.parquet")
    key = ["seed", "t", "visit", "author", "ability"]
    authors = calls.filter(pl.col("kind") == "generate").select(*key, pl.col("model").alias("author_model"))
    reviews = calls.filter(pl.col("kind") == "review")  # a review's samples in the order drawn
    first = reviews.filter(pl.int_range(pl.len()).over(key) == 0).join(authors, on=key)
    dataset_id = load_profile("bbh").dataset_id
    uniforms = {s: D.stream_draws(s, dataset_id, N_TASKS).calls for s in SEEDS}
    files = {load_model(stem, out / "true-params").model: load_model(stem, out / "true-params")
             for stem in ("gpt-oss-120b", "llama-3.2-1b")}  # fmt: skip
    strong = files["openai/gpt-oss-120b"].model
    for row in first.iter_rows(named=True):
        u = uniforms[row["seed"]][row["t"] - 1, row["visit"], D.REVIEW_SAMPLES[0], D.U_MAIN]
        role = "strong_author" if row["author_model"] == strong else "weak_author"
        thresholds = files[row["model"]].review_thresholds(role, row["correct"], 0)
        assert row["score"] == ANCHORS[next(k for k, x in enumerate(thresholds) if u < x)], row
    assert first.height > 4000 and first["model"].n_unique() == 2


def test_roundtrip_reports_what_is_not_identified(trip):
    out, report = trip
    kept = {(k["model"], k["parameter"]) for k in report["not_identified"]}
    for stem in PAIRS["default"]:
        assert {(stem, "p_decide"), (stem, "p_popular_wrong"), (stem, "n_distractors")} <= kept
    doc = json.loads((out / "fitted" / "calibration.json").read_text())
    weak = doc["models"]["llama-3.2-1b"]["parameters"]
    assert weak["p_decide"]["identified"] is False and "decision calls" in weak["p_decide"]["note"]
    assert (
        weak["p_decide"]["value"] is None and weak["p_decide"]["base"] == load_model("llama-3.2-1b").p_decide
    )
    strong = doc["models"]["gpt-oss-120b"]["parameters"]
    assert strong["p_part.bbh.default"]["identified"] and strong["p_part.bbh.default"]["proxy_share"] == 0
    assert strong["p_infer"]["se"] > 0 and strong["p_infer"]["n"] > 1000


def test_fitted_folder_serves_every_pair(trip):
    out, _ = trip
    fitted = out / "fitted"
    assert {p.stem for p in fitted.glob("*.toml")} == {p.stem for p in MODEL_DIR.glob("*.toml")}
    for pair in PAIRS:
        load_pair(pair, fitted)
    header = (fitted / "gpt-oss-120b.toml").read_text().splitlines()[:5]
    assert any(str(out / "traced") in line for line in header)
    assert any("p_decide" in line for line in header)  # names what it kept
    # the fit reads marginal rates under independent draws: its files set the structure to 0 and
    # name the base's values (the shipped gpt-oss file has a review difficulty)
    base = load_model("gpt-oss-120b")
    assert any(
        f"review_difficulty {base.review_difficulty:g}" in line and "Structure set to 0" in line
        for line in header
    )
    assert base.review_difficulty > 0 and load_model("gpt-oss-120b", fitted).review_difficulty == 0.0
    doc = json.loads((fitted / "calibration.json").read_text())
    # intervals beside each value (spec/calibrate.md), the same as calibration.json's
    text = (fitted / "gpt-oss-120b.toml").read_text()
    p_infer = doc["models"]["gpt-oss-120b"]["parameters"]["p_infer"]
    line = next(line for line in text.splitlines() if line.startswith("p_infer = "))
    assert line.endswith(f"  # 95% interval {p_infer['interval']}, n {p_infer['n']}")
    assert float(line.split()[2]) == pytest.approx(p_infer["value"], abs=1e-5)  # written with 5 decimals (C5)
    assert "p_decide = 0.95  # kept from the base file" in text
    assert {(k["model"], k["parameter"]) for k in doc["structure_reset"]} == {
        (m, k) for m in ("gpt-oss-120b", "llama-3.2-1b") for k in ("difficulty_spread", "review_difficulty", "draft_blame")
    }  # fmt: skip
    assert doc["copied"] == ["gemma-3-4b", "llama-3.3-70b"]
    assert (fitted / "gemma-3-4b.toml").read_text() == (MODEL_DIR / "gemma-3-4b.toml").read_text()
    assert doc["truth"] == ["latent truth"]


# ----------------------------------------------------------------------------------------------
# A live-like trace: the proxy path


def test_live_like_trace_uses_gold_and_proxies(trip, tmp_path):
    out, _ = trip
    run = strip_truth(out / "traced", tmp_path / "live-like")
    live, doc = C.calibrate([run], tmp_path / "fit", n_boot=100)
    exact, _ = C.calibrate([out / "traced"], tmp_path / "fit-exact", n_boot=100)
    assert doc["truth"] == ["gold answers + proxies"]
    for stem in PAIRS["default"]:
        a, b = live.estimates[stem], exact.estimates[stem]
        # gold and usage decide these: identical with or without the latent truth
        for name in ("p_infer", "answer_fraction", "completion_tokens.generate", "prompt_tokens.infer"):
            np.testing.assert_array_equal(a[name].value, b[name].value)
        assert not a["p_rescue"].identified and "draft known to be wrong" in a["p_rescue"].note
        assert a["p_part.bbh.default"].proxy == 1.0  # every part label rests on a proxy
    strong = live.estimates["gpt-oss-120b"]
    truth = load_model("gpt-oss-120b", out / "true-params")
    # right answers settle a right part exactly: that categorical needs no proxy and is recovered
    assert strong["review.strong_author.correct"].proxy == 0.0
    true = np.asarray(truth.review[("strong_author", True)])
    np.testing.assert_allclose(strong["review.strong_author.correct"].value, true, atol=0.015)
    # wrong labels rest on the draft proxy; Takeovers are read on Finalize outputs only
    assert strong["review.strong_author.wrong"].proxy == 1.0
    assert strong["p_fix"].n < exact.estimates["gpt-oss-120b"]["p_fix"].n
    # the documented bias: wrong Contribute parts that the committee accepts count as right
    assert strong["p_part.bbh.default"].value > truth.p_part["bbh"]["default"]


# ----------------------------------------------------------------------------------------------
# Bad input


def test_run_folder_without_calls_is_named(trip, tmp_path):
    out, _ = trip
    run = tmp_path / "no-calls"
    run.mkdir()
    for name in ("tasks", "reviews"):
        shutil.copy(out / "traced" / f"{name}.parquet", run / f"{name}.parquet")
    with pytest.raises(MeshHealError, match=r"no-calls/calls\.parquet not found"):
        C.calibrate([run], tmp_path / "fit")


def test_empty_trace_is_refused(trip, tmp_path):
    out, _ = trip
    run = tmp_path / "empty"
    run.mkdir()
    for name in ("tasks", "reviews", "calls"):
        pl.read_parquet(out / "traced" / f"{name}.parquet").clear().write_parquet(run / f"{name}.parquet")
    with pytest.raises(MeshHealError, match=r"calls\.parquet holds no MeshHeal calls"):
        C.calibrate([run], tmp_path / "fit")


def test_other_bad_input(trip, tmp_path):
    out, _ = trip
    with pytest.raises(MeshHealError, match="no run folders"):
        C.calibrate([], tmp_path / "fit")
    with pytest.raises(MeshHealError, match="does not exist"):
        C.calibrate([tmp_path / "nowhere"], tmp_path / "fit")
    top = tmp_path / "scale-top"  # `scale` writes one run folder per topology under its --out
    shutil.copytree(out / "traced", top / "sparse")
    for check in (C.twin_experiments, lambda dirs, fit: C.calibrate(dirs, fit)):
        with pytest.raises(MeshHealError, match=r"scale-top is a folder of run folders, not a run: give those "
                                                 r"\(.*scale-top/sparse\)"):  # fmt: skip
            check([top], tmp_path / "fit")
    with pytest.raises(MeshHealError, match="packaged parameter folder"):
        C.calibrate([out / "traced"], MODEL_DIR)
    run = tmp_path / "unknown-model"
    run.mkdir()
    for name in ("tasks", "reviews"):
        shutil.copy(out / "traced" / f"{name}.parquet", run / f"{name}.parquet")
    calls = pl.read_parquet(out / "traced" / "calls.parquet")
    calls.with_columns(pl.lit("some/other-model").alias("model")).write_parquet(run / "calls.parquet")
    with pytest.raises(MeshHealError, match="some/other-model"):
        C.calibrate([run], tmp_path / "fit")
    with pytest.raises(MeshHealError, match="not empty"):
        C.roundtrip(out)
    with pytest.raises(MeshHealError, match="run folders must be distinct"):
        C.calibrate([out / "traced", out / "traced" / ".." / "traced"], tmp_path / "fit")
    copy = shutil.copytree(out / "traced", tmp_path / "copy-of-traced")
    with pytest.raises(MeshHealError, match="traced and .*copy-of-traced hold the same calls"):
        C.calibrate([out / "traced", copy], tmp_path / "fit")
    with pytest.raises(MeshHealError, match="--min-n must be >= 0, got -1"):
        C.calibrate([out / "traced"], tmp_path / "fit", min_n=-1)
    with pytest.raises(MeshHealError, match="is a run folder"):
        C.calibrate([out / "traced"], out / "traced")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(MeshHealError, match="a-file exists and is not a folder"):
        C.calibrate([out / "traced"], tmp_path / "a-file")
    with pytest.raises(MeshHealError, match="--min-n must be >= 0"):  # a round trip, before it writes
        C.roundtrip(tmp_path / "trip", min_n=-1)
    assert not (tmp_path / "trip").exists()
    for bad, message in (
        (dict(seeds=()), "no seeds given"),
        (dict(n_tasks=50), "multiple of 42, got 50"),
        (dict(dataset="foo"), "foo"),
    ):
        with pytest.raises(MeshHealError, match=message):  # the experiment too, before anything is written
            C.roundtrip(tmp_path / "trip", **bad)
        assert not (tmp_path / "trip").exists()
    (tmp_path / "list-config").mkdir()
    (tmp_path / "list-config" / "config.json").write_text("[]")
    with pytest.raises(MeshHealError, match="is not a run's config.json"):
        C.read_experiment(tmp_path / "list-config")


def test_coverage_study_pools_round_trips_and_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "coverage"
    settings = dict(dataset="bbh", seeds_per=2, n_tasks=252, n_boot=50)
    coverage = C.roundtrip_coverage(out, 2, **settings)
    reports = [json.loads((out / f"rep-{k}" / "roundtrip.json").read_text()) for k in range(2)]
    assert [r["seeds"] for r in reports] == [[0, 1], [2, 3]]  # disjoint seed sets
    values = sum(p["elements"] for r in reports for p in r["parameters"])
    covered = sum(p["elements_covered"] for r in reports for p in r["parameters"])
    assert (coverage["values"], coverage["covered"]) == (values, covered)
    assert sum(b["values"] for b in coverage["bands"]) == values
    twins = [a["consistent"] for r in reports for a in r["aggregates"]]
    assert (coverage["twin_comparisons"], coverage["twin_consistent"]) == (len(twins), sum(twins)) != (0, 0)
    assert {b["band"] for b in coverage["bands"]} <= set(C.BANDS)
    assert json.loads((out / "coverage.json").read_text()) == coverage
    # a rerun reads the finished round trips; an unfinished one is redone
    shutil.rmtree(out / "rep-1" / "fitted")
    (out / "rep-1" / "roundtrip.json").unlink()
    redone = []
    real = C.roundtrip
    monkeypatch.setattr(C, "roundtrip", lambda d, *a, **k: redone.append(d.name) or real(d, *a, **k))
    assert C.roundtrip_coverage(out, 2, **settings) == coverage
    assert redone == ["rep-1"] and "rep-1: unfinished round trip, redone" in capsys.readouterr().out
    (out / "rep-1" / "roundtrip.json").write_text("{bad")  # a damaged report: that round trip redone
    redone.clear()
    assert C.roundtrip_coverage(out, 2, **settings) == coverage
    assert (
        redone == ["rep-1"]
        and "roundtrip.json: unreadable, the round trip is redone" in capsys.readouterr().out
    )
    with pytest.raises(MeshHealError, match=r"other settings .*'n_tasks': \(252, 504\)"):
        C.roundtrip_coverage(out, 2, **{**settings, "n_tasks": 504})
    with pytest.raises(MeshHealError, match="at least 2"):
        C.roundtrip_coverage(tmp_path / "one", 1)
    with pytest.raises(MeshHealError, match="give --roundtrip too"):
        C.body(tyro.cli(C.CalibrateConfig, args=["--roundtrip-repeats", "3", "--out", str(tmp_path / "x")]))
    # a round trip from an older calibrate (no interval method recorded) is named, not pooled
    old = json.loads((out / "rep-0" / "roundtrip.json").read_text())
    del old["intervals"]
    (out / "rep-0" / "roundtrip.json").write_text(json.dumps(old))
    with pytest.raises(MeshHealError, match="other settings .*'intervals': \\(None"):
        C.roundtrip_coverage(out, 2, **settings)


def test_cli_flags():
    cfg = tyro.cli(C.CalibrateConfig, args=["runs/a", "runs/b", "--out", "twin", "--bootstrap", "50"])
    assert (
        cfg.run_dirs == (Path("runs/a"), Path("runs/b")) and cfg.out == Path("twin") and cfg.bootstrap == 50
    )
    assert tyro.cli(C.CalibrateConfig, args=["--roundtrip"]).roundtrip
    assert (
        tyro.cli(C.CalibrateConfig, args=["--roundtrip", "--roundtrip-repeats", "20"]).roundtrip_repeats == 20
    )


# ----------------------------------------------------------------------------------------------
# The estimators alone


def test_bootstrap_weights_resample_within_streams():
    strata = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    w = C.bootstrap_weights(strata, 50, seed=3)
    assert w.shape == (51, 9) and np.all(w[0] == 1)
    for s in range(3):
        assert np.all(w[1:, strata == s].sum(axis=1) == (strata == s).sum())
    np.testing.assert_array_equal(w, C.bootstrap_weights(strata, 50, seed=3))
    assert not np.array_equal(w, C.bootstrap_weights(strata, 50, seed=4))


def test_totals_match_a_grouped_sum():
    rows = pl.DataFrame(
        {"unit": [0, 0, 1, 2, 2], "k": ["a", "b", "a", "a", "b"], "x": [1.0, 2.0, 3.0, 4.0, 5.0]}
    )
    weights = np.array([[1.0, 1.0, 1.0], [2.0, 0.0, 1.0]])
    t = C.totals(rows, ("k",), ("x",), weights)
    np.testing.assert_allclose(t.at("x", k="a"), [8.0, 6.0])
    np.testing.assert_allclose(t.at("x", k="b"), [7.0, 9.0])
    np.testing.assert_allclose(t.at("x"), [15.0, 15.0])


def test_uniform_bounds_from_moments():
    rng = np.random.default_rng(0)
    x = rng.integers(500, 1801, size=20_000).astype(float)
    bounds = C.uniform_bounds(np.array([x.size]), np.array([x.sum()]), np.array([(x * x).sum()]))[0]
    assert abs(bounds[0] - 500) < 10 and abs(bounds[1] - 1800) < 10
    assert np.all(np.isnan(C.uniform_bounds(np.array([1.0]), np.array([5.0]), np.array([25.0]))))


def test_follow_em_recovers_a_known_mixture():
    rng = np.random.default_rng(1)
    first = ([0.0, 0.02, 0.04, 0.94], [0.9, 0.05, 0.03, 0.02])
    second = ([0.0, 0.1, 0.2, 0.7], [0.6, 0.3, 0.05, 0.05])
    counts = np.zeros((1, 2, 4, 4))
    for c in range(2):
        other = rng.choice(4, 20_000, p=first[c])
        own = np.where(rng.random(20_000) < 0.4, other, rng.choice(4, 20_000, p=second[c]))
        np.add.at(counts[0, c], (own, other), 1)
    follow, probs = C.follow_em(counts)
    assert abs(follow[0] - 0.4) < 0.02
    np.testing.assert_allclose(probs[0], np.array(second), atol=0.02)


def test_rho_same_on_a_known_cell():
    probs = np.array([[[0.25, 0.25, 0.25, 0.25]]])  # kappa = 0.25
    rho = 0.6
    pairs = np.array([[2000.0]])
    match = pairs * (rho + (1 - rho) * 0.25)
    np.testing.assert_allclose(C.rho_same(probs, pairs, match), [rho])


def test_effective_clopper_pearson():
    beta = scipy.stats.beta
    # independent draws: n_eff = n, the plain Clopper-Pearson interval of 30 in 100
    low, high = C.effective_clopper_pearson(np.array(0.3), np.sqrt(0.3 * 0.7 / 100), 100, 0.95)
    np.testing.assert_allclose([low, high], [beta.ppf(0.025, 30, 71), beta.ppf(0.975, 31, 70)])
    # twice the binomial standard error (correlated samples): n_eff = 25, so 7.5 events in 25
    low, high = C.effective_clopper_pearson(np.array(0.3), 2 * np.sqrt(0.3 * 0.7 / 100), 100, 0.95)
    np.testing.assert_allclose([low, high], [beta.ppf(0.025, 7.5, 18.5), beta.ppf(0.975, 8.5, 17.5)])
    # a share at exactly 0 or 1: the exact bound at n, whatever the bootstrap's spread (a round-2
    # EM anchor can be exactly 0 with replicates above it)
    for se in (0.0, 0.05):
        low, high = C.effective_clopper_pearson(np.array(0.0), se, 40, 0.95)
        assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 40))
        low, high = C.effective_clopper_pearson(np.array(1.0), se, 40, 0.95)
        assert low == pytest.approx(0.025 ** (1 / 40)) and high == 1.0
    # a categorical's anchors at once, each at its own effective size
    value, se = np.array([0.0, 0.3, 0.7, 0.0]), np.array([0.0, np.sqrt(0.21 / 100), np.sqrt(0.21 / 25), 0.01])
    both = C.effective_clopper_pearson(value, se, 100, 0.95)
    for k in range(4):
        np.testing.assert_allclose(both[k], C.effective_clopper_pearson(value[k], se[k], 100, 0.95))
    np.testing.assert_allclose(both[2], [beta.ppf(0.025, 17.5, 8.5), beta.ppf(0.975, 18.5, 7.5)])
    # n_eff never exceeds n; an undefined share keeps an undefined interval
    tight = C.effective_clopper_pearson(np.array(0.3), 1e-6, 100, 0.95)
    np.testing.assert_allclose(
        tight, C.effective_clopper_pearson(np.array(0.3), np.sqrt(0.21 / 100), 100, 0.95)
    )
    assert np.all(np.isnan(C.effective_clopper_pearson(np.array(np.nan), np.nan, 100, 0.95)))


def test_binomial_interval_holds_the_effective_clopper_pearson():
    """A share's percentile interval from few events is too narrow (docs/decisions.md C11): it is
    widened to the Clopper-Pearson interval at the bootstrap's effective sample size."""
    rng = np.random.default_rng(0)
    reps = np.concatenate([[0.05], rng.binomial(60, 0.05, size=200) / 60])  # 3 events in 60
    e = C.Estimate(reps=reps, n=60, binomial=True)
    exact = C.effective_clopper_pearson(reps[0], e.se, 60, 0.95)
    percentile = np.percentile(reps[1:], [2.5, 97.5])
    np.testing.assert_allclose(e.interval(0.95), [min(percentile[0], exact[0]), max(percentile[1], exact[1])])
    assert exact[1] > percentile[1]  # here the exact interval is the wider one
    # round 2's share counts only its fresh draws (trials), not the followed judgements
    fewer = C.Estimate(reps=reps, n=60, binomial=True, trials=20)
    assert fewer.interval(0.95)[1] >= e.interval(0.95)[1]
    plain = C.Estimate(reps=reps, n=60)  # not a share: the percentile interval alone
    np.testing.assert_allclose(plain.interval(0.95), np.percentile(reps[1:], [2.5, 97.5]))


def test_named_values_round_trip_through_a_file():
    model = load_model("gpt-oss-120b")
    changed = C.with_values(model, {
        "p_fix": 0.123456789, "p_part.bbh.navigate": 0.5, "review.weak_author.wrong": (0.3, 0.3, 0.2, 0.2000004),
        "completion_tokens.review": (10.4, 99.6), "prompt_tokens.synthesis": 812.2,
    })  # fmt: skip
    assert C.value_of(changed, "p_fix") == pytest.approx(0.12346)
    assert (
        C.value_of(changed, "p_part.bbh.navigate") == 0.5
        and C.value_of(changed, "p_part.bbh.geometric_shapes") == model.p_part["bbh"]["default"]
    )
    assert sum(C.value_of(changed, "review.weak_author.wrong")) == pytest.approx(1.0, abs=1e-12)
    assert C.value_of(changed, "completion_tokens.review") == (10, 100)
    import tomllib

    reparsed = parse_model(tomllib.loads(C.dump_model(changed)), "gpt-oss-120b", "test")
    assert reparsed.review == changed.review and reparsed.p_part == changed.p_part
    with pytest.raises(MeshHealError, match="unknown parameter"):
        C.value_of(model, "p_nothing")


def test_twin_check_counts_questions_on_the_fits_basis(tmp_path):
    """A trace whose questions were counted from real texts (--data sample: BBH's sample questions
    are ~90 tokens against the profile's mean of 260): the fit takes prompt bases net of the
    profile's mean, so the twin counts every question as that mean. An inference call's prompt is
    its base plus the question alone, so its mean is where the basis shows: the twin's is within
    5% of the traced run's (a twin counting the real texts again was 19% short)."""
    from meshheal_jax import runner

    exp = runner.Experiment(name="main", datasets=("bbh",), pairs=("default",), seeds=(0, 1), n_tasks=252,
                            live=runner.LiveSettings((), (), data="sample"))  # fmt: skip
    with pytest.warns(UserWarning, match="drawing with replacement"):  # 5 sample questions per type
        runner.run(exp, tmp_path / "traced", progress=False)
    C.calibrate([tmp_path / "traced"], tmp_path / "fit", n_boot=20)
    (check,) = C.twin_check([tmp_path / "traced"], tmp_path / "fit", n_boot=20)

    def infer_prompt(folder: Path) -> float:
        return (
            pl.read_parquet(folder / "calls.parquet")
            .filter(pl.col("kind") == "infer")["prompt_tokens"]
            .mean()
        )

    traced, twin = infer_prompt(tmp_path / "traced"), infer_prompt(Path(check["twin"]))
    assert abs(twin - traced) <= 0.05 * traced, (traced, twin)
