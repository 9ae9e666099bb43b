"""Every PIL mode is read as the 8-bit RGB image it shows, or refused in one sentence (bt_hub.common.images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bt_hub.common.images import ImageFileError, open_rgb, to_rgb
from bt_hub.data.datasets import build_dataset
from bt_hub.data.decode import decode_on_cpu, read_encoded
from bt_hub.method.views import TwoViewTransform

RNG = np.random.default_rng(0)
GRAY8 = RNG.integers(0, 256, (12, 10), dtype=np.uint8)
RGB8 = RNG.integers(0, 256, (12, 10, 3), dtype=np.uint8)


def _rgb(image: Image.Image) -> np.ndarray:
    out = to_rgb(image, "test")
    assert out.mode == "RGB" and out.size == image.size
    return np.asarray(out)


def _gray_rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=2)


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path):
    # Guards: convert("RGB") clipped I;16 PNGs to 255, so 99% of a 16-bit scan's pixels became white.
    path = tmp_path / "g16.png"
    Image.fromarray(GRAY8.astype(np.uint16) * 257).save(path)
    with Image.open(path) as img:
        assert img.mode == "I;16"
    np.testing.assert_array_equal(np.asarray(open_rgb(path)), _gray_rgb(GRAY8))


@pytest.mark.parametrize(("mode", "dtype"), [("I;16", "<u2"), ("I;16L", "<u2"), ("I;16B", ">u2")])
def test_sixteen_bit_byte_orders(mode, dtype):
    values = (GRAY8.astype(np.uint16) * 257).astype(dtype)
    image = Image.frombytes(mode, GRAY8.shape[::-1], values.tobytes())
    np.testing.assert_array_equal(_rgb(image), _gray_rgb(GRAY8))


def test_thirty_two_bit_integers_within_sixteen_bits_are_scaled():
    image = Image.fromarray(GRAY8.astype(np.int32) * 257)
    assert image.mode == "I"
    np.testing.assert_array_equal(_rgb(image), _gray_rgb(GRAY8))


def test_thirty_two_bit_integers_out_of_range_are_refused():
    image = Image.fromarray(np.full((4, 4), 70000, dtype=np.int32))
    with pytest.raises(ImageFileError, match=r"image test holds 32-bit integer pixels from 70000 to 70000"):
        to_rgb(image, "test")


@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_float_images_in_unit_or_byte_range(scale):
    # Guards: convert("RGB") turned a float image in 0..1 into a black image.
    image = Image.fromarray((GRAY8 / 255.0 * scale).astype(np.float32))
    assert image.mode == "F"
    np.testing.assert_array_equal(_rgb(image), _gray_rgb(GRAY8))


@pytest.mark.parametrize("values", [np.full((3, 3), -2.0), np.full((3, 3), 900.0), np.full((3, 3), np.nan)])
def test_float_images_without_a_scale_are_refused(values):
    with pytest.raises(ImageFileError, match="image test holds .*float pixels"):
        to_rgb(Image.fromarray(values.astype(np.float32)), "test")


def test_transparent_pixels_composite_over_white():
    # Guards: convert("RGB") dropped alpha and kept whatever colour lay under transparent pixels.
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque
    rgba[0, 1] = (200, 0, 0, 0)  # fully transparent red
    rgba[1, 0] = (0, 0, 0, 128)  # half-transparent black
    out = _rgb(Image.fromarray(rgba, mode="RGBA"))
    assert out[0, 0].tolist() == [10, 20, 30]
    assert out[0, 1].tolist() == [255, 255, 255]
    assert out[1, 0].tolist() == [127, 127, 127]


def test_gray_with_alpha():
    la = Image.fromarray(np.stack([GRAY8, np.full_like(GRAY8, 255)], axis=2), mode="LA")
    np.testing.assert_array_equal(_rgb(la), _gray_rgb(GRAY8))
    clear = Image.fromarray(np.stack([GRAY8, np.zeros_like(GRAY8)], axis=2), mode="LA")
    assert (_rgb(clear) == 255).all()


def test_palette_with_transparent_index(tmp_path):
    palette = Image.new("P", (3, 1))
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    palette.putdata([0, 1, 2])
    path = tmp_path / "p.png"
    palette.save(path, transparency=0)
    out = np.asarray(open_rgb(path))
    assert out[0].tolist() == [[255, 255, 255], [255, 0, 0], [0, 255, 0]]
    opaque = palette.copy()
    opaque.info.pop("transparency", None)
    assert _rgb(opaque)[0, 0].tolist() == [0, 0, 0]


def test_cmyk_and_eight_bit_modes_use_pils_conversion():
    cmyk = Image.fromarray(RGB8).convert("CMYK")
    np.testing.assert_array_equal(_rgb(cmyk), np.asarray(cmyk.convert("RGB")))
    np.testing.assert_array_equal(_rgb(Image.fromarray(GRAY8)), _gray_rgb(GRAY8))
    rgb = Image.fromarray(RGB8)
    assert to_rgb(rgb) is rgb
    assert _rgb(Image.fromarray(GRAY8 > 127)).max() == 255


@pytest.mark.parametrize("mode", ["HSV", "LAB", "YCbCr"])
def test_other_colour_spaces_use_pils_conversion(mode):
    image = Image.fromarray(RGB8).convert(mode)
    np.testing.assert_array_equal(_rgb(image), np.asarray(image.convert("RGB")))


def test_decompression_bomb_is_refused_before_decoding(tmp_path, monkeypatch):
    # Guards: a PNG whose header claimed 40000 x 40000 pixels ended in a DecompressionBombError traceback.
    path = tmp_path / "bomb.png"
    Image.fromarray(GRAY8).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20)
    with pytest.raises(ImageFileError, match=r"image .*bomb.png claims more pixels than PIL's decompression-bomb"):
        open_rgb(path)


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(ImageFileError, match=r"image .*absent.png does not exist"):
        open_rgb(tmp_path / "absent.png")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(ImageFileError, match=r"image .*junk.png is corrupt or unreadable"):
        open_rgb(tmp_path / "junk.png")


def _write_tree(root, images, sixteen_bit):
    for i, image in enumerate(images):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.astype(np.uint16) * 257 if sixteen_bit else image).save(folder / f"{i}.png")
    return root


def test_sixteen_bit_folder_reads_as_its_eight_bit_copy(tmp_path):
    # End to end through the readers pretraining and evaluation use: the dataset, the workers' decoder, the views.
    images = [RNG.integers(0, 256, (16, 16), dtype=np.uint8) for _ in range(6)]
    eight = build_dataset(str(_write_tree(tmp_path / "eight", images, False)), "train", image_size=None)
    sixteen = build_dataset(str(_write_tree(tmp_path / "sixteen", images, True)), "train", image_size=None)
    for (a, label_a), (b, label_b) in zip(eight, sixteen):
        assert label_a == label_b
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    path = next((tmp_path / "sixteen").rglob("*.png"))
    decoded = decode_on_cpu(read_encoded(path))
    assert decoded.dtype == torch.uint8 and decoded.float().mean() < 250
    views = TwoViewTransform(size=16)
    with Image.open(path) as img:
        a, b = views(img, torch.Generator().manual_seed(0))
    with Image.open(next((tmp_path / "eight").rglob(path.name))) as img:
        c, d = views(img, torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, c)
    torch.testing.assert_close(b, d)
