"""Pretraining machinery: the loop, data, decoding, prefetching, exact resume, the kNN monitor, precision."""
