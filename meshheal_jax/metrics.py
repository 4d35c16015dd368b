"""Records -> polars frames -> the self-healing metrics of spec/protocol.md §7.

Engine-agnostic: every engine produces the same four record tables (SCHEMAS); everything here
reads only them and the health schedule. Task indices are 1-based; agents 0-based.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import polars as pl

from meshheal_jax.config import TAU_TO
from meshheal_jax.streams import HealthSchedule

LOW_SCORE = TAU_TO
TOL = 1e-9  # same tolerance in favour of crossing as the engines (spec/architecture.md)

LABELS = {"method": pl.String, "dataset": pl.String, "pair": pl.String, "seed": pl.Int64}
SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    "tasks": {
        **LABELS, "t": pl.Int64, "task_type": pl.Int64, "phase": pl.Int64, "entry": pl.Int64,
        "route": pl.String, "actions": pl.String, "moves": pl.Int64, "answered": pl.Boolean,
        "correct": pl.Boolean, "answer_id": pl.Int64, "inferred_pair": pl.Int64,
        "pair_correct": pl.Boolean, "unreviewed": pl.Int64, "end": pl.String, "calls": pl.Int64,
        "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64, "tokens": pl.Int64,
    },
    "reviews": {
        **LABELS, "t": pl.Int64, "visit": pl.Int64, "action": pl.String, "author": pl.Int64,
        "ability": pl.Int64, "author_degraded": pl.Boolean, "author_model": pl.String,
        "part_correct": pl.Boolean, "probe": pl.Boolean, "reviewer": pl.Int64,
        "u1": pl.Float64, "u2": pl.Float64, "u3": pl.Float64, "q0": pl.Float64, "s_u": pl.Float64,
        "committee": pl.Boolean, "committee_a": pl.Int64, "committee_b": pl.Int64,
        "v_a1": pl.Float64, "v_b1": pl.Float64, "v_a": pl.Float64, "v_b": pl.Float64,
        "q": pl.Float64, "takeover": pl.Boolean, "correct_before": pl.Boolean,
        "correct_after": pl.Boolean, "z": pl.Float64, "state_before": pl.String,
        "state_after": pl.String,
    },
    "states": {
        **LABELS, "t": pl.Int64, "agent": pl.Int64, "from": pl.String, "to": pl.String,
        "z": pl.Float64, "reason": pl.String, "probe": pl.Boolean, "degraded": pl.Boolean,
    },
    "calls": {
        **LABELS, "t": pl.Int64, "visit": pl.Int64, "kind": pl.String, "agent": pl.Int64,
        "author": pl.Int64, "ability": pl.Int64, "model": pl.String, "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64, "latency_s": pl.Float64, "parse_status": pl.String,
        "score": pl.Float64, "answer_id": pl.Int64, "correct": pl.Boolean,
    },
}  # fmt: skip


def agent_label(agent: int) -> str:
    """'A3 (agent 2)': the profile name (1-based, per six-agent replica) and the 0-based index."""
    return f"A{agent % 6 + 1} (agent {agent})"


def frame(table: str, rows: list[dict]) -> pl.DataFrame:
    """Rows -> a frame with the table's fixed schema (columns in schema order)."""
    schema = SCHEMAS[table]
    return pl.DataFrame([{k: row.get(k) for k in schema} for row in rows], schema=schema, orient="row")


# ----------------------------------------------------------------------------------------------
# Statistics over seeds
# ----------------------------------------------------------------------------------------------


def stat(values: Sequence[float | None]) -> dict:
    """{mean, std (sample), min, max, n_defined} over the defined values; null where undefined."""
    defined = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    n = len(defined)
    if n == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n_defined": 0}
    return {
        "mean": float(np.mean(defined)),
        "std": float(np.std(defined, ddof=1)) if n > 1 else None,
        "min": float(np.min(defined)),
        "max": float(np.max(defined)),
        "n_defined": n,
    }


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


# ----------------------------------------------------------------------------------------------
# Per-stream metrics
# ----------------------------------------------------------------------------------------------


def state_matrix(states: pl.DataFrame, n_agents: int, n_tasks: int) -> np.ndarray:
    """(n_tasks + 1, n_agents) array of state names at the END of task t (row 0 = start)."""
    current = ["normal"] * n_agents
    out = np.empty((n_tasks + 1, n_agents), dtype=object)
    out[0] = current
    changes: dict[int, list[tuple[int, str]]] = {}
    for row in states.sort("t", maintain_order=True).iter_rows(named=True):
        changes.setdefault(row["t"], []).append((row["agent"], row["to"]))
    for t in range(1, n_tasks + 1):
        for agent, to in changes.get(t, []):
            current[agent] = to
        out[t] = current
    return out


