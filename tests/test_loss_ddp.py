"""Two gloo processes with different shards equal one process on the concatenated batch."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bt_hub.common.distributed import GlobalBatchNorm, convert_sync_batchnorm
from bt_hub.method.loss import barlow_twins_loss

pytestmark = pytest.mark.ddp

WORLD_SIZE = 2
N_GLOBAL, EMBED_DIM, LAMBD = 16, 24, 0.0051
LARGE_D = 65536
TIMEOUT_S = 120


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


class TinyTwins(nn.Module):
    """A conv 'backbone' and a reference-style projector (Linear -> BN -> ReLU -> Linear), with both BN kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.projector = nn.Sequential(
            nn.Linear(4, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, EMBED_DIM, bias=False)
        )

    def forward(self, y_a: torch.Tensor, y_b: torch.Tensor, method: str = "auto", reference_grad_scale: bool = False):
        z_a, z_b = self.projector(self.backbone(y_a)), self.projector(self.backbone(y_b))
        return barlow_twins_loss(z_a, z_b, LAMBD, method, reference_grad_scale=reference_grad_scale)


class ReferenceTwins(TinyTwins):
    """facebookresearch/barlowtwins main.py's loss: C summed with a plain all_reduce that autograd cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(EMBED_DIM, affine=False)

    def forward(self, y_a: torch.Tensor, y_b: torch.Tensor):
        z_a, z_b = self.projector(self.backbone(y_a)), self.projector(self.backbone(y_b))
        c = self.bn(z_a).T @ self.bn(z_b) / N_GLOBAL
        torch.distributed.all_reduce(c)
        on_diag = torch.diagonal(c).add(-1).pow(2).sum()
        off_diag = c.pow(2).sum() - torch.diagonal(c).pow(2).sum()
        return on_diag + LAMBD * off_diag


def _inputs() -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return {
        "state": TinyTwins().state_dict(),
        "y_a": torch.randn(N_GLOBAL, 3, 6, 6, generator=g),
        "y_b": torch.randn(N_GLOBAL, 3, 6, 6, generator=g) + 0.5,
    }


def _step(model: nn.Module, *args, **kwargs) -> dict:
    """One forward/backward: the loss and every parameter's gradient and buffer afterwards."""
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {
        "loss": loss.detach().clone(),
        "grads": {k: p.grad.detach().clone() for k, p in inner.named_parameters()},
        "buffers": {k: b.detach().clone() for k, b in inner.named_buffers()},
    }


def _worker(rank: int, world_size: int, init_file: str, inputs_path: str, out_dir: str) -> None:
    """One rank: its own shard through a DDP-wrapped model with global-batch BatchNorm; results to a file."""
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        inputs = torch.load(inputs_path, weights_only=True)
        shard = slice(rank * N_GLOBAL // world_size, (rank + 1) * N_GLOBAL // world_size)
        y_a, y_b = inputs["y_a"][shard], inputs["y_b"][shard]
        results = {}
        for method in ("dense", "gram"):
            for scaled in (False, True):
                model = TinyTwins()
                model.load_state_dict(inputs["state"])
                ddp = nn.parallel.DistributedDataParallel(convert_sync_batchnorm(model))
                results[method, scaled] = _step(ddp, y_a, y_b, method=method, reference_grad_scale=scaled)
        reference = ReferenceTwins()
        reference.load_state_dict(inputs["state"], strict=False)
        results["reference"] = _step(nn.parallel.DistributedDataParallel(convert_sync_batchnorm(reference)), y_a, y_b)

        g = torch.Generator().manual_seed(rank)
        z_a, z_b = (torch.randn(4, LARGE_D, generator=g).requires_grad_() for _ in range(2))
        with LargestTensor() as largest:
            barlow_twins_loss(z_a, z_b, method="gram").loss.backward()
        results["largest_gram_tensor"] = largest.numel
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> tuple[dict, list[dict]]:
    """Single-process results on the whole batch, and each rank's results on its shard."""
    tmp = tmp_path_factory.mktemp("ddp")
    inputs = _inputs()
    torch.save(inputs, tmp / "inputs.pt")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(rank, WORLD_SIZE, str(tmp / "init"), str(tmp / "inputs.pt"), str(tmp)))
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {f.name: f.read_text() for f in tmp.glob("rank*.err")}
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}; {errors}"
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]

    single = {}
    for method in ("dense", "gram"):
        model = TinyTwins()
        model.load_state_dict(inputs["state"])
        single[method] = _step(model, inputs["y_a"], inputs["y_b"], method=method)
    return single, ranks


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * expected.abs().max().item(), msg=what)


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_two_ranks_give_the_loss_and_parameter_gradients_of_the_concatenated_batch(ddp_results, method):
    single, ranks = ddp_results
    for rank, results in enumerate(ranks):
        got = results[method, False]
        _assert_close(got["loss"], single[method]["loss"], f"rank {rank} loss")
        assert got["grads"].keys() == single[method]["grads"].keys()
        for name, grad in got["grads"].items():
            _assert_close(grad, single[method]["grads"][name], f"rank {rank} grad {name}")


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_two_ranks_update_batchnorm_running_stats_with_global_statistics(ddp_results, method):
    # Guards against BN statistics staying per rank (SyncBatchNorm has no CPU kernel).
    single, ranks = ddp_results
    for results in ranks:
        for name, buffer in results[method, False]["buffers"].items():
            _assert_close(buffer.float(), single[method]["buffers"][name].float(), name)


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_reference_grad_scale_gives_one_over_world_size_of_the_exact_gradient(ddp_results, method):
    _, ranks = ddp_results
    for results in ranks:
        exact, scaled = results[method, False], results[method, True]
        assert torch.equal(scaled["loss"], exact["loss"])
        for name, grad in scaled["grads"].items():
            _assert_close(grad, exact["grads"][name] / WORLD_SIZE, name, rel=1e-6)


def test_reference_grad_scale_reproduces_the_reference_codes_gradient(ddp_results):
    # The reference (plain all_reduce of C, then DDP's averaging) is what the option promises to match.
    _, ranks = ddp_results
    for results in ranks:
        reference, scaled = results["reference"], results["dense", True]
        _assert_close(scaled["loss"], reference["loss"], "loss")
        for name, grad in scaled["grads"].items():
            _assert_close(grad, reference["grads"][name], name)


def test_gram_form_never_builds_a_d_by_d_matrix(ddp_results):
    _, ranks = ddp_results
    for results in ranks:  # 4 rows per rank, D = 65536: the largest tensor is the gathered 8 x D batch
        assert results["largest_gram_tensor"] <= WORLD_SIZE * 4 * LARGE_D
    z_a, z_b = (torch.randn(8, LARGE_D).requires_grad_() for _ in range(2))
    with LargestTensor() as largest:
        barlow_twins_loss(z_a, z_b, method="auto").loss.backward()
    assert largest.numel <= 8 * LARGE_D
    small_a, small_b = (torch.randn(8, 64).requires_grad_() for _ in range(2))
    with LargestTensor() as largest:
        barlow_twins_loss(small_a, small_b, method="dense").loss.backward()
    assert largest.numel == 64 * 64  # the recorder does see a D x D matrix when one is built


def test_global_batchnorm_is_plain_batchnorm_without_a_process_group():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    converted[0].load_state_dict(plain.state_dict())
    assert isinstance(converted[0], GlobalBatchNorm)
    x = torch.randn(5, 3, 4, 4)
    torch.testing.assert_close(converted(x), plain(x))
    torch.testing.assert_close(converted[0].running_var, plain.running_var)
