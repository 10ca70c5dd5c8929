"""Expiry watch without the cluster: termination time, decisions, flush argv, prolog guard,
metadata long poll and deadlines, systemd units. A scripted scontrol/squeue/scancel stands in
for Slurm; tests/support/fake_gcp_expiry.py for the Compute API and the metadata server.

The same subject without a cluster, emulator or fake server: tests/unit/test_expiry.py.

Timing (parallel lanes): nothing here is in the serial group. "At once" is asserted against the
period the bug would wait for instead, with half of it as the bound: the long poll's own wait
(WAIT_S) for the watcher, a quarter of the loop's interval (LOOP_S) for the flush.
"""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from support import wait_for
from support.fake_gcp_expiry import FakeGcpExpiry
from slurmagent.commands import expiry
from slurmagent.state.config import parse
from slurmagent.errors import ExpiryError
from slurmagent.commands.expiry import ExpiryWatch
from slurmagent.gcp.compute import SchedulingInfo, read_scheduling
from slurmagent.gcp.events import EventWatcher, Events
from slurmagent.core.timefmt import fmt_time
from slurmagent.slurm.commands import Slurm
from test_expiry import BOOT, NODE, T0, WRAPPED_SCRIPT, ZONE, Clock, iso, slurm_with


# --- the Compute API ----------------------------------------------------------------------------


@pytest.fixture
def gcp(serve_metadata):
    fake = serve_metadata(FakeGcpExpiry())
    fake.add_instance(NODE, ZONE)
    fake.set_identity(NODE, ZONE)
    return fake


def test_read_scheduling_through_the_real_client(gcp, tmp_path):
    gcp.set_scheduling(NODE, termination="2026-11-30T02:00:00.000-08:00", max_run_duration_s=86400)
    cfg = parse({"gcp": {"compute_endpoint": gcp.url}, "expiry": {"api_timeout_s": 10}})  # project/zone: metadata
    info = read_scheduling(cfg, NODE)
    assert fmt_time(info.termination_time) == "2026-11-30T10:00:00Z"
    assert info.provisioning_model == "FLEX_START" and info.max_run_duration_s == 86400
    with pytest.raises(ExpiryError, match="no instance 'nope'"):
        read_scheduling(cfg, "nope")


def test_read_scheduling_sees_a_gpu_vm_and_its_maintenance_window(gcp, tmp_path):
    gcp.set_scheduling(NODE, termination=None, model="STANDARD")
    gcp.set_maintenance(NODE, "2026-11-30T11:00:00Z")
    cfg = parse({"gcp": {"compute_endpoint": gcp.url, "project": "test-proj", "zone": ZONE}})
    info = read_scheduling(cfg, NODE)
    assert info.gpu_vm and info.on_host_maintenance == "TERMINATE" and info.maintenance_can_reschedule
    assert fmt_time(info.maintenance_window_start) == "2026-11-30T11:00:00Z" and info.termination_time is None
    assert SchedulingInfo.from_dict(info.to_dict()) == info
    vm = gcp.instances[(ZONE, NODE)]
    vm.gpus, vm.machine_type = 0, "n2-standard-8"
    gcp.set_maintenance(NODE, None)
    info = read_scheduling(cfg, NODE)
    assert not info.gpu_vm and info.maintenance_window_start is None


def test_an_hour_notice_on_a_gpu_vm_drains_at_the_lead_and_flushes_at_the_flush_lead(gcp, tmp_path):
    """The watch with a compressed clock: the API re-read on the event change gives the window."""
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    gcp.set_scheduling(NODE, termination=None, model="STANDARD")
    gcp.set_maintenance(NODE, iso(T0 + 3600))
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "test-proj", "zone": ZONE, "compute_endpoint": gcp.url},
                 "expiry": {"publish_run_file": False}})
    clock = Clock()
    w = ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT)
    res = w.check(Events())
    assert res.state["source"] == "upcoming-maintenance" and cli.argvs == []  # known, 60 min away: nothing yet
    reads = len(gcp.calls_of("instances.get"))
    clock.t += 60
    res = w.check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert len(gcp.calls_of("instances.get")) == reads + 1  # read again on the event change
    assert res.state["termination_time"] == iso(T0 + 3600) and cli.argvs == []
    clock.t = T0 + 3600 - 1800
    w.check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert cli.reason == f"slurmagent: maintenance: TERMINATE_ON_HOST_MAINTENANCE (VM stops at about {iso(T0 + 3600)})"
    assert cli.of("scancel") == []  # drained, the job runs on
    clock.t = T0 + 3600 - 121
    w.check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert cli.of("scancel") == []
    clock.t += 1
    res = w.check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert cli.of("scancel") == [["scancel", "--batch", "--signal=USR1", "41"]]
    assert res.state["flush_cause"] == "TERMINATE_ON_HOST_MAINTENANCE notice"


