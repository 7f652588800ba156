"""One rank of the 2-process gloo DeMo test (run by test_demo_gloo.py).

    python -m tests.integration.gloo_demo_worker RANK WORLD STORE OUT MODE

MODE `reference`: 4 float64 DeMo steps with reference settings; `determinism`: 50 float32 DeMo steps,
compact settings; `diloco_standard` / `diloco_delayed` / `diloco_eager`: DiLoCo on the tiny GPT.
Hands back the final parameters (tests/gloo_ranks.py).
"""

import torch

from shoal.compression import DenseCodec
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import TorchDistributedExchange
from shoal.peer.algorithms.robust import NONE
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests.gloo_ranks import serve_rank
from tests.unit.test_demo import SHAPES, make_grads

SETTINGS = {
    "reference": {
        "steps": 4,
        "dtype": torch.float64,
        "demo": {"lr": 1e-3, "weight_decay": 0.1, "robust": NONE},  # the reference: no screening
    },
    "determinism": {
        "steps": 50,
        "dtype": torch.float32,
        "demo": {"lr": 1e-3, "compression_topk": 4, "value_bits": 1, "error_feedback": 0.5},
    },
}


def train_diloco(rank: int, mode: str) -> dict:
    """DiLoCo over gloo: 12 inner steps, H = 4; delayed and eager collectives run on its background thread."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    with DiLoCo(
        model, inner, exchange=TorchDistributedExchange(), inner_steps=4, mode=mode, codec=DenseCodec(8)
    ) as diloco:
        for _ in range(12):
            tokens = torch.randint(0, 256, (4, 17), generator=generator)
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            diloco.step(samples=4)
        diloco.finish()
    return {
        "params": [p.detach() for p in model.parameters()],
        "sent": diloco.stats.bytes_sent,
        "outer_steps": diloco.stats.outer_steps,
    }


def train(rank: int, world: int, mode: str) -> dict:
    if mode.startswith("diloco_"):
        return train_diloco(rank, mode.removeprefix("diloco_"))
    return train_demo(rank, world, SETTINGS[mode])


def train_demo(rank: int, world: int, settings: dict) -> dict:
    """DeMo over gloo on the unit tests' shapes and gradients: every rank steps on its own gradients."""
    torch.manual_seed(10)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=settings["steps"], workers=world)
    params = [torch.nn.Parameter(p.clone().to(settings["dtype"])) for p in initial]
    opt = DeMo(params, exchange=TorchDistributedExchange(), **settings["demo"])
    for step_grads in grads:
        for p, g in zip(params, step_grads[rank], strict=True):
            p.grad = g.to(settings["dtype"])
        opt.step()
    return {"initial": initial, "params": [p.detach() for p in params], "sent": opt.stats.bytes_sent}


if __name__ == "__main__":
    serve_rank(train)
