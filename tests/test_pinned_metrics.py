"""Rules of the §7 metrics (spec/protocol.md) and of report.md's tables that a docstring, the spec
or docs/decisions.md states and that no other test held (a mutation audit of metrics.py and
report.py): which detections count as "before onset" (P5b), the audit's tolerance and its probe
columns (P3), the scale counts' detection window and median, the per-agent aggregation, and which
column or row each report.md table cell reads. Hand-built frames and stat dicts: no run."""

from __future__ import annotations

import polars as pl
import pytest
from test_stated_rules import cells  # a markdown table's header -> cell of one data row

from meshheal_jax import metrics, report
from meshheal_jax.streams import HealthSchedule

LABELS = {"method": "meshheal", "dataset": "math", "pair": "default"}


def states(*changes: tuple[int, int, str, str], seed: int = 0) -> pl.DataFrame:
    """(t, agent, from, to) rows -> a `states` frame of one stream."""
    rows = [{**LABELS, "seed": seed, "t": t, "agent": a, "from": f, "to": to, "z": 2.0, "reason": "r",
             "probe": False, "degraded": False}
            for t, a, f, to in changes]  # fmt: skip
    return metrics.frame("states", rows)


def review(degraded: bool, q0: float, q: float, probe: bool = False) -> dict:
    """One reviewed Contribute output (no Takeover) of a healthy (0) or degraded (2) author."""
    return {**LABELS, "seed": 0, "t": 1, "visit": 0, "action": "contribute", "author": 2 if degraded else 0,
            "ability": 0, "author_degraded": degraded, "probe": probe, "q0": q0, "q": q,
            "committee": q0 <= 0.40, "takeover": False, "correct_before": True, "correct_after": True}  # fmt: skip


# agent 2 degraded for tasks 20..59, recovered at 60, stream of 100 tasks
RECOVERING = HealthSchedule(6, 100, ((2, 20, 60),))


# ----------------------------------------------------------------------------------------------
# metrics: detections before onset (decisions P5b)
# ----------------------------------------------------------------------------------------------


def test_only_a_delay_zero_of_an_agent_isolated_at_onset_is_a_detection_before_onset():
    """P5b: "Those read as delay 0 (isolated at onset and still isolated at the end of task b_i)
    are counted ... One released on b_i and isolated again later is a real detection and is not
    counted." An agent isolated on its own first degraded task (delay 0, normal at b_i − 1) is a
    real detection too."""
    released = states(
        (10, 2, "normal", "isolated"), (20, 2, "isolated", "watched"), (23, 2, "watched", "isolated")
    )
    cases = {
        "isolated before onset, kept": (states((10, 2, "normal", "isolated")), True),
        "isolated before onset, released on b_i, isolated again": (released, False),
        "isolated on its first degraded task": (states((20, 2, "normal", "isolated")), False),
    }
    outcomes = {}
    for name, (frame, before_onset) in cases.items():
        (outcomes[name],) = metrics.agent_outcomes(frame, RECOVERING)
        assert metrics.onset_detection(outcomes[name]) is before_onset, name
    per_seed = [{**{k: 0.0 for k in metrics.SCALAR_KEYS}, "phases": [], "review_audit": {}, "agents": [o]}
                for o in outcomes.values()]  # fmt: skip
    assert metrics.aggregate(per_seed, [0, 1, 2])["agents"][0]["onset_detections"] == 1


# ----------------------------------------------------------------------------------------------
# metrics.review_audit: the low-score tolerance and the probe columns
# ----------------------------------------------------------------------------------------------


def test_audit_low_score_decisions_keep_the_engines_tolerance():
    """P3: "metrics use the same `q <= 0.40 + 1e-9` for the audit's low-score decisions": a score a
    rounding above 0.40 (a mean of samples) is low, for q0 and for q."""
    just_above = 0.40 + 1e-12
    a = metrics.review_audit(metrics.frame("reviews", [review(True, just_above, just_above)]))
    assert a["initial_recall"] == 1.0 and a["final_recall"] == 1.0
    assert a["committee_keeps_degraded"] == 1.0


