"""The one place that talks to ``torch.distributed``: rank helpers that work without a process group, the
backend chosen from the device, autograd-aware collectives, and a CPU stand-in for SyncBatchNorm.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank, 0 without a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes, 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (and always without a process group)."""
    return get_rank() == 0


def init_distributed(device: str = "cpu") -> torch.device:
    """Join the torchrun process group if launched by torchrun (nccl on CUDA, else gloo); return this rank's device."""
    if sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ:
        # under torchrun on Linux, have the kernel SIGKILL this worker when its launcher dies, so none writes on
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # torchrun's environment describes one process, or none
        return torch.device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        backend, dev = "nccl", torch.device("cuda", local_rank)
    else:
        backend, dev = "gloo", torch.device(device)
    if not dist.is_initialized():
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend=backend)
        else:
            # torchrun keeps one store across --max-restarts, where a restarted group would read the dead
            # group's addresses (connection refused, or a hang): each attempt gets its own keys
            store, rank, world = next(dist.rendezvous("env://"))
            dist.init_process_group(
                backend=backend, store=dist.PrefixStore(f"bt_hub/attempt_{attempt}", store), rank=rank, world_size=world
            )
    return dev


def cleanup_distributed() -> None:
    """Leave the process group if one was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[torch.device]:
    """Join torchrun's process group for the block, yielding this rank's device; leave it only if this block joined."""
    joined_here = not is_distributed()
    dev = init_distributed(device)
    try:
        yield dev
    finally:
        if joined_here and is_distributed():
            cleanup_distributed()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Differentiable sum over ranks (identity without a process group); its backward sums gradients over ranks."""
    if not is_distributed():
        return x
    return dist_nn.all_reduce(x, op=dist.ReduceOp.SUM)


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Differentiable concatenation along dim 0 of every rank's tensor, in rank order."""
    if not is_distributed():
        return x
    return torch.cat(dist_nn.all_gather(x), dim=0)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank (no-op without a process group)."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` without a process group)."""
    if not is_distributed():
        return [obj]
    gathered: list[object] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value`` (``value`` itself without a process group)."""
    if not is_distributed():
        return value
    found = torch.tensor([value], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return int(found.item())


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_distributed():
        dist.barrier()


def distributed_data_parallel(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` under DistributedDataParallel (on ``device``'s GPU, if it is one) inside a process group of more
    than one rank, else ``module`` itself."""
    if not is_distributed():
        return module
    return nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch (differentiable all-reduces), on any device.

    Without a process group, or in eval mode, a plain BatchNorm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GlobalBatchNorm expects an input of 2 to 5 dimensions, got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N x C x ...) over N and the spatial dimensions of every rank."""
        self._check_input_dim(input)
        if not (self.training and is_distributed()):
            return super().forward(input)
        x = input.float()
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = torch.tensor([x.numel() / x.shape[1]], device=x.device)
        sums = all_reduce_sum(torch.cat([x.sum(dim=dims), local_count]))
        count = sums[-1].detach()
        if count < 2:
            raise ValueError(f"GlobalBatchNorm needs more than one value per channel over all ranks, got {int(count)}")
        mean = sums[:-1] / count
        centred = x - mean.view(shape)
        var = all_reduce_sum(centred.pow(2).sum(dim=dims)) / count
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * count / (count - 1))
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), momentum)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Make every BatchNorm use global-batch statistics: SyncBatchNorm on CUDA, else :class:`GlobalBatchNorm`
    (sharing parameters and buffers, so the state dict keeps its keys).
    """
    if any(p.is_cuda for p in module.parameters()):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _to_global_batchnorm(module)


def _to_global_batchnorm(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, (GlobalBatchNorm, nn.SyncBatchNorm)):
        out = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        if module.track_running_stats:
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        return out.train(module.training)
    for name, child in module.named_children():
        module.add_module(name, _to_global_batchnorm(child))
    return module
