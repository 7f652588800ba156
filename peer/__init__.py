"""shoal.peer: what a volunteer runs: the optimizers, the exchanges they talk through, the embedded
model and data, and the `shoal` command line (`shoal.peer.cli`).

The optimizers and exchanges import torch; they load on first use, so that the command line (and
`shoal coordinator`, which must run without torch) starts without it.
"""

import importlib

_EXPORTS = {
    "DeMo": "shoal.peer.algorithms.demo",
    "DiLoCo": "shoal.peer.algorithms.diloco",
    "Exchange": "shoal.peer.algorithms.exchange",
    "LoopbackExchange": "shoal.peer.algorithms.exchange",
    "TorchDistributedExchange": "shoal.peer.algorithms.exchange",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shoal.peer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
