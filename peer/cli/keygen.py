"""`shoal keygen PATH`: a persistent peer identity (peer/swarm/identity.py)."""

import argparse
import sys

HELP = "create a persistent peer identity"
DESCRIPTION = (
    "Write a new peer identity (an RSA key in hivemind's libp2p format: it fixes "
    "the peer id and signs this peer's records) to PATH."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH")


def run(args: argparse.Namespace) -> int:
    from shoal.peer.swarm.identity import IdentityError, keygen, peer_id_of

    try:
        keygen(args.path)
    except IdentityError as error:
        print(f"shoal keygen: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote a new identity to {args.path}: peer id {peer_id_of(args.path)}")
    return 0
