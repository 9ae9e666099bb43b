"""The Barlow Twins loss: dense and Gram forms against an independent reference, and its invariants."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bt_hub.method.loss as loss_module
from bt_hub.method.loss import barlow_twins_loss, choose_method, standardize

LAMBD = 0.0051
SHAPES = [(8, 48), (64, 16)]  # N < D (Gram is cheaper) and N > D (dense is cheaper)


def off_diagonal(x: torch.Tensor) -> torch.Tensor:
    """facebookresearch/barlowtwins main.py: a flattened view of the off-diagonal elements."""
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


def reference_loss(z1: torch.Tensor, z2: torch.Tensor, lambd: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """facebookresearch/barlowtwins main.py, one process: affine-free BatchNorm1d, C = bn(z1)ᵀ bn(z2) / N."""
    bn = nn.BatchNorm1d(z1.shape[1], affine=False).to(z1.dtype)
    c = bn(z1).T @ bn(z2)
    c.div_(z1.shape[0])
    on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
    off_diag = off_diagonal(c).pow_(2).sum()
    return on_diag + lambd * off_diag, on_diag, off_diag


def _pair(n: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two correlated views, like embeddings of two augmentations of the same images."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(n, d, generator=g) * torch.rand(d, generator=g) * 3 + torch.randn(d, generator=g)
    return shared + 0.5 * torch.randn(n, d, generator=g), shared + 0.5 * torch.randn(n, d, generator=g)


def _loss_and_grads(z_a: torch.Tensor, z_b: torch.Tensor, fn) -> tuple[torch.Tensor, ...]:
    z_a, z_b = z_a.detach().clone().requires_grad_(), z_b.detach().clone().requires_grad_()
    out = fn(z_a, z_b)
    loss = out[0]
    loss.backward()
    return (loss.detach(), *(t.detach() for t in out[1:3]), z_a.grad, z_b.grad)


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal up to ``rel`` times the largest magnitude of ``expected`` (elementwise for gradients)."""
    expected = expected.to(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * expected.abs().max().item())


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_terms_and_gradients_equal_the_reference_formulation(n, d, method):
    z_a, z_b = _pair(n, d)
    ours = _loss_and_grads(z_a, z_b, lambda a, b: barlow_twins_loss(a, b, LAMBD, method))
    # The reference evaluated in float64 on the same float32 values: the exact answer.
    ref = _loss_and_grads(z_a.double(), z_b.double(), lambda a, b: reference_loss(a, b, LAMBD))
    for got, expected in zip(ours, ref):
        _close(got, expected)
    assert ours[0].dtype == torch.float32


@pytest.mark.parametrize("n,d", SHAPES)
def test_gram_loss_and_gradients_equal_dense(n, d):
    z_a, z_b = _pair(n, d, seed=1)
    dense = _loss_and_grads(z_a, z_b, lambda a, b: barlow_twins_loss(a, b, LAMBD, "dense"))
    gram = _loss_and_grads(z_a, z_b, lambda a, b: barlow_twins_loss(a, b, LAMBD, "gram"))
    for got, expected in zip(gram, dense):
        _close(got, expected)


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_is_invariant_to_a_per_dimension_affine_map_of_each_view(method):
    # Guards against mixing the two views' statistics (lightly's loss(x, x) == loss(x, 2x + 4) bug).
    z_a, z_b = _pair(32, 24, seed=2)
    g = torch.Generator().manual_seed(3)
    scale_a, scale_b = 0.5 + 3 * torch.rand(24, generator=g), 0.5 + 3 * torch.rand(24, generator=g)
    shift_a, shift_b = 10 * torch.randn(24, generator=g), 10 * torch.randn(24, generator=g)
    base = barlow_twins_loss(z_a, z_b, LAMBD, method).loss
    moved = barlow_twins_loss(scale_a * z_a + shift_a, scale_b * z_b + shift_b, LAMBD, method).loss
    _close(moved, base, rel=1e-4)
    same = barlow_twins_loss(z_a, z_a, LAMBD, method).loss
    _close(barlow_twins_loss(z_a, 2 * z_a + 4, LAMBD, method).loss, same, rel=1e-4)
    assert barlow_twins_loss(z_a, z_a, LAMBD, method).invariance_term < 1e-4


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_is_symmetric_in_the_two_views(method):
    z_a, z_b = _pair(16, 40, seed=4)
    forward, swapped = barlow_twins_loss(z_a, z_b, LAMBD, method), barlow_twins_loss(z_b, z_a, LAMBD, method)
    for got, expected in zip(swapped, forward):
        _close(got, expected)


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_is_invariant_to_the_order_of_the_batch(method):
    z_a, z_b = _pair(24, 20, seed=5)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    _close(barlow_twins_loss(z_a[perm], z_b[perm], LAMBD, method).loss, barlow_twins_loss(z_a, z_b, LAMBD, method).loss)


