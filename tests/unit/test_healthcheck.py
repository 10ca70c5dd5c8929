"""`slurmagent healthcheck` (Slurm's HealthCheckProgram): check between jobs, drain, never resume.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_healthcheck_slurm.py.
"""

from __future__ import annotations

import json
import time


from slurmagent.commands.healthcheck import recent_decision


# --- unit: the "checked moments ago" window -----------------------------------------------


def _line(event: str, node: str, age_s: float, now: float, verdict: str = "healthy") -> str:
    from datetime import datetime, timezone

    t = datetime.fromtimestamp(now - age_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return json.dumps({"time": t, "event": event, "node": node, "verdict": verdict}) + "\n"


def test_recent_decision_window(tmp_path):
    log = tmp_path / "hooks.log"
    now = time.time()
    assert recent_decision(log, "n1", 120, now) is None  # no log yet
    log.write_text(_line("prolog", "n1", 300, now) + _line("watch", "n1", 10, now) + "not json\n")
    assert recent_decision(log, "n1", 120, now) is None  # only an old prolog; watch lines do not count
    log.write_text(log.read_text() + _line("epilog", "n1", 30, now, "internal-error"))
    assert recent_decision(log, "n1", 120, now) is None  # an internal error checked nothing
    log.write_text(log.read_text() + _line("epilog", "n2", 20, now) + _line("prolog", "n1", 50, now))
    assert recent_decision(log, "n1", 120, now)["event"] == "prolog"
    assert recent_decision(log, "n1", 40, now) is None
    assert recent_decision(log, "n1", 0, now) is None  # window 0: never skip
    assert recent_decision(log, "n3", 120, now) is None


def test_an_unhealthy_verdict_is_never_skipped_an_admin_may_have_resumed_the_node(tmp_path):
    """The prolog drained the node, the admin resumed it at once: the next healthcheck looks again."""
    log = tmp_path / "hooks.log"
    now = time.time()
    log.write_text(_line("prolog", "n1", 30, now, "unhealthy"))
    assert recent_decision(log, "n1", 120, now) is None
    log.write_text(_line("prolog", "n1", 60, now) + _line("watch", "n1", 20, now, "unhealthy"))
    assert recent_decision(log, "n1", 120, now) is None  # a fault after the healthy prolog: look again
    log.write_text(log.read_text() + _line("epilog", "n1", 10, now) + _line("watch", "n2", 5, now, "unhealthy"))
    assert recent_decision(log, "n1", 120, now)["event"] == "epilog"  # healthy since; n2's fault is n2's


def test_an_internal_error_after_a_healthy_verdict_is_never_skipped(tmp_path):
    """A healthy prolog, then an epilog that checked nothing (NVML hung, say): what is known is
    older than the error, so the next healthcheck looks."""
    log = tmp_path / "hooks.log"
    now = time.time()
    log.write_text(_line("prolog", "n1", 60, now) + _line("epilog", "n1", 20, now, "internal-error"))
    assert recent_decision(log, "n1", 120, now) is None
    log.write_text(log.read_text() + _line("epilog", "n1", 10, now))
    assert recent_decision(log, "n1", 120, now)["event"] == "epilog"
