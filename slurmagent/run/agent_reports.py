"""What each node agent reports, and how the batch step merges the reports (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence
from ..checkpoint.errors import RestoreError
from ..checkpoint.manifest import Manifest, entry_content_id


@dataclass
class NodeReport:
    """What one node's agent says it did (JSON, framed on the agent step's stdout: agent_channel)."""

    index: int
    node: str
    ok: bool
    error: str = ""
    generation: int = 0  # restore: the manifest generation now in place
    files: dict[str, dict] = field(default_factory=dict)  # sync: relpath -> manifest entry
    units: dict[str, str] = field(default_factory=dict)  # sync: unit -> how it looked after the upload
    writing: list[str] = field(default_factory=list)  # sync: files the job's processes held open for writing then
    appending: list[str] = field(default_factory=list)  # sync: ... open for appending (logs)
    views: dict[str, list] = field(default_factory=dict)  # sync: unit -> checkpoint/cut.round_views
    declared: list[list] = field(default_factory=list)  # sync: checkpoint/saved.declared_sets (trainer.saved)
    started_ns: int = 0  # sync: this agent's wall clock when it began (compared with the batch step's)
    files_sent: int = 0
    bytes_sent: int = 0
    messages: list[str] = field(default_factory=list)
    node_local: bool = False  # restore: failed because of this node's disk or path (another node would do)
    ranks: list[dict] = field(default_factory=list)  # sync: this node's ranks' progress and state (hang/remote.py)
    phases: list[dict] = field(default_factory=list)  # sync: this node's ranks' announced phases (trainer.phase)

    def payload(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_payload(cls, payload: bytes) -> NodeReport | None:
        try:
            raw = json.loads(payload)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (ValueError, TypeError, KeyError):
            return None

    @property
    def who(self) -> str:
        return f"{self.node or '?'} (node index {self.index})"


# --------------------------------------------------------------------------- merging (pure)


@dataclass
class Merged:
    files: dict[str, dict]
    writers: dict[str, list[int]]
    conflicts: dict[str, str] = field(default_factory=dict)  # relpath -> what was kept and why
    dropped: list[str] = field(default_factory=list)  # deleted by their writer, held by others from the restore


def merge_reports(reports: Sequence[NodeReport], *, baseline: Manifest | None) -> Merged:
    """Every node's files as one checkpoint (the cut then picks what a periodic commit takes).

    `baseline`: the checkpoint restored at start: which copy "changed since the restore", and
    who wrote each file before (module doc)."""
    copies: dict[str, list[tuple[int, dict]]] = {}
    for r in sorted(reports, key=lambda r: r.index):
        for rel, entry in r.files.items():
            copies.setdefault(rel, []).append((r.index, entry))
    present = {r.index for r in reports}
    files: dict[str, dict] = {}
    writers: dict[str, list[int]] = {}
    conflicts: dict[str, str] = {}
    dropped: list[str] = []
    for rel, cands in copies.items():
        was = content_key(baseline.files[rel]) if baseline and rel in baseline.files else None
        if was is not None:
            wrote_before = writers_before(baseline, rel)
            wrote = [(i, e) for i, e in cands if content_key(e) != was or i in wrote_before]
            if not wrote and wrote_before & present:
                dropped.append(rel)  # its writer deleted it; the others hold the restored copy only
                continue
            cands = wrote or cands  # its writers are not in this job: the restored copies stay
        writers[rel] = [i for i, _ in cands]
        if len({content_key(e) for _, e in cands}) == 1:
            files[rel] = cands[0][1]
            continue
        changed = [(i, e) for i, e in cands if content_key(e) != was]
        index, entry = min(changed or cands, key=lambda c: c[0])
        files[rel] = entry
        if len(changed) == 1:
            # the normal case after a restore of every file to every node: one rank rewrote
            # its file, the other nodes still hold the restored copy; nothing to warn about
            continue
        conflicts[rel] = (f"{rel} differs on node indexes {[i for i, _ in cands]}: kept node {index}'s copy "
                          "(the lowest node index)")
    return Merged(files, writers, conflicts, sorted(dropped))


def writers_before(baseline: Manifest, rel: str) -> set[int]:
    """The node indexes that wrote `rel` of the restored checkpoint (a single-node one: the batch node, 0)."""
    return set(baseline.writers.get(rel, [0])) if baseline.node_count else {0}


def content_key(entry: dict) -> str:
    """What makes two manifest entries the same file: its content (or link target), wherever stored."""
    return entry_content_id(entry)


def select_for_node(manifest: Manifest, index: int, num_nodes: int, scope: str) -> Manifest:
    """The part of `manifest` that node `index` must hold: all of it, or (scope "node") the
    files that node index held when it was committed."""
    if scope == "all" or not manifest.node_count:
        return manifest
    if manifest.node_count != num_nodes:
        raise RestoreError(
            f"--restore-scope node: the checkpoint was written by {manifest.node_count} nodes, this job has "
            f"{num_nodes}; restore it whole (--restore-scope all) or run on {manifest.node_count} nodes")
    files = {rel: e for rel, e in manifest.files.items() if index in manifest.writers.get(rel, [index])}
    return Manifest(manifest.attempt, manifest.created, files, manifest.node_count,
                    {rel: w for rel, w in manifest.writers.items() if rel in files})


