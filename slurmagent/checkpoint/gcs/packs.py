"""Packs: small files travel back to back in one object, ``blobs/pack-<blake3 of the pack>``.

Per-object costs, not bytes, bound many-file checkpoints, so files up to
``pack_file_max`` go up together in packs of ``pack_size`` (one request for
thousands of files).  A manifest entry of a packed file names its pack and
offset.  A restore reads the runs of a pack its files occupy as ranged reads
and splits them into the files as they stream, checking each file's CRC32C.
"""

from __future__ import annotations

import base64
import os

from ..hashing import FileDigest, blake3_hex
from ..scan import LocalFile
from ..errors import RestoreError, StorageUnavailableError
from .bucket import BucketObjects
from .sync_run import SyncRun
from .transfer import BLOCK, Aborted, Deadline, MiB, TransferCorrupt, WorkerPool, is_not_found, is_precondition_failed

__all__ = ["add_to_pack", "schedule_pack_restore", "seal_last_pack", "seal_pack"]


# ------------------------------------------------------------------------- upload


def add_to_pack(run: SyncRun, f: LocalFile, d: FileDigest, cid: str, data: bytes) -> None:
    """Queue a small file's bytes into the pack being filled; a full pack goes up."""
    with run.lock:
        run.packing.append((f, d, cid, data))
        run.packing_bytes += d.size
        full = run.packing_bytes >= run.settings.pack_size
    if full:
        seal_pack(run)


def seal_pack(run: SyncRun) -> None:
    """Hand the pack being filled to the ``pack`` lane.  At most two sealed packs are in memory:
    the io lane waits here for a slot, never past the deadline."""
    if not run.pack_slots.acquire(timeout=max(0.0, run.dl.remaining())):
        raise Aborted()
    with run.lock:
        members, run.packing, run.packing_bytes = run.packing, [], 0
    if not members:
        run.pack_slots.release()
        return
    run.pool.submit(upload_pack, run, members, lane="pack")


def seal_last_pack(run: SyncRun) -> None:
    """Send the partly filled pack (the caller's wait then reports a deadline properly)."""
    try:
        seal_pack(run)
    except Aborted:
        pass


def upload_pack(run: SyncRun, members: list[tuple[LocalFile, FileDigest, str, bytes]]) -> None:
    """One object ``blobs/pack-<blake3>`` holding many small files back to back."""
    import google_crc32c

    try:
        data = b"".join(m[3] for m in members)
        members[:] = [(f, d, cid, b"") for f, d, cid, _ in members]  # one copy of the bytes in memory
        pack = blake3_hex(data)
        name = run.objects.blob_name(f"pack:{pack}")
        crc = base64.b64encode(google_crc32c.Checksum(data).digest()).decode("ascii")

        over = 0  # 0: create only; a marked pack's generation: written over, unmarked

        def once(timeout: float) -> None:
            obj = run.objects.post_media(name, data, len(data), timeout, over)
            if obj.get("crc32c") != crc or int(obj.get("size", -1)) != len(data):
                run.objects.delete_quietly(name, run.dl, obj.get("generation"))
                raise TransferCorrupt(f"{name}: the server stored other bytes than were sent")

        try:
            run.objects.call(once, run.dl, f"uploading {len(members)} small files")
        except Exception as exc:
            if not is_precondition_failed(exc):
                raise
            over = run.objects.marked_generation(name, run.dl) or 0  # there means done, unless marked
            if over:
                try:
                    run.objects.call(once, run.dl, f"uploading {len(members)} small files over their marked pack")
                except Exception as again:
                    if not is_precondition_failed(again):
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


# ------------------------------------------------------------------------ restore


def schedule_pack_restore(
    objects: BucketObjects, pool: WorkerPool, pack: str, members: list[tuple[int, str, dict]], stage: list[str],
    dl: Deadline, pack_size: int,
) -> None:
    """Queue the small files held by one pack: ranged reads of the runs they occupy, split as they stream."""
    name = objects.blob_name(f"pack:{pack}")
    members = sorted(members, key=lambda m: (m[2]["offset"], m[2]["size"]))
    runs: list[list[tuple[int, str, dict]]] = []
    run_end = -1
    for m in members:
        off, size = m[2]["offset"], m[2]["size"]
        if runs and off - run_end <= MiB and run_end - runs[-1][0][2]["offset"] < pack_size:
            runs[-1].append(m)
            run_end = max(run_end, off + size)
        else:
            runs.append([m])
            run_end = off + size
    for ms in runs:
        pool.submit(fetch_pack_run, objects, name, ms, stage, dl)


def fetch_pack_run(
    objects: BucketObjects, name: str, ms: list[tuple[int, str, dict]], stage: list[str], dl: Deadline
) -> None:
    """One ranged read of pack ``name`` split into the files ``ms`` as it streams; each file's size and
    CRC32C checked (a mismatch is read once more before the restore fails)."""
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
                resp = objects.http.request(
                    "GET", objects.object_url(name), params={"alt": "media"},
                    headers={"Range": f"bytes={start}-{end - 1}"}, stream=True, timeout=(timeout, timeout),
                )  # fmt: skip
                try:
                    objects.raise_for(resp)
                    if resp.status_code != 206:
                        raise StorageUnavailableError(f"{objects.url}: the server ignored a ranged read of {name}")
                    pos, first = start, 0
                    for chunk in resp.iter_content(BLOCK):
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
            got = objects.call(once, dl, f"downloading {len(ms)} small files")
        except Exception as exc:
            if is_not_found(exc):
                raise RestoreError(objects.missing(ms[0][1], name)) from None
            raise
        wrong = [(m, c, n) for m, (c, n) in zip(ms, got) if n != m[2]["size"] or c != m[2]["crc32c"]]
        if not wrong:
            return
        (_, bad, entry), crc, n = wrong[0]
        if n != entry["size"]:
            problem = f"size {n} != {entry['size']} in the manifest"
        else:
            problem = f"crc32c {crc} != {entry['crc32c']} in the manifest"
    raise RestoreError(objects.corrupt(bad, name, problem))
