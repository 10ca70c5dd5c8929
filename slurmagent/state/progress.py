"""The ranks' progress files: `trainer.progress(step)` writes one per rank, the wrapper reads them.

A private directory per attempt on the node (`SLURMAGENT_PROGRESS_DIR`, made by the wrapper,
0700 under the user's private temp parent): never under `--ckpt-dir`, which is synced. One
small file per rank, `rank-<R>`, replaced atomically: `<step> <wall time> <pid> [<node>]`. The
node (SLURMD_NODENAME of the rank) tells a rank of another node apart where the path is not
node-local (a multi-node job's other ranks are reported by their own node's agent).
`trainer.phase(name)` writes `phase-<R>` (`<name> <wall start> <expected s> <pid> [<node>]`)
while the rank is in a long silent phase, and removes it at the phase's end.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

PROGRESS_ENV = "SLURMAGENT_PROGRESS_DIR"
MAX_RANK_FILES = 4096  # a directory holding more is read partly: a job's ranks on one node fit


@dataclass(frozen=True)
class RankProgress:
    rank: int
    step: int
    at: float  # wall clock of the write
    pid: int
    node: str = ""  # the rank's node as it wrote it ("": not said, a single-node job's)

    def on(self, node: str) -> bool:
        """Is this rank one of `node`'s (a file that names no node is the reader's own)?"""
        return not self.node or not node or self.node == node


def _replace(path: Path, line: str) -> None:
    """Replace one rank's file with `line`, atomically (raises OSError: the caller ignores it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _node_field(node: str) -> str:
    return f" {node}" if node and node.isprintable() and " " not in node else ""


def _rank_files(directory: str | os.PathLike[str], prefix: str):
    """(rank, the file's first fields) of each `<prefix><R>` file (the job's own to write: at most
    MAX_RANK_FILES entries looked at, 400 bytes each; unreadable ones skipped)."""
    try:
        entries = os.scandir(directory)
    except OSError:
        return
    with entries:
        for n, entry in enumerate(entries):
            if n >= MAX_RANK_FILES:
                break
            if not entry.name.startswith(prefix):
                continue
            try:
                rank = int(entry.name[len(prefix):])
                with open(entry.path, "rb") as fh:
                    fields = fh.read(400).decode().split()
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            yield rank, fields


def write(directory: str | os.PathLike[str], rank: int, step: int, at: float, node: str = "") -> None:
    """Replace this rank's file (raises OSError: the caller ignores it, training goes on)."""
    _replace(Path(directory) / f"rank-{rank}", f"{int(step)} {at:.3f} {os.getpid()}{_node_field(node)}\n")


def read_all(directory: str | os.PathLike[str]) -> dict[int, RankProgress]:
    """Every rank's last report, by rank; malformed files (the job's own to write) are skipped."""
    out: dict[int, RankProgress] = {}
    for rank, fields in _rank_files(directory, "rank-"):
        try:
            step, at, pid = fields[:3]
            out[rank] = RankProgress(rank, int(step), float(at), int(pid), fields[3][:255] if len(fields) > 3 else "")
        except ValueError:
            continue
    return dict(sorted(out.items()))  # by rank, whatever order the directory lists them in


# --- announced phases (`trainer.phase`) ------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """A rank inside a long silent phase it announced (evaluation, compilation, a save)."""
    rank: int
    name: str
    started: float  # wall clock
    expected_s: float  # <= 0: not said (the hang watch's ceiling)
    pid: int
    node: str = ""

    def on(self, node: str) -> bool:
        return not self.node or not node or self.node == node

    def live(self, now: float, default_s: float) -> bool:
        """Still within its expected time (wall clock `now`)."""
        return now < self.started + (self.expected_s if self.expected_s > 0 else default_s)

    def words(self, now: float) -> str:
        expected = f" of {self.expected_s:g} s expected" if self.expected_s > 0 else ""
        return f"rank {self.rank} in {self.name!r} for {max(0.0, now - self.started):.0f} s{expected}"


def write_phase(directory: str | os.PathLike[str], rank: int, name: str, started: float, expected_s: float,
                node: str = "") -> None:
    """This rank's phase file `phase-<R>` (raises OSError: the caller ignores it)."""
    clean = "".join(c for c in name if c.isprintable() and not c.isspace())[:40] or "phase"
    _replace(Path(directory) / f"phase-{rank}",
             f"{clean} {started:.3f} {float(expected_s):g} {os.getpid()}{_node_field(node)}\n")


def end_phase(directory: str | os.PathLike[str], rank: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(directory) / f"phase-{rank}")


def read_phases(directory: str | os.PathLike[str]) -> dict[int, Phase]:
    """Every rank's open phase, by rank; malformed files (the job's own) are skipped."""
    out: dict[int, Phase] = {}
    for rank, fields in _rank_files(directory, "phase-"):
        try:
            name, started, expected, pid = fields[:4]
            phase = Phase(rank, name[:40], float(started), float(expected), int(pid),
                          fields[4][:255] if len(fields) > 4 else "")
        except ValueError:
            continue
        if math.isfinite(phase.started) and math.isfinite(phase.expected_s):
            out[rank] = phase
    return dict(sorted(out.items()))
