"""Key layouts of ResNet checkpoints in the wild (docs/protocols.md §1, §3)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bt_hub.common.files import CheckpointError, non_finite_tensors, read_file_and_sha256, safetensors_metadata
from bt_hub.method.model import ARCHITECTURES
from bt_hub.method.transforms import read_input_metadata

# Prefix segments that mark "the backbone" when one file holds several ResNets.
_BACKBONE_MARKERS = ("backbone", "trunk", "encoder", "encoder_q", "student", "bottom_up", "res5")
# Prefix segments of networks that are not the one to evaluate (momentum/teacher copies).
_SECONDARY_MARKERS = ("momentum", "teacher", "encoder_k", "target", "ema")
# The key of a detectron2 .pkl under which bt_hub's export keeps ``input_metadata`` (detectron2 ignores it).
PKL_INPUT_KEY = "bt_hub_input"


# --------------------------------------------------------------------------- flattening


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape"):
        import numpy as np

        return torch.from_numpy(value if value.flags.c_contiguous and value.flags.writeable else np.array(value))
    return None


def flatten_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor (or numpy array) nested in dicts, keyed by its dotted path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str):
                continue
            tensor = _as_tensor(value)
            name = f"{prefix}{key}"
            if tensor is not None:
                out[name] = tensor
            elif isinstance(value, Mapping):
                out.update(flatten_tensors(value, name + "."))
    return out


# --------------------------------------------------------------------------- detectron2 names


def torchvision_to_detectron2_key(key: str) -> str:
    """``layer1.0.bn1.weight`` -> ``res2.0.conv1.norm.weight`` (detectron2's convert-torchvision-to-d2)."""
    if not key.startswith("layer"):
        key = "stem." + key
    for t in (1, 2, 3, 4):
        key = key.replace(f"layer{t}", f"res{t + 1}")
    for t in (1, 2, 3):
        key = key.replace(f"bn{t}", f"conv{t}.norm")
    key = key.replace("downsample.0", "shortcut")
    return key.replace("downsample.1", "shortcut.norm")


def detectron2_to_torchvision_key(key: str) -> str:
    """The inverse of ``torchvision_to_detectron2_key``."""
    key = key.replace("shortcut.norm", "downsample.1").replace("shortcut", "downsample.0")
    for t in (1, 2, 3):
        key = key.replace(f"conv{t}.norm", f"bn{t}")
    for t in (1, 2, 3, 4):
        key = key.replace(f"res{t + 1}.", f"layer{t}.")
    return key[len("stem.") :] if key.startswith("stem.") else key


# --------------------------------------------------------------------------- finding the backbone


# Each layout's stem key, the first stage's first key (both under the backbone's prefix), and its name in words.
_LAYOUTS = {
    "torchvision": ("conv1.weight", "layer1.0.conv1.weight", "torchvision state dict"),
    "vissl": ("_feature_blocks.conv1.weight", "_feature_blocks.layer1.0.conv1.weight", "VISSL trunk"),
    "detectron2": ("stem.conv1.weight", "res2.0.conv1.weight", "detectron2 weights"),
}


def _candidates(flat: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(prefix, layout) pairs under which a ResNet stem and first stage sit."""
    found = []
    for key in flat:
        for layout, (suffix, probe, _) in _LAYOUTS.items():
            if key.endswith(suffix):
                prefix = key[: -len(suffix)]
                if prefix + probe in flat and (prefix, layout) not in found:
                    found.append((prefix, layout))
    return found


def _rank(prefix: str) -> tuple[int, int, int]:
    segments = prefix.rstrip(".").split(".") if prefix else []
    secondary = any(m in s for s in segments for m in _SECONDARY_MARKERS)
    marked = any(s in _BACKBONE_MARKERS for s in segments)
    return (int(secondary), int(not marked), len(prefix))


def extract_backbone(obj: Any, source: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The torchvision-named backbone state dict (no ``fc``) in what ``read_file`` returned, and its ``info``."""
    flat = flatten_tensors(obj)
    candidates = sorted(_candidates(flat), key=lambda c: _rank(c[0]))
    if not candidates:
        examples = list(flat)[:4] if flat else list(obj)[:4] if isinstance(obj, Mapping) else [type(obj).__name__]
        raise CheckpointError(
            f"weights file {source} has no ResNet backbone in a known key layout "
            f"(torchvision, detectron2, VISSL, or these under a prefix); it holds keys such as {examples}"
        )
    prefix, layout = candidates[0]
    state: dict[str, torch.Tensor] = {}
    for key, tensor in flat.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if layout == "vissl":
            if not name.startswith("_feature_blocks."):
                continue
            name = name[len("_feature_blocks.") :]
        elif layout == "detectron2":
            if not (name.startswith("stem.") or re.match(r"res[2-5]\.", name)):
                continue
            name = detectron2_to_torchvision_key(name)
        if name.startswith(("conv1.", "bn1.")) or re.match(r"layer[1-4]\.\d+\.", name):
            state[name] = tensor
    if layout == "detectron2" and not any(k.startswith("layer4.") for k in state):
        # A detectron2 C4 model keeps res5 in its RoI head.
        for key, tensor in flat.items():
            if key.startswith("roi_heads.res5.") or key.startswith("model.roi_heads.res5."):
                name = key.split("roi_heads.", 1)[1]
                state[detectron2_to_torchvision_key(name)] = tensor
    described = _LAYOUTS[layout][2] + (f" under '{prefix}'" if prefix else "")
    used = {prefix + k for k in state}
    dropped = [k for k in flat if k not in used and not _is_backbone_copy(k, prefix, layout)]
    info = {"format": described, "layout": layout, "prefix": prefix, "dropped": dropped}
    return state, info


def _is_backbone_copy(key: str, prefix: str, layout: str) -> bool:
    """Keys already taken under another spelling (VISSL / detectron2 renames)."""
    if layout == "vissl":
        return key.startswith(prefix + "_feature_blocks.") and not key.endswith(("fc.weight", "fc.bias"))
    if layout == "detectron2":
        name = key[len(prefix) :] if key.startswith(prefix) else key
        return name.startswith("stem.") or bool(re.match(r"res[2-5]\.", name)) or ".res5." in key
    return False


def extract_projector(obj: Any) -> dict[str, torch.Tensor]:
    """The projector ``Sequential`` weights (keys ``0.weight``, ``1.running_mean``, ...) or ``{}``."""
    flat = flatten_tensors(obj)
    prefixes = sorted({k.split("projector.")[0] + "projector." for k in flat if "projector." in k}, key=_rank)
    if not prefixes:
        return {}
    prefix = prefixes[0]
    return {
        k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix) and re.match(r"\d+\.", k[len(prefix) :])
    }


def projector_spec(projector: Mapping[str, torch.Tensor]) -> str:
    """The ``"8192-8192-8192"`` spec of projector weights (the widths of its Linear layers)."""
    linears = sorted(
        (int(k.split(".")[0]), v.shape[0]) for k, v in projector.items() if k.endswith(".weight") and v.ndim == 2
    )
    return "-".join(str(width) for _, width in linears)


# --------------------------------------------------------------------------- architecture


def infer_architecture(state: Mapping[str, torch.Tensor], source: str) -> tuple[str, bool]:
    """``(arch, small_image_stem)`` from a torchvision-named state dict's keys and shapes."""
    blocks = []
    for stage in (1, 2, 3, 4):
        indices = {int(m.group(1)) for k in state if (m := re.match(rf"layer{stage}\.(\d+)\.", k))}
        blocks.append(max(indices) + 1 if indices else 0)
    kind = "bottleneck" if "layer1.0.conv3.weight" in state else "basic"
    for arch, spec in ARCHITECTURES.items():
        if tuple(blocks) == spec.layers and spec.block == kind:
            conv1 = state.get("conv1.weight")
            small = conv1 is not None and tuple(conv1.shape[-2:]) == (3, 3)
            return arch, small
    raise CheckpointError(
        f"weights file {source} holds a ResNet with {blocks} {kind} blocks per stage, "
        f"which matches none of {sorted(ARCHITECTURES)}; pass the architecture explicitly"
    )


def check_fits(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], arch: str, source: str) -> None:
    """Raise one sentence when ``state`` misses keys of, or has shapes unlike, ``expected``."""
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if not (missing or unexpected or wrong):
        return
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} shapes differ (file vs model), first {wrong[:3]}")
    if missing:
        problems.append(f"{len(missing)} keys are missing, first {missing[:5]}")
    if unexpected:
        problems.append(f"{len(unexpected)} keys are unexpected, first {unexpected[:5]}")
    try:
        looks = infer_architecture(state, source)[0]
        hint = f" (it looks like {looks})" if looks != arch else ""
    except CheckpointError:
        hint = ""
    raise CheckpointError(f"weights file {source} does not fit {arch}{hint}: " + "; ".join(problems))


