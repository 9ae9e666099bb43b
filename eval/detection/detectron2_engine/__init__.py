"""The detectron2 engine of detection transfer (needs detectron2 importable; not on PyPI)."""