def test_once_via_cli_against_fake_caches_the_api_answer(gcp, tmp_path, monkeypatch, capsys):
    from slurmagent.cli import main

    cli = slurm_with()
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: cls(runner=cli)))
    end = time.time() + 600
    gcp.set_scheduling(NODE, termination=iso(end))
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[hooks]\nsyslog = false\n'
                      f'[gcp]\ncompute_endpoint = "{gcp.url}"\n[expiry]\npublish_run_file = false\n')
    assert main(["--config", str(config), "expiry-watch", "--once", "--node", NODE]) == 0
    out, err = capsys.readouterr()
    assert "drained (slurmagent: expiry: flex expiry at" in out, (out, err)
    assert err == ""
    state = json.loads((tmp_path / "state" / NODE / "expiry.json").read_text())
    assert state["termination_time"] == iso(end) and state["source"] == "compute-api" and state["drained"]
    assert state["scheduling"]["provisioning_model"] == "FLEX_START"
    assert main(["--config", str(config), "expiry-watch", "--once", "--node", NODE]) == 0
    assert len(gcp.calls_of("instances.get")) == 1  # the second check used the cache
    assert cli.reason.startswith("slurmagent: expiry: flex expiry at")


# --- metadata server: long poll, deadlines -----------------------------------------------------


WAIT_S = 20.0  # the watcher's long poll: the server answers on a change or after this


def test_event_watcher_long_polls_with_etag_and_wakes_on_change(gcp):
    """Woken by the change itself, while its long polls still wait: a watcher that saw the
    change only when a poll ends (every WAIT_S) or when it polls again would wake only then."""
    wake, stop = threading.Event(), threading.Event()
    said = []
    w = EventWatcher(1.0, WAIT_S, wake, stop, said.append).start()
    try:
        wait_for(lambda: len(gcp.waits) >= 2, 30, "both keys long-polled")
        wake.clear()
        assert w.snapshot().notice is None
        gcp.set_event("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        assert wake.wait(WAIT_S / 2), f"not woken within half the long poll's {WAIT_S:g} s"
        assert w.snapshot().notice == ("maintenance", 60.0)
        polls = [c for c in gcp.calls if c.kind == "metadata" and c.query.get("wait_for_change") == "true"]
        assert polls and all(c.query.get("last_etag") for c in polls)
    finally:
        stop.set()
    assert said == []


LOOP_S = 120.0  # the loop's interval in the test below: a check at start, the next only this much later


def test_loop_reacts_to_maintenance_at_once(gcp, tmp_path):
    """The notice flushes the job at once, not at the loop's next check (every LOOP_S here)."""
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    gcp.set_scheduling(NODE, termination=None, model="STANDARD")
    vm = gcp.instances[(ZONE, NODE)]
    vm.gpus, vm.machine_type = 0, "n2-standard-8"  # no GPU: the notice means T = now + 60 s, flush at once
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "test-proj", "zone": ZONE, "compute_endpoint": gcp.url},
                 "expiry": {"publish_run_file": False}})
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    th = threading.Thread(target=expiry.run_expiry_watch, args=(cfg, NODE),
                          kwargs=dict(interval_s=LOOP_S, out=out, err=err, slurm=Slurm(runner=cli), stop=stop))
    th.start()
    try:
        wait_for(lambda: (tmp_path / "state" / NODE / "expiry.json").exists() and len(gcp.waits) >= 2, 30, "first check")
        assert not cli.of("scancel")
        gcp.set_event("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        wait_for(lambda: cli.of("scancel"), LOOP_S / 4, "the flush, well before the loop's next check")
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()
    assert cli.reason.startswith("slurmagent: maintenance:")
    assert "TERMINATE_ON_HOST_MAINTENANCE notice" in out.getvalue() and err.getvalue() == ""
