"""The one place that talks to ``torch.distributed``.

Rank helpers work without a process group (rank 0 of 1), the backend follows the
device (gloo on CPU, nccl on CUDA), and the collectives used inside the loss are
autograd-aware so that gradients are those of the global batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


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


def launched_by_torchrun() -> bool:
    """True when torchrun's environment variables describe more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: str = "cpu") -> torch.device:
    """Join the torchrun process group if launched by torchrun; return this rank's device.

    The backend follows the device: nccl for CUDA, gloo otherwise.
    """
    if not launched_by_torchrun():
        return torch.device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        backend, dev = "nccl", torch.device("cuda", local_rank)
    else:
        backend, dev = "gloo", torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dev


def cleanup_distributed() -> None:
    """Leave the process group if one was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Differentiable sum over ranks (identity without a process group).

    Its backward sums the incoming gradients over ranks, so every rank's gradient is
    that of the sum of all ranks' (identical) losses; DDP's averaging then yields the
    gradient of the global-batch loss.
    """
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


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_distributed():
        dist.barrier()
