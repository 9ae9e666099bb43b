"""Image files decoded in batches on the device, and the views of images of different sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin
from torch.utils.data import DataLoader

import bt_hub.data.decode as decode
import bt_hub.data.decode_auto as decode_auto
from bt_hub.cli import main as cli_main
from bt_hub.common.optional import MissingDependencyError
from bt_hub.data import measured
from bt_hub.data.datasets import build_dataset
from bt_hub.data.decode import (
    Decoding,
    PackedItems,
    collate_packed,
    decode_images,
    device_decodable,
    nvimgcodec,
    read_encoded,
    to_device_images,
)
from bt_hub.data.decode_auto import check_decode, decode_choice, time_decoders
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.features import EncodedItems, extract_features
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import DeviceEvalTransform
from bt_hub.method.views import (
    VIEW_A,
    VIEW_B,
    BatchedTwoViews,
    apply_view,
    apply_view_pil,
    sample_view_params,
    to_float_rgb,
)

SIZES = [(37, 53), (64, 48), (20, 90), (75, 75), (33, 41)]


def _photo(seed: int, height: int, width: int) -> np.ndarray:
    """Smooth colours with a fine texture of brightness, like a photograph (cheap and seeded).

    The texture is the same in the three channels: pixel-level colour noise, which photographs
    do not have, is where decoders' chroma upsampling differs most (libjpeg-turbo interpolates,
    nvJPEG does not).
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 5, 5, generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False) * 0.8
    x = x + 0.15 * torch.rand(1, 1, height, width, generator=g)
    return (x[0].permute(1, 2, 0).clamp(0, 1) * 255).round().byte().numpy()


