"""Shared infrastructure every layer may use: run folders and atomic writes, safe reads, progress, records, presets, distributed helpers."""
