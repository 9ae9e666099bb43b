"""The two asymmetric Barlow Twins views, drawn per image for the PIL and the batched tensor paths.

BYOL's parameters (docs/protocols.md §1), as the reference ``Transform`` of barlowtwins' main.py:
``VIEW_A`` always blurs and never solarises, ``VIEW_B`` blurs with p = 0.1 and solarises with p = 0.2.

Every random choice is drawn per image by :func:`sample_view_params`, which both paths share, in a
fixed number and order of draws: :class:`TwoViewTransform` (PIL, in data-loader workers, the reference
pipeline's operations) and :class:`BatchedTwoViews` (whole batches on the training device, no Python loop
over samples). Both take an optional ``torch.Generator``, so that a loader can seed each sample from
``(seed, epoch, index)`` and a resumed run draws the same views. Pretraining draws the batched views' parameters
on the host: with the images each per-image op takes, found there, they reach the device in one copy, and
making the views never waits for the device (no ``nonzero``, no copy from pageable memory, no constant made
again each batch: each of these was a CUDA sync, about 90 a step).

Order of operations, as in the reference: RandomResizedCrop (torchvision's algorithm: the first of 10
valid tries, else a centre crop), horizontal flip, ColorJitter (brightness, contrast, saturation, hue,
in a random order per image), grayscale, Gaussian blur, solarise, ImageNet normalisation.

Where the tensor path differs from the PIL one (the views are alike, not equal pixel for pixel):

- the crop is resampled by ``roi_align`` (bilinear, averaging ``ceil(crop / size)²`` samples per output
  pixel when shrinking) instead of PIL's antialiased bicubic filter;
- intermediate values stay float in [0, 1]: PIL rounds to uint8 after every operation;
- grayscale weighs RGB by ``GRAY_WEIGHTS`` (torchvision's 0.2989, 0.587, 0.114), PIL by its 299/587/114
  integer luma; solarise inverts values >= 0.5, PIL values >= 128;
- a list of images of different sizes is first cut to the region the two views read (with a one-pixel
  margin where the image has one) and padded into one uint8 batch whose extra row and column repeat the
  last ones, so that ``roi_align`` reads no zero (:func:`crop_to_views`).

In both paths the blur kernel is odd and about a tenth of the output side (23 px at 224, as BYOL), at
least 3 px, with σ ~ U(0.1, 2.0) in output pixels; the reference's PIL ``GaussianBlur(σ)`` sizes its
kernel from σ instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf
import torchvision.transforms.v2.functional as F
from PIL import Image
from torchvision.ops import roi_align

from bt_hub.common.images import to_rgb
from bt_hub.method.transforms import constant, normalize

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)
CROP_ATTEMPTS = 10


@dataclass(frozen=True)
class ViewParams:
    """Probabilities and ranges of one view's augmentations."""

    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p: float = 1.0
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_p: float = 0.0
    solarize_threshold: float = 0.5  # 128 on the uint8 scale


#                 flip  jitter  gray  blur  solarise   (side by side: the asymmetry)
VIEW_A = ViewParams(flip_p=0.5, jitter_p=0.8, grayscale_p=0.2, blur_p=1.0, solarize_p=0.0)
VIEW_B = ViewParams(flip_p=0.5, jitter_p=0.8, grayscale_p=0.2, blur_p=0.1, solarize_p=0.2)


