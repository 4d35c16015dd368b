"""Protocol parameters (spec/protocol.md) as one frozen dataclass.

Every numeric DECISION of the spec is a named field here, and the next-hop tie rule; its other rule
DECISIONs (committee draws, unreviewed outputs, ...) are fixed behaviour, listed at the top of
docs/decisions.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

from meshheal_jax.errors import MeshHealError

VARIANTS = ("full", "single_reviewer", "no_takeover")
NEXT_HOP_TIES = ("random", "lowest")
CONVERGENCE = ("instant", "hop_per_task")
WINDOW_RESET = ("never", "on_isolation", "on_release")
CHECKPOINT_EVERY_S = 60.0  # default seconds between checkpoints of unfinished streams (decisions X1)
DETECTORS = ("relative", "absolute", "cusum")
TAU_TO = 0.40  # protocol.md §4's low-score threshold: a score above it accepts an output
_CHECKS_DEFERRED = contextvars.ContextVar("protocol_checks_deferred", default=False)


@contextlib.contextmanager
def checks_deferred():
    """ProtocolParams made inside skip their checks, which the caller then runs (`check`): the
    command-line parser would wrap a constructor's error in a box of its own (cli.entrypoint)."""
    token = _CHECKS_DEFERRED.set(True)
    try:
        yield
    finally:
        _CHECKS_DEFERRED.reset(token)


