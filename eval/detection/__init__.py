"""Detection transfer (Faster/Mask R-CNN R50-C4) through detectron2."""
