"""Slurm hostlist expressions (`gpu-[1-3,7],login1`): expand to names and compress back.

scontrol takes a whole hostlist in one call, so drains and resumes are batched this way.
"""

from __future__ import annotations

import re
from itertools import groupby

_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<ranges>[^\[\]]+)\](?P<rest>.*)$")

# `n[1-100000000]` is a short string and a 100-million-element list: counted before expanded.
# Slurm's own hostlist code takes a range of more than 64K hosts for an error, too.
MAX_NAMES = 65536
_MAX_DIGITS = 18


def expand(expr: str, limit: int = MAX_NAMES) -> list[str]:
    """`n[1-3],x` -> ['n1', 'n2', 'n3', 'x']; keeps zero padding (`n[01-02]`).
    More than `limit` names is a ValueError, found before any name is made."""
    parts = _split_top(expr.strip())
    count = sum(_count_one(part) for part in parts)
    if count > limit:
        raise ValueError(f"hostlist {_short(expr)} names {count} nodes, more than {limit}")
    out: list[str] = []
    for part in parts:
        out.extend(_expand_one(part))
    return out


def _short(expr: str) -> str:
    return repr(expr if len(expr) <= 80 else expr[:80] + "...")


def _ranges(part: str) -> tuple[re.Match[str] | None, list[tuple[int, int, int]]]:
    """The first bracket of `part` and its ranges as (low, high, zero-pad width)."""
    m = _BRACKET.match(part)
    if not m:
        if "[" in part or "]" in part:
            raise ValueError(f"bad brackets in hostlist {_short(part)}")
        return None, []
    out = []
    for rng in m["ranges"].split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or max(len(lo), len(hi)) > _MAX_DIGITS:
            raise ValueError(f"bad range {_short(rng)} in hostlist {_short(part)}")
        if hi and int(hi) < int(lo):
            raise ValueError(f"reversed range {_short(rng)} in hostlist {_short(part)}")
        out.append((int(lo), int(hi or lo), len(lo) if lo.startswith("0") else 0))
    return m, out


def _count_one(part: str) -> int:
    m, ranges = _ranges(part)
    if m is None:
        return 1
    rest = _count_one(m["rest"]) if m["rest"] else 1
    return sum(hi - lo + 1 for lo, hi, _ in ranges) * rest


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in hostlist {_short(expr)}")
        if ch == "," and depth == 0:
            if cur:
                parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in hostlist {_short(expr)}")
    if cur:
        parts.append(cur)
    return parts


def _expand_one(part: str) -> list[str]:
    m, ranges = _ranges(part)
    if m is None:
        return [part]
    tails = _expand_one(m["rest"]) if m["rest"] else [""]
    names = []
    for lo, hi, width in ranges:
        for i in range(lo, hi + 1):
            names.extend(m["prefix"] + str(i).zfill(width) + tail for tail in tails)
    return names


_NUM_SUFFIX = re.compile(r"^(.*?)(\d+)$")


def compress(names: list[str]) -> str:
    """['n1', 'n2', 'n3', 'x'] -> 'n[1-3],x' (sorted, de-duplicated)."""
    keyed = []
    plain = []
    for name in sorted(set(names)):
        m = _NUM_SUFFIX.match(name)
        if m:
            keyed.append((m[1], len(m[2]) if m[2].startswith("0") and len(m[2]) > 1 else 0, int(m[2]), m[2]))
        else:
            plain.append(name)
    parts = list(plain)
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    for (prefix, width), group in groupby(keyed, key=lambda k: (k[0], k[1])):
        items = list(group)
        if len(items) == 1:
            parts.append(prefix + items[0][3])
            continue
        ranges = []
        start = prev = items[0][2]
        for _, _, n, _ in items[1:]:
            if n == prev + 1:
                prev = n
                continue
            ranges.append((start, prev))
            start = prev = n
        ranges.append((start, prev))
        fmt = (lambda n: str(n).zfill(width)) if width else str
        body = ",".join(fmt(a) if a == b else f"{fmt(a)}-{fmt(b)}" for a, b in ranges)
        parts.append(f"{prefix}[{body}]")
    return ",".join(sorted(parts))
