"""detectron2's C4 RoI head with MoCo's extra norm after res5, registered on import."""

from __future__ import annotations

from typing import Any

from detectron2.layers import get_norm
from detectron2.modeling.roi_heads import ROI_HEADS_REGISTRY, Res5ROIHeads
from torch import nn

__all__ = ["Res5ROIHeadsExtraNorm"]


def _register(cls: type) -> type:
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
