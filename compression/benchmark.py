"""`shoal bench codec`: payload size and encode/decode throughput of the codecs on transformer shapes.

    shoal bench codec                 # a table
    shoal bench codec --json          # one JSON object, {"results": [...]}
    shoal bench codec --device cuda   # the same on a GPU (timings wait for the device)

Throughput is MB of float32 input per second (tensor bytes / median seconds). For the DCT top-k
settings the same run times a baseline written the way the DeMo paper's published reference code
does it (rearrange into tiles, einsum with the bases, topk/gather; scatter_reduce and einsum back),
so the two are measured on the same machine under the same load.
"""

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeAlias

import torch
import zstandard

from shoal.compression import dct, streams, values
from shoal.compression.dct_topk import DCTTopKCodec
from shoal.compression.dense import DenseCodec
from shoal.compression.topk import TopKCodec

SHAPES: tuple[tuple[int, ...], ...] = (
    (768, 768),
    (768, 3072),
    (3072, 768),
    (50304, 768),
    (4096, 4096),
    (768,),
)
ZSTD_SHAPE = (768, 3072)
BenchedCodec: TypeAlias = DenseCodec | DCTTopKCodec
"""The codecs benchmarked (TopKCodec is a DCTTopKCodec): each has a value encoding and a zstd switch."""
SETTINGS: tuple[tuple[str, Callable[[], BenchedCodec]], ...] = (
    ("demo_reference", lambda: DCTTopKCodec(chunk=64, topk=32, value_bits=32)),
    ("demo_compact", lambda: DCTTopKCodec(chunk=64, topk=4, value_bits=1)),
    ("dense_int8", lambda: DenseCodec(value_bits=8, block=64)),
    ("dense_int4", lambda: DenseCodec(value_bits=4, block=64)),
    ("diloco_sparse", lambda: TopKCodec(chunk=64, topk=64, value_bits=2)),
)


@dataclass(slots=True)
class CodecResult:
    codec: str
    shape: list[int]
    topk: int | None
    value_bits: int
    bytes: int
    ratio_vs_fp32: float
    encode_mb_s: float
    decode_mb_s: float
    baseline_encode_mb_s: float | None
    baseline_decode_mb_s: float | None


