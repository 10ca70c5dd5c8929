"""The expiry watch and its readers under bad input and flapping notices: garbage times from
the Compute API (through tests/support/fake_gcp_expiry.py and the real client), a maintenance notice
withdrawn and re-issued, a stale state file that a stopped watch left behind.

The same subject without a cluster, emulator or fake server: tests/unit/test_expiry_robust.py.
"""

from __future__ import annotations

import io
import json
import threading

import pytest

from support import wait_for
from support.fake_gcp_expiry import FakeGcpExpiry
from support.fakes.slurm import FakeSlurm
from slurmagent.commands import expiry
from slurmagent.state.config import parse
from slurmagent.commands.expiry import ExpiryWatch
from slurmagent.gcp.events import Events
from slurmagent.slurm.commands import Slurm
from test_expiry_robust import BOOT, T0, iso

NODE = "n1"
ZONE = "us-central1-a"
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
WRAPPED_SCRIPT = "#!/bin/sh\n# Written by `slurmagent sbatch`\nexec /venv/bin/python -m slurmagent.entry run \"$@\"\n"


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def gcp(serve_metadata):
    fake = serve_metadata(FakeGcpExpiry())
    fake.add_instance(NODE, ZONE)
    fake.set_identity(NODE, ZONE)
    return fake


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


# --- 21.14: a maintenance notice withdrawn and re-issued ------------------------------------------


def flapping_watch(tmp_path, gcp):
    """A GPU VM with no maintenance window in the API: a notice means T = about an hour ahead."""
    cli = FakeSlurm([NODE])
    cli.add_job("41", node=NODE, script=WRAPPED_SCRIPT)
    gcp.set_scheduling(NODE, termination=None, model="STANDARD")
    clock = Clock()
    return cli, clock, ExpiryWatch(cfg_for(tmp_path, gcp), NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT)


def test_a_notice_withdrawn_and_reissued_every_10_min_keeps_its_first_end(gcp, tmp_path):
    cli, clock, w = flapping_watch(tmp_path, gcp)
    drained_at, flushed_at, said = None, None, []
    for minute in range(0, 61):  # one check a minute; the notice is gone for the 9th minute of every ten
        clock.t = T0 + minute * 60
        res = w.check(Events(maintenance="NONE" if minute % 10 == 9 else TERMINATE))
        said += res.actions
        if minute % 10 != 9:
            assert res.state["termination_time"] == iso(T0 + 3600), (minute, res.state)
        if drained_at is None and cli.reason.startswith("slurmagent: maintenance:"):
            drained_at = minute
        if flushed_at is None and cli.of("scancel"):
            flushed_at = minute
    assert drained_at == 30 and flushed_at == 58  # the drain lead (30 min) and flush lead (2 min) of T0 + 60 min
    assert sum("keeps the stop time it first announced, " + iso(T0 + 3600) in a for a in said) == 5  # at 10..50 (at 59 it is too near T to count as withdrawn)


def test_a_notice_withdrawn_longer_than_the_drain_lead_is_cancelled_for_real(gcp, tmp_path):
    cli, clock, w = flapping_watch(tmp_path, gcp)
    w.check(Events(maintenance=TERMINATE))
    clock.t = T0 + 300
    res = w.check(Events())
    assert res.state["withdrawn_notice"]["termination_time"] == iso(T0 + 3600)
    clock.t = T0 + 300 + 1800 - 1  # still in doubt: a re-issue keeps T
    res = w.check(Events(maintenance=TERMINATE))
    assert res.state["termination_time"] == iso(T0 + 3600) and "withdrawn_notice" not in res.state
    clock.t += 1
    w.check(Events())
    clock.t += 1800 + 1  # withdrawn longer than drain_lead_s: cancelled; a new notice is a new hour
    res = w.check(Events(maintenance=TERMINATE))
    assert res.state["termination_time"] == iso(clock.t + 3600) and "withdrawn_notice" not in res.state


def test_a_cached_answer_an_older_version_wrote_from_a_bad_time_is_asked_again(gcp, tmp_path):
    cli = FakeSlurm([NODE])
    state = tmp_path / "state" / NODE
    state.mkdir(parents=True)
    (state / "expiry.json").write_text(json.dumps({"boot_id": BOOT, "api": {"checked_at_epoch": T0, "scheduling": {
        "termination_time": "1-01-01T00:00:00Z", "provisioning_model": "FLEX_START"}}}))
    gcp.set_scheduling(NODE, termination=iso(T0 + 900))
    res = ExpiryWatch(cfg_for(tmp_path, gcp), NODE, Slurm(runner=cli), clock=Clock(), boot_id=BOOT).check(Events())
    assert res.errors == [] and res.state["termination_time"] == iso(T0 + 900)
    assert len(gcp.calls_of("instances.get")) == 1
