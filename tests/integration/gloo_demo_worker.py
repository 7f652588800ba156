"""One rank of the 2-process gloo DeMo test (run by test_demo_gloo.py).

    python -m tests.integration.gloo_demo_worker RANK WORLD STORE OUT MODE


MODE `reference`: 4 float64 steps with reference settings; `determinism`: 50 float32 steps, compact settings.
Writes the final parameters to OUT with torch.save (read back with weights_only=True).
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.peer.demo import DeMo
from shoal.peer.exchange import TorchDistributedExchange
from tests.unit.test_demo import SHAPES, make_grads

SETTINGS = {
    "reference": {"steps": 4, "dtype": torch.float64, "demo": {"lr": 1e-3, "weight_decay": 0.1}},
    "determinism": {
        "steps": 50,
        "dtype": torch.float32,
        "demo": {"lr": 1e-3, "compression_topk": 4, "value_bits": 1, "error_feedback": 0.5},
    },
}


def main(rank: int, world: int, store_path: str, out: str, mode: str) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        settings = SETTINGS[mode]
        torch.manual_seed(10)
        initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
        grads = make_grads(steps=settings["steps"], workers=world)
        params = [torch.nn.Parameter(p.clone().to(settings["dtype"])) for p in initial]
        opt = DeMo(params, exchange=TorchDistributedExchange(), **settings["demo"])
        for step_grads in grads:
            for p, g in zip(params, step_grads[rank], strict=True):
                p.grad = g.to(settings["dtype"])
            opt.step()
        torch.save({"initial": initial, "params": [p.detach() for p in params], "sent": opt.bytes_sent}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
