"""What makes a resumed run equal an uninterrupted one: seeded data order, seeded views, full checkpoints
(docs/pretraining.md, "Exact resume").
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bt_hub.common.files import CheckpointError, atomic_torch_save, non_finite_tensors, read_file
from bt_hub.common.presets import first_few

CHECKPOINT_NAME = "checkpoint.pth"


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (same parts, same seed, on every machine)."""
    words = np.random.SeedSequence([int(p) % (2**63) for p in parts]).generate_state(2, dtype=np.uint32)
    return int(words[0]) << 31 ^ int(words[1])


def seeded_generator(*parts: int) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` seeded by ``derive_seed(*parts)`` (the views draw on the host)."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def derived_seed_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a permutation seeded by :func:`derive_seed` of (seed, epoch), so seed 1's first
    epoch is not seed 0's second (the evaluation's classifiers keep DistributedSampler's ``seed + epoch``)."""
    return torch.randperm(num_samples, generator=seeded_generator(seed, epoch))


class EpochBatchSampler:
    """This rank's share of an epoch's global batches from step ``start``, as ``(epoch, index)`` keys.

    Global batch k is positions [kB, (k+1)B) of the epoch's seeded permutation, sliced over the ranks
    (``batch_size`` a multiple of ``world_size``: bt_hub.train.pretrain refuses any other before it builds one).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        epoch: int,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.order = derived_seed_permutation(num_samples, seed, epoch).tolist()
        self.steps = num_samples // batch_size
        self.batch_size, self.epoch, self.start = batch_size, epoch, start
        self.local = batch_size // world_size
        self.offset = rank * self.local

    def __len__(self) -> int:
        return max(self.steps - self.start, 0)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for k in range(self.start, self.steps):
            first = k * self.batch_size + self.offset
            yield [(self.epoch, i) for i in self.order[first : first + self.local]]


def rng_state() -> dict[str, Any]:
    """The torch, numpy and python RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _count(names: list[str]) -> str:
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''}"


def _non_finite_state(state: dict[str, Any]) -> list[str]:
    """The NaN/inf tensors of a checkpoint's model and optimiser state."""
    return non_finite_tensors({"model": state.get("model", {}), "optimizer": state.get("optimizer", {})})


def training_stopped(checkpoint: str | os.PathLike, step: int, what: str) -> str:
    """The sentence that stops a diverged run: what went wrong, when, and whether the checkpoint is finite."""
    checkpoint = Path(checkpoint)
    advice = (
        "resuming with the same flags diverges again (training is deterministic), so start a new --out with a lower "
        "--lr-weights / --lr-biases or a longer --warmup-epochs"
    )
    if checkpoint.exists():
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
            kept_step, bad = int(state["step"]), _non_finite_state(state)
        except Exception:  # an unreadable file is reported as such; the sentence still has to be written
            kept = f"{checkpoint} is kept but could not be read back"
        else:
            if bad:
                kept = f"{checkpoint} (step {kept_step}) is kept but holds NaN or inf ({first_few(bad, 3)})"
                advice = "it cannot be resumed, so start again with --overwrite or a new --out"
            else:
                kept = f"the last good checkpoint {checkpoint} (step {kept_step}, every tensor finite) is kept"
    else:
        kept = "no checkpoint was written yet"
    return f"{what} at step {step}; training stopped and {kept}; {advice}"


def save_checkpoint(path: str | os.PathLike, **state: Any) -> Path:
    """Write a full training checkpoint atomically; a NaN or inf tensor raises RuntimeError and writes nothing."""
    bad = _non_finite_state(state)
    if bad:
        raise RuntimeError(
            training_stopped(
                path,
                int(state.get("step", -1)),
                f"{_count(bad)} of the training state became NaN or inf ({first_few(bad, 3)})",
            )
        )
    return atomic_torch_save({**state, "rng": rng_state()}, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``save_checkpoint`` file safely (CheckpointError for code, no checkpoint, or NaN/inf tensors)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    state = read_file(path)  # refuses code and non-checkpoints in one sentence (CheckpointError)
    missing = [k for k in ("model", "optimizer", "step", "config", "rng") if k not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks the keys {missing}; expected one written by bt-hub pretrain")
    bad = _non_finite_state(state)
    if bad:
        raise CheckpointError(
            f"checkpoint {path} holds NaN or inf in {_count(bad)} ({first_few(bad, 3)}), "
            "so it cannot be resumed; resume from an intact copy, or start again with --overwrite or a new --out"
        )
    return state
