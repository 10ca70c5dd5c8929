#!/usr/bin/env python3
"""One line per test lane, from pytest's exit status and its JUnit XML, and the lane's verdict.

A lane passes only when pytest exited 0 *and* ran at least one test: exit status 5 ("no
tests collected") or an empty report is a failure, never a silent success.

    lane_summary.py --lane trixie --versions "Slurm 24.11.5, Python 3.13.5" \
        --pytest-rc 0 --seconds 612 --junit parallel.xml [--junit serial.xml] [--meter meter.json]
        [--ran tests/unit] [--out FILE]

`--ran` names what the lane ran when it was not the whole suite (pytest's arguments):
    lane trixie (tests/unit): Slurm 24.11.5, Python 3.13.5: 1594 passed in 123 s -- ok
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS_COLLECTED = 5


KEYS = ("tests", "failures", "errors", "skipped")


def counts(*junits: Path) -> dict[str, int] | None:
    """Totals over every <testsuite> of every report (a lane's parallel and serial parts); None
    when no report is readable."""
    suites = []
    for junit in junits:
        try:
            root = ET.parse(junit).getroot()
        except (OSError, ET.ParseError):
            continue
        suites += [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        return None
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in KEYS}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def meter_text(path: Path | None) -> str:
    """`; CPU 901 s, peak memory 9.1 GiB, 4 workers` from ci/run_lane.py's meter.json."""
    try:
        m = json.loads(path.read_text()) if path else None
        return f"; CPU {m['cpu_s']} s, peak memory {m['peak_mem_gib']} GiB, {m['workers']} workers" if m else ""
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def verdict(rc: int, c: dict[str, int] | None) -> str | None:
    """None when the lane passed, else why not."""
    if rc == NO_TESTS_COLLECTED or (c is not None and c["tests"] == 0):
        return "no tests ran"
    if rc != 0:
        return f"pytest exit status {rc}"
    if c is None:
        return "pytest wrote no report"
    if c["failures"] or c["errors"]:
        return "failures in the report"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lane", required=True)
    ap.add_argument("--versions", required=True)
    ap.add_argument("--pytest-rc", type=int, required=True)
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--junit", type=Path, required=True, action="append", help="a JUnit report (repeatable)")
    ap.add_argument("--meter", type=Path, help="ci/run_lane.py's meter.json: the lane's CPU and peak memory")
    ap.add_argument("--ran", default="", help="pytest's arguments, when not the whole suite")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    c = counts(*a.junit)
    parts = []
    if c is not None:
        parts.append(f"{c['passed']} passed")
        parts += [f"{c[k]} {label}" for k, label in (("failures", "failed"), ("errors", "errors"),
                                                      ("skipped", "skipped")) if c[k]]
    result = ", ".join(parts) or "no report"
    why = verdict(a.pytest_rc, c)
    ran = " ".join(a.ran.split())
    line = f"lane {a.lane}{f' ({ran})' if ran else ''}: {a.versions}: {result} in {a.seconds} s{meter_text(a.meter)}"
    line += f" -- FAILED ({why})" if why else " -- ok"
    print(line)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
