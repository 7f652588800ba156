"""shoal.coordinator: the optional gRPC service that runs clock-synchronous rounds (docs/ARCHITECTURE.md).

It imports no torch and nothing of `shoal.peer` or `shoal.compression`, so that it runs on a small
CPU box. Its service arrives with the coordinator issue; until then the package is empty.
"""
