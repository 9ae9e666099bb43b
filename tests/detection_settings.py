"""The shrunk detection settings the tests of both engines train with (their fixtures are in conftest.py)."""

from __future__ import annotations

# Shrunk so that a CPU trains a step in about a second; everything else is the shipped config.
FAST = [
    "INPUT.MIN_SIZE_TRAIN",
    "(64,)",
    "INPUT.MAX_SIZE_TRAIN",
    "64",
    "INPUT.MIN_SIZE_TEST",
    "64",
    "INPUT.MAX_SIZE_TEST",
    "64",
    "SOLVER.IMS_PER_BATCH",
    "2",
    "SOLVER.BASE_LR",
    "0.01",
    "SOLVER.MAX_ITER",
    "8",
    "SOLVER.STEPS",
    "(6,)",
    "SOLVER.WARMUP_ITERS",
    "2",
    "MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION",
    "4",
    "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE",
    "8",
    "MODEL.RPN.PRE_NMS_TOPK_TRAIN",
    "100",
    "MODEL.RPN.POST_NMS_TOPK_TRAIN",
    "16",
    "MODEL.RPN.PRE_NMS_TOPK_TEST",
    "50",
    "MODEL.RPN.POST_NMS_TOPK_TEST",
    "10",
    "TEST.PRECISE_BN.NUM_ITER",
    "1",
]
# detectron2 also reads DATALOADER.NUM_WORKERS (the torchvision engine loads in the training process)
DETECTRON2_FAST = [*FAST, "DATALOADER.NUM_WORKERS", "0"]
