"""The readable reference engine: MeshHeal one task at a time, in plain Python (float64).

Written to be read beside the paper's Algorithm 1 and spec/protocol.md. It shares only DATA with
the JAX engine (profiles, graphs, streams, per-task draws, parameter files); its routing, review,
detector and emulator logic are its own (spec/architecture.md "Reference implementation").
Open choices follow docs/decisions.md.

Each LLM call is a request (kind, calling agent, ability, author, context) answered by
ReferenceEmulator, which alone knows health, models and latent correctness. The protocol
(ReferenceNetwork + run_task) reads only the responses' scores, answers and tokens.
"""

from __future__ import annotations

import dataclasses
import math

from meshheal_jax import draws as D
from meshheal_jax.config import ProtocolParams
from meshheal_jax.params import ANCHORS, ModelParams, Pair
from meshheal_jax.streams import HealthSchedule, Stream
from meshheal_jax.topology import Network

INF = 2**30
NORMAL, WATCHED, ISOLATED = "normal", "watched", "isolated"


def pick(u: float, n: int) -> int:
    """Uniform pick among n candidates listed in increasing index."""
    return min(math.floor(u * n), n - 1)


def categorical(u: float, thresholds: tuple[float, ...]) -> int:
    for k, threshold in enumerate(thresholds):
        if u < threshold:
            return k
    return len(thresholds) - 1


# ----------------------------------------------------------------------------------------------
# Rolling windows and the detector's statistics
# ----------------------------------------------------------------------------------------------


class Window:
    """Last `size` values; push k goes to slot k mod size; sums run over slots in index order."""

    def __init__(self, size: int):
        self.slots = [0.0] * size
        self.count = 0

    def push(self, x: float) -> None:
        self.slots[self.count % len(self.slots)] = x
        self.count += 1

    def filled(self) -> int:
        return min(self.count, len(self.slots))

    def mean(self) -> float:
        total = 0.0
        for k in range(self.filled()):
            total += self.slots[k]
        return total / self.filled()


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation on sorted values: pos = q (n-1)."""
    pos = q * (len(sorted_values) - 1)
    lo, hi = sorted_values[math.floor(pos)], sorted_values[math.ceil(pos)]
    return lo + (hi - lo) * (pos - math.floor(pos))


def median3(a: float, b: float, c: float) -> float:
    return sorted((a, b, c))[1]


def sample_std3(a: float, b: float, c: float) -> float:
    mean = (a + b + c) / 3.0
    return math.sqrt(((a - mean) ** 2 + (b - mean) ** 2 + (c - mean) ** 2) / 2.0)


def needs_committee(q0: float, s_u: float, author_watched: bool, probe: bool, p: ProtocolParams) -> bool:
    """Alg. 2: committee iff q0 <= tau_to or s_u >= sigma_com or watched author or probe."""
    return q0 <= p.tau_to + p.threshold_tol or s_u >= p.sigma_com - p.threshold_tol or author_watched or probe


def is_low(q: float, p: ProtocolParams) -> bool:
    """q <= tau_to: a low score (Takeover after a committee)."""
    return q <= p.tau_to + p.threshold_tol


def next_state(state: str, consecutive: int, z: float, p: ProtocolParams) -> tuple[str, int, str]:
    """§5 step 9: (new state, new consecutive counter, reason). Reason '' = no change."""
    crossed_beta = z >= p.beta - p.threshold_tol
    crossed_alpha = z >= p.alpha - p.threshold_tol
    consecutive = consecutive + 1 if crossed_beta else 0
    if state in (NORMAL, WATCHED) and consecutive >= p.consecutive_to_isolate:
        return ISOLATED, 0, "consecutive z>=beta"
    if state == NORMAL and crossed_alpha:
        return WATCHED, consecutive, "z>=alpha"
    if state == WATCHED and not crossed_alpha:
        return NORMAL, consecutive, "z<alpha"
    if state == ISOLATED and not crossed_beta:
        return WATCHED, consecutive, "probe z<beta"
    return state, consecutive, ""


def cusum_update(s: float, q: float, p: ProtocolParams) -> float:
    """Page's one-sided CUSUM on the score deficit: S <- max(0, S + (target - q) - k)."""
    return max(0.0, s + (p.cusum_target - q) - p.cusum_k)


