"""A GPU that fails under running jobs, without a cluster: which faults move jobs, the
journaled once-per-job requeue, the fault flush of wrapped jobs, the breaker, the epilog."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from support import healthy_snapshot_dict, write_json, xid_snapshot_dict
from support.fakes.slurm import FakeSlurm
from slurmagent.actions.executor import JournalExecutor
from slurmagent.state import metrics
from slurmagent.policy import eviction as eviction_policy
from slurmagent.actions.eviction import FaultEviction
from slurmagent.core.checks import Finding, Severity, xid_finding
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import DecisionLog, read_records
from slurmagent.commands.healthcheck import run_healthcheck
from slurmagent.state.journal import Journal
from slurmagent.slurm.model import FAULT_FLUSH_SIGNAL, JobInfo, running_jobs_from_text
from slurmagent.gpu.nvml import XidEvent
from slurmagent.errors import SlurmError
from slurmagent.slurm.commands import Slurm
from slurmagent.commands.watch import Watcher
from test_hooks_unit import XID79, Harness as HookHarness

WRAPPED = "#!/bin/sh\nexec /usr/bin/python3 -m slurmagent.entry run \"$@\"\n"
PLAIN = "#!/bin/sh\npython train.py\n"
PWR = f"--signal={int(FAULT_FLUSH_SIGNAL)}"


def cfg_for(tmp_path: Path, **watch):
    return parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                  "watch": watch, "slurm": {"timeout_s": 3}})


def drain(rule: str, observed=None) -> Finding:
    return Finding(rule, Severity.DRAIN, 0, rule, observed)


# --- which faults make the jobs leave ---------------------------------------------------------


@pytest.mark.parametrize("finding,evicts", [
    (xid_finding(79, 3), True),   # fallen off the bus: node reboot
    (xid_finding(48, 0), True),   # double-bit ECC: GPU reset
    (xid_finding(95, 0), True),   # uncontained memory error: GPU reset
    (xid_finding(119, 0), True),  # GSP RPC timeout: GPU reset
    (xid_finding(154, 0, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"), True),
    (xid_finding(54, 0), False),  # drains (check mechanicals) but the GPU may still work
    (xid_finding(13, 0), False), (xid_finding(31, 0), False), (xid_finding(43, 0), False),
    (xid_finding(45, 0), False),  # application class: never
    (xid_finding(144, 0, "NVLink: Nonfatal error"), False),
    (drain("gpu-lost", True), True), (drain("gpu-count", 7), True), (drain("nvml-error", "x"), True),
    (drain("recovery-action", 1), True), (drain("recovery-action", 3), False),
    (drain("hw-slowdown", "x"), False), (drain("pcie-width", 8), False), (drain("nvml-timeout", 15), False),
    (Finding("gpu-lost", Severity.WARN, 0, "x", True), False),
])
def test_which_findings_make_running_jobs_leave(finding, evicts):
    assert eviction_policy.evicts_jobs([finding]) is evicts


def test_decide_requeue_once_per_restart_count():
    def job(state="RUNNING", restarts=0, requeue=True):
        return JobInfo("7", state, restarts=restarts, requeue=requeue)

    assert eviction_policy.decide_fault_requeue(job(), 0, cancel=True) == "requeue"
    assert eviction_policy.decide_fault_requeue(job(restarts=1), 0, cancel=True) == "already requeued"
    assert eviction_policy.decide_fault_requeue(job(restarts=1), 1, cancel=True) == "requeue"  # a new fault, a new life
    assert eviction_policy.decide_fault_requeue(job("PENDING", 1), 0, cancel=True) == "already requeued"
    assert eviction_policy.decide_fault_requeue(job("COMPLETED"), 0, cancel=True) == "job COMPLETED"
    assert eviction_policy.decide_fault_requeue(job(requeue=False), 0, cancel=True) == "cancel"
    assert eviction_policy.decide_fault_requeue(job(requeue=False), 0, cancel=False) == "not requeueable"
    assert eviction_policy.decide_fault_requeue(None, 0, cancel=True) == "job gone"


def test_running_jobs_parse_squeue_format():
    jobs = running_jobs_from_text("12|0|1|1|\n13|2|0|4|\n12|0|1|1|\n\n")
    assert [(j.job_id, j.restarts, j.requeue, j.num_nodes) for j in jobs] == [("12", 0, True, 1), ("13", 2, False, 4)]


# --- the eviction through the action layer ------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def eviction(tmp_path, sc, node="n1", clock=None, **watch):
    cfg = cfg_for(tmp_path, **watch)
    log = DecisionLog(tmp_path / "log" / "hooks.log", use_syslog=False)
    clock = clock or Clock()
    return FaultEviction(cfg, Slurm(runner=sc), node, clock(), source="watch",
                         reason="slurmagent: xid 79 on gpu 3 (fallen off the bus)", log=log, clock=clock)


def decisions(tmp_path) -> list[dict]:
    return [d for d in read_records(tmp_path / "log" / "hooks.log") if d["event"] == "fault-evict"]


def test_unwrapped_requeued_not_requeueable_cancelled_wrapped_flushed(tmp_path):
    sc = FakeSlurm(("n1", "n2"))
    sc.add_job("11", script=PLAIN)
    sc.add_job("12", script=PLAIN, Requeue="0")
    sc.add_job("13", script=WRAPPED)
    sc.add_job("14", node="n2", script=PLAIN)  # elsewhere: untouched
    ev = eviction(tmp_path, sc)
    leaves = {j.job.job_id: j for j in ev.start()}
    assert set(leaves) == {"11", "12", "13"}
    assert len(sc.of("squeue")) == 1  # one call finds the node's jobs
    assert sc.of("scancel", "--batch", PWR) == [["scancel", "--batch", PWR, "13"]]
    assert sc.jobs["11"]["JobState"] == "PENDING" and sc.jobs["11"]["Restarts"] == "1"
    assert sc.jobs["12"]["JobState"] == "CANCELLED"
    assert sc.jobs["13"]["JobState"] == "RUNNING" and sc.jobs["14"]["JobState"] == "RUNNING"
    assert (leaves["11"].action, leaves["11"].requeued_by) == ("requeued", "slurmagent")
    assert leaves["12"].action == "cancelled (not requeueable)"
    assert leaves["13"].action == "fault flush signalled" and not ev.done
    done = Journal.for_config(ev.cfg, "n1").done()
    assert sorted((e.kind, e.payload["job_id"], e.outcome) for e in done) == [
        ("fault-requeue", "11", "requeued"), ("fault-requeue", "12", "cancelled (not requeueable)")]
    lines = {d["job"]: d for d in decisions(tmp_path)}
    assert lines["11"]["fault_to_leave_s"] >= 0 and lines["11"]["requeued_by"] == "slurmagent"
    assert lines["13"]["wrapped"] is True and "fault_to_leave_s" not in lines["13"]
    values = metrics.read_values(tmp_path / "state" / "n1")
    assert values['slurmagent_jobs_requeued_on_fault_total{by="slurmagent"}'] == 1
    assert values["slurmagent_jobs_cancelled_on_fault_total"] == 1


def test_flushed_job_that_requeued_itself_is_followed_off_the_node(tmp_path):
    sc = FakeSlurm()
    sc.add_job("13", script=WRAPPED)
    clock = Clock()
    ev = eviction(tmp_path, sc, clock=clock)
    ev.start()
    clock.now += 2
    assert ev.poll() == []  # still flushing
    sc.jobs["13"].update(JobState="COMPLETING", Restarts="1")  # its wrapper requeued it
    clock.now += 1.5
    (leave,) = ev.poll()
    assert ev.done and leave.action == "flushed and requeued by its wrapper" and leave.left_after_s == 3.5
    assert sc.of("scontrol", "requeue") == []  # the watch never requeued it
    assert decisions(tmp_path)[-1]["fault_to_leave_s"] == 3.5
    values = metrics.read_values(tmp_path / "state" / "n1")
    assert values['slurmagent_jobs_requeued_on_fault_total{by="wrapper"}'] == 1
    assert values["slurmagent_fault_to_leave_seconds"] == 3.5


def test_flushed_job_still_there_after_the_deadline_is_requeued(tmp_path):
    sc = FakeSlurm()
    sc.add_job("13", script=WRAPPED)
    clock = Clock()
    ev = eviction(tmp_path, sc, clock=clock, flush_deadline_s=30.0)
    ev.start()
    clock.now += 29
    assert ev.poll() == [] and sc.jobs["13"]["JobState"] == "RUNNING"
    clock.now += 1
    (leave,) = ev.poll()
    assert leave.action == "still on the node after the deadline: requeued" and leave.requeued_by == "slurmagent"
    assert sc.jobs["13"]["Restarts"] == "1" and ev.done


def test_leave_mode_only_drains_but_still_flushes_wrapped(tmp_path):
    sc = FakeSlurm()
    sc.add_job("11", script=PLAIN)
    sc.add_job("13", script=WRAPPED)
    clock = Clock()
    ev = eviction(tmp_path, sc, clock=clock, running_jobs="leave", flush_deadline_s=10.0)
    leaves = {j.job.job_id: j for j in ev.start()}
    assert leaves["11"].action == "left alone (running_jobs = leave)"
    assert leaves["13"].action == "fault flush signalled"
    clock.now += 11
    (late,) = ev.poll()
    assert late.action.endswith("left alone (running_jobs = leave)") and ev.done
    assert sc.of("scontrol", "requeue") == [] and sc.jobs["11"]["JobState"] == "RUNNING"


def test_multi_node_job_is_requeued_once_whichever_nodes_ask(tmp_path):
    sc = FakeSlurm(("n1", "n2"))
    sc.add_job("21", node="n[1-2]", script=PLAIN)
    seen_by_n2 = Slurm(runner=sc).running_jobs("n2")  # n2's watch listed it before n1 requeued it
    eviction(tmp_path, sc, "n1").start()
    assert sc.jobs["21"]["Restarts"] == "1"
    late = eviction(tmp_path, sc, "n2")
    late.jobs.append(late._leave(seen_by_n2[0], wrapped=False, fresh=True))  # n2's request, one moment later
    assert late.jobs[0].action == "nothing to do (already requeued)"
    assert eviction(tmp_path, sc, "n2").start() == []  # and a later look finds nothing running there
    sc.jobs["21"]["JobState"] = "RUNNING"  # restarted; a replay of the old request must not hit this life
    executor = JournalExecutor(cfg_for(tmp_path), Slurm(runner=sc), "n2")
    outcome = executor.fault_requeue("21", 0, fresh=False)
    assert outcome == "nothing to do (already requeued)"
    assert sc.jobs["21"]["Restarts"] == "1" and len(sc.of("scontrol", "requeue")) == 2  # one refused by Slurm


# --- the watch: breaker, application XIDs, transient faults ----------------------------------


def watcher(tmp_path, sc) -> Watcher:
    cfg = parse({"state_dir": str(tmp_path / "state"), "hooks": {"syslog": False},
                 "health": {"kernel_log_enabled": False,
                            "snapshot": str(write_json(tmp_path / "snap.json", healthy_snapshot_dict()))}})
    return Watcher(cfg, "n1", Slurm(runner=sc), use_nvml=False, stderr=io.StringIO(), env={})


def test_watch_xid79_under_a_running_job_requeues_it_after_the_drain(tmp_path):
    sc = FakeSlurm()
    sc.add_job("31", script=PLAIN)
    w = watcher(tmp_path, sc)
    assert w.judge([XidEvent(79, 3, "nvml")]) == "drained"
    verbs = sc.verbs()
    assert verbs.index("update") < verbs.index("squeue") < verbs.index("requeue")
    assert sc.jobs["31"]["JobState"] == "PENDING"
    assert w.judge([XidEvent(79, 3, "kernel_log")]) == "already-drained"  # the same fault again
    assert len(sc.of("scontrol", "requeue")) == 1


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_watch_application_xid_never_touches_a_running_job(tmp_path, code):
    sc = FakeSlurm()
    sc.add_job("31", script=PLAIN)
    w = watcher(tmp_path, sc)
    assert w.judge([XidEvent(code, 3, "nvml")]) is None
    assert sc.calls == [] and sc.jobs["31"]["JobState"] == "RUNNING"


def test_watch_drain_only_xid_leaves_the_running_job(tmp_path):
    sc = FakeSlurm()
    sc.add_job("31", script=PLAIN)
    w = watcher(tmp_path, sc)
    assert w.judge([XidEvent(54, 0, "nvml")]) == "drained"  # auxiliary power: drain, let it run
    assert sc.of("squeue") == [] and sc.jobs["31"]["JobState"] == "RUNNING"


def test_watch_breaker_holding_the_drain_back_requeues_nothing(tmp_path):
    sc = FakeSlurm.cluster(8)
    for n in ("n5", "n6"):  # 2 of 8 = the breaker's limit at 0.25
        sc.nodes[n].update(State="IDLE+DRAIN", Reason="slurmagent: xid 48 on gpu 0 (double bit ecc error)")
    sc.add_job("31", script=PLAIN)
    w = watcher(tmp_path, sc)
    assert w.judge([XidEvent(79, 3, "nvml")]) == "suppressed-by-breaker"
    assert sc.of("squeue") == [] and sc.of("scontrol", "requeue") == []
    assert sc.jobs["31"]["JobState"] == "RUNNING"


# --- healthcheck ---------------------------------------------------------------------------------


def healthcheck(tmp_path, sc, snap: dict) -> int:
    cfg = parse({"state_dir": str(tmp_path / "state"), "hooks": {"syslog": False},
                 "health": {"kernel_log_enabled": False, "expected_gpus": 8,
                            "snapshot": str(write_json(tmp_path / "snap.json", snap))}})
    return run_healthcheck("n1", lambda: cfg, slurm_factory=lambda c: Slurm(runner=sc), skip_recent=0,
                           stderr=io.StringIO())


def test_healthcheck_lost_gpu_requeues_the_running_job(tmp_path):
    sc = FakeSlurm()
    sc.add_job("31", script=PLAIN)
    snap = healthy_snapshot_dict()
    snap["gpus"][2]["lost"] = True
    assert healthcheck(tmp_path, sc, snap) == 1
    assert sc.jobs["31"]["JobState"] == "PENDING" and "DRAIN" in sc.state
    records = read_records(tmp_path / "state" / "hooks.log")
    (d,) = [d for d in records if d["event"] == "fault-evict"]
    assert (d["source"], d["job"], d["action"]) == ("healthcheck", "31", "requeued")
    (hc,) = [d for d in records if d["event"] == "healthcheck"]
    assert (hc["action"], hc["running_jobs"]) == ("drained", "1 running job(s) off the node")


def test_healthcheck_pcie_width_drains_but_leaves_the_job(tmp_path):
    sc = FakeSlurm()
    sc.add_job("31", script=PLAIN)
    snap = healthy_snapshot_dict()
    snap["gpus"][1]["pcie"]["width"] = 8
    assert healthcheck(tmp_path, sc, snap) == 1
    assert "DRAIN" in sc.state and sc.of("squeue") == [] and sc.jobs["31"]["JobState"] == "RUNNING"


# --- the epilog of a job the watch requeued ------------------------------------------------------


def test_epilog_does_not_requeue_a_job_already_requeued(tmp_path):
    h = HookHarness(tmp_path)
    h.scontrol.jobs["42"].update(JobState="PENDING", Restarts="1")  # the watch requeued it
    assert h.run("epilog", XID79, {"SLURM_JOB_EXIT_CODE": "15"}) == 0
    assert h.scontrol.jobs["42"]["Restarts"] == "1"
    (d,) = h.decisions()
    assert d["action"] == "drained,nothing to do (already requeued)"
    assert not Journal.for_config(h.cfg, "n1").has_pending()  # nothing left to retry in a later life


# --- the one internal-error answer; the executor without a journal ----------------------------


def test_healthcheck_fails_closed_without_handing_a_bad_node_name_to_scontrol(tmp_path):
    """One internal-error answer for prolog and healthcheck: a node name that is not one is
    never drained (scontrol would read `State=...` in it), the check still fails closed."""
    sc = FakeSlurm()
    cfg = parse({"state_dir": str(tmp_path / "state"), "hooks": {"syslog": False, "on_internal_error": "closed"}})
    err = io.StringIO()

    def broken(*_):
        raise RuntimeError("boom")

    code = run_healthcheck("n1 State=RESUME", lambda: cfg, broken, slurm_factory=lambda c: Slurm(runner=sc),
                           skip_recent=0, stderr=err)
    assert code == 1 and sc.argvs == []
    assert "internal error (not a GPU fault): RuntimeError: boom; no drain: invalid node name" in err.getvalue()


def test_an_executor_without_a_journal_acts_once_and_raises_slurms_refusal(tmp_path):
    """The wrapper (the job's user, no root journal) requeues through the same API: the held
    `requeuehold State=SpecialExit` goes to scontrol as asked, nothing is journaled, and a
    refusal is raised to the wrapper, which retries or gives up by its own rules."""
    calls: list[list[str]] = []

    def scontrol(argv, timeout):
        calls.append(argv[1:])
        refused = len(calls) > 1
        return subprocess.CompletedProcess(argv, int(refused), "", "Job is pending execution for job 7\n" * refused)

    user = JournalExecutor(cfg_for(tmp_path), Slurm(runner=scontrol), "n1", journal=None)
    assert user.requeue_jobs(["7"], hold=True, special_exit=True) == "requeued"
    assert calls == [["requeuehold", "State=SpecialExit", "7"]]
    with pytest.raises(SlurmError, match="pending execution"):
        user.requeue_jobs(["7"])
    assert calls[1] == ["requeue", "7"] and not (tmp_path / "state").exists()


def test_the_journal_backlog_is_a_metric_that_empties_when_slurm_is_back(tmp_path):
    """A drain Slurm could not take stays journaled; `slurmagent_journal_pending` says so
    until a replay carries it out (the alert on a backlog that does not drain needs it)."""
    sc = FakeSlurm(("n1", "n2"))
    executor = JournalExecutor(cfg_for(tmp_path), Slurm(runner=sc), "n1")
    prom = tmp_path / "state" / "n1" / "slurmagent.prom"
    sc.down = True
    outcome = executor.drain_fault("slurmagent: xid 79 on gpu 3 (fallen off the bus)", node="n1")
    assert "DRAIN" not in sc.nodes["n1"]["State"], outcome
    assert "slurmagent_journal_pending 1\n" in prom.read_text()
    sc.down = False
    executor.replay()
    assert "DRAIN" in sc.nodes["n1"]["State"]
    assert "slurmagent_journal_pending 0\n" in prom.read_text()
