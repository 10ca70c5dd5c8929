"""`make test`'s lanes: the verdicts (ci/lane_summary.py: a lane that ran no test never passes),
which lane runs what (the Makefile over stub lane scripts: host and forky the whole suite, trixie
tests/unit, each under a hang guard that keeps the three inside CI's limit) and the wrappers' SUITE (ci/trixie-lane.sh, ci/forky-lane.sh over ci/debian-lane.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
echo "lane {name}: ${{SUITE:-no suite}}: args [$*]" | tee "$LANE_SUMMARY_FILE"
exit {rc}
"""

# CI's hard limit is 90 minutes for the whole .ci/run; apt and the venvs take about 5 of them.
CI_LIMIT_S, SETUP_S = 90 * 60, 5 * 60


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
    assert SETUP_S + sum(guards.values()) < CI_LIMIT_S - 60, guards


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
