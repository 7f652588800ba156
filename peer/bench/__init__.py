"""shoal.peer.bench: the `shoal bench` subcommands, one module each, named after it (the codecs'
own benchmark, `shoal bench codec`, is shoal.compression.benchmark).

- `converge`: `shoal bench converge`, methods against each other on the embedded GPT (loopback).
- `hostile`: `shoal bench hostile`, attackers that send well-formed payloads (loopback).
- `swarm_local`: `shoal bench swarm-local`, real peer processes on 127.0.0.1, the wire against the codec.
- `wan`: `shoal bench wan`, peers in network namespaces over shaped links (`netlab` builds the
  topology, `wan_worker` is one peer there).

They use the peer and its algorithms; nothing below imports them.
"""
