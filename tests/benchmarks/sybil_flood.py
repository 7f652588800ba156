"""Issue 77's flood of identities, on the decision alone: a round's state decision (`state.decide` with the
votes earned by counted work, shoal.protocol.work) over 3 earned peers and N fresh announcers of
another state, each of which must come out stale. Not the DHT: reading N announcements is measured
by `shoal bench coordinator` and docs/SCALE.md, not here.

    python -m tests.benchmarks.sybil_flood [--announcers 1000,10000] [--repeat 20] [--json]
"""

import argparse
import hashlib
import json
import sys
import time

from shoal.peer.swarm.records import Announcement
from shoal.peer.swarm.state import decide
from shoal.protocol.work import WORK_WINDOW, Work

HONEST = [b"honest-%d" % i for i in range(3)]
GOOD, POISON = b"\x80" * 32, b"\x90" * 32


def announcement(owner: bytes, state: bytes) -> Announcement:
    return Announcement(owner, "peer", hashlib.sha256(owner).digest(), 10, 1, state, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--announcers", default="1000,10000", help="comma-separated flood sizes")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Work()
    for number in range(WORK_WINDOW):
        work.record(number, HONEST)
    rows = []
    for count in (int(n) for n in args.announcers.split(",")):
        ballots = {o: announcement(o, GOOD) for o in HONEST}
        ballots |= {b"sybil-%07d" % i: announcement(b"sybil-%07d" % i, POISON) for i in range(count)}
        started = time.perf_counter()
        for _ in range(args.repeat):
            decision = decide(ballots, ballots[HONEST[0]], compare_states=True, weights=work.weights(ballots))
        seconds = (time.perf_counter() - started) / args.repeat
        assert decision.agreed == GOOD and len(decision.stale) == count and decision.counted == HONEST
        rows.append({"announcers": count, "decide_ms": round(seconds * 1e3, 3)})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(f"{row['announcers']:>7} fresh announcers: {row['decide_ms']:.2f} ms a round, all stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
