"""One interface over DeMo and DiLoCo for the loop that drives them (shoal.peer.train.trainer): a
`Synchronizer` takes an optimizer step on the gradients the loop accumulated, exchanging with the
other participants when its algorithm does, and keeps what every participant must hold alike.

    sync = synchronizer(model, exchange, DEFAULTS["diloco-eager"])
    for step in range(steps):
        loss_fn(model, *batch(step)).backward()
        sync.step(samples=len(batch))       # DiLoCo: an inner step, and every H-th an outer one
    sync.finish()                            # the round still in flight, applied

`synchronizer(model, exchange, config)` builds the one for an algorithm config
(shoal.peer.algorithms.configs): DeMo itself, or DiLoCo around an inner AdamW. The loop reads no
algorithm's internals: the phases' seconds, the bytes sent, the contributions dropped and those that
did not count are the same few attributes for both.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from shoal.compression import Codec
from shoal.peer.algorithms.configs import AlgorithmConfig, DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Exchange, Plan

INNER_BETAS = (0.9, 0.95)
"""DiLoCo's inner AdamW (the DiLoCo paper's inner optimizer, at the betas of its language models)."""
INNER_WEIGHT_DECAY = 0.1


class Synchronizer(ABC):
    """An optimizer over an exchange, as the training loop sees it."""

    inner_steps: int
    """Optimizer steps per round; the last of them exchanges."""

    @abstractmethod
    def step(self, *, samples: int, plan: Plan | None = None) -> None:
        """One optimizer step on the accumulated gradients, which it then clears; `samples`: what the
        step trained on (it weighs this participant in the round); `plan`: the round it computes for,
        handed to the exchange with the round's payload."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (DeMo's; DiLoCo's inner optimizer's): a schedule's."""

    def set_schedule(self, lr_at: Callable[[int], float]) -> None:
        """The learning rate of each round (a schedule's), for an algorithm that replays rounds with it
        (DeMo: shoal.peer.swarm.replay); the others' shared step has no schedule."""
        return None

    @abstractmethod
    def finish(self) -> None:
        """Ends training: an overlapped algorithm applies the round still in flight."""

    @abstractmethod
    def close(self) -> None:
        """Stops its background thread, if it has one."""

    @abstractmethod
    def shared_state(self) -> list[torch.Tensor]:
        """What every participant holds alike (DeMo: the parameters; DiLoCo: the consensus parameters
        and their outer momentum)."""

    @abstractmethod
    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        """Takes the swarm's shared state (same order and shapes as `shared_state`)."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Its state for a checkpoint: tensors and plain values only."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @property
    @abstractmethod
    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent per phase of its exchanging steps: encode, exchange, decode, apply."""

    @property
    @abstractmethod
    def bytes_sent(self) -> int:
        """Payload bytes this participant sent."""

    @property
    @abstractmethod
    def rejected(self) -> dict[str, int]:
        """Contributions it dropped, by reason."""

    @property
    @abstractmethod
    def uncounted(self) -> int:
        """Rounds in which this participant's payload did not count (a bounded fan-in left it out)."""


class DeMoSynchronizer(Synchronizer):
    """DeMo (shoal.peer.algorithms.demo): every step exchanges."""

    inner_steps = 1

    def __init__(self, model: nn.Module, exchange: Exchange, config: DeMoConfig, weight_decay: float = 0.0):
        self.optimizer = DeMo(
            model.parameters(),
            lr=config.lr,
            weight_decay=weight_decay,
            exchange=exchange,
            compression_topk=config.topk,
            value_bits=config.value_bits,
            compression_chunk=config.chunk,
            overlap=config.overlapped,
            lookahead=config.overlapped,  # Psyche's: see shoal.peer.algorithms.demo
        )

    def step(self, *, samples: int, plan: Plan | None = None) -> None:
        self.optimizer.step(samples=samples, plan=plan)
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_schedule(self, lr_at: Callable[[int], float]) -> None:
        self.optimizer.lr_at = lr_at

    def finish(self) -> None:
        self.optimizer.finish()

    def close(self) -> None:
        self.optimizer.close()

    def shared_state(self) -> list[torch.Tensor]:
        return self.optimizer.shared_state()

    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        self.optimizer.load_shared_state(tensors)

    def state_dict(self) -> dict:
        self.optimizer.unshift()  # the shared parameters, not the lookahead's guess
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self.optimizer.stats.phase_seconds

    @property
    def bytes_sent(self) -> int:
        return self.optimizer.stats.bytes_sent

    @property
    def rejected(self) -> dict[str, int]:
        return dict(self.optimizer.stats.rejected)

    @property
    def uncounted(self) -> int:
        return self.optimizer.stats.uncounted


class DiLoCoSynchronizer(Synchronizer):
    """DiLoCo (shoal.peer.algorithms.diloco) around an inner AdamW: `inner_steps` inner steps, the last
    ending in the outer step. `codec`: how pseudo-gradients travel (None: exactly)."""

    def __init__(
        self,
        model: nn.Module,
        exchange: Exchange,
        config: DiLoCoConfig,
        codec: Codec | None = None,
        weight_decay: float = INNER_WEIGHT_DECAY,
        outer_device: torch.device | str | None = None,
    ):
        self.inner = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=INNER_BETAS, weight_decay=weight_decay
        )
        self.diloco = DiLoCo(
            model,
            self.inner,
            exchange=exchange,
            inner_steps=config.inner_steps,
            mode=config.mode,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            codec=codec,
            error_decay=config.error_decay,
            butterfly=config.averaging == "butterfly",
            outer_device=outer_device,
        )
        self.inner_steps = config.inner_steps

    def step(self, *, samples: int, plan: Plan | None = None) -> None:
        self.diloco.step(samples=samples, plan=plan)

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def finish(self) -> None:
        self.diloco.finish()

    def close(self) -> None:
        self.diloco.close()

    def shared_state(self) -> list[torch.Tensor]:
        return self.diloco.shared_state()

    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        self.diloco.load_shared_state(tensors)

    def state_dict(self) -> dict:
        shared = [t.detach().clone() for t in self.diloco.shared_state()]
        return {"optimizer": self.inner.state_dict(), "shared": shared}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["optimizer"])
        self.diloco.load_shared_state(state["shared"])

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self.diloco.stats.phase_seconds

    @property
    def bytes_sent(self) -> int:
        return self.diloco.stats.bytes_sent

    @property
    def rejected(self) -> dict[str, int]:
        return {"malformed": self.diloco.stats.rejected} if self.diloco.stats.rejected else {}

    @property
    def uncounted(self) -> int:
        return self.diloco.stats.uncounted


def synchronizer(
    model: nn.Module,
    exchange: Exchange,
    config: AlgorithmConfig,
    codec: Codec | None = None,
    weight_decay: float | None = None,
    outer_device: torch.device | str | None = None,
) -> Synchronizer:
    """The synchronizer of an algorithm config, over `model`'s parameters; `codec` is DiLoCo's;
    `weight_decay`: DeMo's, or DiLoCo's inner AdamW's (None: 0 for DeMo, INNER_WEIGHT_DECAY);
    `outer_device`: where DiLoCo keeps its outer state (None: with the parameters)."""
    if isinstance(config, DeMoConfig):
        return DeMoSynchronizer(model, exchange, config, weight_decay or 0.0)
    decay = INNER_WEIGHT_DECAY if weight_decay is None else weight_decay
    return DiLoCoSynchronizer(model, exchange, config, codec, decay, outer_device)
