"""The objects of one checkpoint prefix on Cloud Storage, and every request made to them.

:class:`BucketObjects` names the objects (``blobs/...``, ``manifest.json``),
holds the client (made on first use, so importing this module imports no google
library), and makes the requests: :meth:`BucketObjects.call` retries transient
failures with jittered backoff within the caller's :class:`~slurmagent.checkpoint.gcs.transfer.Deadline`;
media uploads, composes and ranged reads go through the client's authorized HTTP
session as single streamed requests (JSON API, so that they run against the local
emulators too), never buffered whole.

The client honours ``STORAGE_EMULATOR_HOST`` as google-cloud-storage does: with
it set, anonymous credentials and a placeholder project are used; otherwise
Application Default Credentials.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any, Callable, TypeVar
from urllib.parse import quote

from ..errors import CheckpointError, StorageUnavailableError
from ..remote import parse_remote
from .transfer import BLOCK, Aborted, Deadline, SizeMismatch, is_not_found, is_transient, one_line, status_of

__all__ = ["BucketObjects", "make_client", "mount_adapter"]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")

T = TypeVar("T")


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


def mount_adapter(session: Any, size: int) -> None:
    """Let ``size`` threads share ``session`` without pool-full churn; send bodies in 1 MiB writes."""
    from requests.adapters import HTTPAdapter

    class _Adapter(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            kwargs["blocksize"] = BLOCK
            super().init_poolmanager(*args, **kwargs)

    adapter = _Adapter(pool_connections=4, pool_maxsize=size)
    session.mount("https://", adapter)
    session.mount("http://", adapter)


class BucketObjects:
    """The objects under ``gs://BUCKET/PREFIX`` and the requests made to them.

    ``client``: a ``google.cloud.storage.Client`` (default :func:`make_client`, created
    on first use; its HTTP pool is widened to ``pool_size`` connections).
    ``timeout_s``: per-request timeout, capped by the time left.
    """

    def __init__(self, remote_url: str, *, client: Any = None, timeout_s: float = 30.0, pool_size: int = 32) -> None:
        self.bucket_name, self.prefix = parse_remote(remote_url)
        self.url = f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = float(timeout_s)
        self.pool_size = pool_size
        self._client = client
        self._bucket = None
        self._lock = threading.Lock()
        self._bucket_checked = False
        self._adapter_mounted = False

    # -- names

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def manifest_name(self) -> str:
        return self.key("manifest.json")

    def blob_name(self, content_id: str) -> str:
        """Object name of a content id (``blake3:<hex>``, ``sha256:<hex>`` or a bare legacy sha256)."""
        algo, sep, hexd = content_id.partition(":")
        if not sep:
            return self.key(f"blobs/{content_id}")
        if algo == "sha256":
            return self.key(f"blobs/{hexd}")
        return self.key(f"blobs/{algo}-{hexd}")

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
                    mount_adapter(self._client._http, self.pool_size)
                except Exception:  # a client without an HTTP session (tests): nothing to widen
                    log.debug("could not mount the HTTP adapter", exc_info=True)
            return self._client

    @property
    def bucket(self) -> Any:
        if self._bucket is None:
            self._bucket = self.client.bucket(self.bucket_name)
        return self._bucket

    @property
    def http(self) -> Any:
        return self.client._http

    def api(self, path: str) -> str:
        return f"{self.client._connection.API_BASE_URL.rstrip('/')}{path}"

    def object_url(self, name: str) -> str:
        return self.api(f"/storage/v1/b/{self.bucket_name}/o/{quote(name, safe='')}")


    # -- retry

    def call(self, fn: Callable[[float], T], dl: Deadline, what: str) -> T:
        """Run ``fn(timeout)``, retrying transient failures with backoff until the deadline.

        404 and 412 are re-raised as they are (callers decide); other HTTP errors
        become :class:`StorageUnavailableError`.
        """
        delay = 0.2
        tries = 0
        while True:
            if dl.abort.is_set():
                raise Aborted()
            tries += 1
            left = dl.remaining()
            if left <= 0:
                raise Aborted()
            try:
                return fn(max(0.05, min(self.timeout_s, left)))
            except Exception as exc:
                if dl.abort.is_set() or isinstance(exc, Aborted):
                    raise Aborted() from None
                if isinstance(exc, (CheckpointError, OSError)) and not is_transient(exc):
                    raise
                if not is_transient(exc):
                    status = status_of(exc)
                    if status in (404, 412) or status is None:
                        raise
                    raise StorageUnavailableError(f"{what} on {self.url} failed: {one_line(exc)}") from exc
                last = exc
            pause = delay * (0.5 + random.random() / 2)
            delay = min(delay * 2, 5.0)
            left = dl.remaining()
            if left < 0.3:
                raise StorageUnavailableError(
                    f"{what} on {self.url}: gave up after {tries} tries in {dl.elapsed():.1f}s "
                    f"(deadline {dl.total:g}s): {one_line(last)}"
                ) from last
            log.debug("%s: %s; retrying in %.2fs", what, one_line(last), pause)
            if dl.abort.wait(min(pause, left - 0.2)):
                raise Aborted()

    # -- raw JSON API requests (streamed, through the client's authorized session)

    def raise_for(self, resp: Any) -> None:
        if resp.status_code >= 400:
            from google.api_core import exceptions

            raise exceptions.from_http_response(resp)

    def request_json(self, method: str, url: str, timeout: float, **kwargs: Any) -> dict:
        """One request whose answer is an object resource: raised on an error status, parsed, closed."""
        resp = self.http.request(method, url, timeout=(timeout, timeout), **kwargs)
        try:
            self.raise_for(resp)
            return resp.json()
        finally:
            resp.close()

    def post_media(self, name: str, body: Any, size: int, timeout: float, if_generation_match: int | None = 0) -> dict:
        params = {"uploadType": "media", "name": name}
        if if_generation_match is not None:
            params["ifGenerationMatch"] = str(if_generation_match)
        return self.request_json(
            "POST",
            self.api(f"/upload/storage/v1/b/{self.bucket_name}/o"),
            timeout,
            data=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            params=params,
        )

    def compose(self, dest: str, sources: list[str], timeout: float, if_generation_match: int | None) -> dict:
        params = {} if if_generation_match is None else {"ifGenerationMatch": str(if_generation_match)}
        return self.request_json(
            "POST",
            self.object_url(dest) + "/compose",
            timeout,
            json={
                "sourceObjects": [{"name": s} for s in sources],
                "destination": {"contentType": "application/octet-stream"},
            },
            params=params,
        )

    def get_into(
        self, name: str, fd: int, start: int, length: int, ranged: bool, expect_size: int, dl: Deadline, timeout: float
    ) -> int:
        """Download ``length`` bytes of object ``name`` from ``start`` into ``fd`` at ``start``; its CRC32C."""
        import google_crc32c

        headers = {"Range": f"bytes={start}-{start + length - 1}"} if ranged else {}
        resp = self.http.request(
            "GET", self.object_url(name), params={"alt": "media"}, headers=headers, stream=True,
            timeout=(timeout, timeout),
        )  # fmt: skip
        try:
            self.raise_for(resp)
            if ranged and resp.status_code != 206:
                raise StorageUnavailableError(f"{self.url}: the server ignored a ranged read of {name}")
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            if ranged and total.isdigit() and int(total) != expect_size:
                raise SizeMismatch(f"size {total} != {expect_size} in the manifest")
            crc = google_crc32c.Checksum()
            pos, end = start, start + length
            for chunk in resp.iter_content(BLOCK):
                dl.check()
                if pos + len(chunk) > end:
                    raise SizeMismatch(f"size > {expect_size} in the manifest")
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, pos)
                    view = view[n:]
                    pos += n
                crc.update(chunk)
            if pos != end:
                raise SizeMismatch(f"size {pos - start} != {expect_size} in the manifest")
            return int.from_bytes(crc.digest(), "big")
        finally:
            resp.close()

    # -- objects

    def check_bucket(self, dl: Deadline) -> None:
        """Tell "no checkpoint yet" from "no such bucket" (needs only storage.objects.list)."""
        if self._bucket_checked:
            return

        def once(timeout: float) -> None:
            it = self.client.list_blobs(
                self.bucket_name, prefix=self.key(""), max_results=1, timeout=timeout, retry=None
            )
            for _ in it:
                break

        try:
            self.call(once, dl, "listing the checkpoint prefix")
        except Exception as exc:
            if is_not_found(exc):
                raise StorageUnavailableError(
                    f"checkpoint bucket gs://{self.bucket_name} does not exist (remote {self.url})"
                ) from None
            raise
        self._bucket_checked = True

    def blob_state(self, name: str, dl: Deadline) -> tuple[bool, int]:
        """(does ``name`` exist, its generation when it carries a retention mark else 0). A marked
        object (``customTime``: the bucket's lifecycle rule will delete it) must not be named by a
        commit as it is: its bytes are written again over that generation, unmarked."""
        def once(timeout: float) -> tuple[bool, int]:
            try:
                blob = self.bucket.get_blob(name, timeout=timeout, retry=None)
            except Exception as exc:  # noqa: BLE001 - gone between the two calls
                if is_not_found(exc):
                    return False, 0
                raise
            if blob is None:
                return False, 0
            return True, (int(blob.generation) if blob.custom_time is not None else 0)
        return self.call(once, dl, "checking a blob")

    def marked_generation(self, name: str, dl: Deadline) -> int:
        """The generation of ``name`` when it exists with a retention mark, else 0."""
        return self.blob_state(name, dl)[1]

    def delete_quietly(self, name: str, dl: Deadline, generation: Any = None) -> None:
        try:
            blob = self.bucket.blob(name)
            kw = {"if_generation_match": int(generation)} if generation else {}
            self.call(lambda t: blob.delete(timeout=t, retry=None, **kw), dl, "removing an object")
        except Exception:
            log.debug("could not remove %s", name, exc_info=True)

    def corrupt(self, rel: str, name: str, problem: str) -> str:
        return f"checkpoint file {rel} is corrupt (gs://{self.bucket_name}/{name}: {problem}); nothing was restored"

    def missing(self, rel: str, name: str) -> str:
        return f"checkpoint file {rel}: blob gs://{self.bucket_name}/{name} is missing; nothing was restored"