def write_images(folder: Path) -> dict[str, Path]:
    """Baseline JPEGs of several sizes (full-resolution colour, 4:4:4), and the files nvJPEG refuses or treats apart."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for i, (h, w) in enumerate(SIZES):
        files[f"rgb{i}"] = folder / f"rgb{i}.jpg"
        Image.fromarray(_photo(i, h, w)).save(files[f"rgb{i}"], quality=90, subsampling=0)
    files["gray"] = folder / "gray.jpg"
    Image.fromarray(_photo(10, 30, 44)[..., 0]).save(files["gray"], quality=90)
    files["progressive"] = folder / "progressive.jpg"
    Image.fromarray(_photo(11, 40, 36)).save(files["progressive"], quality=90, subsampling=0, progressive=True)
    files["cmyk"] = folder / "cmyk.jpg"
    Image.fromarray(_photo(12, 28, 50)).convert("CMYK").save(files["cmyk"], quality=90)
    files["png"] = folder / "image.png"
    Image.fromarray(_photo(13, 26, 31)).save(files["png"])
    return files


def _pil(path: Path) -> torch.Tensor:
    with Image.open(path) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


def assert_decoded_like_pil(decoded: list[torch.Tensor], paths: list[Path]) -> None:
    """PIL's pixels: within one level for grey and 4:4:4 JPEGs, within the chroma upsampling tolerance for 4:2:0.

    Decoders differ in how they bring half-resolution colour (4:2:0) back to full size:
    libjpeg-turbo (PIL) interpolates, nvJPEG does not. Measured on an H100 (torchvision 0.26):
    baseline 4:4:4 files decode to within one level, a progressive 4:4:4 one within 3; a 240 x 320
    4:2:0 photo-like image differs by 0.68 levels on average, 5 at most; a 37 x 53 one, whose colours
    change every few pixels, by 4.3.
    """
    for image, path in zip(decoded, paths):
        expected = _pil(path)
        assert image.dtype == torch.uint8 and image.shape == expected.shape, path.name
        diff = (image.cpu().int() - expected.int()).abs().float()
        with Image.open(path) as img:
            subsampled = img.format == "JPEG" and JpegImagePlugin.get_sampling(img) > 0
            progressive = img.format == "JPEG" and bool(img.info.get("progressive"))
        if progressive and not subsampled:  # nvJPEG's progressive path: max 3 levels on an H100, 2026-11-27
            assert diff.max() <= 3, f"{path.name}: max {diff.max():.0f}"
        elif subsampled:
            assert diff.mean() <= 1.5 and (diff <= 4).float().mean() >= 0.99, (
                f"{path.name}: mean {diff.mean():.2f}, max {diff.max():.0f}"
            )
        else:
            assert diff.max() <= 1, f"{path.name}: max {diff.max():.0f}"


def test_device_decoder_takes_baseline_and_progressive_jpegs_and_leaves_cmyk_and_png_to_pil(tmp_path):
    files = write_images(tmp_path)
    decodable = {name: read_encoded(path).device_decodable for name, path in files.items()}
    assert decodable == {
        **{f"rgb{i}": True for i in range(len(SIZES))},
        "gray": True,
        "progressive": True,
        "cmyk": False,
        "png": False,
    }
    assert not device_decodable(b"\xff\xd8\xff") and not device_decodable(b"GIF89a")


def test_batch_decoded_through_the_device_path_equals_pil_on_the_cpu(tmp_path):
    files = write_images(tmp_path)
    paths = list(files.values())
    decoded = decode_images([read_encoded(p) for p in paths], "cpu")
    assert_decoded_like_pil(decoded, paths)
    rgb = [p for name, p in files.items() if name.startswith("rgb")]
    assert all(torch.equal(d, _pil(p)) for d, p in zip(decoded, rgb))  # libjpeg-turbo both ways on the CPU


def test_nvimgcodec_decodes_jpegs_as_pil_does_bit_for_bit_and_leaves_cmyk_and_png_to_pil(
    tmp_path, with_nvimgcodec, monkeypatch
):
    files = write_images(tmp_path)
    by_pil, pil = [], decode.decode_on_cpu
    monkeypatch.setattr(decode, "decode_on_cpu", lambda item: by_pil.append(Path(item.path).name) or pil(item))
    decoded = decode_images([read_encoded(p) for p in files.values()], "cpu", "nvimgcodec")
    assert all(torch.equal(d, _pil(p)) for d, p in zip(decoded, files.values()))  # libjpeg-turbo both ways
    assert by_pil == ["cmyk.jpg", "image.png"]  # nvImageCodec decoded every JPEG the device decoder takes


def test_nvimgcodec_is_imported_and_refuses_a_file_without_a_word_on_stderr(tmp_path, with_nvimgcodec):
    """Guards: importing nvImageCodec printed 10 lines to stderr (nvJPEG2000 and nvTIFF not found) on every run,
    and each JPEG it refused one line more."""
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"garbage" * 20)
    code = (
        "from bt_hub.data.decode import decode_images, nvimgcodec, read_encoded\n"
        "nvimgcodec()\n"
        "try:\n"
        f"    decode_images([read_encoded({str(tmp_path / 'bad.jpg')!r})], 'cpu', 'nvimgcodec')\n"
        "except OSError as err:\n"
        "    print(type(err).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ImageFileError\n", "")  # PIL names the file


def test_a_missing_nvimgcodec_is_refused_in_one_sentence_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"--decode nvimgcodec needs nvidia\.nvimgcodec, .*\[nvimgcodec\]"):
        nvimgcodec()
    with pytest.raises(MissingDependencyError, match=r"pip install 'bt_hub\[nvimgcodec\]'"):
        EvalConfig(weights="w.pth", decode="nvimgcodec")
    assert decode_choice("device", "cpu", "digits", 2).decode == "device"  # the other values need nothing


@pytest.mark.parametrize("share", [0.1, 0.35, 0.5, 0.9])
def test_the_workers_share_is_the_same_indices_every_time_and_spread_over_every_batch(share):
    jpeg = read_encoded(Path(__file__))._replace(device_decodable=True)
    left = [Decoding("torchvision", "pil", share).leaves_encoded(jpeg, i) for i in range(20_000)]
    for start in range(0, 20_000 - 256, 97):  # any batch of 256 consecutive indices gets its share, within 3
        assert abs(256 * (1 - share) - sum(left[start : start + 256])) <= 3
    assert left == [Decoding("nvimgcodec", "pil", share).leaves_encoded(jpeg, i) for i in range(20_000)]
    assert not any(Decoding(None).leaves_encoded(jpeg, i) for i in range(100))  # no device decoder: workers


def test_split_decoding_gives_the_unsplit_tensors_and_decodes_each_file_once(tmp_path, with_nvimgcodec, monkeypatch):
    """The device path with the workers decoding a share of each batch, nvImageCodec's CPU backend standing in for
    the GPU decoder: the same tensors as the unsplit path, and no file decoded twice or left undecoded."""
    for cls in ("a", "b"):
        write_images(tmp_path / cls)
    dataset = build_dataset(str(tmp_path), "train", image_size=None)
    on_device, in_workers, pil = [], [], decode.decode_on_cpu
    nvjpeg_stand_in = decode._DEVICE_DECODERS["nvimgcodec"]
    monkeypatch.setattr(decode, "decode_on_cpu", lambda item: in_workers.append(item.path) or pil(item))
    monkeypatch.setitem(
        decode._DEVICE_DECODERS,
        "nvimgcodec",
        lambda data, device: on_device.append(len(data)) or nvjpeg_stand_in(data, device),
    )

    def images(decoding: Decoding) -> list[torch.Tensor]:
        on_device.clear(), in_workers.clear()
        loader = DataLoader(
            EncodedItems(dataset, decoding), batch_size=6, collate_fn=lambda b: collate_packed([x for x, _ in b])
        )
        return [image for batch in loader for image in to_device_images(batch, "cpu", decoding.device or "pil")]

    unsplit = images(Decoding("nvimgcodec"))
    assert sum(on_device) == 14 and len(in_workers) == 4  # the device: every JPEG it takes; PIL: CMYK and PNG
    for share in (0.5, 1.0):
        split = images(Decoding("nvimgcodec", "pil", share))
        assert all(torch.equal(a, b) for a, b in zip(split, unsplit, strict=True))
        assert sorted(in_workers) == sorted(set(in_workers)) and sum(on_device) + len(in_workers) == len(dataset)
        assert (sum(on_device), len(in_workers)) == ((7, 11) if share == 0.5 else (0, 18))
    assert all(torch.equal(a, b) for a, b in zip(images(Decoding()), unsplit, strict=True))  # the workers alone


def test_features_of_the_split_path_equal_the_unsplit_path_bit_for_bit(tmp_path, with_nvimgcodec):
    for cls in ("a", "b"):
        write_images(tmp_path / cls)
    dataset = build_dataset(str(tmp_path), "train", image_size=None)
    torch.manual_seed(0)
    net = build_backbone("resnet18", small_image_stem=True)
    options = {"transform": DeviceEvalTransform(16), "batch_size": 8}
    unsplit, labels = extract_features(net, dataset, decoding=Decoding("nvimgcodec"), **options)
    split, split_labels = extract_features(net, dataset, decoding=Decoding("nvimgcodec", "pil", 0.5), **options)
    assert torch.equal(split, unsplit) and split_labels.tolist() == labels.tolist() == dataset.targets


def test_time_decoders_times_each_decoder_at_hand_and_the_device_ones_on_one_batch(tmp_path, with_nvimgcodec):
    sample = decode_auto.jpeg_sample(write_images(tmp_path / "a")["rgb0"].parent.parent)
    assert len(sample) == 7  # the JPEGs the device decoder takes: not the CMYK one nor the PNG
    on_device = time_decoders(sample, "cpu", on_device=True)  # what CUDA times, here on the CPU
    in_workers = time_decoders(sample, "cpu", on_device=False)
    assert set(on_device) == {"pil", "torchvision", "nvimgcodec"} and set(in_workers) == {"pil", "nvimgcodec"}
    assert all(0 < s < 1 for s in [*on_device.values(), *in_workers.values()])


def test_decode_auto_takes_the_faster_decoder_splits_by_the_two_rates_and_caches_per_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / name)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(decode_auto.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(decode_auto, "split_problem", lambda *a: None)  # its own test below: a CPU has no "cuda"
    write_images(tmp_path / "data" / "a")
    timed = []
    same = {"max": 2, "mean": 0.4}

    def measure(sample, device, on_device):
        timed.append((len(sample), on_device))
        if on_device:
            seconds = {"pil": 1 / 400, "torchvision": 1 / 12_000, "nvimgcodec": 1 / 9_000}
            return {"seconds": seconds, "agreement": {"torchvision": same, "nvimgcodec": same}}
        return {"seconds": {"pil": 1 / 400, "nvimgcodec": 1 / 500}, "agreement": {"nvimgcodec": same}}

    chosen = decode_choice("auto", "cuda", tmp_path / "data", 16, measure)
    assert chosen.decoding == Decoding("torchvision", "pil", pytest.approx(6_400 / 18_400))
    assert chosen.decode == "device" and chosen.agreement == {"torchvision": same, "nvimgcodec": same}
    assert "9,000 images/s with nvimgcodec, 12,000 images/s with torchvision" in chosen.reason
    assert chosen.reason.endswith("the workers decoding 35% of each batch's JPEGs (measured now)")
    again = decode_choice("auto", "cuda", tmp_path / "data", 4, lambda *a: pytest.fail("measured again"))
    assert again.decoding.worker_share == pytest.approx(1_600 / 13_600) and "cached in decode_auto.json" in again.reason
    assert decode_choice("auto", "cuda", tmp_path / "data", 0, measure).decoding.worker_share == 0  # no workers
    on_cpu = decode_choice("auto", "cpu", tmp_path / "data", 2, measure)
    assert (on_cpu.decode, on_cpu.decoding) == ("nvimgcodec", Decoding(None, "nvimgcodec"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")  # another machine: timed anew
    assert decode_choice("auto", "cuda", tmp_path / "data", 16, measure).decode == "device"
    assert timed == [(7, True), (7, False), (7, True)]
    none = decode_choice("auto", "cuda", "digits", 16, measure)  # in-memory images: nothing to decode
    assert none == ("device", Decoding("torchvision"), "auto: no JPEG files to time decoders on", None)


# deliberately wrong decoders standing in for a device decoder (on the CPU: torchvision's libjpeg-turbo, PIL's pixels)
WRONG = {
    "channels swapped": lambda image: image.flip(0),
    "transposed": lambda image: image.transpose(1, 2),
    "a row shifted": lambda image: image.roll(1, dims=1),
}


def _few_levels_off(image: torch.Tensor) -> torch.Tensor:
    """PIL's pixels up to 2 levels off, as another IDCT leaves them."""
    noise = torch.randint(-2, 3, image.shape, generator=torch.Generator().manual_seed(image.numel()))
    return (image.int() + noise).clamp(0, 255).byte()


