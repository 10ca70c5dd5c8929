"""Retention: the bucket keeps the objects of the last ``keep_commits`` commits, not every blob ever sent.

Paths under ``gs://BUCKET/PREFIX``::

    PREFIX/manifest.json                   the latest commit (format unchanged: older releases read it)
    PREFIX/commits/<generation>.json       every commit, a copy of manifest.json as written (20-digit
                                           zero-padded generation of manifest.json: sorts by age)
    PREFIX/superseded/manifest-<gen>.json  a manifest another submission replaced (never collected)
    PREFIX/ledger/...                      the goodput ledger's records (never listed, never touched)

The rule (pure: :func:`split_commits`, :func:`collectable`).  Commits are ordered by
generation; the newest ``keep`` are *kept*.  An older commit *dropped out* of the window
when the commit ``keep`` places newer was written (that record's ``timeCreated``); for
``grace_s`` after that it still protects its objects (a restore that read it a moment ago
finishes), then its record goes too.  An object under ``blobs/`` may be deleted when

* no protected manifest references it: ``manifest.json`` as read just before deleting, the
  kept commits, the commits still in their grace, every ``superseded/`` manifest; and
* it was written more than ``grace_s`` ago (``updated``): a sync uploads its blobs before its
  manifest, so a blob of a commit in flight is never taken for garbage.

So no state of its own is kept: a blob's "unreferenced since" is bounded by the time its
last referencing commit dropped out, which the records' times say.  Times are the
server's, compared with this host's clock (NTP keeps them within far less than a grace).

Garbage the job leaves behind is marked for the bucket's lifecycle rule, so a finished (or
cancelled) job's prefix empties itself with nobody running anything and no root process
deleting what a user named.  Each clean-up sets ``customTime`` on what it may not delete yet
(:func:`garbage_marks`): an unreferenced object inside its grace gets ``written + grace``, a
commit record inside its grace ``dropped out + grace``, i.e. the moment this rule would
delete it.  The rule ``daysSinceCustomTime: 1`` (docs/admin/install.md) then deletes it a day
after that.  Cloud Storage never lets ``customTime`` go back, so an object already marked
keeps its mark; one marked and referenced again (a new commit reusing old bytes, a commit in
flight from another node) is *revived*: rewritten onto itself, a new generation without the
mark, at the clean-up after that commit.

Only the fence holder collects: the caller's attempt is fenced against ``manifest.json``
(:meth:`ManifestStore.fence`) before planning and again before each batch of deletes, and
every batch leaves out what the newest manifest references (a new commit may reuse an old
blob).  Each delete carries ``ifGenerationMatch`` of the listed object, so a blob uploaded
again since the listing stays.  A by-hand ``ckpt gc`` has no attempt: it re-reads and
protects the newest manifest the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Sequence

from ..errors import StaleAttemptError
from ..manifest import Manifest
from .bucket import BucketObjects
from .manifest_store import ManifestStore
from .transfer import Deadline, WorkerPool, is_not_found, is_precondition_failed
from .verify import objects_of

__all__ = ["Commit", "GcResult", "StoredObject", "collect", "collectable", "garbage_marks", "list_commits",
           "manifest_objects", "record_marks", "split_commits"]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")

BATCH = 100  # deletes between two reads of manifest.json


@dataclass(frozen=True)
class StoredObject:
    """One listed object: its full name, generation, size and last write (epoch seconds)."""

    name: str
    generation: int
    size: int
    updated: float
    custom_time: float = 0.0  # epoch seconds of its customTime; 0 = none (not marked)


@dataclass(frozen=True)
class Commit:
    """One ``commits/<id>.json`` record: its id (the manifest's generation), when it was written."""

    id: str
    created: float
    generation: int = 0  # of the record object itself
    custom_time: float = 0.0  # of the record object; 0 = not marked


@dataclass
class GcResult:
    """What a clean-up deleted (or, dry, would delete)."""

    deleted: list[StoredObject] = field(default_factory=list)
    dropped_commits: list[str] = field(default_factory=list)
    kept_commits: list[str] = field(default_factory=list)
    waiting: int = 0  # unreferenced objects still inside the grace period
    marked: list[str] = field(default_factory=list)  # names given customTime for the lifecycle rule
    revived: list[str] = field(default_factory=list)  # marked names referenced again: rewritten unmarked
    fenced: str = ""  # why nothing was deleted: this attempt does not hold the fence, or there is no commit
    dry_run: bool = False

    @property
    def bytes_freed(self) -> int:
        return sum(o.size for o in self.deleted)


# ------------------------------------------------------------------- the rule (pure)


def split_commits(commits: Sequence[Commit], keep: int, grace_s: float, now: float) -> tuple[list[Commit], list[Commit], list[Commit]]:
    """(kept, lingering, dropped) of ``commits``: the newest ``keep``; older ones that dropped out of
    the window less than ``grace_s`` ago (they still protect their objects); the rest."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    ordered = sorted(commits, key=lambda c: c.id)
    cut = max(0, len(ordered) - keep)
    kept, lingering, dropped = ordered[cut:], [], []
    for i, c in enumerate(ordered[:cut]):
        dropped_out_at = ordered[i + keep].created
        (lingering if now - dropped_out_at < grace_s else dropped).append(c)
    return kept, lingering, dropped


def collectable(blobs: Iterable[StoredObject], protected: set[str], grace_s: float, now: float) -> tuple[list[StoredObject], int]:
    """(objects that may go, how many unreferenced ones wait out the grace): an object goes when no
    protected manifest references it and it was written more than ``grace_s`` ago."""
    out, waiting = [], 0
    for o in blobs:
        if o.name in protected:
            continue
        if now - o.updated < grace_s:
            waiting += 1
        else:
            out.append(o)
    return sorted(out, key=lambda o: o.name), waiting


def garbage_marks(blobs: Iterable[StoredObject], protected: set[str], lingering_until: dict[str, float],
                  grace_s: float) -> tuple[list[tuple[StoredObject, float]], list[StoredObject]]:
    """(objects no kept commit needs and with no mark yet, each with the moment this rule may delete it:
    written + grace, or later when a commit inside its grace still names it; objects a kept commit
    needs that carry a mark: to revive). Marks stay (Cloud Storage never moves ``customTime`` back)."""
    marks, revive = [], []
    for o in sorted(blobs, key=lambda o: o.name):
        if o.name in protected:
            if o.custom_time:
                revive.append(o)
        elif not o.custom_time:
            marks.append((o, max(o.updated + grace_s, lingering_until.get(o.name, 0.0))))
    return marks, revive


def record_marks(records: Iterable[Commit], commits: Sequence[Commit], keep: int, grace_s: float) -> list[tuple[Commit, float]]:
    """Each of ``records`` beyond the window of ``commits``, with the moment it may go: when it dropped
    out (the commit ``keep`` places newer was written) + grace. Kept records are left out."""
    ordered = sorted(commits, key=lambda c: c.id)
    cut = max(0, len(ordered) - keep)
    until = {c.id: ordered[i + keep].created + grace_s for i, c in enumerate(ordered[:cut])}
    return [(c, until[c.id]) for c in records if c.id in until]


def manifest_objects(objects: BucketObjects, manifest: Manifest | None) -> set[str]:
    """The object names (``PREFIX/blobs/...``) whose bytes ``manifest`` needs."""
    if manifest is None:
        return set()
    return {objects.blob_name(o) for o in objects_of(manifest.files)}


# ------------------------------------------------------------------- the bucket side


def commit_name(objects: BucketObjects, generation: int) -> str:
    return objects.key(f"commits/{int(generation):020d}.json")


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return 0.0  # unknown: as old as can be (a backend that says nothing; the manifest checks still hold)


def _list(objects: BucketObjects, sub: str, dl: Deadline) -> list[Any]:
    prefix = objects.key(sub)

    def once(timeout: float) -> list[Any]:
        it = objects.client.list_blobs(
            objects.bucket_name, prefix=prefix,
            fields="items(name,generation,size,updated,timeCreated,customTime),nextPageToken", timeout=timeout,
            retry=None,
        )  # fmt: skip
        return list(it)

    return objects.call(once, dl, f"listing {sub}")


def list_blobs(objects: BucketObjects, dl: Deadline) -> list[StoredObject]:
    return [StoredObject(b.name, int(b.generation or 0), int(b.size or 0), _epoch(b.updated), _epoch(b.custom_time))
            for b in _list(objects, "blobs/", dl)]


def list_commits(objects: BucketObjects, dl: Deadline) -> list[Commit]:
    """The commit records, oldest first (names that are not ``<digits>.json`` are left alone)."""
    out = []
    for b in _list(objects, "commits/", dl):
        stem = b.name.rpartition("/")[2]
        if stem.endswith(".json") and stem[:-5].isdigit():
            out.append(Commit(stem[:-5], _epoch(b.time_created or b.updated), int(b.generation or 0),
                              _epoch(b.custom_time)))
    return sorted(out, key=lambda c: c.id)


def read_json_manifest(objects: BucketObjects, name: str, dl: Deadline) -> Manifest | None:
    """A manifest-format object (a record, a superseded manifest); None when it is gone."""
    def once(timeout: float) -> bytes:
        return objects.bucket.blob(name).download_as_bytes(timeout=timeout, retry=None)

    try:
        data = objects.call(once, dl, "reading a commit record")
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise
    return Manifest.from_json(data, source=f"gs://{objects.bucket_name}/{name}")


def read_commit(objects: BucketObjects, commit: Commit, dl: Deadline, cache: dict[str, Manifest] | None = None) -> Manifest | None:
    """The manifest of a commit record (records never change: ``cache`` keeps them by id)."""
    if cache is not None and commit.id in cache:
        return cache[commit.id]
    m = read_json_manifest(objects, objects.key(f"commits/{commit.id}.json"), dl)
    if m is not None and cache is not None:
        cache[commit.id] = m
    return m


def _fenced_out(manifests: Any, newest: Any, attempt: Any) -> str:
    """Why this attempt may not clean up ("" = it holds the fence, or a tool runs it: attempt None)."""
    if attempt is None:
        return ""
    try:
        manifests.fence(newest, attempt)
    except StaleAttemptError as exc:
        return str(exc)
    return ""


def collect(
    objects: BucketObjects,
    manifests: ManifestStore,
    keep: int,
    grace_s: float,
    dl: Deadline,
    *,
    attempt: int | None = None,
    dry_run: bool = False,
    workers: int = 8,
    now: Callable[[], float] = time.time,
    cache: dict[str, Manifest] | None = None,
    before_delete: Callable[[], None] | None = None,
) -> GcResult:
    """Delete what no protected manifest references (see the module's rule). ``attempt``: the caller's
    (fenced; None for a tool). Returns what went, or, ``dry_run``, what would go. A malformed record
    stops the clean-up (it cannot say what it references): :class:`ManifestError`."""
    result = GcResult(dry_run=dry_run)
    newest, _ = manifests.read(dl)
    result.fenced = _fenced_out(manifests, newest, attempt)
    if result.fenced:
        return result
    if newest is None:  # nothing committed (or manifest.json removed by hand): nothing says what to keep
        result.fenced = f"no checkpoint is committed under {objects.url} (no manifest.json): nothing to keep by"
        return result
    commits = list_commits(objects, dl)
    t = now()
    kept, lingering, dropped = split_commits(commits, keep, grace_s, t)
    result.kept_commits = [c.id for c in kept]
    protected = manifest_objects(objects, newest)  # for good: what a restore may still want
    for c in kept:
        protected |= manifest_objects(objects, read_commit(objects, c, dl, cache))
    for b in _list(objects, "superseded/", dl):
        protected |= manifest_objects(objects, read_json_manifest(objects, b.name, dl))
    record_until = {c.id: until for c, until in record_marks(lingering, commits, keep, grace_s)}
    lingering_until: dict[str, float] = {}  # object -> when the last lingering commit naming it expires
    for c in lingering:
        for name in manifest_objects(objects, read_commit(objects, c, dl, cache)):
            lingering_until[name] = max(lingering_until.get(name, 0.0), record_until[c.id])
    blobs = list_blobs(objects, dl)
    doomed, result.waiting = collectable(blobs, protected | set(lingering_until), grace_s, t)
    gone_names = {o.name for o in doomed}
    marks, revive = garbage_marks([o for o in blobs if o.name not in gone_names], protected, lingering_until, grace_s)
    marks_r = [(c, record_until[c.id]) for c in lingering if not c.custom_time]
    if dry_run:
        result.deleted, result.dropped_commits = doomed, [c.id for c in dropped]
        result.marked = [o.name for o, _ in marks] + [objects.key(f"commits/{c.id}.json") for c, _ in marks_r]
        result.revived = [o.name for o in revive]
        return result
    if before_delete is not None:
        before_delete()
    for i in range(0, len(doomed), BATCH):
        newest, _ = manifests.read(dl)  # just before deleting: the newest commit may reuse an old blob
        result.fenced = _fenced_out(manifests, newest, attempt)
        if result.fenced:
            return result
        live = manifest_objects(objects, newest)
        batch = [o for o in doomed[i : i + BATCH] if o.name not in live]
        result.deleted += delete_objects(objects, batch, dl, workers)
    for c in dropped:  # after their objects: a record left behind only protects more
        gone = delete_objects(objects, [StoredObject(objects.key(f"commits/{c.id}.json"), c.generation, 0, c.created)], dl, 1)
        if gone:
            result.dropped_commits.append(c.id)
            if cache is not None:
                cache.pop(c.id, None)
    newest, _ = manifests.read(dl)  # a commit since planning may reference what was garbage then
    result.fenced = _fenced_out(manifests, newest, attempt)
    if result.fenced:
        return result
    live = manifest_objects(objects, newest)
    result.revived = revive_objects(objects, revive, dl)
    records = [(StoredObject(objects.key(f"commits/{c.id}.json"), c.generation, 0, c.created), when) for c, when in marks_r]
    result.marked = mark_objects(objects, [(o, w) for o, w in marks if o.name not in live] + records, dl)
    return result


def at_listed_generation(objects: BucketObjects, o: StoredObject, act: Callable[[float, dict], None], dl: Deadline,
                         what: str) -> bool:
    """``act(timeout, precondition)`` on ``o`` only at its listed generation; False when it is gone or
    written again since the listing (left alone: never an error)."""
    kw = {"if_generation_match": o.generation} if o.generation else {}
    try:
        objects.call(lambda t: act(t, kw), dl, what)
    except Exception as exc:
        if is_not_found(exc) or is_precondition_failed(exc):
            return False
        raise
    return True


def mark_objects(objects: BucketObjects, marks: list[tuple[StoredObject, float]], dl: Deadline) -> list[str]:
    """Set ``customTime`` on each object (only at its listed generation); the names marked."""
    done = []
    for o, when in marks:
        blob = objects.bucket.blob(o.name)
        blob.custom_time = datetime.fromtimestamp(when, tz=timezone.utc)
        if at_listed_generation(objects, o, lambda t, kw: blob.patch(timeout=t, retry=None, **kw), dl,
                                "marking an object for the lifecycle rule"):
            done.append(o.name)
    return done


def revive_objects(objects: BucketObjects, stale: list[StoredObject], dl: Deadline) -> list[str]:
    """Rewrite each marked object a commit references onto itself: a new generation without
    ``customTime`` (which can never be cleared or moved back), so the lifecycle rule leaves it."""
    done = []
    for o in stale:
        src = objects.bucket.blob(o.name)
        dst = objects.bucket.blob(o.name)
        # A non-empty body is the new generation's metadata (an empty one copies the source's,
        # customTime included): content type only, no customTime.
        dst.content_type = "application/octet-stream"

        def rewrite(timeout: float, kw: dict) -> None:
            token, _, _ = dst.rewrite(src, timeout=timeout, retry=None, **kw)
            while token is not None:
                token, _, _ = dst.rewrite(src, token=token, timeout=timeout, retry=None, **kw)

        if at_listed_generation(objects, o, rewrite, dl, "reviving a marked object a commit references"):
            done.append(o.name)
    return done


def delete_objects(objects: BucketObjects, batch: list[StoredObject], dl: Deadline, workers: int) -> list[StoredObject]:
    """Delete ``batch``, each only at its listed generation; the ones this call deleted."""
    if not batch:
        return []
    gone: list[StoredObject] = []
    pool = WorkerPool(min(workers, len(batch)), dl, "ckpt-gc")

    def one(o: StoredObject) -> None:
        blob = objects.bucket.blob(o.name)
        if at_listed_generation(objects, o, lambda t, kw: blob.delete(timeout=t, retry=None, **kw), dl,
                                "deleting an unreferenced object"):  # else gone already, or written again: kept
            gone.append(o)

    pool.run_each(one, batch)
    return sorted(gone, key=lambda o: o.name)

