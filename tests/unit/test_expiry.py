"""Expiry watch without the cluster: termination time, decisions, flush argv, prolog guard,
metadata long poll and deadlines, systemd units. A scripted scontrol/squeue/scancel stands in
for Slurm; tests/support/fake_gcp_expiry.py for the Compute API and the metadata server.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_expiry_gcp.py.

Timing (parallel lanes): nothing here is in the serial group. An unreachable metadata server is
judged by the requests it received (one, never a long poll) and the line said, with a wall bound
that only catches a hang.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from support import REPO, chroot_lane
from support.fakes.slurm import FakeSlurm
from slurmagent.commands import expiry
from slurmagent.state import expiry_state, host
from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import DecisionLog, read_records
from slurmagent.errors import ExpiryError
from slurmagent.commands.expiry import ExpiryWatch, flush_jobs
from slurmagent.gcp import metadata
from slurmagent.gcp.compute import SchedulingInfo, scheduling_from_instance
from slurmagent.gcp.events import Events
from slurmagent.commands.hooks import HookContext, prolog_guard
from slurmagent.slurm.model import script_execs_wrapper
from slurmagent.core.reasons import expiry_reason, is_expiry_reason
from slurmagent.core.timefmt import fmt_time, from_epoch, parse_time, parse_time_limit
from slurmagent.slurm.commands import Slurm

NODE = "n1"
ZONE = "us-central1-a"
BOOT = "boot-a"
T0 = 1_800_000_000.0  # a fixed "now"
WRAPPED_SCRIPT = "#!/bin/sh\n# Written by `slurmagent sbatch`\nexec /venv/bin/python -m slurmagent.entry run \"$@\"\n"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def slurm_with(state: str = "IDLE", reason: str = "", jobs: dict[str, str] | None = None,
               partitions_max: str = "UNLIMITED") -> FakeSlurm:
    """Slurm with one node running `jobs` (job id -> batch script; "" = unreadable)."""
    fake = FakeSlurm([NODE], state=state, reason=reason, max_time=partitions_max)
    for job, script in (jobs or {}).items():
        fake.add_job(job, node=NODE, script=script)
    return fake


def make_cfg(tmp_path: Path, **expiry_keys) -> object:
    keys = {"publish_run_file": False, **expiry_keys}
    return parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                  "gcp": {"project": "test-proj", "zone": ZONE}, "expiry": keys})


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def scheduling_reader(termination: float | None, calls: list | None = None, fail: bool = False):
    def read(cfg, node):
        if calls is not None:
            calls.append(node)
        if fail:
            raise ExpiryError("instances.get: HTTP 503 backendError")
        return SchedulingInfo(from_epoch(termination) if termination else None, "FLEX_START", "DELETE",
                                     3600.0, "resourceStatus.scheduling.terminationTimestamp")
    return read


def watch(tmp_path, cli: FakeSlurm, termination: float | None, clock=None, calls=None, boot=BOOT, **keys):
    cfg = make_cfg(tmp_path, **keys)
    return ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock or Clock(), boot_id=boot,
                       scheduling_reader=scheduling_reader(termination, calls))


# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("2026-11-30T10:00:00Z", "2026-11-30T10:00:00Z"),
    ("2026-11-30T02:00:00.123-08:00", "2026-11-30T10:00:00Z"),
    ("2026-11-30T11:00:00+01:00", "2026-11-30T10:00:00Z"),
])
def test_parse_time(text, expected):
    assert fmt_time(parse_time(text)) == expected


def test_parse_time_refuses_naive():
    with pytest.raises(ValueError):
        parse_time("2026-11-30T10:00:00")


@pytest.mark.parametrize("text,seconds", [
    ("01:00:00", 3600), ("1-00:00:00", 86400), ("2-03:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
    ("30", 1800), ("05:30", 330), ("1-12", 36 * 3600), ("UNLIMITED", None), ("Partition_Limit", None), ("", None),
])
def test_parse_time_limit(text, seconds):
    assert parse_time_limit(text) == seconds


def test_reason_format_is_rule_expiry_never_repaired():
    reason = expiry_reason(parse_time("2026-11-30T10:00:00Z"))
    assert reason == "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"
    assert reasons.rule_of(reason) == "expiry" and not reasons.repairable(reason)
    for kind in ("maintenance", "preempt"):
        r = expiry_reason(parse_time("2026-11-30T10:00:00Z"), kind)
        assert r.startswith(f"slurmagent: {kind}: ") and not reasons.repairable(r) and is_expiry_reason(r)


# --- the Compute API ----------------------------------------------------------------------------


def test_scheduling_from_instance_fields():
    from google.cloud import compute_v1

    def inst(d):
        return compute_v1.Instance.from_json(json.dumps(d), ignore_unknown_fields=True)

    a = scheduling_from_instance(inst({"name": "x", "scheduling": {"provisioningModel": "FLEX_START",
                                       "maxRunDuration": {"seconds": "3600"}, "instanceTerminationAction": "DELETE"},
                                       "resourceStatus": {"scheduling": {"terminationTimestamp": "2026-11-30T02:00:00.000-08:00"}}}))
    assert (fmt_time(a.termination_time), a.provisioning_model, a.instance_termination_action,
            a.max_run_duration_s) == ("2026-11-30T10:00:00Z", "FLEX_START", "DELETE", 3600.0)
    assert a.field == "resourceStatus.scheduling.terminationTimestamp"
    b = scheduling_from_instance(inst({"name": "x", "scheduling": {"terminationTime": "2026-11-30T10:00:00Z"}}))
    assert fmt_time(b.termination_time) == "2026-11-30T10:00:00Z" and b.field == "scheduling.terminationTime"
    c = scheduling_from_instance(inst({"name": "x", "lastStartTimestamp": "2026-11-30T09:00:00.000-00:00",
                                       "scheduling": {"maxRunDuration": {"seconds": "7200"}}}))
    assert fmt_time(c.termination_time) == "2026-11-30T11:00:00Z"
    d = scheduling_from_instance(inst({"name": "x", "scheduling": {"provisioningModel": "STANDARD"}}))
    assert d.termination_time is None and d.provisioning_model == "STANDARD"


# --- decisions ----------------------------------------------------------------------------------


def test_ten_minutes_left_with_30_min_lead_drains(tmp_path):
    cli = slurm_with()
    res = watch(tmp_path, cli, T0 + 600).check(Events())
    assert cli.reason == f"slurmagent: expiry: flex expiry at {iso(T0 + 600)}" and "DRAIN" in cli.state
    assert res.remaining_s == 600 and any(a.startswith("drained") for a in res.actions)
    assert not cli.of("squeue")  # no flush yet (lead 120 s)
    st = res.state
    assert st["drained"] and not st.get("flushed") and st["boot_id"] == BOOT and st["source"] == "compute-api"


def test_three_hours_left_not_drained(tmp_path):
    cli = slurm_with()
    res = watch(tmp_path, cli, T0 + 3 * 3600).check(Events())
    assert cli.argvs == [] and res.actions == [] and "DRAIN" not in cli.state
    assert res.state["termination_time"] == iso(T0 + 3 * 3600)
    assert res.next_check_s == pytest.approx(3 * 3600 - 1800)
    # the countdown's metric, exact, with where the time came from
    prom = (tmp_path / "state" / NODE / "slurmagent.prom").read_text()
    assert f'slurmagent_termination_timestamp_seconds{{source="compute-api"}} {int(T0 + 3 * 3600)}\n' in prom, prom


def test_the_termination_metric_goes_away_when_no_time_is_known(tmp_path):
    cli, clock = slurm_with(), Clock()
    watch(tmp_path, cli, T0 + 3 * 3600, clock=clock).check(Events())
    prom = tmp_path / "state" / NODE / "slurmagent.prom"
    assert "slurmagent_termination_timestamp_seconds{" in prom.read_text()
    watch(tmp_path, cli, None, clock=clock, boot="next-boot").check(Events())  # a new VM: no termination time
    assert "slurmagent_termination_timestamp_seconds" not in prom.read_text()


def test_no_termination_time_nothing_to_do_and_cached(tmp_path):
    cli, calls, clock = slurm_with(), [], Clock()
    w = watch(tmp_path, cli, None, clock=clock, calls=calls)
    res = w.check(Events())
    assert res.termination is None and cli.argvs == [] and "termination_time" not in res.state
    clock.t += 600
    w.check(Events())
    assert calls == [NODE]  # cached for refresh_s
    clock.t += 3600 * 1.2
    w.check(Events())
    assert calls == [NODE, NODE]


def test_admin_drained_node_keeps_its_reason(tmp_path):
    cli = slurm_with(state="IDLE+DRAIN", reason="admin: swap PSU [root@2026-11-30T09:00:00]")
    res = watch(tmp_path, cli, T0 + 600).check(Events())
    assert cli.reason.startswith("admin: swap PSU") and not cli.of("scontrol", "update")
    assert res.state["drain"] == "kept-admin-drain"


def test_slurmagent_hardware_drain_is_not_replaced(tmp_path):
    cli = slurm_with(state="IDLE+DRAIN", reason="slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    res = watch(tmp_path, cli, T0 + 600).check(Events())
    assert cli.reason.startswith("slurmagent: xid 79") and res.state["drain"] == "kept-slurmagent-drain"


def test_flush_at_lead_signals_wrapped_requeues_unwrapped_once(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT, "42": "#!/bin/bash\npython train.py\n", "43": ""})
    clock = Clock()
    w = watch(tmp_path, cli, T0 + 100, clock=clock)
    res = w.check(Events())
    assert cli.of("squeue") == [["squeue", "-h", "-w", NODE, "-t", "RUNNING", "-o", "%A"]]
    assert cli.of("scancel") == [["scancel", "--batch", "--signal=USR1", "41"]]
    assert cli.of("scontrol", "requeue") == [["scontrol", "requeue", "42,43"]]
    st = res.state
    assert st["flushed"] and st["flushed_jobs"] == ["41"] and st["requeued_jobs"] == ["42", "43"]
    assert st["flush_cause"] == "VM expiry in 100 s"
    assert res.jobs == ["41", "42", "43"]  # in the decision log's line: `report` joins it to each job
    clock.t += 30
    cli.add_job("44", node=NODE, script=WRAPPED_SCRIPT)
    assert w.check(Events()).jobs == ["44"]
    assert cli.of("scancel")[-1] == ["scancel", "--batch", "--signal=USR1", "44"]  # only the new one
    assert len(cli.of("scontrol", "requeue")) == 1


@pytest.mark.parametrize("policy,signaled,requeued", [("signal", ["41", "42"], []), ("leave", ["41"], [])])
def test_unwrapped_jobs_policy(tmp_path, policy, signaled, requeued):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT, "42": "#!/bin/bash\nslurmagent run -- python x.py\n"})  # no exec
    out = flush_jobs(make_cfg(tmp_path), Slurm(runner=cli), NODE, set(), policy)
    assert out.signaled == signaled and out.requeued == requeued
    assert out.left == ([] if policy == "signal" else ["42"])


def test_classification_budget_spent_counts_the_rest_as_unwrapped(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT, "42": WRAPPED_SCRIPT})
    out = flush_jobs(make_cfg(tmp_path), Slurm(runner=cli), NODE, set(), "requeue", classify_budget_s=0.0)
    assert out.signaled == [] and out.requeued == ["41", "42"] and not cli.of("scontrol", "write")


def test_wrapped_detection():
    for script, wrapped in [
        (WRAPPED_SCRIPT, True),
        ("#!/bin/bash\n#SBATCH --requeue\nexec slurmagent run -- python train.py\n", True),
        ("#!/bin/bash\nexec /opt/slurmagent/venv/bin/slurmagent --config /x run --grace 60 -- python t.py\n", True),
        ("#!/bin/bash\nslurmagent run -- python train.py\n", False),  # not exec'd: USR1 would hit bash
        ("#!/bin/bash\nexec python train.py  # slurmagent run later\n", False),
    ]:
        assert script_execs_wrapper(script) is wrapped, script


def test_maintenance_notice_drains_and_flushes_at_once(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    res = watch(tmp_path, cli, None).check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert cli.reason.startswith("slurmagent: maintenance: TERMINATE_ON_HOST_MAINTENANCE")
    assert cli.of("scancel") == [["scancel", "--batch", "--signal=USR1", "41"]]
    st = res.state
    assert st["source"] == "maintenance-event" and st["termination_time"] == iso(T0 + 60)
    assert st["flush_cause"] == "TERMINATE_ON_HOST_MAINTENANCE notice"


def test_preemption_notice_beats_a_later_flex_expiry(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    res = watch(tmp_path, cli, T0 + 5 * 86400).check(Events(preempted="TRUE"))
    assert res.state["source"] == "preempted" and res.state["termination_time"] == iso(T0 + 30)
    assert cli.reason.startswith("slurmagent: preempt:") and cli.of("scancel")


def test_notice_that_passes_without_a_stop_is_cleared_and_our_drain_undone(tmp_path):
    cli, clock = slurm_with(), Clock()
    w = watch(tmp_path, cli, None, clock=clock)
    w.check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert cli.reason.startswith("slurmagent: maintenance:")
    clock.t += 120
    res = w.check(Events(maintenance="NONE"))  # still inside the grace: the notice holds
    assert "DRAIN" in cli.state and res.state["notice"]
    clock.t += 600
    res = w.check(Events(maintenance="NONE"))
    assert "DRAIN" not in cli.state and "notice" not in res.state and "termination_time" not in res.state
    assert any("passed and the VM lives on" in a for a in res.actions)


def test_migrate_is_logged_not_acted_on(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    res = watch(tmp_path, cli, None).check(Events(maintenance="MIGRATE_ON_HOST_MAINTENANCE"))
    assert cli.argvs == [] and any("live migration" in a for a in res.actions)


def test_state_of_an_earlier_boot_is_discarded(tmp_path):
    cli = slurm_with()
    watch(tmp_path, cli, T0 + 100, boot="old-boot").check(Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    cli2 = slurm_with()
    res = watch(tmp_path, cli2, T0 + 5 * 86400, boot="new-boot").check(Events())
    assert any("earlier boot (old-boot)" in a for a in res.actions)
    assert res.state["boot_id"] == "new-boot" and "notice" not in res.state and not res.state.get("flushed")
    assert cli2.argvs == []


def test_api_failure_keeps_cached_time_and_never_undrains(tmp_path):
    cli, clock = slurm_with(), Clock()
    cfg = make_cfg(tmp_path, refresh_s=60)
    good = ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT, scheduling_reader=scheduling_reader(T0 + 600))
    good.check(Events())
    assert "DRAIN" in cli.state
    clock.t += 120
    bad = ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT,
                      scheduling_reader=scheduling_reader(None, fail=True))
    res = bad.check(Events())
    assert "using the cached answer" in res.errors[0] and res.state["termination_time"] == iso(T0 + 600)
    assert "DRAIN" in cli.state


def test_termination_moved_later_undoes_our_drain_only(tmp_path):
    cli, clock = slurm_with(), Clock()
    cfg = make_cfg(tmp_path, refresh_s=60)
    ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT, scheduling_reader=scheduling_reader(T0 + 600)).check()
    assert "DRAIN" in cli.state
    clock.t += 120
    res = ExpiryWatch(cfg, NODE, Slurm(runner=cli), clock=clock, boot_id=BOOT,
                      scheduling_reader=scheduling_reader(T0 + 86400)).check()
    assert "DRAIN" not in cli.state and any(a.startswith("resumed") for a in res.actions)
    assert "drained" not in res.state


def test_drain_at_max_time_only_with_finite_maxtime(tmp_path):
    cli = slurm_with(partitions_max="1-00:00:00")
    watch(tmp_path, cli, T0 + 20 * 3600, drain_at_max_time=True).check(Events())
    assert "DRAIN" in cli.state
    cli = slurm_with(partitions_max="UNLIMITED")
    watch(tmp_path / "b", cli, T0 + 20 * 3600, drain_at_max_time=True).check(Events())
    assert "DRAIN" not in cli.state


def test_slurm_down_is_an_error_line_not_a_crash(tmp_path):
    cli = slurm_with(jobs={"41": WRAPPED_SCRIPT})
    cli.fail = {"scontrol", "squeue"}
    res = watch(tmp_path, cli, T0 + 60).check(Events())
    assert any("drain failed" in e for e in res.errors) and any("flush failed" in e for e in res.errors)
    assert res.state["termination_time"] == iso(T0 + 60)


def test_state_file_is_what_wrapper_and_status_read(tmp_path):
    from slurmagent.state.expiry_state import termination_time

    watch(tmp_path, slurm_with(), T0 + 3 * 3600).check(Events())
    path = tmp_path / "state" / NODE / "expiry.json"
    assert termination_time((path,), boot_id=BOOT).timestamp() == T0 + 3 * 3600
    assert termination_time((path,), boot_id="a-later-boot") is None  # stale after a restart
    assert (path.stat().st_mode & 0o777) == 0o644
    watch(tmp_path / "none", slurm_with(), None).check(Events())
    assert termination_time((tmp_path / "none" / "state" / NODE / "expiry.json",), boot_id=BOOT) is None


# --- prolog guard -------------------------------------------------------------------------------


class GuardHarness:
    def __init__(self, tmp_path: Path, **keys):
        self.cfg = make_cfg(tmp_path, **keys)
        self.cfg = replace(self.cfg, slurm=replace(self.cfg.slurm, conf=str(tmp_path / "slurm.conf")))
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "slurm.conf").write_text("SchedulerParameters=nohold_on_prolog_fail\n")
        self.cli = slurm_with()
        self.cli.add_job("77", "CONFIGURING", node=NODE)
        self.log_path = tmp_path / "hooks.log"
        self.err = io.StringIO()
        self.state = tmp_path / "state" / NODE / "expiry.json"

    def write_state(self, termination: float | None, boot: str | None = None) -> None:
        data = {"schema": 1, "boot_id": boot or host.boot_id()}
        if termination is not None:
            data["termination_time"] = iso(termination)
        self.state.parent.mkdir(parents=True, exist_ok=True)
        self.state.write_text(json.dumps(data))

    def run(self, job: str = "77") -> int | None:
        ctx = HookContext("prolog", NODE, job)
        return prolog_guard(self.cfg, ctx, lambda cfg: Slurm(runner=self.cli), DecisionLog(self.log_path, False), self.err)


def test_guard_fast_path_no_file_or_no_time_makes_no_slurm_call(tmp_path, monkeypatch):
    h = GuardHarness(tmp_path)
    reads = []
    real = expiry_state.read_state_file
    monkeypatch.setattr(expiry_state, "read_state_file", lambda path: reads.append(path) or real(path))
    assert h.run() is None and h.cli.argvs == []
    h.write_state(None)
    assert h.run() is None and h.cli.argvs == []
    assert reads == [h.state, h.state]  # one read per prolog, nothing else


def test_guard_requeues_job_longer_than_the_lifetime(tmp_path):
    h = GuardHarness(tmp_path)
    h.write_state(time.time() + 1800)
    h.cli.jobs["77"]["TimeLimit"] = "01:00:00"
    assert h.run() == 1
    assert h.cli.reason.startswith("slurmagent: expiry: flex expiry at") and "DRAIN" in h.cli.state
    assert len(h.cli.of("scontrol", "-o", "show", "job")) == 1 and len(h.cli.of("scontrol", "write")) == 1
    rec = read_records(h.log_path)[-1]
    assert rec["verdict"] == "expiry" and rec["action"] == "drained,requeue" and "time limit 01:00:00" in rec["detail"]
    assert "requeued off n1" in h.err.getvalue()


def test_guard_lets_a_wrapped_job_run_it_flushes_at_the_lead(tmp_path):
    h = GuardHarness(tmp_path)
    h.write_state(time.time() + 1800)
    h.cli.scripts["77"] = WRAPPED_SCRIPT
    assert h.run() is None and "DRAIN" not in h.cli.state
    assert read_records(h.log_path)[-1]["action"] == "none (wrapped: flushes at the lead)"
    h2 = GuardHarness(tmp_path / "all", prolog_guard="requeue-all")
    h2.write_state(time.time() + 1800)
    h2.cli.scripts["77"] = WRAPPED_SCRIPT
    assert h2.run() == 1 and "DRAIN" in h2.cli.state
    assert not h2.cli.of("scontrol", "write")  # requeue-all does not need to read the script


@pytest.mark.parametrize("limit,expected", [("00:20:00", None), ("00:29:00", 1), ("UNLIMITED", 1)])
def test_guard_keeps_the_flush_lead(tmp_path, limit, expected):
    h = GuardHarness(tmp_path)  # flush lead 120 s: a 29 min job on a 30 min VM would be cut by the flush
    h.write_state(time.time() + 1800)
    h.cli.jobs["77"]["TimeLimit"] = limit
    assert h.run() == expected


def test_guard_warn_only_logs(tmp_path):
    h = GuardHarness(tmp_path, prolog_guard="warn")
    h.write_state(time.time() + 600)
    assert h.run() is None and "DRAIN" not in h.cli.state
    assert read_records(h.log_path)[-1]["action"] == "warned" and "warning" in h.err.getvalue()


def test_guard_ignores_state_of_an_earlier_boot_and_off(tmp_path):
    h = GuardHarness(tmp_path)
    h.write_state(time.time() + 60, boot="some-other-boot")
    assert h.run() is None and h.cli.argvs == []
    h2 = GuardHarness(tmp_path / "off", prolog_guard="off")
    h2.write_state(time.time() + 60)
    assert h2.run() is None and h2.cli.argvs == []


def test_guard_slurm_failure_lets_the_job_run(tmp_path):
    h = GuardHarness(tmp_path)
    h.write_state(time.time() + 60)
    h.cli.fail = {"scontrol"}
    assert h.run() is None
    assert read_records(h.log_path)[-1]["action"] == "expiry-guard-skipped"


def test_healthy_prolog_path_imports_no_google_and_calls_no_scontrol(tmp_path):
    """Whole process, as slurmd runs it: state file without a termination time."""
    snap = tmp_path / "snap.json"
    from support import healthy_snapshot_dict

    snap.write_text(json.dumps(healthy_snapshot_dict()))
    (tmp_path / "state" / NODE).mkdir(parents=True)
    (tmp_path / "state" / NODE / "expiry.json").write_text(json.dumps({"schema": 1, "boot_id": "x"}))
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[health]\nsnapshot = "{snap}"\nexpected_gpus = 8\n'
                      f'kernel_log_enabled = false\n[hooks]\nsyslog = false\n[slurm]\nscontrol = "/nonexistent/scontrol"\n')
    code = ("import sys, runpy; sys.argv=['slurmagent','prolog']\n"
            "from slurmagent.entry import main\nrc = main(['prolog'])\n"
            "bad = [m for m in sys.modules if m.startswith(('google', 'click'))]\n"
            "print('RC', rc, 'BAD', bad)\n")
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), SLURMD_NODENAME=NODE, SLURM_JOB_ID="5")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "RC 0 BAD []" in proc.stdout, proc.stdout + proc.stderr
    rec = read_records(tmp_path / "state" / NODE / "hooks.log")[-1]
    assert rec["verdict"] == "healthy"


# --- metadata server: long poll, deadlines -----------------------------------------------------


@pytest.fixture
def blackhole(monkeypatch):
    """A metadata 'server' that accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{s.getsockname()[1]}")
    metadata.reset_cache()
    yield s
    s.close()
    metadata.reset_cache()


