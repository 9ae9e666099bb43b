"""Shared infrastructure every layer may use: run folders, atomic writes, safe reads, progress, records, presets."""
