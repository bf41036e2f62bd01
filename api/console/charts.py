"""Line charts as inline SVG, drawn on the server: no JavaScript and nothing vendored. Each
chart is an image with a text alternative (its latest values) and its numbers in a table
under a disclosure, so a screen reader gets the data and not a drawing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from api.console.html import Safe, tag, void
from topics.ids import format_iso_ms

WIDTH, HEIGHT = 420, 150
PAD_L, PAD_R, PAD_T, PAD_B = 48, 8, 10, 22
COLOURS = ("#0b57d0", "#b3261e", "#188038", "#e37400")


def _scale(values: Sequence[float | None]) -> float:
    top = max((v for v in values if v is not None), default=0.0)
    return top if top > 0 else 1.0


def _polyline(values: Sequence[float | None], top: float, colour: str) -> list[Safe]:
    """One series; a missing value breaks the line."""
    n = max(1, len(values) - 1)
    plot_w, plot_h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B
    runs: list[list[str]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            runs.append([])
            continue
        x = PAD_L + plot_w * i / n
        y = PAD_T + plot_h * (1 - v / top)
        runs[-1].append(f"{x:.1f},{y:.1f}")
    return [
        void("polyline", points=" ".join(r), fill="none", stroke=colour, stroke_width="2")
        if len(r) > 1
        else void("circle", cx=r[0].split(",")[0], cy=r[0].split(",")[1], r="2", fill=colour)
        for r in runs
        if r
    ]


def _latest(values: Sequence[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def _num(v: float | None, unit: str) -> str:
    return "no data" if v is None else f"{v:,.1f}{unit}"


def _compact(v: float) -> str:
    """An axis label that fits left of the axis (the unit is in the chart's title)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def line_chart(
    title: str,
    minutes_ms: Sequence[int],
    series: Mapping[str, Sequence[float | None]],
    *,
    unit: str,
) -> Safe:
    everything = [v for values in series.values() for v in values]
    top = _scale(everything)
    alt = "; ".join(f"{name} now {_num(_latest(v), unit)}" for name, v in series.items())
    axes = [
        void("line", x1=PAD_L, y1=PAD_T, x2=PAD_L, y2=HEIGHT - PAD_B, stroke="#888"),
        void(
            "line", x1=PAD_L, y1=HEIGHT - PAD_B, x2=WIDTH - PAD_R, y2=HEIGHT - PAD_B, stroke="#888"
        ),
        tag("text", _compact(top), x=PAD_L - 4, y=PAD_T + 8, text_anchor="end", font_size="10"),
        tag("text", "0", x=PAD_L - 4, y=HEIGHT - PAD_B, text_anchor="end", font_size="10"),
        tag("text", "-60 min", x=PAD_L, y=HEIGHT - 6, font_size="10"),
        tag("text", "now", x=WIDTH - PAD_R, y=HEIGHT - 6, text_anchor="end", font_size="10"),
    ]
    lines = [
        _polyline(values, top, COLOURS[i % len(COLOURS)])
        for i, values in enumerate(series.values())
    ]
    legend = tag(
        "p",
        [
            [
                tag("span", "■ ", style=f"color:{COLOURS[i % len(COLOURS)]}", aria_hidden="true"),
                tag("span", name + "  "),
            ]
            for i, name in enumerate(series)
        ],
        class_="note",
    )
    svg = tag(
        "svg",
        tag("title", f"{title}: {alt}"),
        axes,
        lines,
        role="img",
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        width="100%",
        aria_label=f"{title}: {alt}",
        xmlns="http://www.w3.org/2000/svg",
    )
    return tag(
        "figure",
        tag("figcaption", title),
        svg,
        legend,
        _data_table(title, minutes_ms, series, unit),
    )


def _data_table(
    title: str, minutes_ms: Sequence[int], series: Mapping[str, Sequence[float | None]], unit: str
) -> Safe:
    head = tag(
        "tr", tag("th", "Minute (UTC)", scope="col"), [tag("th", n, scope="col") for n in series]
    )
    rows = [
        tag(
            "tr",
            tag("td", format_iso_ms(m)[11:16]),
            [tag("td", _num(values[i], unit), class_="num") for values in series.values()],
        )
        for i, m in enumerate(minutes_ms)
        if any(values[i] for values in series.values())
    ]
    return tag(
        "details",
        tag("summary", f"{title}: the numbers"),
        tag("table", head, rows) if rows else tag("p", "No data yet."),
    )
