"""Shared infrastructure every layer may use.

Run folders and atomic writes, safe reads, progress, records, presets, distributed helpers.
"""
