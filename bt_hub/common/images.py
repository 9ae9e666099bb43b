"""Image files read as 8-bit RGB whatever their PIL mode (docs/reliability.md), or refused in one sentence."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

WHITE = (255, 255, 255)
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")


class ImageFileError(OSError):
    """An image file that cannot be read, or whose pixels bt_hub cannot convert to 8-bit RGB."""


def _gray_to_rgb(gray: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(gray), 0, 255).astype(np.uint8), mode="L").convert("RGB")


def _scaled_integers(image: Image.Image, source: str) -> Image.Image:
    values = np.asarray(image, dtype=np.int64)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if image.mode not in _SIXTEEN_BIT and (low < 0 or high > 65535):
        raise ImageFileError(
            f"image {source} holds 32-bit integer pixels from {low} to {high}, a range with no known scale; "
            "save it as an 8- or 16-bit image"
        )
    return _gray_to_rgb(values / 257.0)


def _scaled_floats(image: Image.Image, source: str) -> Image.Image:
    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ImageFileError(f"image {source} holds non-finite float pixels; save it as an 8- or 16-bit image")
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if low < 0 or high > 255:
        raise ImageFileError(
            f"image {source} holds float pixels from {low:g} to {high:g}; bt_hub reads float images "
            "within 0..1 or 0..255 only, so save it as an 8- or 16-bit image"
        )
    return _gray_to_rgb(values * 255.0 if high <= 1.0 else values)


def to_rgb(image: Image.Image, source: str = "<in memory>") -> Image.Image:
    """``image`` as an 8-bit RGB PIL image by the module's rules; ``source`` names it in errors."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P" and "transparency" in image.info:
        image, mode = image.convert("RGBA"), "RGBA"
    if mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode in _SIXTEEN_BIT or mode == "I":
        return _scaled_integers(image, source)
    if mode == "F":
        return _scaled_floats(image, source)
    return image.convert("RGB")


def open_rgb(path: str | os.PathLike, data: bytes | memoryview | None = None) -> Image.Image:
    """The image file at ``path`` decoded as 8-bit RGB (see :func:`to_rgb`); one-sentence errors name the file.

    ``data``: the file's bytes, already read (a loader worker that read them once decodes them without opening
    the file again); ``path`` then only names it in errors.
    """
    path = Path(path)
    try:
        with Image.open(path if data is None else io.BytesIO(data)) as img:
            image = to_rgb(img, str(path))
            return image.copy() if image is img else image  # the file's image is closed on leaving the block
    except ImageFileError:
        raise
    except Image.DecompressionBombError as err:
        raise ImageFileError(
            f"image {path} claims more pixels than PIL's decompression-bomb limit "
            f"({2 * Image.MAX_IMAGE_PIXELS} pixels): it is damaged or not meant to be decoded whole; "
            "resize or remove it"
        ) from err
    except FileNotFoundError as err:
        raise ImageFileError(f"image {path} does not exist") from err
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ImageFileError(
            f"image {path} is corrupt or unreadable ({type(err).__name__}: {err}); remove or replace it"
        ) from err
