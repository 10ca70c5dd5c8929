"""NVRM Xid lines parsed from kernel-log text: pure, so every reader of the log (the watch,
the hooks' peek, the tests' recorded logs) judges the same line the same way.

The driver logs ``NVRM: Xid (PCI:dddd:bb:dd): <code>, pid=<pid>, name=<proc>, <detail>``
(older drivers omit ``PCI:``; some lines omit pid/name). Reading the log is `kernlog.py`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

_BUS = re.compile(
    r"^(?:pci:)?(?P<dom>[0-9a-f]{1,8}):(?P<bus>[0-9a-f]{1,2}):(?P<dev>[0-9a-f]{1,2})"
    r"(?:\.[0-7])?$"
)
# Anchored on the "NVRM: Xid (" marker, so any prefix (dmesg time, journal, kmsg) is fine.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}"
    r"(?:\.[0-7])?)[^)\n]*\):\s*(?P<xid>\d{1,6})\b,?[ \t]*(?P<rest>.*)$"
)
_PID = re.compile(r"pid=('[^']*'|[^,]*)(?:,[ \t]*|$)")
_NAME = re.compile(r"name=([^,]*)(?:,[ \t]*|$)")
_NO_VALUE = frozenset({"", "<unknown>", "<n/a>", "n/a", "unknown"})


def normalize_pci(bus_id: str) -> str:
    """Canonical ``dddd:bb:dd`` (lower case) for NVRM ids and NVML ids alike.

    NVRM prints ``0000:3b:00`` (domain:bus:device), NVML ``00000000:3B:00.0``; both map to
    ``0000:3b:00``. A string of neither form comes back stripped and lower-cased.
    """
    s = bus_id.strip().lower()
    m = _BUS.match(s)
    if not m:
        return s
    return f"{int(m['dom'], 16):04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}"


@dataclass(frozen=True)
class KernelXid:
    """One NVRM Xid line. ``pci`` is normalized; ``pid``/``process`` are None when unknown."""

    xid: int
    pci: str
    pid: str | None
    process: str | None
    detail: str
    raw: str


def _value(v: str) -> str | None:
    v = v.strip().strip("'\"").strip()
    return None if v.lower() in _NO_VALUE else v


def parse_line(line: str) -> KernelXid | None:
    """The Xid in one kernel-log line, or None. Never raises on junk."""
    if not isinstance(line, str) or "NVRM: Xid" not in line:
        return None
    raw = line.rstrip("\r\n")
    m = _XID.search(raw)
    if not m:
        return None
    rest = m["rest"]
    pid = process = None
    pm = _PID.match(rest)
    if pm:
        pid, rest = _value(pm.group(1)), rest[pm.end():]
        nm = _NAME.match(rest)
        if nm:
            process, rest = _value(nm.group(1)), rest[nm.end():]
    return KernelXid(
        xid=int(m["xid"]),
        pci=normalize_pci(m["bus"]),
        pid=pid,
        process=process,
        detail=rest.strip(),
        raw=raw,
    )


def parse_text(text: str) -> list[KernelXid]:
    """Every Xid in a block of kernel-log text, in order."""
    return parse_lines(text.splitlines())


def parse_lines(lines: Iterable[str]) -> list[KernelXid]:
    out = []
    for line in lines:
        x = parse_line(line)
        if x is not None:
            out.append(x)
    return out


class _HasPci(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def pci_bus_id(self) -> str | None: ...


def map_to_gpus(
    xids: Iterable[KernelXid], gpus: Iterable[_HasPci]
) -> list[tuple[int | None, KernelXid]]:
    """Pair each XID with the index of the GPU at its PCI address (None when not found)."""
    by_pci = {normalize_pci(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
    return [(by_pci.get(x.pci), x) for x in xids]
