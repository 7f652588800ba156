"""shoal.peer: what a volunteer runs: the optimizers, the exchanges they talk through, the embedded
model and data, and the `shoal` command line (`shoal.peer.cli`)."""

from shoal.peer.demo import DeMo
from shoal.peer.diloco import DiLoCo
from shoal.peer.exchange import Exchange, LoopbackExchange, TorchDistributedExchange

__all__ = ["DeMo", "DiLoCo", "Exchange", "LoopbackExchange", "TorchDistributedExchange"]
