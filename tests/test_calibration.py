"""The calibration report on the default files, and the fit's knobs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from meshheal_jax import calibration_fit as fit
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import (
    PAIRS,
    ModelFileWarning,
    blunt_round2,
    load_model,
    parse_model,
    right_verdicts,
    sharpened,
)

# Primary targets the fitted default files do NOT meet on the report seeds 0..4. Each would be a
# documented conflict (docs/calibration.md); this list must shrink, never hide. Empty since the
# fourth fit command (nineteenth session): the degraded phase passes narrowly, 0.821 against a
# lower bound of 0.819 (other seed sets miss it: docs/calibration.md).
KNOWN_PRIMARY_FAILURES: set[str] = set()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal")
    proc = subprocess.run(
        [sys.executable, "-m", "meshheal_jax.calibration_report", "--pairs", "default", "--quiet",
         "--out", str(out / "run"), "--json-out", str(out / "report.json")],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    data = json.loads((out / "report.json").read_text())
    # the run folder named last, as every experiment does
    assert proc.stdout.rstrip().endswith(f"results: {out / 'run'}")
    return proc, data["targets"], data["degraded_gap"]


def test_report_prints_every_target(report):
    proc, rows, _ = report
    assert "mean q0, healthy-author outputs" in proc.stdout
    assert {r["priority"] for r in rows} == {"primary", "secondary"}
    assert sum(r["priority"] == "primary" for r in rows) == 15
    for r in rows:
        assert r["measured"]["n_defined"] == 5, r["target"]


def test_exit_status_follows_primary_targets(report):
    proc, rows, _ = report
    failed = {r["target"] for r in rows if r["priority"] == "primary" and not r["pass"]}
    assert proc.returncode == (1 if failed else 0)


def test_primary_failures_are_exactly_the_documented_conflicts(report):
    _, rows, _ = report
    failed = {r["target"] for r in rows if r["priority"] == "primary" and not r["pass"]}
    assert failed == KNOWN_PRIMARY_FAILURES


def test_degraded_gap_parts_sum_to_the_phase_difference(report):
    proc, rows, gap = report
    assert "Where the degraded phase's accuracy goes" in proc.stdout
    *parts, total = gap
    assert sum(p["tasks"] for p in parts) == total["tasks"] == 5 * 3 * 252
    assert sum(p["contribution"] for p in parts) == pytest.approx(total["contribution"], abs=1e-12)
    acc = {r["target"]: r["measured"]["mean"] for r in rows}
    d = acc["accuracy, degraded phase, mean of 3 datasets"]
    h = acc["accuracy, healthy phase, mean of 3 datasets"]
    assert total["contribution"] == pytest.approx(d - h, abs=1e-12)  # equal phases: pooled = mean of streams


def test_degraded_gap_on_a_hand_built_stream():
    from meshheal_jax.calibration_report import degraded_gap
    from meshheal_jax.streams import persistent_schedule

    schedule = persistent_schedule(6, 8, (2, 4))  # degraded from task 5 (the midpoint)
    labels = {"dataset": "bbh", "pair": "default", "seed": 0}
    tasks = pl.DataFrame({**{k: [v] * 8 for k, v in labels.items()}, "t": list(range(1, 9)),
                          "phase": [0, 0, 0, 0, 1, 1, 1, 1], "route": ["0", "1", "0-1", "3", "2-0", "1", "4", "0"],
                          "correct": [True, True, True, False, False, True, False, True]})  # fmt: skip
    # A5 isolated at t3 (before it degraded: not a detection) and released at t4, A3 isolated at
    # t5, A5 again at t6
    states = pl.DataFrame({**{k: [v] * 4 for k, v in labels.items()}, "t": [3, 4, 5, 6], "agent": [4, 4, 2, 4],
                           "to": ["isolated", "watched", "isolated", "isolated"]})  # fmt: skip
    *parts, total = degraded_gap(tasks, states, schedule)
    # H = 3/4; t_all = 6 (the later of the two isolations): t5 before, visits A3 (wrong); t6 before,
    # clean (right); t7 after, visits A5 (wrong); t8 after, clean (right)
    assert [(p["tasks"], p["accuracy"]) for p in parts] == [
        (0, None),
        (0, None),
        (1, 0.0),
        (1, 1.0),
        (1, 0.0),
        (1, 1.0),
    ]
    assert [p["contribution"] for p in parts] == [
        0.0,
        0.0,
        0.25 * -0.75,
        0.25 * 0.25,
        0.25 * -0.75,
        0.25 * 0.25,
    ]
    assert total["contribution"] == pytest.approx(0.5 - 0.75)
    # without the release, A5 is still isolated when it degrades (falsely isolated while healthy):
    # the stream's degraded phase is the first part, whatever A3 does
    *parts, _ = degraded_gap(tasks, states.filter(pl.col("t") != 4), schedule)
    assert [(p["tasks"], p["accuracy"]) for p in parts] == [(4, 0.5)] + [(0, None)] * 5
    # only A3 ever isolated: the stream is in "degraded agents not both isolated by the stream's
    # end" (the parts go "by whether every degraded agent had been isolated at least once since it
    # degraded"), whatever its routes
    *parts, total = degraded_gap(tasks, states.filter(pl.col("agent") == 2), schedule)
    assert [p["tasks"] for p in parts] == [0, 4, 0, 0, 0, 0] and total["tasks"] == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_coordinates_give_valid_model_files_and_round_trip(seed):
    base = fit.base_docs()
    x = np.random.default_rng(seed).uniform(-3, 3, fit.DIM)
    docs = fit.decode(x, base)
    parse_model(docs["strong"], "strong", "strong")  # raises on a categorical not summing to 1
    parse_model(docs["weak"], "weak", "weak")
    low = np.concatenate([[k.clip[0] if k.clipped else -np.inf] * k.size for k in fit.KNOBS])
    high = np.concatenate([[k.clip[1] if k.clipped else np.inf] * k.size for k in fit.KNOBS])
    expected = np.clip(x, low, high)  # difficulty >= 0, draft_blame in [0, 1]
    # every coordinate comes back but those of round-2 rows made sharper than round 1 (E11)
    kept = np.concatenate([
        [k.path[0] != "round2" or fit._get(docs[k.model], k.path) == fit._get(fit.decode(x, base, sharpen=False)[k.model], k.path)] * k.size
        for k in fit.KNOBS
    ])  # fmt: skip
    assert kept.any()
    assert np.allclose(fit.encode(docs)[kept], expected[kept], atol=5e-3)  # 6-decimal files: small rounding
    for role in ("strong", "weak"):
        m = parse_model(docs[role], role, role)
        assert blunt_round2(m.review, m.round2) == []
    assert fit.base_docs() == base  # decode copies, never edits its base


def test_sharpened_lifts_a_blunt_round2_row_to_round_1_keeping_each_side_shape():
    round1 = (0.1, 0.1, 0.3, 0.5)  # on a correct output: right verdict (score > 0.40) 0.8
    blunt = (0.2, 0.2, 0.2, 0.4)  # 0.6
    sharp = sharpened(round1, blunt, True)
    assert right_verdicts(sharp, True) == pytest.approx(0.8)
    assert sum(sharp) == pytest.approx(1.0)
    assert sharp[0] / sharp[1] == pytest.approx(1.0) and sharp[2] / sharp[3] == pytest.approx(0.5)
    assert sharpened(round1, (0.0, 0.1, 0.2, 0.7), True) == (0.0, 0.1, 0.2, 0.7)  # already sharper
    # on a wrong output the right verdict is a flag (score <= 0.40): anchors 0 and 0.25
    assert right_verdicts(
        sharpened((0.4, 0.4, 0.1, 0.1), (0.3, 0.1, 0.3, 0.3), False), False
    ) == pytest.approx(0.8)
    assert sharpened((0.4, 0.4, 0.1, 0.1), (0.0, 0.0, 0.5, 0.5), False) == pytest.approx((0.4, 0.4, 0.1, 0.1))


def test_a_model_file_with_a_blunt_round2_row_warns_and_the_shipped_ones_do_not(recwarn):
    for name in PAIRS["default"] + PAIRS["A"] + PAIRS["B"]:
        load_model(name)
    assert not [w for w in recwarn if issubclass(w.category, ModelFileWarning)]
    doc = fit.base_docs()["weak"]
    doc["round2"]["weak_author"]["wrong"] = [0.0, 0.0, 0.5, 0.5]  # never flags a wrong output
    with pytest.warns(ModelFileWarning, match=r"weak_author.wrong \(\d\.\d+ -> 0\.000\)"):
        parse_model(doc, "weak", "weak.toml")
    fit.sharpen_round2(doc)
    m = parse_model(doc, "weak", "weak.toml")
    assert (
        right_verdicts(m.round2[("weak_author", False)], False)
        >= right_verdicts(m.review[("weak_author", False)], False) - 1e-6
    )


def test_decode_sets_every_knob_and_only_knobs():
    base = fit.base_docs()
    docs = fit.decode(fit.encode(base) + 0.5, base)
    for knob in fit.KNOBS:
        assert fit._get(docs[knob.model], knob.path) != fit._get(base[knob.model], knob.path), knob.name
    for model in ("strong", "weak"):
        assert docs[model]["completion_tokens"] == base[model]["completion_tokens"]
        assert docs[model]["p_decide"] == base[model]["p_decide"]  # a baseline-only scalar: not fitted


def test_loss_is_zero_only_on_target():
    row = {"priority": "primary", "paper": 0.5, "tolerance": 0.1, "measured": {"mean": 0.5}}
    assert fit.loss([row]) == 0.0
    assert fit.loss([dict(row, measured={"mean": 0.55})]) == pytest.approx(0.25)  # inside 0.6 tol: z² only
    assert fit.loss([dict(row, measured={"mean": 0.6})]) == pytest.approx(1.0 + 10 * 0.4**2)
    assert fit.loss([dict(row, priority="secondary", measured={"mean": 0.6})]) == pytest.approx(0.25)


def test_utilities_rank_best_first_and_sum_to_zero():
    u = fit.utilities(24)
    assert u.sum() == pytest.approx(0.0)
    assert np.all(np.diff(u) <= 0) and u[0] > 0 > u[-1]


def test_evaluator_equals_the_reference_engine():
    """The fit's batched JAX evaluation of a candidate is exactly the reference engine's run."""
    from meshheal_jax import metrics, reference
    from meshheal_jax.calibration_report import evaluate, seed_context

    ev = fit.Evaluator((100,), ("bbh",))
    base = fit.base_docs()
    pairs = [fit.pair_of(fit.decode(fit.encode(base) + d, base)) for d in (0.0, 0.4)]
    rows = ev.rows(pairs)
    for pair, got in zip(pairs, rows):
        dataset, seed, network, stream = ev.streams[0]
        schedule = ev.schedule
        records = reference.run_stream(
            network,
            fit.ProtocolParams(),
            pair,
            stream,
            schedule,
            {"method": "meshheal", "dataset": dataset, "pair": "default", "seed": seed},
        )
        frames = {n: metrics.frame(n, getattr(records, n)) for n in ("tasks", "reviews", "states")}
        want = evaluate({"default": [seed_context({dataset: frames}, schedule, ev.phase_names)]})
        assert [r["measured"] for r in got] == [r["measured"] for r in want]
    assert rows[0] != rows[1]  # the candidates really differ


def test_evaluator_batches_give_the_rows_of_one_batch(monkeypatch):
    """A generation larger than MAX_STREAMS streams runs in several batches (32 fit seeds x 24
    candidates ran out of memory in one); each candidate's rows and gaps are those of one batch."""
    ev = fit.Evaluator((100, 101), ("bbh",))
    base = fit.base_docs()
    pairs = [fit.pair_of(fit.decode(fit.encode(base) + d, base)) for d in (0.0, 0.3, -0.3)]
    whole_gaps, split_gaps = [], []
    whole = ev.rows(pairs, whole_gaps)
    monkeypatch.setattr(fit, "MAX_STREAMS", len(ev.streams))  # one candidate per batch
    assert ev.rows(pairs, split_gaps) == whole and split_gaps == whole_gaps
    assert whole[0] != whole[1]  # the candidates differ, so order matters


