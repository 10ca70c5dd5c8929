"""`make test`'s lane verdicts (ci/lane_summary.py): a lane that ran no test never passes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO

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
