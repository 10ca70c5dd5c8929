#!/usr/bin/env python3
"""(c) Time from SIGTERM to the job being requeued under `slurmagent run`, by checkpoint size.

    python bench/requeue_latency.py [--sizes 200,2000] [--runs 1] [--shard-mb 100]

On a real local Slurm cluster (slurmagent.devtools.localcluster) with a Cloud Storage emulator
(fake-gcs-server on the same machine). For each checkpoint size, a wrapped trainer holds a
checkpoint of that many MB (shards of --shard-mb), and `scancel --batch --signal=TERM` is
timed until the job shows Restarts=1, in two cases:

  current        the periodic sync has already committed every shard (the usual case)
  nothing synced no periodic sync ran: the flush uploads the whole checkpoint

Baselines measured in the same run: the same shard files uploaded by a plain
google-cloud-storage loop (`upload_from_filename`, one after the other), and a bare batch
script that traps TERM and calls `scontrol requeue` (what Slurm alone costs here).
Sizing rule it checks: flush time ~ unsynced bytes / upload throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRAINER = """
import json, os, sys, time
from slurmagent import trainer
shards, mb = int(sys.argv[1]), int(sys.argv[2])
d = trainer.ckpt_dir()
for i in range(shards):
    trainer.atomic_write(d / f"shard-{i:03d}.bin", os.urandom(mb * 1000 * 1000))
open(sys.argv[3], "w").write("ready")
with trainer.checkpoint_handler():
    step = 0
    while not trainer.checkpoint_requested():
        time.sleep(0.01); step += 1
    trainer.atomic_write(d / "state.json", json.dumps({"step": step}))
