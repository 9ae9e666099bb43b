"""Downstream protocols of the Barlow Twins paper, one module each, run by bt_hub.eval.runner.

The Python API (bt_hub.eval.api) is here too: ``evaluate``, ``compare``, ``embed`` and their ``Results``.

This folder installs as ``bt_hub.eval`` (pyproject ``package-dir``); it is not a top-level
``eval`` package, which would collide with other research code in the same environment.
"""

if __name__ != "bt_hub.eval":
    raise ImportError(
        f"eval/ is bt_hub's evaluation package: import bt_hub.eval (after pip install -e .), not {__name__}"
    )

API = ("evaluate", "compare", "embed", "Results")


def __getattr__(name: str) -> object:
    """``bt_hub.eval.evaluate`` / ``compare`` / ``embed`` / ``Results``, imported on first use (bt_hub.eval.api)."""
    if name in API:
        from bt_hub.eval import api

        return getattr(api, name)
    raise AttributeError(f"module 'bt_hub.eval' has no attribute {name!r}")
