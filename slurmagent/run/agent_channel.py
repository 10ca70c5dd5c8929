"""The node agents' report channel: whole reports over the agent step's shared stdout.

Every task of the agent step writes to one srun stdout, which interleaves the tasks' output
at ~1 KiB boundaries: one long JSON line per node arrives torn once reports grow (a few
hundred files). So each agent sends its report compressed (zlib), base64'd and cut into short
framed lines (FRAME_DATA characters of data, one write each, well under 1 KiB with any
label), which slurmstepd passes on whole in its default line-buffered mode:

    slurmagent-report:1 <node index> <seq> <total> <digest> <data>

`<digest>` (the SHA-256 of the whole compressed report, 16 hex digits) ties the parts of one
report together and proves it whole. The batch step reassembles per node index, in any
order, ignores every other line and any prefix before the tag (`srun --label`'s `N: `), and
names a node whose report is missing or fails its checksum. Pure: no I/O but `write_frames`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Iterable, TextIO

FRAME_TAG = "slurmagent-report:1 "
FRAME_DATA = 600  # base64 characters per line: the whole line stays under 700 bytes


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


def frame_lines(index: int, payload: bytes) -> list[str]:
    """One report (`payload`, e.g. JSON) of node `index` as framed lines, without newlines."""
    blob = zlib.compress(payload, 6)
    text = base64.b64encode(blob).decode("ascii")
    parts = [text[i : i + FRAME_DATA] for i in range(0, len(text), FRAME_DATA)] or [""]
    digest = _digest(blob)
    return [f"{FRAME_TAG}{index} {seq} {len(parts)} {digest} {part}" for seq, part in enumerate(parts)]


def write_frames(out: TextIO, index: int, payload: bytes) -> None:
    """Write the report line by line, each flushed alone (one write, never a torn line)."""
    for line in frame_lines(index, payload):
        out.write(line + "\n")
        out.flush()


@dataclass
class _Parts:
    total: int
    parts: dict[int, str] = field(default_factory=dict)


@dataclass
class Received:
    """What arrived from the agents: whole reports per node index, and why others are not whole."""

    reports: dict[int, bytes] = field(default_factory=dict)
    damaged: dict[int, str] = field(default_factory=dict)  # index -> what is wrong with what came


def read_frames(lines: Iterable[str]) -> Received:
    """Reassemble every node's report from the step's output lines (any order, other lines
    and label prefixes ignored)."""
    pending: dict[int, dict[str, _Parts]] = {}
    for line in lines:
        at = line.find(FRAME_TAG)
        if at < 0:
            continue
        fields = line[at + len(FRAME_TAG):].strip().split(" ")
        if len(fields) != 5:
            continue
        try:
            index, seq, total = int(fields[0]), int(fields[1]), int(fields[2])
        except ValueError:
            continue
        if index < 0 or not 0 <= seq < total:
            continue
        group = pending.setdefault(index, {}).setdefault(fields[3], _Parts(total))
        if group.total == total:
            group.parts.setdefault(seq, fields[4])
    out = Received()
    for index, groups in pending.items():
        why = ""
        for digest, group in sorted(groups.items(), key=lambda g: -len(g[1].parts)):
            if len(group.parts) < group.total:
                why = why or f"{len(group.parts)} of {group.total} parts arrived"
                continue
            try:
                blob = base64.b64decode("".join(group.parts[i] for i in range(group.total)), validate=True)
            except (binascii.Error, ValueError):
                why = "its parts are damaged (not base64)"
                continue
            if _digest(blob) != digest:
                why = "its parts fail the checksum"
                continue
            try:
                out.reports[index] = zlib.decompress(blob)
            except zlib.error:
                why = "its parts do not decompress"
                continue
            break
        if index not in out.reports:
            out.damaged[index] = why
    return out
