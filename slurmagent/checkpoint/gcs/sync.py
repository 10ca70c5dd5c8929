"""A sync: upload what the remote lacks, then write the manifest, last.

The missing blobs go up first and ``manifest.json`` is written last, so an
interrupted sync leaves the previous manifest, and everything it references,
untouched: a half-uploaded checkpoint is never restored.  The whole sync ends at
its deadline (a little is kept for the manifest write): the caller gets a
:class:`SyncDeadlineError` naming what was not uploaded, and the previous
manifest stays.  A file that keeps changing while it is read is tried again a
few times, then keeps its previous committed version (or is left out).
"""

from __future__ import annotations

import logging
import os
import posixpath
import stat
import time

from ..scan import LocalFile, parent_dirs, scan_checkpoint_dir
from ..hash_cache import LocalState
from ..manifest import Manifest, entry_content_id, no_progress_after
from ..errors import SyncDeadlineError
from .bucket import BucketObjects
from .manifest_store import ManifestStore
from .packs import seal_last_pack
from .sync_run import SyncResult, SyncRun
from .transfer import Deadline, Notices, TransferSettings, human_size, some_names
from .upload import sync_file, upload_claimed
from .verify import objects_of, verify_current

__all__ = ["run_sync"]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")


def run_sync(
    objects: BucketObjects,
    manifests: ManifestStore,
    notices: Notices,
    settings: TransferSettings,
    ckpt_dir: str | os.PathLike,
    attempt: int,
    state_file: str | os.PathLike,
    dl: Deadline,
    restored: Manifest | None = None,
    commit: bool = True,
    seen: set[str] | None = None,
    run_key: str = "",
) -> tuple[SyncResult, dict[str, tuple[int, int]] | None]:
    """Sync ``ckpt_dir`` (see :meth:`GcsCheckpointStore.sync`): the result, and relpath -> (size, mtime_ns)
    of what the manifest now holds when this sync wrote or kept one (None when it did not commit).

    ``seen``: the objects known to exist in this run (updated in place); ``run_key``: this run's
    key for the same set kept in the state file (a node agent: a new process every round)."""
    state = LocalState(state_file, ckpt_dir)
    seen = set() if seen is None else seen
    if run_key:
        seen |= state.verified(objects.url, run_key)
    skipped: list[str] = []

    def on_skip(rel: str, why: str) -> None:
        skipped.append(rel)
        notices.skipped(rel, why)

    entries = scan_checkpoint_dir(ckpt_dir, on_skip=on_skip)
    files = [e for e in entries if not e.is_link]
    links = [e for e in entries if e.is_link]
    current, generation = manifests.read(dl)
    manifests.fence(current, attempt)  # a foreign owner's or a newer attempt's: not ours to replace
    run = SyncRun(objects, manifests, notices, settings, state, current, dl)
    reserve = min(2.0, 0.15 * dl.total)  # kept for the manifest write
    result = None
    try:
        verify_current(run, seen)  # before any file trusts the committed manifest's blobs
        wave = files
        for round_no in range(settings.busy_retries + 1):
            for f in wave:
                run.pool.submit(sync_file, run, f)
            wait_for_workers(run, reserve, files)
            seal_last_pack(run)
            wait_for_workers(run, reserve, files)
            # blobs of twins whose uploading file vanished or was busy: upload from a twin
            for rel, (f, d, cid) in sorted(run.included.items()):
                if cid not in run.confirmed and cid not in run.claimed:
                    run.claimed.add(cid)
                    run.pool.submit(upload_claimed, run, f, d, cid)
            wait_for_workers(run, reserve, files)
            seal_last_pack(run)
            wait_for_workers(run, reserve, files)
            if not run.busy or round_no == settings.busy_retries:
                break
            if dl.remaining() - reserve < settings.busy_pause_s + 0.5:
                break
            time.sleep(settings.busy_pause_s * (round_no + 1))
            wave = rescan_busy(run)
        result = finish_sync(run, files, links, skipped, attempt, generation, ckpt_dir, restored, commit)
        return result, run.committed
    finally:
        run.pool.close()
        if result is not None:  # every object its entries name is in the bucket now
            live = set(objects_of(result.files))
            seen &= live | set(objects_of(run.current.files if run.current else {}))
            seen |= live
        if run_key:
            state.set_verified(objects.url, run_key, seen)
        state.add_known_blobs(objects.url, run.confirmed)
        try:
            state.save(
                keep_relpaths=[f.relpath for f in files],
                keep_blobs=(run.confirmed | {cid for _, _, cid in run.included.values()}) or None,
            )
        except OSError as exc:
            notices.say_once(f"state:{exc}", f"could not save the checkpoint hash cache {state.path}: {exc.strerror or exc}")


