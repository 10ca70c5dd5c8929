"""A restore: the last complete checkpoint put in place, all files or none.

Files are downloaded in parallel into a staging directory inside the checkpoint
directory (a reserved name, never synced): a large one as parallel ranged reads
written in place, a pack as ranged reads split into its files as they stream
(:mod:`slurmagent.checkpoint.gcs.packs`).  Every file's CRC32C (a large one's combined from
its ranges) is checked against the manifest before anything is renamed into
place; on any failure nothing appears under a final name.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from .. import hashing as checkpoint_hash
from ..hashing import EMPTY_CRC32C, crc32c_b64, crc32c_combine
from ..scan import RESERVED_PREFIX, LocalFile, parent_dirs
from ..errors import CheckpointError, RestoreError, SyncDeadlineError
from ..hash_cache import LocalState
from ..local_cache import BlobCache
from ..manifest import Manifest, entry_content_id
from ..errors import NodeDiskError, is_node_local
from .bucket import BucketObjects
from .manifest_store import ManifestStore
from .packs import schedule_pack_restore
from .peers import PeerSession
from .transfer import BLOCK, Deadline, Notices, SizeMismatch, TransferSettings, WorkerPool, human_size, is_not_found

__all__ = ["STAGING_PREFIX", "check_targets", "move_tree", "run_restore"]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")

STAGING_PREFIX = RESERVED_PREFIX + "restore-"  # reserved: never synced


def run_restore(
    objects: BucketObjects,
    manifests: ManifestStore,
    notices: Notices,
    settings: TransferSettings,
    root: Path,
    dl: Deadline,
    state_file: str | os.PathLike | None,
    manifest: Manifest | None = None,
    cache: BlobCache | None = None,
    peers: PeerSession | None = None,
) -> tuple[Manifest | None, dict[str, tuple[int, int]] | None]:
    """Put ``manifest`` (default: the committed one) into ``root`` (see :meth:`GcsCheckpointStore.restore`):
    the manifest restored (None when there is none), and relpath -> (size, mtime_ns) of what was placed.
    A failure of this node's disk or path (full, read-only, a file where a directory must be) is a
    :class:`NodeDiskError`: another node can take the checkpoint."""
    if manifest is None:
        manifest, _ = manifests.read(dl)
    if manifest is None:
        return None, None
    try:
        return place(objects, notices, settings, root, dl, state_file, manifest, cache, peers)
    except OSError as exc:
        if not is_node_local(exc):
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        raise NodeDiskError(f"cannot restore into {root}: {exc.strerror or exc}{where}") from None


def place(
    objects: BucketObjects,
    notices: Notices,
    settings: TransferSettings,
    root: Path,
    dl: Deadline,
    state_file: str | os.PathLike | None,
    manifest: Manifest,
    cache: BlobCache | None = None,
    peers: PeerSession | None = None,
) -> tuple[Manifest, dict[str, tuple[int, int]]]:
    """The restore of ``manifest`` into ``root``, staged in place (see :func:`make_room`); with a
    node-local ``cache``, what it holds is taken from there (verified), not downloaded; with
    ``peers`` (a multi-node restore), what other nodes' caches hold comes from them."""
    root.mkdir(parents=True, exist_ok=True)
    items = sorted(manifest.regular_files().items())
    links = sorted(manifest.links().items())
    check_targets(str(root), manifest)
    for stale in root.glob(f"{STAGING_PREFIX}*"):  # left by a restore that was killed
        shutil.rmtree(stale, ignore_errors=True)
    placed = [(rel, entry, os.path.join(root, *rel.split("/"))) for rel, entry in items]
    items = make_room(root, items, state_file)  # what is left to download
    wanted = {entry_content_id(e) for _, e in manifest.regular_files().items()}
    if cache is not None:
        cache.fit(manifest.total_bytes)
        cache.trim(keep=wanted)  # before anything is staged: the cache never takes the restore's room
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root)
    # The staging directory holds the checkpoint's own tree, so that whole directories
    # move into place with one rename each when the destination does not have them.
    stage = [os.path.join(staging, *rel.split("/")) for rel, _ in items]
    for d in sorted({os.path.dirname(p) for p in stage} | {os.path.join(staging, *parent_dirs(r)[-1:]) for r, _ in links}):
        os.makedirs(d, exist_ok=True)
    plan = {}
    if peers is not None:  # at once, even with nothing to fetch: this node's cache serves the others
        held = cache.ids() if cache is not None else set()
        plan = peers.plan(cache, [cid for cid in map(entry_content_id, (e for _, e in items)) if cid not in held])
    if cache is not None and items:
        items, stage = take_cached(cache, items, stage, dl)
    if plan:
        items, stage = peers.fetch(plan, items, stage, dl, settings.max_workers)
    pool = WorkerPool(settings.max_workers, dl, "ckpt-restore")
    fds: dict[int, int] = {}
    try:
        packs: dict[str, list[tuple[int, str, dict]]] = {}
        for i, (rel, entry) in enumerate(items):
            if "pack" in entry:
                packs.setdefault(entry["pack"], []).append((i, rel, entry))
            else:
                schedule_download(objects, settings, pool, i, rel, entry, stage[i], fds, dl)
        for pack, members in sorted(packs.items()):
            schedule_pack_restore(objects, pool, pack, members, stage, dl, settings.pack_size)
        finished = pool.wait(dl.end)
        if pool.error is not None:
            raise pool.error
        if not finished:
            dl.abort.set()
            raise SyncDeadlineError(
                f"restore from {objects.url} did not finish within its deadline of {dl.total:g}s "
                f"({human_size(manifest.total_bytes)} in {len(items)} file(s)); nothing was restored",
                [rel for rel, _ in items],
                manifest.total_bytes,
            )
        for fd in list(fds.values()):
            os.close(fd)
        fds.clear()
        for rel, target in links:
            os.symlink(target, os.path.join(staging, *rel.split("/")))
        move_tree(staging, str(root))
    finally:
        pool.close()
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(staging, ignore_errors=True)
    committed = after_restore(objects, notices, root, manifest, placed, links, state_file)
    if cache is not None:
        cache.enter_many(root, {rel: e for rel, e, _ in placed})
        cache.trim(keep=wanted)
        cache.save_records()
    log.info("restored %d files (%d bytes) from %s, %d from the node-local cache", len(items), manifest.total_bytes,
             objects.manifest_url, cache.taken if cache is not None else 0)
    return manifest, committed


