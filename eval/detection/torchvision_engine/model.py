"""The paper's R50-C4 Faster / Mask R-CNN from torchvision parts, as detectron2's (docs/detection.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.rpn import RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import MultiScaleRoIAlign, roi_align

from bt_hub.eval.detection.config import Settings

__all__ = ["build_c4_model", "c4_backbone_state_dict", "unloaded_backbone_tensors"]

SUPPORTED_NORMS = ("BN", "SyncBN", "naiveSyncBN")
STRIDE = 16


class C4Trunk(nn.Module):
    """ResNet ``conv1 .. layer3``: the C4 backbone (named as torchvision names them)."""

    def __init__(self, resnet: nn.Module) -> None:
        super().__init__()
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3"):
            self.add_module(name, getattr(resnet, name))
        self.out_channels = self.layer3[-1].conv3.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """res4 features (stride 16)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer3(self.layer2(self.layer1(x)))


class RoIAlignC4(MultiScaleRoIAlign):
    """RoIAlign on the single res4 map at scale 1/16; remembers its last training boxes for the mask branch."""

    def __init__(self, resolution: int, sampling_ratio: int, aligned: bool) -> None:
        super().__init__(["0"], resolution, sampling_ratio)
        self.aligned = aligned
        self.last_boxes: list[torch.Tensor] | None = None

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        """N x C x R x R features of every box (all images' boxes in order)."""
        if self.training:
            self.last_boxes = [b.detach() for b in boxes]
        return roi_align(x["0"], boxes, self.output_size, 1.0 / STRIDE, self.sampling_ratio, self.aligned)


