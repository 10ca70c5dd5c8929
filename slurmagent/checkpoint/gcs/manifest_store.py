"""The manifest on Cloud Storage: read with its generation, written last and fenced.

Fencing: the manifest carries the writer's ``owner`` (the submission, see
:mod:`slurmagent.run.identity`) and ``attempt`` (restart count).  Before writing, the
current manifest and its generation are read; one of another owner (foreign: this
job was superseded, or never took the prefix over) or of the same owner with a
higher attempt (we are a stale attempt) raises :class:`StaleAttemptError`.
Attempts are compared within one owner only, so a restart count that resets for a
new submission never blocks it.  The write uses ``if_generation_match=<generation
read>`` (0 when absent), and on 412 the manifest is read again and the decision
retaken.  A store whose owner is not set (``None``: a node agent, a tool) fences
by attempt alone, as before owners existed.  Taking a prefix over (``claim``) is
the one write that replaces a foreign manifest: only the generation read.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from typing import Any

from ..manifest import Manifest
from ..errors import StaleAttemptError, StorageUnavailableError
from ..errors import ClaimRaceError
from .bucket import BucketObjects
from .transfer import Deadline, is_not_found, is_precondition_failed, one_line

__all__ = ["ClaimRaceError", "ManifestStore"]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")


class ManifestStore:
    """``PREFIX/manifest.json`` of one checkpoint prefix."""

    def __init__(self, objects: BucketObjects) -> None:
        self.objects = objects
        self.owner: str | None = None  # who we write as (slurmagent.run.identity); None: fence by attempt only
        # Also keep each commit as commits/<generation>.json (retention: slurmagent.checkpoint.gcs.retention).
        self.history = False
        self.writes = 0  # manifests this store wrote (a clean-up follows a new one)

    def is_own(self, current: Manifest) -> bool:
        """Is ``current`` of the submission we write as (any, when our owner is not set)?"""
        return self.owner is None or current.owner == self.owner

    def fence(self, current: Manifest | None, attempt: int) -> None:
        """Raise :class:`StaleAttemptError` when a writer of ``attempt`` may not replace ``current``."""
        if current is None:
            return
        if not self.is_own(current):
            raise StaleAttemptError(
                f"checkpoint {self.objects.manifest_url} belongs to another submission "
                f"({current.owner or 'written before checkpoint owners'}, attempt {current.attempt}), not to this "
                f"job ({self.owner or 'a job of before checkpoint owners'}): it took the prefix over; refusing to "
                "overwrite it"
            )
        if current.attempt > attempt:
            raise self.stale(current, attempt)

    def stamped(self, manifest: Manifest) -> Manifest:
        """``manifest`` as we write it: with our owner."""
        return manifest if self.owner is None or manifest.owner == self.owner else replace(manifest, owner=self.owner)

    def read(self, dl: Deadline) -> tuple[Manifest | None, int]:
        """(manifest, generation); (None, 0) when there is none."""

        def once(timeout: float) -> tuple[bytes | None, int]:
            blob = self.objects.bucket.blob(self.objects.manifest_name)
            data = blob.download_as_bytes(timeout=timeout, retry=None)
            if blob.generation:  # from x-goog-generation, consistent with the content
                return data, int(blob.generation)
            # The backend did not say which generation it sent (gcp-storage-emulator):
            # read the metadata, then the content of exactly that generation.
            for _ in range(5):
                meta = self.objects.bucket.get_blob(self.objects.manifest_name, timeout=timeout, retry=None)
                if meta is None:
                    return None, 0
                try:
                    data = self.objects.bucket.blob(self.objects.manifest_name).download_as_bytes(
                        if_generation_match=meta.generation, timeout=timeout, retry=None
                    )
                except Exception as exc:
                    if is_precondition_failed(exc):
                        continue
                    raise
                return data, int(meta.generation)
            raise StorageUnavailableError(f"{self.objects.manifest_url} keeps changing; could not read it")

        try:
            data, generation = self.objects.call(once, dl, "reading the manifest")
        except Exception as exc:
            if not is_not_found(exc):
                raise
            data, generation = None, 0
        if data is None:
            self.objects.check_bucket(dl)
            return None, 0
        return Manifest.from_json(data, source=self.objects.manifest_url), generation

    def commit(self, manifest: Manifest, dl: Deadline) -> int:
        """Write ``manifest`` as the complete checkpoint, fenced as a sync does (a newer
        attempt's manifest is never overwritten; ``if_generation_match`` on the one read).
        Every blob it names must already be stored. Returns the manifest's generation; an
        identical manifest of the same attempt already in place is kept as it is."""
        manifest = self.stamped(manifest)
        current, generation = self.read(dl)
        self.fence(current, manifest.attempt)
        if (
            current is not None
            and current.owner == manifest.owner
            and current.attempt == manifest.attempt
            and current.files == manifest.files
            and current.writers == manifest.writers
            and current.node_count == manifest.node_count
            and current.no_progress == manifest.no_progress
        ):
            return generation
        return self.write(manifest, current, generation, dl)

    def stale(self, current: Manifest, attempt: int) -> StaleAttemptError:
        """The refusal to overwrite ``current``, a newer attempt's checkpoint."""
        return StaleAttemptError(
            f"checkpoint {self.objects.manifest_url} belongs to attempt {current.attempt}, newer than ours "
            f"({attempt}); refusing to overwrite it"
        )

    def write(self, manifest: Manifest, current: Manifest | None, generation: int, dl: Deadline) -> int:
        """Write ``manifest`` over ``current`` (read at ``generation``); on a 412 read again and retake
        the decision. Returns the new generation."""
        manifest = self.stamped(manifest)
        data = manifest.to_json().encode("utf-8")
        races = 0
        while True:
            self.fence(current, manifest.attempt)
            blob = self.objects.bucket.blob(self.objects.manifest_name)

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
                return self.written(manifest, self.objects.call(once, dl, "writing the manifest"), dl)
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
            races += 1
            log.info("manifest %s changed under us (412); reading it again", self.objects.manifest_url)
            current, generation = self.read(dl)
            if current is not None and current.to_json() == manifest.to_json():
                return self.written(manifest, generation, dl)  # our own write, whose reply was lost
            if dl.remaining() < 0.3:
                raise StorageUnavailableError(
                    f"writing the manifest on {self.objects.url}: gave up after {races} concurrent changes "
                    f"(deadline {dl.total:g}s)"
                )
            time.sleep(min(0.05 * races * random.random(), max(dl.remaining() - 0.2, 0)))

    def claim(self, manifest: Manifest, over: Manifest | None, generation: int, dl: Deadline) -> int:
        """Take the prefix over: write ``manifest`` (ours) in place of ``over``, the manifest read
        at ``generation``, whoever wrote it. ``over`` is first kept as
        ``superseded/manifest-<generation>.json`` beside it (its blobs stay), so an operator can
        still reach the earlier job's checkpoint. A manifest that changed since it was read
        raises :class:`ClaimRaceError` (read again and decide again)."""
        manifest = self.stamped(manifest)
        if over is not None:
            self._keep_superseded(over, generation, dl)
        blob = self.objects.bucket.blob(self.objects.manifest_name)
        data = manifest.to_json().encode("utf-8")

        def once(timeout: float) -> int:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=generation,
                                    timeout=timeout, retry=None)
            return int(blob.generation)

        try:
            return self.written(manifest, self.objects.call(once, dl, "taking the checkpoint prefix over"), dl)
        except Exception as exc:
            if not is_precondition_failed(exc):
                raise
        current, new_generation = self.read(dl)
        if current is not None and current.to_json() == manifest.to_json():
            return self.written(manifest, new_generation, dl)  # our own write, whose reply was lost
        raise ClaimRaceError(f"{self.objects.manifest_url} changed while this job took the prefix over")

    def written(self, manifest: Manifest, generation: int, dl: Deadline) -> int:
        """``manifest`` is ``manifest.json`` at ``generation`` now: count it and, with ``history``, keep
        its copy ``commits/<generation>.json``. A failed copy costs history, never the commit (the
        clean-up then protects more, not less: manifest.json itself is always protected)."""
        self.writes += 1
        if not self.history:
            return generation
        name = self.objects.key(f"commits/{int(generation):020d}.json")
        data = manifest.to_json().encode("utf-8")

        def once(timeout: float) -> None:
            self.objects.bucket.blob(name).upload_from_string(
                data, content_type="application/json", if_generation_match=0, timeout=timeout, retry=None)

        try:
            self.objects.call(once, dl, "keeping the commit record")
        except Exception as exc:
            if not is_precondition_failed(exc):  # 412: written already (a lost reply)
                log.warning("could not keep the commit record gs://%s/%s: %s", self.objects.bucket_name, name, one_line(exc))
        return generation

    def _keep_superseded(self, over: Manifest, generation: int, dl: Deadline) -> None:
        name = self.objects.key(f"superseded/manifest-{generation}.json")
        data = over.to_json().encode("utf-8")

        def once(timeout: float) -> None:
            self.objects.bucket.blob(name).upload_from_string(
                data, content_type="application/json", if_generation_match=0, timeout=timeout, retry=None)

        try:
            self.objects.call(once, dl, "keeping the superseded manifest")
        except Exception as exc:
            if not is_precondition_failed(exc):  # 412: kept already (a retried claim)
                raise
