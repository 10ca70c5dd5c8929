"""Checkpoint storage on Cloud Storage (the only module importing google.cloud.storage).

Remote layout under ``gs://BUCKET/PREFIX``::

    PREFIX/blobs/<sha256>     content-addressed file contents, immutable
    PREFIX/manifest.json      the last complete checkpoint (see slurmagent.checkpoint.Manifest)

A sync uploads the missing blobs first and writes ``manifest.json`` last, so an
interrupted sync leaves the previous manifest, and everything it references,
untouched: a half-uploaded checkpoint is never restored.

Fencing: the manifest carries the writer's ``attempt`` (restart count).  Before
writing, the current manifest and its generation are read; a higher attempt
there raises :class:`StaleAttemptError`; the write uses
``if_generation_match=<generation read>`` (0 when absent), and on 412 the
manifest is read again and the decision retaken.

Transfers: files go in parallel (a thread pool of ``max_workers``, hashing and
uploading pipelined per file).  A file of at least ``large_file_threshold``
bytes is first tried with ``transfer_manager.upload_chunks_concurrently`` (the
XML multipart API, parallel chunks); when the backend answers that API with
404/405/501 (fake-gcs-server and gcp-storage-emulator both do) the store
remembers it and uses resumable uploads (``resumable_chunk_size`` chunks) from
then on (403 also falls back: a role may allow uploads but not multipart ones).
The XML multipart requests run with the library's own per-request timeouts
(61 s connect, 60 s read): ``upload_chunks_concurrently`` does not forward ours.  Restores of large files use ranged, parallel downloads
(``transfer_manager.download_chunks_concurrently``), which emulators support.

Every request has a timeout (``timeout_s``, capped by the time left).  Transient
failures (connection refused/reset, timeouts, 408, 429, 5xx) are retried with
jittered exponential backoff until the caller's deadline; then
:class:`StorageUnavailableError` is raised.  A sync never deletes or changes
local files; a restore writes under a dot-directory staging name and renames
into place only after every file was verified (size + CRC32C).

The client honours ``STORAGE_EMULATOR_HOST`` as google-cloud-storage does: with
it set, anonymous credentials and a placeholder project are used; otherwise
Application Default Credentials.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from slurmagent.checkpoint import (
    CheckpointError,
    FileDigest,
    LocalChangedError,
    LocalFile,
    LocalState,
    Manifest,
    RestoreError,
    StaleAttemptError,
    StorageUnavailableError,
    no_progress_after,
    parse_remote,
    scan_checkpoint_dir,
)

__all__ = [
    "GcsCheckpointStore",
    "SyncResult",
    "make_client",
    "parse_remote",
    "is_transient",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SIMPLE_UPLOAD_MAX = 8 * 1024 * 1024  # google-cloud-storage's multipart (single request) limit
MiB = 1024 * 1024
_STAGING_PREFIX = ".slurmagent-restore-"  # a dot-dir: never synced


# ---------------------------------------------------------------------------- client


def make_client(project: str | None = None) -> Any:
    """A ``google.cloud.storage.Client``; honours ``STORAGE_EMULATOR_HOST``.

    With the emulator variable set: ``AnonymousCredentials`` and ``project`` (or
    ``GOOGLE_CLOUD_PROJECT``, or ``"slurmagent-emulator"``).  Otherwise Application
    Default Credentials (a missing one is a :class:`StorageUnavailableError`).
    """
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=project or os.environ.get("GOOGLE_CLOUD_PROJECT") or "slurmagent-emulator",
            credentials=AnonymousCredentials(),
        )
    from google.auth.exceptions import DefaultCredentialsError

    try:
        return storage.Client(project=project) if project else storage.Client()
    except DefaultCredentialsError as exc:
        raise StorageUnavailableError(
            f"no Google credentials for Cloud Storage ({str(exc).splitlines()[0]}); "
            "run on a VM with a service account or set GOOGLE_APPLICATION_CREDENTIALS"
        ) from None


def _widen_pool(client: Any, size: int) -> None:
    """Let ``size`` threads share the client's HTTP session without pool-full churn."""
    try:
        from requests.adapters import HTTPAdapter

        session = client._http
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=size)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
    except Exception:  # pragma: no cover - best effort only
        log.debug("could not widen the HTTP connection pool", exc_info=True)


