"""Shared fixtures: offline, CPU-only, small data made at test time."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Destroy any process group a test left behind."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _decoded_stores_in_a_temporary_cache(tmp_path_factory):
    """Pretraining's decoded stores (``--store``) go to a session folder, never to the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BT_HUB_CACHE", str(tmp_path_factory.mktemp("bt_hub_cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_as_a_terminal_gives_it():
    """SIGINT's default disposition for the suite and every process it starts, even when the suite runs as a
    background job (``nohup python -m pytest -q &``): a shell starts such a job with SIGINT ignored, its children
    inherit that, and bt-hub rightly keeps a signal that was ignored at start, so the Ctrl-C tests would see no
    Ctrl-C. A handled signal is reset to its default in a child at exec, an ignored one is not."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session", autouse=True)
def _two_torch_threads():
    """Two torch threads in all for every test: the machines running the suite have few cores, shared with other
    jobs. Under pytest-xdist (``-n 2``, pyproject.toml's addopts) each worker and the processes its tests start get
    one: two threads a worker would put four on two cores, and torch's OpenMP threads spin at every barrier waiting
    for a thread the kernel has put aside (a 10-step pretraining took 127 s of CPU on two loaded cores, 10 s on
    one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    before, threads = torch.get_num_threads(), max(1, 2 // workers)
    torch.set_num_threads(threads)
    with pytest.MonkeyPatch.context() as patch:
        if workers > 1:
            patch.setenv("OMP_NUM_THREADS", str(threads))
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _precision_cache_of_the_session(tmp_path_factory):
    """``--precision auto`` keeps its CPU measurement in a file of the session, never in the user's cache (it is
    measured once, by the first test that resolves auto on the CPU); so does ``--decode auto`` (once per image
    size class)."""
    from bt_hub.data import measured, precision

    path = tmp_path_factory.mktemp("precision") / precision.CACHE_NAME
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(measured, "cache_file", lambda name: path.parent / name)
        yield path


@pytest.fixture
def with_nvimgcodec():
    """nvImageCodec, whose CPU backend stands in for the GPU's decoder (the test extra installs it), or a skip."""
    from bt_hub.common.optional import MissingDependencyError
    from bt_hub.data.decode import nvimgcodec

    try:
        return nvimgcodec()
    except MissingDependencyError:
        pytest.skip("nvImageCodec is not installed: pip install 'bt_hub[nvimgcodec]'")


@pytest.fixture(scope="session")
def seeded_weights(tmp_path_factory) -> Callable[..., Path]:
    """Factory: a random-init backbone built right after ``torch.manual_seed(seed)``, saved once per session as a
    plain torchvision state dict named ``<arch>.pth`` (``<arch>_small_stem.pth`` with the 3x3 small-image stem).

    Tests only read these files; one that changes weights copies them first.
    """
    from bt_hub.method.model import build_backbone

    made: dict[tuple[str, int, bool], Path] = {}

    def make(arch: str = "resnet18", *, seed: int = 0, small_image_stem: bool = False) -> Path:
        key = (arch, seed, small_image_stem)
        if key not in made:
            torch.manual_seed(seed)
            stem = "_small_stem" if small_image_stem else ""
            path = tmp_path_factory.mktemp(f"weights_seed{seed}") / f"{arch}{stem}.pth"
            torch.save(build_backbone(arch, small_image_stem=small_image_stem).state_dict(), path)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="session")
def resnet18_weights(seeded_weights) -> Path:
    """A seeded (0) random-init ResNet-18 backbone saved as a plain torchvision state dict."""
    return seeded_weights("resnet18")


@pytest.fixture(scope="session")
def small_stem_weights(seeded_weights) -> Path:
    """A seeded (0) random-init ResNet-18 with the 3x3 small-image stem (fast on 8-px images)."""
    return seeded_weights("resnet18", small_image_stem=True)


def make_image_folder(
    root: Path,
    classes: Sequence[str] = ("a", "b"),
    per_class: int = 3,
    size: int | tuple[int, int] = 8,
    *,
    splits: Sequence[str] = ("train", "val"),
    seed: int = 0,
    suffix: str = ".png",
    jpeg: bool = False,
) -> Path:
    """A class-per-folder tree of random RGB PNG files (baseline JPEGs of quality 90 with ``jpeg``, whatever the
    ``suffix``): ``root/<split>/<class>/<class>_<i><suffix>`` for each split (``root/<class>/...`` when ``splits`` is
    empty). ``size`` is an int (square) or ``(height, width)``.

    One random generator, seeded by ``seed``, draws every image in order, so two splits of one call never share
    an image, and two calls with the same arguments make byte-identical files. Returns ``root``.
    """
    height, width = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    for split in splits or ("",):
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                Image.fromarray(image).save(folder / f"{c}_{i}{suffix}", format="JPEG" if jpeg else "PNG", quality=90)
    return root


@contextlib.contextmanager
def read_only_storage(folders: list[Path]) -> Iterator[None]:
    """Inside, this process sees each of ``folders`` (a list the caller may add to) as on read-only storage:
    creating or writing anything under one (``os.open``, ``os.mkdir``, ``open``) fails with EROFS, as on a read-only
    mount; tests run as root, whom a ``chmod`` does not stop."""
    real_open, real_mkdir, real_builtin_open = os.open, os.mkdir, builtins.open

    def under(path) -> bool:
        return any(Path(os.path.abspath(os.fspath(path))).is_relative_to(f) for f in folders)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def guarded_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def guarded_mkdir(path, mode=0o777, *, dir_fd=None):
        if under(path):
            if os.path.isdir(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
            refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def guarded_builtin_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and under(file):
            refuse(file)
        return real_builtin_open(file, mode, *args, **kwargs)

    os.open, os.mkdir, builtins.open, io.open = guarded_open, guarded_mkdir, guarded_builtin_open, guarded_builtin_open
    try:
        yield
    finally:
        os.open, os.mkdir, builtins.open, io.open = real_open, real_mkdir, real_builtin_open, real_builtin_open


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], None]]:
    """``read_only(folder)``: this process sees ``folder`` as on read-only storage (:func:`read_only_storage`)."""
    folders: list[Path] = []
    with read_only_storage(folders):
        yield lambda folder: folders.append(Path(folder).resolve())


