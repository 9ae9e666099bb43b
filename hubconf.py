"""torch.hub entry points: ``torch.hub.load("<owner>/bt_hub", "resnet50", weights="DEFAULT")``.

A list, not logic (torchvision's convention): the builders live in ``bt_hub/weights/builders.py``
and are the same code pip users call. Works from a plain checkout without ``pip install``.
"""

import os
import sys

dependencies = ["torch", "torchvision"]

try:
    import bt_hub  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bt_hub.weights import (  # noqa: E402,F401
    barlow_twins,
    get_weights,
    list_weights,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
)