def next_state_cusum(state: str, s: float, p: ProtocolParams) -> tuple[str, str]:
    """CUSUM transitions (baselines.md): watched at S >= h/2, isolated at S >= h; back to watched
    below h (probe outputs), back to normal below h/2. Returns (new state, reason)."""
    high = s >= p.cusum_h - p.threshold_tol
    half = s >= p.cusum_h / 2 - p.threshold_tol
    if state in (NORMAL, WATCHED) and high:
        return ISOLATED, "S>=h"
    if state == NORMAL and half:
        return WATCHED, "S>=h/2"
    if state == WATCHED and not half:
        return NORMAL, "S<h/2"
    if state == ISOLATED and not high:
        return WATCHED, "probe S<h"
    return state, ""


# ----------------------------------------------------------------------------------------------
# The emulated backend (plain Python): the only place that knows health, models and truth
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    """An output as the backend knows it: latent truth and the visible length."""

    correct: bool  # part bit (Contribute) or final-answer bit (Finalize / synthesis)
    tokens: int  # visible tokens passed on to later calls
    model: str  # "strong" | "weak": which pair member wrote it
    answer_id: int = 0  # final answers: 0 = gold, k >= 1 = distractor k
    on_wrong_draft: bool = False  # a Finalize's own part written on an accepted draft with a wrong output


