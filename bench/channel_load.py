#!/usr/bin/env python3
"""Root's job channel under load: 64 wrappers beside a hostile flood, and without it, in one run.

    python bench/channel_load.py [--wrappers 64] [--seconds 20] [--flooders 4] [--idle 40]   (as root)

Starts the real `ChannelServer` (actions/job_channel.py) on a Unix socket under a temporary
root, with Slurm answered in memory (a job per wrapper, RUNNING on this node: squeue's own cost
is left out, it is the same in both runs). Then, twice -- without and with the flood:

* `--wrappers` threads, each a wrapper of its own job, send their checkpoint metrics once a
  second (`ChannelMetrics`, as the wrapper does) for `--seconds`; every answer's time is kept;
* the flood (second run only): `--flooders` processes as `nobody` (a uid with no job) asking
  for drains as fast as they can, plus `--idle` connections from `nobody` that say nothing.

Prints, per run: requests answered, p50/p99/max answer time of the wrappers' requests, their
failures, the flood's request rate, and root's decision log growth (bytes, and per hour).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NOBODY = 65534


def slurm_runner(jobs: int):
    """`squeue -h -j JOB -o %i|%U|%T|%N` for jobs 1..jobs (uid 0, RUNNING on n1); others unknown."""
    def run(argv, timeout):
        if "-j" in argv:
            job = argv[argv.index("-j") + 1]
            if job.isdigit() and 1 <= int(job) <= jobs:
                return subprocess.CompletedProcess(argv, 0, f"{job}|0|RUNNING|n1\n", "")
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        return subprocess.CompletedProcess(argv, 0, "", "")
    return run


def flood(path: str, seconds: float, out_fd: int) -> None:  # pragma: no cover - a child as nobody
    from slurmagent.actions.channel_client import ask_root

    os.setgid(NOBODY)
    os.setuid(NOBODY)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            ask_root(path, {"op": "drain", "job": "999999", "node": "n1", "rule": "hang"}, deadline_s=0.2)
            n += 1
        except (OSError, ValueError):
            pass
    os.write(out_fd, str(n).encode())


def idle(path: str, count: int, seconds: float) -> None:  # pragma: no cover - a child as nobody
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # held until the server drops them, then again
        held = []
        for _ in range(count):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                held.append(s)
            except OSError:
                s.close()
        time.sleep(2.5)
        for s in held:
            s.close()


def one_run(args, with_flood: bool) -> dict:
    from slurmagent.actions.channel_client import ChannelMetrics
    from slurmagent.actions.job_channel import ChannelServer
    from slurmagent.slurm.commands import Slurm
    from slurmagent.state.config import parse
    from slurmagent.state.decisionlog import DecisionLog

    tmp = Path(tempfile.mkdtemp(prefix="channel-load-"))
    run_dir = Path(tempfile.mkdtemp(prefix="sa-run-", dir="/tmp"))
    run_dir.chmod(0o755)
    cfg = parse({"state_dir": str(tmp / "state" / "%n"), "hooks": {"syslog": False},
                 "watch": {"channel_socket": str(run_dir / "%n" / "channel.sock")}})
    log_path = tmp / "state" / "n1" / "hooks.log"
    log_path.parent.mkdir(parents=True)
    server = ChannelServer(cfg, "n1", Slurm(runner=slurm_runner(args.wrappers)), DecisionLog(log_path),
                           say=lambda line: None)
    server.start()
    path = str(server.path)
    children, flood_reads = [], []
    if with_flood:
        for _ in range(args.flooders):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    flood(path, args.seconds + 1, w)
                finally:
                    os._exit(0)
            os.close(w)
            children.append(pid)
            flood_reads.append(r)
        pid = os.fork()
        if pid == 0:
            try:
                idle(path, args.idle, args.seconds + 1)
            finally:
                os._exit(0)
        children.append(pid)
    times: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def wrapper(job: int) -> None:
        said: list[str] = []
        sink = ChannelMetrics(path, str(job), "n1", say=said.append)
        end = time.monotonic() + args.seconds
        tick = time.monotonic()
        while time.monotonic() < end:
            t = time.monotonic()
            sink._said = False
            sink.update(set_={("slurmagent_checkpoint_lag_seconds", ()): 3.0},
                        add={("slurmagent_bytes_synced_total", ()): 1000.0})
            dt = time.monotonic() - t
            with lock:
                times.append(dt)
                failures.extend(said)
            said.clear()
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))

    size0 = log_path.stat().st_size if log_path.exists() else 0
    started = time.monotonic()
    threads = [threading.Thread(target=wrapper, args=(j,)) for j in range(1, args.wrappers + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    flood_sent = 0
    for r in flood_reads:
        data = os.read(r, 64)
        os.close(r)
        flood_sent += int(data or b"0")
    for pid in children:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    server.stop()
    grown = (log_path.stat().st_size if log_path.exists() else 0) - size0
    counts = dict(server.counts)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    times.sort()
    return {"flood": with_flood, "answered": len(times), "p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))], "max_ms": 1000 * times[-1],
            "failures": len(failures), "flood_per_s": flood_sent / wall, "log_bytes": grown,
            "log_per_hour": grown * 3600 / wall, "server": counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrappers", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--flooders", type=int, default=4)
    ap.add_argument("--idle", type=int, default=40)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root: the flood asks as nobody", file=sys.stderr)
        return 2
    rows = [one_run(args, False), one_run(args, True)]
    print(f"{args.wrappers} wrappers sending metrics every second for {args.seconds:g} s; flood: {args.flooders} "
          f"processes of nobody asking for drains as fast as they can + {args.idle} idle connections")
    print(f"{'run':10} {'answered':>8} {'p50':>8} {'p99':>8} {'max':>8} {'failed':>6} {'flood/s':>8} "
          f"{'log':>8} {'log/hour':>9}")
    for r in rows:
        print(f"{'flood' if r['flood'] else 'no flood':10} {r['answered']:8d} {r['p50_ms']:6.1f}ms {r['p99_ms']:6.1f}ms "
              f"{r['max_ms']:6.0f}ms {r['failures']:6d} {r['flood_per_s']:8.0f} {r['log_bytes']:7d}B "
              f"{r['log_per_hour'] / 1024:7.1f}KiB")
    print(json.dumps([r["server"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
