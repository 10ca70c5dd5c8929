"""The objects a commit references exist: checked once per run, re-uploaded when missing.

A sync trusts the content ids of the committed manifest (their blobs and packs are not
sent again).  An object deleted behind our back (a lifecycle rule on ``blobs/``, a hand
with ``gsutil rm``) would then be referenced by every later commit, and the checkpoint
could never be restored again.  So the first sync of a run checks that every object the
committed manifest references is still there, and any sync checks what it has not seen in
this run; what is missing is uploaded again from the local files (a packed file is packed
again), and what cannot be (no local copy) is never committed.

"This run": one wrapper attempt.  The wrapper's store lives as long as the attempt (its
set is in memory); a multi-node job's node agents are new processes every round, so they
keep the set in the node's hash-cache state file under a run key (job id and attempt).

Cost: one metadata read per object not yet seen (in parallel), or, from
:data:`LIST_ABOVE` objects on, one listing of ``blobs/`` (1,000 names a request).  An
unchanged sync after the first costs nothing more.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..manifest import entry_content_id
from .bucket import BucketObjects
from .sync_run import SyncRun
from .transfer import Deadline, WorkerPool, is_not_found

__all__ = ["LIST_ABOVE", "existing", "object_of", "objects_of", "verify_current"]

LIST_ABOVE = 64  # from this many objects to check on, one listing beats a read per object


def object_of(entry: Mapping) -> str:
    """The object id holding an entry's bytes: ``pack:<hex>`` for a packed file, else its content id."""
    return f"pack:{entry['pack']}" if "pack" in entry else entry_content_id(entry)


def objects_of(files: Mapping[str, Mapping]) -> dict[str, set[str]]:
    """Object id -> the content ids it holds, for the regular files among ``files``."""
    out: dict[str, set[str]] = {}
    for e in files.values():
        if "link" not in e:
            out.setdefault(object_of(e), set()).add(entry_content_id(e))
    return out


def existing(objects: BucketObjects, ids: Iterable[str], dl: Deadline, workers: int = 16) -> set[str]:
    """Which of the object ids ``ids`` exist: a read each in parallel, or one listing of ``blobs/``."""
    ids = sorted(set(ids))
    if not ids:
        return set()
    if len(ids) >= LIST_ABOVE:
        names = list_blob_names(objects, dl)
        return {i for i in ids if objects.blob_name(i) in names}
    found: set[str] = set()
    pool = WorkerPool(min(workers, len(ids)), dl, "ckpt-verify")

    def check(i: str) -> None:
        try:
            there = objects.blob_state(objects.blob_name(i), dl) == (True, 0)  # marked for deletion: as gone
        except Exception as exc:
            if not is_not_found(exc):
                raise
            there = False
        if there:
            found.add(i)

    pool.run_each(check, ids)
    return found


def list_blob_names(objects: BucketObjects, dl: Deadline) -> set[str]:
    """Every object name under ``blobs/`` not marked for the lifecycle rule (pages of 1,000; the whole
    listing retried on a transient error)."""
    prefix = objects.key("blobs/")

    def once(timeout: float) -> set[str]:
        it = objects.client.list_blobs(
            objects.bucket_name, prefix=prefix, fields="items(name,customTime),nextPageToken", timeout=timeout,
            retry=None,
        )
        return {b.name for b in it if b.custom_time is None}  # a marked one is as good as gone (retention.py)

    return objects.call(once, dl, "listing the checkpoint's blobs")


def verify_current(run: SyncRun, seen: set[str]) -> set[str]:
    """Check the objects of the committed manifest not in ``seen`` (updated in place); the content
    ids held by missing ones are no longer trusted (uploaded again when a local file has them).
    Returns the missing object ids (said once on the job's stderr)."""
    if run.current is None:
        return set()
    objs = objects_of(run.current.files)
    todo = [o for o in objs if o not in seen]
    there = existing(run.objects, todo, run.dl, run.settings.max_workers)
    seen.update(there)
    missing = set(todo) - there
    if not missing:
        return missing
    lost = set().union(*(objs[o] for o in missing))
    with run.lock:
        run.in_manifest -= lost
        run.known -= lost
        for cid in lost:
            run.locations.pop(cid, None)
        run.missing_ids = set(lost)
    run.state.forget_blobs(run.objects.url, lost)
    files = sorted(rel for rel, e in run.current.regular_files().items() if entry_content_id(e) in lost)
    names = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    run.notices.say_once(
        "missing:" + ",".join(sorted(missing)),
        f"{len(missing)} object(s) the committed checkpoint references are missing from {run.objects.url} or "
        f"marked for its lifecycle rule (deleted by a rule on blobs/, or marked by a clean-up while a commit "
        f"was in flight): uploading {names} again from the local files; "
        "a file with no local copy is left out of the next commit",
    )
    return missing

