"""Detection transfer (Faster/Mask R-CNN R50-C4) on detectron2 or on torchvision, from the same YAML configs."""
