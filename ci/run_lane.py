#!/usr/bin/env python3
"""One lane's pytest, in two parts, metered: the suite on N xdist workers (each with its own
local Slurm cluster, emulator and temporary root), then the `serial` tests alone (the few that
assert a time bound only an idle machine keeps). Standard library only: it runs on the host and
in the Debian chroots.

    run_lane.py --python PY --workers N --out DIR [--guard-s S] [-- PYTEST ARGS...]

Writes DIR/parallel.xml and DIR/serial.xml (JUnit) and DIR/meter.json (wall seconds, CPU seconds
of the whole machine while the lane ran, peak memory in use), and prints the lane's skips, its
25 slowest tests and the meter. Exit status: the first failing part's; a part that selects
nothing is no failure, both selecting nothing is pytest's 5 (ci/lane_summary.py fails a lane
that ran no test).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS_COLLECTED = 5
SLOWEST = 25


def cpu_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat): the lane's daemons, jobs
    and torch ranks are no children of pytest, so its own rusage would miss them."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def mem_used_bytes() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class Meter:
    """Wall, machine CPU and peak memory in use over a block (a sample a second)."""

    def __init__(self) -> None:
        self.peak = mem_used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, mem_used_bytes())

    def __enter__(self) -> Meter:
        self.t0, self.cpu0 = time.monotonic(), cpu_busy_s()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall_s, self.cpu_s = time.monotonic() - self.t0, cpu_busy_s() - self.cpu0

    def as_dict(self) -> dict:
        return {"wall_s": round(self.wall_s), "cpu_s": round(self.cpu_s), "peak_mem_gib": round(self.peak / 2**30, 1)}


def run(argv: list[str], deadline: float | None) -> int:
    """pytest in its own process group (so the guard can end every worker and what they
    started); past the lane's guard, TERM then KILL the group. A Ctrl-C or TERM to this script
    reaches pytest as an interrupt first."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"run_lane: the lane's guard ran out: stopping pytest (pid {proc.pid})", flush=True)
        stop(proc, signal.SIGTERM)
        return 124
    except KeyboardInterrupt:
        stop(proc, signal.SIGINT)
        raise


def stop(proc: subprocess.Popen, first: signal.Signals) -> None:
    for sig, wait_s in ((first, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def interrupted(signum, frame):
    raise KeyboardInterrupt


def testcases(junit: Path) -> list[ET.Element]:
    try:
        return list(ET.parse(junit).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return []


def report(reports: list[Path]) -> None:
    cases = [c for r in reports for c in testcases(r)]
    skips = [(c, s) for c in cases for s in c.findall("skipped")]
    print(f"== {len(skips)} skipped" + (":" if skips else ""))
    for c, s in skips:
        print(f"  {c.get('classname')}::{c.get('name')}: {s.get('message', '')}")
    print(f"== {SLOWEST} slowest tests")
    for c in sorted(cases, key=lambda c: -float(c.get("time", 0)))[:SLOWEST]:
        print(f"  {float(c.get('time', 0)):7.1f} s  {c.get('classname')}::{c.get('name')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="the Python whose pytest runs the lane")
    ap.add_argument("--workers", type=int, required=True, help="xdist workers of the parallel part (0: in-process)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--guard-s", type=float, help="the whole lane's hang guard, both parts together")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, interrupted)
    # worksteal: an idle worker takes tests queued on a busy one, so the lane does not end on one
    # worker's backlog (plain `load` left one worker alone for its last 7 of 17 minutes).
    parts = {"parallel": ["-m", "not serial", *(["-n", str(a.workers), "--dist", "worksteal"] if a.workers else [])],
             "serial": ["-m", "serial"]}
    deadline = None if a.guard_s is None else time.monotonic() + a.guard_s
    rcs = []
    with Meter() as meter:
        for name, extra in parts.items():
            junit = a.out / f"{name}.xml"
            junit.unlink(missing_ok=True)
            print(f"== {name} part: pytest {' '.join(extra)}", flush=True)
            rc = run([a.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra,
                      *a.pytest_args], deadline)
            rcs.append(rc)
    report([a.out / f"{name}.xml" for name in parts])
    stats = meter.as_dict() | {"workers": a.workers}
    (a.out / "meter.json").write_text(json.dumps(stats) + "\n")
    print(f"== lane meter: wall {stats['wall_s']} s, CPU {stats['cpu_s']} s (the whole machine), "
          f"peak memory in use {stats['peak_mem_gib']} GiB, {a.workers} workers", flush=True)
    # A part that selects nothing is fine (a lane of the unit folder may hold no serial test);
    # a lane where neither part ran a test is not.
    if all(rc == NO_TESTS_COLLECTED for rc in rcs):
        return NO_TESTS_COLLECTED
    return next((rc for rc in rcs if rc not in (0, NO_TESTS_COLLECTED)), 0)


if __name__ == "__main__":
    sys.exit(main())