def _decoder_that(change):
    return lambda data, device: [change(image) for image in decode._torchvision(data, device)]


def _on_an_h200_timed_here(monkeypatch, tmp_path, seconds):
    """decode_choice's CUDA rule on this CPU: the device named, ``seconds`` as timed, the pixels of those decoders
    checked here."""
    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / name)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(decode_auto.os, "cpu_count", lambda: 16)
    for cls in ("a", "b"):
        write_images(tmp_path / "data" / cls)

    def measure(sample, device, on_device):
        checked = decode_auto.measure_decoders(sample, torch.device("cpu"), True)["agreement"]
        return {"seconds": seconds, "agreement": {name: checked[name] for name in seconds if name != "pil"}}

    return measure


@pytest.mark.parametrize("wrong", list(WRONG))
def test_decode_auto_never_takes_a_decoder_whose_pixels_are_not_pils(tmp_path, monkeypatch, with_nvimgcodec, wrong):
    # guards (case 7): --decode auto took the fastest device decoder without looking at what it decoded
    measure = _on_an_h200_timed_here(
        monkeypatch, tmp_path, {"pil": 1 / 400, "torchvision": 1 / 50_000, "nvimgcodec": 1 / 9_000}
    )
    monkeypatch.setattr(decode_auto, "split_problem", lambda *a: None)  # its own test below
    monkeypatch.setitem(decode._DEVICE_DECODERS, "torchvision", _decoder_that(WRONG[wrong]))  # the fastest
    monkeypatch.setitem(decode._DEVICE_DECODERS, "nvimgcodec", _decoder_that(_few_levels_off))
    chosen = decode_choice("auto", "cuda", tmp_path / "data", 4, measure)
    levels = chosen.agreement
    assert not decode_auto.agrees(levels["torchvision"]) and 0 < levels["nvimgcodec"]["max"] <= 3
    assert decode_auto.agrees(levels["nvimgcodec"]) and chosen.decoding == Decoding(
        "nvimgcodec", "pil", pytest.approx(1_600 / 10_600)
    )
    assert (
        chosen.decode == "nvimgcodec"
        and "not taken, over the 64 / 2.0 allowed: torchvision (its pixels up to" in chosen.reason
    )
    monkeypatch.setitem(decode._DEVICE_DECODERS, "nvimgcodec", _decoder_that(WRONG[wrong]))
    (tmp_path / "decode_auto.json").unlink()
    none = decode_choice("auto", "cuda", tmp_path / "data", 4, measure)  # no device decoder fits: the workers decode
    assert (none.decode, none.decoding) == (
        "pil",
        Decoding(),
    ) and "has no decoder whose pixels match PIL's" in none.reason


