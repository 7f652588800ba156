"""What the token ledger (shoal.peer.data.ledger) costs a peer each round on a large corpus: its size in
the shared state, drawing a lane, settling a round and taking the state's view, one micro-batch's
window indices, and the progress the metrics show. Prints a table and a JSON line.

    python -m tests.benchmarks.ledger_cost
"""

import json
import time

from shoal.peer.data.ledger import TokenLedger

SLOTS, STRIDE, MICRO = 16, 8, 4096


def _ms(function, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def measure(tokens: int, seq_len: int) -> dict:
    windows = tokens // (seq_len + 1)
    ledger = TokenLedger(windows, STRIDE, seed=1, lag=1, most_places=STRIDE * MICRO, seq_len=seq_len)
    number = 0

    def a_round() -> None:  # 16 peers draw their lanes, train 16 micro-batches each, and it settles
        nonlocal number
        lanes = [ledger.lane(number, slot, SLOTS) for slot in range(SLOTS)]
        for lane in lanes:
            lane.windows = 16 * STRIDE
        ledger.record(number, {bytes([slot]): lane.claim() for slot, lane in enumerate(lanes)})
        ledger.view(number + 1)
        number += 1

    lane = ledger.lane(0, 3, SLOTS)
    return {
        "tokens": tokens,
        "seq_len": seq_len,
        "chunks": ledger.chunks,
        "state_bytes": 2 * ((ledger.size_bytes + 1) // 2) * 2,  # 16-bit words, each a float32
        "lane_ms": _ms(lambda: ledger.lane(number, 3, SLOTS)),
        "round_ms": _ms(a_round),
        "batch_ms": _ms(lambda: ledger.window_ids(lane, 0, STRIDE)),
        "progress_ms": _ms(ledger.progress),
    }


def main() -> None:
    rows = [measure(10_000_000_000, 1024), measure(10_000_000_000, 128)]
    header = (
        "corpus",
        "chunks",
        "in the shared state",
        "draw a lane",
        "a round of 16 peers",
        "ids",
        "progress",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens'] / 1e9:.0f}B tokens, windows of {r['seq_len'] + 1} | {r['chunks']:,} | "
            f"{r['state_bytes'] / 1e6:.2f} MB | {r['lane_ms']:.1f} ms | {r['round_ms']:.1f} ms | "
            f"{r['batch_ms']:.2f} ms | {r['progress_ms']:.1f} ms |"
        )
    print(json.dumps({"results": rows}))


if __name__ == "__main__":
    main()