def take_cached(cache: BlobCache, items: list[tuple[str, dict]], stage: list[str],
                dl: Deadline) -> tuple[list[tuple[str, dict]], list[str]]:
    """Put in staging what the node-local cache holds (each verified, a few at once); returns
    the items (and their staging paths) left to download."""
    held = cache.ids()
    todo = [k for k, (_, e) in enumerate(items) if entry_content_id(e) in held]
    if not todo:
        return items, stage
    got: set[int] = set()
    pool = WorkerPool(min(4, len(todo)), dl, "ckpt-cache")
    started = time.monotonic()

    def take(k: int) -> None:
        rel, entry = items[k]
        if cache.take(entry, stage[k], rel):
            got.add(k)

    try:
        pool.run_each(take, todo)
    finally:
        cache.seconds += time.monotonic() - started
    keep = [k for k in range(len(items)) if k not in got]
    return [items[k] for k in keep], [stage[k] for k in keep]


def make_room(root: Path, items: list[tuple[str, dict]], state_file: str | os.PathLike | None) -> list[tuple[str, dict]]:
    """Stage so that a disk that held the old version takes the new one: a file already holding
    its entry's content stays in place (not downloaded again); one holding other bytes is removed
    now, before its new bytes are written (never both on disk at once). Returns what is left to
    download. A failed restore leaves a removed name absent, never a partial file under it."""
    state = None
    if state_file is not None:
        try:
            state = LocalState(state_file, root)
        except CheckpointError:
            state = None
    left = []
    for rel, entry in items:
        dest = os.path.join(root, *rel.split("/"))
        try:
            st = os.lstat(dest)
        except FileNotFoundError:
            left.append((rel, entry))
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == entry["size"] and holds(state, rel, dest, st, entry):
            continue
        os.unlink(dest)  # the old version's bytes go before the new one's come
        left.append((rel, entry))
    return left


def holds(state: LocalState | None, rel: str, path: str, st: os.stat_result, entry: dict) -> bool:
    """Does the file at ``path`` hold exactly ``entry``'s content? (its cached digest, else one read)"""
    want_sha = not entry.get("blake3")
    f = LocalFile(rel, path, st.st_size, st.st_mtime_ns, st.st_ino)
    try:
        d = state.digest(f, want_sha256=want_sha) if state is not None else checkpoint_hash.hash_file(
            path, want_sha256=want_sha, expect=f, threads=4)[0]
    except (OSError, CheckpointError):
        return False
    if d.crc32c != entry["crc32c"]:
        return False
    return d.sha256 == entry["sha256"] if want_sha else d.blake3 == entry["blake3"]


