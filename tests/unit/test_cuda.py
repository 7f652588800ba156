"""The GPU paths: codecs, DeMo, DiLoCo, screening and the nccl exchange on a CUDA device.

Every test here is skipped on a machine without CUDA (CI has none); run them where a GPU is:

    pytest tests/unit/test_cuda.py -v

Each computes on the GPU what another test computes on the CPU, and compares: the codecs' bytes, a
DeMo step against the float64 re-computation of the reference, DiLoCo's three modes, and the payloads
a screened round lets through. Host synchronizations inside the optimizers' steps are counted with
torch's sync debug mode, so that a new `.item()` in a hot loop fails here.
"""

import os
import warnings
from datetime import timedelta

import pytest
import torch

from shoal.compression import DCTTopKCodec, DenseCodec, TopKCodec
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import LoopbackExchange, TorchDistributedExchange
from shoal.peer.algorithms.exchange import run_loopback as run_workers
from shoal.peer.algorithms.robust import DEMO, NONE
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests import demo_reference
from tests.unit.test_demo import SHAPES, make_grads, train_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("value_bits", [32, 16, 8, 4, 1])
def test_dct_topk_payload_from_the_gpu_decodes_like_the_cpus(value_bits):
    torch.manual_seed(0)
    tensor = torch.randn(256, 192)
    codec = DCTTopKCodec(topk=8, value_bits=value_bits)
    on_cpu = codec.decode(codec.encode(tensor))
    message = DCTTopKCodec(topk=8, value_bits=value_bits).encode(tensor.to(CUDA))
    on_gpu = codec.decode(message, device=CUDA)
    assert on_gpu.device == CUDA
    # the same coefficients are kept (ties aside, which random data has none of)
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_bits", [32, 8, 2])
def test_sparse_topk_payload_from_the_gpu_is_the_cpus(value_bits):
    """Plain top-k with Elias-Fano indices: the GPU's message is byte for byte the CPU's."""
    torch.manual_seed(0)
    tensor = torch.randn(256, 192)
    on_cpu = TopKCodec(topk=64, value_bits=value_bits).encode(tensor)
    on_gpu = TopKCodec(topk=64, value_bits=value_bits).encode(tensor.to(CUDA))
    assert on_gpu.indices == on_cpu.indices and on_gpu.values == on_cpu.values
    decoded = TopKCodec().decode(on_gpu, device=CUDA)
    assert decoded.device == CUDA
    torch.testing.assert_close(decoded.cpu(), TopKCodec().decode(on_cpu), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value_bits", [32, 8, 4])
def test_dense_codec_from_the_gpu_round_trips_within_its_bound(value_bits):
    torch.manual_seed(0)
    tensor = torch.randn(4096)
    codec = DenseCodec(value_bits)
    on_cpu = codec.decode(codec.encode(tensor))
    on_gpu = codec.decode(codec.encode(tensor.to(CUDA)), device=CUDA)
    assert on_gpu.device == CUDA
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-6)


def demo_on(device, initial, grads, **settings):
    """Every worker's final parameters, on the CPU (test_demo's loopback workers, on `device`)."""
    results = train_workers(initial, grads, dtype=initial[0].dtype, device=device, **settings)
    return [[p.cpu() for p in params] for params, _ in results]


@pytest.mark.parametrize("workers", [1, 3])
def test_demo_on_the_gpu_equals_the_float64_reference(workers):
    torch.manual_seed(10)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=4, workers=workers)
    expected = demo_reference.demo_steps(initial, grads, lr=1e-3, weight_decay=0.1)
    for params in demo_on(CUDA, initial, grads, lr=1e-3, weight_decay=0.1):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_screened_compact_demo_on_the_gpu_matches_the_cpu():
    """Default screening, k=4, 1-bit values, float32, 4 workers: a sign update, so a coefficient whose
    float32 sum differs by rounding between devices may flip; nearly all must agree."""
    torch.manual_seed(10)
    initial = [torch.randn(s) for s in SHAPES]
    grads = make_grads(steps=6, workers=4)
    settings = {"lr": 1e-3, "compression_topk": 4, "value_bits": 1, "robust": DEMO}
    on_cpu = demo_on(torch.device("cpu"), initial, grads, **settings)
    on_gpu = demo_on(CUDA, initial, grads, **settings)
    for gpu_params, cpu_params in zip(on_gpu, on_cpu, strict=True):
        for got, want in zip(gpu_params, cpu_params, strict=True):
            differ = (got - want).abs() > 1e-6
            assert differ.float().mean() < 0.01


CONFIG = GPTConfig.preset("tiny", n_layer=1, d_model=32, seq_len=16)


