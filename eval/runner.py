"""One evaluation run, start to end: the one place that claims, loads, resolves and records."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from bt_hub.common.artifacts import READ_ONLY, not_writable
from bt_hub.common.config import config_dict, overrides
from bt_hub.common.distributed import broadcast_object, is_main_process, process_group
from bt_hub.common.files import WriteError, atomic_write_json, remove_stale_temp_files
from bt_hub.common.progress import announce
from bt_hub.common.records import SCHEMA, Record, make_record
from bt_hub.common.reuse import changed_input
from bt_hub.common.runs import claim_run_dir, claimed_run_dir
from bt_hub.data.store import DecodedImages, StoreView, fits_auto, open_store, store_device
from bt_hub.eval.config import LoadedWeights, Settings, decode_settings, load_weights, resolve_settings
from bt_hub.eval.feature_cache import FeatureCache
from bt_hub.eval.features import Pool, architecture_fingerprint, extract_with_source
from bt_hub.eval.protocols import Protocol
from bt_hub.eval.report import PaperRow, Table, append_results, check_history, load_results
from bt_hub.eval.splits import Splits, load_splits
from bt_hub.method.transforms import DeviceEvalTransform, eval_transforms


@dataclass
class Scored:
    """What a protocol's scoring step returns: the metrics and what the record says about them."""

    metrics: Mapping[str, float]
    mode: str | None = None
    preset: str | None = None
    paper: PaperRow | None = None  # the paper's number this run follows
    table: Table | None = None  # the results.md table of its records
    labels: Mapping[str, Any] | None = None
    notes: Mapping[str, Any] | None = None
    warnings: Sequence[str] = ()
    dataset: Mapping[str, Any] | None = None  # the splits' facts, when the protocol built its own splits
    protocol: str = ""  # the table entry's name (the runner sets it: run_protocol, run_child); embed, detect say theirs
    correct: np.ndarray | None = None  # per test image, whether its top-1 was right (compare's verdicts; in no record)


class Cell(typing.Protocol):
    """What a protocol's ``score_cell`` scores: an :class:`EvalRun`, or a row of ``eval compare`` (its network on the
    run's splits, features extracted once per network); a ``score_cell`` reads every knob from its config."""

    progress: ClassVar[bool]  # whether the protocol shows its own progress lines

    @property
    def network(self) -> nn.Module:
        """The network scored."""

    @property
    def splits(self) -> Splits:
        """The train / test splits."""

    @property
    def device(self) -> torch.device:
        """Where to compute."""

    @property
    def settings(self) -> Settings:
        """What the evaluation resolved (image size, precision)."""

    def features(self, split: str) -> tuple[Any, Any]:
        """Features and labels of ``split`` (``train`` or ``test``)."""


