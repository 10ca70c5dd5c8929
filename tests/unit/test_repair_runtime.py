"""repair.py's runtime against an in-memory scontrol (fast, no cluster): journal replay,
unjournaled fallback, crash-replay of a repair request, status while slurmctld is down."""

from __future__ import annotations

import io
import json

from support.fakes.slurm import FakeSlurm
from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.state.journal import Journal
from slurmagent.actions.executor import JournalExecutor
from slurmagent.commands.repair import run_repair
from slurmagent.commands.status import collect_status, format_status
from slurmagent.slurm.commands import Slurm

XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"


def cfg_for(tmp_path, fraction=1.0, strategy="recreate"):
    return parse({"state_dir": str(tmp_path / "state" / "%n"),
                  "gcp": {"project": "p", "zone": "z", "compute_endpoint": "http://127.0.0.1:9"},
                  "repair": {"max_drained_fraction": fraction, "strategy": strategy}})


def test_drain_waits_in_the_journal_while_slurmctld_is_down(tmp_path):
    sc = FakeSlurm.cluster(8)
    cfg = cfg_for(tmp_path)
    executor = JournalExecutor(cfg, Slurm(runner=sc), "n1")
    sc.down = True
    outcome = executor.drain_fault(XID79).action
    assert outcome.startswith("drain-failed: pending in the journal: slurmctld unreachable")
    assert len(sc.argvs) == 1  # stopped at the first unreachable call
    sc.down = False
    results = JournalExecutor(cfg, Slurm(runner=sc), "n1").replay()
    assert [o for _, o in results] == ["drained"]
    assert sc.nodes["n1"]["Reason"] == XID79 and sc.nodes["n1"]["State"] == "IDLE+DRAIN"
    assert JournalExecutor(cfg, Slurm(runner=sc), "n1").drain_fault(XID79).action == "already-drained"


def test_unwritable_state_dir_still_drains_unjournaled(tmp_path, capfd):
    (tmp_path / "state").write_text("not a directory")  # mkdir under it fails even for root
    sc = FakeSlurm.cluster(8)
    outcome = JournalExecutor(cfg_for(tmp_path), Slurm(runner=sc), "n1").drain_fault(XID79).action
    assert outcome == "drained" and "IDLE+DRAIN" == sc.nodes["n1"]["State"]
    assert "trying it unjournaled" in capfd.readouterr().err


class StubCompute:
    def __init__(self):
        self.recreates = []
        self.total_calls = 0

    def recreate(self, mig, instances, request_id, deadline_s=None):
        self.recreates.append((mig.name, instances, request_id))
        self.total_calls += 1
        from slurmagent.gcp.compute import OpRef

        return [OpRef("zones", "z", f"op-{len(self.recreates)}")]

    def wait(self, op, deadline_s=None):
        self.total_calls += 1


def test_a_repair_request_cut_short_is_replayed_with_the_same_request_id(tmp_path):
    sc = FakeSlurm.cluster(8)
    cfg = cfg_for(tmp_path)
    sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    # a previous `repair` journaled its request and died before sending it
    j = Journal.for_config(cfg, "ctl")
    j.add("repair", strategy="recreate", project="p", request_id="0b3e6d3c-4a3f-4f55-9a0a-7d1f7c1f9e11",
          mig={"project": "1", "scope": "zones", "location": "z", "name": "mig-a"},
          nodes={"n2": {"zone": "z", "reason": XID79}}, deadline_s=5)
    stub = StubCompute()
    out = io.StringIO()
    res = run_repair(cfg, [], slurm=Slurm(runner=sc), compute_factory=lambda p: stub, local_node="ctl", out=out,
                     err=io.StringIO())
    assert stub.recreates == [("mig-a", [("z", "n2")], "0b3e6d3c-4a3f-4f55-9a0a-7d1f7c1f9e11")]
    assert "journal: replayed repair n2: requested" in out.getvalue()
    assert sc.nodes["n2"]["Reason"] == reasons.repairing_reason(XID79)
    assert "n2" in res.skipped and not res.failed  # the fresh plan sees it as already requested
    assert not j.has_pending()


def test_status_while_slurmctld_is_down_shows_the_backlog(tmp_path):
    sc = FakeSlurm.cluster(8)
    cfg = cfg_for(tmp_path)
    sc.down = True
    JournalExecutor(cfg, Slurm(runner=sc), "n3").drain_fault(XID79)
    st = collect_status(cfg, Slurm(runner=sc), local_node="n3")
    assert st["slurm_error"] and st["journal"]["pending"] == 1
    text = format_status(st)
    assert "cannot read the nodes" in text and "1 pending action(s)" in text and "n3: 1 (drain" in text
    json.dumps(st)  # --json works too


def test_fault_drain_lets_the_job_run_only_when_suppressed_and_gpus_usable(tmp_path):
    from slurmagent.core.checks import Finding, Severity

    sc = FakeSlurm.cluster(4)
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason=XID79)  # the one allowed drain is taken
    cfg = cfg_for(tmp_path, fraction=0.25)
    slow = [Finding("hw-slowdown", Severity.DRAIN, 0, "clocks slowed by hw_power_brake_slowdown", [])]
    lost = [Finding("gpu-lost", Severity.DRAIN, 1, "GPU is lost", True)]
    d = JournalExecutor(cfg, Slurm(runner=sc), "n2").drain_fault("slurmagent: hw-slowdown: gpu 0", slow, source="prolog",
                                                             job="7", takeover_prolog_error=True)
    assert d.suppressed and not d.blocks_job and sc.nodes["n2"]["State"] == "IDLE"
    assert sc.nodes["n2"]["Comment"].startswith("slurmagent suppressed@")
    d = JournalExecutor(cfg, Slurm(runner=sc), "n3").drain_fault("slurmagent: gpu-lost: gpu 1", lost, source="prolog",
                                                             job="8", takeover_prolog_error=True)
    assert d.suppressed and d.blocks_job
    assert (tmp_path / "state" / "n2" / "breaker-suppressed").exists()


