"""Whether a peer can reach its swarm at all, judged round by round from what it pulled and served.

A peer that pulled none of the other participants' payloads for `ISOLATED_AFTER` rounds in a row, and
served none of its own (nobody pulled from it, directly or through a relay), can reach none of them:
behind a NAT without a relay that works, say (`shoal bootstrap --no-relay`, a stock hivemind-dht, a
relay that went away while the DHT still works). It is told so, and sits the rounds out: it does not
announce its payload (uncoordinated) or report it (coordinated), which nobody could pull and every
other peer would wait for until the round's deadline. It keeps computing and pulling, and it offers
its payload again in every `ISOLATED_AFTER`-th round (the same rounds on every peer, so that peers that
all sat out meet again there); the first payload it pulls or serves ends it.

A peer that can pull but is not pulled from (a public peer whose others are behind NAT without a relay,
say) is not isolated: the others reach it, and it their payloads' authors' relays.
"""

from dataclasses import dataclass

ISOLATED_AFTER = 3


@dataclass(slots=True)
class Isolation:
    """See the module docstring. `observe` after every round; `sits_out` before announcing."""

    after: int = ISOLATED_AFTER
    isolated: bool = False
    streak: int = 0
    """Rounds in a row that reached nobody."""
    rounds: int = 0
    """Rounds it was isolated in, in all."""
    _served: int = 0

    def observe(self, others: int, pulled: int, served_total: int) -> str | None:
        """After a round with `others` other participants seen, of which it `pulled` payloads, and
        `served_total` payload bytes served so far: "isolated" when it just became so, "back" when it
        just reached the swarm again, else None."""
        served, self._served = served_total - self._served, served_total
        self.rounds += self.isolated
        if pulled or served:
            self.streak = 0
            if self.isolated:
                self.isolated = False
                return "back"
            return None
        if not others:  # nobody to reach (alone, or every peer sat the round out): no evidence
            return None
        self.streak += 1
        if not self.isolated and self.streak >= self.after:
            self.isolated = True
            return "isolated"
        return None

    def sits_out(self, round_number: int) -> bool:
        """Whether to keep this round's payload to itself (isolated, and not a round every peer offers in)."""
        return self.isolated and round_number % self.after != 0