@dataclass
class EvalRun:
    """An evaluation in progress: its config (read only), folder, device, weights, settings, splits and features."""

    config: Any
    out: Path | None
    device: torch.device
    all_weights: list[LoadedWeights]
    settings: Settings
    features_used: dict[str, str] = field(default_factory=dict)
    given_splits: Splits | None = None  # splits made elsewhere (tests, planted features) instead of --data's
    reuses_splits: bool = False  # the command extracts each split several times (eval all, compare)
    _splits: dict[tuple[Any, ...], Splits] = field(default_factory=dict)
    _stores: dict[tuple[Any, ...], Dataset] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    progress: ClassVar[bool] = True  # the protocols' own progress lines (a compare row has compare's instead)

    @property
    def weights(self) -> LoadedWeights:
        """The (first) weights under evaluation."""
        return self.all_weights[0]

    @property
    def network(self) -> nn.Module:
        """The network of the (first) weights: what a protocol's ``score_cell`` scores."""
        return self.weights.network

    @property
    def splits(self) -> Splits:
        """The train / test splits of ``--data`` at the run's image size (built once, shared with child runs)."""
        if self.given_splits is not None:
            return self.given_splits
        c = self.config
        test_split = c.test_split if "test" in getattr(c, "splits", ["test"]) else None  # embed --splits train
        key = (c.data, test_split, c.holdout, c.seed, self.settings.image_size, getattr(c, "SCORED", True))
        if key not in self._splits:
            size, scored = self.settings.image_size, key[-1]
            self._splits[key] = load_splits(
                c.data, test_split=test_split, holdout=c.holdout, seed=c.seed, image_size=size, scored=scored
            )
        return self._splits[key]

    def child(self, config: Any, out: Path | None) -> EvalRun:
        """The same weights, settings and splits under another protocol's config and folder (``eval all``)."""
        if out is not None and is_main_process():
            claim_run_dir(out, overwrite=config.overwrite, kind="eval")
        same = config.decode == self.config.decode  # eval all's children: resolved (and timed) once
        settings = self.settings if same else dataclasses.replace(self.settings, **decode_settings(config, self.device))
        shared = {"reuses_splits": self.reuses_splits, "_splits": self._splits, "_stores": self._stores}
        return EvalRun(config, out, self.device, self.all_weights, settings, **shared)

    def transform(self) -> Callable[[Any], torch.Tensor]:
        """The test transform at the run's image size: on the device, or PIL in the workers (``--decode workers``)."""
        size = self.settings.image_size
        return eval_transforms(size) if self.settings.decode == "workers" else DeviceEvalTransform(size)

    def decoded(self, split: str) -> Dataset:
        """The split's images from its decoded store (``--store``, see :mod:`bt_hub.data.store`), made once per run
        (in ``--cache-dir``/decoded, else in memory) and shared with child runs; the split itself when no store
        applies: ``--store off``, PIL transforms, in-memory sets, or ``auto`` on a run that extracts each split
        once without a feature cache."""
        dataset, mode, transform = getattr(self.splits, split), self.config.store, self.transform()
        if mode == "off" or not isinstance(transform, DeviceEvalTransform) or not getattr(dataset, "samples", None):
            return dataset
        cache_dir = self.config.cache_dir
        directory = Path(cache_dir) / "decoded" if cache_dir else None
        view = StoreView.for_eval(transform)
        reused = bool(cache_dir) or self.reuses_splits
        if mode == "auto" and not (reused and fits_auto(len(dataset), 3 * transform.image_size**2, directory)):
            return dataset
        key = self._store_key(split)
        if key not in self._stores:
            store = open_store(
                dataset,
                view,
                directory,
                num_workers=self.config.num_workers,
                desc=f"decode {split}",
                flag="--cache-dir",
            )
            where = store_device(mode, store.nbytes, self.device)
            self._stores[key] = store.to(where) if where.type != "cpu" else store
        return self._stores[key]

    def _store_key(self, split: str) -> tuple[Any, ...]:
        c = self.config
        return (split, id(getattr(self.splits, split)), self.settings.image_size, c.cache_dir, c.store)

    def features(
        self,
        split: str,
        *,
        network: nn.Module | None = None,
        weights_id: str | None = None,
        dataset: Dataset | None = None,
        dataset_id: str | None = None,
        transform: Callable[[Any], torch.Tensor] | None = None,
        pool: Pool = "avg",
        label: str | None = None,
    ) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
        """Features and labels of a split (or ``dataset``) of the run's weights (or ``network``), through the cache."""
        network = network if network is not None else self.weights.network
        weights_id = weights_id or self.weights.sha256
        stored = None
        if dataset is None:
            dataset, stored = getattr(self.splits, split), lambda: self.decoded(split)
            dataset_id = self.splits.info[split]["fingerprint"]
        cache_dir = self.config.cache_dir
        cache = (
            FeatureCache(cache_dir, weights_id, dataset_id, architecture_fingerprint(network)) if cache_dir else None
        )
        name = label or split
        try:
            features, labels, source = extract_with_source(
                network,
                dataset,
                transform=transform or self.transform(),
                pool=pool,
                batch_size=self.config.batch_size,
                device=self.device,
                num_workers=self.config.num_workers,
                cache=cache,
                dtype=self.config.cache_dtype,
                desc=f"features {name}",
                precision=self.settings.precision,
                stored=stored,
                decoding=self.settings.decoding,
            )
        except WriteError as err:  # a feature cache on read-only storage: what is whole there was read
            if cache_dir and err.errno in READ_ONLY:
                raise not_writable(Path(cache_dir), err, "--cache-dir") from None
            raise
        store = self._stores.get(self._store_key(split)) if stored is not None else None
        used = isinstance(store, DecodedImages) and source.startswith("computed")
        self.features_used[name] = source + (f", images {store.where}" if used else "")  # type: ignore[union-attr]
        return features, labels

    def record(
        self,
        scored: Scored,
        *,
        weights: Mapping[str, Any] | None = None,
        seed: int | None = None,
        config: Any = None,
        wall_time_s: float | None = None,
    ) -> Record:
        """The results record of ``scored`` (its ``protocol`` set); weights, seed, config and wall time default to the
        run's."""
        config = config or self.config
        changed = (
            overrides(config, ignore=getattr(config, "RUN_FIELDS", ())) if dataclasses.is_dataclass(config) else {}
        )
        hyper = {
            **config_dict(config),
            "image_size": self.settings.image_size,
            "image_size_from": self.settings.image_size_from,
            "precision": self.settings.precision,
            "decode": self.settings.decode,
            "features": dict(self.features_used),
        }
        return build_record(
            scored,
            hyperparameters=hyper,
            weights=weights if weights is not None else self.weights,
            dataset=scored.dataset if scored.dataset is not None else self.splits.info,
            seed=config.seed if seed is None else seed,
            wall_time_s=time.perf_counter() - self.started if wall_time_s is None else wall_time_s,
            overrides=changed,
            settings=self.settings,
        )

    def finished(self, protocol: Protocol) -> tuple[Record | None, str | None]:
        """The newest record of ``protocol`` in the run's folder made from this run's inputs, every one of them
        (:func:`record_inputs`, asked through :func:`bt_hub.common.reuse.changed_input`); else None, and which input
        of the newest such record changed (None where the folder holds none)."""
        if self.out is None:
            return None, None
        own_data = getattr(protocol.load(), "dataset_info", None)  # a protocol on splits of its own (VOC07, semi)
        dataset = own_data(self) if own_data is not None else self.splits.info
        planned = record_inputs(self.record(Scored({}, dataset=dataset, protocol=protocol.name), wall_time_s=0.0))
        found = [r for r in load_results(self.out)[0] if r.get("protocol") == protocol.name]
        same = [r for r in found if changed_input("record", record_inputs(r), planned) is None]
        if same:
            return same[-1], None
        return None, changed_input("record", record_inputs(found[-1]), planned) if found else None

    def write(self, records: Sequence[Record], summary: Mapping[str, Any] | None = None) -> None:
        """:func:`write_records` into the run's folder (nothing without one, or off the main process)."""
        if self.out is not None and is_main_process():
            write_records(self.out, records, summary)


