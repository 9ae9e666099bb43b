"""Pretraining machinery: the loop, exact resume, the kNN monitor."""
