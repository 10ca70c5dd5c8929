"""The manifest: what a complete checkpoint holds, as ``PREFIX/manifest.json`` says it.

Parsing validates every field against the name rules (:mod:`slurmagent.checkpoint.scan`),
so a manifest that parses is one a restore can put in place as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Mapping

from .errors import ManifestError
from .hashing import CONTENT_ALGOS, is_crc32c_b64, is_hex_digest
from .scan import link_problem, name_problem, parent_dirs

__all__ = [
    "MANIFEST_SCHEMA",
    "OWNER_RE",
    "Manifest",
    "content_signature",
    "entry_content_id",
    "no_progress_after",
    "utc_now_rfc3339",
]

MANIFEST_SCHEMA = 2  # 1: sha256 entries only (still read); 2: + blake3 and link entries
# A checkpoint owner: a submission id, a Cloud Run execution, or a prefix claim (slurmagent.run.identity).
OWNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def entry_content_id(entry: Mapping) -> str:
    """``blake3:<hex>`` / ``sha256:<hex>`` for a file entry, ``link:<target>`` for a link."""
    if "link" in entry:
        return f"link:{entry['link']}"
    for algo in CONTENT_ALGOS:
        if entry.get(algo):
            return f"{algo}:{entry[algo]}"
    raise ValueError(f"manifest entry without a content id: {entry!r}")


def utc_now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Manifest:
    """A complete checkpoint: what ``PREFIX/manifest.json`` holds.

    JSON (schema 2; schema 1, written before BLAKE3, has sha256 entries only)::

        {"schema": 2, "attempt": 2, "created": "2026-11-30T05:00:00Z",
         "files": {"step100/model.pt": {"blake3": "<64 hex>", "size": 123, "crc32c": "AAAAAA=="},
                   "step100/.metadata": {"blake3": "<64 hex>", "size": 9, "crc32c": "AAAAAA==",
                                         "pack": "<64 hex>", "offset": 4096},
                   "old.pt": {"sha256": "<64 hex>", "size": 5, "crc32c": "AAAAAA=="},
                   "last.ckpt": {"link": "step100/model.pt"}}}

    ``attempt`` is the restart count of the job that wrote it (fencing: a lower
    attempt never overwrites a higher one); ``crc32c`` is base64 of the
    big-endian CRC32C as Cloud Storage reports it.  A file's bytes are the
    object ``blobs/blake3-<hex>`` (``blobs/<sha256>`` for a sha256 entry), or,
    with ``pack``, ``size`` bytes at ``offset`` of ``blobs/pack-<pack>``: small
    files travel together.  A ``link`` entry is a symlink, its target relative
    to the link's directory.  Unknown keys are ignored.

    A multi-node job's manifest also says how many nodes wrote it and which node
    indexes held each file (``"node_count": 2, "writers": {"rank1.pt": [1]}``), so a
    restore can give each node only its own files (``--restore-scope node``);
    ``no_progress`` counts the restarts in a row whose committed checkpoint
    equals the one they restored (the wrapper's requeue budget).

    ``owner`` (optional, absent in manifests written before it) names the submission whose
    checkpoint this is (:mod:`slurmagent.run.identity`): fencing compares attempts only between
    manifests of one owner; a manifest of another owner is foreign, never "newer". Readers
    that predate it ignore it (unknown keys), so the format stays schema 2.
    """

    attempt: int
    created: str = field(default_factory=utc_now_rfc3339)
    files: dict[str, dict] = field(default_factory=dict)
    node_count: int = 0  # 0: a single-node checkpoint (no writers recorded)
    writers: dict[str, list[int]] = field(default_factory=dict)
    no_progress: int = 0  # restarts in a row whose committed files equal the restored ones
    owner: str = ""  # the submission that wrote it ("": written before owners existed)

    @property
    def total_bytes(self) -> int:
        return sum(e.get("size", 0) for e in self.files.values())

    def regular_files(self) -> dict[str, dict]:
        return {rel: e for rel, e in self.files.items() if "link" not in e}

    def links(self) -> dict[str, str]:
        return {rel: e["link"] for rel, e in self.files.items() if "link" in e}

    def content_signature(self) -> tuple[tuple[str, str], ...]:
        """(name, content id) of every entry, sorted: equal iff two checkpoints hold the same."""
        return content_signature(self.files)

    def same_content(self, files: Mapping[str, dict]) -> bool:
        """Same names with the same contents (content ids; where the bytes are stored does not count)."""
        return self.content_signature() == content_signature(files)

    def to_json(self) -> str:
        body: dict = {"schema": MANIFEST_SCHEMA, "attempt": self.attempt, "created": self.created, "files": self.files}
        if self.node_count:
            body.update(node_count=self.node_count, writers=self.writers)
        if self.no_progress:
            body["no_progress"] = self.no_progress
        if self.owner:
            body["owner"] = self.owner
        return json.dumps(body, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> "Manifest":
        """Parse and validate; any problem is a :class:`ManifestError` naming ``source`` and the field."""

        def bad(why: str) -> ManifestError:
            return ManifestError(f"malformed checkpoint manifest {source}: {why}")

        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise bad(f"not JSON ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})") from None
        if not isinstance(raw, dict):
            raise bad("not a JSON object")
        schema = raw.get("schema")
        if schema not in (1, MANIFEST_SCHEMA) or isinstance(schema, bool):
            raise bad(f"unsupported schema {schema!r} (expected 1 or {MANIFEST_SCHEMA}; a newer slurmagent wrote it?)")
        attempt = raw.get("attempt")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise bad(f"attempt {attempt!r} is not an integer >= 0")
        created = raw.get("created")
        if not isinstance(created, str):
            raise bad("created is missing or not a string")
        try:
            dt = datetime.fromisoformat(created.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise bad(f"created {created!r} is not an RFC 3339 time") from None
        if dt.tzinfo is None:
            raise bad(f"created {created!r} has no time zone")
        files = raw.get("files")
        if not isinstance(files, dict):
            raise bad("files is missing or not an object")
        clean: dict[str, dict] = {}
        for rel, e in files.items():
            problem = name_problem(rel)
            if problem:
                raise bad(f"file name {rel!r} {problem}")
            if not isinstance(e, dict):
                raise bad(f"files[{rel!r}] is not an object")
            if "link" in e and schema != 1:
                problem = link_problem(rel, e["link"])
                if problem:
                    raise bad(f"files[{rel!r}]: {problem}")
                clean[rel] = {"link": e["link"]}
                continue
            algos = ("sha256",) if schema == 1 else CONTENT_ALGOS
            present = [a for a in algos if a in e]
            if len(present) != 1:
                want = " or ".join(algos)
                raise bad(f"files[{rel!r}] needs exactly one of {want}")
            algo = present[0]
            if not is_hex_digest(e[algo]):
                raise bad(f"files[{rel!r}].{algo} is not 64 lowercase hex digits")
            size = e.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"files[{rel!r}].size is not an integer >= 0")
            if not is_crc32c_b64(e.get("crc32c")):
                raise bad(f"files[{rel!r}].crc32c is not base64 of 4 bytes")
            clean[rel] = {algo: e[algo], "size": size, "crc32c": e["crc32c"]}
            if "pack" in e or "offset" in e:
                offset = e.get("offset")
                if algo != "blake3" or not is_hex_digest(e.get("pack")):
                    raise bad(f"files[{rel!r}].pack is not 64 lowercase hex digits of a blake3 entry")
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                    raise bad(f"files[{rel!r}].offset is not an integer >= 0")
                clean[rel].update(pack=e["pack"], offset=offset)
        _check_tree(clean, bad)
        node_count = raw.get("node_count", 0)
        if not isinstance(node_count, int) or isinstance(node_count, bool) or node_count < 0:
            raise bad(f"node_count {node_count!r} is not an integer >= 0")
        writers = raw.get("writers", {}) if node_count else {}
        if not isinstance(writers, dict):
            raise bad("writers is not an object")
        for rel, nodes in writers.items():
            if rel not in clean:
                raise bad(f"writers names {rel!r}, which is not in files")
            if not isinstance(nodes, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < node_count for i in nodes
            ):
                raise bad(f"writers[{rel!r}] is not a list of node indexes below node_count {node_count}")
        no_progress = raw.get("no_progress", 0)
        if not isinstance(no_progress, int) or isinstance(no_progress, bool) or no_progress < 0:
            raise bad(f"no_progress {no_progress!r} is not an integer >= 0")
        owner = raw.get("owner", "")
        if owner != "" and not (isinstance(owner, str) and OWNER_RE.fullmatch(owner)):
            raise bad(f"owner {owner!r} is not 1-128 letters, digits, '.', '_' or '-'")
        return cls(
            attempt=attempt,
            created=created,
            files=clean,
            node_count=node_count,
            writers={rel: sorted(set(nodes)) for rel, nodes in writers.items()},
            no_progress=no_progress,
            owner=owner,
        )


def content_signature(files: Mapping[str, dict]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((rel, entry_content_id(e)) for rel, e in files.items()))


def no_progress_after(restored: Manifest | None, files: Mapping[str, dict]) -> int:
    """The no-progress streak of a manifest committing ``files`` in an attempt that restored
    ``restored``: 0 when the attempt changed the checkpoint (or started without one), else one
    more than the restored manifest's streak. The wrapper's requeue budget is read from it."""
    if restored is None or not restored.same_content(files):
        return 0
    return restored.no_progress + 1


def _check_tree(files: Mapping[str, dict], bad: Callable[[str], ManifestError]) -> None:
    """No entry below another file or link: a restore never writes through a link."""
    for rel in files:
        for parent in parent_dirs(rel):
            if parent in files:
                what = "link" if "link" in files[parent] else "file"
                raise bad(f"file name {rel!r} lies below the {what} {parent!r}")