def build_record(
    scored: Scored,
    *,
    hyperparameters: Mapping[str, Any],
    weights: LoadedWeights | Mapping[str, Any],
    dataset: Mapping[str, Any],
    seed: int,
    wall_time_s: float,
    overrides: Mapping[str, Any] | None = None,
    settings: Settings | None = None,
) -> Record:
    """The one record builder (:func:`~bt_hub.common.records.make_record` over ``scored``): every protocol's,
    ``eval compare``'s, ``embed``'s and ``detect``'s record. ``hyperparameters`` is what the command ran with,
    ``settings`` what an evaluation resolved (detect's trials resolve their own, so its records carry none), and
    loaded ``weights`` are recorded by name and fingerprint (a baseline of ``eval compare`` gives its own mapping)."""
    if isinstance(weights, LoadedWeights):
        weights = {"name": weights.source, "fingerprint": weights.sha256}
    record = make_record(
        protocol=scored.protocol,
        metrics=scored.metrics,
        config=hyperparameters,
        preset=scored.preset,
        mode=scored.mode,
        weights=weights,
        dataset=dataset,
        seed=seed,
        wall_time_s=wall_time_s,
        overrides=overrides,
        labels=scored.labels,
        warnings=scored.warnings,
        notes=scored.notes,
        paper=scored.paper.block() if scored.paper else None,
        table=scored.table.block() if scored.table else None,
    )
    if settings is not None:
        record["settings"] = settings.as_dict()
    return record


# what a record says of where or how it ran, not of what it computed: the weights are compared by sha256, the
# features' cache, a value's source (``*_from``: a flag, the weights, the cache of a measurement) and what ``decode``
# and the device already say (who decoded, the decoders' measured pixels) are not
NOT_SETTINGS = (
    "features",
    "weights",
    "out",
    "overwrite",
    "threads",
    "config_file",
    "num_workers",
    "cache_dir",
    "decoder",
    "decoded_on",
    "decode_agreement",
)