def test_a_split_decode_unlike_the_unsplit_one_is_found_and_switched_off_with_one_warning(
    tmp_path, monkeypatch, with_nvimgcodec
):
    # guards (case 7): the split decode had met only its CPU stand-in; a merge that put the workers' images in the
    # wrong places, or a workers' decoder that decodes otherwise, would have been scored
    sample = decode_auto.jpeg_sample(write_images(tmp_path / "a")["rgb0"].parent)
    split, cpu = Decoding("nvimgcodec", "pil", 0.5), torch.device("cpu")
    assert decode_auto.split_problem(sample, split, cpu) is None  # nvImageCodec's CPU backend: PIL's pixels
    pil = decode.decode_on_cpu
    monkeypatch.setattr(decode, "decode_on_cpu", lambda item: pil(item).flip(0))  # the workers' share decoded wrong
    problem = decode_auto.split_problem(sample, split, cpu)
    assert problem.startswith("differs from the unsplit decode by up to")
    measure = _on_an_h200_timed_here(monkeypatch, tmp_path / "h200", {"pil": 1 / 400, "torchvision": 1 / 12_000})
    monkeypatch.setattr(decode, "decode_on_cpu", pil)
    monkeypatch.setattr(decode_auto, "split_problem", lambda *a: problem)  # what it finds on the GPU's first JPEGs
    with pytest.warns(
        measured.MeasurementWarning, match="the split decode of the data's first JPEGs differs"
    ) as warned:
        chosen = decode_choice("auto", "cuda", tmp_path / "h200" / "data", 16, measure)
    assert len(warned) == 1 and chosen.decoding == Decoding("torchvision") and chosen.reason.endswith("so it is off")


