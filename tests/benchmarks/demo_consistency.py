"""Can DeMo tell "a little is enough" apart over rounds? Real `shoal join` peers on 127.0.0.1 (the
`hostile_swarm` setting: 12 rounds, the last `--attackers` of `--peers` attack from round 0), whose
honest peers score every sender, without acting on it, by two figures kept over rounds:

- its mean agreement: the median of its cosines with the others, over the rounds it sent (what
  screening rule 4 averages);
- a direction-consistency score: the length of the mean of its last 8 unit deviations from the
  round's coordinate-wise median, each of its sparse DCT coefficients count-sketched to 1,024
  numbers by position (a position is the same in every round, so a push kept across rounds keeps
  its sketch). Deviations that point anywhere average out (about 1 / sqrt(8) = 0.35); DiLoCo's
  "a little is enough" kept 0.90-0.97 there (tests/benchmarks/robust_alternatives.py).

    python -m tests.benchmarks.demo_consistency [--peers 6] [--attackers 2] [--rounds 12]

Prints, for a clean run and an attacked one, the honest peers' and the attackers' figures at the
run's end (lowest, median, highest over senders, as the first honest peer saw them), and the
attacked run's loss against the clean one's.
"""

import argparse
import json
import os
import sys
import tempfile
from collections import deque
from pathlib import Path

import torch

from shoal.peer.algorithms.robust import lower_median
from tests.integration import test_hostile

BUCKETS, WINDOW = 1024, 8
SCORES = "SHOAL_CONSISTENCY_SCORES"  # where an honest peer appends its rounds' figures (JSON lines)


def sketch(decoded, slices, device) -> torch.Tensor:
    """Each contribution's coefficients count-sketched by position: (contributions, BUCKETS)."""
    out = torch.zeros(len(decoded), BUCKETS, device=device)
    base = 0
    for index, piece in enumerate(slices):
        plan = piece.plan
        starts = base + torch.arange(plan.num_chunks, device=device).unsqueeze(1) * plan.chunk_numel
        for row, coeffs in enumerate(decoded):
            hashed = ((starts + coeffs[index].indices) % 2147483647) * 1103515245 + 12345  # < 2^62
            buckets, signs = (hashed >> 20) % BUCKETS, ((hashed >> 12) & 1) * 2 - 1
            out[row].index_add_(0, buckets.reshape(-1), (coeffs[index].values.float() * signs).reshape(-1))
        base += plan.numel
    return out


def observe() -> None:
    """Hooks DeMo's screening (shoal.peer.algorithms.hooks) so that this peer logs every sender's
    figures each round."""
    from shoal.peer.algorithms.demo import DeMo
    from shoal.peer.algorithms.hooks import Hooks

    recent: dict[bytes, deque] = {}
    agreed: dict[bytes, list[float]] = {}

    class Scoring(Hooks):
        def screened(self, optimizer, decoded, slices, senders, verdict):
            own = getattr(optimizer.exchange, "owner", b"")
            if len(decoded) >= 3:
                log(own, decoded, slices, senders, verdict)

    def log(own: bytes, decoded, slices, senders, verdict) -> None:
        rows = sketch(decoded, slices, decoded[0][0].values.device)
        deviations = rows - rows.median(dim=0).values
        units = deviations / deviations.norm(dim=1, keepdim=True).clamp(min=1e-30)
        for sender, unit, cosine in zip(senders, units, verdict.cosines, strict=True):
            recent.setdefault(sender, deque(maxlen=WINDOW)).append(unit)
            if cosine is not None:
                agreed.setdefault(sender, []).append(cosine)
        figures = {
            sender.hex(): {
                "score": float(torch.stack(list(recent[sender])).mean(dim=0).norm()),
                "agreement": sum(agreed.get(sender, [0.0])) / max(len(agreed.get(sender, [])), 1),
            }
            for sender in senders
        }
        with open(os.environ[SCORES], "a") as out:
            out.write(json.dumps({"pid": os.getpid(), "own": own.hex(), "senders": figures}) + "\n")

    DeMo.hooks = Scoring()  # every DeMo this process builds


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f} / {lower_median(values):.2f} / {max(values):.2f}"


def figures(path: Path) -> dict[str, dict]:
    """The first honest peer's last round of figures, split into honest senders and attackers."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    honest = {row["own"] for row in rows}
    first = rows[0]["pid"]
    last = [row for row in rows if row["pid"] == first][-1]["senders"]
    sides = {
        "honest": [v for k, v in last.items() if k in honest],
        "attackers": [v for k, v in last.items() if k not in honest],
    }
    return {
        side: {name: spread([v[name] for v in values]) for name in ("score", "agreement")}
        for side, values in sides.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--attackers", type=int, default=2)
    args = parser.parse_args()
    test_hostile.HONEST = [sys.executable, "-m", "tests.benchmarks.demo_consistency"]
    losses = {}
    with tempfile.TemporaryDirectory() as temp:
        for name, attack, attackers in (("clean", None, 0), ("attacked", "alie", args.attackers)):
            path = Path(temp) / f"{name}.jsonl"
            os.environ[SCORES] = str(path)
            summaries = test_hostile.swarm(
                Path(temp),
                name,
                test_hostile.DEMO,
                attack,
                args.rounds,
                peers=args.peers,
                attackers=attackers,
            )
            losses[name] = test_hostile.final_loss(summaries[: args.peers - attackers])
            for side, row in figures(path).items():
                if row["score"] != "-":
                    print(f"{name:>8} {side:>9}: score {row['score']}, mean agreement {row['agreement']}")
    change = losses["attacked"] / losses["clean"] - 1
    print(f"loss: clean {losses['clean']:.4f}, alie {losses['attacked']:.4f} ({change:+.1%})")
    print("(each figure: lowest / median / highest over senders, as the first honest peer saw them)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["join"]:  # a peer of the run
        from shoal.peer import cli

        if not os.environ.get("SHOAL_FAULTS"):  # the honest peers score; attackers share the command
            observe()
        sys.exit(cli.main(sys.argv[1:]))
    sys.exit(main())