# --------------------------------------------------------------------------- checks


def check_finite(state: Mapping[str, torch.Tensor], source: str, *, allow: bool = False) -> None:
    """Raise one sentence naming ``source`` and the first parameters or buffers holding NaN or inf, unless ``allow``."""
    bad = non_finite_tensors(state)
    if bad and not allow:
        raise CheckpointError(
            f"weights file {source} holds NaN or inf in {len(bad)} tensor{'s' if len(bad) > 1 else ''}, "
            f"first {bad[:5]}, so bt_hub refuses to load it "
            "(pass --allow-non-finite / allow_non_finite=True to inspect such weights anyway)"
        )


def input_metadata_of(path: Path, obj: Any) -> dict[str, Any]:
    """What a weights file bt_hub wrote says of its input (``method.transforms.input_metadata``), typed; ``{}`` for
    other files: safetensors metadata counts only when marked ``written_by: bt_hub``."""
    if isinstance(obj, Mapping) and isinstance(obj.get(PKL_INPUT_KEY), Mapping):
        return read_input_metadata(obj[PKL_INPUT_KEY], str(path))
    meta = safetensors_metadata(path) if path.suffix == ".safetensors" else {}
    return read_input_metadata(meta, str(path)) if meta.get("written_by") == "bt_hub" else {}


def read_backbone(path: Path, *, allow_non_finite: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checked backbone state dict in a weights file; ``info["sha256"]`` is of the very bytes read and
    ``info["metadata"]`` what the file says of its input (:func:`input_metadata_of`)."""
    obj, sha256 = read_file_and_sha256(path)
    state, info = extract_backbone(obj, str(path))
    check_finite(state, str(path), allow=allow_non_finite)
    return state, {**info, "file": str(path), "sha256": sha256, "metadata": input_metadata_of(path, obj)}
