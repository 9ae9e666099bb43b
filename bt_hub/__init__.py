"""bt_hub: Barlow Twins pretraining, weights on torch.hub and the Hugging Face Hub, and the paper's evaluation suite."""

from bt_hub.method.loss import LossTerms, barlow_twins_loss
from bt_hub.method.model import BarlowTwins, build_backbone, build_projector

__all__ = ["BarlowTwins", "LossTerms", "barlow_twins_loss", "build_backbone", "build_projector"]
__version__ = "0.1.0"
