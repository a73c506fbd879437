"""How amounts read in the terminal: dollars, durations and wall-clock times, one way each.

`traingate runs`, `show`, `cost`, `watch` and `queue` print through these, so the same number reads
the same everywhere (a run's total in `runs` is the string `cost` and `watch` print for it).

>>> usd(0.012345), usd(12.345), usd(1234.5)
('$0.0123', '$12.35', '$1,234.50')
>>> duration(62), duration(3723), duration(None)
('1:02', '1:02:03', '?')
>>> utc(1_790_000_000)
'2026-09-21 14:13:20'
"""

from __future__ import annotations

import datetime as dt
import math

UTC_LABEL = "UTC"  # the zone `utc` writes in: headers say it once ("START (UTC)")


def usd(amount: float | None) -> str:
    """Dollars: to the cent from $1 up, four decimals below (a CPU stage costs fractions of a cent)."""
    if amount is None or not math.isfinite(amount):
        return "?"
    return f"${amount:,.2f}" if abs(amount) >= 1 else f"${amount:.4f}"


def duration(seconds: float | None) -> str:
    """``1:02:03``, ``2:03``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def utc(epoch_s: float | None) -> str:
    """A wall-clock time in UTC, to the second (``2026-09-21 14:13:20``); ``-`` when unknown."""
    if epoch_s is None or not math.isfinite(epoch_s):
        return "-"
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