def test_shuffling_one_view_only_breaks_the_pairing():
    # Guards against a loss that ignores which rows are paired (e.g. per-view statistics only).
    z_a, z_b = _pair(24, 20, seed=6)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    paired, unpaired = barlow_twins_loss(z_a, z_b).loss, barlow_twins_loss(z_a, z_b[perm]).loss
    assert unpaired > 2 * paired


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["dense", "gram"])
def test_half_precision_input_gives_the_float32_loss(dtype, method):
    # Guards against computing ‖C‖² − Σ C_ii² in half precision, where the subtraction cancels.
    z_a, z_b = (z.to(dtype) for z in _pair(16, 64, seed=7))
    half = _loss_and_grads(z_a, z_b, lambda a, b: barlow_twins_loss(a, b, LAMBD, method))
    full = _loss_and_grads(z_a.float(), z_b.float(), lambda a, b: barlow_twins_loss(a, b, LAMBD, method))
    assert half[0].dtype == torch.float32 and half[3].dtype == dtype
    for got, expected in zip(half[:3], full[:3]):
        _close(got, expected)
    _close(half[3].float(), full[3], rel=1e-2)  # the gradient is rounded back to the input dtype


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_under_cpu_bf16_autocast_is_computed_in_float32(method):
    # Guards against autocast silently running the loss's matmuls in bfloat16.
    torch.manual_seed(0)
    projector = nn.Linear(12, 64)
    x_a, x_b = torch.randn(16, 12), torch.randn(16, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z_a, z_b = projector(x_a), projector(x_b)
        terms = barlow_twins_loss(z_a, z_b, LAMBD, method)
    assert z_a.dtype == torch.bfloat16 and terms.loss.dtype == torch.float32
    exact = barlow_twins_loss(z_a.float(), z_b.float(), LAMBD, "dense")
    for got, expected in zip(terms, exact):
        _close(got, expected)
    terms.loss.backward()
    assert torch.isfinite(projector.weight.grad).all() and projector.weight.grad.abs().sum() > 0


def test_auto_uses_gram_exactly_when_2n_is_below_d(monkeypatch):
    assert choose_method(100, 201) == "gram" and choose_method(100, 200) == "dense"
    calls = []
    for name in ("dense_terms", "gram_terms"):
        original = getattr(loss_module, name)
        monkeypatch.setattr(
            loss_module, name, lambda a, b, n, _f=original, _name=name: calls.append(_name) or _f(a, b, n)
        )
    barlow_twins_loss(*_pair(8, 17))
    barlow_twins_loss(*_pair(8, 16))
    assert calls == ["gram_terms", "dense_terms"]


def test_loss_parts_recombine_with_lambda():
    terms = barlow_twins_loss(*_pair(16, 32, seed=8), lambd=0.3)
    _close(terms.loss, terms.invariance_term + 0.3 * terms.redundancy_term)
    assert not terms.invariance_term.requires_grad and not terms.redundancy_term.requires_grad


@pytest.mark.parametrize(
    "z_a,z_b,kwargs,match",
    [
        (torch.randn(4, 8), torch.randn(4, 9), {}, "N x D"),
        (torch.randn(8), torch.randn(8), {}, "N x D"),
        (torch.randn(4, 8), torch.randn(4, 8), {"method": "fast"}, "method 'fast' is unknown"),
        (torch.randn(1, 8), torch.randn(1, 8), {}, "at least 2"),
    ],
)
def test_bad_shapes_methods_and_batches_raise_value_error(z_a, z_b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        barlow_twins_loss(z_a, z_b, **kwargs)


def test_standardising_in_one_process_sends_nothing_from_the_host_to_the_device(device_traffic):
    # Guards a CUDA sync a view in every training step: the global batch size was made as a tensor on the device
    # (torch.tensor from host data) even without a process group to sum it over. The meta device stands for the GPU.
    z = torch.empty(8, 16, device="meta", requires_grad=True)
    with device_traffic() as seen:
        a, n = standardize(z)
        a.sum().backward()
    assert n == 8 and seen.sent == []
