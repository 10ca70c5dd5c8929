"""One file of a sync: hashed once, then uploaded unless the remote already has its content.

A small file (up to ``small_file_max``) is read once, hashed and uploaded from
memory (or packed, :mod:`slurmagent.checkpoint.gcs.packs`); a larger file is hashed
(BLAKE3 + CRC32C in one read, chunks in parallel, on a lane of
``hash_workers`` threads that hold the read buffers) and then streamed; from
``parallel_upload_threshold`` on, it goes up as parts in parallel which are
then composed (``compose``, 32 at a time) into the blob: a parallel composite
upload.  Every object's CRC32C, as the server computed it, is checked against
ours: a file that changed while it was read is tried again later (``busy``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid

from .. import hashing as checkpoint_hash
from ..hashing import FileDigest, open_nofollow
from ..errors import LocalChangedError, StorageUnavailableError
from ..scan import LocalFile
from .bucket import BucketObjects
from .packs import add_to_pack
from .sync_run import SyncRun
from .transfer import Deadline, FileRange, MiB, TransferCorrupt, is_not_found, is_precondition_failed, one_line

__all__ = ["check_stored", "digest", "part_bytes", "sync_file", "upload_claimed", "upload_parallel", "upload_whole"]

COMPOSE_MAX = 32  # source objects per compose request
COMPONENTS_MAX = 1024  # components of one composite object


def digest(run: SyncRun, f: LocalFile, want_sha256: bool, need_blake3: bool) -> tuple[FileDigest, bytes | None] | None:
    """``f``'s digest (cached, else read once), or None when it vanished, is busy or unreadable."""
    d = run.state.cached(f, want_sha256=want_sha256)
    if d is not None and (d.blake3 or not need_blake3):
        return d, None
    started = time.time()
    try:
        if f.size > run.settings.small_file_max:
            d, st, data = checkpoint_hash.hash_file(f.path, want_sha256=want_sha256, expect=f, threads=4)
        else:
            d, st, data = checkpoint_hash.hash_file(f.path, want_sha256=want_sha256, expect=f, keep_bytes=run.settings.small_file_max)
    except FileNotFoundError:
        with run.lock:
            run.done.add(f.relpath)  # deleted since the scan: not part of this checkpoint
        return None
    except LocalChangedError:
        run.file_busy(f)
        return None
    except OSError as exc:
        why = exc.strerror or str(exc)
        with run.lock:
            run.unreadable[f.relpath] = why
        run.notices.say_once(f"unreadable:{f.relpath}", f"not syncing {f.relpath}: unreadable ({why})")
        return None
    run.state.remember(f, d, st, started)
    return d, data


def sync_file(run: SyncRun, f: LocalFile, lane: str = "io") -> None:
    """Hash one file (or take its cached digest), then upload its content unless the remote has it.

    A large file not in the cache is hashed on the ``hash`` lane (few threads hold
    the read buffers), then handed back to the ``io`` lane for its upload.
    """
    run.dl.check()
    if lane == "io" and f.size > run.settings.small_file_max and run.state.cached(f) is None:
        run.pool.submit(sync_file, run, f, "hash", lane="hash")
        return
    legacy = run.current.files.get(f.relpath) if run.current is not None else None
    if not (legacy and legacy.get("sha256") and legacy.get("size") == f.size):
        legacy = None
    got = digest(run, f, want_sha256=legacy is not None, need_blake3=legacy is None)
    if got is None:
        return
    d, data = got
    if legacy is not None and d.sha256 == legacy["sha256"]:
        cid = f"sha256:{d.sha256}"  # unchanged since a manifest written before BLAKE3: keep its blob
    else:
        if not d.blake3:  # a cached sha256 only, and the content changed
            got = digest(run, f, want_sha256=False, need_blake3=True)
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
        run.pool.submit(upload_claimed, run, f, d, cid, data)
    else:
        upload_claimed(run, f, d, cid, data)


