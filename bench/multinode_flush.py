#!/usr/bin/env python3
"""Multi-node flush bench: a 2-node job's flush against a single-node job's, same total bytes.

    python bench/multinode_flush.py [--size-mib 256] [--shards 8] [--repeat 2]

Needs root and the Debian Slurm packages (it starts its own local cluster, with node-local
directories, and a Cloud Storage emulator on 127.0.0.1). In the same run it measures, inside
real allocations:

(a) single node (the baseline): one node holds the whole checkpoint (SIZE MiB in SHARDS files);
    the time of `GcsCheckpointStore.sync` (hash + upload + manifest), as `slurmagent run`'s
    final sync does it;
(b) two nodes: each node holds half (SIZE/2 MiB in SHARDS/2 files, as two ranks would write
    them to their local disks); the time of the batch step's `AllocationStore.sync`: the
    agent step on both nodes (srun --overlap), both uploads, the merge and ONE commit.

Both start with a cold hash cache and an empty prefix. On one host the two "nodes" share the
CPUs, the disk and the emulator, so (b) shows the agent step's overhead, not the speed-up
that separate VMs with their own NICs would give; read the ratio as an upper bound of the
cost of covering every node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 1024 * 1024


def write_shards(ckpt: Path, mib: int, shards: int, first: int) -> None:
    """`shards` random files of `mib` MiB in all, under step_1/, named by global shard index."""
    folder = ckpt / "step_1"
    folder.mkdir(parents=True, exist_ok=True)
    each = mib * MiB // shards
    old = time.time() - 600  # outside the hash cache's racy window
    for i in range(shards):
        path = folder / f"__{first + i}_0.distcp"
        with open(path, "wb") as fh:
            left = each
            while left:
                n = min(left, 8 * MiB)
                fh.write(os.urandom(n))
                left -= n
        os.utime(path, (old, old))


def in_job(args: argparse.Namespace) -> int:
    """Runs as the batch step: lay out the checkpoint on every node, time one flush."""
    from slurmagent.run.multinode import allocation_store
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    env = dict(os.environ)
    nodes = int(env["SLURM_JOB_NUM_NODES"])
    ckpt = Path(args.ckpt)
    per_node = args.shards // nodes
    subprocess.run(["srun", "--ntasks-per-node=1", sys.executable, __file__, "--write", str(ckpt),
                    str(args.size_mib // nodes), str(per_node)], check=True, timeout=600)
    gcs = GcsCheckpointStore(args.remote)
    state = Path(str(ckpt) + ".sync-state.json")
    store = allocation_store(env, gcs, ckpt_dir_option=str(ckpt)) or gcs
    started = time.perf_counter()
    result = store.sync(ckpt, 0, state, deadline_s=1800)
    seconds = time.perf_counter() - started
    Path(args.result).write_text(json.dumps({"nodes": nodes, "seconds": seconds, "bytes": result.bytes_sent}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="total checkpoint size in MiB (default 256)")
    ap.add_argument("--shards", type=int, default=8, help="shard files in all (even; default 8)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each layout, best kept (default 2)")
    ap.add_argument("--in-job", choices=["yes"], help=argparse.SUPPRESS)
    ap.add_argument("--write", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--remote", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write:
        ckpt, mib, shards = Path(args.write[0]), int(args.write[1]), int(args.write[2])
        write_shards(ckpt, mib, shards, first=int(os.environ.get("SLURM_NODEID", "0")) * shards)
        return 0
    if args.in_job:
        return in_job(args)
    if args.size_mib <= 0 or args.shards < 2 or args.shards % 2:
        ap.error("--size-mib must be > 0 and --shards even and >= 2")

    from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available
    from slurmagent.devtools.localgcs import GcsEmulator

    why = slurm_available()
    if why:
        print(f"multinode_flush: cannot run here: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="slurmagent-bench-multinode-"))
    work.chmod(0o755)
    cluster = LocalSlurmCluster(work / "slurm", nodes=["n1", "n2"], node_local=work)
    emu = GcsEmulator("fake-gcs-server", data_dir=work / "emulator", backend="memory")
    best: dict[int, dict] = {}
    try:
        emu.start()
        emu.create_bucket("bench")
        cluster.start()
        env = dict(cluster.env, STORAGE_EMULATOR_HOST=emu.url, PYTHONPATH=str(REPO))
        script = work / "job.py"  # the batch step: this file, with this interpreter
        script.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {__file__!r}\n"
                          f"runpy.run_path({__file__!r}, run_name='__main__')\n")
        script.chmod(0o755)
        for run in range(args.repeat):
            for nodes in (1, 2):
                name = f"n{nodes}-r{run}"
                result = work / f"{name}.json"
                ckpt = cluster.local_path / name
                proc = subprocess.run(
                    ["sbatch", "--parsable", f"-N{nodes}", "--ntasks-per-node=1", "-o", str(work / f"{name}.out"),
                     f"--job-name=bench-{name}", str(script), "--in-job", "yes", "--size-mib", str(args.size_mib), "--shards", str(args.shards),
                     "--ckpt", str(ckpt), "--remote", f"gs://bench/{name}", "--result", str(result)],
                    env=env, capture_output=True, text=True, timeout=30, check=True)
                job = proc.stdout.strip().split(";")[0]
                end = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), 1800)
                if end["JobState"] != "COMPLETED":
                    print((work / f"{name}.out").read_text(), file=sys.stderr)
                    raise SystemExit(f"bench job {name} {end['JobState']}")
                figure = json.loads(result.read_text())
                if nodes not in best or figure["seconds"] < best[nodes]["seconds"]:
                    best[nodes] = figure
                for n in cluster.nodes:  # free the node-local space
                    shutil.rmtree(cluster.node_dir(n) / name, ignore_errors=True)
    finally:
        cluster.stop()
        emu.stop()
        shutil.rmtree(work, ignore_errors=True)
    mib = args.size_mib
    one, two = best[1], best[2]
    print(f"checkpoint: {mib} MiB in {args.shards} shards; best of {args.repeat} runs each")
    print(f"(a) single node, one sync:            {one['seconds']:7.2f} s  {mib / one['seconds']:7.1f} MiB/s")
    print(f"(b) two nodes, agents + one commit:   {two['seconds']:7.2f} s  {mib / two['seconds']:7.1f} MiB/s")
    print(f"    ratio (b)/(a): {two['seconds'] / one['seconds']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
