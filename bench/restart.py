#!/usr/bin/env python3
"""Restart bench: a 4-node job requeued onto 3 of its old nodes and 1 new one.

    python bench/restart.py [--size-mib 1024]

Needs root and the Debian Slurm packages (it starts its own local cluster of 5 nodes with
node-local directories, and a Cloud Storage emulator on 127.0.0.1).

Job A (n1-n4): each rank writes its shard (SIZE/4 MiB) to its node's `--ckpt-dir`; one
multi-node sync commits them; one restore (`--restore-scope all`) makes every node hold the
whole checkpoint (SIZE MiB per node), so every node's cache holds it too; the job "trains" for
3 s and ends with the wrapper's final sync (nothing new to upload), which records the restored
files as verified in each cache (`local_cache`: a take then needs no re-hash; the 3 s keep the
files out of the racy window that rule shares with the hash cache).

n4 is drained; job B lands on n1-n3 (old) and n5 (new). The old nodes' checkpoint directories
are emptied first (a job-scoped directory, or one the job cleaned): what they hold is only in
their caches. Measured in job B, same run:

(1) the old nodes' restore from their caches (the slowest of the three, from the agents' lines)
    against a local copy of the same bytes on one old node (`shutil.copyfile` of every entry);
(2) the new node's fetch from its peers (the agents' line) against a raw TCP copy of the same
    bytes from an old node to the new one (one connection, sendfile out of the cache entries,
    recv_into a 4 MiB buffer written to one file; no hashing, where the peers hash every byte
    into its content id);
    each baseline is taken ROUNDS times before the restore, all printed, the fastest compared
    (the machine is shared: the conservative choice);
(3) the whole restore (the batch step's `AllocationStore.restore`: agent step, peers, cache)
    against the whole restore of the same checkpoint into empty directories with the cache and
    the peers off (everything from the bucket emulator), once before and once after it, the
    faster compared;
(4) the peak RSS of each node agent (its `getrusage` of the agent as a child of a small shim
    the launcher runs instead of python) and of the batch step, against the 256 MiB bound.
Also printed: the floor of any agent round here (an `srun --overlap` step of the same shape
whose python imports the store and exits).

On one host the five "nodes" share 2 CPUs, one disk and the loopback: read the figures as
the costs of the paths, not of separate VMs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 1024 * 1024
CACHE_GIB = 16
ROUNDS = 3  # of each baseline


def write_shard(ckpt: Path, mib: int) -> None:
    rank = int(os.environ.get("SLURM_NODEID", "0"))
    ckpt.mkdir(parents=True, exist_ok=True)
    path = ckpt / f"__{rank}_0.distcp"
    with open(path, "wb") as fh:
        left = mib * MiB
        while left:
            n = min(left, 8 * MiB)
            fh.write(os.urandom(n))
            left -= n
    old = time.time() - 600  # outside the hash cache's racy window
    os.utime(path, (old, old))


def cache_dir(ckpt: Path) -> Path:
    return ckpt.parent / f".slurmagent-cache-{os.geteuid()}"


def entries(ckpt: Path) -> list[str]:
    """The cache's entries (its records file left out)."""
    return sorted(n for n in os.listdir(cache_dir(ckpt)) if n.startswith("blake3-"))


def local_copy(ckpt: Path, out: Path) -> None:
    """One old node: copy every cache entry to a scratch directory, timed."""
    src = cache_dir(ckpt)
    scratch = ckpt.parent / "copy-scratch"
    scratch.mkdir(exist_ok=True)
    started = time.perf_counter()
    total = 0
    for name in entries(ckpt):
        shutil.copyfile(src / name, scratch / name)
        total += os.path.getsize(scratch / name)
    seconds = time.perf_counter() - started
    shutil.rmtree(scratch)
    out.write_text(json.dumps({"seconds": seconds, "bytes": total}))


