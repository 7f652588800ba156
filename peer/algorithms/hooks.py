"""What a benchmark sees of an optimizer's round, or an experiment changes in it, without reaching into
its private methods: a `Hooks` object on the optimizer (`optimizer.hooks`; the class's by default,
`DeMo.hooks = ...` reaching every optimizer a process builds, a swarm peer's included).

The defaults observe nothing and aggregate by the optimizer's own rule. The benchmarks in
tests/benchmarks use them: demo_consistency.py (the figures of DeMo's screening, sender by sender),
outer_agreement.py (DiLoCo's outer directions) and gauntlet.py (another aggregation rule for DiLoCo).
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from shoal.peer.algorithms.robust import Reference, Robustness, Screened, add_screened_mean

if TYPE_CHECKING:
    from shoal.peer.algorithms.robust import Suspicion

Aggregate = Callable[
    [
        Sequence[torch.Tensor],
        Sequence[tuple[Sequence[torch.Tensor], int]],
        Robustness,
        "Suspicion | None",
        Sequence[bytes],
        Reference | None,
    ],
    tuple[float, Screened],
]
"""DiLoCo's aggregation of a round, with robust.add_screened_mean's arguments and result."""


class Hooks:
    """Every method's default does nothing, or what the optimizer does without hooks."""

    def screened(
        self, optimizer: object, decoded: list, slices: list, senders: Sequence[bytes], verdict: object
    ) -> None:
        """DeMo screened a round: `decoded`, the contributions' coefficients in rank order (per slice),
        `senders` their keys, `verdict` the screening's (shoal.peer.algorithms.demo_receive.screen)."""

    def outer_direction(
        self, optimizer: object, direction: Sequence[torch.Tensor], global_step: bool
    ) -> None:
        """DiLoCo is about to step along `direction`: its global parameters' outer step (`global_step`),
        or the eager consensus's. Called before the step's finiteness check."""

    def aggregate(self, optimizer: object) -> Aggregate:
        """The rule DiLoCo aggregates its next round's contributions by (robust.add_screened_mean)."""
        return add_screened_mean


NO_HOOKS = Hooks()