def blur_kernel_size(size: int) -> int:
    """Odd Gaussian kernel of about a tenth of the output size (23 at 224), at least 3."""
    return max(3, int(0.1 * size) // 2 * 2 + 1)


def _crop_boxes(
    batch_size: int,
    height: int | torch.Tensor,
    width: int | torch.Tensor,
    view: ViewParams,
    generator: torch.Generator | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """RandomResizedCrop boxes, torchvision's algorithm vectorised: first of 10 valid tries, else centre."""
    shape = (batch_size, CROP_ATTEMPTS)
    u_area, u_ratio, u_top, u_left = torch.rand((4, *shape), generator=generator, device=device, dtype=torch.float64)
    height, width = (torch.as_tensor(v, device=device).to(torch.float64).expand(batch_size) for v in (height, width))
    rows, cols = height[:, None], width[:, None]
    lo, hi = view.crop_scale
    area = rows * cols * (lo + (hi - lo) * u_area)
    log_lo, log_hi = math.log(view.crop_ratio[0]), math.log(view.crop_ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    valid = (w > 0) & (w <= cols) & (h > 0) & (h <= rows)
    top = torch.floor(u_top * (rows - h + 1))
    left = torch.floor(u_left * (cols - w + 1))
    first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)
    pick = [t.gather(1, first).squeeze(1) for t in (top, left, h, w)]

    # the centre crop of the largest box whose aspect ratio is inside crop_ratio (torchvision's fallback)
    in_ratio = width / height
    too_tall, too_wide = in_ratio < view.crop_ratio[0], in_ratio > view.crop_ratio[1]
    fw = torch.where(too_wide, torch.round(height * view.crop_ratio[1]), width)
    fh = torch.where(too_tall, torch.round(width / view.crop_ratio[0]), height)
    fallback = (
        torch.div(height - fh, 2, rounding_mode="floor"),
        torch.div(width - fw, 2, rounding_mode="floor"),
        fh,
        fw,
    )
    found = valid.any(dim=1)
    top, left, h, w = (torch.where(found, p, f).long() for p, f in zip(pick, fallback))
    return {"top": top, "left": left, "height": h, "width": w}


def sample_view_params(
    batch_size: int,
    view: ViewParams,
    generator: torch.Generator | None = None,
    height: int | torch.Tensor = 224,
    width: int | torch.Tensor = 224,
) -> dict[str, torch.Tensor]:
    """Draw every random choice of one view for ``batch_size`` images of height x width (ints or per-image tensors).

    The number and order of draws is fixed, so a generator state determines the result. Returns (batch_size,)
    tensors: crop ``top``, ``left``, ``height``, ``width``; the ``flip``, ``jitter``, ``grayscale``, ``blur``
    and ``solarize`` flags; jitter factors (``hue`` a shift in turns); blur ``sigma``; and ``jitter_order``
    (batch_size x 4, a permutation of brightness, contrast, saturation, hue).
    """
    device = generator.device if generator is not None else torch.device("cpu")
    params = _crop_boxes(batch_size, height, width, view, generator, device)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device)

    params["flip"] = uniform(batch_size) < view.flip_p
    params["jitter"] = uniform(batch_size) < view.jitter_p
    u = uniform(batch_size, 4)
    for i, name in enumerate(("brightness", "contrast", "saturation")):  # factors in [1 - s, 1 + s]
        params[name] = 1 - getattr(view, name) + 2 * getattr(view, name) * u[:, i]
    params["hue"] = -view.hue + 2 * view.hue * u[:, 3]
    params["jitter_order"] = torch.argsort(uniform(batch_size, 4), dim=1)
    params["grayscale"] = uniform(batch_size) < view.grayscale_p
    params["blur"] = uniform(batch_size) < view.blur_p
    lo, hi = view.blur_sigma
    params["sigma"] = lo + (hi - lo) * uniform(batch_size)
    params["solarize"] = uniform(batch_size) < view.solarize_p
    return params


# ---------------------------------------------------------------- PIL path (data loaders)


def apply_view_pil(img: Image.Image, p: dict[str, torch.Tensor], size: int, view: ViewParams = VIEW_A) -> torch.Tensor:
    """One view (3 x size x size, normalised) of one RGB PIL image from parameters drawn for a batch of 1."""
    box = [int(p[k][0]) for k in ("top", "left", "height", "width")]
    out = F.resized_crop(img, *box, [size, size], interpolation=F.InterpolationMode.BICUBIC, antialias=True)
    if p["flip"][0]:
        out = F.horizontal_flip(out)
    if p["jitter"][0]:
        ops = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
        keys = ("brightness", "contrast", "saturation", "hue")
        for op_index in p["jitter_order"][0].tolist():
            out = ops[op_index](out, float(p[keys[op_index]][0]))
    if p["grayscale"][0]:
        out = F.rgb_to_grayscale(out, num_output_channels=3)
    if p["blur"][0]:
        k, sigma = blur_kernel_size(size), float(p["sigma"][0])
        out = F.gaussian_blur(out, [k, k], [sigma, sigma])
    if p["solarize"][0]:
        out = F.solarize(out, threshold=round(255 * view.solarize_threshold))
    return normalize(F.pil_to_tensor(out).float().div_(255))


class _TwoViews:
    """The output side and the two views' parameters, shared by the PIL and the batched paths."""

    def __init__(self, size: int = 224, views: tuple[ViewParams, ViewParams] = (VIEW_A, VIEW_B)) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self.views = views


class TwoViewTransform(_TwoViews):
    """PIL image -> (view A, view B), float 3 x size x size, normalised."""

    def sample(self, height: int, width: int, generator: torch.Generator | None = None) -> tuple[dict, dict]:
        """Both views' parameters for one image of height x width (what ``__call__`` draws)."""
        return tuple(sample_view_params(1, v, generator, height, width) for v in self.views)

    def __call__(self, img: Image.Image, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Two views of ``img`` (any PIL mode; grayscale is replicated to RGB)."""
        if not isinstance(img, Image.Image):
            raise TypeError(f"TwoViewTransform expects a PIL image, got {type(img).__name__}")
        img = to_rgb(img)
        params = self.sample(img.height, img.width, generator)
        return tuple(apply_view_pil(img, p, self.size, v) for p, v in zip(params, self.views))


# ---------------------------------------------------------------- tensor path (training device)


def _gray(x: torch.Tensor) -> torch.Tensor:
    w = constant(GRAY_WEIGHTS, x.device, x.dtype).view(1, 3, 1, 1)
    return (x * w).sum(dim=1, keepdim=True)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * other).clamp_(0, 1)


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(dim=1)
    maxc, minc = x.amax(dim=1), x.amin(dim=1)
    delta = maxc - minc
    s = delta / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    safe = torch.where(delta == 0, torch.ones_like(delta), delta)
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    h = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2 + rc - bc, 4 + gc - rc))
    h = torch.where(delta == 0, torch.zeros_like(h), (h / 6) % 1)
    return torch.stack((h, s, maxc), dim=1)


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """Channel n of RGB is v − v·s·clamp(min(k, 4 − k), 0, 1) with k = (n + 6h) mod 6, n = 5, 3, 1."""
    h, s, v = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    k = (constant((5.0, 3.0, 1.0), x.device, x.dtype).view(1, 3, 1, 1) + 6 * h) % 6
    return v - v * s * torch.minimum(k, 4 - k).clamp_(0, 1)


def _adjust(x: torch.Tensor, op: int, factor: torch.Tensor) -> torch.Tensor:
    """ColorJitter's op ``op`` (0 brightness, 1 contrast, 2 saturation, 3 hue) with per-image factors."""
    if op == 0:
        return _blend(x, torch.zeros_like(x), factor)
    if op == 1:
        return _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), factor)
    if op == 2:
        return _blend(x, _gray(x), factor)
    hsv = _rgb_to_hsv(x)
    hsv[:, 0] = (hsv[:, 0] + factor.view(-1, 1, 1)) % 1
    return _hsv_to_rgb(hsv)


