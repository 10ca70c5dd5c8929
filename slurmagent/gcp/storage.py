"""Checkpoint storage on Cloud Storage (the only module importing google.cloud.storage).

Remote layout under ``gs://BUCKET/PREFIX``::

    PREFIX/blobs/blake3-<hex>   a file's contents, named by their BLAKE3, immutable
    PREFIX/blobs/pack-<hex>     small files back to back (named by the pack's BLAKE3), immutable
    PREFIX/blobs/<sha256>       file contents of manifests written before BLAKE3
    PREFIX/parts/<token>/...    parts of a parallel upload in flight (removed once composed)
    PREFIX/manifest.json        the last complete checkpoint (see slurmagent.checkpoint.Manifest)

A sync uploads the missing blobs first and writes ``manifest.json`` last, so an
interrupted sync leaves the previous manifest, and everything it references,
untouched: a half-uploaded checkpoint is never restored.

Fencing: the manifest carries the writer's ``attempt`` (restart count).  Before
writing, the current manifest and its generation are read; a higher attempt
there raises :class:`StaleAttemptError`; the write uses
``if_generation_match=<generation read>`` (0 when absent), and on 412 the
manifest is read again and the decision retaken.

Data path (JSON API, so that it runs against the local emulators too): the
bytes go through the client's authorized HTTP session as single streamed
requests, never buffered whole.  A pool of ``max_workers`` daemon threads moves
files in parallel.  A small file (up to ``small_file_max``) is read once, hashed
and uploaded from memory; files up to ``pack_file_max`` travel together in
packs of ``pack_size`` (one request for thousands of files: per-object costs,
not bytes, bound many-file checkpoints); a larger file is hashed (BLAKE3 +
CRC32C in one read, chunks in parallel, on a lane of ``hash_workers`` threads
that hold the read buffers) and then streamed; from
``parallel_upload_threshold`` on (off by default, see there), a file goes up
as parts in parallel which are then composed (``compose``, 32 at a time) into
the blob: a parallel composite upload.  Every object's CRC32C, as the server computed it, is checked against
ours.  Restores download files in parallel, a large one as parallel ranged
reads written in place, a pack as ranged reads split into its files as they
stream; every file's CRC32C (a large one's combined from its ranges) is checked
against the manifest before anything is renamed into place.

Deadlines: every request has a timeout (``timeout_s``, capped by the time
left), transient failures (connection refused/reset, timeouts, 408, 429, 5xx)
are retried with jittered backoff, and the whole sync or restore ends at its
deadline: streamed transfers stop within one block, the caller gets a
:class:`SyncDeadlineError` naming what was not transferred, and the previous
manifest stays.  Worker threads are daemons: one stuck in a dead connection
never holds up the caller or the process's exit.

The client honours ``STORAGE_EMULATOR_HOST`` as google-cloud-storage does: with
it set, anonymous credentials and a placeholder project are used; otherwise
Application Default Credentials.
"""

from __future__ import annotations

import base64
import logging
import os
import posixpath
import queue
import random
import shutil
import stat
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import quote

from slurmagent import checkpoint as ck
from slurmagent import checkpoint_hash
from slurmagent.checkpoint import (
    EMPTY_CRC32C,
    RESERVED_PREFIX,
    CheckpointError,
    CheckpointLag,
    FileDigest,
    LocalChangedError,
    LocalFile,
    LocalState,
    Manifest,
    RestoreError,
    StaleAttemptError,
    StorageUnavailableError,
    SyncDeadlineError,
    checkpoint_lag,
    no_progress_after,
    crc32c_b64,
    crc32c_combine,
    entry_content_id,
    open_nofollow,
    parse_remote,
    scan_checkpoint_dir,
)
from slurmagent.errors import SlurmagentError

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
MiB = 1024 * 1024
GiB = 1024 * MiB
_STAGING_PREFIX = RESERVED_PREFIX + "restore-"  # reserved: never synced
_BLOCK = 1 * MiB  # read/write unit of a streamed transfer (also the deadline's granularity)
_COMPOSE_MAX = 32  # source objects per compose request
_COMPONENTS_MAX = 1024  # components of one composite object


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


