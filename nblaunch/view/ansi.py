"""ANSI escape sequences in rank output: colours to HTML, everything else away.

Ranks no longer inherit the kernel's colour forcing, but code may colour its
output anyway (``rich`` with ``force_terminal``, coloured loggers, compiler
diagnostics). The widget's log pane shows SGR colours and bold as styled
spans; every other sequence (cursor moves, line erases) is dropped, since a
log pane has no cursor. The text display strips all of them when its stream
is not a terminal or a Jupyter front end (both render colours themselves).

Written here rather than taken from ``ansi2html`` or nbconvert's filter: the
view needs only the SGR subset, per line, HTML-escaped in the same pass, and
neither package is a dependency of a training launcher.
"""
from __future__ import annotations

import html
import re

__all__ = ["strip", "to_html"]

# CSI sequences (ESC [ params final), OSC sequences (ESC ] ... BEL/ST), and
# two-character escapes.
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_SGR = re.compile(r"\x1b\[([0-9;]*)m")

# The xterm default palette (normal, bright), readable on light and dark.
_COLORS = ["#4d4d4d", "#cd3131", "#0dbc79", "#b58900", "#2472c8", "#bc3fbc", "#11a8cd", "#8a8a8a"]
_BRIGHT = ["#666666", "#f14c4c", "#23d18b", "#c7a500", "#3b8eea", "#d670d6", "#29b8db", "#a0a0a0"]


def strip(text: str) -> str:
    """``text`` without any escape sequence."""
    return _ESCAPE.sub("", text) if "\x1b" in text else text


def to_html(text: str) -> str:
    """``text`` HTML-escaped, its SGR colours and bold as ``<span>`` styles."""
    if "\x1b" not in text:
        return html.escape(text)
    out: list[str] = []
    style: dict[str, str] = {}
    pos = 0
    opened = False
    for match in _ESCAPE.finditer(text):
        out.append(html.escape(text[pos:match.start()]))
        pos = match.end()
        sgr = _SGR.fullmatch(match.group())
        if sgr is None:
            continue
        _apply(style, sgr.group(1))
        if opened:
            out.append("</span>")
            opened = False
        if style:
            out.append("<span style='" + ";".join(f"{k}:{v}" for k, v in style.items()) + "'>")
            opened = True
    out.append(html.escape(text[pos:]))
    if opened:
        out.append("</span>")
    return "".join(out)


def _apply(style: dict, params: str) -> None:
    codes = [int(c) if c.isdigit() else 0 for c in params.split(";")] if params else [0]
    i = 0
    while i < len(codes):
        c = codes[i]
        if c == 0:
            style.clear()
        elif c == 1:
            style["font-weight"] = "bold"
        elif c == 2:
            style["opacity"] = "0.7"
        elif c == 3:
            style["font-style"] = "italic"
        elif c == 4:
            style["text-decoration"] = "underline"
        elif c == 22:
            style.pop("font-weight", None)
            style.pop("opacity", None)
        elif c == 23:
            style.pop("font-style", None)
        elif c == 24:
            style.pop("text-decoration", None)
        elif 30 <= c <= 37 or 90 <= c <= 97:
            style["color"] = (_COLORS if c < 90 else _BRIGHT)[c % 10]
        elif 40 <= c <= 47 or 100 <= c <= 107:
            style["background"] = (_COLORS if c < 100 else _BRIGHT)[c % 10]
        elif c == 39:
            style.pop("color", None)
        elif c == 49:
            style.pop("background", None)
        elif c in (38, 48) and i + 1 < len(codes):
            key = "color" if c == 38 else "background"
            if codes[i + 1] == 5 and i + 2 < len(codes):
                style[key] = _xterm256(codes[i + 2])
                i += 2
            elif codes[i + 1] == 2 and i + 4 < len(codes):
                r, g, b = (min(255, v) for v in codes[i + 2:i + 5])
                style[key] = f"#{r:02x}{g:02x}{b:02x}"
                i += 4
        i += 1


def _xterm256(n: int) -> str:
    if n < 8:
        return _COLORS[n]
    if n < 16:
        return _BRIGHT[n - 8]
    if n < 232:
        n -= 16
        r, g, b = (v * 40 + 55 if v else 0 for v in (n // 36, n // 6 % 6, n % 6))
        return f"#{r:02x}{g:02x}{b:02x}"
    v = 8 + 10 * (min(n, 255) - 232)
    return f"#{v:02x}{v:02x}{v:02x}"