def onset_detection(outcome: dict) -> bool:
    """§7's delay 0 for an agent already isolated when it degraded and still isolated at the end
    of its first degraded task: a false isolation, not a detection (decisions P5b)."""
    return bool(outcome.get("isolated_at_onset")) and outcome["detection_delay"] == 0


def agent_outcomes(states: pl.DataFrame, schedule: HealthSchedule) -> list[dict]:
    """Detection delay, closure and reintegration per degraded agent (spec/protocol.md §7), and
    whether the agent was already isolated when it degraded (at the end of task b_i − 1: a false
    isolation of the healthy agent, which §7 counts as detection at delay 0 unless it leaves
    isolation on task b_i)."""
    n = schedule.n_tasks
    matrix = state_matrix(states, schedule.n_agents, n)
    out = []
    for agent, begin, end in schedule.intervals:
        isolated = [t for t in range(begin, end) if matrix[t, agent] == "isolated"]
        detected = isolated[0] if isolated else None
        closure = detected is not None and all(matrix[t, agent] == "isolated" for t in range(detected, end))
        reintegration = None
        if end <= n:
            normal_from = None
            for t in range(n, end - 1, -1):  # latest run of 'normal' reaching the end
                if matrix[t, agent] != "normal":
                    break
                normal_from = t
            reintegration = None if normal_from is None else normal_from - end
        out.append({
            "agent": agent, "degraded_at": begin, "recovered_at": end if end <= n else None,
            "detection_delay": None if detected is None else detected - begin,
            "closure": closure, "reintegration_delay": reintegration,
            "isolated_at_onset": bool(matrix[begin - 1, agent] == "isolated"),
        })  # fmt: skip
    return out


# Review rows with no reviewing call behind them: an SAC team's score of its own answer (its
# anchor; decisions B4). The audit judges reviews of another agent's output, so they are left out.
NOT_AUDITED_ACTIONS = ("self_evaluate",)


def _mean(df: pl.DataFrame, col: str) -> float | None:
    """A column's mean (booleans as 0/1), None for no rows."""
    return float(df[col].cast(pl.Float64).mean()) if df.height else None


def review_audit(reviews: pl.DataFrame) -> dict:
    """Review audit on non-probe outputs, without SAC's self-scores; probe outputs reported apart
    (probe_*: their number, mean q, their Takeovers, and per author health their number, mean q0
    and q, and the share judged low, q <= 0.40)."""
    r = reviews.filter(~pl.col("probe") & ~pl.col("action").is_in(NOT_AUDITED_ACTIONS))
    healthy = r.filter(~pl.col("author_degraded"))
    degraded = r.filter(pl.col("author_degraded"))

    def low(col: str, df: pl.DataFrame) -> pl.DataFrame:
        return df.filter(pl.col(col) <= LOW_SCORE + TOL)

    flagged_h, flagged_d = low("q0", healthy), low("q0", degraded)
    fin_take = r.filter((pl.col("action") == "finalize") & pl.col("takeover"))
    n_take = fin_take.height
    wrong_to_right = fin_take.filter(~pl.col("correct_before") & pl.col("correct_after")).height
    right_to_wrong = fin_take.filter(pl.col("correct_before") & ~pl.col("correct_after")).height
    probes = reviews.filter(pl.col("probe"))
    probe_h, probe_d = probes.filter(~pl.col("author_degraded")), probes.filter(pl.col("author_degraded"))
    return {
        "outputs_healthy": healthy.height,
        "outputs_degraded": degraded.height,
        "mean_q0_healthy": _mean(healthy, "q0"),
        "mean_q0_degraded": _mean(degraded, "q0"),
        "committee_rate": _ratio(r["committee"].sum(), r.height),
        "committee_share_degraded": _ratio(degraded["committee"].sum(), degraded.height),
        "initial_recall": _ratio(flagged_d.height, degraded.height),
        "initial_false_alarm": _ratio(flagged_h.height, healthy.height),
        "final_recall": _ratio(low("q", degraded).height, degraded.height),
        "final_false_alarm": _ratio(low("q", healthy).height, healthy.height),
        "committee_clears_healthy": _ratio(flagged_h.filter(pl.col("q") > LOW_SCORE + TOL).height, flagged_h.height),
        "committee_keeps_degraded": _ratio(low("q", flagged_d).height, flagged_d.height),
        "takeovers": r["takeover"].sum(),
        "finalize_takeovers": n_take,
        # spec §7: the Takeover outcome counts on Finalize outputs; and their shares of
        # finalize_takeovers (the calibration targets are shares)
        "takeover_wrong_to_right_count": wrong_to_right,
        "takeover_right_to_wrong_count": right_to_wrong,
        "takeover_unchanged_count": n_take - wrong_to_right - right_to_wrong,
        "takeover_wrong_to_right": _ratio(wrong_to_right, n_take),
        "takeover_right_to_wrong": _ratio(right_to_wrong, n_take),
        "takeover_unchanged": _ratio(n_take - wrong_to_right - right_to_wrong, n_take),
        "probe_outputs": probes.height,
        "probe_mean_q": _mean(probes, "q"),
        "probe_takeovers": probes["takeover"].sum(),
        **{f"probe_{key}_{health}": value
           for health, df in (("healthy", probe_h), ("degraded", probe_d))
           for key, value in (("outputs", df.height), ("mean_q0", _mean(df, "q0")), ("mean_q", _mean(df, "q")),
                              ("low", _ratio(low("q", df).height, df.height)))},
    }  # fmt: skip


