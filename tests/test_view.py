"""The view's pieces without a process: ANSI rendering, which bar a row shows,
what a row says, and text mode's plain output."""
from __future__ import annotations

import io

from nblaunch.view import ansi
from nblaunch.wire.channel import Progress
from nblaunch.view import LaunchState, TextDisplay, clip


def test_sgr_colours_become_spans_and_other_escapes_vanish():
    assert ansi.to_html("\x1b[35mpurple\x1b[0m <b>") == "<span style='color:#bc3fbc'>purple</span> &lt;b&gt;"
    assert ansi.to_html("\x1b[1;31mbold red\x1b[22m red\x1b[39m plain") == (
        "<span style='font-weight:bold;color:#cd3131'>bold red</span>"
        "<span style='color:#cd3131'> red</span> plain")
    assert ansi.to_html("\x1b[38;5;196mx\x1b[0m") == "<span style='color:#ff0000'>x</span>"
    assert ansi.to_html("\x1b[38;2;1;2;3mx") == "<span style='color:#010203'>x</span>"
    assert ansi.to_html("\x1b[2K\x1b[1Aup\x1b]0;title\x07") == "up"
    assert ansi.strip("\x1b[35m━━━\x1b[0m 50%\x1b[?25l") == "━━━ 50%"


def _state(*bars) -> LaunchState:
    st = LaunchState()
    st.begin(1, "fork", "gloo", "/tmp/x")
    st.set_rank(0, "running")
    for event in bars:
        st.progress(event)
    return st


def test_a_row_shows_the_inner_bar_with_the_outer_one_beside_it():
    st = _state(Progress(0, 1, "epoch", 1, 3, False, 10.0),
                Progress(0, 2, "batch", 0, 100, False, 10.0),
                Progress(0, 2, "batch", 50, 100, False, 11.0, "loss=0.5"))
    row = st.ranks[0]
    assert row.current.desc == "batch" and row.n == 50
    assert row.detail() == "running epoch 1/3 \u00b7 batch 50/100 50 it/s ETA 1 s loss=0.5"


def test_when_every_bar_closed_the_row_keeps_the_one_that_closed_last():
    st = _state(Progress(0, 1, "epoch", 0, 2, False, 10.0),
                Progress(0, 2, "batch", 40, 40, True, 11.0),  # inner closed first...
                Progress(0, 1, "epoch", 2, 2, True, 11.5))  # ... then the outer loop
    st.set_rank(0, "finished")
    assert st.ranks[0].detail().startswith("finished epoch 2/2")


def test_a_row_that_is_not_running_shows_no_eta():
    st = _state(Progress(0, 1, "train", 0, 100, False, 10.0), Progress(0, 1, "train", 10, 100, False, 11.0))
    assert "ETA" in st.ranks[0].detail()
    for status in ("failed", "stopped", "finished"):
        st.set_rank(0, status)
        assert "ETA" not in st.ranks[0].detail()


def test_a_bar_reset_for_the_next_epoch_measures_its_rate_afresh():
    st = _state(Progress(0, 1, "train", 0, 100, False, 10.0), Progress(0, 1, "train", 100, 100, False, 11.0),
                Progress(0, 1, "train", 0, 100, False, 20.0), Progress(0, 1, "train", 20, 100, False, 30.0))
    assert st.ranks[0].current.rate() == 2.0  # not (120 items / 20 s)


def test_text_mode_writes_plain_text_to_a_file_and_shortens_giant_lines():
    out = io.StringIO()
    view = TextDisplay(stream=out)
    view.begin(1, "fork", "gloo", "/tmp/x")
    view.rank_lines(0, ["\x1b[31mred\x1b[0m", "y" * 5000])
    view.flush()
    text = out.getvalue()
    assert "[rank 0] red\n" in text and "\x1b" not in text
    assert f"[rank 0] {clip('y' * 5000)}\n" in text and "[3,000 more characters in the log file]" in text


def test_a_loss_over_several_decades_is_drawn_on_a_log_axis_with_values():
    from nblaunch.view.html import svg_chart

    falling = {0: [(i, 5.0 * 10 ** (-i / 10)) for i in range(60)]}  # 5 down to ~6e-6
    svg = svg_chart("loss", falling)
    assert "data-scale='log'" in svg and "loss (log)" in svg
    assert all(f">{v}</text>" in svg for v in ("0.0001", "0.01", "1"))  # decade ticks
    ys = [float(p.split(",")[1]) for p in svg.split("points='")[1].split("'")[0].split()]
    assert max(ys) - min(ys) > 100  # the curve uses the plot's height, not one flat line
    flat = svg_chart("lr", {0: [(i, 0.1 + i * 0.001) for i in range(10)]})
    assert "data-scale='linear'" in flat and ">0.1</text>" in flat


def test_the_view_colours_read_on_light_and_dark_backgrounds():
    """Rank colours (tags, chart lines, legend) and state colours (header,
    bars): WCAG contrast >= 3 on white and on JupyterLab Dark's #111111."""
    from nblaunch.view import html as display

    def luminance(hex_colour: str) -> float:
        channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    def contrast(a: str, b: str) -> float:
        high, low = sorted((luminance(a), luminance(b)), reverse=True)
        return (high + 0.05) / (low + 0.05)

    for colour in [*display.PALETTE, *display.STATE_COLOR.values()]:
        for background in ("#ffffff", "#111111"):
            assert contrast(colour, background) >= 3, (colour, background, contrast(colour, background))


def test_chart_ticks_sit_at_round_values_on_both_axes():
    from nblaunch.view.html import log_ticks, nice_ticks, tick_label

    # The ranges the issue saw (ticks at 8.3 / 5.57 / 2.84 / 0.115 and 0.125 / 0.113 / 0.101 / 0.0889).
    assert [tick_label(t) for t in nice_ticks(0.115, 8.3)] == ["0", "2", "4", "6", "8", "10"]
    assert [tick_label(t) for t in nice_ticks(0.0889, 0.125)] == ["0.08", "0.09", "0.1", "0.11", "0.12", "0.13"]
    assert [tick_label(t) for t in nice_ticks(-3, 7)] == ["-5", "0", "5", "10"]
    assert [tick_label(t) for t in log_ticks(6e-6, 5)] == ["1e-06", "0.0001", "0.01", "1"]
    assert [tick_label(t) for t in log_ticks(1e-12, 1e3)] == ["1e-12", "1e-09", "1e-06", "0.001", "1", "1000"]
    for lo, hi in [(0.115, 8.3), (1e-7, 3e-7), (5, 5.0000001), (100, 12345), (0.1, 0.109)]:
        ticks = nice_ticks(lo, hi)
        assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 6
        steps = {round((b - a) / (ticks[1] - ticks[0]), 6) for a, b in zip(ticks, ticks[1:])}
        assert steps == {1.0}  # evenly spaced
        mantissa = float(f"{ticks[1] - ticks[0]:.1e}".split("e")[0])
        assert mantissa in (1.0, 2.0, 5.0), (lo, hi, ticks)
        assert len({tick_label(t) for t in ticks}) == len(ticks)  # no two labels alike
    svg = __import__("nblaunch.view.html", fromlist=["svg_chart"]).svg_chart(
        "loss", {0: [(i, 8.3 - i * 0.1) for i in range(82)]})
    assert ">2</text>" in svg and ">8</text>" in svg and ">8.3</text>" not in svg
