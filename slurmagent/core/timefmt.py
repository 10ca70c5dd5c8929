"""Time as slurmagent reads and writes it: RFC 3339, slurmctld's local stamps, Slurm time
limits and human durations. Pure: no clock is read here unless a caller passes none."""

from __future__ import annotations

import time
from datetime import datetime, timezone

UNLIMITED_WORDS = ("UNLIMITED", "INFINITE", "PARTITION_LIMIT", "NONE", "N/A")


def parse_time(text: str) -> datetime:
    """RFC 3339 (`Z` or an offset, optional fractions) -> an aware UTC datetime."""
    t = str(text).strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    dt = datetime.fromisoformat(t)
    if dt.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return dt.astimezone(timezone.utc)


USABLE_YEARS = (2000, 3000)  # a termination time outside these years is garbage, not a time to act on


def usable_time(text: str, offset_s: float = 0.0) -> datetime:
    """`parse_time(text)` + `offset_s`, or ValueError: garbage, the protobuf zero
    (`0001-01-01T00:00:00Z`: a year-1 end would flush every job at once) or a year outside
    USABLE_YEARS (a `maxRunDuration` of 1e15 s)."""
    try:
        when = parse_time(text)
        if offset_s:
            when = from_epoch(when.timestamp() + offset_s)
    except (OverflowError, OSError) as exc:
        raise ValueError(str(exc)) from None
    if not USABLE_YEARS[0] <= when.year < USABLE_YEARS[1]:
        raise ValueError(f"year {when.year} is outside {USABLE_YEARS[0]}-{USABLE_YEARS[1] - 1}")
    return when


def fmt_time(dt: datetime) -> str:
    """An aware datetime -> `2026-11-30T05:00:00Z`."""
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_epoch(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def parse_log_time(text: object) -> float | None:
    """A decision-log `time` (`...T..:..:...mmmZ`, or any ISO form) -> epoch seconds; None if not one."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None


def parse_slurm_time(text: str) -> float | None:
    """`2026-11-30T09:49:04` (slurmctld's local time, as scontrol prints it) -> epoch seconds."""
    if not text or text in ("None", "Unknown", "(null)", "N/A"):
        return None
    if len(text) == 19 and text[10] == "T" and text[13] == ":" and text[16] == ":" and text[11:13] != "24":
        # the usual form through fromisoformat (C, no _strptime): every node of a `show node`
        # has one, and a failing prolog reads them all twice; anything else as strptime reads it
        # (hour 24 too: Python 3.14's fromisoformat reads it as the next midnight, strptime not)
        try:
            return time.mktime(datetime.fromisoformat(text).timetuple())
        except ValueError:
            pass
    try:
        return time.mktime(datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timetuple())
    except ValueError:
        return None


def parse_time_limit(text: str) -> float | None:
    """scontrol's TimeLimit (`[D-]HH:MM:SS`, also `MM`, `MM:SS`, `D-HH`) in seconds; None = unlimited."""
    t = (text or "").strip()
    if not t or t.upper() in UNLIMITED_WORDS:
        return None
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
        parts = [int(p) for p in t.split(":")]
        parts += [0] * (3 - len(parts))  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, s = parts[:3]
    else:
        parts = [int(p) for p in t.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0  # minutes
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]  # MM:SS
        else:
            h, m, s = parts[:3]
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def human(seconds: float | None, *, column: bool = False) -> str:
    """A duration: `45s`, `12m05s`, `3h05m`, `2d3h`; a negative one `-45s`.

    `column` (a `status` table cell, read at a glance): whole minutes under two hours (`12m`),
    `in 45s` for a negative one (ahead), `-` for None (unknown)."""
    if seconds is None:
        return "-"
    s = int(seconds) if column else int(round(seconds))
    if s < 0:
        return ("in " if column else "-") + human(-s, column=column)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m" if column else f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"