def test_a_batch_of_files_or_of_images_of_their_own_sizes_crosses_from_workers_as_one_tensor(tmp_path):
    files = write_images(tmp_path)
    paths = list(files.values())
    images = [_pil(p) for p in paths]
    for items in ([read_encoded(p) for p in paths], images):
        loader = torch.utils.data.DataLoader(items, batch_size=4, num_workers=2, collate_fn=collate_packed)
        batches = list(loader)
        assert all(isinstance(b, PackedItems) and b.data.ndim == 1 for b in batches)
        unpacked = [item for b in batches for item in b.unpack()]
        if isinstance(items[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(unpacked, items)) and len(unpacked) == len(items)
        else:
            assert [u.path for u in unpacked] == [str(p) for p in paths]
            assert [u.device_decodable for u in unpacked] == [i.device_decodable for i in items]
            assert all(torch.equal(u.data, i.data) for u, i in zip(unpacked, items))
            decoded = [image for b in batches for image in to_device_images(b, "cpu")]
            assert all(torch.equal(d, i) for d, i in zip(decoded, images))


def test_a_corrupt_file_fails_with_one_sentence_naming_it(tmp_path):
    files = write_images(tmp_path)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(files["rgb0"].read_bytes()[:200])
    items = [read_encoded(files["rgb1"]), read_encoded(broken)]
    with pytest.raises(OSError, match=rf"image {broken} is corrupt or unreadable .*; remove or replace it") as err:
        decode_images(items, "cpu")
    assert "\n" not in str(err.value)


def test_boxes_drawn_for_per_image_sizes_equal_the_boxes_drawn_for_each_size():
    heights, widths = torch.tensor([h for h, _ in SIZES]), torch.tensor([w for _, w in SIZES])
    together = sample_view_params(len(SIZES), VIEW_A, torch.Generator().manual_seed(3), heights, widths)
    for i, (h, w) in enumerate(SIZES):
        alone = sample_view_params(len(SIZES), VIEW_A, torch.Generator().manual_seed(3), h, w)
        assert all(torch.equal(together[k][i], alone[k][i]) for k in together), (h, w)


@pytest.mark.parametrize("crop_scale", [(0.08, 1.0), (0.9, 1.0)])  # large crops touch the images' borders
def test_views_of_a_list_of_sizes_equal_the_views_of_each_full_image(crop_scale):
    import dataclasses

    views = (dataclasses.replace(VIEW_A, crop_scale=crop_scale), dataclasses.replace(VIEW_B, crop_scale=crop_scale))
    images = [torch.from_numpy(_photo(i, h, w)).permute(2, 0, 1).contiguous() for i, (h, w) in enumerate(SIZES * 4)]
    transform = BatchedTwoViews(24, views)
    got = transform(images, torch.Generator().manual_seed(5))
    heights, widths = torch.tensor([im.shape[1] for im in images]), torch.tensor([im.shape[2] for im in images])
    params = transform.sample(len(images), heights, widths, torch.Generator().manual_seed(5))
    for i, image in enumerate(images):
        for out, p, view in zip(got, params, views):
            expected = apply_view(to_float_rgb(image[None]), {k: v[i : i + 1] for k, v in p.items()}, 24, view)
            torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=0)


