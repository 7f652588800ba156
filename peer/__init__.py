"""shoal.peer: what a volunteer runs. Today: the `shoal` command line (`shoal.peer.cli`)."""
