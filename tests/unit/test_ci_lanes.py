"""`make test`'s lanes: the verdicts (ci/lane_summary.py: a lane that ran no test never passes),
which lane runs what (the Makefile over stub lane scripts: host and forky the whole suite, trixie
tests/unit, each under a hang guard that keeps the three inside CI's limit) and the wrappers' SUITE (ci/trixie-lane.sh, ci/forky-lane.sh over ci/debian-lane.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from support import REPO, need_tool

JUNIT = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{errors}" '
         'failures="{failures}" skipped="{skipped}" tests="{tests}" time="1.0"></testsuite></testsuites>')


def summary(tmp_path, rc: int, junit: str | None) -> tuple[int, str, str]:
    path = tmp_path / "junit.xml"
    if junit is not None:
        path.write_text(junit)
    out = tmp_path / "lane.summary"
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "lane_summary.py"), "--lane", "trixie",
                           "--versions", "Slurm 24.11.5, Python 3.13.5", "--pytest-rc", str(rc), "--seconds", "7",
                           "--junit", str(path), "--out", str(out)], capture_output=True, text=True, timeout=30)
    assert out.read_text() == proc.stdout
    return proc.returncode, proc.stdout.strip(), proc.stderr


def test_passing_lane_names_versions_and_counts(tmp_path):
    code, line, _ = summary(tmp_path, 0, JUNIT.format(tests=12, failures=0, errors=0, skipped=2))
    assert code == 0
    assert line == "lane trixie: Slurm 24.11.5, Python 3.13.5: 10 passed, 2 skipped in 7 s -- ok"


@pytest.mark.parametrize("rc, junit", [
    (5, JUNIT.format(tests=0, failures=0, errors=0, skipped=0)),  # pytest: no tests collected
    (5, None),
    (0, JUNIT.format(tests=0, failures=0, errors=0, skipped=0)),
])
def test_a_lane_that_ran_no_test_fails(tmp_path, rc, junit):
    code, line, _ = summary(tmp_path, rc, junit)
    assert code == 1 and line.endswith("-- FAILED (no tests ran)")


def test_failures_fail_the_lane_with_their_count(tmp_path):
    code, line, _ = summary(tmp_path, 1, JUNIT.format(tests=40, failures=1, errors=2, skipped=0))
    assert code == 1
    assert line == ("lane trixie: Slurm 24.11.5, Python 3.13.5: 37 passed, 1 failed, 2 errors in 7 s"
                    " -- FAILED (pytest exit status 1)")


def test_killed_pytest_without_report_fails(tmp_path):
    code, line, _ = summary(tmp_path, 124, None)
    assert code == 1 and line.endswith("no report in 7 s -- FAILED (pytest exit status 124)")


def test_a_lane_that_ran_part_of_the_suite_says_which(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.format(tests=3, failures=0, errors=0, skipped=0))
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "lane_summary.py"), "--lane", "trixie",
                           "--versions", "Slurm 24.11.5, Python 3.13.5", "--pytest-rc", "0", "--seconds", "7",
                           "--junit", str(path), "--ran", "tests/unit  -q"], capture_output=True, text=True, timeout=30)
    assert proc.stdout == "lane trixie (tests/unit -q): Slurm 24.11.5, Python 3.13.5: 3 passed in 7 s -- ok\n"


STUB_LANE = """#!/bin/sh
# what the real lane prints last, with what it was given (its hang guard on stderr)
echo "guard {name} ${{SUITE:-host}} ${{LANE_TEST_TIMEOUT_S:-${{HOST_TEST_TIMEOUT_S:-none}}}}" >&2
echo "workers {name} ${{SUITE:-host}} ${{LANE_WORKERS:-none}}" >&2
echo "lane {name}: ${{SUITE:-no suite}}: args [$*]" | tee "$LANE_SUMMARY_FILE"
exit {rc}
"""

# CI's hard limit is 90 minutes for the whole .ci/run; the lanes' guards keep it under 60 (issue 34),
# with set-up (apt, the venv, both chroots built on a new machine) about 6 of them.
CI_LIMIT_S, CI_BUDGET_S, SETUP_S = 90 * 60, 60 * 60, 6 * 60


def stub_repo(tmp_path, fail: str = "") -> Path:
    """The real Makefile and lane wrappers over a stub ci/debian-lane.sh and ci/host-lane.sh."""
    (tmp_path / "ci").mkdir()
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for name in ("trixie-lane.sh", "forky-lane.sh"):
        shutil.copy(REPO / "ci" / name, tmp_path / "ci" / name)
    for script, name in (("host-lane.sh", "host"), ("debian-lane.sh", "debian")):
        path = tmp_path / "ci" / script
        path.write_text(STUB_LANE.format(name=name, rc=1 if fail == name else 0))
        path.chmod(0o755)
    (tmp_path / "pyproject.toml").touch()
    os.utime(tmp_path / "pyproject.toml", (1, 1))  # deps and the venv count as made: the stubs need neither
    (tmp_path / ".deps.stamp").touch()
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()
    return tmp_path


def make_test(repo: Path) -> subprocess.CompletedProcess:
    make = need_tool("make", install="apt-get install make", chroot_lanes_lack=True)  # .ci/run installs it on the host
    return subprocess.run([make, "--no-print-directory", "test"],
                          cwd=repo, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "PYTEST_ARGS"))})


def test_make_test_runs_host_and_forky_whole_and_trixie_unit_only_then_one_line_each(tmp_path):
    proc = make_test(stub_repo(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-4:] == [
        "== test lanes",
        "lane host: no suite: args []",
        "lane debian: trixie: args [tests/unit]",
        "lane debian: forky: args []",
    ]


def test_every_lane_runs_under_a_hang_guard_and_the_three_fit_ci_with_its_setup(tmp_path):
    proc = make_test(stub_repo(tmp_path))
    guards = {}
    for line in proc.stderr.splitlines():
        if line.startswith("guard "):
            _, _, lane, seconds = line.split()
            guards[lane] = int(seconds)
    assert set(guards) == {"host", "trixie", "forky"}, proc.stderr
    assert all(s >= 300 for s in guards.values()), guards
    assert SETUP_S + sum(guards.values()) <= CI_BUDGET_S < CI_LIMIT_S, guards


def test_make_test_fails_when_one_lane_fails_and_still_runs_the_others(tmp_path):
    proc = make_test(stub_repo(tmp_path, fail="host"))
    assert proc.returncode != 0
    assert proc.stdout.splitlines()[-3:] == ["lane host: no suite: args []", "lane debian: trixie: args [tests/unit]",
                                             "lane debian: forky: args []"]


@pytest.mark.parametrize("suite", [None, "", "../trixie", "Forky"])
def test_the_debian_lane_refuses_a_missing_or_odd_suite_before_anything_else(suite):
    env = {k: v for k, v in os.environ.items() if k != "SUITE"}
    if suite is not None:
        env["SUITE"] = suite
    proc = subprocess.run([str(REPO / "ci" / "debian-lane.sh")], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "SUITE" in proc.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_lane_runs_on_workers_the_unit_lane_on_no_more_than_the_cores(tmp_path):
    proc = make_test(stub_repo(tmp_path))
    workers = {}
    for line in proc.stderr.splitlines():
        if line.startswith("workers "):
            _, _, lane, n = line.split()
            workers[lane] = int(n)
    assert set(workers) == {"host", "trixie", "forky"}, proc.stderr
    assert workers["host"] >= 2 and workers["forky"] >= 2 and 1 <= workers["trixie"] <= 2, workers


# --- ci/run_lane.py: the parallel part, the serial part, the budget of a stuck test

LANE_SUITE = {
    "test_lane.py": """