def requests_received(sink: socket.socket) -> list[str]:
    """The request lines of the connections waiting on a listening socket that never answers
    (its accept queue): what a client asked for and gave up on."""
    got = []
    sink.setblocking(False)
    while True:
        try:
            conn, _ = sink.accept()
        except BlockingIOError:
            return got
        with conn:
            conn.settimeout(5)
            try:
                got.append(conn.recv(4096).decode(errors="replace").split("\r\n", 1)[0])
            except OSError:
                got.append("")


def test_unreachable_metadata_once_no_hang_one_line(blackhole, tmp_path):
    """A metadata server that never answers costs `--once` one request and its timeout, then
    one line. Counted at the server, not in wall seconds (the interpreter's start alone can take
    seconds on a loaded machine); the bound on the run only catches a hang."""
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[hooks]\nsyslog = false\n'
                      '[expiry]\nmetadata_timeout_s = 1.5\npublish_run_file = false\n')  # no project/zone either
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO))
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "expiry-watch", "--once", "--node", NODE],
                          env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert proc.returncode == 0 and took < 1.5 + 40, (took, proc.stderr)
    asked = requests_received(blackhole)
    assert len(asked) == 1 and asked[0].startswith("GET /computeMetadata/v1/instance/"), asked
    assert "wait_for_change" not in asked[0]  # --once never long-polls
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "metadata server" in lines[0] and "did not answer" in lines[0] and "set [gcp] project and zone" in lines[0]
    assert "deadline 1.5 s" in lines[0]  # the configured timeout, not a default


