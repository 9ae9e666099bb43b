"""The flags of ``bt-hub pretrain`` (``PretrainConfig``, its presets and checks) and what a resumed run must keep."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from bt_hub.common.config import RunConfig, check_image_size, option, out_field
from bt_hub.data.decode import nvimgcodec
from bt_hub.data.decode_auto import check_decode
from bt_hub.method.loss import LAMBD
from bt_hub.method.model import ARCHITECTURES, parse_projector

# Settings a resumed run must share with its checkpoint (the rest may change, e.g. --max-steps).
RESUME_INVARIANTS = (
    "data",
    "backbone",
    "projector",
    "lambd",
    "small_image_stem",
    "image_size",
    "epochs",
    "batch_size",
    "lr_weights",
    "lr_biases",
    "weight_decay",
    "warmup_epochs",
    "loss_method",
    "reference_grad_scale",
    "precision",
    "views",
    "seed",
    "crop_scale_min",
    "flip",
    "blur",
)
MAX_PROJECTOR_WIDTH = 32_768  # a width-w projector layer holds w^2 weights; the paper's widest is 16384


@dataclass
class PretrainConfig(RunConfig):
    """Flags of ``bt-hub pretrain``; defaults are the paper's recipe (docs/protocols.md §1)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "reference": {},
        # The 8-px digits (bt-hub demo pretrains with exactly this): a 32-d output, whose 32 x 32
        # cross-correlation a batch of 256 estimates well; LR 8 (the paper's 0.2 is far too slow for
        # 200 steps), biases at the paper's biases : weights ratio; larger crops, no flips (digits are
        # not mirror-symmetric) and no blur (it smears 8-px strokes away). Batch and epochs were chosen
        # by benchmarks/small_image_recipe.py on a held-out part of the training split (table in
        # docs/pretraining.md): batch 256 x 40 epochs beat batch 64 x 20 epochs on kNN at a like cost.
        "digits": {
            "data": "digits",
            "backbone": "resnet18",
            "small_image_stem": True,
            "projector": "128-128-32",
            "lambd": 0.1,
            "image_size": 8,
            "crop_scale_min": 0.4,
            "flip": False,
            "blur": False,
            "epochs": 40,
            "batch_size": 256,
            "lr_weights": 8.0,
            "lr_biases": 8.0 * (0.0048 / 0.2),
            "warmup_epochs": 1,
            "views": "batched",
        },
        # 28-64 px data (CIFAR-10/100, STL-10 downscaled): solo-learn's CIFAR recipe
        # (scripts/pretrain/cifar/barlow.yaml + augmentations/asymmetric.yaml: ResNet-18 with a
        # 3x3 stem, projector 2048-2048-2048, batch 256, LARS lr 0.3 with eta 0.02, loss x 0.1,
        # wd 1e-4, 10 warm-up epochs + cosine, 1000 epochs, no blur, solarise 0 / 0.2), in our
        # units: LARS here has eta 0.001 and an unscaled loss, so the weights' lr is 0.3 x 0.02 /
        # 0.001 = 6, the biases' (no LARS adaptation) 0.3 x 0.1 = 0.03 and the weight decay 1e-4 /
        # 0.1 = 1e-3. lightly's CIFAR-10 benchmark (docs/.../cifar10_benchmark.py) also trains
        # its Barlow Twins ResNet-18 with a 2048-d projector, batch 128-512 and no blur.
        "cifar": {
            "backbone": "resnet18",
            "small_image_stem": True,
            "projector": "2048-2048-2048",
            "image_size": 32,
            "batch_size": 256,
            "lr_weights": 6.0,
            "lr_biases": 0.03,
            "weight_decay": 1e-3,
            "warmup_epochs": 10,
            "epochs": 1000,
            "blur": False,
            "views": "batched",
        },
    }

    data: str = option("digits", "'digits' (embedded), 'synthetic[:N]', or an ImageFolder / ImageNet directory")
    out: str = out_field("runs/pretrain", "run directory (checkpoint, metrics, final weights)")
    backbone: str = option(
        "resnet50", "torchvision ResNet", flag="arch", aliases=("backbone",), choices=tuple(ARCHITECTURES)
    )
    projector: str = option("8192-8192-8192", "projector widths joined by '-'")
    lambd: float = option(LAMBD, "weight of the redundancy-reduction term")
    small_image_stem: bool = option(False, "3x3 stem without max-pool, for 32-px images")
    image_size: int = option(224, "side of the views in pixels")
    crop_scale_min: float = option(
        0.08,
        "smallest area fraction of the views' random resized crop (paper: 0.08; tiny images such as the "
        "8-px digits want more)",
    )
    flip: bool = option(
        True,
        "random horizontal flips in both views (paper: p = 0.5); --no-flip for images that are not "
        "mirror-symmetric, such as digits",
    )
    blur: bool = option(
        True,
        "Gaussian blur in the views (paper: p = 1.0 / 0.1, σ in [0.1, 2] px); --no-blur for tiny images, "
        "where even the 3x3 kernel smears every stroke",
    )
    epochs: int = option(1000, "epochs of the schedule")
    batch_size: int = option(2048, "global batch size (all processes together)")
    lr_weights: float = option(0.2, "base LR of weights, × batch/256")
    lr_biases: float = option(0.0048, "base LR of biases and BN parameters, × batch/256")
    weight_decay: float = option(1e-6, "LARS weight decay (not on biases/BN)")
    warmup_epochs: int = option(10, "linear warm-up epochs before the cosine decay")
    loss_method: Literal["auto", "dense", "gram"] = option("auto", "loss form: D x D, N x N, or the cheaper")
    reference_grad_scale: bool = option(False, "reproduce the reference code's 1/world_size gradients")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto",
        "autocast dtype (fp16 only on CUDA, with a GradScaler); auto: bf16 on GPUs with bf16; on a CPU "
        "the faster of fp32 and bf16 on a micro-benchmark timed once per CPU model and torch version and cached "
        "(the choice, why and both times are recorded in run.json and config.json)",
    )
    channels_last: Literal["auto", "on", "off"] = option(
        "auto",
        "channels-last memory format for the backbone and its inputs; auto: on where the precision is bf16 "
        "or fp16 (AMX/avx512_bf16 CPUs and GPUs run those convolutions fastest channels-last), off for fp32 "
        "(the choice is recorded in run.json and config.json)",
    )
    compile: Literal["auto", "on", "off"] = option(
        "auto",
        "torch.compile the forward pass and the loss (minutes of compiling at the start, then ~25% less "
        "per step); auto: on when the first eager steps' time x the steps left says it repays itself "
        "(bt_hub/train/compile_auto.py); the path taken and why go to config.json",
    )
    views: Literal["pil", "batched"] = option(
        "pil", "augment per image in loader workers (pil) or per batch on the device (batched)"
    )
    decode: Literal["auto", "device", "nvimgcodec", "pil", "workers"] = option(
        "auto",
        "image files with --views batched: workers read bytes and the device decodes the batch (device: "
        "torchvision's nvJPEG; nvimgcodec: nvImageCodec, pip install 'bt_hub[nvimgcodec]'), or the workers decode "
        "every file with PIL (pil, workers); auto: as bt-hub eval's, the decoders at hand timed on the data's first "
        "JPEGs and checked against PIL's pixels, the faster one that matches, the workers decoding a share of each "
        "batch on CUDA; with --views pil: workers",
    )
    store: Literal["auto", "off", "disk", "device"] = option(
        "auto",
        "with --views batched on a folder: decode it once into a store of whole images that every epoch "
        "reads (bt_hub/data/store.py; its size is printed first), in GPU memory (device) or memory-mapped (disk); "
        "auto: on the CPU, for images up to 128 px that fit half the free disk (on CUDA the loader workers "
        "decoding every epoch measured faster); off: decode the files every epoch",
    )
    store_dir: str | None = option(
        None, "where --store keeps decoded stores (default $BT_HUB_CACHE/decoded or ~/.cache/bt_hub/decoded)"
    )
    num_workers: int = option(0, "data-loader worker processes per rank")
    checkpoint_every: int = option(
        500, "steps between checkpoints (one is also written at each epoch end); 0: epoch ends only"
    )
    keep_every: str = option(
        "0",
        "keep the backbone's weights for a learning curve (bt-hub eval compare --over-steps): every N "
        "steps, 'log' (steps 1, 2, 4, 8, ...) or at the steps listed ('100,400'); and at the last step; as "
        "kept/step-NNNNNN.safetensors (no optimizer state); 0: off",
    )
    resume: str | None = option(None, "'auto': continue OUT/checkpoint.pth if present; or a checkpoint path")
    max_steps: int = option(0, "stop after this many steps in all (0: the whole schedule); the schedule is unchanged")
    log_every: int = option(10, "steps between metrics lines (and progress lines when not on a terminal)")
    monitor_knn: int = option(
        0,
        "every this many steps, weighted kNN top-1 (k = 20, T = 0.07) of the backbone's features on a "
        "small labelled bank, logged and shown in the progress bar, and RankMe of the bank's features, logged (0: off)",
    )
    monitor_data: str | None = option(
        None,
        "labelled data of the kNN monitor (as --data; its train split is the bank, its val/test split "
        "the queries); default: --data's training and held-out splits",
    )
    monitor_size: int = option(2000, "bank images of the kNN monitor (queries: a quarter of it, at most 500)")
    tensorboard: bool = option(
        False, "also write the metrics as TensorBoard scalars to OUT/tensorboard (needs the tensorboard package)"
    )
    probe_max_dim: int = option(
        2048, "record the probe batch's cross-correlation when the projector output is at most this wide"
    )

    def __post_init__(self) -> None:
        for name in ("lambd", "lr_weights", "lr_biases", "weight_decay", "crop_scale_min"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{self.flag(name)} must be a finite number, got {getattr(self, name)}")
        positive = ("image_size", "epochs", "batch_size", "log_every", "monitor_size", "lr_weights", "lr_biases")
        self.require_positive(*positive)
        check_image_size(self.image_size, "pretrain", self.flag("image_size"))
        nonnegative = ("lambd", "weight_decay", "warmup_epochs", "num_workers", "checkpoint_every", "max_steps")
        self.require_positive(*nonnegative, "probe_max_dim", "monitor_knn", or_zero=True)
        self.require_fraction("crop_scale_min")
        self.keep_every = str(self.keep_every)
        if self.keep_every != "log" and not self.keep_every.replace(",", "").isdigit():
            raise ValueError(
                "--keep-every must be a number of steps (0: off), 'log' or steps joined by ',', got "
                f"{self.keep_every!r}"
            )
        try:
            widths = parse_projector(self.projector)
        except ValueError as err:
            raise ValueError(f"{self.flag('projector')}: {err}") from None
        if max(widths) > MAX_PROJECTOR_WIDTH:
            raise ValueError(
                f"{self.flag('projector')} {self.projector} has a layer of {max(widths)} units, more than the "
                f"{MAX_PROJECTOR_WIDTH} bt-hub pretrain accepts (the paper's is 8192-8192-8192); choose narrower widths"
            )
        if self.backbone not in ARCHITECTURES:
            raise ValueError(
                f"{self.flag('backbone')} {self.backbone!r} is unknown; expected one of {sorted(ARCHITECTURES)}"
            )
        super().__post_init__()
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ValueError("--precision fp16 needs --device cuda; use bf16 on CPU")
        check_decode(self.decode, self.views)  # an impossible --decode / --views pair fails here
        if self.decode == "nvimgcodec":
            nvimgcodec()  # a missing extra is refused here, before the run claims --out
        if self.store in ("disk", "device") and self.views != "batched":
            raise ValueError(
                f"--store {self.store} keeps a folder decoded once for --views batched; with --views {self.views} the "
                "loader workers decode and augment every image each epoch: pass --views batched or leave --store out"
            )

    def keeps(self, step: int, last_step: int) -> bool:
        """Whether ``--keep-every`` keeps the weights of ``step`` (the last step too, whenever it keeps any)."""
        if self.keep_every == "log":
            return step & (step - 1) == 0 or step == last_step
        if "," in self.keep_every:
            return step in {int(s) for s in self.keep_every.split(",") if s} or step == last_step
        every = int(self.keep_every)
        return every > 0 and (step % every == 0 or step == last_step)

    def schedule_steps(self, num_images: int, start: int = 0) -> tuple[int, int, int]:
        """(total, warm-up, last) steps of a schedule over ``num_images`` training images.

        Refuses, in one message, every way the schedule cannot be what was meant (a batch larger than the data, a
        warm-up longer than the schedule, a ``--max-steps`` past it), then names all the flags of a short trial run
        that fits, so a first ``--max-steps 20`` is not refused flag after flag; and a ``--max-steps`` before the
        resumed ``start``.
        """
        steps_per_epoch = num_images // self.batch_size
        total = self.epochs * steps_per_epoch
        problems = []
        if steps_per_epoch == 0:
            problems.append(
                f"--batch-size {self.batch_size} is larger than the {num_images} training images of --data {self.data}"
            )
        if self.warmup_epochs > self.epochs:
            problems.append(
                f"--warmup-epochs {self.warmup_epochs} is longer than the whole schedule (--epochs {self.epochs})"
            )
        if steps_per_epoch and self.max_steps > total:
            problems.append(
                f"--max-steps {self.max_steps} is more than the {total} steps of the schedule (--epochs "
                f"{self.epochs} x {steps_per_epoch} steps per epoch)"
            )
        if problems:
            raise ValueError("; ".join(problems) + "; " + self.short_run(num_images))
        last = self.max_steps or total
        if start > last:
            raise ValueError(
                f"--max-steps {self.max_steps} is before step {start} of the checkpoint being resumed; raise "
                "--max-steps"
            )
        return total, self.warmup_epochs * steps_per_epoch, last

    def short_run(self, num_images: int) -> str:
        """The flags of a short trial run on ``num_images`` images that the schedule checks accept, in words."""
        steps = self.max_steps or 20
        batch = self.batch_size if self.batch_size <= num_images else 2 ** int(math.log2(max(1, min(num_images, 256))))
        epochs = math.ceil(steps / (num_images // batch))
        return (
            f"for a short trial run pass these together: --batch-size {batch} --epochs {epochs} --warmup-epochs 0 "
            f"--max-steps {steps} ({steps} steps of {batch} of the {num_images} images; --max-steps alone stops the "
            "paper's 1000-epoch schedule early without shortening it)"
        )
