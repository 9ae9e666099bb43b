"""K linear heads trained at once on fixed features (DINOv2's linear evaluation), and the grid probe that picks one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bt_hub.common.progress import progress as reported
from bt_hub.eval.classifier import distributed_sampler_permutation, lr_factor, make_classifier, topk_hits
from bt_hub.eval.features import as_float32
from bt_hub.eval.splits import indices_sha256, stratified_holdout

# The default grid: 6 learning rates x 2 weight decays = 12 heads (lr per batch of --batch-size features).
GRID_LRS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
GRID_WEIGHT_DECAYS = (0.0, 1e-3)
MAX_LR = 100.0  # larger LRs only overflow a linear classifier
MAX_EPOCHS = 100_000
# train_heads' softmax probabilities below this count as 0: subnormal floats slow x86 arithmetic ~10x
TINY_PROBABILITY = 2.0**-100


class NonFiniteLoss(ValueError):
    """The training loss of a linear head became NaN or inf."""


@dataclass
class LinearHeads:
    """K linear classifiers over the same features (``weight`` K x C x D); ``diverged[k]``: the epoch head k stopped."""

    weight: torch.Tensor
    bias: torch.Tensor
    lrs: list[float]
    weight_decays: list[float]
    diverged: list[int | None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """N x K x C logits of every head: one matrix product for all of them."""
        k, c, d = self.weight.shape
        return (x @ self.weight.reshape(k * c, d).T + self.bias.reshape(-1)).view(len(x), k, c)


def _feature_rows(features: torch.Tensor | np.ndarray, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``idx`` of a tensor or a (memory-mapped) array as float32 on ``device`` (arrays: ``idx`` sorted)."""
    if isinstance(features, torch.Tensor):
        return features[idx.to(features.device)].float().to(device)
    return torch.from_numpy(np.asarray(features[idx.numpy()], dtype=np.float32)).to(device)


def train_heads(
    features: torch.Tensor | np.ndarray, labels: torch.Tensor, num_classes: int, **hyper: Any
) -> LinearHeads:
    """Train one linear head per ``(lrs[k], weight_decays[k])`` at once on fixed features (optionally ``rows`` only).

    Each head equals the paper's classifier as ``train_classifier`` trains it with that LR (to float32
    rounding); a head that becomes non-finite goes back to where that epoch started and stops (``diverged``).
    The keywords are :func:`train_head_sets`'.
    """
    return train_head_sets([features], labels, num_classes, **hyper)[0]


def train_head_sets(
    feature_sets: Sequence[torch.Tensor | np.ndarray],
    labels: torch.Tensor,
    num_classes: int,
    *,
    lrs: Sequence[float],
    weight_decays: Sequence[float],
    epochs: int,
    batch_size: int = 256,
    momentum: float = 0.9,
    schedule: str = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    seed: int = 0,
    rows: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "linear heads",
) -> list[LinearHeads]:
    """:func:`train_heads` on several sets of features of one width for the same images and labels (the rows of a
    learning curve), each set's heads as that function trains them on it alone (within a few float32 ulps: a batched
    product is not bit-exact on every CPU; the same divergence), all in
    one batched product per step: on a GPU, where a step's cost is its kernel launches, S sets cost about one."""
    if len(lrs) != len(weight_decays) or not lrs:
        raise ValueError(
            f"lrs and weight_decays must be equally long and not empty, got {len(lrs)} and {len(weight_decays)}"
        )
    first = feature_sets[0]
    if device is None:
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    pool = torch.arange(len(labels)) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
    torch.manual_seed(seed)
    fc = make_classifier(first.shape[1], num_classes)
    s, k, c, d = len(feature_sets), len(lrs), num_classes, first.shape[1]
    # every head's weight with its bias as an extra column, S x K*C x (D+1), one buffer per state (parameters,
    # gradients, momentum), so that x with a column of ones gives both in one product each way
    params = torch.cat([fc.weight.detach(), fc.bias.detach()[:, None]], 1).repeat(s, k, 1).to(device)
    grads, velocity, epoch_start = torch.empty_like(params), torch.zeros_like(params), torch.empty_like(params)
    lr_list, wd_list = [float(v) for v in lrs], [float(v) for v in weight_decays]
    heads = [LinearHeads(p[:, :d].view(k, c, d), p[:, d].view(k, c), lr_list, wd_list, [None] * k) for p in params]
    # the same buffers with one row per head, for the per-head LR and weight decay (S*K x 1)
    head_params, head_grads, head_velocity = params.view(s * k, -1), grads.view(s * k, -1), velocity.view(s * k, -1)
    decay, base_lr = (torch.tensor(v * s, device=device)[:, None] for v in (wd_list, lr_list))
    alive = torch.ones(s * k, 1, dtype=torch.bool, device=device)
    classes = torch.arange(c, device=device)[:, None]
    rows_with_one = torch.ones(s, batch_size, d + 1, device=device)  # each set's batch of features and a column of ones
    moved = [_on_device(f, labels.long().cpu(), device) for f in feature_sets]
    features, y = [f for f, _ in moved], moved[0][1]
    for epoch in reported(range(epochs), desc, unit="epoch") if progress else range(epochs):
        step = base_lr * lr_factor(epoch, epochs, schedule, milestones, gamma) * alive
        epoch_start.copy_(params)
        order = pool[distributed_sampler_permutation(len(pool), seed, epoch)].to(y.device)
        for start in range(0, len(order), batch_size):
            # rows in file order: quick to read from a memmap, and the same sums (so the same heads) as a tensor
            idx = order[start : start + batch_size].sort().values
            x = rows_with_one[:, : len(idx)]
            for f, out in zip(features, x):
                _copy_feature_rows(f, idx, out[:, :d])
            _cross_entropy_gradient(params, x, y[idx].to(device), classes, out=grads)
            # SGD with momentum and weight decay as torch.optim.SGD: v = mu v + (grad + wd w); w -= lr v
            head_grads.addcmul_(head_params, decay)
            torch.add(grads, velocity, alpha=momentum, out=velocity)
            head_params.addcmul_(head_velocity, step, value=-1)
        _stop_diverged(heads, epoch, alive, head_params, head_velocity, epoch_start)
    return heads


