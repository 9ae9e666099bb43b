"""detectron2 YAML configs of the Barlow Twins detection transfer (docs/protocols.md §3).

A package only so that the YAML files ship in the wheel, as ``bt_hub.detection_configs``;
``bt_hub.eval.detection.config`` finds them.
"""

if __name__ != "bt_hub.detection_configs":
    raise ImportError(f"detection_configs/ installs as bt_hub.detection_configs: import that, not {__name__}")
