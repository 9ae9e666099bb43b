"""The paper's numbers and the recipe of its released ResNet-50: what the registry's weights carry in their
``meta`` and what each evaluation protocol's paper row refers to by key.

Apart from the registry so that reading them loads no download, export, Hugging Face or card module.
"""

from bt_hub.method.loss import LAMBD

# The paper's Barlow Twins numbers (ResNet-50, 1000 epochs; Tables 1-4 of Zbontar et al., 2021), by the task
# names that the evaluation protocols' paper rows refer to.
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "imagenet_linear": {"top1": 73.2, "top5": 91.0},
    "semi_supervised_1pct": {"top1": 55.0, "top5": 79.2},
    "semi_supervised_10pct": {"top1": 69.7, "top5": 89.3},
    "places205_linear": {"top1": 54.1},
    "voc07_svm": {"mAP": 86.2},
    "inat18_linear": {"top1": 46.5},
    "voc07+12_faster_rcnn_c4": {"bbox_AP": 56.8, "bbox_AP50": 82.6, "bbox_AP75": 63.4},
    "coco_mask_rcnn_c4_1x": {
        "bbox_AP": 39.2,
        "bbox_AP50": 59.0,
        "bbox_AP75": 42.5,
        "segm_AP": 34.3,
        "segm_AP50": 56.0,
        "segm_AP75": 36.5,
    },
}
# docs/protocols.md §1: the recipe of the released ResNet-50.
RECIPE = {
    "dataset": "ImageNet-1k (train, no labels)",
    "epochs": 1000,
    "batch_size": 2048,
    "optimizer": "LARS",
    "lr_weights": 0.2,
    "lr_biases": 0.0048,
    "lambd": LAMBD,
    "projector": "8192-8192-8192",
    "code": "https://github.com/facebookresearch/barlowtwins",
}
