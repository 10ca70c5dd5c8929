"""The expiry watch and its readers under bad input and flapping notices: garbage times from
the Compute API (through tests/fake_gcp_expiry.py and the real client), a maintenance notice
withdrawn and re-issued, a stale state file that a stopped watch left behind."""

from __future__ import annotations

import io
import json
import threading
import time
from datetime import datetime, timezone

import pytest

from conftest import wait_for
from fake_gcp_expiry import FakeGcpExpiry
from fakes.slurm import FakeSlurm
from slurmagent import expiry, expiry_state
from slurmagent.config import parse
from slurmagent.expiry import ExpiryWatch
from slurmagent.gcp import metadata
from slurmagent.gcp.events import Events
from slurmagent.slurm import Slurm

NODE = "n1"
ZONE = "us-central1-a"
BOOT = "boot-a"
T0 = 1_800_000_000.0
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
WRAPPED_SCRIPT = "#!/bin/sh\n# Written by `slurmagent sbatch`\nexec /venv/bin/python -m slurmagent.entry run \"$@\"\n"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def gcp(monkeypatch):
    fake = FakeGcpExpiry().start()
    fake.add_instance(NODE, ZONE)
    fake.set_identity(NODE, ZONE)
    monkeypatch.setenv("GCE_METADATA_HOST", fake.host)
    monkeypatch.delenv("GCE_METADATA_ROOT", raising=False)
    metadata.reset_cache()
    yield fake
    fake.stop()
    metadata.reset_cache()


def cfg_for(tmp_path, gcp, **expiry_keys):
    return parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                  "gcp": {"project": "test-proj", "zone": ZONE, "compute_endpoint": gcp.url},
                  "expiry": {"publish_run_file": False, **expiry_keys}})


# --- 21.13: an unusable time from the Compute API ----------------------------------------------

BAD_TIMES = {
    "garbage terminationTimestamp": dict(termination="garbage"),
    "protobuf zero terminationTimestamp": dict(termination="0001-01-01T00:00:00Z"),
    "maxRunDuration 1e15": dict(termination=None, max_run_duration_s=10**15, last_start="2026-11-30T09:00:00Z"),
    "bad windowStartTime": dict(window="next tuesday"),
}


def set_bad(gcp, case: dict) -> None:
    if "window" in case:
        gcp.set_scheduling(NODE, termination=None, model="STANDARD")
        gcp.set_maintenance(NODE, case["window"])
    else:
        gcp.set_scheduling(NODE, **case)


@pytest.mark.parametrize("case", BAD_TIMES.values(), ids=BAD_TIMES.keys())
def test_an_unusable_api_time_is_one_error_and_the_cached_end_stands(gcp, tmp_path, case):
    cli = FakeSlurm([NODE])
    clock = Clock()
    cfg = cfg_for(tmp_path, gcp, refresh_s=60)
    w = ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT)
    gcp.set_scheduling(NODE, termination=iso(T0 + 900))
    w.check(Events())
    assert cli.reason.startswith("slurmagent: expiry: flex expiry at")
    set_bad(gcp, case)
    clock.t += 120  # the cached answer is old: the API is asked again and answers garbage
    res = w.check(Events())
    assert len(res.errors) == 1 and "instances.get:" in res.errors[0], res.errors
    assert ("is not a usable time" in res.errors[0] or "out of range" in res.errors[0])
    assert "using the cached answer" in res.errors[0]
    assert res.state["termination_time"] == iso(T0 + 900) and "DRAIN" in cli.state  # what it knew still holds
    state = json.loads((tmp_path / "state" / NODE / "expiry.json").read_text())
    assert state["termination_time"] == iso(T0 + 900)


@pytest.mark.parametrize("case", BAD_TIMES.values(), ids=BAD_TIMES.keys())
def test_the_loop_says_a_bad_api_time_once_and_still_acts_on_a_preemption(gcp, tmp_path, case):
    cli = FakeSlurm([NODE])
    cli.add_job("41", node=NODE, script=WRAPPED_SCRIPT)
    set_bad(gcp, case)
    cfg = cfg_for(tmp_path, gcp)
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    th = threading.Thread(target=expiry.run_expiry_watch, args=(cfg, NODE),
                          kwargs=dict(interval_s=0.2, out=out, err=err, slurm=Slurm(runner=cli), stop=stop))
    th.start()
    try:
        wait_for(lambda: len(gcp.calls_of("instances.get")) >= 3, 20, "three checks")
        assert th.is_alive()
        gcp.set_event("instance/preempted", "TRUE")
        wait_for(lambda: cli.of("scancel"), 10, "flush on the preemption notice")
    finally:
        stop.set()
        th.join(10)
    assert not th.is_alive()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert "instances.get:" in lines[0] and ("is not a usable time" in lines[0] or "out of range" in lines[0])
    assert cli.reason.startswith("slurmagent: preempt")