def test_unreachable_metadata_loop_says_it_once(blackhole, tmp_path):
    cfg = make_cfg(tmp_path, termination_time=iso(time.time() + 86400), metadata_timeout_s=0.3)
    out, err, stop = io.StringIO(), io.StringIO(), threading.Event()
    th = threading.Thread(target=expiry.run_expiry_watch, args=(cfg, NODE),
                          kwargs=dict(interval_s=0.3, out=out, err=err, slurm=Slurm(runner=slurm_with()), stop=stop))
    th.start()
    time.sleep(3)
    stop.set()
    th.join(10)
    assert not th.is_alive()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "did not answer" in lines[0] and "not watched" in lines[0], err.getvalue()


def test_once_runs_say_a_lasting_metadata_outage_once_and_its_end_in_one_line(tmp_path, monkeypatch):
    """60 `expiry-watch --once` runs (the timer's 30 min) against a metadata server that stays
    down: the error is said and logged once; the run after it is back says so in one line."""
    from support.fake_gcp import FakeGcp

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused at once
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed.getsockname()[1]}")
    metadata.reset_cache()
    cfg = make_cfg(tmp_path, termination_time=iso(time.time() + 86400), metadata_timeout_s=0.5)
    slurm = Slurm(runner=slurm_with())
    err = io.StringIO()
    try:
        for _ in range(60):
            assert expiry.run_expiry_watch(cfg, NODE, once=True, out=io.StringIO(), err=err, slurm=slurm) == 0
        down_lines = err.getvalue().splitlines()
        fake = FakeGcp().start()
        fake.metadata.update({"instance/maintenance-event": "NONE", "instance/preempted": "FALSE"})
        monkeypatch.setenv("GCE_METADATA_HOST", fake.host)
        metadata.reset_cache()
        for _ in range(3):
            expiry.run_expiry_watch(cfg, NODE, once=True, out=io.StringIO(), err=err, slurm=slurm)
        fake.stop()
    finally:
        closed.close()
        metadata.reset_cache()
    assert len(down_lines) == 1 and "metadata server" in down_lines[0], down_lines
    lines = err.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[1].startswith(f"slurmagent expiry-watch: {NODE}: cleared: no error now (since ")
    assert down_lines[0].split(f"{NODE}: ", 1)[1] in lines[1]
    logged = [r for r in read_records(expiry.decision_log_path(cfg, NODE)) if r.get("event") == "expiry-watch"]
    assert [bool(r.get("errors")) for r in logged] == [True, False], logged
    assert logged[1]["said"][0].startswith("cleared: ")
    assert expiry_state.SAID_KEY not in expiry_state.load(cfg, NODE)


