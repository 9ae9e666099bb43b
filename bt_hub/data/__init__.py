"""The data layer that training and evaluation both stand on: datasets, decode, prefetch, precision."""