class ReferenceEmulator:
    def __init__(self, network: Network, pair: Pair, schedule: HealthSchedule, question_tokens: list[int],
                 difficulty: list[int]):  # fmt: skip
        self.holds = network.holds
        self.pair = pair
        self.schedule = schedule
        self.question_tokens = question_tokens  # tokens of task t's question at index t-1
        self.difficulty = difficulty  # difficulty bin of task t's question at index t-1
        self.p_part = {
            "strong": pair.strong.p_part_for(network.profile),
            "weak": pair.weak.p_part_for(network.profile),
        }
        self.calls: list[dict] = []

    def role(self, agent: int, ability: int | None, t: int) -> str:
        """Model-backed rule: strong iff healthy and (ability held or no ability)."""
        if self.schedule.is_degraded(agent, t):
            return "weak"
        if ability is None or self.holds[agent, ability]:
            return "strong"
        return "weak"

    def model(self, role: str) -> ModelParams:
        return self.pair.strong if role == "strong" else self.pair.weak

    def _complete(self, m: ModelParams, kind: str, u: float) -> int:
        lo, hi = m.completion_tokens[kind]
        return min(lo + math.floor(u * (hi - lo + 1)), hi)

    def _visible(self, m: ModelParams, completion: int) -> int:
        return math.floor(completion * m.answer_fraction)

    def _log(
        self, ctx: dict, kind: str, agent: int, role: str, prompt: int, completion: int, **fields
    ) -> None:
        self.calls.append(
            dict(ctx, kind=kind, agent=agent, model=self.model(role).model,
                 prompt_tokens=prompt, completion_tokens=completion, **fields)
        )  # fmt: skip

    def _distractor(self, m: ModelParams, u: float) -> int:
        return 1 + categorical(u, m.distractor_thresholds())

    # -- call kinds --------------------------------------------------------------------------

    def infer(self, ctx, agent: int, t: int, true_pair: int, n_pairs: int, u) -> int:
        role = self.role(agent, None, t)
        m = self.model(role)
        if u[D.INFER_CORRECT] < m.p_infer or n_pairs == 1:
            inferred = true_pair
        else:
            others = [k for k in range(n_pairs) if k != true_pair]
            inferred = others[pick(u[D.INFER_WRONG_PAIR], len(others))]
        completion = self._complete(m, "infer", u[D.INFER_TOKENS])
        prompt = m.prompt_tokens["infer"] + self.question_tokens[t - 1]
        self._log(ctx, "infer", agent, role, prompt, completion, author=-1, ability=-1,
                  score=None, answer_id=None, correct=inferred == true_pair)  # fmt: skip
        return inferred

    def generate(
        self, ctx, agent, ability, t, task_type, draft: list[Output], finalize, pair_ok, u
    ) -> tuple[Output, Output | None]:
        """A part (Contribute) or the rest plus the final answer (Finalize).

        Returns (the judged part, the final answer or None)."""
        role = self.role(agent, ability, t)
        m = self.model(role)
        q = self.difficulty[t - 1]
        part_ok = u[D.U_MAIN] < self.p_part[role][task_type][q]
        completion = self._complete(m, "generate", u[D.U_TOKENS])
        context = sum(o.tokens for o in draft)
        prompt = m.prompt_tokens["generate"] + self.question_tokens[t - 1] + context
        draft_ok = all(o.correct for o in draft)
        part = Output(part_ok, self._visible(m, completion), role, on_wrong_draft=finalize and not draft_ok)
        answer = None
        if finalize:
            if not pair_ok:
                answer_ok = u[D.U_AUX] < self.p_part["weak"][task_type][q]
            else:
                answer_ok = part_ok and (draft_ok or u[D.U_AUX] < m.p_rescue)
            answer_id = 0 if answer_ok else self._distractor(m, u[D.U_DISTRACTOR])
            answer = Output(answer_ok, part.tokens, role, answer_id)
        self._log(ctx, "generate", agent, role, prompt, completion, author=agent, ability=ability,
                  score=None, answer_id=None if answer is None else answer.answer_id,
                  correct=part_ok if answer is None else answer.correct)  # fmt: skip
        return part, answer

    def review_sample(
        self, ctx, kind, reviewer, ability, t, judged: Output, draft, u, repeat_of=None
    ) -> tuple[float, int]:
        """One review score on the anchors; returns (score, visible explanation tokens)."""
        role = self.role(reviewer, ability, t)
        m = self.model(role)
        author_role = f"{judged.model}_author"
        if repeat_of is not None and u[D.U_AUX] < m.rho_same:
            score = repeat_of
        else:
            thresholds = m.review_thresholds(
                author_role, judged.correct, self.difficulty[t - 1], judged.on_wrong_draft
            )
            score = ANCHORS[categorical(u[D.U_MAIN], thresholds)]
        return self._score_call(ctx, kind, reviewer, role, ability, judged, draft, u, score, 0, t)

    def round2_sample(
        self, ctx, reviewer, ability, t, judged: Output, draft, other_round1: float, u, extra
    ) -> tuple[float, int]:
        """Committee round 2: sees both round-1 judgements (extra = their visible tokens)."""
        role = self.role(reviewer, ability, t)
        m = self.model(role)
        if u[D.U_AUX] < m.p_follow:
            score = other_round1
        else:
            thresholds = m.round2_thresholds(
                f"{judged.model}_author", judged.correct, self.difficulty[t - 1], judged.on_wrong_draft
            )
            score = ANCHORS[categorical(u[D.U_MAIN], thresholds)]
        return self._score_call(ctx, "committee2", reviewer, role, ability, judged, draft, u, score, extra, t)

    def _score_call(
        self, ctx, kind, reviewer, role, ability, judged, draft, u, score, extra, t
    ) -> tuple[float, int]:
        m = self.model(role)
        completion = self._complete(m, kind, u[D.U_TOKENS])
        prompt = (
            m.prompt_tokens[kind]
            + self.question_tokens[t - 1]
            + sum(o.tokens for o in draft)
            + judged.tokens
            + extra
        )
        self._log(ctx, kind, reviewer, role, prompt, completion, author=ctx["author"], ability=ability,
                  score=score, answer_id=None, correct=judged.correct)  # fmt: skip
        return score, self._visible(m, completion)

    def takeover(self, ctx, writers, a, ability, t, judged: Output, draft, original: Output, finalize, ucand,
                 usynth) -> Output:  # fmt: skip
        """A correction candidate by each of `writers`, then a's synthesis replaces the output.
        Full MeshHeal: writers = (A, B); single_reviewer: writers = () and a = the reviewer, whose
        one correction call is the synthesis (decisions: single correction)."""
        visible = []
        for agent, u in zip(writers, ucand):
            role = self.role(agent, ability, t)
            m = self.model(role)
            completion = self._complete(m, "candidate", u[D.U_TOKENS])
            prompt = (
                m.prompt_tokens["candidate"]
                + self.question_tokens[t - 1]
                + sum(o.tokens for o in draft)
                + judged.tokens
            )
            self._log(ctx, "candidate", agent, role, prompt, completion, author=ctx["author"], ability=ability,
                      score=None, answer_id=None, correct=None)  # fmt: skip
            visible.append(self._visible(m, completion))
        role = self.role(a, ability, t)
        m = self.model(role)
        p_ok = m.p_keep if original.correct else m.p_fix
        ok = usynth[D.U_MAIN] < p_ok
        completion = self._complete(m, "synthesis", usynth[D.U_TOKENS])
        prompt = (m.prompt_tokens["synthesis"] + self.question_tokens[t - 1] + sum(o.tokens for o in draft)
                  + judged.tokens + sum(visible))  # fmt: skip
        answer_id = 0 if ok else self._distractor(m, usynth[D.U_DISTRACTOR])
        out = Output(ok, self._visible(m, completion), role, answer_id if finalize else 0)
        self._log(ctx, "synthesis", a, role, prompt, completion, author=ctx["author"], ability=ability,
                  score=None, answer_id=out.answer_id if finalize else None, correct=ok)  # fmt: skip
        return out


