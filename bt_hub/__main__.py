"""``python -m bt_hub``: the ``bt-hub`` command, where its console script is not on PATH."""

from bt_hub.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
