"""How much exchange time DiLoCo's delayed and eager modes hide behind the next inner phase.

    python -m tests.benchmarks.diloco_overlap [--latency 0.5] [--steps 200] [--inner-steps 20]

Four loopback workers train the tiny GPT; every collective takes `--latency` seconds longer (a
slow link). Prints one JSON object per mode: wall time, exchange seconds, seconds the loop waited,
seconds hidden behind compute (worker 0).
"""

import argparse

import torch

from shoal.peer.algorithms.configs import MODES
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests.benchmarks import time_loopback_mode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency", type=float, default=0.5, help="seconds added to every collective")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    initial = TinyGPT(config).state_dict()
    for mode in MODES:

        def work(rank: int, exchange: LoopbackExchange, mode: str = mode) -> dict:
            model = TinyGPT(config)
            model.load_state_dict(initial)
            generator = torch.Generator().manual_seed(rank)
            inner = torch.optim.AdamW(model.parameters(), lr=4e-3, betas=(0.9, 0.95), weight_decay=0.1)
            with DiLoCo(model, inner, exchange=exchange, inner_steps=args.inner_steps, mode=mode) as diloco:
                for _ in range(args.steps):
                    tokens = torch.randint(0, 256, (16, config.seq_len + 1), generator=generator)
                    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                    diloco.step(samples=16)
                diloco.finish()
            stats = diloco.stats
            return {"exchange_s": stats.exchange_s, "waited_s": stats.waited_s, "hidden_s": stats.hidden_s}

        time_loopback_mode(mode, work, args.workers, args.latency)


if __name__ == "__main__":
    main()
