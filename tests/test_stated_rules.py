"""Rules of data, scoring, the sweep, scale outcomes and report tables that a docstring or the spec
states and that no other test held (twenty-fourth session's fourth mutation pass): scoring's
option range and ambiguity rules, the thousands-separated numbers of `same_answer`, a question
pool used exactly to its size, the sweep's per-seed detection delay and its table's columns, the
end-of-interval state of `scale_outcomes`, and which statistic each report.md cell reads.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from meshheal_jax import data, metrics, report, scoring, sweep
from meshheal_jax.data import Record
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import load_pair
from meshheal_jax.streams import recovery_schedule


def cells(table: str, row: int = 0) -> dict[str, str]:
    """A markdown table's header -> cell of data row `row`."""
    lines = table.splitlines()
    split = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in (lines[0], lines[2 + row])]
    return dict(zip(*split))


# ----------------------------------------------------------------------------------------------
# scoring.py
# ----------------------------------------------------------------------------------------------


def test_bbh_letter_one_past_the_last_option_is_invalid():
    """judge: `options` are "used to reject out-of-range letters"; (C) of two options is one."""
    verdict = scoring.judge("bbh", "RESULT: (C)", "(A)", ("x", "y"))
    assert (verdict.correct, verdict.status, verdict.answer) == (False, scoring.INVALID_OPTION, "C")
    assert scoring.judge("bbh", "RESULT: (B)", "(B)", ("x", "y")).status == scoring.OK


def test_mmlu_pro_text_of_two_identical_options_names_no_letter():
    """option_letter: "the letter of the one option whose text it equals": two equal options are
    not one, so quoting their text names no letter."""
    options = ("same", "same", "other")
    assert scoring.option_letter("same", options) is None
    assert scoring.judge("mmlu_pro", "RESULT: same", "A", options).status == scoring.UNPARSABLE
    assert scoring.option_letter("other", options) == "C"


def test_a_final_ellipsis_is_not_a_final_period():
    """Markup removed around an answer includes "a final period", not an ellipsis."""
    assert scoring.extract_answer("bbh", "RESULT: and so on...") == "and so on..."
    assert scoring.extract_answer("bbh", "RESULT: Yes.") == "Yes"


def test_same_answer_reads_thousands_separated_numbers_as_equal():
    """same_answer: "normalised text (BBH, MMLU-Pro ...), equal numbers"."""
    assert scoring.same_answer("bbh", "1,000", "1000")
    assert scoring.same_answer("mmlu_pro", "15", "15.0")
    assert not scoring.same_answer("bbh", "1,5", "15")


def test_math_answer_with_no_expression_under_a_text_gold_is_unparsable():
    """UNPARSABLE: "an answer was found but is not of the gold's kind (no letter, no expression)",
    also where the gold is one math-verify cannot read (\\frac{12}{5,525}; MATH's one such gold,
    \\frac{12}{5,\\!525}, is read since decisions L8's rewrite). Under such a gold, compared as text,
    an answer math-verify hands back as text is of its kind; one it reads nothing from is not."""
    pytest.importorskip("math_verify")
    gold = "\\frac{12}{5,525}"
    assert not any(scoring._is_expression(x) for x in scoring._parse_gold(gold))  # the premise
    verdict = scoring.judge("math", "RESULT: }{", gold)
    assert (verdict.correct, verdict.status) == (False, scoring.UNPARSABLE)
    assert scoring.judge("math", "RESULT: ???", gold).status == scoring.OK  # text, as the gold is
    assert scoring.judge("math", "RESULT: 5", gold).status == scoring.OK  # an expression, just not the gold
    assert scoring.judge("math", f"RESULT: {gold}", gold).correct


# ----------------------------------------------------------------------------------------------
# data.py
# ----------------------------------------------------------------------------------------------


