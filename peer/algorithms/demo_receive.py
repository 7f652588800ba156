"""DeMo's receiving side, pure functions over what a round gathered: each contribution decoded and
checked against the run's codec (`decode`), the contributions screened from their Gram matrix in the
DCT domain (`screen`, shoal.peer.algorithms.robust), and the accepted ones combined into the round's
update direction (`combine`). shoal.peer.algorithms.demo drives them."""

from collections.abc import Sequence
from typing import cast

import torch

from shoal.compression import DCTTopKCodec, DecodeLimits, MalformedPayloadError, dct
from shoal.compression.dct_topk import TopKCoefficients, unpack
from shoal.peer.algorithms.canonical import tree_sum_rows_
from shoal.peer.algorithms.exchange import Contribution
from shoal.peer.algorithms.robust import Reference, Screened, Suspicion, directions_judged, judged, overclaims
from shoal.peer.algorithms.tile_groups import Slice
from shoal.protocol import Payload, ValueEncoding, parse_message

SUM_SLOT, WEIGHT_SLOT = 2, 3
"""Workspace slots beyond the codec's 0 and 1 (transform scratch, magnitudes)."""


def screen(
    decoded: list[list[TopKCoefficients]],
    weights: list[float],
    slices: list[Slice],
    senders: list[bytes],
    claims: list[float],
    reference: Reference | None = None,
    *,
    suspicion: Suspicion,
    workspace: dct.Workspace,
) -> Screened:
    """shoal.peer.algorithms.robust's screening of sparse contributions, from their Gram matrix: per
    slice, each contribution scattered densely once and read at all contributions' indices in one gather
    (the round's coefficients side by side), then zeroed where it was written. `claims`: the samples
    each one announced (for `overclaim`); `reference`: what this participant sent (`Reference`)."""
    count, policy = len(decoded), suspicion.policy
    judging = directions_judged(policy, count, reference)
    if (count < 2 and not judging) or (policy.norm_ratio is None and not policy.judges):
        return Screened.of(weights, [1.0] * count, [None] * count, policy, overclaimed=overclaims(claims))
    gram: list[list[float]] | torch.Tensor  # the Gram matrix, read or on the device
    if not judging:  # the squared norms alone, in the canonical order (see below)
        squared = []
        for coeffs in decoded:
            total = torch.zeros(1, device=coeffs[0].values.device, dtype=torch.float64)
            for c in coeffs:  # slice by slice, in order
                total += _sum(c.values.float().square().view(1, -1))
            squared.append(total)
        gram = torch.diag(torch.cat(squared)).tolist()
        return judged(gram, weights, policy, suspicion, senders, claims)
    by_reference = reference is not None
    if by_reference:
        assert reference is not None  # by_reference
        decoded = [*decoded, list(cast("Sequence[TopKCoefficients]", reference.update))]  # DeMo's: top-k
    rows = len(decoded)
    device = decoded[0][0].values.device
    # float32 products summed slice by slice in an order set by their count alone, and across slices
    # in float64: every device decides alike (shoal.peer.algorithms.canonical)
    gram = torch.zeros(rows, rows, device=device, dtype=torch.float64)
    for index, piece in enumerate(slices):
        plan = piece.plan
        dense = workspace.get(SUM_SLOT, plan.numel, device, torch.float32)
        dense = dense.view(plan.num_chunks, -1).zero_()
        # every contribution's coefficients side by side: (chunks, count * k); read at once
        indices = torch.cat([coeffs[index].indices for coeffs in decoded], dim=1)
        values = torch.cat([coeffs[index].values.float() for coeffs in decoded], dim=1)
        for j, other in enumerate(decoded):
            dense.scatter_(1, other[index].indices, other[index].values.float())
            products = dense.gather(1, indices).mul_(values).view(plan.num_chunks, rows, -1)
            gram[:, j] += _sum(products.transpose(0, 1).reshape(rows, -1))
            dense.scatter_(1, other[index].indices, 0.0)  # back to zeros, at only what was written
    # one host sync
    return judged(gram.tolist(), weights, policy, suspicion, senders, claims, True, by_reference)