@dataclasses.dataclass(frozen=True)
class ProtocolParams:
    alpha: float = 1.2  # z threshold normal -> watched
    beta: float = 2.0  # z threshold for the consecutive counter (isolation after 2)
    consecutive_to_isolate: int = 2
    tau_to: float = TAU_TO  # low-score threshold (committee and Takeover)
    sigma_com: float = 0.55  # review disagreement threshold
    window_scores: int = 8  # W_mu (DECISION)
    window_shortfalls: int = 8  # W_x (DECISION)
    min_observations: int = 3  # shortfalls (and scores, for the other detectors) before z is formed
    min_matched: int = 3  # §5 step 7's "enough matched evidence" for a peer's pool entry (DECISION: 3)
    z_scale_floor: float = 0.10  # z = (xbar - m) / max(m - p25, floor)
    probe_interval: int = 10
    warmup_per_six: int = 30  # warm-up tasks per six agents (DECISION)
    route_limit: int = 4  # moves since the last output (paper's routing limit)
    move_limit: int = 8  # total moves (DECISION)
    threshold_tol: float = 1e-9  # comparisons favour crossing by this much
    # DECISION (protocol.md §2): a next hop among equally near neighbours (routing and RawRelay) is
    # drawn uniformly with the visit's tie draw ("random"), or is the lowest-index one ("lowest":
    # the rule the spec rejects because it starves some holders of all routed work)
    next_hop_ties: str = "random"
    # DECISION (protocol.md §2): after a routing state changes, the distance tables are recomputed to
    # convergence before the next routing decision ("instant", the default), or, the extension the
    # spec names, news travels one hop per task ("hop_per_task": every task's start takes one
    # synchronous Bellman-Ford step over the neighbours' tables; docs/decisions.md P6)
    convergence: str = "instant"
    # protocol.md §5: "Windows are never reset" ("never", the default). Extensions (docs/decisions.md
    # P7): an agent loses its evidence (every score and shortfall window and lifetime count n_x, and
    # CUSUM statistic, of all its keys) when it enters isolation ("on_isolation": its probes are
    # judged on what it did since) or when a probe releases it ("on_release": its outputs after the
    # release are judged on what it does from then on)
    window_reset: str = "never"
    # MeshHeal variant (spec/experiments.md §4, baselines.md "Ablations"):
    #   full | single_reviewer (the initial reviewer is the whole committee, in two contexts, and
    #   writes the Takeover alone: one synthesis call) | no_takeover (low scores leave the output)
    variant: str = "full"
    # detector (spec/experiments.md §5, baselines.md "Detector variants"):
    #   relative (peer-relative z, §5) | absolute (own mean score) | cusum (Page 1954)
    detector: str = "relative"
    # absolute: z_abs = (absolute_threshold - own mean score over the window) / absolute_scale,
    # into the alpha/beta state machine: watched at mean <= 0.58, counted at mean <= 0.50
    absolute_threshold: float = 0.70  # baselines.md (ours)
    absolute_scale: float = 0.10  # = z_scale_floor: the same score distance per unit of z
    # cusum: S <- max(0, S + (cusum_target - q) - cusum_k) per (agent, type, ability);
    # watched at S >= cusum_h / 2, isolated at S >= cusum_h (baselines.md, ours)
    cusum_target: float = 0.85
    cusum_k: float = 0.05
    cusum_h: float = 1.0

    def __post_init__(self):
        if not _CHECKS_DEFERRED.get():
            self.check()

    def check(self) -> None:
        """A MeshHealError naming the first parameter out of its range."""
        for field in dataclasses.fields(self):  # the engines hold these in float64 / int32
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise MeshHealError(f"protocol parameter {field.name} must be finite, got {value}")
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**31) <= value < 2**31:
                raise MeshHealError(f"protocol parameter {field.name} must fit in int32, got {value}")
        if self.variant not in VARIANTS:
            raise MeshHealError(f"unknown MeshHeal variant {self.variant!r}; known: {', '.join(VARIANTS)}")
        choices = {"next_hop_ties": NEXT_HOP_TIES, "convergence": CONVERGENCE, "window_reset": WINDOW_RESET,
                   "detector": DETECTORS}  # fmt: skip
        for name, known in choices.items():
            if getattr(self, name) not in known:
                raise MeshHealError(f"unknown {name} {getattr(self, name)!r}; known: {', '.join(known)}")
        if not self.absolute_scale > 0:
            raise MeshHealError(f"absolute_scale must be > 0, got {self.absolute_scale}")
        if not (self.cusum_h > 0 and self.cusum_k >= 0):
            raise MeshHealError(f"need cusum_h > 0 and cusum_k >= 0, got h={self.cusum_h}, k={self.cusum_k}")
        if self.move_limit + 1 > 9:
            raise MeshHealError("move_limit above 8 needs more per-visit draws (draws.N_VISITS)")
        if not 0 < self.alpha <= self.beta:
            raise MeshHealError(f"need 0 < alpha <= beta, got alpha={self.alpha}, beta={self.beta}")
        for name in ("window_scores", "window_shortfalls", "min_observations", "min_matched", "probe_interval",
                     "consecutive_to_isolate", "route_limit", "move_limit"):  # fmt: skip
            if getattr(self, name) < 1:
                raise MeshHealError(f"protocol parameter {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_per_six < 0:
            raise MeshHealError(f"protocol parameter warmup_per_six must be >= 0, got {self.warmup_per_six}")
        for name in ("tau_to", "sigma_com", "absolute_threshold", "cusum_target"):  # score thresholds
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise MeshHealError(f"protocol parameter {name} must be in [0, 1], got {getattr(self, name)}")
        if not self.z_scale_floor > 0:
            raise MeshHealError(f"protocol parameter z_scale_floor must be > 0, got {self.z_scale_floor}")
        if not 0.0 <= self.threshold_tol < 0.01:
            raise MeshHealError(
                f"protocol parameter threshold_tol must be in [0, 0.01), got {self.threshold_tol}"
            )

    def warmup_tasks(self, n_agents: int) -> int:
        return self.warmup_per_six * n_agents // 6


def recorded_protocol(recorded: dict) -> dict:
    """A run folder's recorded protocol block with every field: one missing from an older record
    ran with the value it had then, the default, except min_matched, which before it existed (the
    twenty-sixth session) was min_observations itself."""
    filled = dict(recorded)
    filled.setdefault("min_matched", filled.get("min_observations", ProtocolParams.min_observations))
    return {**dataclasses.asdict(ProtocolParams()), **filled}