# ----------------------------------------------------------------------------------------------
# The network: routing states, distance tables, evidence windows, detector
# ----------------------------------------------------------------------------------------------


class ReferenceNetwork:
    def __init__(self, network: Network, params: ProtocolParams, n_types: int):
        self.net = network
        self.p = params
        self.n = network.n_agents
        self.n_abilities = network.holds.shape[1]
        self.neighbours = [network.neighbours(i) for i in range(self.n)]
        self.state = [NORMAL] * self.n
        self.consecutive = [0] * self.n
        self.probe_timer = [0] * self.n
        self.n_types = n_types
        keys = [(i, ty, s) for i in range(self.n) for ty in range(n_types) for s in range(self.n_abilities)]
        self.scores = {k: Window(params.window_scores) for k in keys}
        self.shortfalls = {k: Window(params.window_shortfalls) for k in keys}
        self.n_shortfalls = {k: 0 for k in keys}
        self.cusum = {k: 0.0 for k in keys}  # CUSUM statistic S per key (detector "cusum")
        self.distance = self.distance_tables()
        self.settled = True  # the tables are the converged ones for the current states (hop_per_task)

    def holds(self, agent: int, ability: int) -> bool:
        return bool(self.net.holds[agent, ability])

    # -- §2 distance tables (distributed Bellman-Ford) --------------------------------------------

    def provides(self, agent: int, column: int) -> bool:
        """An eligible provider of ability `column` (held, not isolated); column n_abilities: any
        non-isolated agent."""
        return self.state[agent] != ISOLATED and (column == self.n_abilities or self.holds(agent, column))

    def distance_tables(self) -> list[list[int]]:
        """distance[i][s] for s < n_abilities, and distance[i][n_abilities] = nearest non-isolated:
        Bellman-Ford to convergence, one column at a time, improved in place (the tables `relax`
        leaves as they are; in place, a column converges in fewer sweeps, and this engine is the
        benchmarks' baseline)."""
        columns = []
        for s in range(self.n_abilities + 1):
            dist = [0 if self.provides(i, s) else INF for i in range(self.n)]
            changed = True
            while changed:
                changed = False
                for i in range(self.n):
                    best = min([dist[j] + 1 for j in self.neighbours[i]] + [dist[i]])
                    if best < dist[i]:
                        dist[i], changed = best, True
            columns.append(dist)
        return [[columns[s][i] for s in range(self.n_abilities + 1)] for i in range(self.n)]

    def relax(self) -> list[list[int]]:
        """One synchronous Bellman-Ford step from the current tables ("hop_per_task" convergence,
        decisions P6): a provider is at 0, any other agent at 1 + its neighbours' nearest; N or more
        hops is INF (no shortest path is that long)."""
        out = []
        for i in range(self.n):
            row = []
            for s in range(self.n_abilities + 1):
                through = min([self.distance[j][s] for j in self.neighbours[i]], default=INF) + 1
                row.append(0 if self.provides(i, s) else (through if through < self.n else INF))
            out.append(row)
        return out

    def reach(self, agent: int, column: int) -> int:
        """How far the agent reads `column`'s nearest provider to be: its own table's entry, or, with
        hop_per_task convergence, one more than its nearest neighbour's (the tables may disagree)."""
        if self.p.convergence == "instant":
            return self.distance[agent][column]
        return min([self.distance[j][column] for j in self.neighbours[agent]], default=INF) + 1

    def next_hops(self, agent: int, column: int) -> list[int]:
        d = self.reach(agent, column)
        return [j for j in self.neighbours[agent] if self.distance[j][column] == d - 1]

    def probe_eligible(self, agent: int, t: int) -> bool:
        return self.state[agent] == ISOLATED and t - self.probe_timer[agent] >= self.p.probe_interval

    def reviewers(self, author: int, abilities: list[int]) -> list[int]:
        return [j for j in self.neighbours[author]
                if self.state[j] == NORMAL and all(self.holds(j, s) for s in abilities)]  # fmt: skip

    # -- §5 the peer-relative detector -----------------------------------------------------------

    def observe(self, i: int, task_type: int, s: int, q: float, t: int, warmup: int) -> dict:
        """Record author i's final score q; returns {z, from, to, reason} (z None if not formed).
        z is the detector's statistic: peer-relative z, z_abs, or the CUSUM S."""
        if self.p.detector == "absolute":
            return self.observe_absolute(i, task_type, s, q, t, warmup)
        if self.p.detector == "cusum":
            return self.observe_cusum(i, task_type, s, q, t, warmup)
        return self.observe_relative(i, task_type, s, q, t, warmup)

    def _enter(self, i: int, new: str, t: int, z: float, reason: str, out: dict) -> dict:
        """Apply a detector decision: probe timer on isolation, distance tables on a change."""
        was = self.state[i] == ISOLATED
        entering, leaving = new == ISOLATED and not was, was and new != ISOLATED
        if entering:
            self.probe_timer[i] = t
        if {"on_isolation": entering, "on_release": leaving}.get(self.p.window_reset, False):
            self.clear_evidence(i)
        out.update(z=z, to=new, reason=reason)
        if new != self.state[i]:
            self.state[i] = new
            if self.p.convergence == "instant":  # (hop_per_task: the next tasks' starts relax them)
                self.distance = self.distance_tables()
            self.settled = False
        return out

    def clear_evidence(self, i: int) -> None:
        """window_reset (decisions P7): every window, count and CUSUM statistic of agent i emptied,
        as at the start."""
        for task_type in range(self.n_types):
            for s in range(self.n_abilities):
                key = (i, task_type, s)
                self.scores[key] = Window(self.p.window_scores)
                self.shortfalls[key] = Window(self.p.window_shortfalls)
                self.n_shortfalls[key] = 0
                self.cusum[key] = 0.0

    def observe_absolute(self, i: int, task_type: int, s: int, q: float, t: int, warmup: int) -> dict:
        """Absolute detector: z_abs = (threshold - own mean score of (T, s)) / scale, into §5 step 9."""
        key = (i, task_type, s)
        out = {"z": None, "from": self.state[i], "to": self.state[i], "reason": ""}
        window = self.scores[key]
        window.push(q)
        if t <= warmup or window.count < self.p.min_observations:
            return out
        z = (self.p.absolute_threshold - window.mean()) / self.p.absolute_scale
        new, self.consecutive[i], reason = next_state(self.state[i], self.consecutive[i], z, self.p)
        return self._enter(i, new, t, z, reason, out)

    def observe_cusum(self, i: int, task_type: int, s: int, q: float, t: int, warmup: int) -> dict:
        """CUSUM detector: S of (i, T, s) updated by every final score; transitions on S."""
        key = (i, task_type, s)
        out = {"z": None, "from": self.state[i], "to": self.state[i], "reason": ""}
        self.cusum[key] = cusum_update(self.cusum[key], q, self.p)
        self.scores[key].push(q)
        if t <= warmup or self.scores[key].count < self.p.min_observations:
            return out
        new, reason = next_state_cusum(self.state[i], self.cusum[key], self.p)
        return self._enter(i, new, t, self.cusum[key], reason, out)

    def observe_relative(self, i: int, task_type: int, s: int, q: float, t: int, warmup: int) -> dict:
        """The peer-relative detector of §5."""
        key = (i, task_type, s)
        out = {"z": None, "from": self.state[i], "to": self.state[i], "reason": ""}
        peers = [j for j in self.neighbours[i]
                 if j != i and self.state[j] == NORMAL and self.scores[(j, task_type, s)].filled() > 0]  # fmt: skip
        self.scores[key].push(q)
        if not peers:
            return out
        total = 0.0
        for j in peers:
            total += self.scores[(j, task_type, s)].mean()
        reference = total / len(peers)
        self.shortfalls[key].push(reference - q)
        self.n_shortfalls[key] += 1
        if t <= warmup or self.n_shortfalls[key] < self.p.min_observations:
            return out
        own = self.shortfalls[key].mean()
        pool = []
        for j in self.neighbours[i]:
            if j == i or self.state[j] != NORMAL:
                continue
            for s2 in range(self.n_abilities):
                if self.n_shortfalls[(j, task_type, s2)] >= self.p.min_matched:
                    pool.append(self.shortfalls[(j, task_type, s2)].mean())
        if not pool:
            return out
        pool.sort()
        m, p25 = quantile(pool, 0.5), quantile(pool, 0.25)
        z = (own - m) / max(m - p25, self.p.z_scale_floor)
        new, self.consecutive[i], reason = next_state(self.state[i], self.consecutive[i], z, self.p)
        return self._enter(i, new, t, z, reason, out)