def check_targets(root: str, manifest: Manifest) -> None:
    """Refuse, before downloading, a restore whose final names cannot be used as they are."""
    parents: set[str] = set()
    for rel in manifest.files:
        dest = os.path.join(root, *rel.split("/"))
        if os.path.isdir(dest) and not os.path.islink(dest):
            raise NodeDiskError(f"cannot restore {rel}: {dest} is a directory")
        parents.update(parent_dirs(rel))
    for parent in sorted(parents):
        path = os.path.join(root, *parent.split("/"))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):  # a file, or a symlink we would write through
            raise NodeDiskError(f"cannot restore into {parent}/: {path} is not a directory")


def after_restore(
    objects: BucketObjects,
    notices: Notices,
    root: Path,
    manifest: Manifest,
    placed: list[tuple[str, dict, Path]],
    links: list[tuple[str, str]],
    state_file: str | os.PathLike | None,
) -> dict[str, tuple[int, int]]:
    """relpath -> (size, mtime_ns) of what was placed; the hash cache told the placed files' digests."""
    committed: dict[str, tuple[int, int]] = {}
    state = None
    if state_file is not None:
        try:
            state = LocalState(state_file, root)
        except CheckpointError as exc:
            notices.say_once(f"state:{exc}", str(exc))
    for rel, entry, dest in placed:
        st = os.stat(dest, follow_symlinks=False)
        committed[rel] = (st.st_size, st.st_mtime_ns)
        if state is not None:
            state.seed(rel, st, entry)
    for rel, _ in links:
        st = os.stat(root.joinpath(*rel.split("/")), follow_symlinks=False)
        committed[rel] = (st.st_size, st.st_mtime_ns)
    if state is not None:
        state.add_known_blobs(objects.url, {entry_content_id(e) for e in manifest.regular_files().values()})
        try:
            state.save()
        except OSError as exc:
            notices.say_once(f"state:{exc}", f"could not save the checkpoint hash cache {state.path}: {exc.strerror or exc}")
    return committed


def schedule_download(
    objects: BucketObjects,
    settings: TransferSettings,
    pool: WorkerPool,
    i: int,
    rel: str,
    entry: dict,
    path: str,
    fds: dict[int, int],
    dl: Deadline,
) -> None:
    """Queue the download of one file into ``path``: whole, or as parallel ranged reads."""
    size = entry["size"]
    name = objects.blob_name(entry_content_id(entry))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    fds[i] = fd
    if size == 0:
        if entry["crc32c"] != EMPTY_CRC32C:
            raise RestoreError(objects.corrupt(rel, name, f"crc32c {EMPTY_CRC32C} != {entry['crc32c']} in the manifest"))
        return
    os.ftruncate(fd, size)
    spans = slices(size, settings)
    ranged = len(spans) > 1
    crcs: list[int | None] = [None] * len(spans)
    left = [len(spans)]
    lock = threading.Lock()
    tries = [0]

    problems: list[str] = []

    def fetch(k: int) -> None:
        off, length = spans[k]
        try:
            crc = objects.call(
                lambda t: objects.get_into(name, fd, off, length, ranged, size, dl, t), dl, f"downloading {rel}"
            )
        except SizeMismatch as exc:
            crc = None
            with lock:
                problems.append(str(exc))
        except Exception as exc:
            if is_not_found(exc):
                raise RestoreError(objects.missing(rel, name)) from None
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
            raise RestoreError(objects.corrupt(rel, name, problem))
        for k in range(len(spans)):
            pool.submit(fetch, k)

    for k in range(len(spans)):
        pool.submit(fetch, k)


def slices(size: int, settings: TransferSettings) -> list[tuple[int, int]]:
    """(offset, length) of each ranged read of a file of ``size`` bytes: one whole read below
    the threshold, else at most ``slices_per_file`` equal parts of at least ``range_size``
    (a block multiple, so each part streams in whole blocks)."""
    count = min(settings.slices_per_file, size // max(1, settings.range_size))
    if size < settings.ranged_download_threshold or count < 2:
        return [(0, size)]
    step = -(-size // count)
    step = -(-step // BLOCK) * BLOCK if step > BLOCK else step
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def move_tree(src: str, dst: str) -> None:
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
            move_tree(entry.path, target)
        else:
            os.replace(entry.path, target)
