"""The view of a launch or call, for the person watching it.

The call watch feeds a view from the cell's own thread (the one running
``notebook_launcher``), so ipykernel routes everything to that cell on every
ipykernel version, with no parent-header juggling in other threads. The view
only receives: the core never reads it.

- :mod:`.state`: the model (:class:`LaunchState`), the limits;
- :mod:`.base`: what every view does with a report (:class:`View`), and how
  much rank output it admits (a flooding rank cannot trip Jupyter's IOPub
  limit: the rest is in the rank's log file);
- :mod:`.text` (:class:`TextDisplay`) and :mod:`.widget`
  (:class:`WidgetDisplay`): the two renderers, each redrawing at most
  ``MAX_RATE`` times a second however much arrives;
- :mod:`.html`: rows and charts as HTML and SVG.
"""
from __future__ import annotations

import sys

from .base import View, in_kernel
from .state import LaunchState, clip
from .text import TextDisplay
from .widget import WidgetDisplay

__all__ = ["View", "LaunchState", "TextDisplay", "WidgetDisplay", "make_display", "clip", "SHOW_AFTER_S"]


# A launch or call shorter than this shows only its final view, as static
# HTML: building and closing a dozen widgets is most of a short call's cost
# (8.5 vs 16.5 ms for a live call, measured in bench/live.py).
SHOW_AFTER_S = 0.25


def make_display(kind: str, show_after: float = 0.0):
    """``"auto"``: widgets in a kernel with ipywidgets, else text.
    ``show_after``: see :class:`WidgetDisplay`."""
    if kind == "auto":
        kind = "widget" if in_kernel() and _has_widgets() else "text"
    if kind == "widget":
        return WidgetDisplay(show_after=show_after)
    return TextDisplay(show_status=(kind == "text"))


def _has_widgets() -> bool:
    # Found, not imported: importing ipywidgets costs tens of ms in a fresh
    # kernel, paid only once a launch lasts long enough to build its widgets.
    import importlib.util

    return "ipywidgets" in sys.modules or importlib.util.find_spec("ipywidgets") is not None
