"""The DeMo step's host synchronizations and kernel launches do not grow with the model's tensors: each
sync stalls a GPU's queue, each launch costs the host microseconds, and one per tensor made the step
host-bound (BENCHMARKS.md). Counted on the CPU, device-agnostic: the operations that read a value back
to the host (`item`, `bool`, data-dependent shapes) as they reach torch's dispatcher, the tensor methods
that copy to host memory, and every operator that computes (views compute nothing)."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT

READS_BACK = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}
"""Operators that make the host wait for the device's result."""
VIEWS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "transpose",
    "t",
    "permute",
    "unsqueeze",
    "squeeze",
    "reshape",
    "expand",
    "as_strided",
    "alias",
    "detach",
    "narrow",
    "split",
    "unbind",
}
"""Operators that only make a new view of a tensor's memory: no kernel runs."""
PER_TENSOR_ON_THE_CPU = {"aminmax", "stack"}
"""robust.finite's CPU form, per tensor by design (one pass each, faster there than any fused form);
on a GPU it is one multi-tensor kernel (`torch._foreach_norm`)."""


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.launches = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS_BACK:
            self.counts[name] += 1
        if name not in VIEWS and name not in PER_TENSOR_ON_THE_CPU:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_copies(monkeypatch):
    counts = collections.Counter()
    for method in ("tolist", "cpu"):  # .numpy() follows .cpu(): one copy
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            counts[_method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return counts


def syncs_per_step(layers: int, host_copies: collections.Counter, **settings) -> tuple[int, int, int]:
    """(host reads, host copies, kernel launches) of one DeMo step of the tiny GPT with `layers` blocks."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset("tiny", n_layer=layers))
    exchange = LoopbackExchange.group(1, trusted=False)[0]  # the swarm's step: screened
    optimizer = DeMo(model.parameters(), lr=1e-3, weight_decay=0.1, exchange=exchange, **settings)
    tokens = torch.randint(0, 256, (2, 65))
    for _ in range(2):  # the second step: buffers exist, as in training
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        host_copies.clear()
        with HostReads() as reads:
            optimizer.step(samples=2)
        optimizer.zero_grad(set_to_none=True)
    return sum(reads.counts.values()), sum(host_copies.values()), sum(reads.launches.values())


@pytest.mark.parametrize("settings", [{}, {"compression_topk": 4, "value_bits": 1}], ids=["k32", "k4-1bit"])
def test_a_demo_step_syncs_and_launches_as_often_with_four_times_the_tensors(settings, host_copies):
    small = syncs_per_step(2, host_copies, **settings)
    large = syncs_per_step(8, host_copies, **settings)  # 68 tensors instead of 20
    assert large == small  # weight decay, gradients in, signs out: one multi-tensor call per slice
    assert small[0] <= 8 and small[1] <= 8  # a handful a step: the payload, the checks, the screen