def tcp_serve(ckpt: Path, port_file: Path) -> None:
    """An old node: send every cache entry, back to back, to the first client (sendfile)."""
    files = [cache_dir(ckpt) / n for n in entries(ckpt)]
    srv = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(srv.getsockname()[1]))
    conn, _ = srv.accept()
    with conn:
        conn.sendall(f"{sum(os.path.getsize(f) for f in files)}\n".encode())
        for f in files:
            with open(f, "rb") as fh:
                size, off = os.fstat(fh.fileno()).st_size, 0
                while off < size:
                    off += os.sendfile(conn.fileno(), fh.fileno(), off, size - off)


def tcp_fetch(ckpt: Path, port_file: Path, out: Path) -> None:
    """The new node: receive the bytes into one file (recv_into, written), timed."""
    for _ in range(600):
        if port_file.exists() and port_file.read_text():
            break
        time.sleep(0.05)
    dest = ckpt.parent / "tcp-scratch"
    started = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
    f = sock.makefile("rb")
    size = int(f.readline())
    buf = bytearray(4 * MiB)
    got = 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while got < size:
            n = f.readinto(memoryview(buf)[: min(len(buf), size - got)])
            if not n:
                raise SystemExit("tcp copy: connection closed early")
            os.write(fd, memoryview(buf)[:n])
            got += n
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    os.unlink(dest)
    out.write_text(json.dumps({"seconds": seconds, "bytes": got}))


RSS_SHIM = """import os, resource, subprocess, sys
rc = subprocess.call([sys.executable, *sys.argv[1:]])
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"bench-rss {os.environ.get('SLURMD_NODENAME', '?')}: {kib} KiB", file=sys.stderr, flush=True)
sys.exit(rc)
"""


def store_for(env, remote: str, ckpt: Path, cache_gib: int, err, shim: Path):
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
    from slurmagent.run.multinode import allocation_store

    gcs = GcsCheckpointStore(remote, local_cache_gib=cache_gib)
    store = allocation_store(env, gcs, ckpt_dir_option=str(ckpt), err=err,
                             agent_options=["--transfers", "16", "--cache-gib", str(cache_gib)])
    store.launcher.python = str(shim)  # the agent runs as its child: its peak RSS is said on stderr
    return store


def step_floor(env) -> float:
    """An agent round that does nothing: srun --overlap, one task per node, python importing the store."""
    n = int(env["SLURM_JOB_NUM_NODES"])
    started = time.perf_counter()
    subprocess.run(["srun", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--input=none",
                    sys.executable, "-P", "-c", "import slurmagent.checkpoint.gcs.store"], check=True, timeout=600,
                   env=env, cwd="/")
    return time.perf_counter() - started


def srun(*args: str, nodes: list[str] | None = None, wait: bool = True):
    where = ["-N1", "-n1", f"--nodelist={nodes[0]}"] if nodes else ["--ntasks-per-node=1"]
    argv = ["srun", "--overlap", *where, sys.executable, __file__, *args]
    return subprocess.run(argv, check=True, timeout=1800) if wait else subprocess.Popen(argv)