"""

BARE = """#!/bin/sh
trap 'scontrol requeue $SLURM_JOB_ID; exit 143' TERM
touch "$1"
while :; do sleep 0.05; done
"""


def wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def time_to_requeue(cluster, job_id: str, timeout: float = 1800) -> float:
    t0 = time.perf_counter()
    cluster.run(["scancel", "--batch", "--signal=TERM", job_id])
    while time.perf_counter() - t0 < timeout:
        if cluster.job(job_id).get("Restarts") == "1":
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise SystemExit(f"job {job_id} was not requeued within {timeout:g} s")


class Bench:
    def __init__(self, root: Path, cluster, emu, shard_mb: int):
        from google.cloud import storage

        self.root, self.cluster, self.emu, self.shard_mb = root, cluster, emu, shard_mb
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        self.bucket = storage.Client(project="bench").bucket("bench")
        (root / "trainer.py").write_text(TRAINER)
        (root / "bare.sh").write_text(BARE)
        self.n = 0

    def config(self, sync_interval: float) -> Path:
        path = self.root / f"config-{sync_interval:g}.toml"
        path.write_text(f'state_dir = "{self.root}/state"\n[checkpoint]\nremote = "gs://bench/jobs"\n'
                        f"sync_interval_s = {sync_interval}\ngrace_s = 1800.0\n")
        return path

    def wrapped(self, size_mb: int, synced: bool) -> tuple[float, float, Path, str]:
        """(seconds SIGTERM -> requeued, final sync seconds from the log, ckpt dir, job id)."""
        self.n += 1
        shards = max(1, size_mb // self.shard_mb)
        ready, out, ckpt = (self.root / f"{name}-{self.n}" for name in ("ready", "out", "ckpt"))
        env = dict(self.cluster.env, SLURMAGENT_CONFIG=str(self.config(1.0 if synced else 3600.0)),
                   STORAGE_EMULATOR_HOST=self.emu.url, PYTHONPATH=str(REPO))
        sub = subprocess.run(
            [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--",
             "--ckpt-dir", str(ckpt), "--", sys.executable, str(self.root / "trainer.py"), str(shards),
             str(self.shard_mb), str(ready)],
            env=env, capture_output=True, text=True, timeout=30, check=True)
        job = sub.stdout.strip().split(";")[0]
        wait(ready.exists, 900, "the trainer's checkpoint")
        if synced:
            wait(lambda: len(self.committed_files(job)) == shards, 1800, "the periodic sync of every shard")
        took = time_to_requeue(self.cluster, job)
        self.cluster.run(["scancel", job], check=False)
        wait(lambda: self.cluster.job(job).get("JobState") not in ("RUNNING", "COMPLETING"), 120, "job end")
        final = [line for line in out.read_text().splitlines() if "final sync:" in line]
        sync_s = float(final[-1].rsplit(" in ", 1)[1].split()[0]) if final else float("nan")
        return took, sync_s, ckpt, job

    def committed_files(self, job: str) -> dict:
        blob = self.bucket.blob(f"jobs/{job}/manifest.json")  # a new Blob: no pinned generation
        return json.loads(blob.download_as_bytes())["files"] if blob.exists() else {}

    def plain_upload(self, ckpt: Path) -> float:
        """The same shard files, uploaded one after the other by plain google-cloud-storage calls."""
        files = sorted(ckpt.glob("shard-*.bin"))
        t0 = time.perf_counter()
        for f in files:
            self.bucket.blob(f"plain/{self.n}/{f.name}").upload_from_filename(str(f), timeout=600)
        return time.perf_counter() - t0

    def bare(self) -> float:
        self.n += 1
        ready = self.root / f"bare-ready-{self.n}"
        job = self.cluster.sbatch("-o", "/dev/null", "--requeue", str(self.root / "bare.sh"), str(ready))
        wait(ready.exists, 60, "bare job start")
        took = time_to_requeue(self.cluster, job)
        self.cluster.run(["scancel", job], check=False)
        return took

    def cleanup(self, ckpt: Path, job: str) -> None:
        shutil.rmtree(ckpt, ignore_errors=True)
        for prefix in (f"jobs/{job}/", f"plain/{self.n}/"):
            for blob in list(self.bucket.list_blobs(prefix=prefix)):
                blob.delete()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200,2000", help="checkpoint sizes in MB, comma-separated")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--shard-mb", type=int, default=100)
    args = ap.parse_args()
    from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available
    from slurmagent.devtools.localgcs import GcsEmulator

    if slurm_available():
        raise SystemExit(f"needs a local Slurm cluster: {slurm_available()}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster on the way out
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="sa-requeue-"))
    root.chmod(0o755)
    cluster = LocalSlurmCluster(root / "slurm", nodes=["n1", "n2"], cred_expire=600)
    emu = GcsEmulator(data_dir=root / "gcs")
    rows: list[tuple[str, list[float], list[float]]] = []
    try:
        cluster.start()
        emu.start()
        emu.create_bucket("bench")
        b = Bench(root, cluster, emu, args.shard_mb)
        bare = [b.bare() for _ in range(args.runs)]
        for size in sizes:
            cur, cur_sync, none, none_sync, plain = [], [], [], [], []
            for _ in range(args.runs):
                took, sync_s, ckpt, job = b.wrapped(size, synced=True)
                cur.append(took)
                cur_sync.append(sync_s)
                b.cleanup(ckpt, job)
                took, sync_s, ckpt, job = b.wrapped(size, synced=False)
                none.append(took)
                none_sync.append(sync_s)
                plain.append(b.plain_upload(ckpt))
                b.cleanup(ckpt, job)
            rows += [(f"{size} MB, periodic sync current: SIGTERM -> requeued", cur, cur_sync),
                     (f"{size} MB, nothing synced: SIGTERM -> requeued", none, none_sync),
                     (f"{size} MB, plain google-cloud-storage upload loop", plain, [])]
        print(f"SIGTERM -> requeued under slurmagent run, fake-gcs-server on this machine, {args.runs} run(s) each")
        print(f"{'':<58}{'median s':>9}{'max s':>8}{'final sync s':>14}")
        print(f"{'bare batch script: trap TERM; scontrol requeue':<58}{statistics.median(bare):>9.2f}{max(bare):>8.2f}")
        for name, values, syncs in rows:
            sync = f"{statistics.median(syncs):>14.2f}" if syncs else ""
            print(f"{name:<58}{statistics.median(values):>9.2f}{max(values):>8.2f}{sync}")
        for size in sizes:
            none = next(v for n, v, _ in rows if n.startswith(f"{size} MB, nothing"))
            plain = next(v for n, v, _ in rows if n.startswith(f"{size} MB, plain"))
            print(f"{size} MB nothing synced / plain upload: {statistics.median(none) / statistics.median(plain):.2f}x "
                  f"({size / statistics.median(plain):.0f} MB/s plain)")
        return 0
    finally:
        cluster.stop()
        emu.cleanup()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