def test_errors_to_say_repeats_a_lasting_error_hourly_and_says_a_change_at_once():
    said, rec = expiry_state.errors_to_say(None, ["down"], T0)
    assert said == ["down"] and rec["errors"] == ["down"]
    old = {expiry_state.SAID_KEY: rec}
    assert expiry_state.errors_to_say(old, ["down"], T0 + 3599) == ([], rec)
    again, rec2 = expiry_state.errors_to_say(old, ["down"], T0 + 3600)
    assert again == [f"down (still, since {iso(T0)})"] and rec2["said_at"] == T0 + 3600 and rec2["since"] == iso(T0)
    changed, rec3 = expiry_state.errors_to_say(old, ["down", "api 503"], T0 + 60)
    assert changed == ["down", "api 503"] and rec3["errors"] == ["down", "api 503"]
    assert expiry_state.errors_to_say(old, [], T0 + 90) == ([f"cleared: no error now (since {iso(T0)}: down)"], None)
    assert expiry_state.errors_to_say({}, [], T0) == ([], None)


# --- systemd units ------------------------------------------------------------------------------


def test_units_are_consistent():
    svc = (REPO / "systemd" / "slurmagent-expiry.service").read_text()
    timer = (REPO / "systemd" / "slurmagent-expiry.timer").read_text()
    assert "Type=oneshot" in svc and "expiry-watch --once" in svc
    for key in ("ProtectSystem=strict", "PrivateTmp=yes", "NoNewPrivileges=yes", "ReadWritePaths=/var/lib/slurmagent",
                "RuntimeDirectory=slurmagent"):
        assert key in svc, key
    assert "Unit=slurmagent-expiry.service" in timer and "OnUnitActiveSec=30s" in timer and "AccuracySec=" in timer


