#!/usr/bin/env python3
"""`slurmagent watch` on a real local Slurm cluster: XID line -> node DRAIN, idle CPU and RSS.

Usage: python bench/watch.py [--runs 5] [--idle-seconds 20]   (as root; --idle-seconds 60 for a full minute)

Starts its own LocalSlurmCluster (n1, n2) and one watcher for n1, then:
  * latency: appends a drain-class NVRM Xid line to n1's kernel log and times until
    `scontrol show node n1` shows DRAIN (median of --runs), beside the baseline of a plain
    `scontrol update state=drain` on n2 timed the same way (call + until DRAIN shows);
  * idle cost: the watcher's CPU (% of one core, utime+stime of all its threads from
    /proc/<pid>/stat over the window) and RSS (MiB) while nothing happens.
Targets: drain < 2 s, idle CPU < 1% of one core, RSS < 50 MiB. Leaves nothing running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

XID_LINE = "[ 8123.456789] NVRM: Xid (PCI:0000:48:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


def proc_cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def until_drained(cluster, node: str, timeout: float = 10.0) -> float:
    """Poll scontrol until `node` shows DRAIN; the perf_counter time it was first seen."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if "DRAIN" in cluster.node(node).get("State", ""):
            return time.perf_counter()
        time.sleep(0.005)
    raise SystemExit(f"{node} not drained within {timeout:g} s")


def until_resumed(cluster, node: str) -> None:
    cluster.resume(node)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if "DRAIN" not in cluster.node(node).get("State", ""):
            return
        time.sleep(0.05)
    raise SystemExit(f"{node} not resumed")


def stats(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):9.1f} {min(ms):9.1f} {max(ms):9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=0.25, help="the watcher's kernel-log poll period")
    args = ap.parse_args()

    from support import healthy_snapshot_dict  # the tests' replay snapshot (GPU 3 at 0000:48:00)
    from slurmagent.state.decisionlog import read_records
    from slurmagent.core.timefmt import parse_log_time
    from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available

    why = slurm_available()
    if why:
        raise SystemExit(f"bench/watch.py needs a local Slurm cluster: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="sa-bench-watch-", dir="/tmp"))
    tmp.chmod(0o755)
    cluster = LocalSlurmCluster(tmp / "slurm", nodes=["n1", "n2"])
    watcher: subprocess.Popen | None = None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for node in cluster.nodes:
            (tmp / "snap").mkdir(exist_ok=True)
            (tmp / "snap" / f"{node}.json").write_text(json.dumps(healthy_snapshot_dict(hostname=node)))
            (tmp / "kern").mkdir(exist_ok=True)
            (tmp / "kern" / f"{node}.log").write_text("[    0.000000] Linux version 6.1.0\n" * 2000)
        config = tmp / "config.toml"
        config.write_text(
            f'state_dir = "{tmp}/state/%n"\n[health]\nsnapshot = "{tmp}/snap/%n.json"\n'
            f'kernel_log = "{tmp}/kern/%n.log"\nexpected_gpus = 8\ntimeout_s = 5\n[hooks]\nsyslog = false\n'
        )
        cluster.start()

        sock.bind(str(tmp / "notify"))
        sock.settimeout(30)
        env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO),
                   NOTIFY_SOCKET=str(tmp / "notify"))
        t_start = time.perf_counter()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "slurmagent.entry", "watch", "--node", "n1", "--interval", str(args.interval)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(tmp / "watch.err", "wb"))
        while not sock.recv(4096).startswith(b"READY=1"):
            pass
        ready_s = time.perf_counter() - t_start

        kern = tmp / "kern" / "n1.log"
        log = tmp / "state" / "n1" / "hooks.log"
        latency, decided, acting, baseline_call, baseline_seen = [], [], [], [], []
        for i in range(args.runs):
            time.sleep(0.3 + 0.07 * i)  # land at different points of the poll period
            before = len(read_records(log))
            t0 = time.perf_counter()
            wall0 = time.time()
            with open(kern, "a") as fh:
                fh.write(XID_LINE)
            latency.append(until_drained(cluster, "n1") - t0)
            end = time.monotonic() + 5  # the line is written just after the drain call returns
            while not (records := [r for r in read_records(log)[before:] if r["event"] == "watch"]):
                if time.monotonic() > end:
                    raise SystemExit("no decision line logged")
                time.sleep(0.01)
            record = records[-1]
            decided.append(parse_log_time(record["time"]) - wall0)
            acting.append(record["duration_ms"] / 1000)
            until_resumed(cluster, "n1")

            t0 = time.perf_counter()
            cluster.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=bench baseline"])
            baseline_call.append(time.perf_counter() - t0)
            baseline_seen.append(until_drained(cluster, "n2") - t0)
            until_resumed(cluster, "n2")

        time.sleep(2.0)  # let the last decision settle
        pid = watcher.pid
        cpu0, w0 = proc_cpu_s(pid), time.perf_counter()
        time.sleep(args.idle_seconds)
        cpu1, w1 = proc_cpu_s(pid), time.perf_counter()
        idle_pct = (cpu1 - cpu0) / (w1 - w0) * 100
        rss, hwm = proc_status_mib(pid, "VmRSS"), proc_status_mib(pid, "VmHWM")
        threads = len(os.listdir(f"/proc/{pid}/task"))

        watcher.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        rc = watcher.wait(10)
        stop_s = time.perf_counter() - t0
        said = (tmp / "watch.err").read_text(errors="replace").strip().splitlines()

        print(f"slurmagent watch on a local Slurm {cluster.run(['scontrol', '--version']).stdout.strip()} cluster, "
              f"{os.cpu_count()} CPUs, poll interval {args.interval:g} s, {args.runs} runs")
        print(f"{'':<52}{'median ms':>9} {'min ms':>9} {'max ms':>9}")
        print(f"{'XID line written -> n1 shows DRAIN (scontrol poll)':<52}{stats(latency)}")
        print(f"{'XID line written -> decision logged (watcher)':<52}{stats(decided)}")
        print(f"{'  of which judge + drain (line read -> logged)':<52}{stats(acting)}")
        print(f"{'baseline: scontrol update state=drain (call)':<52}{stats(baseline_call)}")
        print(f"{'baseline: same call -> n2 shows DRAIN':<52}{stats(baseline_seen)}")
        print("per run, ms (line -> DRAIN): " + " ".join(f"{v * 1000:.0f}" for v in latency))
        print(f"target: drain < 2000 ms: {'ok' if max(latency) < 2 else 'MISSED'}")
        print(f"idle CPU over {w1 - w0:.1f} s: {idle_pct:.3f}% of one core (target < 1%: "
              f"{'ok' if idle_pct < 1 else 'MISSED'}); {threads} threads")
        print(f"RSS {rss:.1f} MiB, peak {hwm:.1f} MiB (target < 50 MiB: {'ok' if hwm < 50 else 'MISSED'})")
        print(f"start -> READY=1 {ready_s * 1000:.0f} ms; SIGTERM -> exit {rc} in {stop_s * 1000:.0f} ms")
        print("watcher said: " + " | ".join(line.removeprefix("slurmagent watch: ") for line in said))
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait(5)
        sock.close()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