def test_views_of_decoded_files_equal_per_image_pil_views_within_the_batched_tolerance(tmp_path):
    files = write_images(tmp_path)
    paths = [p for name, p in files.items() if name.startswith("rgb")] * 20
    decoded = decode_images([read_encoded(p) for p in paths], "cpu")
    transform = BatchedTwoViews(24)
    got = transform(decoded, torch.Generator().manual_seed(1))
    heights, widths = torch.tensor([d.shape[1] for d in decoded]), torch.tensor([d.shape[2] for d in decoded])
    params = transform.sample(len(paths), heights, widths, torch.Generator().manual_seed(1))
    for out, p, view in zip(got, params, (VIEW_A, VIEW_B)):
        pil_views = []
        for i, path in enumerate(paths):
            with Image.open(path) as img:
                pil_views.append(apply_view_pil(img.convert("RGB"), {k: v[i : i + 1] for k, v in p.items()}, 24, view))
        pil_views = torch.stack(pil_views)
        # the bound of tests/test_views.py: bicubic vs roi_align and PIL's uint8 rounding
        assert (pil_views - out).abs().mean() < 0.06
        torch.testing.assert_close(pil_views.mean(dim=(0, 2, 3)), out.mean(dim=(0, 2, 3)), atol=0.03, rtol=0)


def test_a_decode_given_is_who_decodes_on_that_device_and_the_device_path_needs_batched_views():
    on = {
        d: {m: decode_choice(m, d, "digits", 2).decoding for m in ("device", "nvimgcodec", "pil")}
        for d in ("cpu", "cuda")
    }
    assert on["cuda"] == {"device": Decoding("torchvision"), "nvimgcodec": Decoding("nvimgcodec"), "pil": Decoding()}
    assert on["cpu"] == {"device": Decoding(), "nvimgcodec": Decoding(None, "nvimgcodec"), "pil": Decoding()}
    assert decode_choice("workers", "cuda", "digits", 2) == ("workers", Decoding(), "--decode workers", None)
    check_decode("auto", "pil")  # pretraining's PIL views: the workers decode (its _train passes "workers")
    for mode in ("device", "nvimgcodec", "pil"):
        with pytest.raises(ValueError, match=f"--decode {mode} needs --views batched"):
            check_decode(mode, "pil")