def test_a_stream_using_the_whole_pool_draws_without_replacement():
    """pick_questions: ids are drawn with replacement (flag, short_types, warning) only "when the
    stream needs more questions of T than the pool holds"; exactly the pool is a permutation."""
    pool = ((Record("q0", "t", "1"), Record("q1", "t", "2"), Record("q2", "t", "3")),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pick = data.pick_questions(pool, np.zeros(3, dtype=int), np.arange(3), seed=0)
    assert not pick.with_replacement and pick.short_types == ()
    assert sorted(pick.pool_index.tolist()) == [0, 1, 2]
    with pytest.warns(data.QuestionPoolWarning):
        more = data.pick_questions(pool, np.zeros(4, dtype=int), np.arange(4), seed=0)
    assert more.with_replacement and more.short_types == ("t",)


def test_bbh_target_one_past_the_last_option_is_refused():
    """A lettered target must be one of the question's options: (C) of (A)-(B) is a malformed row."""
    row = {"input": "Pick one.\nOptions:\n(A) x\n(B) y", "target": "(C)"}
    with pytest.raises(MeshHealError, match=r"f\.json, row 3: target '\(C\)' is not one of .*\(A\)-\(B\)"):
        data.map_bbh_row(row, "task", "f.json, row 3")
    assert data.map_bbh_row({**row, "target": "(B)"}, "task", "f.json, row 3").gold == "(B)"


# ----------------------------------------------------------------------------------------------
# sweep.py
# ----------------------------------------------------------------------------------------------


def test_sweep_detection_delay_is_per_seed_mean_over_detected_agents():
    """_detection: "Per seed the mean delay over the degraded agents that were detected; a stat over seeds"."""
    per_seed = [
        {"agents": [{"detection_delay": 2}, {"detection_delay": 6}]},  # mean 4
        {"agents": [{"detection_delay": None}, {"detection_delay": 10}]},  # mean 10 (one detected)
        {"agents": [{"detection_delay": None}, {"detection_delay": None}]},  # undefined
    ]
    got = sweep._detection(per_seed)
    assert got["mean"] == pytest.approx(7.0) and got["n_defined"] == 2
    assert (got["min"], got["max"]) == (4.0, 10.0)


def test_grid_range_count_must_be_at_least_one():
    with pytest.raises(MeshHealError, match="COUNT must be >= 1"):
        sweep.parse_grid(["alpha=1.0:1.4:0"])
    assert sweep.parse_grid(["alpha=1.0:1.4:1"]) == {"alpha": (1.0,)}


def test_emulator_probability_accepts_both_ends_of_0_1():
    """_with_scalar: a model scalar "must be a probability in [0, 1]": 0 and 1 included."""
    pair = load_pair("default")
    assert sweep._with_scalar(pair, "strong.p_infer", 1.0).strong.scalars["p_infer"] == 1.0
    assert sweep._with_scalar(pair, "weak.p_infer", 0.0).weak.scalars["p_infer"] == 0.0
    with pytest.raises(MeshHealError, match=r"probability in \[0, 1\]"):
        sweep._with_scalar(pair, "strong.p_infer", 1.01)


def test_sweep_table_cells_read_their_columns():
    s = metrics.stat
    result = {"dataset": "bbh", "grid_point": 0, "values": {"alpha": 1.2}, "acc_healthy": s([0.9]),
              "acc_degraded": s([0.6]), "detection_delay": s([5.0]), "missed": s([0.0]),
              "false_isolations": s([1.0]), "false_isolated_agents": s([2.0]),
              "tokens_per_task_healthy": s([1000.0]), "tokens_per_task_degraded": s([3000.0])}  # fmt: skip
    headers, rows = sweep.summary_rows({"grid": {"alpha": [1.2]}, "results": [result]}, "bbh")
    row = dict(zip(headers, rows[0]))
    assert (row["alpha"], row["acc H"], row["acc D"]) == ("1.2", "0.900", "0.600")
    assert row["detection delay"] == "5.0 n=1"
    assert (row["false isol."], row["false-isol. agents"]) == ("1.00", "2.00")
    assert (row["tokens/task H (k)"], row["tokens/task D (k)"]) == ("1.0", "3.0")


# ----------------------------------------------------------------------------------------------
# metrics.scale_outcomes
# ----------------------------------------------------------------------------------------------


def test_scale_outcomes_isolated_at_end_reads_the_last_degraded_task():
    """scale_outcomes: "whether it is isolated at the end of the interval": the end of its last
    degraded task (intervals are [begin, end)); a release at the restoration task `end` comes after."""
    schedule = recovery_schedule(630)  # agent 4 degraded in tasks 127-378, agent 2 in 253-504
    rows = [{"method": "meshheal", "dataset": "math", "pair": "default", "seed": 0, "t": t, "agent": agent,
             "from": src, "to": dst, "z": None, "reason": "test", "probe": False, "degraded": False}
            for t, agent, src, dst in [(300, 4, "normal", "isolated"), (379, 4, "isolated", "probation")]]  # fmt: skip
    outcome = metrics.scale_outcomes(metrics.frame("states", rows), schedule)
    assert outcome["isolated_degraded"] == 1
    assert outcome["missed"] == 1 and outcome["detection_delay_mean"] == 173.0


# ----------------------------------------------------------------------------------------------
# report.py
# ----------------------------------------------------------------------------------------------


def test_phase_table_spans_are_one_based_task_ranges():
    """spec/experiments.md §2: five phases of 126: healthy (1-126); A5 degraded (127–252); ..."""
    s = metrics.stat([0.5])
    phases = [{"name": f"p{k}", "acc": s, "calls_per_task": s, "tokens_per_task": s} for k in range(5)]
    summary = {
        "n_tasks": 630,
        "results": [{"method": "m", "dataset": "math", "pair": "default", "phases": phases}],
    }
    table = report.phases_table(summary)
    assert [cells(table, k)["tasks"] for k in range(5)] == [
        "1–126",
        "127–252",
        "253–378",
        "379–504",
        "505–630",
    ]


def test_results_table_cells_read_their_phase():
    s = metrics.stat
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "acc_healthy": s([0.9]),
         "acc_degraded": s([0.6]), "phase_change": s([-0.3]), "calls_per_task_healthy": s([3.0]),
         "calls_per_task_degraded": s([7.0]), "tokens_per_task_healthy": s([1000.0]),
         "tokens_per_task_degraded": s([4000.0])}  # fmt: skip
    row = cells(report.results_table({"results": [r]}))
    assert (row["acc H"], row["acc D"], row["D − H"]) == ("0.900", "0.600", "-0.300")
    assert (row["calls H"], row["calls D"]) == ("3.0", "7.0")
    assert (row["tokens H (k)"], row["tokens D (k)"]) == ("1.0", "4.0")


def test_parse_problems_of_one_seed_among_several_are_noted():
    """parse_problems: "Whether some stream of the result had a reply that failed to parse or
    needed the retry": one failure in one of five seeds is some stream."""
    zero = metrics.stat([0, 0, 0, 0, 0])
    assert report.parse_problems({"parse_failed": metrics.stat([0, 0, 0, 0, 1]), "parse_retried": zero})
    assert report.parse_problems({"parse_failed": zero, "parse_retried": metrics.stat([0, 1, 0, 0, 0])})
    assert not report.parse_problems({"parse_failed": zero, "parse_retried": zero})


def test_parse_table_columns_read_failed_and_retried():
    r = {"method": "meshheal", "dataset": "bbh", "pair": "default", "parse_failed": metrics.stat([2.0]),
         "parse_failed_review": metrics.stat([2.0]), "parse_retried": metrics.stat([5.0]),
         "phases": [{"name": "healthy", "parse_failed": metrics.stat([1.0])}]}  # fmt: skip
    row = cells(report.parse_table({"results": [r]}))
    assert (row["failed"], row["failed: review"], row["failed: infer"]) == ("2.0", "2.0", "—")
    assert row["parsed on retry"] == "5.0" and row["failed per phase"] == "healthy 1.0"