def upload_claimed(run: SyncRun, f: LocalFile, d: FileDigest, cid: str, data: bytes | None = None) -> None:
    """Put content ``cid`` (this sync's claim on it) on the remote: already there, packed, in parts or whole."""
    dl = run.dl
    if cid in run.in_manifest or (cid in run.known and run.objects.blob_state(run.objects.blob_name(cid), dl) == (True, 0)):
        with run.lock:
            run.confirmed.add(cid)
            run.done.add(f.relpath)
        return
    small = min(run.settings.pack_file_max, run.settings.small_file_max)
    if (data is not None or d.size <= small) and d.size <= run.settings.pack_file_max and cid.startswith("blake3:"):
        if data is None:  # digest from the cache (e.g. its pack was deleted): read it, to pack it
            data = read_again(run, f, cid)
            if data is None:
                return
        add_to_pack(run, f, d, cid, data)
        return
    try:
        threshold = run.settings.parallel_upload_threshold
        if data is None and threshold is not None and d.size >= threshold:
            upload_parallel(run, f, d, cid)  # its last part marks it done
            return
        uploaded = upload_whole(run, f, d, cid, data)
    except FileNotFoundError:
        with run.lock:
            run.included.pop(f.relpath, None)
            run.claimed.discard(cid)
            run.done.add(f.relpath)
        return
    except LocalChangedError:
        run.file_busy(f, cid)
        return
    with run.lock:
        run.confirmed.add(cid)
        if uploaded:
            run.uploaded[cid] = d.size
        run.done.add(f.relpath)


def read_again(run: SyncRun, f: LocalFile, cid: str) -> bytes | None:
    """The bytes of small file ``f`` whose content must be ``cid``; None (said busy, or done when
    gone) otherwise: a pack holds exactly the hashed bytes."""
    try:
        d, _, data = checkpoint_hash.hash_file(f.path, expect=f, keep_bytes=run.settings.small_file_max)
    except FileNotFoundError:
        with run.lock:
            run.included.pop(f.relpath, None)
            run.claimed.discard(cid)
            run.done.add(f.relpath)
        return None
    except (LocalChangedError, OSError):
        run.file_busy(f, cid)
        return None
    if d.content_id != cid or data is None:
        run.file_busy(f, cid)
        return None
    return data


def check_stored(objects: BucketObjects, obj: dict, name: str, f: LocalFile, d: FileDigest, dl: Deadline) -> None:
    """The object the server stored holds exactly the hashed bytes; else remove it."""
    if obj.get("crc32c") == d.crc32c and int(obj.get("size", -1)) == d.size:
        return
    objects.delete_quietly(name, dl, obj.get("generation"))
    raise LocalChangedError(
        f"checkpoint file {f.relpath} changed while it was being uploaded "
        "(write it under a temporary name, then rename); sync again later"
    )


def upload_whole(run: SyncRun, f: LocalFile, d: FileDigest, cid: str, data: bytes | None) -> bool:
    """One request: from memory (``data``) or streamed from the file.  False: it was already there."""
    objects, dl = run.objects, run.dl
    name = objects.blob_name(cid)

    over = 0  # the generation written over: 0 = none (create only); a marked object's, to unmark it

    def once(timeout: float) -> tuple[dict, str]:
        if d.size == 0:  # a multipart request: some servers drop an empty media upload
            blob = objects.bucket.blob(name)
            blob.upload_from_string(b"", if_generation_match=over, timeout=timeout, retry=None, checksum=None)
            return {"crc32c": blob.crc32c, "size": blob.size, "generation": blob.generation}, d.crc32c
        if data is not None:
            obj, sent_crc = objects.post_media(name, data, d.size, timeout, over), d.crc32c
        else:
            fd = open_nofollow(f.path)
            try:
                body = FileRange(fd, 0, d.size, dl)
                obj = objects.post_media(name, body, d.size, timeout, over)
            finally:
                os.close(fd)
            sent_crc = body.crc32c()
        if obj.get("crc32c") != sent_crc:  # damaged on the way: remove it, send again
            objects.delete_quietly(name, dl, obj.get("generation"))
            raise TransferCorrupt(f"{name}: the server stored other bytes than were sent")
        return obj, sent_crc

    try:
        obj, _ = objects.call(once, dl, f"uploading {f.relpath}")
    except Exception as exc:
        if not is_precondition_failed(exc):
            if is_not_found(exc):
                raise StorageUnavailableError(f"uploading {f.relpath} to {objects.url} failed: {one_line(exc)}") from None
            raise
        over = objects.marked_generation(name, dl) or 0  # content-addressed: there means done, unless marked
        if not over:
            return False
        try:
            obj, _ = objects.call(once, dl, f"uploading {f.relpath} over its marked copy")
        except Exception as again:
            if is_precondition_failed(again):
                return False  # written again meanwhile: by another sync, unmarked
            raise
    check_stored(objects, obj, name, f, d, dl)
    return True