def _mount_adapter(session: Any, size: int) -> None:
    """Let ``size`` threads share ``session`` without pool-full churn; send bodies in 1 MiB writes."""
    from requests.adapters import HTTPAdapter

    class _Adapter(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            kwargs["blocksize"] = _BLOCK
            super().init_poolmanager(*args, **kwargs)

    adapter = _Adapter(pool_connections=4, pool_maxsize=size)
    session.mount("https://", adapter)
    session.mount("http://", adapter)


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


class _TransferCorrupt(Exception):
    """The server's CRC32C of what we sent (or the bytes we received) does not match: resend."""


class _SizeMismatch(Exception):
    """A download ended cleanly with another size than the manifest's: the object is not that file."""


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection refused/reset, timeouts, 408/429/5xx, transport corruption."""
    if isinstance(exc, (ConnectionError, TimeoutError, _TransferCorrupt)):
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


def _human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _names(rels: list[str], most: int = 5) -> str:
    shown = ", ".join(rels[:most])
    return shown + (f" and {len(rels) - most} more" if len(rels) > most else "")


class _Aborted(Exception):
    """The transfer was abandoned (deadline, or another worker failed); never surfaces to callers."""


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

    def check(self) -> None:
        """Raise :class:`_Aborted` once the transfer is abandoned or out of time."""
        if self.abort.is_set() or time.monotonic() >= self.end:
            raise _Aborted()


class _Pool:
    """Daemon worker threads running tasks until all are done, one fails, or the caller stops waiting.

    Tasks run in lanes, each with its own threads (``io`` has ``workers``; others
    as given), so that a few lanes hold the large buffers and no lane waits on
    work queued behind itself.  Tasks may submit more tasks.  A task's exception
    (other than :class:`_Aborted`) is kept as :attr:`error` and aborts the rest.
    """

    def __init__(self, workers: int, dl: _Deadline, name: str, lanes: dict[str, int] | None = None) -> None:
        self.dl = dl
        self.error: BaseException | None = None
        self._name = name
        self._caps = {"io": max(1, workers), **(lanes or {})}
        self._queues: dict[str, queue.SimpleQueue] = {lane: queue.SimpleQueue() for lane in self._caps}
        self._submitted = dict.fromkeys(self._caps, 0)
        self._cond = threading.Condition()
        self._pending = 0
        self._threads: dict[str, list[threading.Thread]] = {lane: [] for lane in self._caps}

    def submit(self, fn: Callable[..., Any], *args: Any, lane: str = "io") -> None:
        with self._cond:
            self._pending += 1
            self._submitted[lane] += 1
            threads = self._threads[lane]
            if len(threads) < min(self._caps[lane], self._submitted[lane]):
                t = threading.Thread(
                    target=self._run, args=(lane,), name=f"{self._name}-{lane}-{len(threads)}", daemon=True
                )
                threads.append(t)
                t.start()
        self._queues[lane].put((fn, args))

    def _run(self, lane: str) -> None:
        q = self._queues[lane]
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                if not self.dl.abort.is_set():
                    fn(*args)
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with self._cond:
                    if self.error is None:
                        self.error = exc
                self.dl.abort.set()
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def wait(self, until: float) -> bool:
        """True once every task finished or one failed; False when monotonic time ``until`` came first."""
        with self._cond:
            while self._pending and self.error is None:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        for lane, threads in self._threads.items():
            for _ in threads:
                self._queues[lane].put(None)


class _FileRange:
    """A request body: bytes [offset, offset+length) of an open file, read in blocks.

    Computes the CRC32C of what was sent; stops (raises :class:`_Aborted`) once
    the transfer is abandoned or its deadline passed.
    """

    def __init__(self, fd: int, offset: int, length: int, dl: _Deadline) -> None:
        import google_crc32c

        self.fd, self.pos, self.left, self.length, self.dl = fd, offset, length, length, dl
        self.crc = google_crc32c.Checksum()

    def __len__(self) -> int:
        return self.length

    def read(self, n: int = -1) -> bytes:
        self.dl.check()
        want = self.left if n is None or n < 0 else min(n, self.left)
        want = min(want, _BLOCK)
        if want <= 0:
            return b""
        data = os.pread(self.fd, want, self.pos)
        if not data:
            raise LocalChangedError("a checkpoint file shrank while it was being uploaded")
        self.pos += len(data)
        self.left -= len(data)
        self.crc.update(data)
        return data

    def crc32c(self) -> str:
        return base64.b64encode(self.crc.digest()).decode("ascii")


# ---------------------------------------------------------------------------- result


@dataclass(frozen=True)
class SyncResult:
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


class _SyncRun:
    """Book-keeping of one sync, shared by its worker threads."""

    def __init__(self, store: "GcsCheckpointStore", state: LocalState, current: Manifest | None, dl: _Deadline):
        self.store = store
        self.state = state
        self.current = current
        self.dl = dl
        self.pool = _Pool(store.max_workers, dl, "ckpt-sync", {"hash": store.hash_workers, "pack": 2})
        self.lock = threading.Lock()
        # where each content of the current manifest is stored: {} (its own blob) or {"pack", "offset"}
        self.locations: dict[str, dict] = {}
        for e in current.regular_files().values() if current else ():
            self.locations[entry_content_id(e)] = {k: e[k] for k in ("pack", "offset") if k in e}
        self.in_manifest = set(self.locations)
        self.known = state.known_blobs(store.url) - self.in_manifest
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


# ----------------------------------------------------------------------------- store


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
    parallel_upload_threshold: int | None = None
    part_size = 128 * MiB  # part of a parallel upload (grown so a file has at most 1024 parts)
    ranged_download_threshold = 64 * MiB  # from this size on: ranged reads in parallel
    range_size = 32 * MiB  # one ranged read
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
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.bucket_name, self.prefix = parse_remote(remote_url)
        self.url = f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = float(timeout_s)
        self.max_workers = max(1, int(max_workers))
        self.warn = warn
        self._client = client
        self._bucket = None
        self._lock = threading.Lock()
        self._bucket_checked = False
        self._adapter_mounted = False
        self._said: set[str] = set()
        self._committed: dict[str, tuple[int, int]] = {}
        self.last_sync_error = ""
        self.last_sync: SyncResult | None = None

    # -- names

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def manifest_name(self) -> str:
        return self._key("manifest.json")

    def blob_name(self, content_id: str) -> str:
        """Object name of a content id (``blake3:<hex>``, ``sha256:<hex>`` or a bare legacy sha256)."""
        algo, sep, hexd = content_id.partition(":")
        if not sep:
            return self._key(f"blobs/{content_id}")
        if algo == "sha256":
            return self._key(f"blobs/{hexd}")
        return self._key(f"blobs/{algo}-{hexd}")

    @property
    def manifest_url(self) -> str:
        return f"gs://{self.bucket_name}/{self.manifest_name}"

    # -- client

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = make_client()
            if not self._adapter_mounted:
                self._adapter_mounted = True
                try:
                    _mount_adapter(self._client._http, max(32, self.max_workers * 2))
                except Exception:  # a client without an HTTP session (tests): nothing to widen
                    log.debug("could not mount the HTTP adapter", exc_info=True)
            return self._client

    @property
    def bucket(self) -> Any:
        if self._bucket is None:
            self._bucket = self.client.bucket(self.bucket_name)
        return self._bucket

    @property
    def _http(self) -> Any:
        return self.client._http

    def _api(self, path: str) -> str:
        return f"{self.client._connection.API_BASE_URL.rstrip('/')}{path}"

    def _object_url(self, name: str) -> str:
        return self._api(f"/storage/v1/b/{self.bucket_name}/o/{quote(name, safe='')}")

    # -- messages

    def _say_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        if self.warn is not None:
            try:
                self.warn(message)
                return
            except Exception:  # a broken callback never breaks a sync
                log.debug("warn callback failed", exc_info=True)
        log.warning("%s", message)

    def _skipped(self, rel: str, why: str) -> None:
        self._say_once(f"skip:{rel}:{why}", f"not syncing {rel}: {why}")

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
            left = dl.remaining()
            if left <= 0:
                raise _Aborted()
            try:
                return fn(max(0.05, min(self.timeout_s, left)))
            except Exception as exc:
                if dl.abort.is_set() or isinstance(exc, _Aborted):
                    raise _Aborted() from None
                if isinstance(exc, (CheckpointError, OSError)) and not is_transient(exc):
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

    # -- raw JSON API requests (streamed, through the client's authorized session)

    def _raise_for(self, resp: Any) -> None:
        if resp.status_code >= 400:
            from google.api_core import exceptions

            raise exceptions.from_http_response(resp)

    def _post_media(self, name: str, body: Any, size: int, timeout: float, if_generation_match: int | None = 0) -> dict:
        params = {"uploadType": "media", "name": name}
        if if_generation_match is not None:
            params["ifGenerationMatch"] = str(if_generation_match)
        resp = self._http.request(
            "POST",
            self._api(f"/upload/storage/v1/b/{self.bucket_name}/o"),
            data=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            params=params,
            timeout=(timeout, timeout),
        )
        try:
            self._raise_for(resp)
            return resp.json()
        finally:
            resp.close()

    def _compose(self, dest: str, sources: list[str], timeout: float, if_generation_match: int | None) -> dict:
        params = {} if if_generation_match is None else {"ifGenerationMatch": str(if_generation_match)}
        resp = self._http.request(
            "POST",
            self._object_url(dest) + "/compose",
            json={
                "sourceObjects": [{"name": s} for s in sources],
                "destination": {"contentType": "application/octet-stream"},
            },
            params=params,
            timeout=(timeout, timeout),
        )
        try:
            self._raise_for(resp)
            return resp.json()
        finally:
            resp.close()

    def _get_into(
        self, name: str, fd: int, start: int, length: int, ranged: bool, expect_size: int, dl: _Deadline, timeout: float
    ) -> int:
        """Download ``length`` bytes of object ``name`` from ``start`` into ``fd`` at ``start``; its CRC32C."""
        import google_crc32c

        headers = {"Range": f"bytes={start}-{start + length - 1}"} if ranged else {}
        resp = self._http.request(
            "GET", self._object_url(name), params={"alt": "media"}, headers=headers, stream=True,
            timeout=(timeout, timeout),
        )  # fmt: skip
        try:
            self._raise_for(resp)
            if ranged and resp.status_code != 206:
                raise StorageUnavailableError(f"{self.url}: the server ignored a ranged read of {name}")
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            if ranged and total.isdigit() and int(total) != expect_size:
                raise _SizeMismatch(f"size {total} != {expect_size} in the manifest")
            crc = google_crc32c.Checksum()
            pos, end = start, start + length
            for chunk in resp.iter_content(_BLOCK):
                dl.check()
                if pos + len(chunk) > end:
                    raise _SizeMismatch(f"size > {expect_size} in the manifest")
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, pos)
                    view = view[n:]
                    pos += n
                crc.update(chunk)
            if pos != end:
                raise _SizeMismatch(f"size {pos - start} != {expect_size} in the manifest")
            return int.from_bytes(crc.digest(), "big")
        finally:
            resp.close()

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
        return self.read_manifest(deadline_s=deadline_s)[0]

    def read_manifest(self, *, deadline_s: float = 60.0) -> tuple[Manifest | None, int]:
        """(manifest, generation) of the last complete checkpoint; (None, 0) when there is none."""
        return self._guard(self._read_manifest, _Deadline(deadline_s), "reading the manifest")

    def commit(self, manifest: Manifest, *, deadline_s: float = 60.0) -> int:
        """Write ``manifest`` as the complete checkpoint, fenced as :meth:`sync` does (a newer
        attempt's manifest is never overwritten; ``if_generation_match`` on the one read).
        Every blob it names must already be stored. Returns the manifest's generation; an
        identical manifest of the same attempt already in place is kept as it is."""

        def run(dl: _Deadline) -> int:
            current, generation = self._read_manifest(dl)
            if current is not None and current.attempt > manifest.attempt:
                raise self._stale(current, manifest.attempt)
            if (
                current is not None
                and current.attempt == manifest.attempt
                and current.files == manifest.files
                and current.writers == manifest.writers
                and current.node_count == manifest.node_count
                and current.no_progress == manifest.no_progress
            ):
                return generation
            return self._commit_manifest(manifest, current, generation, dl)

        return self._guard(run, _Deadline(deadline_s), "committing the manifest of")

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

    # -- uploads

    def _blob_exists(self, content_id: str, dl: _Deadline) -> bool:
        blob = self.bucket.blob(self.blob_name(content_id))
        return self._call(lambda t: blob.exists(timeout=t, retry=None), dl, "checking a blob")

    def _delete_quietly(self, name: str, dl: _Deadline, generation: Any = None) -> None:
        try:
            blob = self.bucket.blob(name)
            kw = {"if_generation_match": int(generation)} if generation else {}
            self._call(lambda t: blob.delete(timeout=t, retry=None, **kw), dl, "removing an object")
        except Exception:
            log.debug("could not remove %s", name, exc_info=True)

    def _check_stored(self, obj: dict, name: str, f: LocalFile, d: FileDigest, dl: _Deadline) -> None:
        """The object the server stored holds exactly the hashed bytes; else remove it."""
        if obj.get("crc32c") == d.crc32c and int(obj.get("size", -1)) == d.size:
            return
        self._delete_quietly(name, dl, obj.get("generation"))
        raise LocalChangedError(
            f"checkpoint file {f.relpath} changed while it was being uploaded "
            "(write it under a temporary name, then rename); sync again later"
        )

    def _upload_whole(self, f: LocalFile, d: FileDigest, cid: str, data: bytes | None, dl: _Deadline) -> bool:
        """One request: from memory (``data``) or streamed from the file.  False: it was already there."""
        name = self.blob_name(cid)

        def once(timeout: float) -> tuple[dict, str]:
            if d.size == 0:  # a multipart request: some servers drop an empty media upload
                blob = self.bucket.blob(name)
                blob.upload_from_string(b"", if_generation_match=0, timeout=timeout, retry=None, checksum=None)
                return {"crc32c": blob.crc32c, "size": blob.size, "generation": blob.generation}, d.crc32c
            if data is not None:
                obj, sent_crc = self._post_media(name, data, d.size, timeout), d.crc32c
            else:
                fd = open_nofollow(f.path)
                try:
                    body = _FileRange(fd, 0, d.size, dl)
                    obj = self._post_media(name, body, d.size, timeout)
                finally:
                    os.close(fd)
                sent_crc = body.crc32c()
            if obj.get("crc32c") != sent_crc:  # damaged on the way: remove it, send again
                self._delete_quietly(name, dl, obj.get("generation"))
                raise _TransferCorrupt(f"{name}: the server stored other bytes than were sent")
            return obj, sent_crc

        try:
            obj, _ = self._call(once, dl, f"uploading {f.relpath}")
        except Exception as exc:
            if _is_precondition_failed(exc):
                return False  # content-addressed: already there means done
            if _is_not_found(exc):
                raise StorageUnavailableError(f"uploading {f.relpath} to {self.url} failed: {_one_line(exc)}") from None
            raise
        self._check_stored(obj, name, f, d, dl)
        return True

    def _part_bytes(self, size: int) -> int:
        part = max(self.part_size, -(-size // _COMPONENTS_MAX))
        return -(-part // MiB) * MiB

    def _upload_parallel(self, run: _SyncRun, f: LocalFile, d: FileDigest, cid: str) -> None:
        """Parallel composite upload: parts as temporary objects (pool tasks), then compose into the blob.

        The task finishing the last part composes, checks the CRC32C and removes the parts.
        """
        dl = run.dl
        name = self.blob_name(cid)
        part = self._part_bytes(d.size)
        ranges = [(off, min(part, d.size - off)) for off in range(0, d.size, part)]
        tmp = self._key(f"parts/{uuid.uuid4().hex}")
        parts = [f"{tmp}/{i:05d}" for i in range(len(ranges))]
        fd = open_nofollow(f.path)
        left = [len(ranges)]
        lock = threading.Lock()
        closed = [False]
        changed = [False]

        def close_fd() -> None:
            with lock:
                if not closed[0]:
                    closed[0] = True
                    os.close(fd)

        def finish() -> None:
            close_fd()
            temporaries = list(parts)
            try:
                sources, level = parts, 0
                while len(sources) > _COMPOSE_MAX:  # a tree of composes, 32 sources each
                    grouped = []
                    for j in range(0, len(sources), _COMPOSE_MAX):
                        inter = f"{tmp}/c{level}-{j // _COMPOSE_MAX:05d}"
                        group = sources[j : j + _COMPOSE_MAX]
                        self._call(lambda t, i=inter, g=group: self._compose(i, g, t, None), dl, f"composing {f.relpath}")
                        grouped.append(inter)
                    temporaries += grouped
                    sources, level = grouped, level + 1
                try:
                    obj = self._call(lambda t: self._compose(name, sources, t, 0), dl, f"composing {f.relpath}")
                except Exception as exc:
                    if not _is_precondition_failed(exc):
                        raise
                    obj = None  # the blob is already there
                if obj is not None:
                    self._check_stored(obj, name, f, d, dl)
                with run.lock:
                    run.confirmed.add(cid)
                    if obj is not None:
                        run.uploaded[cid] = d.size
                    run.done.add(f.relpath)
            except LocalChangedError:
                self._file_busy(run, f, cid)
            finally:
                for t in temporaries:
                    run.pool.submit(self._delete_quietly, t, dl)

        def upload_part(i: int) -> None:
            if changed[0]:
                return
            off, length = ranges[i]

            def once(timeout: float) -> None:
                body = _FileRange(fd, off, length, dl)
                obj = self._post_media(parts[i], body, length, timeout, if_generation_match=None)
                if obj.get("crc32c") != body.crc32c():
                    raise _TransferCorrupt(f"part {i} of {f.relpath}: the server stored other bytes than were sent")

            try:
                self._call(once, dl, f"uploading part {i + 1}/{len(ranges)} of {f.relpath}")
            except LocalChangedError:
                with lock:
                    first = not changed[0]
                    changed[0] = True
                close_fd()
                if first:
                    self._file_busy(run, f, cid)
                    for t in parts:
                        run.pool.submit(self._delete_quietly, t, dl)
                return
            except BaseException:
                close_fd()
                raise
            with lock:
                left[0] -= 1
                last = left[0] == 0 and not changed[0]
            if last:
                finish()

        for i in range(len(ranges)):
            run.pool.submit(upload_part, i)

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
        (or is left out) and is named in :attr:`SyncResult.busy`.  Raises
        :class:`StaleAttemptError`, :class:`StorageUnavailableError` (and its
        :class:`SyncDeadlineError`), :class:`ManifestError` (remote manifest
        unreadable), :class:`CheckpointError`.  Local files are only read.
        """
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ValueError("attempt must be an integer >= 0")
        dl = _Deadline(deadline_s)
        try:
            result = self._guard(lambda dl: self._sync(ckpt_dir, attempt, state_file, dl, restored, commit), dl, "syncing")
        except SlurmagentError as exc:
            self.last_sync_error = str(exc)
            raise
        self.last_sync_error = ""
        self.last_sync = result
        return result

    def _guard(self, fn: Callable[[_Deadline], T], dl: _Deadline, what: str) -> T:
        """Every failure as one-line :class:`CheckpointError` (no traceback reaches a sync thread)."""
        try:
            return fn(dl)
        except SlurmagentError:
            raise
        except _Aborted:
            raise SyncDeadlineError(f"{what} {self.url}: deadline of {dl.total:g}s reached") from None
        except Exception as exc:
            log.debug("%s %s failed", what, self.url, exc_info=True)
            raise CheckpointError(f"{what} {self.url} failed: {_one_line(exc)}") from exc

    def _sync(
        self,
        ckpt_dir: str | os.PathLike,
        attempt: int,
        state_file: str | os.PathLike,
        dl: _Deadline,
        restored: Manifest | None = None,
        commit: bool = True,
    ) -> SyncResult:
        state = LocalState(state_file, ckpt_dir)
        skipped: list[str] = []

        def on_skip(rel: str, why: str) -> None:
            skipped.append(rel)
            self._skipped(rel, why)

        entries = scan_checkpoint_dir(ckpt_dir, on_skip=on_skip)
        files = [e for e in entries if not e.is_link]
        links = [e for e in entries if e.is_link]
        current, generation = self._read_manifest(dl)
        if current is not None and current.attempt > attempt:
            raise self._stale(current, attempt)
        run = _SyncRun(self, state, current, dl)
        reserve = min(2.0, 0.15 * dl.total)  # kept for the manifest write
        try:
            wave = files
            for round_no in range(self.busy_retries + 1):
                for f in wave:
                    run.pool.submit(self._sync_file, run, f)
                self._wait(run.pool, dl, reserve, files, run)
                self._seal_last_pack(run)
                self._wait(run.pool, dl, reserve, files, run)
                # blobs of twins whose uploading file vanished or was busy: upload from a twin
                for rel, (f, d, cid) in sorted(run.included.items()):
                    if cid not in run.confirmed and cid not in run.claimed:
                        run.claimed.add(cid)
                        run.pool.submit(self._upload_claimed, run, f, d, cid)
                self._wait(run.pool, dl, reserve, files, run)
                self._seal_last_pack(run)
                self._wait(run.pool, dl, reserve, files, run)
                if not run.busy or round_no == self.busy_retries:
                    break
                if dl.remaining() - reserve < self.busy_pause_s + 0.5:
                    break
                time.sleep(self.busy_pause_s * (round_no + 1))
                wave = self._rescan(ckpt_dir, run)
            return self._finish_sync(run, files, links, skipped, attempt, generation, ckpt_dir, restored, commit)
        finally:
            run.pool.close()
            state.add_known_blobs(self.url, run.confirmed)
            try:
                state.save(
                    keep_relpaths=[f.relpath for f in files],
                    keep_blobs=(run.confirmed | {cid for _, _, cid in run.included.values()}) or None,
                )
            except OSError as exc:
                self._say_once(f"state:{exc}", f"could not save the checkpoint hash cache {state.path}: {exc.strerror or exc}")

    def _wait(self, pool: _Pool, dl: _Deadline, reserve: float, files: list[LocalFile], run: _SyncRun) -> None:
        finished = pool.wait(dl.end - reserve)
        if pool.error is not None:
            raise pool.error
        if finished:
            return
        dl.abort.set()
        with run.lock:
            left = [f for f in files if f.relpath not in run.done and f.relpath not in run.unreadable]
        rels = sorted(f.relpath for f in left)
        size = sum(f.size for f in left)
        after = (
            f"the previous checkpoint (attempt {run.current.attempt}, {run.current.created}) stays the one restored"
            if run.current is not None
            else "no checkpoint is committed yet"
        )
        raise SyncDeadlineError(
            f"sync to {self.url} did not finish within its deadline of {dl.total:g}s: "
            f"{len(rels)} file(s) ({_human(size)}) not uploaded: {_names(rels)}; {after}",
            rels,
            size,
        )

    def _rescan(self, ckpt_dir: str | os.PathLike, run: _SyncRun) -> list[LocalFile]:
        """Fresh stats of the busy files, for another try."""
        wave = []
        with run.lock:
            busy = dict(run.busy)
            run.busy.clear()
        for rel, f in busy.items():
            try:
                st = os.stat(f.path, follow_symlinks=False)
            except OSError:
                continue  # gone: not part of this checkpoint
            if stat.S_ISREG(st.st_mode):
                wave.append(LocalFile(rel, f.path, st.st_size, st.st_mtime_ns, st.st_ino))
        return wave

    def _file_busy(self, run: _SyncRun, f: LocalFile, cid: str | None = None) -> None:
        with run.lock:
            run.busy[f.relpath] = f
            run.included.pop(f.relpath, None)
            if cid is not None:
                run.claimed.discard(cid)

    def _digest(self, run: _SyncRun, f: LocalFile, want_sha256: bool, need_blake3: bool) -> tuple[FileDigest, bytes | None] | None:
        """``f``'s digest (cached, else read once), or None when it vanished, is busy or unreadable."""
        d = run.state.cached(f, want_sha256=want_sha256)
        if d is not None and (d.blake3 or not need_blake3):
            return d, None
        started = time.time()
        try:
            if f.size > self.small_file_max:
                d, st, data = checkpoint_hash.hash_file(f.path, want_sha256=want_sha256, expect=f, threads=4)
            else:
                d, st, data = checkpoint_hash.hash_file(f.path, want_sha256=want_sha256, expect=f, keep_bytes=self.small_file_max)
        except FileNotFoundError:
            with run.lock:
                run.done.add(f.relpath)  # deleted since the scan: not part of this checkpoint
            return None
        except LocalChangedError:
            self._file_busy(run, f)
            return None
        except OSError as exc:
            why = exc.strerror or str(exc)
            with run.lock:
                run.unreadable[f.relpath] = why
            self._say_once(f"unreadable:{f.relpath}", f"not syncing {f.relpath}: unreadable ({why})")
            return None
        run.state.remember(f, d, st, started)
        return d, data

    def _sync_file(self, run: _SyncRun, f: LocalFile, lane: str = "io") -> None:
        """Hash one file (or take its cached digest), then upload its content unless the remote has it.

        A large file not in the cache is hashed on the ``hash`` lane (few threads hold
        the read buffers), then handed back to the ``io`` lane for its upload.
        """
        run.dl.check()
        if lane == "io" and f.size > self.small_file_max and run.state.cached(f) is None:
            run.pool.submit(self._sync_file, run, f, "hash", lane="hash")
            return
        legacy = run.current.files.get(f.relpath) if run.current is not None else None
        if not (legacy and legacy.get("sha256") and legacy.get("size") == f.size):
            legacy = None
        got = self._digest(run, f, want_sha256=legacy is not None, need_blake3=legacy is None)
        if got is None:
            return
        d, data = got
        if legacy is not None and d.sha256 == legacy["sha256"]:
            cid = f"sha256:{d.sha256}"  # unchanged since a manifest written before BLAKE3: keep its blob
        else:
            if not d.blake3:  # a cached sha256 only, and the content changed
                got = self._digest(run, f, want_sha256=False, need_blake3=True)
                if got is None:
                    return
                d, data = got
            cid = d.content_id
        with run.lock:
            run.included[f.relpath] = (f, d, cid)
            mine = cid not in run.claimed
            run.claimed.add(cid)
        if not mine:
            with run.lock:
                run.done.add(f.relpath)
            return  # another file with the same content uploads it
        if lane == "hash":
            run.pool.submit(self._upload_claimed, run, f, d, cid, data)
        else:
            self._upload_claimed(run, f, d, cid, data)

    def _upload_claimed(self, run: _SyncRun, f: LocalFile, d: FileDigest, cid: str, data: bytes | None = None) -> None:
        dl = run.dl
        if cid in run.in_manifest or (cid in run.known and self._blob_exists(cid, dl)):
            with run.lock:
                run.confirmed.add(cid)
                run.done.add(f.relpath)
            return
        if data is not None and d.size <= self.pack_file_max and cid.startswith("blake3:"):
            self._pack(run, f, d, cid, data)
            return
        try:
            threshold = self.parallel_upload_threshold
            if data is None and threshold is not None and d.size >= threshold:
                self._upload_parallel(run, f, d, cid)  # its last part marks it done
                return
            uploaded = self._upload_whole(f, d, cid, data, dl)
        except FileNotFoundError:
            with run.lock:
                run.included.pop(f.relpath, None)
                run.claimed.discard(cid)
                run.done.add(f.relpath)
            return
        except LocalChangedError:
            self._file_busy(run, f, cid)
            return
        with run.lock:
            run.confirmed.add(cid)
            if uploaded:
                run.uploaded[cid] = d.size
            run.done.add(f.relpath)

    def _pack(self, run: _SyncRun, f: LocalFile, d: FileDigest, cid: str, data: bytes) -> None:
        """Queue a small file's bytes into the pack being filled; a full pack goes up."""
        with run.lock:
            run.packing.append((f, d, cid, data))
            run.packing_bytes += d.size
            full = run.packing_bytes >= self.pack_size
        if full:
            self._seal_pack(run)

    def _seal_pack(self, run: _SyncRun) -> None:
        # at most two packs in memory: the io lane waits here, never past the deadline
        if not run.pack_slots.acquire(timeout=max(0.0, run.dl.remaining())):
            raise _Aborted()
        with run.lock:
            members, run.packing, run.packing_bytes = run.packing, [], 0
        if not members:
            run.pack_slots.release()
            return
        run.pool.submit(self._upload_pack, run, members, lane="pack")

    def _seal_last_pack(self, run: _SyncRun) -> None:
        """Send the partly filled pack (the caller's wait then reports a deadline properly)."""
        try:
            self._seal_pack(run)
        except _Aborted:
            pass

    def _upload_pack(self, run: _SyncRun, members: list[tuple[LocalFile, FileDigest, str, bytes]]) -> None:
        """One object ``blobs/pack-<blake3>`` holding many small files back to back."""
        import google_crc32c

        try:
            data = b"".join(m[3] for m in members)
            members[:] = [(f, d, cid, b"") for f, d, cid, _ in members]  # one copy of the bytes in memory
            pack = ck.blake3_hex(data)
            name = self.blob_name(f"pack:{pack}")
            crc = base64.b64encode(google_crc32c.Checksum(data).digest()).decode("ascii")

            def once(timeout: float) -> None:
                obj = self._post_media(name, data, len(data), timeout)
                if obj.get("crc32c") != crc or int(obj.get("size", -1)) != len(data):
                    self._delete_quietly(name, run.dl, obj.get("generation"))
                    raise _TransferCorrupt(f"{name}: the server stored other bytes than were sent")

            try:
                self._call(once, run.dl, f"uploading {len(members)} small files")
            except Exception as exc:
                if not _is_precondition_failed(exc):
                    raise
        finally:
            run.pack_slots.release()
        offset = 0
        with run.lock:
            for f, d, cid, _ in members:
                run.locations[cid] = {"pack": pack, "offset": offset}
                run.confirmed.add(cid)
                run.uploaded[cid] = d.size
                run.done.add(f.relpath)
                offset += d.size

    def _finish_sync(
        self,
        run: _SyncRun,
        files: list[LocalFile],
        links: list[LocalFile],
        skipped: list[str],
        attempt: int,
        generation: int,
        ckpt_dir: str | os.PathLike,
        restored: Manifest | None = None,
        commit: bool = True,
    ) -> SyncResult:
        current = run.current
        new_files: dict[str, dict] = {}
        committed: dict[str, tuple[int, int]] = {}
        for rel, (f, d, cid) in sorted(run.included.items()):
            if cid not in run.confirmed:
                continue  # its upload did not happen (busy twin)
            new_files[rel] = {**d.entry(cid), **run.locations.get(cid, {})}
            committed[rel] = (f.size, f.mtime_ns)
        busy = sorted(run.busy)
        for rel in busy:
            previous = current.files.get(rel) if current is not None else None
            if previous is not None and "link" not in previous:
                new_files[rel] = dict(previous)
                self._say_once(
                    f"busy:{rel}",
                    f"{rel} kept changing while it was read (written in place?): "
                    "its previous committed version stays in the checkpoint",
                )
            else:
                self._say_once(
                    f"busy:{rel}",
                    f"{rel} kept changing while it was read (written in place?): left out of this checkpoint",
                )
        kept_dirs = {p for rel in new_files for p in ck.parent_dirs(rel)}
        for link in links:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(link.relpath), link.link or ""))
            if target in new_files or target in kept_dirs:
                new_files[link.relpath] = {"link": link.link}
                committed[link.relpath] = (link.size, link.mtime_ns)
            else:
                skipped.append(link.relpath)
                self._skipped(link.relpath, f"a symlink to {target!r}, which is not in this checkpoint")
        result_skipped = tuple(sorted(set(skipped) | set(run.unreadable)))
        files_sent = len(run.uploaded)
        if not new_files:
            log.info("%s: checkpoint dir %s is empty; nothing written", self.url, ckpt_dir)
            return SyncResult(
                0, 0, generation or None, 0, 0, tuple(busy), result_skipped, run.dl.elapsed(), manifest=current
            )
        if not commit:  # one node's part: the job commits every node's entries at once
            return SyncResult(
                files_sent=files_sent,
                bytes_sent=sum(run.uploaded.values()),
                manifest_generation=generation or None,
                skipped_unchanged=sum(1 for e in new_files.values() if "link" not in e) - files_sent,
                files_total=len(new_files),
                busy=tuple(busy),
                skipped=result_skipped,
                seconds=run.dl.elapsed(),
                files=new_files,
            )
        no_progress = no_progress_after(restored, new_files)
        if (
            current is not None
            and current.attempt == attempt
            and current.files == new_files
            and current.no_progress == no_progress
        ):
            new_generation, manifest = generation, current  # nothing changed: keep the manifest as it is
        else:
            manifest = Manifest(attempt=attempt, files=new_files, no_progress=no_progress)
            new_generation = self._commit_manifest(manifest, current, generation, run.dl)
        self._committed = committed
        return SyncResult(
            files_sent=files_sent,
            bytes_sent=sum(run.uploaded.values()),
            manifest_generation=new_generation,
            skipped_unchanged=sum(1 for e in new_files.values() if "link" not in e) - files_sent,
            files_total=len(new_files),
            busy=tuple(busy),
            skipped=result_skipped,
            seconds=run.dl.elapsed(),
            files=new_files,
            manifest=manifest,
        )

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
        return self._guard(lambda dl: self._restore(Path(ckpt_dir), dl, state_file), _Deadline(deadline_s), "restoring")

    def restore_manifest(
        self,
        ckpt_dir: str | os.PathLike,
        manifest: Manifest,
        *,
        deadline_s: float = 1800.0,
        state_file: str | os.PathLike | None = None,
    ) -> None:
        """Put exactly the entries of ``manifest`` (one already read, possibly a part of one)
        into ``ckpt_dir``, all or none, as :meth:`restore` does."""
        self._guard(
            lambda dl: self._restore(Path(ckpt_dir), dl, state_file, manifest), _Deadline(deadline_s), "restoring"
        )

    def _restore(
        self, root: Path, dl: _Deadline, state_file: str | os.PathLike | None, manifest: Manifest | None = None
    ) -> Manifest | None:
        if manifest is None:
            manifest, _ = self._read_manifest(dl)
        if manifest is None:
            return None
        root.mkdir(parents=True, exist_ok=True)
        items = sorted(manifest.regular_files().items())
        links = sorted(manifest.links().items())
        self._check_targets(str(root), manifest)
        for stale in root.glob(f"{_STAGING_PREFIX}*"):  # left by a restore that was killed
            shutil.rmtree(stale, ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=root)
        # The staging directory holds the checkpoint's own tree, so that whole directories
        # move into place with one rename each when the destination does not have them.
        stage = [os.path.join(staging, *rel.split("/")) for rel, _ in items]
        for d in sorted({os.path.dirname(p) for p in stage} | {os.path.join(staging, *ck.parent_dirs(r)[-1:]) for r, _ in links}):
            os.makedirs(d, exist_ok=True)
        pool = _Pool(self.max_workers, dl, "ckpt-restore")
        fds: dict[int, int] = {}
        try:
            packs: dict[str, list[tuple[int, str, dict]]] = {}
            for i, (rel, entry) in enumerate(items):
                if "pack" in entry:
                    packs.setdefault(entry["pack"], []).append((i, rel, entry))
                else:
                    self._schedule_download(pool, i, rel, entry, stage[i], fds, dl)
            for pack, members in sorted(packs.items()):
                self._schedule_pack(pool, pack, members, stage, dl)
            finished = pool.wait(dl.end)
            if pool.error is not None:
                raise pool.error
            if not finished:
                dl.abort.set()
                raise SyncDeadlineError(
                    f"restore from {self.url} did not finish within its deadline of {dl.total:g}s "
                    f"({_human(manifest.total_bytes)} in {len(items)} file(s)); nothing was restored",
                    [rel for rel, _ in items],
                    manifest.total_bytes,
                )
            for fd in list(fds.values()):
                os.close(fd)
            fds.clear()
            for rel, target in links:
                os.symlink(target, os.path.join(staging, *rel.split("/")))
            _move_tree(staging, str(root))
        finally:
            pool.close()
            for fd in fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(staging, ignore_errors=True)
        placed = [(rel, entry, os.path.join(root, *rel.split("/"))) for rel, entry in items]
        self._after_restore(root, manifest, placed, links, state_file)
        log.info("restored %d files (%d bytes) from %s", len(items), manifest.total_bytes, self.manifest_url)
        return manifest

    @staticmethod
    def _check_targets(root: str, manifest: Manifest) -> None:
        """Refuse, before downloading, a restore whose final names cannot be used as they are."""
        parents: set[str] = set()
        for rel in manifest.files:
            dest = os.path.join(root, *rel.split("/"))
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise RestoreError(f"cannot restore {rel}: {dest} is a directory")
            parents.update(ck.parent_dirs(rel))
        for parent in sorted(parents):
            path = os.path.join(root, *parent.split("/"))
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):  # a file, or a symlink we would write through
                raise RestoreError(f"cannot restore into {parent}/: {path} is not a directory")

    def _after_restore(
        self,
        root: Path,
        manifest: Manifest,
        placed: list[tuple[str, dict, Path]],
        links: list[tuple[str, str]],
        state_file: str | os.PathLike | None,
    ) -> None:
        committed: dict[str, tuple[int, int]] = {}
        state = None
        if state_file is not None:
            try:
                state = LocalState(state_file, root)
            except CheckpointError as exc:
                self._say_once(f"state:{exc}", str(exc))
        for rel, entry, dest in placed:
            st = os.stat(dest, follow_symlinks=False)
            committed[rel] = (st.st_size, st.st_mtime_ns)
            if state is not None:
                state.seed(rel, st, entry)
        for rel, _ in links:
            st = os.stat(root.joinpath(*rel.split("/")), follow_symlinks=False)
            committed[rel] = (st.st_size, st.st_mtime_ns)
        self._committed = committed
        if state is not None:
            state.add_known_blobs(self.url, {entry_content_id(e) for e in manifest.regular_files().values()})
            try:
                state.save()
            except OSError as exc:
                self._say_once(f"state:{exc}", f"could not save the checkpoint hash cache {state.path}: {exc.strerror or exc}")

    def _schedule_download(
        self, pool: _Pool, i: int, rel: str, entry: dict, path: str, fds: dict[int, int], dl: _Deadline
    ) -> None:
        """Queue the download of one file into ``path``: whole, or as parallel ranged reads."""
        size = entry["size"]
        name = self.blob_name(entry_content_id(entry))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        fds[i] = fd
        if size == 0:
            if entry["crc32c"] != EMPTY_CRC32C:
                raise RestoreError(self._corrupt(rel, name, f"crc32c {EMPTY_CRC32C} != {entry['crc32c']} in the manifest"))
            return
        os.ftruncate(fd, size)
        ranged = size >= self.ranged_download_threshold
        step = self.range_size if ranged else size
        spans = [(off, min(step, size - off)) for off in range(0, size, step)]
        crcs: list[int | None] = [None] * len(spans)
        left = [len(spans)]
        lock = threading.Lock()
        tries = [0]

        problems: list[str] = []

        def fetch(k: int) -> None:
            off, length = spans[k]
            try:
                crc = self._call(
                    lambda t: self._get_into(name, fd, off, length, ranged, size, dl, t), dl, f"downloading {rel}"
                )
            except _SizeMismatch as exc:
                crc = None
                with lock:
                    problems.append(str(exc))
            except Exception as exc:
                if _is_not_found(exc):
                    raise RestoreError(self._missing(rel, name)) from None
                raise
            with lock:
                crcs[k] = crc
                left[0] -= 1
                last = left[0] == 0
            if last:
                verify()

        def verify() -> None:
            if problems:
                problem = problems[0]
            else:
                whole = crcs[0] or 0
                for (_, length), crc in list(zip(spans, crcs))[1:]:
                    whole = crc32c_combine(whole, crc or 0, length)
                if crc32c_b64(whole) == entry["crc32c"]:
                    return
                problem = f"crc32c {crc32c_b64(whole)} != {entry['crc32c']} in the manifest"
            with lock:
                problems.clear()
                tries[0] += 1
                again = tries[0] < 2
                if again:
                    left[0] = len(spans)
            if not again:  # a mismatch is downloaded once more before giving up
                raise RestoreError(self._corrupt(rel, name, problem))
            for k in range(len(spans)):
                pool.submit(fetch, k)

        for k in range(len(spans)):
            pool.submit(fetch, k)

    def _schedule_pack(
        self, pool: _Pool, pack: str, members: list[tuple[int, str, dict]], stage: list[str], dl: _Deadline
    ) -> None:
        """Queue the small files held by one pack: ranged reads of the runs they occupy, split as they stream."""
        name = self.blob_name(f"pack:{pack}")
        members = sorted(members, key=lambda m: (m[2]["offset"], m[2]["size"]))
        runs: list[list[tuple[int, str, dict]]] = []
        run_end = -1
        for m in members:
            off, size = m[2]["offset"], m[2]["size"]
            if runs and off - run_end <= MiB and run_end - runs[-1][0][2]["offset"] < self.pack_size:
                runs[-1].append(m)
                run_end = max(run_end, off + size)
            else:
                runs.append([m])
                run_end = off + size
        for ms in runs:
            pool.submit(self._fetch_pack_run, name, ms, stage, dl)

    def _fetch_pack_run(self, name: str, ms: list[tuple[int, str, dict]], stage: list[str], dl: _Deadline) -> None:
        import google_crc32c

        start = ms[0][2]["offset"]
        end = max(m[2]["offset"] + m[2]["size"] for m in ms)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

        def once(timeout: float) -> list[tuple[str, int]]:
            crcs = [google_crc32c.Checksum() for _ in ms]
            sizes = [0] * len(ms)
            fds: dict[int, int] = {}
            try:
                for j, (i, _, entry) in enumerate(ms):
                    if entry["size"] == 0:
                        os.close(os.open(stage[i], flags, 0o666))
                if end > start:
                    resp = self._http.request(
                        "GET", self._object_url(name), params={"alt": "media"},
                        headers={"Range": f"bytes={start}-{end - 1}"}, stream=True, timeout=(timeout, timeout),
                    )  # fmt: skip
                    try:
                        self._raise_for(resp)
                        if resp.status_code != 206:
                            raise StorageUnavailableError(f"{self.url}: the server ignored a ranged read of {name}")
                        pos, first = start, 0
                        for chunk in resp.iter_content(_BLOCK):
                            dl.check()
                            cend = pos + len(chunk)
                            j = first
                            while j < len(ms) and ms[j][2]["offset"] < cend:
                                i, _, entry = ms[j]
                                a, b = max(pos, entry["offset"]), min(cend, entry["offset"] + entry["size"])
                                if a < b:
                                    if j not in fds:
                                        fds[j] = os.open(stage[i], flags, 0o666)
                                    piece = chunk[a - pos : b - pos]
                                    os.pwrite(fds[j], piece, a - entry["offset"])
                                    crcs[j].update(piece)
                                    sizes[j] += b - a
                                j += 1
                            while first < len(ms) and ms[first][2]["offset"] + ms[first][2]["size"] <= cend:
                                if first in fds:
                                    os.close(fds.pop(first))
                                first += 1
                            pos = cend
                    finally:
                        resp.close()
            finally:
                for fd in fds.values():
                    os.close(fd)
            return [(base64.b64encode(c.digest()).decode("ascii"), n) for c, n in zip(crcs, sizes)]

        for _ in range(2):  # a mismatch is downloaded once more before giving up
            try:
                got = self._call(once, dl, f"downloading {len(ms)} small files")
            except Exception as exc:
                if _is_not_found(exc):
                    raise RestoreError(self._missing(ms[0][1], name)) from None
                raise
            wrong = [(m, c, n) for m, (c, n) in zip(ms, got) if n != m[2]["size"] or c != m[2]["crc32c"]]
            if not wrong:
                return
            (_, bad, entry), crc, n = wrong[0]
            if n != entry["size"]:
                problem = f"size {n} != {entry['size']} in the manifest"
            else:
                problem = f"crc32c {crc} != {entry['crc32c']} in the manifest"
        raise RestoreError(self._corrupt(bad, name, problem))

    def _corrupt(self, rel: str, name: str, problem: str) -> str:
        return f"checkpoint file {rel} is corrupt (gs://{self.bucket_name}/{name}: {problem}); nothing was restored"

    def _missing(self, rel: str, name: str) -> str:
        return f"checkpoint file {rel}: blob gs://{self.bucket_name}/{name} is missing; nothing was restored"


def _move_tree(src: str, dst: str) -> None:
    """Move everything under ``src`` into ``dst``: a name ``dst`` lacks moves whole (one rename),
    a directory both have is merged, a file replaces ``dst``'s.  Never follows a symlink of ``dst``."""
    with os.scandir(src) as it:
        entries = list(it)
    for entry in entries:
        target = os.path.join(dst, entry.name)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            os.rename(entry.path, target)
            continue
        if entry.is_dir(follow_symlinks=False) and stat.S_ISDIR(st.st_mode):
            _move_tree(entry.path, target)
        else:
            os.replace(entry.path, target)