def test_a_committee_score_of_exactly_0_40_does_not_clear_a_flagged_output():
    """committee_clears_healthy: flagged healthy outputs (q0 <= 0.40) whose final q is NOT low; a
    final q of 0.40 is still the low-score decision (q <= 0.40), so it keeps the flag."""
    rows = [review(False, 0.25, 0.40), review(False, 0.25, 0.75)]
    a = metrics.review_audit(metrics.frame("reviews", rows))
    assert a["initial_false_alarm"] == 1.0 and a["final_false_alarm"] == 0.5
    assert a["committee_clears_healthy"] == 0.5


def test_probe_columns_read_the_final_score():
    """review_audit: per author health the probes' "mean q0 and q, and the share judged low,
    q <= 0.40": two probes of a degraded author, one judged low at first (q0) but not at the end."""
    probes = [review(True, 0.25, 0.75, probe=True), review(True, 0.0, 0.25, probe=True)]
    a = metrics.review_audit(metrics.frame("reviews", [review(False, 1.0, 1.0), *probes]))
    assert a["probe_outputs_degraded"] == 2 and a["probe_outputs"] == 2
    assert a["probe_mean_q0_degraded"] == pytest.approx(0.125)
    assert a["probe_mean_q_degraded"] == pytest.approx(0.5) and a["probe_mean_q"] == pytest.approx(0.5)
    assert a["probe_low_degraded"] == 0.5


# ----------------------------------------------------------------------------------------------
# metrics: per-stream numbers and their aggregation
# ----------------------------------------------------------------------------------------------


def test_phase_numbers_read_their_columns_and_a_broken_closure_is_not_missed():
    """Per phase: accuracy, tokens per task and calls per task, each of its own column. §7: a null
    detection delay is "missed"; an agent isolated, then released before r_i is detected (its
    closure fails), not missed."""
    schedule = HealthSchedule(6, 6, ((2, 2, 7),))
    tasks = metrics.frame("tasks", [
        {**LABELS, "seed": 0, "t": t, "phase": int(t >= 2), "correct": t != 4, "answered": True, "calls": 3 + t,
         "tokens": 1000 * t, "unreviewed": 0}
        for t in range(1, 7)
    ])  # fmt: skip
    frame = states((3, 2, "normal", "isolated"), (5, 2, "isolated", "watched"))
    m = metrics.stream_metrics(tasks, None, frame, schedule, ("healthy", "degraded"))
    assert m["agents"][0]["detection_delay"] == 1 and m["agents"][0]["closure"] is False
    assert m["missed"] == 0
    assert [ph["tokens_per_task"] for ph in m["phases"]] == [1000.0, 4000.0]
    assert [ph["calls_per_task"] for ph in m["phases"]] == [4.0, 7.0]
    assert [ph["acc"] for ph in m["phases"]] == [1.0, 0.8]


def test_aggregate_keeps_each_agents_own_delays():
    """aggregate: per degraded agent (in schedule order) its own detection and reintegration delays
    over seeds, not the first agent's."""
    agents = [{"agent": 4, "degraded_at": 21, "recovered_at": 61, "detection_delay": 2, "closure": True,
               "reintegration_delay": 30, "isolated_at_onset": False},
              {"agent": 2, "degraded_at": 41, "recovered_at": 81, "detection_delay": 9, "closure": False,
               "reintegration_delay": 5, "isolated_at_onset": False}]  # fmt: skip
    entry = {**{k: 0.0 for k in metrics.SCALAR_KEYS}, "phases": [], "review_audit": {}, "agents": agents}
    out = metrics.aggregate([entry, entry], [0, 1])["agents"]
    assert [a["profile"] for a in out] == ["A5", "A3"]
    assert [a["detection_delay"]["mean"] for a in out] == [2.0, 9.0]
    assert [a["reintegration_delay"]["mean"] for a in out] == [30.0, 5.0]
    assert [a["closure_seeds"] for a in out] == [2, 0]


# ----------------------------------------------------------------------------------------------
# report.py: which column or row each cell reads
# ----------------------------------------------------------------------------------------------


