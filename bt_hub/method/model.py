"""Backbones, projector and the Barlow Twins model (docs/protocols.md §1): a torchvision ResNet with
``fc = Identity`` and the reference's ``Sequential`` projector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchvision.models import resnet
from torchvision.models.resnet import BasicBlock, Bottleneck

from bt_hub.method.loss import LAMBD, LossTerms, barlow_twins_loss


@dataclass(frozen=True)
class Architecture:
    """A backbone bt_hub builds: torchvision's builder, blocks per stage, block type, feature width."""

    builder: Callable[..., resnet.ResNet]
    layers: tuple[int, int, int, int]
    block: str
    feature_dim: int


# The one list of architectures: builders, checkpoint reading, exports and the CLI's choices read it.
ARCHITECTURES: dict[str, Architecture] = {
    "resnet18": Architecture(resnet.resnet18, (2, 2, 2, 2), "basic", 512),
    "resnet34": Architecture(resnet.resnet34, (3, 4, 6, 3), "basic", 512),
    "resnet50": Architecture(resnet.resnet50, (3, 4, 6, 3), "bottleneck", 2048),
    "resnet101": Architecture(resnet.resnet101, (3, 4, 23, 3), "bottleneck", 2048),
}


def build_backbone(name: str = "resnet50", *, small_image_stem: bool = False) -> resnet.ResNet:
    """A torchvision ResNet with zero-initialised residual BNs, ``fc = Identity``, optionally a 3x3/1 stem."""
    if name not in ARCHITECTURES:
        raise ValueError(f"backbone {name!r} is unknown; expected one of {sorted(ARCHITECTURES)}")
    net = ARCHITECTURES[name].builder(weights=None, zero_init_residual=True)
    if small_image_stem:
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    net.feature_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net


def parse_projector(spec: str) -> list[int]:
    """Parse a projector spec such as ``"8192-8192-8192"`` into layer widths."""
    try:
        sizes = [int(s) for s in spec.split("-")]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(
            f"projector {spec!r} is malformed; expected positive widths joined by '-', e.g. '8192-8192-8192'"
        )
    return sizes


def build_projector(in_dim: int, spec: str = "8192-8192-8192") -> nn.Sequential:
    """The reference projector: (Linear(bias=False), BN, ReLU) x (n-1), then Linear(bias=False)."""
    sizes = [in_dim] + parse_projector(spec)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1], bias=False), nn.BatchNorm1d(sizes[i + 1]), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(sizes[-2], sizes[-1], bias=False))
    return nn.Sequential(*layers)


class BarlowTwins(nn.Module):
    """Backbone + projector trained with the Barlow Twins loss (Zbontar et al., ICML 2021).

    Args:
        projector: widths of the projector layers, e.g. ``"8192-8192-8192"``.
        lambd: weight of the redundancy-reduction term (0.0051 in the reference code).
        loss_method: ``"auto"``, ``"dense"`` (D x D) or ``"gram"`` (N x N); same value.
        reference_grad_scale: reproduce the reference code's gradients, 1/world_size of the global
            loss's (docs/protocols.md §1); off by default.
    """

    def __init__(
        self,
        backbone: str = "resnet50",
        projector: str = "8192-8192-8192",
        lambd: float = LAMBD,
        *,
        small_image_stem: bool = False,
        loss_method: str = "auto",
        reference_grad_scale: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = build_backbone(backbone, small_image_stem=small_image_stem)
        self.projector = build_projector(self.backbone.feature_dim, projector)
        self.lambd = lambd
        self.loss_method = loss_method
        self.reference_grad_scale = reference_grad_scale
        self.config = {
            "backbone": backbone,
            "projector": projector,
            "lambd": lambd,
            "small_image_stem": small_image_stem,
        }

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Projector output z for a batch of images."""
        return self.projector(self.backbone(x))

    def loss(self, z_a: torch.Tensor, z_b: torch.Tensor) -> LossTerms:
        """Loss terms of two batches of embeddings under this model's ``lambd``, loss form and gradient scale."""
        return barlow_twins_loss(
            z_a, z_b, lambd=self.lambd, method=self.loss_method, reference_grad_scale=self.reference_grad_scale
        )

    def forward(self, y_a: torch.Tensor, y_b: torch.Tensor) -> LossTerms:
        """Loss terms for two batches of views of the same images."""
        return self.loss(self.embed(y_a), self.embed(y_b))


def default_init_backbone(arch: str, small_image_stem: bool, seed: int) -> nn.Module:
    """The backbone at torchvision's default initialisation (residual BN weights 1, Kaiming-normal small stem)."""
    torch.manual_seed(seed)
    net = build_backbone(arch, small_image_stem=small_image_stem)
    if small_image_stem:  # torchvision's initialisation of every convolution, which the 3x3 stem replaced
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    for module in net.modules():
        if isinstance(module, Bottleneck):
            nn.init.ones_(module.bn3.weight)
        elif isinstance(module, BasicBlock):
            nn.init.ones_(module.bn2.weight)
    return net