def test_replayed_requeue_and_release_look_before_they_act(tmp_path):
    sc = FakeSlurm.cluster(8)
    cfg = cfg_for(tmp_path)
    sc.add_job("11", "FAILED")
    sc.add_job("12", "RUNNING", Restarts="1")
    sc.add_job("13", "PENDING", Reason="JobHeldAdmin", Restarts="1")
    sc.add_job("14", "PENDING", Reason="BeginTime", Restarts="1")
    j = Journal.for_config(cfg, "n1")
    j.add("requeue", job_ids=["11", "12"], fresh=True)
    j.mark_failed_attempt(j.pending()[0], "slurmctld unreachable")  # the first try failed
    j.add("release", job_id="13")
    j.add("release", job_id="14")
    j.add("requeue", job_ids=["99"])
    results = [o for _, o in JournalExecutor(cfg, Slurm(runner=sc), "n1").replay()]
    assert results == ["requeued 11", "released", "nothing to do (job PENDING, not held)",
                       "nothing to do (jobs already requeued, running or gone)"]
    assert sc.jobs["12"]["JobState"] == "RUNNING"  # never requeued a running job on replay
    assert ["requeue", "11"] in [a[1:] for a in sc.argvs]


def test_a_reason_left_on_a_resumed_node_is_not_a_drain(tmp_path):
    """Slurm 24.11 keeps the Reason of a resumed node: it neither counts as a drain nor shows
    in `status` as Slurm's word on a node the breaker held back."""
    sc = FakeSlurm.cluster(4, resume_keeps_reason=True)
    cfg = cfg_for(tmp_path, fraction=0.5)  # 2 of 4 may be drained
    executors = {n: JournalExecutor(cfg, Slurm(runner=sc), n) for n in sc.nodes}
    for n in ("n1", "n3"):
        assert executors[n].drain_fault(XID79).action == "drained"
        assert executors[n].resume(XID79) == "resumed"
        assert sc.nodes[n]["State"] == "IDLE" and sc.nodes[n]["Reason"] == XID79

    assert executors["n2"].drain_fault(XID79).action == "drained"
    assert executors["n1"].drain_fault(XID79).action == "drained"  # not "already-drained"
    assert sc.nodes["n1"]["State"] == "IDLE+DRAIN"
    assert executors["n3"].drain_fault(XID79).action == "suppressed-by-breaker"

    rows = {r["node"]: r for r in collect_status(cfg, Slurm(runner=sc), local_node="n3")["nodes"]}
    assert sorted(rows) == ["n1", "n2", "n3"]
    assert rows["n1"]["repair"] == rows["n2"]["repair"] == "drained"
    assert rows["n3"]["repair"] == "suppressed by breaker" and rows["n3"]["state"] == "IDLE"


def test_an_adopted_foreign_drain_becomes_ours_and_a_slurmsync_down_stays(tmp_path):
    """[repair] adopt_reasons: the Toolkit's GPU prolog drain is re-drained as ours, reason kept."""
    sc = FakeSlurm.cluster(8)
    sc.nodes["n2"].update(State="IDLE+DRAIN", Reason="Prolog error")
    sc.nodes["n3"].update(State="DOWN+NOT_RESPONDING", Reason="Instance terminated")
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "gcp": {"project": "p", "zone": "z"},
                 "repair": {"strategy": "none", "max_drained_fraction": 1.0, "adopt_reasons": ["^Prolog error$"]}})
    out = io.StringIO()
    res = run_repair(cfg, [], slurm=Slurm(runner=sc), local_node="ctl", out=out, err=io.StringIO())
    assert sc.nodes["n2"]["Reason"] == "slurmagent: adopted: Prolog error" and "DRAIN" in sc.nodes["n2"]["State"]
    assert "n2: drained: adopted 'Prolog error'" in out.getvalue()
    assert res.skipped == {"n2": "strategy none"}
    assert sc.nodes["n3"]["Reason"] == "Instance terminated"  # not adopted: untouched


def test_adoption_goes_through_the_circuit_breaker(tmp_path):
    sc = FakeSlurm.cluster(4)
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason=XID79)  # the one drain 25 % of 4 allows
    sc.nodes["n2"].update(State="IDLE+DRAIN", Reason="Prolog error")
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "gcp": {"project": "p", "zone": "z"},
                 "repair": {"strategy": "none", "max_drained_fraction": 0.25, "adopt_reasons": ["Prolog"]}})
    res = run_repair(cfg, [], slurm=Slurm(runner=sc), local_node="ctl", out=io.StringIO(), err=io.StringIO())
    assert sc.nodes["n2"]["Reason"] == "Prolog error"  # still theirs: adopting it would exceed the breaker
    assert res.skipped["n2"] == "suppressed by the circuit breaker"
