#!/usr/bin/env python3
"""Restore memory: the peak RSS of a restore of an 8 GiB checkpoint, from each source.

    python bench/restore_rss.py [--size-gib 8] [--files 4]

Needs fake-gcs-server (`slurmagent.devtools.localgcs`, filesystem backend: the bytes stay on
disk, not in the emulator's memory) and about 3x SIZE of free disk under $TMPDIR. No Slurm: each
restore runs the node agent's data path (`GcsCheckpointStore.restore_manifest`, the peers'
`PeerSession`) in a process of its own, whose peak RSS (`getrusage`, `ru_maxrss`) it reports:

* sync: the checkpoint's first upload (its files enter the node-local cache);
* bucket: into an empty directory, the cache off, every byte from the emulator;
* cache: into an empty directory on the node whose cache holds every blob;
* peers: a new node (empty cache) takes every blob from an old node's cache over TCP, both
  checked in with a `Coordinator` as the batch step runs it; the old node serving is reported too.

The bound (DESIGN: the data path's memory does not grow with the checkpoint) is 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 1 << 20
REMOTE = "gs://bench/rss"
BOUND_MIB = 256


def write_files(ckpt: Path, size: int, files: int) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MiB)
    for i in range(files):
        path = ckpt / f"__{i}_0.distcp"
        left = size // files
        with open(path, "wb") as fh:
            while left:
                n = min(left, len(block))
                fh.write(os.urandom(16) + block[16:n] if n > 16 else block[:n])  # distinct blocks, cheap
                left -= n
        old = time.time() - 600  # outside the hash cache's racy window
        os.utime(path, (old, old))


def phase(name: str, work: Path, coord: str, token: str) -> dict:
    """One restore (or the sync, or the serving old node) in this process; its seconds."""
    from slurmagent.checkpoint.gcs.peers import PeerSession
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
    from slurmagent.checkpoint.local_cache import open_cache

    old, new = work / "old" / "ckpt", work / "new" / "ckpt"
    started = time.perf_counter()
    extra = ""
    if name == "sync":
        GcsCheckpointStore(REMOTE, local_cache_gib=64).sync(old, 0, work / "old" / "state.json")
    elif name == "bucket":
        GcsCheckpointStore(REMOTE, local_cache_gib=-1).restore(new)
    elif name == "cache":
        store = GcsCheckpointStore(REMOTE, local_cache_gib=64)
        store.restore(work / "old" / "restored")
        extra = f"{store.last_cache.taken} taken, {store.last_cache.hashed} hashed"
    elif name == "serve":
        session = PeerSession(coord, token, 0, "old")
        session.plan(open_cache(old, 64), [])
        session.finish(1800.0)
    elif name == "peers":
        store = GcsCheckpointStore(REMOTE, local_cache_gib=64)
        manifest, _ = store.read_manifest()
        session = PeerSession(coord, token, 1, "new")
        try:
            store.restore_manifest(new, manifest, peers=session)
        finally:
            session.finish(60.0)
        extra = f"{session.fetched} from the peer ({session.fetched_bytes} bytes) in {session.seconds:.2f} s"
        if session.messages:
            extra += "; " + "; ".join(session.messages)
    seconds = time.perf_counter() - started
    return {"phase": name, "seconds": seconds, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "extra": extra}


def child(name: str, work: Path, env: dict, coord: str = "", token: str = "", wait: bool = True):
    argv = [sys.executable, __file__, "--phase", name, "--work", str(work), "--coord", coord, "--token", token]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    return proc if not wait else finish(proc)


def finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=3600)
    if proc.returncode:
        raise SystemExit(f"bench phase failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=8.0, help="checkpoint size (default 8)")
    ap.add_argument("--files", type=int, default=4, help="files it is made of (default 4)")
    for hidden in ("--phase", "--work", "--coord", "--token"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.work), args.coord, args.token)), flush=True)
        return 0

    from slurmagent.checkpoint.gcs.peers import Coordinator, new_token
    from slurmagent.devtools.localgcs import GcsEmulator

    size = int(args.size_gib * 1024) * MiB
    work = Path(tempfile.mkdtemp(prefix="slurmagent-bench-rss-"))
    emu = GcsEmulator("fake-gcs-server", data_dir=work / "emulator", backend="filesystem")
    results = []
    try:
        emu.start()
        emu.create_bucket("bench")
        env = dict(os.environ, STORAGE_EMULATOR_HOST=emu.url, PYTHONPATH=str(REPO))
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        write_files(work / "old" / "ckpt", size, args.files)
        results.append(child("sync", work, env))
        results.append(child("bucket", work, env))
        shutil.rmtree(work / "new")
        results.append(child("cache", work, env))
        from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

        manifest, _ = GcsCheckpointStore(REMOTE).read_manifest()
        token = new_token()
        sizes = {f"blake3:{e['blake3']}": e["size"] for e in manifest.regular_files().values()}
        coord = Coordinator(2, token, sizes, "127.0.0.1", barrier_s=120.0)
        try:
            server = child("serve", work, env, coord.address, token, wait=False)
            results.append(child("peers", work, env, coord.address, token))
            results.append(finish(server))
        finally:
            coord.close()
    finally:
        emu.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"checkpoint: {size / (1 << 30):g} GiB in {args.files} file(s); peak RSS of each process (bound {BOUND_MIB} MiB)")
    for r in results:
        mib = r["rss_kib"] / 1024
        print(f"  {r['phase']:7s} {r['seconds']:7.2f} s   peak RSS {mib:6.1f} MiB   "
              f"{'under' if mib < BOUND_MIB else 'OVER'} the bound   {r['extra']}")
    return 0 if all(r["rss_kib"] / 1024 < BOUND_MIB for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