def systemd_analyze() -> str:
    """systemd-analyze (Debian's systemd package: the host and both chroot lanes have it);
    missing, the test skips outside CI and fails in CI."""
    tool = shutil.which("systemd-analyze") or next(
        (p for p in ("/usr/bin/systemd-analyze", "/bin/systemd-analyze") if os.access(p, os.X_OK)), None)
    if tool:
        return tool
    lane = chroot_lane()
    why = "systemd-analyze not installed (apt-get install systemd)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}: CI must verify the units{f' (the Debian {lane} chroot lane)' if lane else ''}")
    pytest.skip(why)


def test_units_pass_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` of the timer and its service as installed: no running systemd or
    bus is needed (it loads the files; --man=no: no man page lookups). It exits 0 on an unknown
    key or a value it cannot parse ("Failed to parse ..., ignoring"), so any line it prints
    about our units fails the test; a failure of the tool itself fails it too, never a skip."""
    tool = systemd_analyze()
    binary = Path(sys.prefix) / "bin" / "slurmagent"
    if not os.access(binary, os.X_OK):  # not installed in this environment: verify checks only that it is executable
        binary = tmp_path / "bin" / "slurmagent"
        binary.parent.mkdir()
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(0o755)
    for name in ("slurmagent-expiry.service", "slurmagent-expiry.timer"):
        text = (REPO / "systemd" / name).read_text()
        assert "/opt/slurmagent/venv/bin/slurmagent" in text or name.endswith(".timer"), name
        (tmp_path / name).write_text(text.replace("/opt/slurmagent/venv/bin/slurmagent", str(binary)))
    proc = subprocess.run([tool, "verify", "--man=no", str(tmp_path / "slurmagent-expiry.timer"),
                           str(tmp_path / "slurmagent-expiry.service")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice", SYSTEMD_COLORS="0", SYSTEMD_PAGER=""))
    said = (proc.stdout + proc.stderr).strip()
    problems = [line for line in said.splitlines() if "slurmagent-expiry" in line]
    assert proc.returncode == 0 and not problems, f"systemd-analyze verify (exit {proc.returncode}):\n{said}"


# --- bench/expiry_sim.py --------------------------------------------------------------------


def test_expiry_sim_model_on_a_hand_case():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import expiry_sim as sim
    finally:
        sys.path.remove(str(REPO / "bench"))
    H = sim.H
    long_job = [sim.Job(limit_s=12 * H, run_s=11 * H, ckpt_s=60.0)]
    a = sim.simulate(10 * H, long_job, "a")
    assert a.work == 10 * H and a.restart == sim.RESTART_S
    b = sim.simulate(10 * H, long_job, "b")
    assert b.work < sim.PERIODIC_S + 60 and b.stall > 0
    c = sim.simulate(10 * H, long_job, "c")
    assert c.work == 0 and c.flushed == 1 and c.total == 60 + (60 + sim.RESTART_S) + (sim.FLUSH_LEAD_S - 60)
    d = sim.simulate(10 * H, long_job, "d")
    assert d.idle == 10 * H  # the guard keeps the 12 h job off and drains the node
    short = [sim.Job(H, 0.5 * H, 15.0)] * 40
    assert sim.simulate(10 * H, short, "c").idle == pytest.approx(sim.DRAIN_LEAD_S)
    assert sim.run(3, 7, 8) == sim.run(3, 7, 8)  # deterministic