@pytest.fixture
def image_folder() -> Callable[..., Path]:
    """Factory fixture for :func:`make_image_folder` (tiny ImageFolder trees on disk)."""
    return make_image_folder


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty TORCH_HOME (and no hub directory left set by an earlier torch.hub.set_dir)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    return tmp_path / "torch_home"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data beside the repository (reference data, never copied in)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present beside the repository")
    return SHARED_DATA


@pytest.fixture(scope="module")
def bt_weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A ResNet-50 state dict whose every tensor differs from a fresh initialisation (and from detectron2's)."""
    from bt_hub.method.model import build_backbone

    torch.manual_seed(0)
    state = build_backbone("resnet50").state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            tensor.copy_(torch.rand_like(tensor) + 0.5 if "running_var" in name else torch.randn_like(tensor) * 0.05)
        else:
            tensor.fill_(7)
    path = tmp_path_factory.mktemp("weights") / "bt_resnet50.pth"
    torch.save(state, path)
    return path, state


@pytest.fixture
def one_thread():
    """One torch thread (the detection tests).

    On a loaded machine, waiting OpenMP threads spin and multiply the CPU time.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class DeviceTraffic(TorchDispatchMode):
    """Counts the ops run inside it (``ops``, by name) and lists those that send host data to a device (``sent``):
    an op taking a CPU tensor and giving a tensor elsewhere, or ``torch.tensor(data, device=...)`` (which the
    dispatcher hides from a mode: it is watched by patching ``torch.tensor``).

    On the ``meta`` device, which holds no data, it stands for a GPU on the CPU: anything that reads device data
    back to the host (``nonzero``, ``item``, ``tolist``: a CUDA sync) raises there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sent: list[str] = []

    def __enter__(self) -> DeviceTraffic:
        self._patch, real = pytest.MonkeyPatch(), torch.tensor

        def tensor(data, *args, device=None, **kwargs):
            if device is not None and torch.device(device).type != "cpu":
                self.sent.append("torch.tensor")
            return real(data, *args, device=device, **kwargs)

        self._patch.setattr(torch, "tensor", tensor)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self._patch.undo()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.name()] += 1
        given = [t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if "cpu" in given and any(d != "cpu" for d in made):
            self.sent.append(func.name())
        return out


@pytest.fixture
def device_traffic() -> Callable[[], DeviceTraffic]:
    """Factory fixture for :class:`DeviceTraffic` (``with device_traffic() as seen: ...``)."""
    return DeviceTraffic