def _color_jitter(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each jittered image gets its four ops in its own order; one subset call per (position, op)."""
    factors = torch.stack((p["brightness"], p["contrast"], p["saturation"], p["hue"]), dim=1)
    x = x.clone()
    for position in range(4):
        for op in range(4):
            idx = p[f"jitter_{position}{op}"]
            if idx.numel():
                x[idx] = _adjust(x[idx], op, factors[idx, op])
    return x


def _subsets(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The images each per-image op takes: colour-jitter op ``o`` at position ``i`` (``jitter_io``) and the blur."""
    masks = {f"jitter_{i}{o}": p["jitter"] & (p["jitter_order"][:, i] == o) for i in range(4) for o in range(4)}
    return {k: torch.nonzero(m).squeeze(1) for k, m in (masks | {"blur_rows": p["blur"]}).items()}


def _on_device(params: Sequence[dict[str, torch.Tensor]], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The views' parameters with their op subsets (found where they were drawn: on the host, no device sync), on
    ``device`` in one copy (page-locked and asynchronous on CUDA) instead of one synchronising copy a parameter."""
    params = [p | _subsets(p) for p in params]
    # as bytes, widest types first, so that each part starts where its type can be viewed again
    entries = sorted(((p[k].itemsize, i, k) for i, p in enumerate(params) for k in p), reverse=True)
    parts = [params[i][k].reshape(-1).view(torch.uint8) for _, i, k in entries]
    packed = torch.cat(parts)
    if packed.device.type == "cpu" and device.type == "cuda":
        packed = packed.pin_memory()
    moved = packed.to(device, non_blocking=True)
    out: list[dict[str, torch.Tensor]] = [dict.fromkeys(p) for p in params]  # type: ignore[misc]
    for (_, i, k), part in zip(entries, moved.split([len(part) for part in parts])):
        out[i][k] = part.view(params[i][k].dtype).view(params[i][k].shape)
    return out


def _gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Separable Gaussian blur with a per-image σ (reflect padding, as torchvision)."""
    b, c, h, w = x.shape
    half = (kernel_size - 1) / 2
    t = torch.linspace(-half, half, kernel_size, device=x.device, dtype=x.dtype)
    k = torch.exp(-0.5 * (t[None] / sigma[:, None]) ** 2)
    k = (k / k.sum(dim=1, keepdim=True)).repeat_interleave(c, dim=0)  # (b*c) x k
    pad = kernel_size // 2
    y = nnf.pad(x.reshape(1, b * c, h, w), (pad, pad, pad, pad), mode="reflect")
    y = nnf.conv2d(y, k[:, None, None, :], groups=b * c)
    y = nnf.conv2d(y, k[:, None, :, None], groups=b * c)
    return y.reshape(b, c, h, w)


def apply_view(images: torch.Tensor, p: dict[str, torch.Tensor], size: int, view: ViewParams = VIEW_A) -> torch.Tensor:
    """One view of a batch (float B x 3 x H x W in [0, 1]) from drawn parameters; normalised."""
    return _apply(images, _on_device([p], images.device)[0], size, view)


def _apply(images: torch.Tensor, p: dict[str, torch.Tensor], size: int, view: ViewParams) -> torch.Tensor:
    top, left = p["top"].to(images.dtype), p["left"].to(images.dtype)
    boxes = torch.stack(
        (
            torch.arange(len(top), device=images.device, dtype=images.dtype),
            left,
            top,
            left + p["width"],
            top + p["height"],
        ),
        dim=1,
    )
    x = roi_align(images, boxes, output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    x = torch.where(p["flip"].view(-1, 1, 1, 1), x.flip(-1), x)
    x = _color_jitter(x, p)
    x = torch.where(p["grayscale"].view(-1, 1, 1, 1), _gray(x).expand_as(x), x)
    idx = p["blur_rows"]
    if idx.numel():
        x[idx] = _gaussian_blur(x[idx], p["sigma"][idx].to(x.dtype), blur_kernel_size(size))
    x = torch.where(p["solarize"].view(-1, 1, 1, 1) & (x >= view.solarize_threshold), 1 - x, x)
    return normalize(x)


def to_float_rgb(images: torch.Tensor) -> torch.Tensor:
    """B x C x H x W uint8 (0..255) or float (0..1), C = 1 or 3 -> float32 RGB in [0, 1]."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be B x C x H x W with C = 1 or 3, got shape {tuple(images.shape)}")
    x = images.float().div(255) if images.dtype == torch.uint8 else images.float()
    return x.expand(-1, 3, -1, -1).contiguous() if x.shape[1] == 1 else x.contiguous()


def crop_to_views(
    images: Sequence[torch.Tensor], params: Sequence[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Images of different sizes -> one padded uint8 batch of the regions the views read, and the shifted boxes."""
    heights = torch.tensor([im.shape[-2] for im in images])
    widths = torch.tensor([im.shape[-1] for im in images])
    top = torch.stack([p["top"] for p in params]).amin(0).sub(1).clamp_min(0)
    left = torch.stack([p["left"] for p in params]).amin(0).sub(1).clamp_min(0)
    bottom = torch.minimum(torch.stack([p["top"] + p["height"] for p in params]).amax(0) + 1, heights)
    right = torch.minimum(torch.stack([p["left"] + p["width"] for p in params]).amax(0) + 1, widths)
    rows, cols = bottom - top, right - left
    batch = images[0].new_zeros((len(images), 3, int(rows.max()) + 1, int(cols.max()) + 1))
    for i, (im, y0, y1, x0, x1) in enumerate(zip(images, top.tolist(), bottom.tolist(), left.tolist(), right.tolist())):
        batch[i, :, : y1 - y0, : x1 - x0] = im[:, y0:y1, x0:x1]  # a 1-channel image broadcasts to RGB
    index = torch.arange(len(images), device=batch.device)
    rows_d, cols_d = rows.to(batch.device), cols.to(batch.device)
    batch[index, :, :, cols_d] = batch[index, :, :, cols_d - 1]
    batch[index, :, rows_d, :] = batch[index, :, rows_d - 1, :]
    shifted = [dict(p, top=p["top"] - top, left=p["left"] - left) for p in params]
    return batch, shifted


class BatchedTwoViews(_TwoViews):
    """Batch of images on any device (a tensor, or a list of uint8 images of different sizes) -> (views A, views B)."""

    def sample(
        self,
        batch_size: int,
        height: int | torch.Tensor,
        width: int | torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[dict, dict]:
        """Both views' parameters for a batch (what ``__call__`` draws); sizes are ints or one per image."""
        return tuple(sample_view_params(batch_size, v, generator, height, width) for v in self.views)

    def __call__(
        self, images: torch.Tensor | Sequence[torch.Tensor], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two normalised float32 views, B x 3 x size x size, on the images' device."""
        if isinstance(images, torch.Tensor):
            x = to_float_rgb(images)
            params = self.sample(x.shape[0], x.shape[2], x.shape[3], generator)
        else:
            if not images:
                raise ValueError("BatchedTwoViews needs at least one image")
            heights = torch.tensor([im.shape[-2] for im in images])
            widths = torch.tensor([im.shape[-1] for im in images])
            drawn = [{k: v.cpu() for k, v in p.items()} for p in self.sample(len(images), heights, widths, generator)]
            # one size (JPEGs of one camera): one batch, no crops
            one_size = len({tuple(im.shape) for im in images}) == 1
            batch, params = (torch.stack(list(images)), drawn) if one_size else crop_to_views(images, drawn)
            x = to_float_rgb(batch)
        return tuple(_apply(x, p, self.size, v) for p, v in zip(_on_device(params, x.device), self.views))
