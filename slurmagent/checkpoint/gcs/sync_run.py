"""One sync's book-keeping, shared by its worker threads, and what a sync returns.

A sync hashes and uploads files on many threads at once (:mod:`slurmagent.checkpoint.gcs.upload`,
:mod:`slurmagent.checkpoint.gcs.packs`), then builds the manifest (:mod:`slurmagent.checkpoint.gcs.sync`);
:class:`SyncRun` is where they all write down what happened to each file.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..hashing import FileDigest
from ..scan import LocalFile
from ..hash_cache import LocalState
from ..manifest import Manifest, entry_content_id
from .bucket import BucketObjects
from .manifest_store import ManifestStore
from .transfer import Deadline, Notices, TransferSettings, WorkerPool

__all__ = ["SyncResult", "SyncRun"]


@dataclass(frozen=True)
class SyncResult:
    """What one sync did; ``files`` are its manifest entries (one node's part when it did not commit)."""

    files_sent: int  # blobs uploaded by this sync
    bytes_sent: int  # their total size (blob payload; the small manifest is not counted)
    manifest_generation: int | None  # generation of the manifest now in place (None: none written yet)
    skipped_unchanged: int  # files of the manifest whose content was already stored remotely
    files_total: int  # entries in the manifest (files and links)
    busy: tuple[str, ...] = ()  # files that kept changing: previous version kept, or left out
    skipped: tuple[str, ...] = ()  # entries left out: unreadable, temporary names, links leading outside
    seconds: float = 0.0
    files: dict[str, dict] = field(default_factory=dict)  # the manifest entries of this sync, by relpath
    manifest: Manifest | None = None  # the manifest in place after this sync (None: none yet)


class SyncRun:
    """Book-keeping of one sync, shared by its worker threads, with what they work with."""

    def __init__(
        self,
        objects: BucketObjects,
        manifests: ManifestStore,
        notices: Notices,
        settings: TransferSettings,
        state: LocalState,
        current: Manifest | None,
        dl: Deadline,
    ) -> None:
        self.objects = objects
        self.manifests = manifests
        self.notices = notices
        self.settings = settings
        self.state = state
        self.current = current
        self.dl = dl
        self.pool = WorkerPool(settings.max_workers, dl, "ckpt-sync", {"hash": settings.hash_workers, "pack": 2})
        self.lock = threading.Lock()
        # where each content of the current manifest is stored: {} (its own blob) or {"pack", "offset"}
        self.locations: dict[str, dict] = {}
        for e in current.regular_files().values() if current else ():
            self.locations[entry_content_id(e)] = {k: e[k] for k in ("pack", "offset") if k in e}
        self.in_manifest = set(self.locations)
        self.known = state.known_blobs(objects.url) - self.in_manifest
        self.packing: list[tuple[LocalFile, FileDigest, str, bytes]] = []
        self.packing_bytes = 0
        self.pack_slots = threading.BoundedSemaphore(2)  # sealed packs held in memory at once
        self.claimed: set[str] = set()
        self.confirmed: set[str] = set()
        self.included: dict[str, tuple[LocalFile, FileDigest, str]] = {}  # relpath -> (file, digest, id)
        self.uploaded: dict[str, int] = {}  # content id -> bytes, for blobs this sync uploaded
        self.busy: dict[str, LocalFile] = {}
        self.unreadable: dict[str, str] = {}
        self.done: set[str] = set()
        self.missing_ids: set[str] = set()  # content ids of the committed manifest whose object is gone
        self.committed: dict[str, tuple[int, int]] | None = None  # relpath -> (size, mtime_ns), once committed

    def file_busy(self, f: LocalFile, cid: str | None = None) -> None:
        """``f`` changed while it was read: another try later, and its content is no longer claimed."""
        with self.lock:
            self.busy[f.relpath] = f
            self.included.pop(f.relpath, None)
            if cid is not None:
                self.claimed.discard(cid)
