"""Protocol parameters (spec/protocol.md) as one frozen dataclass.

Every DECISION of the spec is a named field here, documented in docs/decisions.md.
"""

from __future__ import annotations

import dataclasses

from meshheal_jax.errors import MeshHealError


@dataclasses.dataclass(frozen=True)
class ProtocolParams:
    alpha: float = 1.2  # z threshold normal -> watched
    beta: float = 2.0  # z threshold for the consecutive counter (isolation after 2)
    consecutive_to_isolate: int = 2
    tau_to: float = 0.40  # low-score threshold (committee and Takeover)
    sigma_com: float = 0.55  # review disagreement threshold
    window_scores: int = 8  # W_mu (DECISION)
    window_shortfalls: int = 8  # W_x (DECISION)
    min_observations: int = 3  # shortfalls before z is formed; also "enough matched evidence"
    z_scale_floor: float = 0.10  # z = (xbar - m) / max(m - p25, floor)
    probe_interval: int = 10
    warmup_per_six: int = 30  # warm-up tasks per six agents (DECISION)
    route_limit: int = 4  # moves since the last output (paper's routing limit)
    move_limit: int = 8  # total moves (DECISION)
    threshold_tol: float = 1e-9  # comparisons favour crossing by this much

    def __post_init__(self):
        if self.move_limit + 1 > 9:
            raise MeshHealError("move_limit above 8 needs more per-visit draws (draws.N_VISITS)")
        if not 0 < self.alpha <= self.beta:
            raise MeshHealError(f"need 0 < alpha <= beta, got alpha={self.alpha}, beta={self.beta}")
        for name in ("window_scores", "window_shortfalls", "min_observations", "probe_interval"):
            if getattr(self, name) < 1:
                raise MeshHealError(f"protocol parameter {name} must be >= 1")

    def warmup_tasks(self, n_agents: int) -> int:
        return self.warmup_per_six * n_agents // 6