def test_structure_scan_evaluates_each_point_and_its_degraded_gap(tmp_path, capsys):
    ev = fit.Evaluator((100,), ("bbh",))
    cfg = fit.FitConfig(scan_spread=(0.0, 1.0), scan_review=(0.0,), scan_blame=(0.0, 0.5), out=tmp_path)
    result = fit.scan_structure(cfg, ev)
    points = [(r["difficulty_spread"], r["review_difficulty"], r["draft_blame"]) for r in result]
    assert points == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.5), (1.0, 0.0, 0.0), (1.0, 0.0, 0.5)]
    flat = fit.base_docs()
    for doc in flat.values():  # all 0 = the files with their structure set to 0 on both models
        doc.update(dict.fromkeys(("difficulty_spread", "review_difficulty", "draft_blame"), 0.0))
    assert result[0]["rows"] == ev.rows([fit.pair_of(flat)])[0]
    assert all(r["rows"] != result[0]["rows"] for r in result[1:])  # each structure reaches the run
    for r in result:
        *parts, total = r["degraded_gap"]
        assert sum(p["contribution"] for p in parts) == pytest.approx(total["contribution"], abs=1e-12)
    assert "Latent difficulty and draft blame on both models" in capsys.readouterr().out


def test_the_same_fit_command_gives_the_same_files_also_when_resumed(tmp_path, capsys):
    """The shipped files must be what their documented commands write (docs/calibration.md): a fit
    is seeded, and one stopped after a generation and rerun on its folder ends where one run at once
    does."""
    start = fit.MODEL_DIR / "fit_start"
    settings = dict(pair="B", population=2, fit_seeds=(100,), start=start)
    fit.body(fit.FitConfig(generations=2, out=tmp_path / "at-once", **settings))
    fit.body(fit.FitConfig(generations=1, out=tmp_path / "resumed", **settings))
    fit.body(fit.FitConfig(generations=2, out=tmp_path / "resumed", **settings))
    assert "resumed" in capsys.readouterr().out
    written = tmp_path / "at-once" / "model_params" / "llama-3.3-70b.toml"
    assert written.read_text() == (tmp_path / "resumed" / "model_params" / "llama-3.3-70b.toml").read_text()
    assert sorted(p.name for p in (tmp_path / "at-once" / "model_params").iterdir()) == ["llama-3.3-70b.toml"]
    text = written.read_text()
    where = start.relative_to(Path.cwd()) if start.is_relative_to(Path.cwd()) else start
    assert f"--start {where} " in text.splitlines()[1]  # the header names the command, start included
    assert text != (start / "llama-3.3-70b.toml").read_text()


