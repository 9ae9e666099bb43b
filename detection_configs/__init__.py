"""detectron2 YAML configs of the Barlow Twins detection transfer (docs/protocols.md §3).

A package only so that the YAML files ship in the wheel; ``eval.detection.config`` finds them.
"""