class Res5Head(nn.Module):
    """res5 (``layer4``) + the extra norm; ``forward`` mean-pools for the box predictor."""

    def __init__(self, layer4: nn.Module, extra_norm: bool) -> None:
        super().__init__()
        self.res5 = layer4
        channels = layer4[-1].conv3.out_channels
        self.norm = nn.BatchNorm2d(channels) if extra_norm else nn.Identity()
        self.out_channels = channels
        self.last_maps: torch.Tensor | None = None

    def maps(self, x: torch.Tensor) -> torch.Tensor:
        """The res5 feature maps of pooled RoI features (R x R -> R/2 x R/2)."""
        return self.norm(self.res5(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """N x 2048 box features."""
        maps = self.maps(x)
        self.last_maps = maps if self.training else None
        return maps.mean(dim=(2, 3))


class Res5MaskFeatures(MultiScaleRoIAlign):
    """The mask branch's input: res5 maps of the mask boxes, shared with the box head.

    Training reuses the rows the box head computed for the same foreground proposals; inference runs
    res5 on the predicted boxes. It holds no parameters of its own.
    """

    def __init__(self, pooler: RoIAlignC4, head: Res5Head) -> None:
        super().__init__(["0"], pooler.output_size, pooler.sampling_ratio)
        self._shared = (pooler, head)

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        """res5 maps of ``boxes`` (N x 2048 x R/2 x R/2)."""
        pooler, head = self._shared
        if not self.training:
            return head.maps(pooler(x, boxes, image_shapes))
        if pooler.last_boxes is None or head.last_maps is None:
            raise RuntimeError("the mask branch ran before the box branch in training; the res5 maps are not available")
        rows, offset = [], 0
        for sampled, wanted in zip(pooler.last_boxes, boxes):
            same = (wanted[:, None, :] == sampled[None, :, :]).all(dim=2)
            if not bool(same.any(dim=1).all()):
                raise RuntimeError("a mask proposal is not among the sampled box proposals")
            rows.append(same.float().argmax(dim=1) + offset)
            offset += len(sampled)
        maps = head.last_maps[torch.cat(rows)] if rows else head.last_maps[:0]
        pooler.last_boxes, head.last_maps = None, None
        return maps


class C4MaskPredictor(nn.Sequential):
    """2x2 stride-2 deconvolution + ReLU + 1x1 convolution to one mask logit map per class."""

    def __init__(self, in_channels: int, conv_dim: int, num_classes: int) -> None:
        super().__init__(
            nn.ConvTranspose2d(in_channels, conv_dim, 2, stride=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(conv_dim, num_classes, 1),
        )
        nn.init.kaiming_normal_(self[0].weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self[2].weight, std=0.001)
        nn.init.zeros_(self[0].bias)
        nn.init.zeros_(self[2].bias)


class C4Transform(GeneralizedRCNNTransform):
    """torchvision's resize/normalise/batch step with detectron2's separate train and test sizes."""

    def __init__(self, settings: Settings) -> None:
        mean = [v / 255 for v in settings["MODEL.PIXEL_MEAN"]]
        std = [v / 255 for v in settings["MODEL.PIXEL_STD"]]
        train = (tuple(int(s) for s in settings["INPUT.MIN_SIZE_TRAIN"]), int(settings["INPUT.MAX_SIZE_TRAIN"]))
        test = ((int(settings["INPUT.MIN_SIZE_TEST"]),), int(settings["INPUT.MAX_SIZE_TEST"]))
        super().__init__(train[0], train[1], mean, std, size_divisible=1)
        self.sizes = {True: train, False: test}

    def train(self, mode: bool = True) -> C4Transform:
        """Switch between the training sizes (drawn per image) and the test size."""
        self.min_size, self.max_size = self.sizes[mode]
        return super().train(mode)


def _check_supported(s: Settings) -> None:
    fixed = {
        "MODEL.BACKBONE.FREEZE_AT": 0,
        "MODEL.RESNETS.STRIDE_IN_1X1": False,
        "INPUT.FORMAT": "RGB",
        "INPUT.RANDOM_FLIP": "horizontal",
        "INPUT.MIN_SIZE_TRAIN_SAMPLING": "choice",
        "MODEL.RPN.BBOX_REG_WEIGHTS": [1.0, 1.0, 1.0, 1.0],
        "MODEL.ROI_MASK_HEAD.NUM_CONV": 0,
        "SOLVER.WARMUP_METHOD": "linear",
    }
    for key, value in fixed.items():
        got = s[key]
        if (list(got) if isinstance(value, list) else got) != value:
            raise ValueError(f"{key} is {s[key]!r} in {s.source}; the torchvision engine implements only {value!r}")
    if s["MODEL.RESNETS.DEPTH"] not in (50, 101):
        raise ValueError(
            f"MODEL.RESNETS.DEPTH is {s['MODEL.RESNETS.DEPTH']} in {s.source}; "
            "the torchvision engine builds ResNet-50 or -101"
        )
    allowed = {
        "MODEL.RESNETS.NORM": (SUPPORTED_NORMS, f"the torchvision engine supports {', '.join(SUPPORTED_NORMS)}"),
        "MODEL.ROI_HEADS.NAME": (
            ("Res5ROIHeadsExtraNorm", "Res5ROIHeads"),
            "the torchvision engine builds the C4 heads Res5ROIHeads(ExtraNorm)",
        ),
        "MODEL.ROI_BOX_HEAD.POOLER_TYPE": (("ROIAlignV2", "ROIAlign"), "expected ROIAlignV2 or ROIAlign"),
    }
    for key, (values, expected) in allowed.items():
        if s[key] not in values:
            raise ValueError(f"{key} is {s[key]!r} in {s.source}; {expected}")
    if len(s["MODEL.ANCHOR_GENERATOR.SIZES"]) != 1 or len(s["MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS"]) != 1:
        raise ValueError(
            f"MODEL.ANCHOR_GENERATOR in {s.source} must describe one feature map (C4), "
            "e.g. SIZES [[32, 64, 128, 256, 512]]"
        )


def build_c4_model(settings: Settings, resnet: nn.Module) -> FasterRCNN:
    """The C4 detector of ``settings`` around ``resnet``'s tensors, in train mode."""
    s = settings
    _check_supported(s)
    num_classes = int(s["MODEL.ROI_HEADS.NUM_CLASSES"]) + 1  # torchvision's class 0 is the background
    trunk = C4Trunk(resnet)
    pooler = RoIAlignC4(
        int(s["MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION"]),
        int(s["MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO"]),
        aligned=s["MODEL.ROI_BOX_HEAD.POOLER_TYPE"] == "ROIAlignV2",
    )
    head = Res5Head(resnet.layer4, extra_norm=s["MODEL.ROI_HEADS.NAME"] == "Res5ROIHeadsExtraNorm")
    predictor = FastRCNNPredictor(head.out_channels, num_classes)
    nn.init.normal_(predictor.cls_score.weight, std=0.01)
    nn.init.normal_(predictor.bbox_pred.weight, std=0.001)
    for layer in (predictor.cls_score, predictor.bbox_pred):
        nn.init.zeros_(layer.bias)
    sizes, ratios = s["MODEL.ANCHOR_GENERATOR.SIZES"][0], s["MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS"][0]
    anchors = AnchorGenerator(sizes=(tuple(int(v) for v in sizes),), aspect_ratios=(tuple(float(v) for v in ratios),))
    rpn_bg, rpn_fg = s["MODEL.RPN.IOU_THRESHOLDS"]
    (roi_iou,) = s["MODEL.ROI_HEADS.IOU_THRESHOLDS"]
    common: dict[str, Any] = dict(
        rpn_anchor_generator=anchors,
        rpn_head=RPNHead(trunk.out_channels, anchors.num_anchors_per_location()[0]),
        rpn_pre_nms_top_n_train=int(s["MODEL.RPN.PRE_NMS_TOPK_TRAIN"]),
        rpn_pre_nms_top_n_test=int(s["MODEL.RPN.PRE_NMS_TOPK_TEST"]),
        rpn_post_nms_top_n_train=int(s["MODEL.RPN.POST_NMS_TOPK_TRAIN"]),
        rpn_post_nms_top_n_test=int(s["MODEL.RPN.POST_NMS_TOPK_TEST"]),
        rpn_nms_thresh=float(s["MODEL.RPN.NMS_THRESH"]),
        rpn_fg_iou_thresh=float(rpn_fg),
        rpn_bg_iou_thresh=float(rpn_bg),
        rpn_batch_size_per_image=int(s["MODEL.RPN.BATCH_SIZE_PER_IMAGE"]),
        rpn_positive_fraction=float(s["MODEL.RPN.POSITIVE_FRACTION"]),
        box_roi_pool=pooler,
        box_head=head,
        box_predictor=predictor,
        box_score_thresh=float(s["MODEL.ROI_HEADS.SCORE_THRESH_TEST"]),
        box_nms_thresh=float(s["MODEL.ROI_HEADS.NMS_THRESH_TEST"]),
        box_detections_per_img=int(s["TEST.DETECTIONS_PER_IMAGE"]),
        box_fg_iou_thresh=float(roi_iou),
        box_bg_iou_thresh=float(roi_iou),
        box_batch_size_per_image=int(s["MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE"]),
        box_positive_fraction=float(s["MODEL.ROI_HEADS.POSITIVE_FRACTION"]),
        bbox_reg_weights=tuple(float(v) for v in s["MODEL.ROI_BOX_HEAD.BBOX_REG_WEIGHTS"]),
    )
    if s["MODEL.MASK_ON"]:
        model: FasterRCNN = MaskRCNN(
            trunk,
            mask_roi_pool=Res5MaskFeatures(pooler, head),
            mask_head=nn.Identity(),
            mask_predictor=C4MaskPredictor(head.out_channels, int(s["MODEL.ROI_MASK_HEAD.CONV_DIM"]), num_classes),
            **common,
        )
    else:
        model = FasterRCNN(trunk, **common)
    model.transform = C4Transform(s)
    return model.train()


def c4_backbone_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's backbone tensors under torchvision ResNet names (trunk + res5 as ``layer4``)."""
    model = getattr(model, "module", model)
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("backbone."):
            out[name[len("backbone.") :]] = tensor
        elif name.startswith("roi_heads.box_head.res5."):
            out["layer4." + name[len("roi_heads.box_head.res5.") :]] = tensor
    return out


def unloaded_backbone_tensors(model: nn.Module, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """Backbone names whose tensor in ``model`` is missing from ``expected`` (torchvision names) or differs from it."""
    ours = c4_backbone_state_dict(model)
    bad = [
        k
        for k, v in ours.items()
        if k not in expected or not torch.equal(v.detach().cpu(), expected[k].to(v.dtype).cpu())
    ]
    bad += [k for k in expected if not k.startswith("fc.") and k not in ours]
    return bad
