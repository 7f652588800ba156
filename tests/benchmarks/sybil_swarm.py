"""Issue 77's Sybil majority with real `shoal join` processes on 127.0.0.1: 3 honest peers against K free
identities (`sybil` of tests/integration/faults.py) that hold one poisoned state, never update it,
claim to be in sync on it every round and serve it, from round 0 or joining at a later round; DeMo and
DiLoCo as tests/integration/test_hostile.py runs them (one micro-batch a step, seed 3), against one
clean run of the 3 honest peers alone.

    python -m tests.benchmarks.sybil_swarm [--sybils 1,3,6,12] [--late 0,4] [--rounds 12] [--joiner 5]
        [--json]

Prints one row per algorithm, K and join round: the honest peers' held-out loss and its change from
the clean run, the states they downloaded (any is the poison: none may be), the Sybils they struck
for false claims (`false_state`) and banned, the rounds they kept their own state against an
unbacked headcount (`unbacked_state`), and whether they ended on one model. With `--joiner R`, one
more honest peer joins during the attack, once the first peer has ended round R, with the run key of
the first peer's join command (`--trust-key`, shoal.peer.swarm.anchor): whether it ended on the honest
model, and the rounds from its first to its first counted with another peer (its sync).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.integration.harness import events
from tests.integration.test_hostile import DEMO, DILOCO, final_loss, swarm

HONEST = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sybils", default="1,3,6,12", help="comma-separated Sybil counts")
    parser.add_argument("--late", default="0,4", help="comma-separated rounds the Sybils join at")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--algorithms", default="demo,diloco", help="comma-separated, of demo,diloco")
    parser.add_argument("--joiner", type=int, default=5, help="an honest joiner's round (0: none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(k) for k in args.sybils.split(",")]
    lates = [int(r) for r in args.late.split(",")]
    if min(counts) < 1 or min(lates) < 0 or max(lates) >= args.rounds:
        parser.error("--sybils must be >= 1, --late in [0, --rounds)")
    rows = []
    with tempfile.TemporaryDirectory() as temp:
        chosen = args.algorithms.split(",")
        for name, algorithm in (("demo", DEMO), ("diloco", DILOCO)):
            if name not in chosen:
                continue
            folder = Path(temp) / name
            folder.mkdir()
            clean = final_loss(
                swarm(folder, "clean", algorithm, None, args.rounds, peers=HONEST, attackers=0)
            )
            for late in lates:
                for count in counts:
                    run = f"sybil-{count}-{late}"
                    summaries = swarm(
                        folder, run, algorithm, "sybil", args.rounds, peers=HONEST + count, attackers=count,
                        late=late, joiner=args.joiner,
                    )  # fmt: skip
                    honest = summaries[:HONEST]
                    loss = final_loss(honest)
                    joined = {}
                    if args.joiner:
                        log = events(folder / f"{run}-{HONEST + count}.jsonl")
                        rounds = [e for e in log if e.get("event") == "round"]
                        synced = next((e["round"] for e in rounds if e["participants"] > 1), None)
                        joined = {
                            "joiner_honest": summaries[-1]["param_hash"] == honest[0]["param_hash"],
                            "joiner_first": rounds[0]["round"] if rounds else None,
                            "joiner_synced": synced,
                        }
                    rows.append({
                        "algorithm": name, "sybils": count, "late": late, "clean": clean, "attacked": loss,
                        "change": loss / clean - 1,
                        "downloads": sum(s["resyncs"] for s in honest),
                        "false_state": sum(s["rejected"].get("false_state", 0) for s in honest),
                        "unbacked_state": sum(s["rejected"].get("unbacked_state", 0) for s in honest),
                        "banned": min(s["banned"] for s in honest),
                        "one_model": len({s["param_hash"] for s in honest}) == 1,
                    } | joined)  # fmt: skip
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "honest": HONEST, "results": rows}, indent=1))
    else:
        print("| algorithm | Sybils | join round | honest loss (clean) | change | states downloaded "
              "| false_state strikes | banned (fewest) | unbacked_state | one model "
              "| joiner: honest model, first round -> synced |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            joiner = (f"{'yes' if r['joiner_honest'] else 'NO'}, {r['joiner_first']} -> {r['joiner_synced']}"
                      if "joiner_honest" in r else "-")  # fmt: skip
            print(f"| {r['algorithm']} | {r['sybils']} | {r['late']} "
                  f"| {r['attacked']:.4f} ({r['clean']:.4f}) "
                  f"| {r['change']:+.1%} | {r['downloads']} | {r['false_state']} | {r['banned']} "
                  f"| {r['unbacked_state']} | {r['one_model']} | {joiner} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
