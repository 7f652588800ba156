"""An independent float64 re-computation of DeMo as the paper's reference code computes it.

Written from the algorithm (arXiv 2411.19870, Algorithm 1) and the reference's semantics: chunk per
dimension = largest divisor <= chunk, tiles transformed with einsum against DCT bases built from the
cosine definition, top-k of |coefficient| per tile, all-gather by concatenation in rank order,
scatter_reduce("mean", include_self=False), inverse, sign, SGD step. Shares no code with shoal.
"""

import math
from collections.abc import Callable

import torch


def basis(n: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    b[0] *= math.sqrt(0.5)
    return b.to(device=device, dtype=dtype)  # coefficient = b @ x


def split(n: int, chunk: int) -> int:
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def encode(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(..., tile_elems) coefficients: 2-D -> (y, x, h*w), 1-D -> (x, w)."""
    if x.dim() == 1:
        w = split(x.shape[0], chunk)
        return torch.einsum("xj,bj->xb", x.reshape(-1, w), basis(w, x.dtype, x.device))
    h, w = split(x.shape[0], chunk), split(x.shape[1], chunk)
    tiles = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
    coeffs = torch.einsum("yjxl,bj,dl->yxbd", tiles, basis(h, x.dtype, x.device), basis(w, x.dtype, x.device))
    return coeffs.reshape(coeffs.shape[0], coeffs.shape[1], h * w)


def decode(coeffs: torch.Tensor, shape: tuple[int, ...], chunk: int) -> torch.Tensor:
    if len(shape) == 1:
        w = split(shape[0], chunk)
        return torch.einsum("xb,bj->xj", coeffs, basis(w, coeffs.dtype, coeffs.device)).reshape(shape)
    h, w = split(shape[0], chunk), split(shape[1], chunk)
    tiles = coeffs.reshape(coeffs.shape[0], coeffs.shape[1], h, w)
    return torch.einsum(
        "yxbd,bj,dl->yjxl",
        tiles,
        basis(h, coeffs.dtype, coeffs.device),
        basis(w, coeffs.dtype, coeffs.device),
    ).reshape(shape)


class ReferenceDeMo:
    """Replicated parameters and the momentum of every worker simulated here, stepped the reference's way
    (in the dtype of the given parameters): all of them in one process, or one per process of a
    torch.distributed job (`step`'s `gather`)."""

    def __init__(self, params, workers, *, lr, decay=0.999, topk=32, chunk=64, weight_decay=0.0):
        self.params = [p.clone() for p in params]
        self.deltas = [[torch.zeros_like(p) for p in self.params] for _ in range(workers)]
        self.lr, self.decay, self.topk, self.chunk, self.weight_decay = lr, decay, topk, chunk, weight_decay

    def step(
        self, grads: list[list[torch.Tensor]], gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """grads[worker][param]: one step of every worker simulated here, all-gather in rank order.
        `gather(t)`: every process's `t` concatenated along the last dimension in rank order (the
        reference's all-gather of the sent indices and values); None: this process simulates them all."""
        for i, p in enumerate(self.params):
            p.mul_(1 - self.lr * self.weight_decay)
            idx_all, val_all = [], []
            for m, delta in enumerate(d[i] for d in self.deltas):
                delta.mul_(self.decay).add_(grads[m][i].to(p.dtype), alpha=self.lr)
                coeffs = encode(delta, self.chunk)
                k = min(self.topk, coeffs.shape[-1])
                idx = torch.topk(coeffs.abs(), k, dim=-1).indices
                val = torch.gather(coeffs, -1, idx)
                sent = torch.zeros_like(coeffs).scatter_(-1, idx, val)
                delta.sub_(decode(sent, tuple(p.shape), self.chunk))
                idx_all.append(idx)
                val_all.append(val)
            idx, val = torch.cat(idx_all, -1), torch.cat(val_all, -1)
            if gather is not None:
                idx, val = gather(idx), gather(val)
            combined = torch.zeros_like(encode(p, self.chunk))
            combined.scatter_reduce_(-1, idx, val, "mean", include_self=False)
            p.sub_(torch.sign(decode(combined, tuple(p.shape), self.chunk)), alpha=self.lr)


def demo_steps(
    params: list[torch.Tensor],
    grads: list[list[list[torch.Tensor]]],
    *,
    lr: float,
    decay: float = 0.999,
    topk: int = 32,
    chunk: int = 64,
    weight_decay: float = 0.0,
) -> list[torch.Tensor]:
    """The replicated float64 parameters after len(grads) steps; grads[step][worker][param]."""
    reference = ReferenceDeMo(
        [p.double() for p in params],
        len(grads[0]),
        lr=lr,
        decay=decay,
        topk=topk,
        chunk=chunk,
        weight_decay=weight_decay,
    )
    for step_grads in grads:
        reference.step(step_grads)
    return reference.params
