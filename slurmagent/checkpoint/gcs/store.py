"""Checkpoint storage on Cloud Storage: the store the rest of the package imports.

Remote layout under ``gs://BUCKET/PREFIX``::

    PREFIX/blobs/blake3-<hex>   a file's contents, named by their BLAKE3, immutable
    PREFIX/blobs/pack-<hex>     small files back to back (named by the pack's BLAKE3), immutable
    PREFIX/blobs/<sha256>       file contents of manifests written before BLAKE3
    PREFIX/parts/<token>/...    parts of a parallel upload in flight (removed once composed)
    PREFIX/manifest.json        the last complete checkpoint (see slurmagent.checkpoint.Manifest)
    PREFIX/commits/<gen>.json   every commit, kept while retention keeps it (slurmagent.checkpoint.gcs.retention)
    PREFIX/ledger/...           the goodput ledger's records: never touched here

A sync uploads the missing blobs first and writes ``manifest.json`` last, so an
interrupted sync leaves the previous manifest, and everything it references,
untouched: a half-uploaded checkpoint is never restored.  :class:`GcsCheckpointStore`
is the front; the parts live beside it, each with its own story:

* :mod:`slurmagent.checkpoint.gcs.transfer`: deadlines, the worker pool, what is worth retrying;
* :mod:`slurmagent.checkpoint.gcs.bucket`: object names, the client, every request (retried, streamed);
* :mod:`slurmagent.checkpoint.gcs.manifest_store`: the manifest, read with its generation, written fenced;
* :mod:`slurmagent.checkpoint.gcs.sync` (with :mod:`~slurmagent.checkpoint.gcs.sync_run`, :mod:`~slurmagent.checkpoint.gcs.upload`,
  :mod:`~slurmagent.checkpoint.gcs.packs`): a sync, file by file, small files in packs;
* :mod:`slurmagent.checkpoint.gcs.restore`: a restore, all files or none; what the node-local cache
  (:mod:`slurmagent.checkpoint.local_cache`) or, multi-node, a peer (:mod:`~slurmagent.checkpoint.gcs.peers`)
  holds is not downloaded;
* :mod:`slurmagent.checkpoint.gcs.retention`: after a new commit, what no kept commit references goes.

Deadlines: every request has a timeout (``timeout_s``, capped by the time
left), transient failures (connection refused/reset, timeouts, 408, 429, 5xx)
are retried with jittered backoff, and the whole sync or restore ends at its
deadline: streamed transfers stop within one block, the caller gets a
:class:`SyncDeadlineError` naming what was not transferred, and the previous
manifest stays.  Worker threads are daemons: one stuck in a dead connection
never holds up the caller or the process's exit.  This module, like its parts,
imports no google library until a request is made.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import CheckpointError, SyncDeadlineError
from ..hash_cache import LocalState
from ..local_cache import BlobCache, open_cache
from ..remote import CheckpointLag, checkpoint_lag
from ..manifest import Manifest, entry_content_id as cache_id
from ..scan import scan_checkpoint_dir
from ...errors import SlurmagentError
from .bucket import BucketObjects
from .manifest_store import ManifestStore
from .peers import PeerSession
from .restore import run_restore
from .retention import GcResult, collect
from .sync import run_sync
from .sync_run import SyncResult
from .verify import existing, object_of, objects_of
from .transfer import Aborted, Deadline, MiB, Notices, TransferSettings, one_line


log = logging.getLogger(__name__)

T = TypeVar("T")


class GcsCheckpointStore:
    """Checkpoints of one job under ``gs://BUCKET/PREFIX``.

    ``client``: a ``google.cloud.storage.Client`` (default :func:`make_client`, created
    on first use).  ``timeout_s``: per-request timeout.  ``max_workers``: parallel
    transfers.  ``warn``: called with one line for everything worth the user's
    attention that does not fail the sync (a file left out, a file that keeps
    changing); each is said once per store.  Default: this module's logger.

    After every sync, :attr:`last_sync_error` holds its one-line error ("" when
    it succeeded) and :attr:`last_sync` its :class:`SyncResult`; :meth:`lag`
    says how far the bucket is behind the local directory.
    """

    small_file_max = 1 * MiB  # read once into memory, uploaded from there (or packed)
    pack_file_max = 256 * 1024  # files up to this size go up together, in packs
    pack_size = 8 * MiB  # bytes per pack (two sealed packs and one filling are in memory)
    # From this size on a file goes up as parts in parallel, then compose; None: never.  Off by
    # default: on both emulators every object write holds one global lock and compose copies the
    # bytes again, so parts lose to one stream (2 GiB: 114 s against 22 s, bench/flush.py);
    # Cloud Storage composes without copying, where parallel parts pay for big files.
    parallel_upload_threshold: int | None  # set from parallel_upload_mib (0: None)
    part_size = 128 * MiB  # part of a parallel upload (grown so a file has at most 1024 parts)
    # From this size on a file is restored as parallel ranged reads ("sliced"), at most
    # slices_per_file of them, none under range_size.  Few and large, as gcloud does: on
    # bench/flush.py (1 GiB, best of 6) 32 slices of 32 MiB took 2.36 s, 4 of 256 MiB 0.82 s,
    # one stream 0.62 s; Cloud Storage serves one stream at a fraction of a NIC, 4 fill more.
    ranged_download_threshold = 128 * MiB
    range_size = 64 * MiB  # the smallest slice
    slices_per_file = 4
    hash_workers = 2  # large files hashed at once (each holds a 16 MiB buffer)
    busy_retries = 3  # more tries of a file that changed while it was read, within one sync
    busy_pause_s = 0.5

    def __init__(
        self,
        remote_url: str,
        *,
        client: Any = None,
        timeout_s: float = 30.0,
        max_workers: int = 16,
        parallel_upload_mib: int = 0,
        warn: Callable[[str], None] | None = None,
        run_id: str = "",
        keep_commits: int | None = None,
        gc_grace_s: float = 600.0,
        local_cache_gib: float = -1.0,
        local_cache_dir: str = "",
        local_cache_copies: int | None = None,
    ) -> None:
        self.max_workers = max(1, int(max_workers))
        self.parallel_upload_threshold = parallel_upload_mib * MiB or None
        self.objects = BucketObjects(remote_url, client=client, timeout_s=timeout_s, pool_size=max(32, self.max_workers * 2))
        self.bucket_name, self.prefix, self.url = self.objects.bucket_name, self.objects.prefix, self.objects.url
        self.timeout_s = self.objects.timeout_s
        self.notices = Notices(warn)
        self.manifests = ManifestStore(self.objects)
        self._committed: dict[str, tuple[int, int]] = {}
        # Objects seen in the bucket during this run (slurmagent.checkpoint.gcs.verify): a store lives for one
        # wrapper attempt; with ``run_id`` (a node agent, a new process every round) the set is also
        # kept in the state file, under ``run_id/attempt``.
        self.seen: set[str] = set()
        self.run_id = run_id
        self.last_sync_error = ""
        self.last_sync: SyncResult | None = None
        # Retention: keep the last ``keep_commits`` commits (None: no records, no clean-up, as before).
        if keep_commits is not None and (not isinstance(keep_commits, int) or keep_commits < 1):
            raise ValueError("keep_commits must be an integer >= 1")
        self.keep_commits = keep_commits
        self.gc_grace_s = float(gc_grace_s)
        self.manifests.history = keep_commits is not None
        self.last_gc: GcResult | None = None
        self._records: dict[str, Manifest] = {}  # commit records read (they never change)
        self._state_ref: tuple[str | os.PathLike, str | os.PathLike] | None = None  # last sync's (state file, dir)
        # The node-local cache of committed blobs (slurmagent.checkpoint.local_cache): < 0 = off,
        # 0 = room for keep_commits checkpoints.
        self.local_cache_gib = float(local_cache_gib)
        self.local_cache_dir = local_cache_dir
        self.local_cache_copies = local_cache_copies  # an automatic bound's checkpoints (default keep_commits)
        self.last_cache: BlobCache | None = None  # the cache of the last restore or sync (its counters)

    @property
    def warn(self) -> Callable[[str], None] | None:
        """Where lines about files a sync leaves out go (None: the storage logger)."""
        return self.notices.warn

    @warn.setter
    def warn(self, callback: Callable[[str], None] | None) -> None:
        self.notices.warn = callback

    # -- names and client

    @property
    def manifest_name(self) -> str:
        return self.objects.manifest_name

    @property
    def manifest_url(self) -> str:
        return self.objects.manifest_url

    def blob_name(self, content_id: str) -> str:
        """Object name of a content id (``blake3:<hex>``, ``sha256:<hex>`` or a bare legacy sha256)."""
        return self.objects.blob_name(content_id)

    @property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client``, made on first use."""
        return self.objects.client

    def settings(self) -> TransferSettings:
        """The tunables as they are now: each sync or restore reads them once, when it starts."""
        return TransferSettings(
            max_workers=self.max_workers,
            small_file_max=self.small_file_max,
            pack_file_max=self.pack_file_max,
            pack_size=self.pack_size,
            parallel_upload_threshold=self.parallel_upload_threshold,
            part_size=self.part_size,
            ranged_download_threshold=self.ranged_download_threshold,
            range_size=self.range_size,
            slices_per_file=self.slices_per_file,
            hash_workers=self.hash_workers,
            busy_retries=self.busy_retries,
            busy_pause_s=self.busy_pause_s,
        )

    # -- manifest

    def latest_manifest(self, *, deadline_s: float = 60.0) -> Manifest | None:
        """The last complete checkpoint's manifest, or None when there is none."""
        return self.read_manifest(deadline_s=deadline_s)[0]

    def read_manifest(self, *, deadline_s: float = 60.0) -> tuple[Manifest | None, int]:
        """(manifest, generation) of the last complete checkpoint; (None, 0) when there is none."""
        return self._guard(self.manifests.read, Deadline(deadline_s), "reading the manifest")

    def commit(self, manifest: Manifest, *, deadline_s: float = 60.0) -> int:
        """Write ``manifest`` as the complete checkpoint, fenced as :meth:`sync` does (a newer
        attempt's manifest is never overwritten; ``if_generation_match`` on the one read).
        Every blob it names must already be stored. Returns the manifest's generation; an
        identical manifest of the same attempt already in place is kept as it is."""
        dl = Deadline(deadline_s)
        before = self.manifests.writes
        generation = self._guard(lambda dl: self.manifests.commit(manifest, dl), dl, "committing the manifest of")
        if self.manifests.writes != before:
            self._after_commit(manifest.attempt, dl)
        return generation

    @property
    def owner(self) -> str | None:
        """The submission this store commits as (:mod:`slurmagent.run.identity`); None: not decided,
        fencing by attempt alone."""
        return self.manifests.owner

    @owner.setter
    def owner(self, value: str | None) -> None:
        self.manifests.owner = value

    def claim(self, manifest: Manifest, over: Manifest | None, generation: int, *, deadline_s: float = 60.0) -> int:
        """Take the prefix over from ``over`` (the manifest read at ``generation``, another
        submission's): see :meth:`ManifestStore.claim`. Returns the new generation."""
        return self._guard(lambda dl: self.manifests.claim(manifest, over, generation, dl), Deadline(deadline_s),
                           "taking over")

    def missing_objects(self, files: dict[str, dict], *, deadline_s: float = 60.0) -> list[str]:
        """The entries of ``files`` whose blob or pack is not in the bucket, checked once per run
        (what this store has seen exist is not asked again): a commit never points at a missing one."""
        objs = objects_of(files)

        def check(dl: Deadline) -> set[str]:
            todo = [o for o in objs if o not in self.seen]
            there = existing(self.objects, todo, dl, self.max_workers)
            self.seen.update(there)
            return set(todo) - there

        missing = self._guard(check, Deadline(deadline_s), "checking the blobs of")
        return sorted(rel for rel, e in files.items() if "link" not in e and object_of(e) in missing)

    # -- sync

    def sync(
        self,
        ckpt_dir: str | os.PathLike,
        attempt: int,
        state_file: str | os.PathLike,
        deadline_s: float = 600.0,
        restored: Manifest | None = None,
        *,
        commit: bool = True,
    ) -> SyncResult:
        """Upload new/changed files of ``ckpt_dir``, then write the manifest (last).

        ``commit=False`` uploads the blobs and returns their entries (``SyncResult.files``)
        without writing the manifest: one node's part of a multi-node checkpoint, which the
        job commits once with :meth:`commit` after every node's upload.  ``restored``: the
        manifest this attempt started from (its no-progress streak is carried on).

        ``attempt``: this job's restart count (fencing).  ``state_file``: the hash
        cache, outside ``ckpt_dir``.  ``deadline_s``: the time budget, kept: what
        was not uploaded by then is named in a :class:`SyncDeadlineError` and the
        previous checkpoint stays.  An empty directory never replaces an existing
        checkpoint.  A file that cannot be read is left out (said once through
        ``warn``); one that keeps changing keeps its previous committed version
        (or is left out) and is named in :attr:`SyncResult.busy`.  The objects the committed
        manifest references are checked once per run (:mod:`slurmagent.checkpoint.gcs.verify`): a missing
        one is uploaded again from the local files, never referenced blindly.  Raises
        :class:`StaleAttemptError`, :class:`StorageUnavailableError` (and its
        :class:`SyncDeadlineError`), :class:`ManifestError` (remote manifest
        unreadable), :class:`CheckpointError`.  Local files are only read.
        """
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ValueError("attempt must be an integer >= 0")
        dl = Deadline(deadline_s)
        self._state_ref = (state_file, ckpt_dir)
        before = self.manifests.writes
        try:
            result, committed = self._guard(
                lambda dl: run_sync(self.objects, self.manifests, self.notices, self.settings(), ckpt_dir, attempt,
                                    state_file, dl, restored, commit, self.seen,
                                    f"{self.run_id}/{attempt}" if self.run_id else ""),
                dl,
                "syncing",
            )  # fmt: skip
        except SlurmagentError as exc:
            self.last_sync_error = str(exc)
            raise
        if committed is not None:
            self._committed = committed
        self.last_sync_error = ""
        self.last_sync = result
        self._cache_synced(ckpt_dir, state_file, result)
        if self.manifests.writes != before:
            self._after_commit(attempt, dl)
        return result

    # -- retention

    def collect_garbage(
        self,
        *,
        attempt: int | None = None,
        keep: int | None = None,
        grace_s: float | None = None,
        dry_run: bool = False,
        deadline_s: float = 300.0,
        before_delete: Callable[[], None] | None = None,
    ) -> GcResult:
        """Delete the objects no kept commit references (:mod:`slurmagent.checkpoint.gcs.retention`).
        ``attempt``: the caller's, fenced (None: a tool). ``keep``/``grace_s``: default this store's.
        After a clean-up that deleted anything, what this run knew to exist is forgotten."""
        keep = keep if keep is not None else (self.keep_commits or 2)
        grace = self.gc_grace_s if grace_s is None else float(grace_s)
        result = self._guard(
            lambda dl: collect(self.objects, self.manifests, keep, grace, dl, attempt=attempt, dry_run=dry_run,
                               workers=self.max_workers, cache=self._records, before_delete=before_delete),
            Deadline(deadline_s), "cleaning up")  # fmt: skip
        if result.deleted and not dry_run:
            self.forget_seen(result)
        self.last_gc = result
        return result

    def forget_seen(self, result: GcResult) -> None:
        """Drop this run's "that object exists" knowledge (the missing-blob check's set, in memory and
        in the state file): a deleted blob is uploaded again, never assumed."""
        self.seen.clear()
        if self._state_ref is None:
            return
        state = LocalState(*self._state_ref)
        state.set_verified(self.url, "", ())
        gone = {self.object_id(o.name) for o in result.deleted}
        state.forget_blobs(self.url, gone)
        try:
            state.save()
        except OSError as exc:
            log.warning("could not save the checkpoint hash cache %s: %s", state.path, exc.strerror or exc)

    def object_id(self, name: str) -> str:
        """The object id (``pack:<hex>``, ``blake3:<hex>``, ``sha256:<hex>``) of an object name under ``blobs/``."""
        base = name.rpartition("/")[2]
        algo, sep, hexd = base.partition("-")
        return f"{algo}:{hexd}" if sep else f"sha256:{base}"

    def _after_commit(self, attempt: int, dl: Deadline) -> None:
        """A new manifest is durable: the fence holder cleans up, within what is left of the deadline.
        A failed clean-up is said once and never fails the sync (the next commit tries again)."""
        if self.keep_commits is None or dl.remaining() < 1.0:
            return
        try:
            self.collect_garbage(attempt=attempt, deadline_s=dl.remaining())
        except SlurmagentError as exc:
            self.notices.say_once(f"gc:{exc}", f"checkpoint clean-up of {self.url} failed (retried after the next "
                                  f"commit): {exc}")

    def _guard(self, fn: Callable[[Deadline], T], dl: Deadline, what: str) -> T:
        """Every failure as one-line :class:`CheckpointError` (no traceback reaches a sync thread)."""
        try:
            return fn(dl)
        except SlurmagentError:
            raise
        except Aborted:
            raise SyncDeadlineError(f"{what} {self.url}: deadline of {dl.total:g}s reached") from None
        except Exception as exc:
            log.debug("%s %s failed", what, self.url, exc_info=True)
            raise CheckpointError(f"{what} {self.url} failed: {one_line(exc)}") from exc

    # -- lag

    def lag(self, ckpt_dir: str | os.PathLike, now: float | None = None) -> CheckpointLag:
        """How far the bucket is behind ``ckpt_dir``, against the last sync or restore of this store."""
        return checkpoint_lag(scan_checkpoint_dir(ckpt_dir), dict(self._committed), now)

    # -- restore

    def restore(
        self,
        ckpt_dir: str | os.PathLike,
        *,
        deadline_s: float = 1800.0,
        state_file: str | os.PathLike | None = None,
    ) -> Manifest | None:
        """Download the last complete checkpoint into ``ckpt_dir``; None when there is none.

        Files are downloaded in parallel (a large one as parallel ranged reads)
        into a staging directory inside ``ckpt_dir`` (a reserved name, never
        synced), each verified (size + CRC32C), and renamed to their final
        names, links recreated, only when all are good.  On any failure nothing
        appears under a final name and the staging directory is removed.
        Entries of ``ckpt_dir`` that are not in the manifest are left alone.
        ``state_file``: the sync's hash cache, told the restored files' digests so
        the next sync neither reads nor uploads them again.
        """
        return self._restore(Path(ckpt_dir), deadline_s, state_file)

    def restore_manifest(
        self,
        ckpt_dir: str | os.PathLike,
        manifest: Manifest,
        *,
        deadline_s: float = 1800.0,
        state_file: str | os.PathLike | None = None,
        peers: PeerSession | None = None,
    ) -> None:
        """Put exactly the entries of ``manifest`` (one already read, possibly a part of one)
        into ``ckpt_dir``, all or none, as :meth:`restore` does; ``peers``: the other nodes of the
        job serve what their caches hold (:mod:`slurmagent.checkpoint.gcs.peers`)."""
        self._restore(Path(ckpt_dir), deadline_s, state_file, manifest, peers)

    def cache_for(self, ckpt_dir: str | os.PathLike) -> BlobCache | None:
        """The node-local cache beside ``ckpt_dir`` (None: off, or its directory unusable, said once)."""
        self.last_cache = open_cache(ckpt_dir, self.local_cache_gib, self.local_cache_dir,
                                     lambda m: self.notices.say_once(f"cache:{m}", m), copies=self.local_cache_copies or self.keep_commits or 2)
        return self.last_cache

    def _cache_synced(self, ckpt_dir: str | os.PathLike, state_file: str | os.PathLike, result: SyncResult) -> None:
        """After a sync: its files enter the node-local cache, those the hash cache saw hashed
        exactly as they are now, and those written too soon before the sync for the hash cache to
        keep (racy) but not touched since the sync began (never read again: the flush's time is
        the job's); what no file of this sync names leaves first when over the bound."""
        if self.local_cache_gib < 0 or not result.files:
            return
        cache = self.cache_for(ckpt_dir)
        if cache is None:
            return
        cache.fit(sum(e.get("size", 0) for e in result.files.values() if "link" not in e))
        try:
            state = LocalState(state_file, ckpt_dir)
        except CheckpointError:
            return
        stats = {}
        for rel, e in result.files.items():
            seen = state.files.get(rel)
            if seen and "ino" in seen and e.get("blake3") and seen.get("blake3") == e["blake3"]:
                stats[rel] = (seen["ino"], seen["size"], seen["mtime_ns"])
        try:
            cache.enter_many(ckpt_dir, result.files, stats)
            began_ns = time.time_ns() - int((result.seconds + 0.02) * 1e9)  # a coarse mtime tick
            for rel, e in result.files.items():
                if "link" in e or rel in stats:
                    continue
                path = os.path.join(ckpt_dir, *rel.split("/"))
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_mtime_ns < began_ns:  # the bytes this sync hashed (a take checks them again)
                    cache.enter(path, e, (st.st_ino, st.st_size, st.st_mtime_ns), verified=False)
            cache.trim(keep={cache_id(e) for e in result.files.values() if "link" not in e})
            cache.save_records()
        except OSError as exc:  # the cache never fails a sync
            self.notices.say_once(f"cache:{exc}", f"node-local checkpoint cache {cache.root}: {exc.strerror or exc}")

    def _restore(
        self, root: Path, deadline_s: float, state_file: str | os.PathLike | None, manifest: Manifest | None = None,
        peers: PeerSession | None = None,
    ) -> Manifest | None:
        cache = self.cache_for(root) if self.local_cache_gib >= 0 else None
        restored, committed = self._guard(
            lambda dl: run_restore(self.objects, self.manifests, self.notices, self.settings(), root, dl, state_file,
                                   manifest, cache, peers),
            Deadline(deadline_s),
            "restoring",
        )  # fmt: skip
        if committed is not None:
            self._committed = committed
        return restored