def any_degraded(schedule: HealthSchedule) -> np.ndarray:
    """(n_tasks,) bool: some agent is degraded during task t (index t - 1)."""
    marks = np.zeros(schedule.n_tasks + 2, dtype=np.int64)
    for _, begin, end in schedule.intervals:
        marks[begin] += 1
        marks[end] -= 1
    return np.cumsum(marks)[1 : schedule.n_tasks + 1] > 0


def end_states(states: pl.DataFrame) -> pl.DataFrame:
    """Per (agent, t) with a change: the state at the END of task t (the last change at t)."""
    return (states.with_row_index("order").sort("agent", "t", "order")
            .group_by("agent", "t", maintain_order=True).agg(pl.col("to").last())
            .sort("agent", "t"))  # fmt: skip


def scale_outcomes(states: pl.DataFrame, schedule: HealthSchedule) -> dict:
    """Detection for large networks without a (tasks x agents) matrix: per degraded agent the
    first task of its degraded interval at whose end it is isolated (same rule as
    agent_outcomes), whether it is isolated at the end of the interval, and the detections of an
    agent already isolated when it degraded (agent_outcomes' isolated_at_onset), counted."""
    intervals = pl.DataFrame(list(schedule.intervals), schema={"agent": pl.Int64, "begin": pl.Int64, "end": pl.Int64},
                             orient="row")  # fmt: skip
    changes = end_states(states).with_columns(pl.col("agent").cast(pl.Int64), pl.col("t").cast(pl.Int64))

    def state_at(col: str, shift: int) -> pl.DataFrame:
        query = intervals.select("agent", (pl.col(col) + shift).alias("t")).sort("t")
        joined = query.join_asof(
            changes.sort("t"), on="t", by="agent", strategy="backward", check_sortedness=False
        )
        return joined.select("agent", pl.col("to").fill_null("normal").alias(col + "_state"))

    first_isolation = (changes.join(intervals, on="agent")
                       .filter((pl.col("to") == "isolated") & (pl.col("t") > pl.col("begin")) & (pl.col("t") < pl.col("end")))
                       .group_by("agent").agg(pl.col("t").min().alias("first")))  # fmt: skip
    onset = state_at("begin", -1).rename({"begin_state": "onset_state"})
    table = (intervals.join(state_at("begin", 0), on="agent").join(state_at("end", -1), on="agent")
             .join(onset, on="agent")
             .join(first_isolation, on="agent", how="left")
             .with_columns(pl.when(pl.col("begin_state") == "isolated").then(pl.col("begin"))
                           .otherwise(pl.col("first")).alias("detected")))  # fmt: skip
    delays = (table["detected"] - table["begin"]).drop_nulls()
    return {
        "degraded": intervals.height,
        "isolated_degraded": int((table["end_state"] == "isolated").sum()),
        "missed": int(table["detected"].is_null().sum()),
        "onset_detections": int(
            ((table["onset_state"] == "isolated") & (table["begin_state"] == "isolated")).sum()
        ),
        "detection_delay_mean": float(delays.mean()) if delays.len() else None,
        "detection_delay_median": float(delays.median()) if delays.len() else None,
    }


