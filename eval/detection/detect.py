"""``bt-hub detect``: Faster/Mask R-CNN R50-C4 transfer (docs/protocols.md §3) on one of two engines."""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from bt_hub.common.config import REQUIRED, RunConfig, option, out_field
from bt_hub.common.optional import require
from bt_hub.common.runs import check_run_dir, claimed_run_dir
from bt_hub.eval.config import LoadedWeights, load_weights
from bt_hub.eval.detection.config import CONFIGS, build_cfg, load_settings, opts_overrides, resolve_config
from bt_hub.eval.report import DETECTION_METRICS, PaperRow, Table
from bt_hub.eval.runner import Scored, build_record, write_records

__all__ = ["DetectConfig", "aggregate_trials", "main", "prepare_weights", "resolve_engine"]

INSTALL_PURPOSE = "bt-hub detect --engine detectron2 (detection transfer)"
ENGINES = ("auto", "torchvision", "detectron2")
_TASK = "object-detection"  # the Hugging Face task type
# the results.md table and the paper's row of each shipped config; other data gets the last table and no row
TABLES = {
    "voc": Table("Detection transfer: VOC07+12 Faster R-CNN R50-C4 (paper Table 4)", DETECTION_METRICS[:3], task=_TASK),
    "coco": Table("Detection transfer: COCO Mask R-CNN R50-C4 1x (paper Table 4)", DETECTION_METRICS, task=_TASK),
    None: Table(
        "Detection on other data (e.g. the generated shapes of the installation check; no paper row)",
        DETECTION_METRICS,
        task=_TASK,
    ),
}
PAPER_ROWS = {
    "voc": PaperRow(
        "voc07+12_faster_rcnn_c4",
        "VOC07+12 (test: VOC07 test)",
        "preset voc; Faster R-CNN R50-C4, 24k iterations, 5 trials",
        ("voc", "vocdevkit", "voc0712", "voc2007", "voc2012"),
        4952,
    ),
    "coco": PaperRow(
        "coco_mask_rcnn_c4_1x",
        "COCO 2017 (test: val2017)",
        "preset coco; Mask R-CNN R50-C4, 1x schedule",
        ("coco", "coco2017", "mscoco"),
        5000,
    ),
}
# overrides that change how a run executes, not what a trial computes: the paper's row still applies
EXECUTION_OVERRIDES = ("trials", "DATALOADER.NUM_WORKERS", "SOLVER.CHECKPOINT_PERIOD")


@dataclass
class DetectConfig(RunConfig):
    """Flags of ``bt-hub detect``; defaults are the paper's runs (docs/protocols.md §3)."""

    weights: str = option(
        REQUIRED, "backbone weights: a detectron2 .pkl, or anything load_backbone reads (converted to .pkl in --out)"
    )
    data: str = option(
        REQUIRED,
        "data root: VOC2007/ and VOC2012/ devkits (voc), or annotations/instances_{train,val}2017.json + "
        "train2017/ + val2017/ (coco)",
    )
    detection_config: str = option(
        "voc",
        "'voc' (Faster R-CNN, VOC07+12, 24k), 'coco' (Mask R-CNN, COCO 1x), 'shapes-voc' / 'shapes-coco' "
        "(the installation check on make-detection-data output) or a YAML path",
    )
    engine: Literal["auto", "torchvision", "detectron2"] = option(
        "auto",
        "detectron2, or torchvision's Faster/Mask R-CNN built as the same C4 model; auto: detectron2 "
        "when importable, else torchvision",
    )
    out: str = out_field(
        "runs/detect",
        "output directory: results.json, weights.pkl, trial<k>/ (config.yaml, metrics.jsonl, checkpoints, log)",
    )
    num_gpus: int = option(
        1,
        "detectron2: processes per machine (one per GPU); batch, lr and iterations rescale linearly from "
        "the configs' 8 (SOLVER.REFERENCE_WORLD_SIZE). torchvision: run under torchrun instead",
    )
    num_machines: int = option(1, "machines in the job")
    machine_rank: int = option(0, "this machine's rank (0 writes results.json)")
    dist_url: str = option(
        "auto", "rendezvous URL, e.g. tcp://HOST:PORT; 'auto' picks a free local port (one machine only)"
    )
    trials: int = option(
        1, "independent runs with seeds seed..seed+K-1; results are mean and std (MoCo averages 5 on VOC)"
    )
    resume: bool = option(False, "continue each trial from the last checkpoint in its folder")
    opts: list[str] = option([], "detectron2 overrides KEY VALUE ..., e.g. SOLVER.IMS_PER_BATCH 8", positional=True)

    ALIASES: ClassVar[tuple[str, ...]] = tuple(CONFIGS)
    RUN_FIELDS: ClassVar[tuple[str, ...]] = RunConfig.RUN_FIELDS + (
        "weights",
        "data",
        "detection_config",
        "resume",
        "num_gpus",
        "num_machines",
        "machine_rank",
        "dist_url",
    )

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--num-gpus", self.num_gpus, 1),
            ("--num-machines", self.num_machines, 1),
            ("--trials", self.trials, 1),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if not 0 <= self.machine_rank < self.num_machines:
            raise ValueError(f"--machine-rank must be in [0, {self.num_machines}), got {self.machine_rank}")
        if self.num_machines > 1 and not self.dist_url.startswith("tcp://"):
            raise ValueError(
                f"--dist-url must be tcp://HOST:PORT of machine 0 when --num-machines > 1, got {self.dist_url!r}"
            )
        super().__post_init__()
        if not str(self.weights).strip():
            raise ValueError("--weights must name a checkpoint, got an empty string")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.opts = list(self.opts)
        # last: the flags above are cheaper to get wrong
        check_run_dir(self.out, kind="detect", overwrite=self.overwrite)