def _on_device(
    features: torch.Tensor | np.ndarray, labels: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
    """The features (as float32) and labels moved once to a CUDA ``device`` where they take under a quarter of its
    free memory, so that each step gathers its rows there: read from the host, every step of a 100-epoch grid
    waits for a copy (the time of a learning curve's cells on a GPU). Elsewhere, as they are."""
    if device.type != "cuda" or 4 * len(labels) * features.shape[1] > torch.cuda.mem_get_info(device)[0] // 4:
        return features, labels
    return as_float32(features).to(device), labels.to(device)


def _cross_entropy_gradient(
    params: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, classes: torch.Tensor, out: torch.Tensor
) -> None:
    """Write every head's mean cross-entropy gradient on each set's ``x`` (S x N x D+1) into ``out`` (S x K*C x D+1).

    Probabilities below TINY_PROBABILITY become 0, so that no subnormal float slows the products.
    """
    n = x.shape[1]
    logits = torch.bmm(params, x.transpose(1, 2)).view(-1, len(classes), n)
    g = torch.maximum(logits, logits.amax(1, keepdim=True) - 70.0).softmax(1)
    F.threshold(g, TINY_PROBABILITY, 0.0, inplace=True)
    g.sub_((targets == classes).float()).mul_(1 / n)  # the C x N one-hot, broadcast over heads
    torch.bmm(g.view(len(x), -1, n), x, out=out)


def _stop_diverged(
    heads: list[LinearHeads],
    epoch: int,
    alive: torch.Tensor,
    head_params: torch.Tensor,
    head_velocity: torch.Tensor,
    epoch_start: torch.Tensor,
) -> None:
    """Put each head whose weights became non-finite back to where ``epoch`` started, and stop training it."""
    finite = torch.isfinite(head_params).all(1, keepdim=True)
    if bool(finite.all()):
        return
    back, k = ~finite.flatten(), len(heads[0].lrs)
    for h in back.nonzero().flatten().tolist():
        if heads[h // k].diverged[h % k] is None:
            heads[h // k].diverged[h % k] = epoch
    alive &= finite
    head_params[back] = epoch_start.view_as(head_params)[back]
    head_velocity[back] = 0


def _copy_feature_rows(features: torch.Tensor | np.ndarray, idx: torch.Tensor, out: torch.Tensor) -> None:
    """Write rows ``idx`` of the features into ``out`` (a float32 tensor that may be strided) in one copy."""
    if isinstance(features, torch.Tensor) and features.dtype == out.dtype and features.device == out.device:
        torch.index_select(features, 0, idx.to(features.device), out=out)
    else:
        out.copy_(_feature_rows(features, idx, out.device))


@torch.no_grad()
def score_heads(
    heads: LinearHeads,
    features: torch.Tensor | np.ndarray,
    labels: torch.Tensor,
    batch_size: int = 4096,
    hits: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """Per head: ``top1`` / ``top5`` accuracy (percent) and the mean cross-entropy ``loss`` on fixed features;
    ``hits`` (N x heads booleans): whether each image's top-1 was right, written there."""
    k = heads.weight.shape[0]
    device = heads.weight.device
    correct, loss = torch.zeros(k, 2), torch.zeros(k, dtype=torch.float64)
    n = len(labels)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(start + batch_size, n))
        logits, targets = heads.logits(_feature_rows(features, idx, device)), labels[idx].long().to(device)
        for h in range(k):
            found = topk_hits(logits[:, h], targets).cpu()
            correct[h] += found.sum(0).float()
            if hits is not None:
                hits[idx, h] = found[:, 0]
        loss += F.cross_entropy(logits.permute(0, 2, 1), targets[:, None].expand(-1, k), reduction="none").sum(0).cpu()
    return [
        {"top1": 100.0 * float(correct[h, 0]) / n, "top5": 100.0 * float(correct[h, 1]) / n, "loss": float(loss[h]) / n}
        for h in range(k)
    ]


def grid_probe(
    train_x: torch.Tensor | np.ndarray,
    train_y: torch.Tensor,
    test_x: torch.Tensor | np.ndarray,
    test_y: torch.Tensor,
    num_classes: int,
    **settings: Any,
) -> dict[str, Any]:
    """The linear probe with its LR and weight decay chosen on a validation split carved from the training data.

    The best head on a seeded, class-stratified ``val_fraction`` (ties: lower loss, then grid order) is scored
    on the test features; returns ``metrics``, ``correct`` (per test image, whether its top-1 was right), ``chosen``,
    ``grid`` and ``validation``. NonFiniteLoss when all diverge.
    The keywords are :func:`grid_probes`'.
    """
    return grid_probes([train_x], train_y, [test_x], test_y, num_classes, **settings)[0]


def grid_probes(
    train_sets: Sequence[torch.Tensor | np.ndarray],
    train_y: torch.Tensor,
    test_sets: Sequence[torch.Tensor | np.ndarray],
    test_y: torch.Tensor,
    num_classes: int,
    *,
    lrs: Sequence[float] = GRID_LRS,
    weight_decays: Sequence[float] = GRID_WEIGHT_DECAYS,
    val_fraction: float = 0.2,
    seed: int = 0,
    **hyper: Any,
) -> list[dict[str, Any]]:
    """:func:`grid_probe` of each of several feature sets of one width for the same images, their grids trained
    together (:func:`train_head_sets`): one result a set, each what ``grid_probe`` finds on it alone."""
    pairs = [(lr, wd) for wd in weight_decays for lr in lrs]
    fit_rows, val_rows = stratified_holdout(np.asarray(train_y), val_fraction, seed)
    if not val_rows:
        raise ValueError(
            f"the {len(fit_rows)} training images hold at most one per class, so the grid has no validation split to "
            "choose on; pass --search fixed (the preset's recipe) or label more images"
        )
    head_sets = train_head_sets(
        train_sets,
        train_y,
        num_classes,
        lrs=[p[0] for p in pairs],
        weight_decays=[p[1] for p in pairs],
        seed=seed,
        rows=fit_rows,
        **hyper,
    )
    val_idx = torch.as_tensor(val_rows, dtype=torch.long)
    found = []
    for heads, train_x, test_x in zip(head_sets, train_sets, test_sets):
        val_x = train_x[val_idx] if isinstance(train_x, torch.Tensor) else np.asarray(train_x[val_rows], np.float32)
        grid = _grid_rows(pairs, score_heads(heads, val_x, train_y[val_idx]), heads.diverged)
        usable = [h for h, row in enumerate(grid) if row["val_top1"] is not None]
        if not usable:
            raise NonFiniteLoss(
                f"every head of the linear grid diverged (lr {', '.join(f'{lr:g}' for lr in lrs)}); "
                "give smaller --lr-grid values"
            )
        best = min(usable, key=lambda h: (-grid[h]["val_top1"], grid[h]["val_loss"], h))
        lr, wd = pairs[best]
        chosen = LinearHeads(heads.weight[best : best + 1], heads.bias[best : best + 1], [lr], [wd], [None])
        hits = torch.zeros(len(test_y), 1, dtype=torch.bool)
        test = score_heads(chosen, test_x, test_y, hits=hits)[0]
        found.append(
            {
                "metrics": {"top1": test["top1"], "top5": test["top5"]},
                "correct": hits[:, 0].numpy(),
                "chosen": {"lr": lr, "weight_decay": wd, "val_top1": grid[best]["val_top1"]},
                "grid": grid,
                "validation": {
                    "fraction": val_fraction,
                    "seed": seed,
                    "source_split": "train",
                    "train_size": len(fit_rows),
                    "val_size": len(val_rows),
                    "val_indices_sha256": indices_sha256(val_rows),
                    "refit": "none: the chosen head as trained on the rest of the training split",
                },
            }
        )
    return found


def _grid_rows(
    pairs: list[tuple[float, float]], scores: list[dict[str, float]], diverged: list[int | None]
) -> list[dict[str, Any]]:
    """Each head's lr, weight decay, validation top-1 and loss (None for a diverged head) and divergence epoch."""
    grid = []
    for (lr, wd), score, epoch in zip(pairs, scores, diverged):
        ok = epoch is None and math.isfinite(score["loss"])
        grid.append(
            {
                "lr": lr,
                "weight_decay": wd,
                "val_top1": score["top1"] if ok else None,
                "val_loss": score["loss"] if ok else None,
                "diverged_epoch": epoch,
            }
        )
    return grid