@pytest.mark.parametrize("overlap", [False, True])
def test_demos_shared_step_on_the_gpu_gives_the_cpus_bits(overlap):
    """Issue 76: the same DeMo payload bytes, three rounds of DeMo's own transition (`DeMo.replay`:
    screening, the mean, the exact inverse DCT's signs, weight decay) from the same state on the GPU
    and on the CPU: the same bits, as a CPU peer and a GPU peer of one swarm must hold."""
    from shoal.peer.algorithms.exchange import Contribution
    from tests.unit.test_canonical import demo_rounds

    rounds = demo_rounds()
    ends = []
    for device in (torch.device("cpu"), CUDA):
        model = TinyGPT(CONFIG).to(device)
        exchange = LoopbackExchange.group(1, trusted=False)[0]
        demo = DeMo(
            model.parameters(), lr=0.01, exchange=exchange, weight_decay=0.1, compression_topk=8,
            overlap=overlap, lookahead=overlap,
        )  # fmt: skip
        state = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for p in model.parameters()]
        for number, contributions in enumerate(rounds):
            payloads = [
                Contribution(r, bytes.fromhex(data), n, sender=bytes([r + 1]))
                for r, (data, n) in enumerate(contributions)
            ]
            replayed = demo.replay(state, payloads, (number, number + 1))
            assert replayed is not None and not replayed[1]
            state = [t.cpu() for t in replayed[0]]
        demo.close()
        ends.append(state)
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


def diloco_on(
    device, mode: str, make_codec=None, workers: int = 2, gather_limit: int = 0, **settings
) -> list[list[torch.Tensor]]:
    """Every worker's final parameters; `make_codec` makes each worker its own (codecs are not
    thread-safe); `gather_limit` bounds the fan-in."""
    torch.manual_seed(0)
    initial = TinyGPT(CONFIG).state_dict()

    def work(rank, exchange):
        model = TinyGPT(CONFIG)
        model.load_state_dict(initial)
        model.to(device)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
        generator = torch.Generator().manual_seed(1000 + rank)
        codec = make_codec() if make_codec else None
        diloco = DiLoCo(model, inner, exchange=exchange, inner_steps=4, mode=mode, codec=codec, **settings)
        with diloco:
            for _ in range(12):
                tokens = torch.randint(0, 256, (4, CONFIG.seq_len + 1), generator=generator).to(device)
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
                diloco.step(samples=4)
            diloco.finish()
        return [p.detach().cpu() for p in model.parameters()]

    # untrusted: the swarm's screened mean, on both devices
    return run_workers(workers, work, timeout=timedelta(seconds=60), gather_limit=gather_limit, trusted=False)


