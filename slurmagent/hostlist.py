"""Slurm hostlist expressions (`gpu-[1-3,7],login1`): expand to names and compress back.

scontrol takes a whole hostlist in one call, so drains and resumes are batched this way.
"""

from __future__ import annotations

import re
from itertools import groupby

_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<ranges>[^\[\]]+)\](?P<rest>.*)$")


def expand(expr: str) -> list[str]:
    """`n[1-3],x` -> ['n1', 'n2', 'n3', 'x']; keeps zero padding (`n[01-02]`)."""
    out: list[str] = []
    for part in _split_top(expr.strip()):
        out.extend(_expand_one(part))
    return out


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in hostlist {expr!r}")
        if ch == "," and depth == 0:
            if cur:
                parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in hostlist {expr!r}")
    if cur:
        parts.append(cur)
    return parts


def _expand_one(part: str) -> list[str]:
    m = _BRACKET.match(part)
    if not m:
        if "[" in part or "]" in part:
            raise ValueError(f"bad brackets in hostlist {part!r}")
        return [part]
    names = []
    for rng in m["ranges"].split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {rng!r} in hostlist {part!r}")
        if hi and int(hi) < int(lo):
            raise ValueError(f"reversed range {rng!r} in hostlist {part!r}")
        width = len(lo) if lo.startswith("0") else 0
        for i in range(int(lo), int(hi or lo) + 1):
            names.extend(m["prefix"] + str(i).zfill(width) + tail for tail in _expand_one(m["rest"]) or [""])
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