def test_results_table_detector_columns_read_their_keys():
    s = metrics.stat
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "acc_healthy": s([0.9]),
         "acc_degraded": s([0.6]), "phase_change": s([-0.3]), "calls_per_task_healthy": s([3.0]),
         "calls_per_task_degraded": s([7.0]), "tokens_per_task_healthy": s([1000.0]),
         "tokens_per_task_degraded": s([4000.0]), "missed": s([1.0]), "false_isolations": s([3.0]),
         "false_isolated_agents": s([2.0])}  # fmt: skip
    row = cells(report.results_table({"results": [r]}))
    assert row["missed"] == "1.00"
    assert (row["false isolations"], row["falsely isolated agents"]) == ("3.00", "2.00")


def test_phases_table_calls_and_tokens_columns_read_their_keys():
    s = metrics.stat
    phase = {"name": "healthy", "acc": s([0.8]), "calls_per_task": s([5.0]), "tokens_per_task": s([2000.0])}
    result = {"method": "m", "dataset": "bbh", "pair": "default", "phases": [phase]}
    summary = {"n_tasks": 10, "results": [result]}
    row = cells(report.phases_table(summary))
    assert (row["tasks"], row["accuracy"]) == ("1–10", "0.800")
    assert (row["calls/task"], row["tokens/task (k)"]) == ("5.0", "2.0")


def test_agents_table_row_of_an_agent_degraded_to_the_end():
    """The agents table: "degraded tasks" b_i–N for an agent never restored (recovered_at null,
    P5), closure as seeds with closure of all seeds, a delay defined in one seed shown with n=1."""
    s = metrics.stat
    agent = {"agent": 2, "profile": "A3", "degraded_at": 253, "recovered_at": None, "detection_delay": s([4, None, None]),
             "closure_seeds": 1, "onset_detections": 0, "reintegration_delay": s([None] * 3)}  # fmt: skip
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "seeds": [0, 1, 2], "detector": "relative",
         "agents": [agent]}  # fmt: skip
    row = cells(report.agents_table({"n_tasks": 504, "results": [r]}))
    assert (row["agent"], row["degraded tasks"]) == ("A3 (agent 2)", "253–504")
    assert row["detection delay"] == "4.0 (4–4) n=1"
    assert row["closure"] == "1/3 seeds" and row["reintegration delay"] == "— (never restored)"


def test_scaling_table_orders_rows_by_topology_then_network_size():
    entries = [{"n_agents": n, "topology": t} for t in ("sparse", "complete") for n in (96, 6, 288)]
    lines = report.scaling_table(entries).splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert rows == [["6", "complete"], ["96", "complete"], ["288", "complete"],
                    ["6", "sparse"], ["96", "sparse"], ["288", "sparse"]]  # fmt: skip


def test_state_changes_table_shows_the_seed_and_counts_all_its_changes():
    """report.md's state changes: the shown seed's (dataset, pair) changes, the first
    STATE_CHANGES_SHOWN of them as rows, and their number (all of them, for the "first 400 of n")."""
    n = report.STATE_CHANGES_SHOWN + 1
    changes = [(t, 2, "normal", "watched") for t in range(1, n + 1)]
    frame = pl.concat([states(*changes, seed=0), states((5, 4, "normal", "isolated"), seed=1)])
    table, count = report.state_changes_table(frame, 0, "math", "default")
    assert count == n and len(table.splitlines()) == 2 + report.STATE_CHANGES_SHOWN
    assert cells(table)["agent"] == "A3 (agent 2)" and "A5 (agent 4)" not in table
    table, count = report.state_changes_table(frame, 1, "math", "default")
    assert count == 1 and cells(table)["agent"] == "A5 (agent 4)"


@pytest.mark.parametrize("extra, note", [(0, ""), (1, " (first 400 of 401; all in states.parquet)")])
def test_report_says_the_state_changes_were_cut_only_past_the_rows_shown(tmp_path, extra, note):
    """render: the state-change table is cut after STATE_CHANGES_SHOWN rows, and says so only where
    there were more changes than that (400 of 400 shown is the whole table)."""
    n = report.STATE_CHANGES_SHOWN + extra
    experiment = {"name": "recovery", "seeds": [0], "datasets": ["math"], "pairs": ["default"]}
    run = report.RunFolder(path=tmp_path, config={"experiment": experiment}, summary={},
                           tasks=metrics.frame("tasks", []), reviews=None,
                           states=states(*[(t, 2, "normal", "watched") for t in range(1, n + 1)]))  # fmt: skip
    assert f"<details><summary>{n} state changes{note}</summary>" in report.render(run, [])
