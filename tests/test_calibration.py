"""The calibration report on the default files, and the fit's knobs."""

import json
import subprocess
import sys

import numpy as np
import pytest

from meshheal_jax import calibration_fit as fit
from meshheal_jax.params import parse_model

# Primary targets the fitted default files do NOT meet on the report seeds 0..4 (reference
# engine). Each is a documented conflict (docs/calibration.md); this list must shrink, never hide.
KNOWN_PRIMARY_FAILURES = {
    "initial low-score false alarm (healthy)",
    "committee clears healthy-flagged",
    "Takeover on Finalize: wrong->right",
    "accuracy, healthy phase, mean of 3 datasets",
    "accuracy, degraded phase, mean of 3 datasets",
    "MATH accuracy, healthy phase",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal")
    proc = subprocess.run(
        [sys.executable, "-m", "meshheal_jax.calibration_report", "--pairs", "default", "--quiet",
         "--out", str(out / "run"), "--json-out", str(out / "report.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return proc, json.loads((out / "report.json").read_text())


def test_report_prints_every_target(report):
    proc, rows = report
    assert "mean q0, healthy-author outputs" in proc.stdout
    assert {r["priority"] for r in rows} == {"primary", "secondary"}
    assert sum(r["priority"] == "primary" for r in rows) == 15
    for r in rows:
        assert r["measured"]["n_defined"] == 5, r["target"]


def test_exit_status_follows_primary_targets(report):
    proc, rows = report
    failed = {r["target"] for r in rows if r["priority"] == "primary" and not r["pass"]}
    assert proc.returncode == (1 if failed else 0)


def test_primary_failures_are_exactly_the_documented_conflicts(report):
    _, rows = report
    failed = {r["target"] for r in rows if r["priority"] == "primary" and not r["pass"]}
    assert failed == KNOWN_PRIMARY_FAILURES


@pytest.mark.parametrize("corner", ["lower", "upper"])
def test_every_knob_setting_gives_valid_model_files(corner):
    base = fit.base_docs()
    x = np.array([k[1] if corner == "lower" else k[2] for k in fit.KNOBS])
    strong, weak = fit.docs_for(x, base)
    parse_model(strong, "strong", "strong")  # raises on a categorical not summing to 1
    parse_model(weak, "weak", "weak")


def test_loss_is_zero_only_on_target():
    row = {"priority": "primary", "paper": 0.5, "tolerance": 0.1, "measured": {"mean": 0.5}}
    assert fit.loss([row]) == 0.0
    assert fit.loss([dict(row, measured={"mean": 0.6})]) == pytest.approx(1.0)
    assert fit.loss([dict(row, priority="secondary", measured={"mean": 0.6})]) == pytest.approx(0.25)
