"""DeMo over torch.distributed with every default is the paper's DeMo, bit for bit (issue 79).

Two real gloo processes (tests/gloo_ranks.py), as a torchrun user runs them: the same small MLP and
seeds, different data per rank. Each rank trains one copy of the model with `shoal.peer.DeMo(...,
exchange=TorchDistributedExchange())`, nothing else given, and another with the reference's algorithm
(tests/demo_reference.py, written from the paper: each rank keeps its own momentum and all-gathers the
indices and values it sends over the same gloo group). The parameters must be equal after every step:
over trusted participants DeMo screens nothing by default (`Exchange.trusted`), where the swarm's
screening (a norm bound at the round's median) would change the update.

The ranks run this module: `python -m tests.unit.test_reference_demo RANK WORLD STORE OUT`.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from shoal.peer import DeMo, TorchDistributedExchange
from tests import gloo_ranks
from tests.demo_reference import ReferenceDeMo

STEPS = 6
LR = 1e-3
SETTINGS = {"defaults": {}, "weight_decay": {"weight_decay": 0.1}}
"""What each rank passes to shoal's DeMo besides lr and the exchange (the reference gets the same)."""


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's data: another stream on each rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(STEPS)
    ]


def _gradients(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()


def _all_gather_last(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor`, concatenated along the last dimension in rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.cat(gathered, dim=-1)


def _train(rank: int, world: int) -> dict[str, list[dict[str, list[torch.Tensor]]]]:
    """Per setting, per step: the parameters of shoal's DeMo and of the reference."""
    results = {}
    for name, settings in SETTINGS.items():
        model = _mlp()
        reference_model = copy.deepcopy(model)
        optimizer = DeMo(model.parameters(), lr=LR, exchange=TorchDistributedExchange(), **settings)
        reference = ReferenceDeMo([p.detach() for p in reference_model.parameters()], 1, lr=LR, **settings)
        steps = []
        for inputs, targets in _batches(rank):
            _gradients(model, inputs, targets)
            optimizer.step()
            _gradients(reference_model, inputs, targets)
            reference.step([[p.grad for p in reference_model.parameters()]], gather=_all_gather_last)
            with torch.no_grad():
                for p, stepped in zip(reference_model.parameters(), reference.params, strict=True):
                    p.copy_(stepped)
            steps.append(
                {
                    "shoal": [p.detach().clone() for p in model.parameters()],
                    "reference": [p.clone() for p in reference.params],
                }
            )
        results[name] = steps
    return results


@pytest.mark.timeout(120)
def test_demo_with_its_defaults_over_two_gloo_ranks_equals_the_reference_bit_for_bit(tmp_path):
    ranks = gloo_ranks.run_ranks(tmp_path, "tests.unit.test_reference_demo")
    initial = [p.detach() for p in _mlp().parameters()]
    for name in SETTINGS:
        for rank, result in enumerate(ranks):
            assert len(result[name]) == STEPS
            for step, params in enumerate(result[name]):
                for index, (got, want) in enumerate(zip(params["shoal"], params["reference"], strict=True)):
                    differ = (got != want).float().mean().item()
                    assert torch.equal(got, want), (
                        f"{name}, rank {rank}, step {step + 1}, parameter {index}: {differ:.1%} differ"
                    )
            # the ranks trained on different data, and moved
            assert not torch.equal(result[name][-1]["shoal"][0], initial[0])
        for a, b in zip(ranks[0][name][-1]["shoal"], ranks[1][name][-1]["shoal"], strict=True):
            assert torch.equal(a, b)  # one model on both ranks


if __name__ == "__main__":
    gloo_ranks.serve_rank(_train)
