"""Issue 47's "a little is enough" setting, with real `shoal join` processes: 4 peers on 127.0.0.1, one
of them sending its own update plus its own norm along one fixed direction every round
(tests/integration/faults.py `alie`), against a clean run of the same seed by 4 honest peers; DeMo and
DiLoCo, as tests/integration/test_hostile.py runs them (one micro-batch a step, seed 3).

    python -m tests.benchmarks.alie_swarm [--rounds 12] [--json]

Prints, per algorithm, the honest peers' held-out loss attacked and clean, the change, and what the
honest peers rejected. The issue measured DeMo +4.9% and DiLoCo +2.0% over 12 rounds, undetected.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.integration.test_hostile import DEMO, DILOCO, final_loss, swarm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as temp:
        for name, algorithm in (("demo", DEMO), ("diloco", DILOCO)):
            folder = Path(temp) / name
            folder.mkdir()
            clean = swarm(folder, "clean", algorithm, None, args.rounds, peers=4, attackers=0)
            attacked = swarm(folder, "alie", algorithm, "alie", args.rounds, peers=4)
            honest = attacked[:3]
            rejected: dict[str, int] = {}
            for summary in honest:
                for reason, count in summary["rejected"].items():
                    rejected[reason] = rejected.get(reason, 0) + count
            one_model = len({s["param_hash"] for s in honest}) == 1
            rows.append({
                "algorithm": name, "clean": final_loss(clean), "attacked": final_loss(honest),
                "change": final_loss(honest) / final_loss(clean) - 1, "rejected": rejected,
                "banned": sum(s["banned"] for s in honest), "one_model": one_model,
            })  # fmt: skip
    if args.json:
        print(json.dumps({"rounds": args.rounds, "results": rows}, indent=1))
    else:
        for row in rows:
            print(f"{row['algorithm']:>6}: clean {row['clean']:.4f}, alie {row['attacked']:.4f} "
                  f"({row['change']:+.1%}), rejected {row['rejected']}, banned {row['banned']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