# ----------------------------------------------------------------------------------------------
# One task (Alg. 1) and one stream
# ----------------------------------------------------------------------------------------------


class Unanswered(Exception):
    """The task ends without an answer (budget, unreachable ability)."""


@dataclasses.dataclass
class StreamRecords:
    tasks: list[dict]
    reviews: list[dict]
    states: list[dict]
    calls: list[dict]


class ReferenceEngine:
    def __init__(self, network: Network, params: ProtocolParams, pair: Pair, stream: Stream,
                 schedule: HealthSchedule, draws: D.TaskDraws, labels: dict | None = None):  # fmt: skip
        self.network = network
        self.p = params
        self.stream = stream
        self.schedule = schedule
        self.draws = draws
        self.profile = network.profile
        self.labels = dict(labels or {})
        self.world = ReferenceNetwork(network, params, len(self.profile.task_types))
        self.backend = ReferenceEmulator(
            network, pair, schedule, stream.question_tokens_or(self.profile.question_tokens).tolist(),
            stream.difficulty.tolist())  # fmt: skip
        self.warmup = params.warmup_tasks(network.n_agents)
        self.records = StreamRecords([], [], [], [])

    def run(self) -> StreamRecords:
        """Every task of the stream; the records include the emulator's calls (an emulated call has
        no latency and always parses)."""
        for t in range(1, self.stream.n_tasks + 1):
            self.run_task(t)
        self.records.calls = [dict(c, latency_s=0.0, parse_status="ok") for c in self.backend.calls]
        return self.records

    def run_task(self, t: int) -> None:
        self.task = _Task(t=t, task_type=int(self.stream.task_type[t - 1]))
        self.u_route = self.draws.route[t - 1]
        self.u_calls = self.draws.calls[t - 1]
        n_calls_before = len(self.backend.calls)
        if self.p.convergence == "hop_per_task" and not self.world.settled:  # news travels a hop per task
            relaxed = self.world.relax()  # (converged tables relax to themselves: skipped)
            self.world.settled, self.world.distance = relaxed == self.world.distance, relaxed
        try:
            self._execute(t)
        except Unanswered as why:
            self.task.answered = False
            self.task.end = str(why)
        task = self.task
        calls = self.backend.calls[n_calls_before:]
        self.records.tasks.append(dict(
            self.labels, t=t, task_type=task.task_type, phase=int(self.stream.phase[t - 1]),
            entry=task.entry, route="-".join(map(str, task.route)), actions=",".join(task.actions),
            moves=task.moves, answered=task.answered, correct=task.answered and task.answer.correct,
            answer_id=task.answer.answer_id if task.answered else -1,
            inferred_pair=task.inferred_pair, pair_correct=task.pair_correct,
            unreviewed=task.unreviewed, end=task.end, calls=len(calls),
            prompt_tokens=sum(c["prompt_tokens"] for c in calls),
            completion_tokens=sum(c["completion_tokens"] for c in calls),
            tokens=sum(c["prompt_tokens"] + c["completion_tokens"] for c in calls),
        ))  # fmt: skip

    def _ctx(self, author: int = -1) -> dict:
        return dict(self.labels, t=self.task.t, visit=self.task.moves, author=author)

    def _move(self, to: int, action: str) -> None:
        task = self.task
        if task.moves + 1 > self.p.move_limit or task.since_output + 1 > self.p.route_limit:
            raise Unanswered("move budget")
        task.moves += 1
        task.since_output += 1
        task.actions.append(action)
        task.route.append(to)
        task.agent = to

    def _tie(self, u: float, n: int) -> int:
        """A next hop among n equally near neighbours (increasing index): the tie draw's pick, or the
        lowest index (ProtocolParams.next_hop_ties)."""
        return pick(u, n) if self.p.next_hop_ties == "random" else 0

    def _toward(self, column: int, action: str, unreachable: str) -> None:
        """Move the task one hop toward `column`'s nearest provider (§2), or end it unanswered."""
        agent = self.task.agent
        if self.world.reach(agent, column) >= INF:
            raise Unanswered(unreachable)
        hops = self.world.next_hops(agent, column)
        self._move(hops[self._tie(self.u_route[self.task.moves][D.HOP_TIE], len(hops))], action)

    def _next_hop(self, missing: list[int], action: str) -> None:
        s = missing[pick(self.u_route[self.task.moves][D.HOP_ABILITY], len(missing))]
        self._toward(s, action, "unreachable ability")

    def _execute(self, t: int) -> None:
        task, world = self.task, self.world
        task.entry = task.agent = pick(float(self.draws.entry[t - 1]), self.network.n_agents)
        task.route = [task.agent]
        # 1. RawRelay from an isolated entry agent toward the nearest non-isolated agent.
        while world.state[task.agent] == ISOLATED:
            self._toward(world.n_abilities, "rawrelay", "no non-isolated agent reachable")
        # 2. InferAbilities by the first non-isolated holder.
        true_pair = self.profile.pair_index(task.task_type)
        pairs = self.profile.pairs
        task.inferred_pair = self.backend.infer(
            self._ctx(), task.agent, t, true_pair, len(pairs), self.draws.infer[t - 1]
        )
        task.pair_correct = task.inferred_pair == true_pair
        required = sorted(pairs[task.inferred_pair])  # vocabulary order
        task.actions.append("infer")
        covered: set[int] = set()
        probe_visit = False
        # 3. Loop until a final answer.
        while True:
            i = task.agent
            missing = [s for s in required if s not in covered]
            if world.state[i] == ISOLATED and not probe_visit:
                self._next_hop(missing, "relay")
                continue
            if not probe_visit:
                candidates = [j for j in world.neighbours[i]
                              if world.probe_eligible(j, t) and any(self.world.holds(j, s) for s in missing)]  # fmt: skip
                within_budget = (task.moves + 1 <= self.p.move_limit
                                 and task.since_output + 1 <= self.p.route_limit)  # fmt: skip
                if candidates and within_budget:
                    j = candidates[pick(self.u_route[task.moves][D.PROBE], len(candidates))]
                    world.probe_timer[j] = t
                    self._move(j, "probe")
                    probe_visit = True
                    continue
            held = [s for s in missing if world.holds(i, s)]
            if not held:
                self._next_hop(missing, "handoff")
                probe_visit = False
                continue
            finalize = len(held) == len(missing)
            output = self._produce(i, held, finalize, probe_visit)
            if finalize:
                task.answer = output
                task.actions.append("finalize")
                return
            task.draft.append(output)
            task.actions.append("contribute")
            covered.update(held)
            task.since_output = 0
            probe_visit = False
            self._next_hop([s for s in required if s not in covered], "handoff")

    def _produce(self, author: int, held: list[int], finalize: bool, probe: bool) -> Output:
        """Contribute/Finalize: generate, review (§4), record evidence (§5). Returns the output used."""
        task, world, p, emu = self.task, self.world, self.p, self.backend
        if len(held) != 1:
            raise AssertionError("profiles guarantee exactly one ability per output (abilities.md)")
        s = held[0]
        v = task.moves
        uc, ur = self.u_calls[v], self.u_route[v]
        ctx = self._ctx(author)
        part, answer = emu.generate(ctx, author, s, task.t, task.task_type, task.draft, finalize,
                                    task.pair_correct, uc[D.GENERATE])  # fmt: skip
        result = answer if finalize else part
        reviewers = world.reviewers(author, held)
        if not reviewers:
            task.unreviewed += 1
            return result
        before = world.state[author]
        r = reviewers[pick(ur[D.REVIEWER], len(reviewers))]
        samples: list[float] = []
        for k, slot in enumerate(D.REVIEW_SAMPLES):
            first = samples[0] if k else None
            samples.append(
                emu.review_sample(ctx, "review", r, s, task.t, part, task.draft, uc[slot], first)[0]
            )
        q0, s_u = median3(*samples), sample_std3(*samples)
        committee = needs_committee(q0, s_u, before == WATCHED, probe, p)
        row = dict(self.labels, t=task.t, visit=v, action="finalize" if finalize else "contribute",
                   author=author, ability=s, author_degraded=self.schedule.is_degraded(author, task.t),
                   author_model=part.model, part_correct=part.correct, probe=probe, reviewer=r,
                   u1=samples[0], u2=samples[1], u3=samples[2], q0=q0, s_u=s_u, committee=committee,
                   committee_a=-1, committee_b=-1, v_a1=None, v_b1=None, v_a=None, v_b=None,
                   q=q0, takeover=False, correct_before=result.correct, correct_after=result.correct)  # fmt: skip
        q = q0
        if committee:
            if p.variant == "single_reviewer":  # the initial reviewer in two isolated contexts
                a = b = r
            elif len(reviewers) >= 2:
                a = reviewers[pick(ur[D.COMMITTEE_A], len(reviewers))]
                rest = [j for j in reviewers if j != a]
                b = rest[pick(ur[D.COMMITTEE_B], len(rest))]
            else:
                a = b = reviewers[0]
            ra, ea = emu.review_sample(ctx, "committee1", a, s, task.t, part, task.draft, uc[D.ROUND1[0]])
            rb, eb = emu.review_sample(ctx, "committee1", b, s, task.t, part, task.draft, uc[D.ROUND1[1]])
            va, _ = emu.round2_sample(ctx, a, s, task.t, part, task.draft, rb, uc[D.ROUND2[0]], ea + eb)
            vb, _ = emu.round2_sample(ctx, b, s, task.t, part, task.draft, ra, uc[D.ROUND2[1]], ea + eb)
            q = (va + vb) / 2.0
            row.update(committee_a=a, committee_b=b, v_a1=ra, v_b1=rb, v_a=va, v_b=vb, q=q)
            if is_low(q, p) and p.variant != "no_takeover":  # no_takeover: the low output stays
                writers = () if p.variant == "single_reviewer" else (a, b)
                ucand = (uc[D.CANDIDATES[0]], uc[D.CANDIDATES[1]])
                result = emu.takeover(ctx, writers, a, s, task.t, part, task.draft, result, finalize,
                                      ucand, uc[D.SYNTHESIS])  # fmt: skip
                row.update(takeover=True, correct_after=result.correct)
        change = world.observe(author, task.task_type, s, q, task.t, self.warmup)
        row.update(z=change["z"], state_before=change["from"], state_after=change["to"])
        self.records.reviews.append(row)
        if change["to"] != change["from"]:
            self.records.states.append(dict(
                self.labels, t=task.t, agent=author, **{"from": change["from"], "to": change["to"]},
                z=change["z"], reason=change["reason"], probe=probe,
                degraded=self.schedule.is_degraded(author, task.t),
            ))  # fmt: skip
        return result


@dataclasses.dataclass
class _Task:
    t: int
    task_type: int
    agent: int = -1
    entry: int = -1
    moves: int = 0
    since_output: int = 0
    route: list = dataclasses.field(default_factory=list)
    actions: list = dataclasses.field(default_factory=list)
    draft: list = dataclasses.field(default_factory=list)
    inferred_pair: int = -1
    pair_correct: bool = False
    answered: bool = True
    answer: Output | None = None
    unreviewed: int = 0
    end: str = ""


def run_stream(network: Network, params: ProtocolParams, pair: Pair, stream: Stream,
               schedule: HealthSchedule, labels: dict | None = None) -> StreamRecords:  # fmt: skip
    """Run one stream on the reference engine; the draws come from draws.stream_draws."""
    draws = D.stream_draws(stream.seed, stream.dataset_id, stream.n_tasks)
    return ReferenceEngine(network, params, pair, stream, schedule, draws, labels).run()
