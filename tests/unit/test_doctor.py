"""`slurmagent doctor` without a fake server: one table of ok/FAIL/skip lines, each failure
with its fix, exit 1 on any failure.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_doctor_gcp.py.
"""

from __future__ import annotations

import time


def test_external_checks_are_bounded_even_when_one_never_returns():
    from slurmagent.commands.doctor import Result, run_bounded

    start = time.monotonic()
    rows = run_bounded([("fast", "fix-a", lambda: Result("fast", True, "fine")),
                        ("stuck", "fix-b", lambda: time.sleep(30)),
                        ("broken", "fix-c", lambda: 1 / 0)], deadline_s=0.5)
    assert time.monotonic() - start < 2
    assert [(r.name, r.ok, r.detail, r.fix) for r in rows] == [
        ("fast", True, "fine", ""), ("stuck", False, "no answer within 0.5 s", "fix-b"),
        ("broken", False, "ZeroDivisionError: division by zero", "fix-c")]