# --------------------------------------------------------------------- error helpers


def _status_of(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code < 600:
        return code
    resp = getattr(exc, "response", None)
    sc = getattr(resp, "status_code", None)
    if isinstance(sc, int):
        return sc
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection refused/reset, timeouts, 408/429/5xx, transport corruption."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    import requests

    if isinstance(
        exc,
        (
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
        ),
    ):
        return True
    try:
        from google.auth.exceptions import TransportError

        if isinstance(exc, TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    if type(exc).__name__ == "DataCorruption":  # checksum mismatch in transit
        return True
    return _status_of(exc) in TRANSIENT_HTTP_STATUS


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _is_not_found(exc: BaseException) -> bool:
    return _status_of(exc) == 404


def _is_precondition_failed(exc: BaseException) -> bool:
    return _status_of(exc) == 412


class _Aborted(Exception):
    """Another worker failed; this one stops early (never surfaces to callers)."""


class _Deadline:
    def __init__(self, seconds: float) -> None:
        if seconds is None or seconds <= 0:
            raise ValueError("deadline_s must be > 0")
        self.total = float(seconds)
        self.start = time.monotonic()
        self.end = self.start + self.total
        self.abort = threading.Event()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ---------------------------------------------------------------------------- result


@dataclass(frozen=True)
class SyncResult:
    files_sent: int  # blobs uploaded by this sync
    bytes_sent: int  # their total size (blob payload; the small manifest is not counted)
    manifest_generation: int | None  # generation of the manifest now in place (None: none written yet)
    skipped_unchanged: int  # files of the manifest whose content was already stored remotely
    files_total: int  # files in the manifest
    files: dict[str, dict] = field(default_factory=dict)  # the manifest entries of this sync, by relpath
    manifest: Manifest | None = None  # the manifest in place after this sync (None: none yet)


def _crc32c_factory() -> Callable[[], Any]:
    import google_crc32c

    return google_crc32c.Checksum


def _file_crc32c(path: str | os.PathLike) -> str:
    import base64

    import google_crc32c

    crc = google_crc32c.Checksum()
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(4 * MiB)
            if not chunk:
                break
            crc.update(chunk)
    return base64.b64encode(crc.digest()).decode("ascii")


# ----------------------------------------------------------------------------- store


class GcsCheckpointStore:
    """Checkpoints of one job under ``gs://BUCKET/PREFIX``.

    ``client``: a ``google.cloud.storage.Client`` (default :func:`make_client`, created
    on first use).  ``timeout_s``: per-request timeout.  ``max_workers``: parallel files.
    """

    large_file_threshold = 256 * MiB  # chunked parallel transfer from this size on
    parallel_chunk_size = 64 * MiB  # chunk of XML multipart uploads / ranged downloads
    chunk_workers = 4  # threads per chunked transfer
    resumable_chunk_size = 32 * MiB  # request size of resumable uploads (multiple of 256 KiB)

    def __init__(
        self,
        remote_url: str,
        *,
        client: Any = None,
        timeout_s: float = 30.0,
        max_workers: int = 8,
    ) -> None:
        self.bucket_name, self.prefix = parse_remote(remote_url)
        self.url = f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = float(timeout_s)
        self.max_workers = max(1, int(max_workers))
        self._client = client
        self._bucket = None
        self._lock = threading.Lock()
        self._xml_multipart: bool | None = None  # None: not tried yet
        self._bucket_checked = False

    # -- names

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def manifest_name(self) -> str:
        return self._key("manifest.json")

    def blob_name(self, sha256: str) -> str:
        return self._key(f"blobs/{sha256}")

    @property
    def manifest_url(self) -> str:
        return f"gs://{self.bucket_name}/{self.manifest_name}"

    # -- client

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = make_client()
                _widen_pool(self._client, max(32, self.max_workers * (self.chunk_workers + 1)))
            return self._client

    @property
    def bucket(self) -> Any:
        if self._bucket is None:
            self._bucket = self.client.bucket(self.bucket_name)
        return self._bucket

    # -- retry

    def _call(self, fn: Callable[[float], T], dl: _Deadline, what: str) -> T:
        """Run ``fn(timeout)``, retrying transient failures with backoff until the deadline.

        404 and 412 are re-raised as they are (callers decide); other HTTP errors
        become :class:`StorageUnavailableError`.
        """
        delay = 0.2
        tries = 0
        while True:
            if dl.abort.is_set():
                raise _Aborted()
            tries += 1
            try:
                return fn(max(0.5, min(self.timeout_s, dl.remaining())))
            except Exception as exc:
                if isinstance(exc, (CheckpointError, _Aborted, OSError)) and not is_transient(exc):
                    raise
                if not is_transient(exc):
                    status = _status_of(exc)
                    if status in (404, 412) or status is None:
                        raise
                    raise StorageUnavailableError(f"{what} on {self.url} failed: {_one_line(exc)}") from exc
                last = exc
            pause = delay * (0.5 + random.random() / 2)
            delay = min(delay * 2, 5.0)
            left = dl.remaining()
            if left < 0.3:
                raise StorageUnavailableError(
                    f"{what} on {self.url}: gave up after {tries} tries in {dl.elapsed():.1f}s "
                    f"(deadline {dl.total:g}s): {_one_line(last)}"
                ) from last
            log.debug("%s: %s; retrying in %.2fs", what, _one_line(last), pause)
            if dl.abort.wait(min(pause, left - 0.2)):
                raise _Aborted()

    def _run_parallel(self, items: Iterable[Any], fn: Callable[[Any], T], dl: _Deadline) -> list[T]:
        items = list(items)
        if not items:
            return []
        results: list[Any] = [None] * len(items)
        first: BaseException | None = None
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(items)), thread_name_prefix="ckpt") as ex:
            futures = {ex.submit(fn, item): i for i, item in enumerate(items)}
            for fut in as_completed(futures):
                if fut.cancelled():
                    continue
                exc = fut.exception()
                if exc is None:
                    results[futures[fut]] = fut.result()
                    continue
                if first is None or (isinstance(first, _Aborted) and not isinstance(exc, _Aborted)):
                    first = exc
                dl.abort.set()
                for f in futures:
                    f.cancel()
        if first is not None:
            raise first
        return results

    # -- manifest

    def _check_bucket(self, dl: _Deadline) -> None:
        """Tell "no checkpoint yet" from "no such bucket" (needs only storage.objects.list)."""
        if self._bucket_checked:
            return

        def once(timeout: float) -> None:
            it = self.client.list_blobs(
                self.bucket_name, prefix=self._key(""), max_results=1, timeout=timeout, retry=None
            )
            for _ in it:
                break

        try:
            self._call(once, dl, "listing the checkpoint prefix")
        except Exception as exc:
            if _is_not_found(exc):
                raise StorageUnavailableError(
                    f"checkpoint bucket gs://{self.bucket_name} does not exist (remote {self.url})"
                ) from None
            raise
        self._bucket_checked = True

    def _read_manifest(self, dl: _Deadline) -> tuple[Manifest | None, int]:
        """(manifest, generation); (None, 0) when there is none."""

        def once(timeout: float) -> tuple[bytes | None, int]:
            blob = self.bucket.blob(self.manifest_name)
            data = blob.download_as_bytes(timeout=timeout, retry=None)
            if blob.generation:  # from x-goog-generation, consistent with the content
                return data, int(blob.generation)
            # The backend did not say which generation it sent (gcp-storage-emulator):
            # read the metadata, then the content of exactly that generation.
            for _ in range(5):
                meta = self.bucket.get_blob(self.manifest_name, timeout=timeout, retry=None)
                if meta is None:
                    return None, 0
                try:
                    data = self.bucket.blob(self.manifest_name).download_as_bytes(
                        if_generation_match=meta.generation, timeout=timeout, retry=None
                    )
                except Exception as exc:
                    if _is_precondition_failed(exc):
                        continue
                    raise
                return data, int(meta.generation)
            raise StorageUnavailableError(f"{self.manifest_url} keeps changing; could not read it")

        try:
            data, generation = self._call(once, dl, "reading the manifest")
        except Exception as exc:
            if not _is_not_found(exc):
                raise
            data, generation = None, 0
        if data is None:
            self._check_bucket(dl)
            return None, 0
        return Manifest.from_json(data, source=self.manifest_url), generation

    def latest_manifest(self, *, deadline_s: float = 60.0) -> Manifest | None:
        """The last complete checkpoint's manifest, or None when there is none."""
        return self._read_manifest(_Deadline(deadline_s))[0]

    def read_manifest(self, *, deadline_s: float = 60.0) -> tuple[Manifest | None, int]:
        """(manifest, generation) of the last complete checkpoint; (None, 0) when there is none."""
        return self._read_manifest(_Deadline(deadline_s))

    def commit(self, manifest: Manifest, *, deadline_s: float = 60.0) -> int:
        """Write ``manifest`` as the complete checkpoint, fenced as :meth:`sync` does (a newer
        attempt's manifest is never overwritten; ``if_generation_match`` on the one read).
        Every blob it names must already be stored. Returns the manifest's generation; an
        identical manifest of the same attempt already in place is kept as it is."""
        dl = _Deadline(deadline_s)
        current, generation = self._read_manifest(dl)
        if current is not None and current.attempt > manifest.attempt:
            raise self._stale(current, manifest.attempt)
        if (current is not None and current.attempt == manifest.attempt and current.files == manifest.files
                and current.writers == manifest.writers and current.node_count == manifest.node_count):
            return generation
        return self._commit_manifest(manifest, current, generation, dl)

    def _stale(self, current: Manifest, attempt: int) -> StaleAttemptError:
        return StaleAttemptError(
            f"checkpoint {self.manifest_url} belongs to attempt {current.attempt}, newer than ours "
            f"({attempt}); refusing to overwrite it"
        )

    def _commit_manifest(
        self, manifest: Manifest, current: Manifest | None, generation: int, dl: _Deadline
    ) -> int:
        data = manifest.to_json().encode("utf-8")
        races = 0
        while True:
            if current is not None and current.attempt > manifest.attempt:
                raise self._stale(current, manifest.attempt)
            blob = self.bucket.blob(self.manifest_name)

            def once(timeout: float, blob: Any = blob, gen: int = generation) -> int:
                blob.upload_from_string(
                    data,
                    content_type="application/json",
                    if_generation_match=gen,
                    timeout=timeout,
                    retry=None,
                )
                return int(blob.generation)

            try:
                return self._call(once, dl, "writing the manifest")
            except Exception as exc:
                if not _is_precondition_failed(exc):
                    raise
            races += 1
            log.info("manifest %s changed under us (412); reading it again", self.manifest_url)
            current, generation = self._read_manifest(dl)
            if current is not None and current.to_json() == manifest.to_json():
                return generation  # our own write, whose reply was lost
            if dl.remaining() < 0.3:
                raise StorageUnavailableError(
                    f"writing the manifest on {self.url}: gave up after {races} concurrent changes "
                    f"(deadline {dl.total:g}s)"
                )
            time.sleep(min(0.05 * races * random.random(), max(dl.remaining() - 0.2, 0)))

    # -- blobs

    def _blob_exists(self, sha256: str, dl: _Deadline) -> bool:
        blob = self.bucket.blob(self.blob_name(sha256))
        return self._call(lambda t: blob.exists(timeout=t, retry=None), dl, "checking a blob")

    def _upload_chunked(self, path: str, blob: Any, timeout: float) -> None:
        from google.cloud.storage import transfer_manager

        transfer_manager.upload_chunks_concurrently(
            path,
            blob,
            content_type="application/octet-stream",
            chunk_size=self.parallel_chunk_size,
            worker_type=transfer_manager.THREAD,
            max_workers=self.chunk_workers,
            timeout=timeout,
            retry=None,
        )
        blob.reload(timeout=timeout, retry=None)

    def _upload_blob(self, f: LocalFile, d: FileDigest, dl: _Deadline) -> int:
        """Upload ``f`` as blob ``d.sha256``; returns bytes sent (0 if it was already there)."""
        name = self.blob_name(d.sha256)

        def once(timeout: float) -> Any:
            blob = self.bucket.blob(name)
            if d.size >= self.large_file_threshold and self._xml_multipart is not False:
                try:
                    self._upload_chunked(f.path, blob, timeout)
                    self._xml_multipart = True
                    return blob
                except Exception as exc:
                    if self._xml_multipart is None and _status_of(exc) in (403, 404, 405, 501):
                        self._xml_multipart = False
                        log.info(
                            "%s: no XML multipart upload API (%s); using resumable uploads",
                            self.url,
                            _one_line(exc),
                        )
                        blob = self.bucket.blob(name)
                    else:
                        raise
            if d.size > _SIMPLE_UPLOAD_MAX:
                blob.chunk_size = self.resumable_chunk_size
            blob.upload_from_filename(
                f.path,
                content_type="application/octet-stream",
                if_generation_match=0,  # content-addressed: already there means done
                timeout=timeout,
                retry=None,
                checksum=None,  # verified below against the CRC32C computed when hashing
            )
            return blob

        try:
            blob = self._call(once, dl, f"uploading {f.relpath}")
        except Exception as exc:
            if _is_precondition_failed(exc):
                return 0
            if _is_not_found(exc):
                raise StorageUnavailableError(
                    f"uploading {f.relpath} to {self.url} failed: {_one_line(exc)}"
                ) from None
            raise
        if blob.crc32c != d.crc32c or (blob.size is not None and int(blob.size) != d.size):
            # The file changed after it was hashed: remove exactly the object we wrote.
            generation = blob.generation
            try:
                self._call(
                    lambda t: blob.delete(if_generation_match=generation, timeout=t, retry=None),
                    dl,
                    "removing a mismatched blob",
                )
            except Exception:
                log.warning("could not remove mismatched blob %s", name, exc_info=True)
            raise LocalChangedError(
                f"checkpoint file {f.relpath} changed while it was being uploaded "
                "(write it under a temporary name, then rename); sync again later"
            )
        return d.size

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
        job commits once with :meth:`commit` after every node's upload.

        ``attempt``: this job's restart count (fencing).  ``state_file``: the hash
        cache, outside ``ckpt_dir``.  ``deadline_s``: overall time budget.  ``restored``:
        the manifest this attempt started from (its no-progress streak is carried on).
        An empty directory never replaces an existing checkpoint (nothing is written).
        Raises :class:`StaleAttemptError`, :class:`StorageUnavailableError`,
        :class:`LocalChangedError`, :class:`ManifestError` (remote manifest unreadable).
        Local files are only read.
        """
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ValueError("attempt must be an integer >= 0")
        dl = _Deadline(deadline_s)
        state = LocalState(state_file, ckpt_dir)
        crc_factory = _crc32c_factory()
        files = scan_checkpoint_dir(ckpt_dir)
        confirmed: set[str] = set()  # blobs known to be stored remotely
        included: list[tuple[LocalFile, FileDigest, bool]] = []
        try:
            current, generation = self._read_manifest(dl)
            if current is not None and current.attempt > attempt:
                raise self._stale(current, attempt)
            in_manifest = {e["sha256"] for e in current.files.values()} if current else set()
            cached = state.known_blobs(self.url) - in_manifest
            claimed: set[str] = set()
            claim_lock = threading.Lock()

            def work(f: LocalFile) -> tuple[LocalFile, FileDigest, bool, bool] | None:
                if dl.abort.is_set():
                    raise _Aborted()
                try:
                    d = state.digest(f, crc_factory)
                except FileNotFoundError:
                    return None  # deleted by the trainer since the scan
                with claim_lock:
                    mine = d.sha256 not in claimed
                    claimed.add(d.sha256)
                if not mine:
                    return f, d, False, False  # another file with the same content handles it
                if d.sha256 in in_manifest:
                    return f, d, False, True
                if d.sha256 in cached and self._blob_exists(d.sha256, dl):
                    return f, d, False, True
                try:
                    sent = self._upload_blob(f, d, dl)
                except FileNotFoundError:
                    return None
                return f, d, sent > 0 or d.size == 0, True

            for r in self._run_parallel(files, work, dl):
                if r is None:
                    continue
                f, d, sent, ok = r
                included.append((f, d, sent))
                if ok:
                    confirmed.add(d.sha256)
            # a blob claimed by a file that then vanished: upload it from a twin
            for f, d, _ in included:
                if d.sha256 not in confirmed:
                    self._upload_blob(f, d, dl)
                    confirmed.add(d.sha256)

            if not included:
                log.info("%s: checkpoint dir %s is empty; nothing written", self.url, ckpt_dir)
                return SyncResult(0, 0, generation or None, 0, 0, current)
            new_files = {
                f.relpath: {"sha256": d.sha256, "size": d.size, "crc32c": d.crc32c} for f, d, _ in included
            }
            sent = [(f, d) for f, d, s in included if s]
            if not commit:
                return SyncResult(
                    files_sent=len(sent),
                    bytes_sent=sum(d.size for _, d in sent),
                    manifest_generation=generation or None,
                    skipped_unchanged=len(included) - len(sent),
                    files_total=len(included),
                    files=new_files,
                )
            no_progress = no_progress_after(restored, new_files)
            if (current is not None and current.attempt == attempt and current.files == new_files
                    and current.no_progress == no_progress):
                new_generation, manifest = generation, current  # nothing changed: keep the manifest as it is
            else:
                manifest = Manifest(attempt=attempt, files=new_files, no_progress=no_progress)
                new_generation = self._commit_manifest(manifest, current, generation, dl)
            return SyncResult(
                files_sent=len(sent),
                bytes_sent=sum(d.size for _, d in sent),
                manifest_generation=new_generation,
                skipped_unchanged=len(included) - len(sent),
                files_total=len(included),
                files=new_files,
                manifest=manifest,
            )
        finally:
            state.add_known_blobs(self.url, confirmed)
            try:
                state.save(
                    keep_relpaths=[f.relpath for f in files],
                    keep_blobs=[d.sha256 for _, d, _ in included] or None,
                )
            except OSError:
                log.warning("could not save checkpoint state %s", state.path, exc_info=True)

    # -- restore

    def _download_verified(self, rel: str, entry: dict, tmp: Path, dl: _Deadline) -> None:
        name = self.blob_name(entry["sha256"])
        large = entry["size"] >= self.large_file_threshold

        def once(timeout: float) -> None:
            if large:
                from google.cloud.storage import transfer_manager

                blob = self.bucket.get_blob(name, timeout=timeout, retry=None)
                if blob is None:
                    raise RestoreError(self._missing(rel, name))
                transfer_manager.download_chunks_concurrently(
                    blob,
                    str(tmp),
                    chunk_size=self.parallel_chunk_size,
                    download_kwargs={"timeout": timeout, "retry": None},
                    worker_type=transfer_manager.THREAD,
                    max_workers=self.chunk_workers,
                    crc32c_checksum=False,
                )
            else:
                self.bucket.blob(name).download_to_filename(str(tmp), timeout=timeout, retry=None, checksum=None)

        problem = ""
        for _ in range(2):  # a mismatch is downloaded once more before giving up
            try:
                self._call(once, dl, f"downloading {rel}")
            except Exception as exc:
                if _is_not_found(exc):
                    raise RestoreError(self._missing(rel, name)) from None
                raise
            size = tmp.stat().st_size
            if size != entry["size"]:
                problem = f"size {size} != {entry['size']} in the manifest"
                continue
            crc = _file_crc32c(tmp)
            if crc != entry["crc32c"]:
                problem = f"crc32c {crc} != {entry['crc32c']} in the manifest"
                continue
            return
        raise RestoreError(
            f"checkpoint file {rel} is corrupt (gs://{self.bucket_name}/{name}: {problem}); nothing was restored"
        )

    def _missing(self, rel: str, name: str) -> str:
        return f"checkpoint file {rel}: blob gs://{self.bucket_name}/{name} is missing; nothing was restored"

    def restore(self, ckpt_dir: str | os.PathLike, *, deadline_s: float = 1800.0) -> Manifest | None:
        """Download the last complete checkpoint into ``ckpt_dir``; None when there is none.

        Files are downloaded in parallel into a staging dot-directory inside
        ``ckpt_dir``, each verified (size + CRC32C), and renamed to their final
        names only when all are good.  On any failure nothing appears under a
        final name and the staging directory is removed.  Files of ``ckpt_dir``
        that are not in the manifest are left alone.
        """
        dl = _Deadline(deadline_s)
        manifest, _ = self._read_manifest(dl)
        if manifest is None:
            return None
        self._restore_files(ckpt_dir, manifest, dl)
        return manifest

    def restore_manifest(self, ckpt_dir: str | os.PathLike, manifest: Manifest, *, deadline_s: float = 1800.0) -> None:
        """Put exactly the files of ``manifest`` (one already read, possibly a part of one)
        into ``ckpt_dir``, all or none, as :meth:`restore` does."""
        self._restore_files(ckpt_dir, manifest, _Deadline(deadline_s))

    def _restore_files(self, ckpt_dir: str | os.PathLike, manifest: Manifest, dl: _Deadline) -> None:
        root = Path(ckpt_dir)
        root.mkdir(parents=True, exist_ok=True)
        items = sorted(manifest.files.items())
        for rel, _ in items:  # refuse before downloading if a final name cannot be used
            dest = root.joinpath(*rel.split("/"))
            if dest.is_dir() and not dest.is_symlink():
                raise RestoreError(f"cannot restore {rel}: {dest} is a directory")
            for parent in dest.parents:
                if parent == root:
                    break
                if parent.exists() and not parent.is_dir():
                    raise RestoreError(f"cannot restore {rel}: {parent} is not a directory")
        for stale in root.glob(f"{_STAGING_PREFIX}*"):  # left by a restore that was killed
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=root))
        try:

            def work(i_item: tuple[int, tuple[str, dict]]) -> Path:
                i, (rel, entry) = i_item
                tmp = staging / f"{i}.part"
                self._download_verified(rel, entry, tmp, dl)
                return tmp

            tmps = self._run_parallel(list(enumerate(items)), work, dl)
            for (rel, _), tmp in zip(items, tmps):
                dest = root.joinpath(*rel.split("/"))
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("restored %d files (%d bytes) from %s", len(items), manifest.total_bytes, self.manifest_url)