def _sum(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum (rows, n) in float32, in the canonical order (`tree_sum_rows_`), as float64;
    overwrites `rows` (a copy of the caller's)."""
    if rows.shape[1] == 0:
        return torch.zeros(rows.shape[0], device=rows.device, dtype=torch.float64)
    return tree_sum_rows_(rows).double()


def decode(
    contribution: Contribution,
    slices: list[Slice],
    limits: DecodeLimits,
    codec: DCTTopKCodec,
    max_payload_bytes: int,
) -> list[TopKCoefficients]:
    """A contribution's coefficients, slice by slice; MalformedPayloadError unless it is well-formed
    and sent with the run's chunk plan, top-k and value encoding (`config_mismatch`)."""
    payload = parse_message(Payload, contribution.payload, max_bytes=max_payload_bytes)
    if len(payload.tensors) != len(slices):
        raise MalformedPayloadError(
            "wrong_structure", f"{len(payload.tensors)} tensors for {len(slices)} slices"
        )
    if contribution.samples < 0:
        raise MalformedPayloadError("bad_samples", f"negative sample count {contribution.samples}")
    decoded = []
    for message, piece in zip(payload.tensors, slices, strict=True):
        coeffs = unpack(message, piece.members[0].param.device, limits)
        if coeffs.plan != piece.plan:
            raise MalformedPayloadError(
                "config_mismatch", f"chunk plan {coeffs.plan} where the run's is {piece.plan}"
            )
        expected = (min(codec.topk, piece.plan.chunk_numel), codec.encoding)
        if (coeffs.topk, message.value_encoding) != expected:
            raise MalformedPayloadError(
                "config_mismatch",
                f"top-{coeffs.topk} with {ValueEncoding.Name(message.value_encoding)} values where "
                f"the run sends top-{expected[0]} with {ValueEncoding.Name(expected[1])}",
            )
        decoded.append(coeffs)
    return decoded


def signs(
    received: list[tuple[TopKCoefficients, float]],
    piece: Slice,
    workspace: dct.Workspace,
    *,
    canonical: bool,
) -> torch.Tensor:
    """Step 8's direction for one slice: the sign of `combine`'s inverse DCT. `canonical`: the same
    bits on every device (`dct.inverse_signs`, after the dense mean, whose sums are in rank order);
    else the float inverse of the reference. A view into the codec's workspace, valid until its next
    use."""
    if not canonical:
        # finite but huge values from a hostile peer can sum to inf and inf - inf to NaN: never apply NaN
        return combine(received, piece, workspace).sign_().nan_to_num_(nan=0.0)
    sums = _mean(received, piece, workspace)
    return dct.inverse_signs(sums, piece.plan, workspace, out=sums)


def combine(
    received: list[tuple[TopKCoefficients, float]], piece: Slice, workspace: dct.Workspace
) -> torch.Tensor:
    """Step 7 of DeMo: per coefficient, the (weighted) mean over the participants that sent it; then
    idct. Returns a view into the codec's workspace, valid until its next use."""
    plan = piece.plan
    sent = sum(coeffs.topk for coeffs, _ in received)
    if received and dct.sparse_is_cheaper(sent, plan):
        return _combine_sparse(received, plan, workspace)
    sums = _mean(received, piece, workspace)
    return dct.inverse_dense(sums, plan, workspace, out=sums)  # sums is read before out is written


def _mean(
    received: list[tuple[TopKCoefficients, float]], piece: Slice, workspace: dct.Workspace
) -> torch.Tensor:
    """Per coefficient, the weighted mean of the values sent at it (0 where none was), in the
    workspace's sum slot: summed in rank order, one value per index and call (a chunk's indices are
    distinct), so the same floats on every device."""
    plan = piece.plan
    device = piece.members[0].param.device
    sums = workspace.get(SUM_SLOT, plan.numel, device, torch.float32).view(plan.num_chunks, -1).zero_()
    weights = workspace.get(WEIGHT_SLOT, plan.numel, device, torch.float32).view(plan.num_chunks, -1).zero_()
    for coeffs, weight in received:
        sums.scatter_add_(1, coeffs.indices, coeffs.values * weight)
        weights.scatter_add_(1, coeffs.indices, torch.full_like(coeffs.values, weight))
    return sums.div_(weights.clamp_(min=1e-30))  # where nobody sent a coefficient: 0 / tiny = 0


def _combine_sparse(
    received: list[tuple[TopKCoefficients, float]], plan: dct.ChunkPlan, workspace: dct.Workspace
) -> torch.Tensor:
    """`combine` without a dense pass over the coefficients, for few values per chunk (the usual
    case: k times the participants): every sent value is divided by the summed weight of those
    sent at its index, and the sparse inverse adds up the duplicates, so each index gets the
    weighted mean of its values, as the dense path computes it."""
    indices = torch.cat([coeffs.indices for coeffs, _ in received], dim=1)
    values = torch.cat([coeffs.values.float() * weight for coeffs, weight in received], dim=1)
    weights = torch.cat(
        [torch.full(c.indices.shape, weight, device=values.device) for c, weight in received], dim=1
    )
    same = (indices.unsqueeze(2) == indices.unsqueeze(1)).to(values.dtype)  # (chunks, sent, sent)
    totals = torch.bmm(same, weights.unsqueeze(2)).squeeze(2)
    values.div_(totals)
    out = workspace.get(SUM_SLOT, plan.numel, values.device, values.dtype)
    return dct.inverse_sparse(indices, values, plan, workspace, out=out)
