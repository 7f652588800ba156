"""How much exchange time DeMo's overlapped mode hides behind the next step's forward and backward.

    python -m tests.benchmarks.demo_overlap [--latency 0.3] [--steps 40]

Four loopback workers train the tiny GPT with DeMo (top-4, 1-bit values); every collective takes
`--latency` seconds longer (a slow link). Prints one JSON object per mode (synchronous, overlapped,
overlapped with the lookahead): wall time, seconds the exchanges took, seconds the training loop
waited for them (worker 0).
"""

import argparse

import torch

from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests.benchmarks import time_loopback_mode

MODES = {"sync": {}, "overlap": {"overlap": True}, "lookahead": {"overlap": True, "lookahead": True}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency", type=float, default=0.3, help="seconds added to every collective")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    initial = TinyGPT(config).state_dict()
    for mode, options in MODES.items():

        def work(rank: int, exchange: LoopbackExchange, options: dict = options) -> dict:
            model = TinyGPT(config)
            model.load_state_dict(initial)
            generator = torch.Generator().manual_seed(rank)
            optimizer = DeMo(
                model.parameters(), lr=2e-3, exchange=exchange, compression_topk=4, value_bits=1, **options
            )
            for _ in range(args.steps):
                tokens = torch.randint(0, 256, (16, config.seq_len + 1), generator=generator)
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                optimizer.step(samples=16)
                optimizer.zero_grad(set_to_none=True)
            optimizer.finish()
            optimizer.close()
            stats = optimizer.stats
            return {"exchange_s": stats.exchange_s, "waited_s": stats.phase_seconds["exchange"]}

        time_loopback_mode(mode, work, args.workers, args.latency)


if __name__ == "__main__":
    main()