def job_a(args: argparse.Namespace) -> None:
    env, ckpt = dict(os.environ), Path(args.ckpt)
    srun("--write", str(ckpt), str(args.size_mib // 4))
    store = store_for(env, args.remote, ckpt, CACHE_GIB, sys.stderr, Path(args.result).parent / "rss-shim")
    state = Path(str(ckpt) + ".sync-state.json")
    store.sync(ckpt, 0, state, deadline_s=1800)
    store.restore(ckpt, deadline_s=1800, state_file=state)
    time.sleep(3.0)  # the job runs; then the wrapper's final sync
    store.sync(ckpt, 1, state, deadline_s=1800)


def job_b(args: argparse.Namespace) -> None:
    env, ckpt, work = dict(os.environ), Path(args.ckpt), Path(args.result).parent
    nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    old, new = [n for n in nodes if n != args.new], args.new
    srun("--wipe", str(ckpt))
    copies, tcps = [], []
    for k in range(ROUNDS):
        srun("--copy", str(ckpt), str(work / "copy.json"), nodes=[old[0]])
        copies.append(json.loads((work / "copy.json").read_text()))
        (work / "port").unlink(missing_ok=True)
        server = srun("--tcp-serve", str(ckpt), str(work / "port"), nodes=[old[1 + k % 2]], wait=False)
        srun("--tcp-fetch", str(ckpt), str(work / "port"), str(work / "tcp.json"), nodes=[new])
        server.wait(600)
        tcps.append(json.loads((work / "tcp.json").read_text()))
    floor = step_floor(env)

    def from_bucket(k: int) -> tuple[float, str]:
        """The same checkpoint into empty directories, cache and peers off: every byte from the bucket."""
        cold, said = Path(f"{ckpt}-cold{k}"), io.StringIO()
        bucket_only = store_for(env, args.remote, cold, -1, said, work / "rss-shim")
        bucket_only.read_manifest()
        started = time.perf_counter()
        bucket_only.restore(cold, deadline_s=1800, state_file=Path(f"{cold}.sync-state.json"))
        seconds = time.perf_counter() - started
        srun("--wipe", str(cold))
        return seconds, said.getvalue()

    before, cold_text = from_bucket(1)  # one before and one after the restore measured: the host is shared
    lines = io.StringIO()
    store = store_for(env, args.remote, ckpt, CACHE_GIB, lines, work / "rss-shim")
    store.read_manifest()  # as the wrapper does before it restores (run/identity): its client is up
    started = time.perf_counter()
    store.restore(ckpt, deadline_s=1800, state_file=Path(str(ckpt) + ".sync-state.json"))
    whole = time.perf_counter() - started
    after, _ = from_bucket(2)
    import resource

    batch_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text = lines.getvalue()
    sys.stderr.write(text)
    cache = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"node-agent (\S+): \d+ file\(s\) \(\d+ bytes\) from the node-local cache \S+ in ([\d.]+) s", text)}
    peers = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"node-agent (\S+): \d+ file\(s\) \(\d+ bytes\) from the job's other nodes in ([\d.]+) s", text)}
    rss = {m.group(1): int(m.group(2)) for m in re.finditer(r"bench-rss (\S+): (\d+) KiB", text)}
    Path(args.result).write_text(json.dumps({
        "floor_s": floor, "rss_kib": rss, "batch_rss_kib": batch_rss, "cold_lines": cold_text,
        "old": old, "new": new, "cache_s": cache, "peers_s": peers, "whole_s": whole, "bucket_s": [before, after],
        "copy": copies, "tcp": tcps,
        "lines": text}))


def rounds(runs: list[dict]) -> str:
    return " ".join(f"{x['seconds']:.2f}" for x in runs) + " s"