class ReferenceStyleDCT:
    """The transform as the DeMo reference code writes it, used only as a timing baseline."""

    def __init__(self, shape: tuple[int, ...], chunk: int, topk: int, device: torch.device):
        plan = dct.ChunkPlan.for_shape(shape, chunk)
        self.plan, self.topk = plan, min(topk, plan.chunk_numel)
        self.rows = dct.dct_basis(plan.chunk_rows, device, torch.float32).T.contiguous()
        self.cols = dct.dct_basis(plan.chunk_cols, device, torch.float32).T.contiguous()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.plan
        tiles = x.reshape(p.matrix_layout())  # "(y h) (x w) -> y h x w"
        coeffs = torch.einsum("yhxw,hb,wd->yxbd", tiles, self.rows, self.cols)
        coeffs = coeffs.reshape(
            p.rows // p.chunk_rows, p.tiles_per_row, p.chunk_numel
        )  # "y x h w -> y x (h w)"
        indices = torch.topk(coeffs.abs(), self.topk, dim=-1, largest=True, sorted=False).indices
        return indices, torch.gather(coeffs, -1, indices)

    def decode(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        p = self.plan
        coeffs = values.new_zeros(p.rows // p.chunk_rows, p.tiles_per_row, p.chunk_numel)
        coeffs.scatter_reduce_(-1, indices, values, reduce="mean", include_self=False)
        coeffs = coeffs.reshape(p.tile_layout())
        return torch.einsum("yxbd,hb,wd->yhxw", coeffs, self.rows, self.cols).reshape(p.shape)


def median_seconds(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """The median wall time of `fn`, waiting for the device's queued work before each clock read."""

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: caches, workspace, lazy init
    times = []
    for _ in range(repeat):
        wait()
        start = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    name: str, make: Callable[[], BenchedCodec], shape: tuple[int, ...], repeat: int, device: torch.device
) -> CodecResult:
    torch.manual_seed(0)
    x = torch.randn(shape).to(device)
    megabytes = x.numel() * 4 / 1e6
    codec = make()
    message = codec.encode(x)
    size = message.ByteSize()
    encode_s = median_seconds(lambda: codec.encode(x), repeat, device)
    decode_s = median_seconds(lambda: codec.decode(message, device=device), repeat, device)
    topk = codec.topk if isinstance(codec, DCTTopKCodec) else None  # TopKCodec is one
    baseline_encode = baseline_decode = None
    if isinstance(codec, DCTTopKCodec) and not isinstance(codec, TopKCodec):
        reference = ReferenceStyleDCT(shape, codec.chunk, codec.topk, device)
        indices, kept = reference.encode(x)
        baseline_encode = megabytes / median_seconds(lambda: reference.encode(x), repeat, device)
        baseline_decode = megabytes / median_seconds(lambda: reference.decode(indices, kept), repeat, device)
    return CodecResult(
        codec=name,
        shape=list(shape),
        topk=topk,
        value_bits=values.BITS[codec.encoding],
        bytes=size,
        ratio_vs_fp32=x.numel() * 4 / size,
        encode_mb_s=megabytes / encode_s,
        decode_mb_s=megabytes / decode_s,
        baseline_encode_mb_s=baseline_encode,
        baseline_decode_mb_s=baseline_decode,
    )


@dataclass(slots=True)
class ZstdGain:
    codec: str
    shape: list[int]
    stream: str
    raw_bytes: int
    zstd_bytes: int


def zstd_gains(shape: tuple[int, ...]) -> list[ZstdGain]:
    """What zstd (level 3) does to each byte stream of each setting, on a Gaussian tensor."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    gains = []
    for name, make in SETTINGS:
        codec = make()
        codec.zstd = False  # measure zstd on the raw streams
        message = codec.encode(x)
        for stream in ("indices", "values", "scales"):
            raw = getattr(message, stream)
            if raw:
                packed = zstandard.ZstdCompressor(level=streams.ZSTD_LEVEL).compress(raw)
                gains.append(ZstdGain(name, list(shape), stream, len(raw), len(packed)))
    return gains


def run(*, repeat: int = 5, device: torch.device | None = None) -> list[CodecResult]:
    device = device or torch.device("cpu")
    return [measure(name, make, shape, repeat, device) for name, make in SETTINGS for shape in SHAPES]


def format_table(results: list[CodecResult]) -> str:
    header = (
        f"{'codec':<15} {'shape':<12} {'k':>3} {'bits':>4} {'bytes':>10} {'ratio':>8} "
        f"{'enc MB/s':>9} {'dec MB/s':>9} {'base enc':>9} {'base dec':>9} {'enc x':>6} {'dec x':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        shape = "x".join(map(str, r.shape))
        base_e = f"{r.baseline_encode_mb_s:9.0f}" if r.baseline_encode_mb_s else f"{'-':>9}"
        base_d = f"{r.baseline_decode_mb_s:9.0f}" if r.baseline_decode_mb_s else f"{'-':>9}"
        gain_e = f"{r.encode_mb_s / r.baseline_encode_mb_s:6.2f}" if r.baseline_encode_mb_s else f"{'-':>6}"
        gain_d = f"{r.decode_mb_s / r.baseline_decode_mb_s:6.2f}" if r.baseline_decode_mb_s else f"{'-':>6}"
        lines.append(
            f"{r.codec:<15} {shape:<12} {r.topk or '-':>3} {r.value_bits:>4} {r.bytes:>10} "
            f"{r.ratio_vs_fp32:>8.1f} {r.encode_mb_s:>9.0f} {r.decode_mb_s:>9.0f} {base_e} {base_d} "
            f"{gain_e} {gain_d}"
        )
    return "\n".join(lines)


def format_zstd_table(gains: list[ZstdGain]) -> str:
    lines = [f"{'codec':<15} {'shape':<12} {'stream':<8} {'raw':>10} {'zstd':>10} {'saved':>6}"]
    for g in gains:
        saved = 1 - g.zstd_bytes / g.raw_bytes
        lines.append(
            f"{g.codec:<15} {'x'.join(map(str, g.shape)):<12} {g.stream:<8} {g.raw_bytes:>10} "
            f"{g.zstd_bytes:>10} {saved:>6.1%}"
        )
    return "\n".join(lines)


def main(*, as_json: bool, repeat: int, device: str = "cpu") -> int:
    on = torch.device(device)
    results = run(repeat=repeat, device=on)
    gains = zstd_gains(ZSTD_SHAPE)
    if as_json:
        print(
            json.dumps({"results": [asdict(r) for r in results], "zstd_streams": [asdict(g) for g in gains]})
        )
    else:
        where = torch.cuda.get_device_name(on) if on.type == "cuda" else "CPU"
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 input on {where}")
        print(format_table(results))
        print("\nzstd level 3 on each stream (Gaussian input):")
        print(format_zstd_table(gains))
    return 0