def _folder_pretrain(data: Path, out: Path, *extra: str) -> list[dict]:
    code = cli_main(
        [
            "pretrain",
            "--data",
            str(data),
            "--out",
            str(out),
            "--arch",
            "resnet18",
            "--small-image-stem",
            "--image-size",
            "16",
            "--projector",
            "32-32",
            "--batch-size",
            "6",
            "--epochs",
            "1",
            "--warmup-epochs",
            "1",
            "--views",
            "batched",
            "--log-every",
            "1",
            "--probe-max-dim",
            "32",
            *extra,
        ]
    )
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pretraining_from_files_decoded_on_the_device_path_equals_decoding_in_workers(tmp_path):
    for cls in ("a", "b"):
        write_images(tmp_path / "data" / cls)
    device = _folder_pretrain(tmp_path / "data", tmp_path / "device", "--decode", "device")
    workers = _folder_pretrain(tmp_path / "data", tmp_path / "workers", "--decode", "workers", "--num-workers", "1")
    assert len(device) == 3 and [r["loss"] for r in device] == [r["loss"] for r in workers]
    recipe = json.loads((tmp_path / "device" / "config.json").read_text())["recipe"]
    assert recipe["decode"] == "device" and recipe["precision"] in ("fp32", "bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvjpeg_batch_decode_equals_pil_and_falls_back_for_cmyk_png_and_a_rejected_batch(tmp_path, monkeypatch):
    import bt_hub.data.decode as decode

    files = write_images(tmp_path)
    paths = list(files.values())
    decoded = decode_images([read_encoded(p) for p in paths], "cuda")
    assert all(d.device.type == "cuda" for d in decoded)
    assert_decoded_like_pil(decoded, paths)
    photo = tmp_path / "photo420.jpg"  # camera-like: 4:2:0 colour, the size of a small photograph
    Image.fromarray(_photo(20, 240, 320)).save(photo, quality=90)
    assert_decoded_like_pil(decode_images([read_encoded(photo)], "cuda"), [photo])
    real, calls = decode._decode_jpegs, []

    def reject_batches(data, device):
        calls.append(len(data))
        if len(data) > 1:
            raise RuntimeError("nvJPEG rejected the batch")
        return real(data, device)

    monkeypatch.setattr(decode, "_decode_jpegs", reject_batches)
    retried = decode_images([read_encoded(p) for p in paths], "cuda")
    assert calls[0] == 7 and calls[1:] == [1] * 7  # the 7 device-decodable files, then one by one
    assert all(torch.equal(a, b) for a, b in zip(retried, decoded))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pretraining_on_cuda_decodes_files_on_the_gpu(tmp_path):
    for cls in ("a", "b"):
        write_images(tmp_path / "data" / cls)
    rows = _folder_pretrain(
        tmp_path / "data", tmp_path / "run", "--device", "cuda", "--precision", "auto", "--num-workers", "2"
    )
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
    recipe = json.loads((tmp_path / "run" / "config.json").read_text())["recipe"]
    assert recipe["decode"] in ("device", "nvimgcodec") and recipe["precision"] == (
        "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    )  # auto: the faster device decoder whose pixels are PIL's, named in run.json
    started = json.loads((tmp_path / "run" / "run.json").read_text())
    assert started["decoder"] in ("torchvision", "nvimgcodec") and started["decoded_on"] in ("device", "split")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvimgcodec_decodes_on_the_gpu_as_nvjpeg_does_and_its_split_path_extracts_the_same_features(
    tmp_path, with_nvimgcodec
):
    files = write_images(tmp_path / "data" / "a")
    write_images(tmp_path / "data" / "b")
    decoded = decode_images([read_encoded(p) for p in files.values()], "cuda", "nvimgcodec")
    assert all(d.device.type == "cuda" for d in decoded)
    assert_decoded_like_pil(decoded, list(files.values()))
    dataset = build_dataset(str(tmp_path / "data"), "train", image_size=None)
    torch.manual_seed(0)
    net = build_backbone("resnet18", small_image_stem=True)
    options = {"transform": DeviceEvalTransform(16), "batch_size": 8, "device": "cuda", "num_workers": 2}
    unsplit, _ = extract_features(net, dataset, decoding=Decoding("nvimgcodec"), **options)
    split, _ = extract_features(net, dataset, decoding=Decoding("nvimgcodec", "pil", 0.5), **options)
    assert torch.linalg.vector_norm(split - unsplit) / torch.linalg.vector_norm(unsplit) < 0.01  # PIL's pixels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eval_on_cuda_times_the_decoders_and_lets_the_workers_decode_a_share(tmp_path, small_stem_weights):
    for split in ("train", "val"):
        for cls in ("a", "b"):
            write_images(tmp_path / "data" / split / cls)
    argv = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(tmp_path / "data"), "--k", "1"]
    assert (
        cli_main([*argv, "--image-size", "16", "--device", "cuda", "--num-workers", "2", "--out", str(tmp_path / "ev")])
        == 0
    )
    settings = json.loads((tmp_path / "ev" / "results.json").read_text())["settings"]
    assert settings["decode"] in ("device", "nvimgcodec") and 0 < settings["decode_share"] < 1
    assert settings["decoded_on"] == "split" and all(
        decode_auto.agrees(a) for a in settings["decode_agreement"].values()
    )
    assert settings["decode_from"].startswith(f"auto: the {torch.cuda.get_device_name()} decoded ~")