def fmt_rss(kib: dict[str, int]) -> str:
    return " ".join(f"{n}={v / 1024:.0f}" for n, v in sorted(kib.items())) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="checkpoint size each node restores (default 1024)")
    for hidden in ("--job", "--ckpt", "--remote", "--result", "--new", "--wipe"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--write", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--copy", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--tcp-serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--tcp-fetch", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write:
        return write_shard(Path(args.write[0]), int(args.write[1])) or 0
    if args.wipe:
        shutil.rmtree(args.wipe, ignore_errors=True)
        return 0
    if args.copy:
        return local_copy(Path(args.copy[0]), Path(args.copy[1])) or 0
    if args.tcp_serve:
        return tcp_serve(Path(args.tcp_serve[0]), Path(args.tcp_serve[1])) or 0
    if args.tcp_fetch:
        return tcp_fetch(*map(Path, args.tcp_fetch)) or 0
    if args.job:
        (job_a if args.job == "a" else job_b)(args)
        return 0
    if args.size_mib < 4:
        ap.error("--size-mib must be >= 4")

    from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available
    from slurmagent.devtools.localgcs import GcsEmulator

    why = slurm_available()
    if why:
        print(f"restart: cannot run here: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="slurmagent-bench-restart-"))
    work.chmod(0o755)
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    cluster = LocalSlurmCluster(work / "slurm", nodes=nodes, node_local=work)
    emu = GcsEmulator("fake-gcs-server", data_dir=work / "emulator", backend="memory")
    try:
        emu.start()
        emu.create_bucket("bench")
        cluster.start()
        env = dict(cluster.env, STORAGE_EMULATOR_HOST=emu.url, PYTHONPATH=str(REPO), SLURMAGENT_PEER_HOST="127.0.0.1")
        script = work / "job.py"
        script.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {__file__!r}\n"
                          f"runpy.run_path({__file__!r}, run_name='__main__')\n")
        script.chmod(0o755)
        shim = work / "rss-shim"  # the agents' python: reports their peak RSS
        shim.write_text(f"#!{sys.executable}\n" + RSS_SHIM)
        shim.chmod(0o755)
        ckpt = cluster.local_path / "ckpt"
        result = work / "result.json"
        for job, where in (("a", ["--nodelist=n1,n2,n3,n4"]), ("b", ["--exclude=n4"])):
            if job == "b":
                cluster.run(["scontrol", "update", "nodename=n4", "state=drain", "reason=bench: gone"])
            proc = subprocess.run(
                ["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "-o", str(work / f"{job}.out"), *where,
                 f"--job-name=bench-restart-{job}", str(script), "--job", job, "--size-mib", str(args.size_mib),
                 "--ckpt", str(ckpt), "--remote", "gs://bench/restart", "--result", str(result), "--new", "n5"],
                env=env, capture_output=True, text=True, timeout=30, check=True)
            jid = proc.stdout.strip().split(";")[0]
            end = cluster.wait_job(jid, ("COMPLETED", "FAILED", "CANCELLED"), 3600)
            if end["JobState"] != "COMPLETED":
                print((work / f"{job}.out").read_text(), file=sys.stderr)
                raise SystemExit(f"bench job {job} {end['JobState']}")
        r = json.loads(result.read_text())
    finally:
        cluster.stop()
        emu.stop()
        shutil.rmtree(work, ignore_errors=True)
    mib = args.size_mib
    print(r["lines"], end="")
    cache_s = max(r["cache_s"].values()) if r["cache_s"] else float("nan")
    peers_s = r["peers_s"].get(r["new"], float("nan"))
    print(f"checkpoint: {mib} MiB per node (4 shards of {mib // 4} MiB, every node restores all of it); "
          f"old nodes {', '.join(r['old'])}, new node {r['new']}")
    copy_s, tcp_s = (min(x["seconds"] for x in r[k]) for k in ("copy", "tcp"))
    print(f"(1) old nodes from their caches (slowest): {cache_s:7.2f} s   local copy of the same bytes: "
          f"{copy_s:7.2f} s   ratio {cache_s / copy_s:.2f}   (copies: {rounds(r['copy'])})")
    print(f"(2) new node from its peers:               {peers_s:7.2f} s   raw TCP copy of the same bytes:  "
          f"{tcp_s:7.2f} s   ratio {peers_s / tcp_s:.2f}   (TCP copies: {rounds(r['tcp'])})")
    bucket_s = min(r["bucket_s"])
    print(f"(3) whole restore (cache + peers):         {r['whole_s']:7.2f} s   all from the bucket emulator:   "
          f"{bucket_s:7.2f} s   speed-up {bucket_s / r['whole_s']:.1f}x   (from the bucket before and after: "
          f"{' '.join(f'{x:.2f}' for x in r['bucket_s'])} s)")
    print(f"    (the floor of any agent round here: {r['floor_s']:.2f} s, srun --overlap + python importing the store)")
    cold_rss = {m.group(1): int(m.group(2)) for m in re.finditer(r"bench-rss (\S+): (\d+) KiB", r["cold_lines"])}
    peak = max([*r["rss_kib"].values(), *cold_rss.values(), r["batch_rss_kib"]]) / 1024
    print(f"(4) peak RSS, MiB: agents (cache + peers) {fmt_rss(r['rss_kib'])}; agents (bucket) {fmt_rss(cold_rss)}; "
          f"batch step {r['batch_rss_kib'] / 1024:.0f}; highest {peak:.0f} (bound 256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
