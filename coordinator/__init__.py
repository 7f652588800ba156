"""shoal.coordinator: the optional gRPC service that runs clock-synchronous rounds (docs/ARCHITECTURE.md).

`rounds` is the pure state machine (with `state`, `events`, `actions`, `policy` and `validation`),
`server` its gRPC service, `store` its SQLite state, `auth` its tokens, `metrics` its Prometheus
metrics and `cli` the `shoal coordinator` command. It imports no torch and nothing of `shoal.peer` or
`shoal.compression`, so that it runs on a small CPU box.
"""
