#!/usr/bin/env python3
"""Checkpoint data path bench: slurmagent's flush and restore beside the floor, in one run.

    python bench/flush.py [--size-gib 1] [--big] [--big-one-file] [--small-files 20000] [--small-kib 4]
                          [--emulator fake-gcs-server|gcp-storage-emulator] [--only SHAPE ...]
                          [--no-library] [--repeat N] [--set KEY=VALUE ...]

Starts its own Cloud Storage emulator on 127.0.0.1 and, for each shape of
checkpoint (1 GiB as one file and as 16 shards, 20,000 small files; with
``--big`` also 8 GiB as 16 shards, with ``--big-one-file`` as one file),
measures against that same emulator, in the same run:

* raw: ONE plain HTTP request of the same bytes (``http.client``, the JSON
  API's ``uploadType=media`` / ``alt=media``), the floor of what the emulator
  accepts and serves;
* library: a plain ``google-cloud-storage`` loop (``upload_from_filename`` /
  ``download_to_filename``, one file after the other);
* local copy: the same files copied into a fresh directory on the same disk
  (``shutil.copytree``), the file system's own floor for a restore of many
  files (creating 20,000 files costs more than fetching their bytes);
* slurmagent: a cold flush (``GcsCheckpointStore.sync`` with an empty hash
  cache and nothing remote: hashing included) and a restore into an empty
  directory (verified), each in a child process that reports its peak RSS
  (VmHWM) beside the RSS it had before the transfer (interpreter + libraries).

Raw and slurmagent are measured in turn, ``--repeat`` rounds (default 3), and
the table compares the best of each: on this VM the same 1 GiB download swings
between 0.6 and 2.5 s with the state of the page cache (freshly freed pages are
cheap to write into, pages the host took back are not), so one run of each
says more about the order than about the code.  Every measurement starts
after ``os.sync()`` and after the previous one's files were removed.

Then the bytes an incremental sync sends after 1 of 16 shards changed, and
the hashing throughput of this CPU.  The emulator runs on the same cores as
the bench (fake-gcs-server writes each object under one global lock and
``compose`` copies bytes again; real Cloud Storage does neither), so the ratios
are what this machine shows, not Cloud Storage's.  Needs about 4x the largest
shape of free space under --tmpdir; 8 GiB shapes take minutes on 2 cores, and
fake-gcs-server holds each object in memory while it is written (up to twice
its size: 16 GiB of RAM for the 8 GiB single file).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1024 * 1024
GiB = 1024 * MiB
BUCKET = "bench"


# ------------------------------------------------------------------ child process


def child_main(argv: list[str]) -> int:
    """``flush.py --child sync|restore URL DIR STATE [k=v ...]``: one transfer, JSON result on stdout."""
    op, url, directory, state = argv[:4]
    tunables = dict(kv.split("=", 1) for kv in argv[4:])
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    store = GcsCheckpointStore(url, max_workers=int(tunables.pop("max_workers", 16)), warn=lambda m: None)
    for key, value in tunables.items():
        setattr(store, key, int(value))
    store.client  # noqa: B018 - the client is made before the clock starts, as in a running wrapper
    import google.cloud.storage  # noqa: F401 - loaded before the peak-RSS baseline
    import blake3  # noqa: F401 - likewise

    rss_before = _vm_hwm_kib()
    t0 = time.perf_counter()
    if op == "sync":
        r = store.sync(directory, 0, state, deadline_s=7200)
        out = {"bytes_sent": r.bytes_sent, "files_sent": r.files_sent}
    else:
        m = store.restore(directory, deadline_s=7200)
        out = {"files": len(m.files), "bytes": m.total_bytes}
    out.update(seconds=time.perf_counter() - t0, rss_before_kib=rss_before, rss_peak_kib=_vm_hwm_kib())
    print(json.dumps(out))
    return 0


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def settle() -> None:
    """Start every measurement with no dirty pages pending: otherwise the one that runs
    after a few GiB were written pays for their writeback (the kernel throttles writers
    at vm.dirty_ratio), and the order of the measurements decides the ratios."""
    os.sync()


def run_child(op: str, url: str, directory: Path, state: Path, env: dict, tunables: dict) -> dict:
    settle()
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", op, url, str(directory), str(state)]
    argv += [f"{k}={v}" for k, v in tunables.items()]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"{op} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ floors


class _Concat:
    """A request body: several files one after the other, read in 1 MiB blocks."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = list(paths)
        self.fh = None

    def read(self, n: int = -1) -> bytes:
        while True:
            if self.fh is None:
                if not self.paths:
                    return b""
                self.fh = open(self.paths.pop(0), "rb", buffering=0)
            data = self.fh.read(min(n if n and n > 0 else MiB, MiB))
            if data:
                return data
            self.fh.close()
            self.fh = None


