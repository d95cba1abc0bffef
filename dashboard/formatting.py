"""How numbers read on the pages: Jinja filters, also used by the JSON the live pages re-render.

The JavaScript side (`static/app.js`, `bg.fmt`) formats the same way, so a table refreshed in the
browser shows what the server rendered.
"""

from __future__ import annotations

import math
import time

from flask import Flask


def register_filters(app: Flask) -> None:
    app.jinja_env.filters.update(
        num=fmt_num, rate=fmt_rate, duration=fmt_duration, age=fmt_age, pct=fmt_pct, clock=fmt_clock,
    )


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def fmt_num(value, digits: int = 0) -> str:
    """12345 -> '12,345'; 3.14159 with digits=2 -> '3.14'; None -> '–'."""
    if _missing(value):
        return "–"
    return f"{value:,.{digits}f}"


def fmt_rate(value) -> str:
    """Tokens (or rows) per second: three significant figures, no exponent."""
    if _missing(value):
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_duration(seconds) -> str:
    """Seconds as '850 ms', '12.3 s', '4m 05s', '2h 07m'."""
    if _missing(seconds):
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} µs"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours < 48 else f"{hours // 24}d {hours % 24:02d}h"


def fmt_age(ts) -> str:
    """An epoch timestamp as how long ago it was."""
    if _missing(ts):
        return "–"
    return fmt_duration(max(time.time() - ts, 0.0)) + " ago"


def fmt_pct(fraction) -> str:
    if _missing(fraction):
        return "–"
    return f"{100 * fraction:.0f}%"


def fmt_clock(ts) -> str:
    """An epoch timestamp as local 'YYYY-MM-DD HH:MM:SS'."""
    if _missing(ts):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