# Parse outcomes of the live backend (spec/live.md): the calls table's `parse_status` per sample
# is "ok", "retried" (the first reply did not parse, the retry with seed + 1,000,003 did) or
# "failed" (the retry did not parse either: the parser's fallback was recorded). The same values
# as backends.live.PARSE_OK / PARSE_RETRIED / PARSE_FAILED (not imported: this module reads
# tables only); the emulator and the reference engine write "ok" for every call.
PARSE_OK = "ok"
PARSE_COUNTED = ("failed", "retried")
# Call kinds grouped by what a failed parse leaves behind (every kind of backends.live.KINDS):
# inference -> the documented pair of the task type (which is the true pair); review -> the
# neutral score 0.5 (MeshHeal's review samples and committee rounds, RAPS' watchdog, SAC's
# evaluations); execution -> a reply without an answer; choice -> no named agent (AgentNet's
# router, AutoGen's speaker selection: the method's own rule decides).
PARSE_GROUPS: dict[str, tuple[str, ...]] = {
    "infer": ("infer",),
    "review": ("review", "committee1", "committee2", "watchdog", "evaluate"),
    "execution": ("generate", "candidate", "synthesis", "compose", "refine", "cot"),
    "choice": ("router", "select"),
}
# parse_failed, parse_failed_infer, ..., parse_retried, parse_retried_infer, ...: samples per stream
PARSE_KEYS = tuple(
    f"parse_{status}{suffix}" for status in PARSE_COUNTED for suffix in ("", *(f"_{g}" for g in PARSE_GROUPS))
)


def parse_counts(calls: pl.DataFrame, tasks: pl.DataFrame, n_phases: int) -> tuple[dict, list[dict]]:
    """One stream's replies that failed to parse for good (`parse_failed*`) and that parsed only on
    their retry (`parse_retried*`), in all and per kind group (PARSE_GROUPS): counts of samples
    (an n = 3 initial review is three), for the whole stream and per phase (a call's phase is its
    task's). A status list joined by commas (a baseline call's live trace) counts each entry."""
    problems = calls.filter(pl.col("parse_status").fill_null(PARSE_OK) != PARSE_OK)
    problems = problems.join(tasks.select("t", "phase"), on="t", how="left").select(
        "phase",
        "kind",
        *(pl.col("parse_status").str.count_matches(s, literal=True).alias(s) for s in PARSE_COUNTED),
    )

    def tally(df: pl.DataFrame) -> dict:
        out = {}
        for status in PARSE_COUNTED:
            out[f"parse_{status}"] = int(df[status].sum())
            for group, kinds in PARSE_GROUPS.items():
                out[f"parse_{status}_{group}"] = int(df.filter(pl.col("kind").is_in(kinds))[status].sum())
        return out

    return tally(problems), [tally(problems.filter(pl.col("phase") == k)) for k in range(n_phases)]


def stream_metrics(
    tasks: pl.DataFrame, reviews: pl.DataFrame | None, states: pl.DataFrame,
    schedule: HealthSchedule, phase_names: Sequence[str], per_agent: bool = True,
    calls: pl.DataFrame | None = None, scale_counts: bool = False,
) -> dict:  # fmt: skip
    """Every per-stream number the summary aggregates over seeds. per_agent=False (large
    networks) replaces the per-agent outcome list by scale_outcomes' counts; scale_counts=True adds
    the counts beside the per-agent list (the scale experiment at 6 agents). With `calls` (the
    stream's calls table) the parse counts (PARSE_KEYS, parse_counts) are added, overall and per
    phase; without it they are left out (not known), as the review audit is without `reviews`."""
    degraded_rows = any_degraded(schedule)
    tasks = tasks.sort("t")
    tasks = tasks.with_columns(pl.Series("any_degraded", degraded_rows[tasks["t"].to_numpy() - 1]))
    healthy, degraded = tasks.filter(~pl.col("any_degraded")), tasks.filter(pl.col("any_degraded"))
    acc_h, acc_d = _mean(healthy, "correct"), _mean(degraded, "correct")
    parse, parse_phases = parse_counts(calls, tasks, len(phase_names)) if calls is not None else ({}, None)
    phases = []
    for k, name in enumerate(phase_names):
        part = tasks.filter(pl.col("phase") == k)
        phases.append({"name": name, "acc": _mean(part, "correct"), "tokens_per_task": _mean(part, "tokens"),
                       "calls_per_task": _mean(part, "calls"), **(parse_phases[k] if parse_phases else {})})  # fmt: skip
    to_isolated = states.filter(pl.col("to") == "isolated")
    false_iso = to_isolated.filter(~pl.col("degraded"))
    agents = agent_outcomes(states, schedule) if per_agent else []
    scale = scale_outcomes(states, schedule) if scale_counts or not per_agent else {}
    return {
        "acc_healthy": acc_h,
        "acc_degraded": acc_d,
        "phase_change": None if acc_h is None or acc_d is None else acc_d - acc_h,
        "calls_per_task_healthy": _mean(healthy, "calls"),
        "calls_per_task_degraded": _mean(degraded, "calls"),
        "tokens_per_task_healthy": _mean(healthy, "tokens"),
        "tokens_per_task_degraded": _mean(degraded, "tokens"),
        "unanswered": int((~tasks["answered"]).sum()),
        "unreviewed_outputs": int(tasks["unreviewed"].sum()),
        **parse,
        "phases": phases,
        "agents": agents,
        "missed": scale["missed"] if scale else sum(a["detection_delay"] is None for a in agents),
        **{k: v for k, v in scale.items() if k != "missed"},
        "false_isolations": false_iso.height,
        "false_isolated_agents": false_iso["agent"].n_unique(),
        "review_audit": review_audit(reviews)
        if reviews is not None and (reviews.height or per_agent)
        else {},
    }