def raw_upload(host: str, port: int, name: str, paths: list[Path]) -> float:
    size = sum(p.stat().st_size for p in paths)
    settle()
    conn = http.client.HTTPConnection(host, port, timeout=3600, blocksize=MiB)
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    t0 = time.perf_counter()
    conn.request(
        "POST", f"/upload/storage/v1/b/{BUCKET}/o?{query}", body=_Concat(paths),
        headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    resp = conn.getresponse()
    body = resp.read()
    elapsed = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"raw upload failed: {resp.status} {body[:200]!r}")
    return elapsed


def raw_download(host: str, port: int, name: str, dest: Path) -> float:
    settle()
    conn = http.client.HTTPConnection(host, port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("GET", f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media")
    resp = conn.getresponse()
    with open(dest, "wb", buffering=0) as out:
        while True:
            data = resp.read(MiB)
            if not data:
                break
            out.write(data)
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


# ------------------------------------------------------------------------ shapes


def write_files(root: Path, count: int, size: int) -> list[Path]:
    old = time.time() - 600  # outside the hash cache's racy-timestamp window
    paths = []
    block = os.urandom(min(size, 8 * MiB)) if count > 64 else None
    for i in range(count):
        p = root / (f"d{i // 1000:03d}/f{i:05d}.bin" if count > 64 else f"step-1000/shard-{i:03d}.pt")
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as fh:
            if block is not None:  # many small files: random prefix keeps every file distinct
                fh.write(os.urandom(16) + block[16:size])
            else:
                left = size
                while left:
                    n = min(left, 8 * MiB)
                    fh.write(os.urandom(n))
                    left -= n
        os.utime(p, (old, old))
        paths.append(p)
    return paths


def delete_prefix(client, prefix: str) -> None:
    """Free the emulator's disk between shapes."""
    for b in list(client.list_blobs(BUCKET, prefix=prefix)):
        b.delete()


def hashing_rates(size: int = 256 * MiB) -> list[tuple[str, float]]:
    import blake3
    import google_crc32c

    data = os.urandom(size)
    out = []
    for label, fn in (
        ("BLAKE3, 1 thread", lambda: blake3.blake3(data).digest()),
        (f"BLAKE3, {os.cpu_count()} threads", lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()),
        ("SHA-256 (the old content id)", lambda: hashlib.sha256(data).digest()),
        ("CRC32C (google-crc32c)", lambda: google_crc32c.value(data)),
    ):
        best = min(_timed(fn) for _ in range(3))
        out.append((label, size / best / 1e9))
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fmt_s(seconds: float, size: int) -> str:
    return f"{seconds:8.2f} s {size / MiB / seconds:7.0f} MiB/s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="size of the one-file and 16-shard shapes (default 1)")
    ap.add_argument("--big", action="store_true", help="also 8 GiB as 16 shards (minutes)")
    ap.add_argument("--big-one-file", action="store_true",
                    help="also 8 GiB as one file (the emulator needs up to 16 GiB of RAM for it)")  # fmt: skip
    ap.add_argument("--small-files", type=int, default=20000, help="files of the many-small-files shape (default 20000)")
    ap.add_argument("--small-kib", type=int, default=4, help="size of each small file in KiB (default 4)")
    ap.add_argument("--emulator", default="fake-gcs-server", choices=["fake-gcs-server", "gcp-storage-emulator"])
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run (one-file, shards, small, big-one-file, big-shards)")
    ap.add_argument("--no-library", action="store_true", help="skip the google-cloud-storage loop (it is slow)")
    ap.add_argument("--raw-max-gib", type=float, default=2.0,
                    help="above this size the raw floor is one request per file, not one for all "
                         "(fake-gcs-server holds a request's object in RAM twice over)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of raw and slurmagent, taken in turn; the table shows the best of each (default 3: "
                         "on this VM one run of the same download swings 0.6-2.5 s with the page cache's state)")  # fmt: skip
    ap.add_argument("--tmpdir", default=None, help="where to put files and emulator data (default $TMPDIR)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="store tunables, e.g. max_workers=8 part_size=67108864")  # fmt: skip
    args = ap.parse_args(argv)
    tunables = dict(kv.split("=", 1) for kv in args.set)

    from slurmagent.devtools.localgcs import GcsEmulator

    size = int(args.size_gib * GiB)
    shapes = [("one-file", 1, size), ("shards", 16, size // 16), ("small", args.small_files, args.small_kib * 1024)]
    if args.big:
        shapes += [("big-shards", 16, GiB // 2)]
    if args.big_one_file:
        shapes += [("big-one-file", 1, 8 * GiB)]
    if args.only:
        shapes = [s for s in shapes if s[0] in args.only]

    work = Path(tempfile.mkdtemp(prefix="slurmagent-bench-", dir=args.tmpdir))
    emu = GcsEmulator(args.emulator, data_dir=work / "emulator")
    rows: list[tuple[str, str, int, list[float], float | None, list[dict], float]] = []
    try:
        emu.start()
        emu.create_bucket(BUCKET)
        env = {**os.environ, "STORAGE_EMULATOR_HOST": emu.url, "PYTHONPATH": str(REPO)}
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        from slurmagent.checkpoint.gcs.bucket import make_client

        client = make_client()
        bucket = client.bucket(BUCKET)
        print(
            f"checkpoint data path bench: {args.emulator} on 127.0.0.1, {os.cpu_count()} CPUs, "
            f"slurmagent tunables {tunables or 'default'}",
            flush=True,
        )
        for name, count, each in shapes:
            ckpt = work / name
            paths = write_files(ckpt, count, each)
            total = count * each
            label = f"{count} x {each / MiB:.3g} MiB" if each >= MiB else f"{count} x {each // 1024} KiB"
            print(f"-- {name}: {label} = {total / MiB:.0f} MiB", flush=True)
            per_file = total > args.raw_max_gib * GiB and count > 1
            how = " (1 request per file)" if per_file else ""

            def raw_up_once() -> float:
                if per_file:  # one request per file, one after the other
                    return sum(raw_upload(emu.host, emu.port, f"raw/{name}/{i}", [p]) for i, p in enumerate(paths))
                return raw_upload(emu.host, emu.port, f"raw/{name}", paths)

            # raw and slurmagent in turn, round after round: each round's flush is cold
            # (its own prefix, an empty hash cache); the best of each is compared
            raw_ups, flushes = [], []
            for k in range(args.repeat):
                raw_ups.append(raw_up_once())
                if k and count <= 64:  # free the previous round's big objects
                    delete_prefix(client, f"sa/{name}/")
                url = f"gs://{BUCKET}/sa/{name}/r{k}"
                state = work / f"{name}.state"
                state.unlink(missing_ok=True)
                flushes.append(run_child("sync", url, ckpt, state, env, tunables))
                assert flushes[-1]["bytes_sent"] == total, flushes[-1]
                print(f"   round {k + 1}: raw upload {fmt_s(raw_ups[-1], total)}{how}, "
                      f"slurmagent flush {fmt_s(flushes[-1]['seconds'], total)}", flush=True)  # fmt: skip
            lib_up = None
            if not args.no_library:
                settle()
                t0 = time.perf_counter()
                for p in paths:
                    bucket.blob(f"lib/{name}/{p.relative_to(ckpt).as_posix()}").upload_from_filename(str(p))
                lib_up = time.perf_counter() - t0
                print(f"   library upload    {fmt_s(lib_up, total)}", flush=True)
            settle()
            t0 = time.perf_counter()
            shutil.copytree(ckpt, work / "local-copy")
            local_copy = time.perf_counter() - t0
            shutil.rmtree(work / "local-copy")
            print(f"   local copy        {fmt_s(local_copy, total)}", flush=True)
            rows.append(("flush", name + ("*" if per_file else ""), total, raw_ups, lib_up, flushes, local_copy))

            # each download's files are removed as soon as it is timed, so that every
            # measurement starts from the same state (the previous one's files just removed)
            raw_downs, restores = [], []
            raw_dir, restored = work / "raw-download", work / "restored"
            for k in range(args.repeat):
                raw_dir.mkdir()
                if per_file:
                    raw_downs.append(sum(raw_download(emu.host, emu.port, f"raw/{name}/{i}", raw_dir / str(i)) for i in range(count)))
                else:
                    raw_downs.append(raw_download(emu.host, emu.port, f"raw/{name}", raw_dir / "all"))
                shutil.rmtree(raw_dir)
                restores.append(run_child("restore", url, restored, work / "unused", env, tunables))
                assert restores[-1]["bytes"] == total, restores[-1]
                shutil.rmtree(restored)
                print(f"   round {k + 1}: raw download {fmt_s(raw_downs[-1], total)}, "
                      f"slurmagent restore {fmt_s(restores[-1]['seconds'], total)}", flush=True)  # fmt: skip
            lib_down = None
            if not args.no_library:
                dest = work / "lib-download"
                settle()
                t0 = time.perf_counter()
                for p in paths:
                    rel = p.relative_to(ckpt).as_posix()
                    out = dest / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    bucket.blob(f"lib/{name}/{rel}").download_to_filename(str(out))
                lib_down = time.perf_counter() - t0
                shutil.rmtree(dest)
                print(f"   library download  {fmt_s(lib_down, total)}", flush=True)
            rows.append(("restore", name + ("*" if per_file else ""), total, raw_downs, lib_down, restores, local_copy))

            if name == "shards":  # incremental: 1 of 16 shards changes
                victim = paths[len(paths) // 2]
                with open(victim, "r+b") as fh:
                    fh.seek(each // 2)
                    fh.write(os.urandom(min(MiB, each)))
                r = run_child("sync", url, ckpt, work / f"{name}.state", env, tunables)
                inc = (r["bytes_sent"], each, r["seconds"])
            shutil.rmtree(ckpt)
            if count <= 64:  # big objects: free the space (20,000 deletes would take longer than the bench)
                for prefix in (f"raw/{name}", f"lib/{name}/", f"sa/{name}/"):
                    delete_prefix(client, prefix)

        print()
        print("| operation | shape | bytes | raw: 1 request | local copy | google-cloud-storage loop | slurmagent | vs raw | "
              "vs max(raw, local copy) | vs library | peak RSS (before) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for op, name, total, raws, lib, results, local in rows:
            raw = min(raws)
            ours = min(x["seconds"] for x in results)
            r = {k: max(x[k] for x in results) for k in ("rss_peak_kib", "rss_before_kib")}
            lib_s = f"{lib:.2f} s" if lib else "-"
            vs_lib = f"{ours / lib:.2f}x" if lib else "-"
            print(
                f"| {op} | {name} | {total / MiB:.0f} MiB | {raw:.2f} s | {local:.2f} s | {lib_s} | {ours:.2f} s | "
                f"{ours / raw:.2f}x | {ours / max(raw, local):.2f}x | {vs_lib} | {r['rss_peak_kib'] / 1024:.0f} MiB ({r['rss_before_kib'] / 1024:.0f}) |"
            )
        print(f"raw and slurmagent: the best of {args.repeat} rounds, taken in turn (the rounds are listed above); "
              "peak RSS: the highest of the rounds")  # fmt: skip
        print("local copy: shutil.copytree of the same files on the same disk (what creating the files costs)")
        if any(n.endswith("*") for _, n, *_ in rows):
            print("* raw: one request per file, one after the other (see --raw-max-gib)")
        if any(n == "shards" for _, n, *_ in rows):
            sent, shard, secs = inc
            print(f"\nincremental sync after changing 1 of 16 shards: {sent:,} B sent = {sent / shard:.3f}x the shard, {secs:.2f} s")
        print("\nhashing on this CPU (256 MiB in memory, best of 3):")
        for label, rate in hashing_rates():
            print(f"  {label:32s} {rate:6.2f} GB/s")
        return 0
    finally:
        emu.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
