"""The two asymmetric views: the table's frequencies, per-image randomness, both paths."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image

from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD
from bt_hub.method.views import (
    VIEW_A,
    VIEW_B,
    BatchedTwoViews,
    TwoViewTransform,
    apply_view,
    apply_view_pil,
    blur_kernel_size,
    sample_view_params,
)

DRAWS = 2000
DECISIONS = {
    "flip": "flip_p",
    "jitter": "jitter_p",
    "grayscale": "grayscale_p",
    "blur": "blur_p",
    "solarize": "solarize_p",
}


def _unnormalize(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return x * std + mean


def _smooth_image(seed: int, size: int = 48) -> Image.Image:
    """A colourful image with structure at several scales (cheap, deterministic)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 6, 6, generator=g)
    fine = 0.2 * torch.rand(1, 3, size, size, generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear") * 0.8 + fine
    return Image.fromarray((x[0].permute(1, 2, 0).clamp(0, 1) * 255).round().byte().numpy())


def test_view_tables_are_the_protocol_table():
    assert (VIEW_A.blur_p, VIEW_B.blur_p) == (1.0, 0.1)
    assert (VIEW_A.solarize_p, VIEW_B.solarize_p) == (0.0, 0.2)
    for view in (VIEW_A, VIEW_B):
        assert view.crop_scale == (0.08, 1.0) and view.crop_ratio == pytest.approx((3 / 4, 4 / 3))
        assert (view.flip_p, view.jitter_p, view.grayscale_p) == (0.5, 0.8, 0.2)
        assert (view.brightness, view.contrast, view.saturation, view.hue) == (0.4, 0.4, 0.2, 0.1)
        assert view.blur_sigma == (0.1, 2.0) and view.solarize_threshold == 0.5


@functools.cache
def _draws(path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both views' parameters for DRAWS images of 40 x 50, drawn as each path draws them."""
    g = torch.Generator().manual_seed(1234)
    if path == "batched":
        return BatchedTwoViews(32).sample(DRAWS, 40, 50, g)
    transform = TwoViewTransform(32)
    per_image = [transform.sample(40, 50, g) for _ in range(DRAWS)]
    return tuple({k: torch.cat([p[i][k] for p in per_image]) for k in per_image[0][i]} for i in (0, 1))


@pytest.mark.parametrize("path", ["batched", "pil"])
@pytest.mark.parametrize("view_index", [0, 1])
def test_decision_frequencies_match_the_table_within_three_standard_errors(path, view_index):
    view = (VIEW_A, VIEW_B)[view_index]
    params = _draws(path)[view_index]
    for key, attr in DECISIONS.items():
        p = getattr(view, attr)
        freq = params[key].float().mean().item()
        if p in (0.0, 1.0):
            assert freq == p, key
        else:
            se = math.sqrt(p * (1 - p) / DRAWS)
            assert abs(freq - p) < 3 * se, f"{key}: {freq} vs {p} (3 SE = {3 * se:.4f})"
    assert params["brightness"].min() >= 0.6 and params["brightness"].max() <= 1.4
    assert params["saturation"].min() >= 0.8 and params["saturation"].max() <= 1.2
    assert params["hue"].abs().max() <= 0.1 and params["hue"].std() > 0.05
    assert params["sigma"].min() >= 0.1 and params["sigma"].max() <= 2.0
    assert all(sorted(row) == [0, 1, 2, 3] for row in params["jitter_order"].tolist())
    area = (params["height"] * params["width"]).float() / (40 * 50)
    aspect = params["width"].float() / params["height"].float()
    assert area.min() >= 0.07 and area.max() <= 1.0 and 0.4 < area.mean() < 0.6
    assert aspect.min() >= 0.7 and aspect.max() <= 1.4
    assert (params["top"] + params["height"]).max() <= 40 and (params["left"] + params["width"]).max() <= 50


def test_pil_call_draws_exactly_what_sample_draws():
    transform = TwoViewTransform(24)
    img = _smooth_image(0)
    g_call, g_sample = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    transform(img, g_call)
    transform.sample(img.height, img.width, g_sample)
    assert torch.equal(g_call.get_state(), g_sample.get_state())


def test_images_in_one_batch_get_different_parameters_and_views():
    images = torch.rand(1, 3, 32, 32).expand(16, -1, -1, -1)
    params_a, _ = BatchedTwoViews(16).sample(16, 32, 32, torch.Generator().manual_seed(0))
    assert len(set(zip(params_a["top"].tolist(), params_a["left"].tolist(), params_a["height"].tolist()))) > 12
    assert params_a["brightness"].unique().numel() == 16 and params_a["hue"].unique().numel() == 16
    view_a, view_b = BatchedTwoViews(16)(images, torch.Generator().manual_seed(0))
    for view in (view_a, view_b):
        flat = view.flatten(1)
        distances = torch.cdist(flat, flat)
        assert (distances + torch.eye(16) * 1e9).min() > 1e-3


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("channels", [1, 3])
def test_batched_views_are_normalised_float_rgb_on_the_input_device(dtype, channels):
    images = torch.rand(5, channels, 20, 28)
    images = (images * 255).byte() if dtype == torch.uint8 else images
    for view in BatchedTwoViews(16)(images):
        assert view.shape == (5, 3, 16, 16) and view.dtype == torch.float32 and view.device == images.device
        raw = _unnormalize(view)
        assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_pil_views_are_normalised_float_rgb_for_any_mode(mode):
    img = _smooth_image(1).convert(mode)
    for view in TwoViewTransform(24)(img, torch.Generator().manual_seed(0)):
        assert view.shape == (3, 24, 24) and view.dtype == torch.float32
        raw = _unnormalize(view)
        assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5


def test_grayscale_input_gives_gray_views_on_both_paths():
    gray = torch.rand(8, 1, 24, 24)
    for view in BatchedTwoViews(16)(gray, torch.Generator().manual_seed(3)):
        raw = _unnormalize(view)
        torch.testing.assert_close(raw[:, 0], raw[:, 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(raw[:, 0], raw[:, 2], atol=1e-5, rtol=0)
    img = _smooth_image(2).convert("L")
    for view in TwoViewTransform(16)(img, torch.Generator().manual_seed(3)):
        raw = _unnormalize(view)
        assert (raw[0] - raw[1]).abs().max() <= 1 / 255 + 1e-5 and (raw[0] - raw[2]).abs().max() <= 1 / 255 + 1e-5


def test_same_generator_seed_gives_identical_views_and_another_seed_does_not():
    img, batch = _smooth_image(3), torch.rand(4, 3, 24, 24)
    for transform, x in ((TwoViewTransform(16), img), (BatchedTwoViews(16), batch)):
        first = transform(x, torch.Generator().manual_seed(11))
        again = transform(x, torch.Generator().manual_seed(11))
        other = transform(x, torch.Generator().manual_seed(12))
        assert all(torch.equal(u, v) for u, v in zip(first, again))
        assert not torch.equal(first[0], other[0])
    torch.manual_seed(5)
    first = BatchedTwoViews(16)(batch)
    torch.manual_seed(5)
    assert torch.equal(first[1], BatchedTwoViews(16)(batch)[1])


def test_batched_ops_equal_torchvision_ops_applied_image_by_image():
    images = torch.rand(12, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    p = sample_view_params(12, VIEW_B, torch.Generator().manual_seed(1), 16, 16)
    p.update(top=torch.zeros(12, dtype=torch.long), left=torch.zeros(12, dtype=torch.long))
    p.update(height=torch.full((12,), 16), width=torch.full((12,), 16))
    p.update(jitter=torch.arange(12) % 4 != 0, grayscale=torch.arange(12) % 3 == 0)
    p.update(blur=torch.arange(12) % 2 == 0, solarize=torch.arange(12) % 5 < 2)
    got = apply_view(images, p, 16, VIEW_B)
    ops = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
    keys = ("brightness", "contrast", "saturation", "hue")
    k = blur_kernel_size(16)
    for i in range(12):
        x = images[i]
        x = F.horizontal_flip(x) if p["flip"][i] else x
        if p["jitter"][i]:
            for op in p["jitter_order"][i].tolist():
                x = ops[op](x, float(p[keys[op]][i]))
        x = F.rgb_to_grayscale(x, num_output_channels=3) if p["grayscale"][i] else x
        x = F.gaussian_blur(x, [k, k], [float(p["sigma"][i])] * 2) if p["blur"][i] else x
        x = F.solarize(x, 0.5) if p["solarize"][i] else x
        expected = F.normalize(x, IMAGENET_MEAN, IMAGENET_STD)
        torch.testing.assert_close(got[i], expected, atol=2e-5, rtol=1e-5, msg=f"image {i}")


def test_batched_crop_resamples_like_bilinear_resize_and_area_average():
    images = torch.rand(2, 3, 8, 8)
    full = {"top": torch.zeros(2, dtype=torch.long), "left": torch.zeros(2, dtype=torch.long)}
    full.update(height=torch.full((2,), 8), width=torch.full((2,), 8))
    off = {k: torch.zeros(2, dtype=torch.bool) for k in DECISIONS}
    neutral = {**full, **off, "jitter_order": torch.arange(4).repeat(2, 1), "sigma": torch.ones(2)}
    neutral.update({k: torch.ones(2) for k in ("brightness", "contrast", "saturation")}, hue=torch.zeros(2))
    same = _unnormalize(apply_view(images, neutral, 8))
    torch.testing.assert_close(same, images, atol=1e-6, rtol=0)
    up = _unnormalize(apply_view(images, neutral, 16))
    torch.testing.assert_close(up, F.resize(images, [16, 16], antialias=False), atol=1e-5, rtol=0)
    down = _unnormalize(apply_view(images, neutral, 4))
    torch.testing.assert_close(down, torch.nn.functional.avg_pool2d(images, 2), atol=1e-6, rtol=0)


def test_pil_path_and_tensor_path_agree_given_the_same_parameters():
    img, n = _smooth_image(4), 100
    batch = F.pil_to_tensor(img)[None].expand(n, -1, -1, -1)
    outputs = []
    for view in (VIEW_A, VIEW_B):
        p = sample_view_params(n, view, torch.Generator().manual_seed(0), img.height, img.width)
        tensor_views = apply_view(batch.float() / 255, p, 24, view)
        pil_views = torch.stack(
            [apply_view_pil(img, {k: v[i : i + 1] for k, v in p.items()}, 24, view) for i in range(n)]
        )
        # Bicubic vs roi_align resampling and PIL's uint8 rounding after each op: ~2/255 per pixel.
        assert (pil_views - tensor_views).abs().mean() < 0.06
        torch.testing.assert_close(pil_views.mean(dim=(0, 2, 3)), tensor_views.mean(dim=(0, 2, 3)), atol=0.03, rtol=0)
        torch.testing.assert_close(pil_views.std(), tensor_views.std(), atol=0, rtol=0.03)
        outputs.append((pil_views, tensor_views))
    # View A is always blurred, view B rarely: its high-frequency energy is larger on both paths.
    for a, b in zip(*outputs):
        assert a.diff(dim=-1).abs().mean() < 0.8 * b.diff(dim=-1).abs().mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_views_run_on_cuda_with_a_cuda_generator():
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    view_a, view_b = BatchedTwoViews(24)(images, g)
    assert view_a.device.type == "cuda" and view_b.shape == (8, 3, 24, 24)
    cpu_a, _ = BatchedTwoViews(24)(images.cpu(), torch.Generator().manual_seed(0))
    assert np.isfinite(view_a.cpu().numpy()).all() and cpu_a.shape == view_a.shape


def test_a_list_of_one_size_is_viewed_as_its_stacked_batch_and_like_the_padded_crops_of_mixed_sizes():
    from bt_hub.method.views import apply_view, crop_to_views, to_float_rgb

    images = [
        torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        for i in range(6)
    ]
    views = BatchedTwoViews(8)
    listed = views(images, generator=torch.Generator().manual_seed(1))
    stacked = views(torch.stack(images), generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(listed, stacked))
    drawn = views.sample(6, torch.full((6,), 20), torch.full((6,), 30), torch.Generator().manual_seed(1))
    batch, params = crop_to_views(images, drawn)
    padded = [apply_view(to_float_rgb(batch), p, 8, v) for p, v in zip(params, views.views)]
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(listed, padded))  # the mixed-size path, same views


@pytest.mark.parametrize("listed", [False, True])
def test_batched_views_on_a_device_read_nothing_back_and_take_their_parameters_in_one_copy(device_traffic, listed):
    # Guards the pretraining views' ~90 CUDA syncs a step: a synchronising copy per parameter, a nonzero per
    # colour-jitter op and position, a torch.tensor constant per gray, hue and normalisation. The meta device
    # stands for the GPU: it holds no data, so a read back to the host raises.
    images = torch.empty(16, 3, 28, 28, dtype=torch.uint8, device="meta")
    batch = list(images) if listed else images
    views = BatchedTwoViews(32)
    views(batch, torch.Generator().manual_seed(0))  # the constants (gray weights, mean, std) are made once
    with device_traffic() as seen:
        view_a, view_b = views(batch, torch.Generator().manual_seed(1))
    assert view_a.shape == view_b.shape == (16, 3, 32, 32) and view_a.device.type == "meta"
    assert seen.sent == ["aten::_to_copy"]
