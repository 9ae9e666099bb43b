"""The Barlow Twins loss (Zbontar et al., ICML 2021, eq. 1 and 2), dense and Gram forms.

With each embedding dimension standardised over the batch (mean 0, biased variance 1,
eps 1e-5, as the reference's ``BatchNorm1d(affine=False)``), the cross-correlation is

    C = z_aᵀ z_b / N                                     (D x D)
    loss = Σ_i (1 − C_ii)²  +  λ Σ_{i≠j} C_ij²            (invariance + λ · redundancy)

The redundancy term equals ‖C‖_F² − Σ_i C_ii², and ‖z_aᵀ z_b‖_F² = Σ_{n,m} (z_a z_aᵀ)_{nm}
(z_b z_bᵀ)_{nm}, so the same loss costs O(N²D) time and O(N²) memory in the Gram form
instead of O(ND²) and O(D²). Both forms give the same value and gradient.

Under ``torch.distributed`` the statistics, C and the Gram matrices are those of the
global batch, through autograd-aware collectives, so that the loss and (after DDP's
gradient averaging) the gradients equal those of one process on the concatenated batch.

Both forms, ten LARS steps each, are held to the official main.py's loss and step in
tests/test_against_reference.py (which says what float tolerance each can promise and why).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from bt_hub.common.distributed import all_gather_cat, all_reduce_sum, get_world_size

EPS = 1e-5
METHODS = ("auto", "dense", "gram")


class LossTerms(NamedTuple):
    """The loss and its two parts (unweighted), all float32 scalars."""

    loss: torch.Tensor
    invariance_term: torch.Tensor
    redundancy_term: torch.Tensor


class _Standardize(torch.autograd.Function):
    """Affine-free batch norm over the global batch with the fused batch-norm backward.

    Backward: dz = rsqrt(var + eps) · (g − mean(g) − a · mean(g ⊙ a)), the means over the global batch;
    about half the element-wise passes of autograd's graph of the same formula.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, n: int, eps: float) -> torch.Tensor:
        centred = z - all_reduce_sum(z.sum(dim=0)) / n
        var = all_reduce_sum(torch.linalg.vector_norm(centred, dim=0).square()) / n
        inv_std = torch.rsqrt(var + eps)
        out = centred.mul_(inv_std)
        ctx.save_for_backward(out, inv_std)
        ctx.n = n
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out, inv_std = ctx.saved_tensors
        sums = all_reduce_sum(torch.stack((g.sum(dim=0), (g * out).sum(dim=0)))) / ctx.n
        return (g - sums[0]).addcmul_(out, sums[1], value=-1).mul_(inv_std), None, None


def standardize(z: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, int]:
    """Per-dimension (z − mean) / sqrt(biased var + eps) over the global batch; the rows and the global N."""
    n = z.shape[0]
    if get_world_size() > 1:  # a tensor made on the device only here: in one process it was a CUDA sync a view
        n = int(all_reduce_sum(torch.tensor([float(n)], device=z.device)).item())
    return _Standardize.apply(z, n, eps), n


def choose_method(n: int, d: int) -> str:
    """'gram' when the N x N Gram form is cheaper than the D x D matrix (2N < D), else 'dense'."""
    return "gram" if 2 * n < d else "dense"


def dense_terms(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Invariance and redundancy terms from the D x D cross-correlation C = aᵀb / N, summed over ranks."""
    c = all_reduce_sum(a.T @ b) / n
    diag = torch.diagonal(c)
    invariance = (1 - diag).pow(2).sum()
    redundancy = c.pow(2).sum() - diag.pow(2).sum()
    return invariance, redundancy


class _GramFrobenius(torch.autograd.Function):
    """Σ_{n,m} (A Aᵀ)_{nm} (B Bᵀ)_{nm} over the global batch (= N² ‖C‖_F²), in float64.

    Each rank forms only its rows of the Gram matrices; the gradient is 2 (B Bᵀ) A for A (and 2 (A Aᵀ) B
    for B), one matrix product per view.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a_all, b_all = all_gather_cat(a), all_gather_cat(b)
        gram_a, gram_b = a @ a_all.T, b @ b_all.T
        ctx.save_for_backward(a_all, b_all, gram_a, gram_b)
        return all_reduce_sum((gram_a.double() * gram_b.double()).sum())

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a_all, b_all, gram_a, gram_b = ctx.saved_tensors
        scale = (2 * all_reduce_sum(g)).to(a_all.dtype)
        return (gram_b @ a_all).mul_(scale), (gram_a @ b_all).mul_(scale)


def gram_terms(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same terms without forming C: ‖C‖_F² = Σ_{n,m} (A Aᵀ)_{nm} (B Bᵀ)_{nm} / N², local x global rows."""
    diag = all_reduce_sum((a * b).sum(dim=0)) / n
    # float64 accumulation: ‖C‖² − Σ C_ii² subtracts two numbers of size ~D.
    frob = _GramFrobenius.apply(a, b) / (n * n)
    invariance = (1 - diag).pow(2).sum()
    redundancy = (frob - diag.double().pow(2).sum()).float()
    return invariance, redundancy


# λ, the weight of the redundancy-reduction term: the reference code's 0.0051 (the paper rounds it to 5e-3).
LAMBD = 0.0051


def _scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor + x.detach() * (1.0 - factor)


def barlow_twins_loss(
    z_a: torch.Tensor,
    z_b: torch.Tensor,
    lambd: float = LAMBD,
    method: str = "auto",
    *,
    reference_grad_scale: bool = False,
) -> LossTerms:
    """Barlow Twins loss of two embedding batches (N x D each), in float32.

    Args:
        z_a: embeddings of the first views (this rank's rows under DDP).
        z_b: embeddings of the second views, same shape.
        lambd: weight λ of the redundancy term (paper 5e-3, reference code 0.0051).
        method: "dense" (D x D), "gram" (N x N) or "auto" (the cheaper of the two).
        reference_grad_scale: scale the gradient by 1/world_size, as the reference code's
            plain all_reduce + DDP averaging does, to match the released recipe on a given
            GPU count; off by default (exact global-batch gradients).

    Returns:
        LossTerms(loss, invariance_term, redundancy_term) with
        loss = invariance_term + lambd * redundancy_term.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is unknown; expected one of {METHODS}")
    if z_a.shape != z_b.shape or z_a.dim() != 2:
        raise ValueError(f"z_a and z_b must both be N x D; got {tuple(z_a.shape)} and {tuple(z_b.shape)}")
    with torch.autocast(device_type=z_a.device.type, enabled=False):
        a, n = standardize(z_a.float())
        if n < 2:
            raise ValueError(f"the global batch must hold at least 2 samples to standardise over it, got {n}")
        b, _ = standardize(z_b.float())
        if method == "auto":
            method = choose_method(n, a.shape[1])
        terms = dense_terms if method == "dense" else gram_terms
        invariance, redundancy = terms(a, b, n)
        loss = invariance + lambd * redundancy
        if reference_grad_scale and get_world_size() > 1:
            loss = _scale_gradient(loss, 1.0 / get_world_size())
    return LossTerms(loss, invariance.detach(), redundancy.detach())