def wait_for_workers(run: SyncRun, reserve: float, files: list[LocalFile]) -> None:
    """Until the workers are done, keeping ``reserve`` seconds for the manifest; past that, what was not uploaded."""
    pool, dl = run.pool, run.dl
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
        f"sync to {run.objects.url} did not finish within its deadline of {dl.total:g}s: "
        f"{len(rels)} file(s) ({human_size(size)}) not uploaded: {some_names(rels)}; {after}",
        rels,
        size,
    )


def rescan_busy(run: SyncRun) -> list[LocalFile]:
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


def finish_sync(
    run: SyncRun,
    files: list[LocalFile],
    links: list[LocalFile],
    skipped: list[str],
    attempt: int,
    generation: int,
    ckpt_dir: str | os.PathLike,
    restored: Manifest | None = None,
    commit: bool = True,
) -> SyncResult:
    """The manifest entries of what was uploaded or already there, written as the manifest unless
    ``commit`` is off or nothing is left to commit."""
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
        if previous is not None and "link" not in previous and entry_content_id(previous) in run.missing_ids:
            previous = None
            run.notices.say_once(
                f"busy-missing:{rel}",
                f"{rel}: its committed version's blob is missing from {run.objects.url}; left out of this "
                "checkpoint until it can be read whole",
            )
        if previous is not None and "link" not in previous:
            new_files[rel] = dict(previous)
            run.notices.say_once(
                f"busy:{rel}",
                f"{rel} kept changing while it was read (written in place?): "
                "its previous committed version stays in the checkpoint",
            )
        else:
            run.notices.say_once(
                f"busy:{rel}",
                f"{rel} kept changing while it was read (written in place?): left out of this checkpoint",
            )
    kept_dirs = {p for rel in new_files for p in parent_dirs(rel)}
    for link in links:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(link.relpath), link.link or ""))
        if target in new_files or target in kept_dirs:
            new_files[link.relpath] = {"link": link.link}
            committed[link.relpath] = (link.size, link.mtime_ns)
        else:
            skipped.append(link.relpath)
            run.notices.skipped(link.relpath, f"a symlink to {target!r}, which is not in this checkpoint")
    result_skipped = tuple(sorted(set(skipped) | set(run.unreadable)))
    files_sent = len(run.uploaded)
    if not new_files:
        log.info("%s: checkpoint dir %s is empty; nothing written", run.objects.url, ckpt_dir)
        return SyncResult(
            0, 0, generation or None, 0, 0, tuple(busy), result_skipped, run.dl.elapsed(), manifest=current
        )
    def result(generation_now: int | None, manifest: Manifest | None = None) -> SyncResult:
        return SyncResult(
            files_sent=files_sent,
            bytes_sent=sum(run.uploaded.values()),
            manifest_generation=generation_now,
            skipped_unchanged=sum(1 for e in new_files.values() if "link" not in e) - files_sent,
            files_total=len(new_files),
            busy=tuple(busy),
            skipped=result_skipped,
            seconds=run.dl.elapsed(),
            files=new_files,
            manifest=manifest,
        )

    if not commit:  # one node's part: the job commits every node's entries at once
        return result(generation or None)
    no_progress = no_progress_after(restored, new_files)
    if (
        current is not None
        and run.manifests.is_own(current)
        and current.attempt == attempt
        and current.files == new_files
        and current.no_progress == no_progress
    ):
        new_generation, manifest = generation, current  # nothing changed: keep the manifest as it is
    else:
        manifest = run.manifests.stamped(Manifest(attempt=attempt, files=new_files, no_progress=no_progress))
        new_generation = run.manifests.write(manifest, current, generation, run.dl)
    run.committed = committed
    return result(new_generation, manifest)
