"""The shared-state step's arithmetic, the same bits on every device (docs/ARCHITECTURE.md, "What must
be bit-identical").

Peers compare the digest of their shared state every round, so the transition from (the agreed state,
the round's counted payloads) to the next agreed state must give identical bits on any CPU and GPU.
Two things make torch's own kernels differ from one device to another:

- a fused multiply-add: `a.add_(b, alpha=w)`, `addcmul`, torch.optim.SGD's momentum and Nesterov
  updates are one rounding on a vectorized kernel (AVX2's, a GPU's) and two on a plain one;
- a reduction's order: `sum`, `norm`, `@` add in an order set by the vector width, the thread count
  or the BLAS library.

So the step is written here with elementwise operations only, each rounded on its own (an IEEE
product or sum of two floats is the same everywhere), and with reductions in a fixed order: `tree_sum`
adds halves of a tensor elementwise until one value is left, an order set by its length alone. A
device's own inner steps are untouched: only what every peer must agree on goes through here.
"""

from collections.abc import Iterator, Sequence
from typing import Any

import torch


def tree_sum_(x: torch.Tensor) -> torch.Tensor:
    """The sum of the 1-D tensor `x` in an order set by its length alone: the last half added onto the
    first, elementwise, until one value is left (an odd middle element stays for the next pass).
    Overwrites `x`; returns a 0-dim view of its first element."""
    return tree_sum_rows_(x.view(1, -1))[0]


def tree_sum_rows_(x: torch.Tensor) -> torch.Tensor:
    """`tree_sum_` of each row of the 2-D tensor `x` at once (the same order in every row). Overwrites
    `x`; returns a view of its first column."""
    n = x.shape[1]
    while n > 1:
        half = n // 2
        x[:, :half] += x[:, n - half : n]
        n -= half
    return x[:, 0]


def gram(rows: Sequence[Sequence[torch.Tensor]], *, diagonal_only: bool = False) -> list[list[float]]:
    """The Gram matrix of `rows` (each a list of tensors, the same shapes in every row): <r_i, r_j>,
    each product rounded in float32, summed tensor by tensor with `tree_sum_` and across tensors in
    float64, in order. With `diagonal_only`, the squared norms alone (the rest 0)."""
    count = len(rows)
    sums = [[0.0] * count for _ in range(count)]
    for parts in zip(*rows, strict=True):
        flat = [t.reshape(-1).float() for t in parts]
        if not flat or flat[0].numel() == 0:
            continue
        scratch = torch.empty_like(flat[0])
        for i in range(count):
            for j in range(i, i + 1) if diagonal_only else range(i, count):
                torch.mul(flat[i], flat[j], out=scratch)
                sums[i][j] += float(tree_sum_(scratch))
    for i in range(count):
        for j in range(i):
            sums[i][j] = sums[j][i]
    return sums


def add_scaled_(into: torch.Tensor, tensor: torch.Tensor, weight: float) -> None:
    """into += tensor * weight, the product rounded first (not one fused multiply-add)."""
    into.add_(tensor * weight)


class NesterovSGD(torch.optim.Optimizer):
    """torch.optim.SGD's update (momentum, optional Nesterov, no dampening or weight decay), each
    operation rounded on its own, so that the outer step gives the same bits on every device; its
    state (`momentum_buffer`) and parameter groups load and save as SGD's do."""

    def __init__(
        self, params: Any, lr: float, momentum: float = 0.0, nesterov: bool = False, **ignored: Any
    ) -> None:
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"lr must be > 0 and momentum in [0, 1), got {lr} and {momentum}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "dampening": 0.0,
            "weight_decay": 0.0,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> bool:  # type: ignore[override]
        """One step of every parameter with a gradient, unless it would leave a parameter or its
        momentum infinite or NaN (finite but huge values can overflow): then nothing moves, and it
        returns False. The check costs the update computed twice and one host sync."""
        finite = []  # one flag a tensor on its device, read at once: one host sync
        for p, direction, buffer in self._updates(commit=False):
            finite.append(torch.isfinite(p - direction).all())
            if buffer is not None:
                finite.append(torch.isfinite(buffer).all())
        if finite and not bool(torch.stack(finite).all()):
            return False
        for p, direction, _ in self._updates(commit=True):
            p.sub_(direction)
        return True

    def _updates(self, *, commit: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(parameter, lr * its direction, its new momentum) for each parameter with a gradient; the
        momentum is written to the state only with `commit`."""
        for group in self.param_groups:
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction, buffer = p.grad, None
                if momentum:
                    state = self.state[p]
                    old = state.get("momentum_buffer")
                    if old is None:
                        buffer = direction.detach().clone()
                    else:
                        buffer = old * momentum
                        buffer.add_(direction)
                    if commit:
                        state["momentum_buffer"] = buffer if old is None else old.copy_(buffer)
                    if nesterov:
                        direction = buffer * momentum
                        direction.add_(p.grad)
                    else:
                        direction = buffer
                yield p, direction * lr, buffer
