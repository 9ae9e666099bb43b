"""Downstream protocols of the Barlow Twins paper, one module each, sharing eval.features."""