@pytest.mark.parametrize("mode", ["standard", "delayed", "eager"])
def test_diloco_on_the_gpu_matches_the_cpu(mode):
    """TF32 and other kernels make the GPU's AdamW steps differ in the last bits; 12 inner steps keep
    that far below the update's size."""
    torch.backends.cuda.matmul.allow_tf32 = False
    on_cpu = diloco_on(torch.device("cpu"), mode, lambda: DenseCodec(8))
    on_gpu = diloco_on(CUDA, mode, lambda: DenseCodec(8))
    for gpu_params, cpu_params in zip(on_gpu, on_cpu, strict=True):
        for got, want in zip(gpu_params, cpu_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    first = on_gpu[0]
    for other in on_gpu[1:]:  # every worker ends on one model
        for a, b in zip(first, other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_diloco_with_its_outer_state_on_the_host_matches_it_on_the_gpu(mode):
    """`--outer-state cpu`: the outer copy, its momentum, the error feedback and the round's mean in
    pinned host memory give the model the GPU-resident outer state gives it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    on_gpu = diloco_on(CUDA, mode, lambda: DenseCodec(8))
    on_host = diloco_on(CUDA, mode, lambda: DenseCodec(8), outer_device="cpu")
    for host_params, gpu_params in zip(on_host, on_gpu, strict=True):
        for got, want in zip(host_params, gpu_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_sparse_diloco_on_the_gpu_matches_the_cpu(mode):
    """`--compression sparse` (top-64 of 4096, 2-bit levels, error feedback): a value whose last bits
    differ between devices could swap places with its neighbour at the top-k's edge, which moves its
    chunk's levels, and error feedback carries that on; so the GPU's model must be within 2% of how far
    training moved the CPU's (measured on an H200: 0, the bfloat16 levels absorb the last bits), and the
    workers on the GPU end on one model, bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    settings = {"outer_lr": 1.5, "outer_momentum": 0.0, "error_decay": 1.0}
    sparse = lambda: TopKCodec(topk=64, value_bits=2)  # noqa: E731
    on_cpu = diloco_on(torch.device("cpu"), mode, sparse, workers=3, **settings)
    on_gpu = diloco_on(CUDA, mode, sparse, workers=3, **settings)
    torch.manual_seed(0)
    initial = [p.detach() for p in TinyGPT(CONFIG).parameters()]

    def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return float(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)) ** 0.5)

    for gpu_params, cpu_params in zip(on_gpu, on_cpu, strict=True):
        drift = distance(gpu_params, cpu_params) / distance(cpu_params, initial)
        print(f"sparse {mode}: the GPU's model is {drift:.2e} of training's movement from the CPU's")
        assert drift < 0.02, drift
    for other in on_gpu[1:]:
        for a, b in zip(on_gpu[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("carry", [False, True])
def test_demo_under_a_bounded_fan_in_on_the_gpu_equals_the_cpu(carry):
    """`--gather 2` of 4 workers, float64: the payloads left out (and with `carry`, what they sent
    going back into the momentum) on the GPU give the CPU's parameters, and the same workers wait."""
    torch.manual_seed(10)
    initial = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(steps=6, workers=4)
    settings = {"lr": 1e-3, "gather_limit": 2, "carry": carry}
    on_cpu = train_workers(initial, grads, **settings)
    on_gpu = train_workers(initial, grads, device=CUDA, **settings)
    assert [opt.stats.uncounted for _, opt in on_gpu] == [opt.stats.uncounted for _, opt in on_cpu]
    assert sum(opt.stats.uncounted for _, opt in on_gpu) == 2 * 6
    for (gpu_params, _), (cpu_params, _) in zip(on_gpu, on_cpu, strict=True):
        for got, want in zip(gpu_params, cpu_params, strict=True):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["standard", "eager"])
def test_diloco_with_carry_under_a_bounded_fan_in_on_the_gpu_matches_the_cpu(mode):
    """`--gather 1` of 3 workers with `carry`: a pseudo-gradient left out is averaged into the next one
    on the GPU as on the CPU, and the workers on the GPU end on one model."""
    torch.backends.cuda.matmul.allow_tf32 = False
    settings = {"workers": 3, "gather_limit": 1, "carry": True}
    on_cpu = diloco_on(torch.device("cpu"), mode, lambda: DenseCodec(8), **settings)
    on_gpu = diloco_on(CUDA, mode, lambda: DenseCodec(8), **settings)
    for gpu_params, cpu_params in zip(on_gpu, on_cpu, strict=True):
        for got, want in zip(gpu_params, cpu_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    for other in on_gpu[1:]:
        for a, b in zip(on_gpu[0], other, strict=True):
            assert torch.equal(a, b)


def host_syncs(fn) -> int:
    """How many times `fn` makes the host wait for the GPU (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    "settings", [{}, {"compression_topk": 4, "value_bits": 1}], ids=["reference", "compact"]
)
def test_a_demo_step_syncs_the_host_a_bounded_number_of_times(settings):
    """A step copies its payload to the host (indices, values and scales of each tile group: the wire)
    and the decoded contributions back; nothing per tensor or per chunk. So the count does not grow
    with the model: the same for 1 and for 4 layers (measured on an H100: 23 for reference settings,
    29 for compact, with 3 tile groups)."""
    counts = []
    for layers in (1, 4):
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig.preset("tiny", n_layer=layers, d_model=64, seq_len=32)).to(CUDA)
        exchange = LoopbackExchange.group(1, trusted=False)[0]  # the swarm's step: screened
        optimizer = DeMo(model.parameters(), lr=1e-4, exchange=exchange, **settings)
        tokens = torch.randint(0, 256, (8, 33), device=CUDA)
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        optimizer.step()  # the first step builds the plans and bases
        counts.append(host_syncs(optimizer.step))
    assert counts[0] == counts[1], counts
    assert counts[0] <= 32, counts


def test_nccl_exchange_runs_demo_like_the_loopback(tmp_path):
    """One rank over nccl on this GPU (nccl refuses two ranks on one device): the collectives, the
    uint8 payload tensors on the GPU and their copy back, against the loopback's result."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
    try:
        torch.manual_seed(10)
        initial = [torch.randn(s) for s in SHAPES]
        grads = make_grads(steps=3, workers=1)
        params = [torch.nn.Parameter(p.clone().to(CUDA)) for p in initial]
        optimizer = DeMo(params, exchange=TorchDistributedExchange(), lr=1e-3, robust=NONE)
        for step_grads in grads:
            for p, g in zip(params, step_grads[0], strict=True):
                p.grad = g.to(device=CUDA, dtype=p.dtype)
            optimizer.step()
        mean = TorchDistributedExchange().mean(torch.ones(3, device=CUDA), weight=2.0)
    finally:
        dist.destroy_process_group()
    (expected,) = demo_on(CUDA, initial, grads, lr=1e-3)
    for got, want in zip(params, expected, strict=True):
        assert torch.equal(got.detach().cpu(), want)
    assert torch.equal(mean.cpu(), torch.ones(3))