SCALAR_KEYS = (
    "acc_healthy", "acc_degraded", "phase_change", "calls_per_task_healthy",
    "calls_per_task_degraded", "tokens_per_task_healthy", "tokens_per_task_degraded",
    "unanswered", "unreviewed_outputs", "missed", "false_isolations", "false_isolated_agents",
)  # fmt: skip
SCALE_KEYS = (
    "degraded",
    "isolated_degraded",
    "onset_detections",
    "detection_delay_mean",
    "detection_delay_median",
)
PHASE_KEYS = ("acc", "tokens_per_task", "calls_per_task")  # + PARSE_KEYS where the calls were given


def _present(keys: Sequence[str], entry: dict) -> tuple[str, ...]:
    """The keys an entry carries (scale and parse counts are there only where they are known)."""
    return tuple(k for k in keys if k in entry)


def aggregate(per_seed: list[dict], seeds: Sequence[int]) -> dict:
    """Per-seed metric dicts of one (method, dataset, pair) -> stats over seeds."""
    out: dict = {"seeds": list(seeds)}
    first = per_seed[0]
    for key in SCALAR_KEYS + _present(SCALE_KEYS + PARSE_KEYS, first):
        out[key] = stat([m[key] for m in per_seed])
    out["phases"] = [
        {"name": ph["name"],
         **{key: stat([m["phases"][k][key] for m in per_seed]) for key in PHASE_KEYS + _present(PARSE_KEYS, ph)}}
        for k, ph in enumerate(first["phases"])
    ]  # fmt: skip
    out["agents"] = [
        {"agent": a["agent"], "profile": f"A{a['agent'] % 6 + 1}",
         "degraded_at": a["degraded_at"], "recovered_at": a["recovered_at"],
         "detection_delay": stat([m["agents"][k]["detection_delay"] for m in per_seed]),
         "closure_seeds": sum(bool(m["agents"][k]["closure"]) for m in per_seed),
         "onset_detections": sum(onset_detection(m["agents"][k]) for m in per_seed),
         "reintegration_delay": stat([m["agents"][k]["reintegration_delay"] for m in per_seed])}
        for k, a in enumerate(first["agents"])
    ]  # fmt: skip
    out["review_audit"] = {
        key: stat([m["review_audit"][key] for m in per_seed]) for key in first["review_audit"]
    }
    return out


def mean_over_datasets(per_dataset: dict[str, list[dict]], seeds: Sequence[int]) -> dict:
    """The "dataset": "mean" entry: scalars averaged over datasets within each seed."""
    datasets = list(per_dataset)
    out: dict = {"seeds": list(seeds)}
    for key in SCALAR_KEYS + _present(PARSE_KEYS, per_dataset[datasets[0]][0]):
        within_seed = []
        for k in range(len(seeds)):
            within_seed.append(_mean_or_none([per_dataset[d][k][key] for d in datasets]))
        out[key] = stat(within_seed)
    first = per_dataset[datasets[0]][0]["phases"]
    out["phases"] = [
        {"name": ph["name"], **{
            key: stat([_mean_or_none([per_dataset[d][k]["phases"][j][key] for d in datasets])
                       for k in range(len(seeds))])
            for key in PHASE_KEYS + _present(PARSE_KEYS, ph)}}
        for j, ph in enumerate(first)
    ]  # fmt: skip
    out["agents"] = []  # per-agent outcomes are per dataset
    out["review_audit"] = {}
    return out


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))
