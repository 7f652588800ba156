"""Learning-rate schedules that follow the swarm's round, not a peer's own step count: a peer that joins
at round 900, or comes back from a checkpoint, trains at the learning rate every other peer has at
round 900 (`Schedule.lr(base, position)`, position = the swarm's round, plus the inner step's share of
it for DiLoCo's inner steps).

    Schedule(kind="cosine", warmup=100, decay=900, min_lr=1e-4).lr(3e-4, 450.0)

- constant: the base rate (after the warmup);
- cosine, linear: from the base rate down to `min_lr` over `decay` rounds after the warmup, then
  `min_lr` (cosine: half a cosine; linear: a straight line);
- wsd (warmup, stable, decay): the base rate until the last `decay` rounds of a run of `total`, then
  a straight line down to `min_lr` (Hu et al., MiniCPM, 2024).

The warmup, in every kind, rises linearly from base / warmup to the base rate over `warmup` rounds.
No torch here: the settings check a schedule before torch loads.
"""

import math
from dataclasses import dataclass

KINDS = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    kind: str = "constant"
    warmup: int = 0
    """Rounds of linear warmup."""
    decay: int = 0
    """cosine, linear: rounds of decay after the warmup; wsd: rounds of the final decay."""
    total: int = 0
    """wsd: the run's rounds (the decay starts `decay` rounds before their end)."""
    min_lr: float = 0.0
    """Where the decay ends."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"lr_schedule: one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.warmup < 0 or self.decay < 0 or self.total < 0:
            raise ValueError("warmup_rounds: rounds of warmup and decay are >= 0")
        if not 0 <= self.min_lr < math.inf:
            raise ValueError(f"min_lr: a finite number >= 0, not {self.min_lr!r}")
        if self.kind in ("cosine", "linear", "wsd") and self.decay < 1:
            raise ValueError(f"decay_rounds: a {self.kind} schedule needs --decay-rounds or --until-round")
        if self.kind != "constant" and self.warmup > self.decay:
            raise ValueError(
                f"warmup_rounds: the warmup ({self.warmup} rounds) exceeds the decay ({self.decay} rounds)"
            )
        if self.kind == "wsd" and self.warmup + self.decay > self.total:
            raise ValueError(
                f"decay_rounds: warmup ({self.warmup}) and decay ({self.decay}) exceed the run's "
                f"{self.total} rounds (--until-round)"
            )

    def lr(self, base: float, position: float) -> float:
        """The learning rate at `position` (the swarm's round, fractional within it) for base rate
        `base`."""
        position = max(position, 0.0)
        if self.warmup and position < self.warmup:
            return base * min(1.0, (position + 1) / self.warmup)
        if self.kind == "constant":
            return base
        start = self.total - self.decay if self.kind == "wsd" else self.warmup
        done = min(max((position - start) / self.decay, 0.0), 1.0)
        if self.kind == "cosine":
            return self.min_lr + (base - self.min_lr) * 0.5 * (1 + math.cos(math.pi * done))
        return base + (self.min_lr - base) * done

    def run_config(self) -> dict[str, str]:
        """What a run pins of it (nothing for the constant rate without warmup, as before schedules)."""
        if self.kind == "constant" and not self.warmup:
            return {}
        config = {"lr_schedule": self.kind, "warmup_rounds": str(self.warmup)}
        if self.kind != "constant":
            config |= {"decay_rounds": str(self.decay), "min_lr": repr(self.min_lr)}
        if self.kind == "wsd":
            config["total_rounds"] = str(self.total)
        return config