def record_inputs(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a finished protocol record was made from (``INPUTS["record"]`` of :mod:`bt_hub.common.reuse`): the
    protocol, the weights' sha256, the fingerprints of the train and test splits (with the labelled subset where the
    protocol drew one) and the held-out split's facts, the resolved settings and the hyper-parameters, less
    ``NOT_SETTINGS`` and the ``*_from`` sources. ``eval all`` skips a run only where all of them are the same."""

    def kept(block: Mapping[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (block or {}).items() if k not in NOT_SETTINGS and not k.endswith("_from")}

    dataset = record.get("dataset") or {}
    split = {name: dataset.get(name) or {} for name in ("train", "test")}
    return {
        "protocol": record.get("protocol"),
        "weights": (record.get("weights") or {}).get("fingerprint"),
        "train split": [split["train"].get("fingerprint"), split["train"].get("labelled_indices_sha256")],
        "test split": split["test"].get("fingerprint"),
        "held-out split": dataset.get("holdout"),
        "settings": kept(record.get("settings")),
        "hyper-parameters": kept(record.get("hyperparameters")),
    }


def write_records(out: str | Path, records: Sequence[Record], summary: Mapping[str, Any] | None = None) -> None:
    """The one results writer: ``results.json`` (the record, or ``summary`` with ``schema``), ``results.jsonl``
    appended and ``results.md`` rewritten from the folder's whole history."""
    body = dict(records[0]) if summary is None and len(records) == 1 else {"schema": SCHEMA, **(summary or {})}
    if summary is None and len(records) != 1:
        body["results"] = list(records)
    atomic_write_json(Path(out) / "results.json", body)
    append_results(out, records)


@contextlib.contextmanager
def evaluation(config: Any, *, kind: str = "eval", weights: list[str] | None = None) -> Iterator[EvalRun]:
    """Claim ``config.out``, load the weights (``config.weights``, or the files ``weights`` derived from it) once,
    resolve the settings; the run, for one block."""
    out = Path(config.out) if config.out is not None else None
    with process_group(config.device) as device, contextlib.ExitStack() as claims:
        if is_main_process():
            if out is not None:  # taken back if the run fails before writing anything else there
                claims.enter_context(claimed_run_dir(out, kind=kind, overwrite=config.overwrite))
                check_history(out)
            if config.cache_dir:  # what writes cut short by a crash or a kill left in the cache
                remove_stale_temp_files(config.cache_dir)
        torch.manual_seed(config.seed)
        sources = weights or (config.weights if isinstance(config.weights, list) else [config.weights])
        loaded = [
            load_weights(
                source,
                arch=config.arch,
                small_image_stem=config.small_image_stem,
                allow_non_finite=config.allow_non_finite,
            )
            for source in sources
        ]
        settings = resolve_settings(config, loaded[0], device)
        yield EvalRun(config, out, device, loaded, settings, reuses_splits=config.REUSES_SPLITS)


def _score_and_write(run: EvalRun, protocol: Protocol) -> Record:
    scored = protocol.load().score(run)
    if not is_main_process():
        return {"metrics": dict(scored.metrics)}
    record = run.record(dataclasses.replace(scored, protocol=protocol.name))
    run.write([record])
    return record


def run_protocol(protocol: Protocol, config: Any) -> Record:
    """``bt-hub eval NAME``: the scoring step of ``protocol`` (an entry of the table) inside :func:`evaluation`, its
    record (named after the entry) written; return the record."""
    with evaluation(config) as run:
        return _score_and_write(run, protocol)


def run_child(parent: EvalRun, protocol: Protocol, config: Any, *, rerun: bool = False) -> Record:
    """One protocol of ``eval all`` on the parent's weights and settings, in its own folder ``config.out``; a record
    of the same run there (:meth:`EvalRun.finished`) is returned instead, with a line saying so, unless ``rerun``."""
    run = parent.child(config, Path(config.out) if config.out is not None else None)
    done, why = (None, None) if rerun else broadcast_object(run.finished(protocol) if is_main_process() else None)
    if done is None:
        if why is not None:
            announce(f"bt-hub eval all: {protocol.name} in {run.out} was scored {_from(why)} ({why}); running it again")
        return _score_and_write(run, protocol)
    announce(
        f"bt-hub eval all: {done['protocol']} in {run.out} finished before from the same inputs (weights, data, "
        "settings); skipped (--rerun runs it again)"
    )
    return done


def _from(why: str) -> str:
    """``on other data`` / ``with other weights`` / ``with other settings``, of a :func:`changed_input` reason."""
    if "split" in why:
        return "on other data"
    return "with other weights" if why.startswith("weights") else "with other settings"
