"""The swarm layer: everything of a peer that speaks hivemind (DHT, libp2p) or to the coordinator.

- `exchange`: `SwarmExchange`, the algorithms' `Exchange` over the DHT, and the uncoordinated round;
  `coordinated`: its rounds under a coordinator, and butterfly rounds.
- `pull` (pulling payloads and state pieces), `channels` (long-lived payload streams), `records` (the
  round clock, plans and announcements read from and written to the DHT), `names` (the run's DHT keys
  and handler names), `membership` (signed peer records, the run hash), `state` (shared-state
  snapshots and re-sync), `bootstrap` (starting the DHT), `lifeline` (its process dies with the peer),
  `identity` (the key file), `coordinator_link` (the coordinator's gRPC client).

Imports run one way: this package uses `shoal.peer.algorithms`, `shoal.compression` and
`shoal.protocol`, never the peer job (`shoal.peer.job.node`, `settings`, ...) above it. Importing the
package itself loads nothing: take what you need from its modules.
"""
