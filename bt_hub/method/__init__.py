"""The Barlow Twins method: loss, model (backbone + projector), views, LARS, transforms and normalisation."""