# ------------------------------------------------------------ parallel composite upload


def part_bytes(size: int, part_size: int) -> int:
    """The size of one part of a parallel upload: ``part_size``, grown so a file has at most 1024 parts."""
    part = max(part_size, -(-size // COMPONENTS_MAX))
    return -(-part // MiB) * MiB


def upload_parallel(run: SyncRun, f: LocalFile, d: FileDigest, cid: str) -> None:
    """Parallel composite upload: parts as temporary objects (pool tasks), then compose into the blob.

    The task finishing the last part composes, checks the CRC32C and removes the parts.
    """
    dl = run.dl
    name = run.objects.blob_name(cid)
    part = part_bytes(d.size, run.settings.part_size)
    ranges = [(off, min(part, d.size - off)) for off in range(0, d.size, part)]
    tmp = run.objects.key(f"parts/{uuid.uuid4().hex}")
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
            while len(sources) > COMPOSE_MAX:  # a tree of composes, 32 sources each
                grouped = []
                for j in range(0, len(sources), COMPOSE_MAX):
                    inter = f"{tmp}/c{level}-{j // COMPOSE_MAX:05d}"
                    group = sources[j : j + COMPOSE_MAX]
                    run.objects.call(
                        lambda t, i=inter, g=group: run.objects.compose(i, g, t, None), dl, f"composing {f.relpath}"
                    )
                    grouped.append(inter)
                temporaries += grouped
                sources, level = grouped, level + 1
            try:
                obj = run.objects.call(lambda t: run.objects.compose(name, sources, t, 0), dl, f"composing {f.relpath}")
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
                obj = None  # the blob is already there
            if obj is not None:
                check_stored(run.objects, obj, name, f, d, dl)
            with run.lock:
                run.confirmed.add(cid)
                if obj is not None:
                    run.uploaded[cid] = d.size
                run.done.add(f.relpath)
        except LocalChangedError:
            run.file_busy(f, cid)
        finally:
            for t in temporaries:
                run.pool.submit(run.objects.delete_quietly, t, dl)

    def upload_part(i: int) -> None:
        if changed[0]:
            return
        off, length = ranges[i]

        def once(timeout: float) -> None:
            body = FileRange(fd, off, length, dl)
            obj = run.objects.post_media(parts[i], body, length, timeout, if_generation_match=None)
            if obj.get("crc32c") != body.crc32c():
                raise TransferCorrupt(f"part {i} of {f.relpath}: the server stored other bytes than were sent")

        try:
            run.objects.call(once, dl, f"uploading part {i + 1}/{len(ranges)} of {f.relpath}")
        except LocalChangedError:
            with lock:
                first = not changed[0]
                changed[0] = True
            close_fd()
            if first:
                run.file_busy(f, cid)
                for t in parts:
                    run.pool.submit(run.objects.delete_quietly, t, dl)
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
