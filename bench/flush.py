#!/usr/bin/env python3
"""Checkpoint flush bench: slurmagent's sync vs a plain sequential upload loop.

    python bench/flush.py [--size-mib 2048] [--shards 16] [--workers 8]
                          [--emulator fake-gcs-server] [--emulator-backend filesystem|memory]

Starts its own Cloud Storage emulator on 127.0.0.1 (tests/gcs_emulator.py),
writes a checkpoint of N random shards, then measures in the same run:

(a) a sequential ``blob.upload_from_filename`` loop (the baseline) against
    ``GcsCheckpointStore.sync`` (parallel files; its time includes hashing,
    since the hash cache starts cold): MiB/s of each and the ratio;
(b) after rewriting 1 shard of N, the bytes the next sync sends, against the
    shard size (target <= 1.05x; exit status 1 if missed).

(c), the time from SIGTERM to ``scontrol requeue`` with the sync up to date, needs a
Slurm cluster and has its own script: ``python bench/requeue_latency.py``.

The default (2048 MiB) takes about 70 s on a 2-core box and needs about
6.5 GiB of free space under $TMPDIR (shards + the emulator's two copies);
``--size-mib 512`` is a quick run.  Emulator throughput is CPU-bound on
small machines (the emulator shares the cores), so the ratio is a lower bound
of what parallel transfers give against real Cloud Storage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

MiB = 1024 * 1024


def write_shards(root: Path, shards: int, shard_bytes: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    old = time.time() - 600  # outside the hash cache's racy-timestamp window
    paths = []
    for i in range(shards):
        p = root / f"step-1000/shard-{i:03d}.pt"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as fh:
            left = shard_bytes
            while left:
                n = min(left, 8 * MiB)
                fh.write(os.urandom(n))
                left -= n
        os.utime(p, (old, old))
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=2048, help="checkpoint size in MiB (default 2048)")
    ap.add_argument("--shards", type=int, default=16, help="number of shard files (default 16)")
    ap.add_argument("--workers", type=int, default=8, help="parallel transfers of the sync (default 8)")
    ap.add_argument("--emulator", default="fake-gcs-server", choices=["fake-gcs-server", "gcp-storage-emulator"])
    ap.add_argument(
        "--emulator-backend",
        default="filesystem",
        choices=["filesystem", "memory"],
        help="fake-gcs-server storage backend (memory: less noise, ~4x the checkpoint size in RAM)",
    )
    ap.add_argument("--tmpdir", default=None, help="where to put shards and emulator data (default $TMPDIR)")
    args = ap.parse_args(argv)
    if args.size_mib <= 0 or args.shards <= 0:
        ap.error("--size-mib and --shards must be > 0")

    from slurmagent.devtools.localgcs import GcsEmulator

    work = Path(tempfile.mkdtemp(prefix="slurmagent-bench-", dir=args.tmpdir))
    shard_bytes = args.size_mib * MiB // args.shards
    total = shard_bytes * args.shards
    emu = GcsEmulator(args.emulator, data_dir=work / "emulator", backend=args.emulator_backend)
    try:
        emu.start()
        emu.create_bucket("bench")
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url  # this process only

        from slurmagent.gcp.storage import GcsCheckpointStore, make_client

        t = time.perf_counter()
        paths = write_shards(work / "ckpt", args.shards, shard_bytes)
        gen_s = time.perf_counter() - t

        # (a) baseline: one file after the other, the obvious loop
        bucket = make_client().bucket("bench")
        t = time.perf_counter()
        for p in paths:
            bucket.blob(f"baseline/{p.relative_to(work / 'ckpt').as_posix()}").upload_from_filename(str(p))
        base_s = time.perf_counter() - t

        store = GcsCheckpointStore("gs://bench/job", max_workers=args.workers)
        state = work / "state.json"
        t = time.perf_counter()
        r1 = store.sync(work / "ckpt", attempt=0, state_file=state, deadline_s=3600)
        sync_s = time.perf_counter() - t
        assert r1.bytes_sent == total, r1

        # (b) change 1 shard of N, sync again
        victim = paths[len(paths) // 2]
        with open(victim, "r+b") as fh:
            fh.seek(shard_bytes // 2)
            fh.write(os.urandom(min(MiB, shard_bytes)))
        t = time.perf_counter()
        r2 = store.sync(work / "ckpt", attempt=0, state_file=state, deadline_s=3600)
        inc_s = time.perf_counter() - t

        mib = total / MiB
        base_rate, sync_rate = mib / base_s, mib / sync_s
        ratio_b = r2.bytes_sent / shard_bytes
        ok_b = ratio_b <= 1.05
        cpus = os.cpu_count()
        backend = f" ({args.emulator_backend} backend)" if args.emulator == "fake-gcs-server" else ""
        print(
            f"checkpoint flush bench: {args.shards} shards x {shard_bytes / MiB:.1f} MiB = {mib:.0f} MiB, "
            f"{args.emulator}{backend} on 127.0.0.1, {cpus} CPUs, sync workers {args.workers} "
            f"(shards written in {gen_s:.1f}s)"
        )
        print("(a) full upload                                 seconds     MiB/s")
        print(f"    baseline: sequential upload_from_filename {base_s:8.2f}  {base_rate:8.1f}")
        print(f"    slurmagent sync (parallel, incl. hashing) {sync_s:8.2f}  {sync_rate:8.1f}")
        print(f"    sync / baseline                                      {sync_rate / base_rate:6.2f}x")
        xml = {True: "XML multipart", False: "resumable (no XML multipart API)", None: "resumable"}[
            store._xml_multipart
        ]
        print(f"    large-file uploads used: {xml}")
        print(f"(b) sync after changing 1 of {args.shards} shards")
        print(f"    shard size        {shard_bytes:>14,d} B")
        print(f"    bytes sent        {r2.bytes_sent:>14,d} B   = {ratio_b:.3f}x shard (target <= 1.05x) "
              f"{'OK' if ok_b else 'MISSED'}")  # fmt: skip
        print(f"    files sent {r2.files_sent}, unchanged {r2.skipped_unchanged}, {inc_s:.2f}s")
        return 0 if ok_b else 1
    finally:
        emu.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
