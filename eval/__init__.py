"""Downstream protocols of the Barlow Twins paper, one module each, run by bt_hub.eval.runner, and the
Python API (``evaluate``, ``compare``, ``embed``). Installed as ``bt_hub.eval``, never as a top-level ``eval``.
"""

if __name__ != "bt_hub.eval":
    raise ImportError(
        f"eval/ is bt_hub's evaluation package: import bt_hub.eval (after pip install -e .), not {__name__}"
    )

API = ("evaluate", "compare", "embed", "Results")


def __getattr__(name: str) -> object:
    """``bt_hub.eval.evaluate`` / ``compare`` / ``embed`` / ``Results``, imported on first use (bt_hub.eval.api)."""
    if name in API:
        import bt_hub.eval.api

        return getattr(bt_hub.eval.api, name)
    raise AttributeError(f"module 'bt_hub.eval' has no attribute {name!r}")
