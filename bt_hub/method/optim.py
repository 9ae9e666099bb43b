"""LARS, its two parameter groups and the per-step learning-rate schedule (docs/protocols.md §1).

Ten steps with the Barlow Twins loss are held to the official main.py in tests/test_against_reference.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def excluded_from_adaptation(p: torch.Tensor) -> bool:
    """True for biases and BatchNorm parameters (``ndim == 1``): no weight decay, no LARS."""
    return p.ndim == 1


def trust_ratio(param_norm: torch.Tensor, update_norm: torch.Tensor, eta: float) -> torch.Tensor:
    """η‖p‖ / ‖g + wd·p‖, or 1 when either norm is 0."""
    one = torch.ones_like(param_norm)
    ratio = torch.where(
        update_norm > 0, eta * param_norm / update_norm.clamp_min(torch.finfo(update_norm.dtype).tiny), one
    )
    return torch.where(param_norm > 0, ratio, one)


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You et al., 2017) as in the reference code: momentum without
    Nesterov, trust ratio ``eta`` ‖p‖ / ‖g + wd·p‖ (1 when either norm is 0).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.0,
        weight_decay: float = 1e-6,
        momentum: float = 0.9,
        eta: float = 0.001,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or eta <= 0:
            raise ValueError(
                "LARS needs lr >= 0, weight_decay >= 0, 0 <= momentum < 1 and eta > 0; "
                f"got {lr}, {weight_decay}, {momentum}, {eta}"
            )
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eta=eta))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update: p ← p − lr · μ, μ ← momentum · μ + trust · (g + wd · p), a group's tensors at once.

        The update is formed in ``p.grad`` (which holds it afterwards), so a step allocates no weight-sized
        tensor: the same arithmetic as the reference loop, bit for bit, without its two copies of each weight.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            adapted = [(p, g) for p, g in zip(params, grads) if not excluded_from_adaptation(p)]
            if adapted:
                weights, updates = (list(t) for t in zip(*adapted))
                torch._foreach_add_(updates, weights, alpha=group["weight_decay"])
                norms = torch.stack(torch._foreach_norm(weights)), torch.stack(torch._foreach_norm(updates))
                torch._foreach_mul_(updates, list(trust_ratio(*norms, group["eta"]).unbind()))
            for p in params:
                if "mu" not in self.state[p]:
                    self.state[p]["mu"] = torch.zeros_like(p)
            momenta = [self.state[p]["mu"] for p in params]
            torch._foreach_mul_(momenta, group["momentum"])
            torch._foreach_add_(momenta, grads)
            torch._foreach_add_(params, momenta, alpha=-group["lr"])
        return loss


def param_groups(
    model: nn.Module, lr_weights: float, lr_biases: float, weight_decay: float = 1e-6
) -> list[dict[str, Any]]:
    """Two groups split by ``ndim``: weights (index 0) and biases/BN (index 1, weight decay 0)."""
    weights = [p for p in model.parameters() if p.requires_grad and not excluded_from_adaptation(p)]
    biases = [p for p in model.parameters() if p.requires_grad and excluded_from_adaptation(p)]
    return [
        {"params": weights, "base_lr": lr_weights, "weight_decay": weight_decay, "name": "weights"},
        {"params": biases, "base_lr": lr_biases, "weight_decay": 0.0, "name": "biases"},
    ]


def lr_at_step(step: int, total_steps: int, warmup_steps: int, base_lr: float, final_factor: float = 0.001) -> float:
    """Linear warm-up from 0 over ``warmup_steps``, then cosine from ``base_lr`` to ``base_lr × final_factor``."""
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    q = 0.5 * (1 + math.cos(math.pi * min(step - warmup_steps, decay_steps) / decay_steps))
    end_lr = base_lr * final_factor
    return base_lr * q + end_lr * (1 - q)


def scaled_lr(base_lr: float, batch_size: int) -> float:
    """The linear scaling rule of the recipe: ``base_lr × batch_size / 256``."""
    return base_lr * batch_size / 256


def set_learning_rates(
    optimizer: torch.optim.Optimizer, step: int, total_steps: int, warmup_steps: int, batch_size: int
) -> list[float]:
    """Set every group's ``lr`` from its ``base_lr`` for this step; return the rates set."""
    rates = []
    for group in optimizer.param_groups:
        group["lr"] = lr_at_step(step, total_steps, warmup_steps, scaled_lr(group["base_lr"], batch_size))
        rates.append(group["lr"])
    return rates
