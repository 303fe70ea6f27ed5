"""``python -m nblaunch``: the ``nblaunch`` command (:mod:`nblaunch.background.cli`)."""
import sys

from .background.cli import main

if __name__ == "__main__":
    sys.exit(main())
