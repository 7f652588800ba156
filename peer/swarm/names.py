"""The names a run lives under, in the DHT and on libp2p: the rule for a run name, the DHT keys of its
records and announcements, and the protocol names of its stream handlers.

Pure: no hivemind here, so that settings can check `--run` before anything heavy is imported.
"""

import re

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
"""1-64 letters, digits or '-', starting with a letter or digit: safe inside every key below."""


def check_run_name(run: str) -> str:
    """`run`, or ValueError saying what a run name may hold."""
    if not RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r} must be 1-64 letters, digits or '-', starting with a letter or digit"
        )
    return run


def peers_key(run: str) -> str:
    """The DHT key under which every peer of `run` heartbeats its signed record (one subkey each)."""
    return f"{run}_peers"


def round_key(run: str, round_number: int) -> str:
    """The DHT key of round `round_number`'s announcements (one subkey per announcing peer)."""
    return f"{run}.round.{round_number}"


def final_key(run: str, last_round: int) -> str:
    """The DHT key under which the peers ending `run` after `last_round` announce the state they ended
    on (SwarmExchange.agree_final)."""
    return f"{run}.final.{last_round}"


RUN_HANDLER = "shoal.run"
"""The libp2p protocol name under which every training peer tells which run it trains (RunRequest)."""


def handler(run: str, kind: str) -> str:
    """The libp2p protocol name of `run`'s handler for `kind` (payload, payloads, state or probe)."""
    return f"shoal.{run}.{kind}"


TRUST_KEY = re.compile(r"[0-9a-f]{64}")
"""A run key as `--trust-key` takes it, and a join command prints it: 32 bytes in lowercase hex."""


def parse_trust_key(text: str) -> bytes:
    """The 32-byte Ed25519 public key of a `--trust-key` (shoal.peer.swarm.anchor), or ValueError saying
    what one looks like."""
    if not isinstance(text, str) or not TRUST_KEY.fullmatch(text.lower()):
        raise ValueError("expected the run key its starter's join command prints: 64 hex digits")
    return bytes.fromhex(text)


def anchor_key(run: str) -> str:
    """The DHT key under which the run key signs the shared state of the round in progress
    (shoal.peer.swarm.anchor): one entry, under the run key's subkey, that only it can write."""
    return f"{run}.anchor"
