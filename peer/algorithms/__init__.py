"""shoal.peer.algorithms: the training algorithms and what they talk through, with no network in them.

- `exchange`: the `Exchange` interface an optimizer gathers its round's contributions through, with
  `LoopbackExchange` (threads of one process) and `TorchDistributedExchange` (torch.distributed).
  The swarm's exchange (shoal.peer.swarm.exchange) implements the same interface over hivemind.
- `demo`: the DeMo optimizer; `diloco`: DiLoCo (standard, delayed and eager outer updates).
- `configs`: the algorithms as typed configs (`DeMoConfig`, `DiLoCoConfig`), what `--algorithm` parses
  into; no torch.
- `butterfly`: the pure core of butterfly averaging (pieces cut, averaged and reassembled).
- `robust`: how a round bounds each contribution (docs/ROBUSTNESS.md).
- `tile_groups`: parameters grouped into batches of equal DCT chunk plans.

Nothing here imports hivemind (tests/unit/test_layers.py checks it): imports run one way, from the
algorithms to the swarm to the peer job to the command line.
"""
