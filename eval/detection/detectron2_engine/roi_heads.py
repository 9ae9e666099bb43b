"""``Res5ROIHeadsExtraNorm``: detectron2's C4 RoI head with one more norm layer after res5.

When the backbone's BN layers are fine-tuned (FREEZE_AT 0, SyncBN), MoCo's detection
configs add a norm layer (the backbone's ``MODEL.RESNETS.NORM``) after the last res5 block
of the head; the Barlow Twins detection transfer uses the same head (docs/protocols.md §3).
Importing this module registers the head in detectron2's ``ROI_HEADS_REGISTRY``; it needs
detectron2, so only code that already requires detectron2 imports it.
"""

from __future__ import annotations

from typing import Any

from detectron2.layers import get_norm
from detectron2.modeling.roi_heads import ROI_HEADS_REGISTRY, Res5ROIHeads
from torch import nn

__all__ = ["Res5ROIHeadsExtraNorm"]


def _register(cls: type) -> type:
    """Register ``cls`` once (a second import, e.g. by a spawned worker, must not fail)."""
    if cls.__name__ not in ROI_HEADS_REGISTRY:
        ROI_HEADS_REGISTRY.register(cls)
    return cls


@_register
class Res5ROIHeadsExtraNorm(Res5ROIHeads):
    """Res5ROIHeads whose res5 stage ends with ``norm`` (named ``roi_heads.res5.norm``)."""

    @classmethod
    def _build_res5_block(cls, cfg: Any) -> tuple[nn.Sequential, int]:
        seq, out_channels = super()._build_res5_block(cfg)
        seq.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, out_channels))
        return seq, out_channels
