"""The torchvision R50-C4 engine of detection transfer (installs with pip)."""
