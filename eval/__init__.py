"""Downstream protocols of the Barlow Twins paper, one module each, sharing bt_hub.eval.features.

This folder installs as ``bt_hub.eval`` (pyproject ``package-dir``); it is not a top-level
``eval`` package, which would collide with other research code in the same environment.
"""

if __name__ != "bt_hub.eval":
    raise ImportError(
        f"eval/ is bt_hub's evaluation package: import bt_hub.eval (after pip install -e .), not {__name__}"
    )