def resolve_engine(engine: str) -> str:
    """``auto`` -> ``detectron2`` when it is importable, else ``torchvision``; others unchanged."""
    if engine != "auto":
        return engine
    try:
        import detectron2  # noqa: F401
    except ImportError:
        return "torchvision"
    return "detectron2"


def prepare_weights(weights: LoadedWeights, out_dir: Path) -> tuple[str, dict[str, Any]]:
    """``MODEL.WEIGHTS`` (a ``.pkl`` as is, else ``out_dir/weights.pkl``) and the backbone's detectron2 tensors."""
    from bt_hub.weights.export import save_detectron2, to_detectron2

    state = weights.network.state_dict()
    if weights.source.endswith(".pkl") and Path(weights.source).is_file():
        return str(Path(weights.source).resolve()), to_detectron2(state)["model"]
    path = save_detectron2(state, out_dir / "weights.pkl")
    return str(path), to_detectron2(state)["model"]


def aggregate_trials(trials: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the trials, plus ``<metric>_std`` (sample std) when K > 1."""
    names = list(dict.fromkeys(k for t in trials for k in t))
    out: dict[str, float] = {}
    for name in names:
        values = [t[name] for t in trials if name in t]
        out[name] = statistics.fmean(values)
        if len(trials) > 1:
            out[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else float("nan")
    return out


def main(config: DetectConfig) -> dict[str, Any] | None:
    """Run ``config.trials`` detection transfers; the record on the main process, else None."""
    start = time.time()
    engine = resolve_engine(config.engine)
    with claimed_run_dir(Path(config.out).expanduser(), kind="detect", overwrite=config.overwrite) as out:
        return _main(config, engine, out.resolve(), start)


def _main(config: DetectConfig, engine: str, out: Path, start: float) -> dict[str, Any] | None:
    yaml_path = resolve_config(config.detection_config)
    depth = load_settings(yaml_path, config.opts)["MODEL.RESNETS.DEPTH"]
    _check_engine(config, engine)  # before the weights are read: a missing engine is the first thing to say
    weights = load_weights(config.weights, arch=f"resnet{depth}", small_image_stem=False)  # one read, one hash
    run = _detectron2_trials if engine == "detectron2" else _torchvision_trials
    trials = run(config, weights, yaml_path, out)
    if trials is None:
        return None
    return _write(config, weights, engine, yaml_path, trials, start)


def _check_engine(config: DetectConfig, engine: str) -> None:
    """detectron2 importable for its engine; the torchvision engine given none of detectron2's launcher flags."""
    if engine == "detectron2":
        require("detectron2", INSTALL_PURPOSE)
    elif (config.num_gpus, config.num_machines, config.machine_rank, config.dist_url) != (1, 1, 0, "auto"):
        raise ValueError(
            "--engine torchvision runs one process per GPU under torchrun (torchrun --nproc-per-node N -m bt_hub.cli "
            "detect --engine torchvision ...); --num-gpus, --num-machines, --machine-rank and --dist-url are "
            "detectron2's launcher flags"
        )


def _detectron2_trials(
    config: DetectConfig, loaded: LoadedWeights, yaml_path: Path, out: Path
) -> list[dict[str, Any]] | None:
    from detectron2.engine import launch

    from bt_hub.eval.detection.detectron2_engine.trainer import run_trial
    from bt_hub.eval.detection.evaluation import TRIAL_METRICS

    weights, expected = prepare_weights(loaded, out)
    seeds = [config.seed + k for k in range(config.trials)]
    trial_dirs = [out / f"trial{k}" for k in range(config.trials)]
    cfgs = [
        build_cfg(yaml_path, config.opts, weights=weights, device=config.device, seed=s, output_dir=d)
        for s, d in zip(seeds, trial_dirs)
    ]
    for cfg in cfgs:
        launch(
            run_trial,
            config.num_gpus,
            num_machines=config.num_machines,
            machine_rank=config.machine_rank,
            dist_url=config.dist_url,
            args=(
                cfg,
                str(Path(config.data).expanduser().resolve()),
                None if config.resume else expected,
                config.resume,
            ),
        )
    if config.machine_rank != 0:
        return None
    return [json.loads((d / TRIAL_METRICS).read_text()) for d in trial_dirs]


def _torchvision_trials(
    config: DetectConfig, weights: LoadedWeights, yaml_path: Path, out: Path
) -> list[dict[str, Any]] | None:
    from bt_hub.common.distributed import is_main_process, process_group
    from bt_hub.eval.detection.torchvision_engine.trainer import run_trial

    settings = load_settings(yaml_path, config.opts)
    expected = {k: v.clone() for k, v in weights.network.state_dict().items()}
    data_root = str(Path(config.data).expanduser().resolve())
    trials = []
    with process_group(config.device) as device:
        for k in range(config.trials):
            resnet = copy.deepcopy(weights.network)  # every trial starts from the weights as loaded
            trials.append(
                run_trial(
                    settings,
                    data_root=data_root,
                    resnet=resnet,
                    expected=None if config.resume else expected,
                    out=out / f"trial{k}",
                    seed=config.seed + k,
                    device=device,
                    resume=config.resume,
                )
            )
        main_process = is_main_process()
    return trials if main_process else None


def _write(
    config: DetectConfig,
    weights: LoadedWeights,
    engine: str,
    yaml_path: Path,
    trials: list[dict[str, Any]],
    start: float,
) -> dict[str, Any]:
    """Write the record (results.json, .jsonl, .md) and return it.

    Its ``overrides`` include every opt that changes the config, so a shortened run never reads like its
    preset; the paper's row applies only when nothing but ``EXECUTION_OVERRIDES`` changed.
    """
    from bt_hub.common.config import config_dict, overrides
    from bt_hub.data.datasets import dataset_fingerprint

    preset = config.detection_config if config.detection_config in DetectConfig.ALIASES else yaml_path.stem
    changed = {
        **overrides(config, ignore=(*DetectConfig.RUN_FIELDS, "engine", "opts")),
        **opts_overrides(yaml_path, config.opts),
    }
    scored = Scored(
        aggregate_trials([t["metrics"] for t in trials]),
        preset=preset,
        paper=PAPER_ROWS.get(str(preset)) if set(changed) <= set(EXECUTION_OVERRIDES) else None,
        table=TABLES.get(str(preset), TABLES[None]),
        notes={"engine": engine, "trials": [{"seed": t["seed"], "metrics": t["metrics"]} for t in trials]},
        protocol="detect",
    )
    record = build_record(
        scored,
        hyperparameters={
            **config_dict(config),
            "engine": engine,
            "detection_config_file": str(yaml_path),  # config_file: the --config file, if any
            "resolved_config": trials[0]["config"],
        },
        weights=weights,
        dataset={
            "name": Path(str(config.data)).name or str(config.data),
            "path": str(config.data),
            "fingerprint": dataset_fingerprint(config.data),
        },
        seed=config.seed,
        wall_time_s=time.time() - start,
        overrides=changed,
    )
    write_records(config.out, [record])
    return record