def test_a_rounded_row_never_holds_a_negative_probability():
    """Sharpening a row with no right-side mass splits the target evenly; the halves' rounding could
    leave the last entry at -1e-06, a file parse_model refuses (a review of this change, 2026-12-06)."""
    row = fit._rounded([0.3333335, 0.3333335, 0.3333335, 0.0])  # 3 x 0.333334: the last would be -2e-06
    assert min(row) >= 0.0 and sum(row) == pytest.approx(1.0, abs=1e-9)
    doc = fit.base_docs()["weak"]
    doc["review"]["weak_author"]["wrong"] = [0.979601, 0.00319, 5.9e-05, 0.01715]
    doc["round2"]["weak_author"]["wrong"] = [0.0, 0.0, 0.999994, 6e-06]
    fit.sharpen_round2(doc)
    assert min(doc["round2"]["weak_author"]["wrong"]) >= 0.0
    parse_model(doc, "weak", "weak.toml")  # sums to 1 within 1e-6, nothing negative


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(population=3), "--population must be even and >= 2"),
        (dict(population=0), "--population must be even and >= 2"),
        (dict(fit_seeds=()), "--fit-seeds must be one or more distinct seeds, got []"),
        (dict(fit_seeds=(100, 100)), "--fit-seeds must be one or more distinct seeds, got [100, 100]"),
        (dict(generations=-1), "--generations must be >= 0, got -1"),
        (dict(sigma=float("nan")), "--sigma must be a finite number > 0, got nan"),
        (dict(sigma=0.0), "--sigma must be a finite number > 0, got 0.0"),
        (dict(sigma=float("inf")), "--sigma must be a finite number > 0, got inf"),
        (dict(difficulty_sigma=0.0), "--difficulty-sigma must be a finite number > 0, got 0.0"),
        (dict(difficulty_sigma=float("nan")), "--difficulty-sigma must be a finite number > 0, got nan"),
    ],
)
def test_a_fit_with_settings_it_cannot_run_is_refused_before_anything(settings, message, tmp_path):
    with pytest.raises(MeshHealError, match=re.escape(message)):
        fit.body(fit.FitConfig(out=tmp_path / "fit", **{"pair": "B", **settings}))
    assert not (tmp_path / "fit").exists()


@pytest.mark.parametrize("text", ["{bad", "", "[]", "{}", '{"config": {}, "mean": []}'])
def test_a_damaged_search_state_is_named(text, tmp_path):
    (tmp_path / "state.json").write_text(text)
    config = fit.FitConfig(out=tmp_path, pair="B", population=2, fit_seeds=(100,), generations=1)
    with pytest.raises(MeshHealError, match="state.json (cannot be read|is not a search's state)"):
        fit.fit(config, fit.Evaluator(config.fit_seeds, pair="B"))


def test_a_start_folder_with_a_damaged_model_file_is_named(tmp_path):
    (tmp_path / "llama-3.3-70b.toml").write_text("scalars = [unclosed")
    with pytest.raises(MeshHealError, match=r"cannot parse model parameter file .*llama-3\.3-70b\.toml"):
        fit.base_docs("B", start=tmp_path)


def test_a_fit_into_a_file_is_refused_before_anything(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(MeshHealError, match="--out .*a-file exists and is not a folder"):
        fit.body(fit.FitConfig(out=tmp_path / "a-file", pair="B"))
