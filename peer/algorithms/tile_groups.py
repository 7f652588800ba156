"""How DeMo lays out the momentum of a whole model: parameters grouped by DCT chunk shape, each
group one tile-major buffer of row bands, cut into slices of bounded size.

A parameter of plan (R, C, r, c) owns `R/r * C/c` consecutive tiles of its group's buffer; tile t of
the buffer is rows `[t r, (t + 1) r)` (`ChunkPlan.bands`). Gradients are added into that layout, and
signs applied back, through permuted views of the parameter (no copies). A slice is a run of whole
parameters holding at most `max_slice_numel` elements (a larger parameter is a slice of its own),
so the codec transforms a slice at once and its scratch memory stays bounded.

What a step does to every member of a slice goes through one multi-tensor (`torch._foreach_*`) call
per distinct scale, not one call per parameter: on a GPU each call is a kernel launch and a few
microseconds of Python, and per-parameter calls made the DeMo step host-bound (BENCHMARKS.md).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shoal.compression.dct import ChunkPlan


@dataclass(frozen=True, slots=True)
class Member:
    """One parameter inside a slice."""

    param: torch.Tensor
    plan: ChunkPlan
    """The parameter's own chunking (0-d parameters as one-element 1-D tensors)."""
    first_tile: int
    """Its first tile, counted within the slice."""

    def tiles(self, bands: torch.Tensor) -> torch.Tensor:
        """The parameter's tiles in the slice's band buffer, viewed as (tile_row, tile_col, r, c)."""
        count = self.plan.num_chunks * self.plan.chunk_rows
        start = self.first_tile * self.plan.chunk_rows
        return bands[start : start + count].view(self.plan.tile_layout())

    def matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the parameter's shape viewed in tile order: (tile_row, tile_col, r, c)."""
        return tensor.reshape(self.plan.matrix_layout()).transpose(1, 2)


@dataclass(frozen=True, slots=True)
class Slice:
    """Whole parameters of one chunk shape, dtype and device, transformed together."""

    members: list[Member]
    plan: ChunkPlan
    """`ChunkPlan.bands` of all the members' tiles."""

    def gather(
        self, bands: torch.Tensor, tensors: Sequence[torch.Tensor | None], scales: Sequence[float]
    ) -> None:
        """Writes `scales[i] * tensors[i]` into member i's tiles of `bands` (a None tensor: zeros)."""
        targets, sources = [], []
        for member, tensor in zip(self.members, tensors, strict=True):
            if tensor is None:  # an unused parameter still sends: the same payload everywhere
                member.tiles(bands).zero_()
            else:
                targets.append(member.tiles(bands))
                sources.append(member.matrix(tensor))
        if targets:
            torch._foreach_copy_(targets, sources)
        groups = _by_scale(self.members, scales)
        if len(groups) == 1:  # the members' tiles make up the whole buffer
            scale = next(iter(groups))
            if scale != 1:
                bands.mul_(scale)
            return
        for scale, members in groups.items():
            if scale != 1:
                torch._foreach_mul_([m.tiles(bands) for m in members], scale)

    def add_to_params(
        self,
        bands: torch.Tensor,
        alphas: Sequence[float],
        into: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Adds `alphas[i] *` member i's tiles of `bands` to its parameter (the DeMo step's apply), or to
        the tensor `into` maps it to (a replay's copy)."""
        for alpha, members in _by_scale(self.members, alphas).items():
            targets = [m.param if into is None else into[m.param] for m in members]
            torch._foreach_add_(
                [m.matrix(t) for m, t in zip(members, targets, strict=True)],
                [m.tiles(bands) for m in members],
                alpha=alpha,
            )

    def scale_params(
        self, factors: Sequence[float], into: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Multiplies member i's parameter (or what `into` maps it to) by `factors[i]` (1: untouched;
        decoupled weight decay)."""
        for factor, members in _by_scale(self.members, factors).items():
            if factor != 1:
                torch._foreach_mul_([m.param if into is None else into[m.param] for m in members], factor)


def _by_scale(members: list[Member], scales: Sequence[float]) -> dict[float, list[Member]]:
    """The members grouped by their scale, in member order within a group."""
    groups: dict[float, list[Member]] = {}
    for member, scale in zip(members, scales, strict=True):
        groups.setdefault(scale, []).append(member)
    return groups


def slice_parameters(params: list[torch.Tensor], chunk: int, max_slice_numel: int) -> list[Slice]:
    """Deterministic slices: groups in order of (chunk shape, dtype, device), members in param order."""
    groups: dict[tuple, list[tuple[torch.Tensor, ChunkPlan]]] = {}
    for p in params:
        plan = ChunkPlan.for_shape(tuple(p.shape) if p.dim() else (1,), chunk)
        key = (plan.chunk_rows, plan.chunk_cols, str(p.dtype), str(p.device))
        groups.setdefault(key, []).append((p, plan))
    slices = []
    for key in sorted(groups):
        current: list[tuple[torch.Tensor, ChunkPlan]] = []
        for p, plan in groups[key]:
            if current and sum(q.numel() for q, _ in current) + p.numel() > max_slice_numel:
                slices.append(_make_slice(current))
                current = []
            current.append((p, plan))
        slices.append(_make_slice(current))
    return slices


def _make_slice(entries: list[tuple[torch.Tensor, ChunkPlan]]) -> Slice:
    members, tiles = [], 0
    for p, plan in entries:
        members.append(Member(p, plan, tiles))
        tiles += plan.num_chunks
    rows, cols = entries[0][1].chunk_rows, entries[0][1].chunk_cols
    return Slice(members, ChunkPlan.bands(tiles, rows, cols))