import os, time, pytest

@pytest.fixture
def never_returns():
    with open(__file__.replace("test_lane.py", "stuck.pid"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(3600)  # a fixture that never returns

def test_fine_1(): pass
def test_fine_2(): pass

def test_stuck(never_returns): pass

@pytest.mark.skip(reason="said why")
def test_skipped(): pass

@pytest.mark.serial
def test_alone(): time.sleep(0.2)
""",
    "pytest.ini": "[pytest]\nmarkers =\n    serial: alone\ntimeout = 5\n",
}


def run_lane(tmp_path, *args: str, guard_s: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    for name, text in LANE_SUITE.items():
        (suite / name).write_text(text)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "run_lane.py"), "--python", sys.executable,
                           "--workers", "2", "--out", str(tmp_path / "out"), "--guard-s", str(guard_s), "--",
                           *args], cwd=suite, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - t0


def test_a_stuck_test_fails_within_its_budget_with_its_stack_and_the_lane_goes_on(tmp_path):
    proc, wall = run_lane(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout" in out and "never_returns" in out and "time.sleep(3600)" in out, out  # its stack
    assert wall < 100, out  # the 5 s budget, not the hour the fixture sleeps nor the lane's guard
    cases = {c.get("name"): c for x in ("parallel.xml", "serial.xml")
             for c in ET.parse(tmp_path / "out" / x).getroot().iter("testcase")}
    assert set(cases) == {"test_fine_1", "test_fine_2", "test_stuck", "test_skipped", "test_alone"}
    assert cases["test_stuck"].find("error") is not None or cases["test_stuck"].find("failure") is not None
    assert all(not list(cases[n]) for n in ("test_fine_1", "test_fine_2", "test_alone")), out  # passed
    # the serial test ran in its own part, after the parallel one, alone
    assert out.index("== parallel part") < out.index("== serial part") < out.index("== 1 skipped")
    assert "test_lane::test_skipped: said why" in out
    assert "slowest tests" in out and "test_lane::test_stuck" in out.split("slowest tests", 1)[1]
    meter = json.loads((tmp_path / "out" / "meter.json").read_text())
    assert meter["workers"] == 2 and meter["wall_s"] >= 5 and meter["cpu_s"] >= 0 and meter["peak_mem_gib"] > 0


def test_the_lane_guard_ends_pytest_and_every_worker(tmp_path):
    proc, wall = run_lane(tmp_path, "-o", "timeout=0", guard_s=20)  # no per-test budget: only the guard is left
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "guard ran out" in proc.stdout
    assert wall < 100
    pids = [int(p) for p in (tmp_path / "suite" / "stuck.pid").read_text().split()]
    assert pids and not [p for p in pids if alive(p)], "the stuck worker outlived the guard"


def alive(pid: int) -> bool:
    """Running, not a zombie left for an init that reaps slowly (this sandbox's does)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_lane_where_neither_part_selects_a_test_says_so(tmp_path):
    proc, _ = run_lane(tmp_path, "-k", "nothing_matches_this")
    assert proc.returncode == 5, proc.stdout + proc.stderr
