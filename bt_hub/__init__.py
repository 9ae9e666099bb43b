"""bt_hub: Barlow Twins pretraining, weights on torch.hub and the Hugging Face Hub, and the paper's evaluation suite."""

__all__ = ["BarlowTwins", "LossTerms", "barlow_twins_loss", "build_backbone", "build_projector"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """The public names, imported on first use, so that ``bt-hub`` handles Ctrl-C and SIGTERM before torch loads."""
    if name not in __all__:
        raise AttributeError(f"module 'bt_hub' has no attribute {name!r}")
    from bt_hub.method import loss, model

    return getattr(loss if hasattr(loss, name) else model, name)
