"""`repair` by the VM's provisioning model, zones, dynamic nodes, admin resumes and the opt-out:
the runtime against the in-memory scontrol (tests/support/fakes/slurm.py) and the fake Compute API
(tests/support/fake_gcp.py) spoken to by the real google-cloud-compute client."""

from __future__ import annotations

import io
import json

import pytest

from support.fake_gcp import FakeGcp
from support.fakes.slurm import FakeSlurm
from slurmagent.actions.executor import JournalExecutor
from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.state.journal import Journal
from slurmagent.commands.repair import run_repair
from slurmagent.slurm.commands import Slurm

ZONE, ZONE_B = "us-central1-a", "us-central1-b"
XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
SLOW = "slurmagent: hw-slowdown: gpu 0 clocks slowed by hw_power_brake_slowdown"
RECREATE = "instanceGroupManagers.recreateInstances"
RRECREATE = "regionInstanceGroupManagers.recreateInstances"
REPORT = "instances.reportHostAsFaulty"
ULTRA = {"machine_type": "a3-ultragpu-8g", "provisioning_model": "RESERVATION_BOUND",
         "reservation": "SPECIFIC_RESERVATION"}
FLEX = {"machine_type": "a3-ultragpu-8g", "provisioning_model": "FLEX_START"}


@pytest.fixture
def gcp():
    fake = FakeGcp().start()
    yield fake
    fake.stop()


def cfg_for(tmp_path, fake, strategy="auto", gcp=None, repair=None):
    return parse({"state_dir": str(tmp_path / "state" / "%n"),
                  "gcp": {"project": fake.project, "zone": ZONE, "compute_endpoint": fake.url, **(gcp or {})},
                  "repair": {"max_drained_fraction": 1.0, "strategy": strategy, "operation_timeout_s": 20,
                             **(repair or {})}})


def repair(cfg, sc, *names, dry_run=False):
    out, err = io.StringIO(), io.StringIO()
    res = run_repair(cfg, list(names), dry_run=dry_run, slurm=Slurm(runner=sc), local_node="ctl", out=out, err=err)
    return res, out.getvalue(), err.getvalue()


def drain(sc, names, reason=XID79, state="IDLE+DRAIN"):
    for n in names:
        sc.nodes[n].update(State=state, Reason=reason)


def journal_done(tmp_path, kind=None):
    done = [json.loads(p.read_text()) for p in sorted((tmp_path / "state" / "ctl" / "journal" / "done").glob("*.json"))]
    return [d for d in done if kind is None or d["kind"] == kind]


def repairs_metric(tmp_path) -> dict[tuple[str, str], float]:
    """`slurmagent_repairs_total{action,result}` as Prometheus's parser reads the node's textfile."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (tmp_path / "state" / "ctl" / "slurmagent.prom").read_text()
    return {(s.labels["action"], s.labels["result"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "slurmagent_repairs_total"}


# --- auto: by provisioning model -------------------------------------------------------------


def test_flex_and_reserved_a3_ultra_drained_together_get_recreate_and_report(tmp_path, gcp):
    sc = FakeSlurm.cluster(4)
    gcp.add_instance("n1", ZONE, mig="mig-flex", **FLEX)
    gcp.add_instance("n2", ZONE, mig="mig-flex", **FLEX)
    gcp.add_instance("n3", ZONE, mig="mig-resv", **ULTRA)
    drain(sc, ["n1", "n2"])
    drain(sc, ["n3"], SLOW)
    cfg = cfg_for(tmp_path, gcp)

    res, out, err = repair(cfg, sc)

    assert res.exit_code == 0, err
    [rec] = gcp.calls_of(RECREATE)  # one call for the MIG's two flex VMs
    assert rec.path.endswith("/mig-flex/recreateInstances")
    assert rec.body["instances"] == [f"zones/{ZONE}/instances/n1", f"zones/{ZONE}/instances/n2"]
    [rep] = gcp.calls_of(REPORT)
    assert rep.path.split("/")[-2] == "n3" and rep.body["faultReasons"][0]["behavior"] == "PERFORMANCE"
    assert gcp.instances[(ZONE, "n3")].recreated == 0 and gcp.instances[(ZONE, "n3")].reported == 1
    assert "n3: reported host as faulty (PERFORMANCE)" in out and "running reservation-bound a3-ultragpu-8g" in out
    assert "n1: recreate requested via MIG" in out
    for n in ("n1", "n2", "n3"):
        assert sc.nodes[n]["Reason"].startswith("slurmagent: repairing:")
    # a second run asks nothing again
    before = len(gcp.mutations)
    res, out, _ = repair(cfg, sc)
    assert len(gcp.mutations) == before and out.count("repair already requested") == 3


@pytest.mark.parametrize("in_operation", [False, True])
def test_a_refused_report_falls_back_to_recreate_journaled(tmp_path, gcp, in_operation):
    sc = FakeSlurm.cluster(3)
    gcp.refuse_in_operation = in_operation
    gcp.add_instance("n1", ZONE, mig="mig-a", **ULTRA, refuse="INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED")
    gcp.add_instance("n2", ZONE, mig="mig-a", **FLEX)
    drain(sc, ["n1", "n2"])
    cfg = cfg_for(tmp_path, gcp)

    res, out, err = repair(cfg, sc)

    assert res.exit_code == 0, err
    assert len(gcp.calls_of(REPORT)) == 1
    [rec] = gcp.calls_of(RECREATE)  # the refused node joins its MIG's recreate: still one call
    assert rec.body["instances"] == [f"zones/{ZONE}/instances/n1", f"zones/{ZONE}/instances/n2"]
    assert "n1: reportHostAsFaulty refused" in out and "recreate via its MIG instead" in out
    reports = journal_done(tmp_path, "repair")
    refused = [d for d in reports if d["payload"]["strategy"] == "report-faulty"]
    assert refused[0]["outcome"].startswith("refused: ") and "falling back to recreate via MIG" in refused[0]["outcome"]
    assert "INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED" in refused[0]["outcome"]
    [recreated] = [d for d in reports if d["payload"]["strategy"] == "recreate"]
    assert list(recreated["payload"]["fallback"]) == ["n1"] and recreated["outcome"].startswith("requested")
    # the node's metrics count each node once per action and result
    assert repairs_metric(tmp_path) == {("recreate", "requested"): 2, ("report-faulty", "refused"): 1}
    # remembered: next time (a new fault after the node came back) straight to recreate
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason=XID79)
    _, out, _ = repair(cfg, sc, "n1", dry_run=True)
    assert "n1: would recreate via MIG" in out and "reportHostAsFaulty refused" in out


def test_a_vm_in_no_mig_is_reported_or_left_drained_never_deleted(tmp_path, gcp):
    sc = FakeSlurm.cluster(3)
    gcp.add_instance("n1", ZONE, **ULTRA)  # no MIG, reportable
    gcp.add_instance("n2", ZONE, **FLEX)  # no MIG, not reportable
    drain(sc, ["n1", "n2"])
    res, out, err = repair(cfg_for(tmp_path, gcp), sc)
    assert [c.path.split("/")[-2] for c in gcp.calls_of(REPORT)] == ["n1"]
    assert gcp.calls_of(RECREATE) == [] and [m.kind for m in gcp.mutations] == [REPORT]
    assert "n2: left drained: in no MIG and flex-start VM" in out and "never deleted" in out
    assert sc.nodes["n2"]["Reason"] == XID79 and res.exit_code == 0


def test_dry_run_shows_the_choice_per_node_and_changes_nothing(tmp_path, gcp):
    sc = FakeSlurm(["n1", "n2", "c1"])
    gcp.add_instance("n1", ZONE, mig="mig-a", **FLEX)
    gcp.add_instance("n2", ZONE, mig="mig-b", **ULTRA)
    drain(sc, ["n1", "n2"])
    drain(sc, ["c1"], state="IDLE+CLOUD+DRAIN")
    res, out, err = repair(cfg_for(tmp_path, gcp), sc, dry_run=True)
    assert err == "" and res.exit_code == 0
    lines = sorted(out.splitlines())
    assert lines[0] == "c1: would power down (POWER_DOWN_ASAP) (xid 79 on gpu 3 (fallen off the bus)): dynamic node: " \
                       "Slurm gives the next job a fresh VM"
    assert lines[1].startswith("n1: would recreate via MIG zones/us-central1-a/instanceGroupManagers/mig-a") and \
        "flex-start VM: Google takes reportHostAsFaulty only for reservation-bound VMs" in lines[1]
    assert lines[2].startswith("n2: would report host as faulty [UNRECOVERABLE_GPU_ERROR]")
    assert gcp.mutations == [] and sc.updates() == []


# --- dynamic nodes ----------------------------------------------------------------------------


def test_a_drained_dynamic_node_is_powered_down_not_recreated(tmp_path, gcp):
    sc = FakeSlurm(["c1", "c2", "n1"])
    drain(sc, ["c1"], state="IDLE+CLOUD+DRAIN")
    res, out, err = repair(cfg_for(tmp_path, gcp), sc)
    assert res.exit_code == 0, err
    assert gcp.calls == []  # no Compute call at all: Slurm's SuspendProgram owns the VM
    [update] = sc.updates()
    assert update == ["scontrol", "update", "NodeName=c1", "State=POWER_DOWN_ASAP",
                      f"Reason={reasons.repairing_reason(XID79)}"]
    assert "DRAIN" not in sc.nodes["c1"]["State"] and "POWERED_DOWN" in sc.nodes["c1"]["State"]
    assert "c1: powered down (POWER_DOWN_ASAP): c1" in out
    assert [d["outcome"] for d in journal_done(tmp_path, "power_down")] == ["powered down (POWER_DOWN_ASAP): c1"]
    assert repairs_metric(tmp_path) == {("power-down", "requested"): 1}


def test_a_dynamic_node_is_not_left_down_after_its_vm_went_away(tmp_path, gcp):
    expiry = "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"
    sc = FakeSlurm(["c1", "n1"])
    drain(sc, ["c1"], expiry, state="DOWN+CLOUD+DRAIN+NOT_RESPONDING")
    drain(sc, ["n1"], expiry, state="DOWN+DRAIN+NOT_RESPONDING")  # static: resume-if-healthy's, on its new VM
    cfg = cfg_for(tmp_path, gcp)
    _, out, _ = repair(cfg, sc)
    assert sc.updates() == [["scontrol", "update", "NodeName=c1", "State=POWER_DOWN_ASAP", f"Reason={expiry}"]]
    assert sc.nodes["c1"]["State"] == "DOWN+CLOUD+POWERED_DOWN"
    _, out, _ = repair(cfg, sc)  # powered down, still DOWN: resumed, so Slurm may power it up for a job
    assert sc.updates()[-1] == ["scontrol", "update", "NodeName=c1", "State=RESUME"]
    assert sc.nodes["c1"]["State"] == "IDLE+CLOUD+POWERED_DOWN"
    assert sc.nodes["n1"]["State"] == "DOWN+DRAIN+NOT_RESPONDING" and gcp.calls == []
    assert "c1: powered down but DOWN in Slurm: resumed" in out


# --- regional MIGs ----------------------------------------------------------------------------


@pytest.mark.parametrize("zones", [[], [ZONE_B]])
def test_a_regional_mig_in_two_zones_is_repaired_in_one_run(tmp_path, gcp, zones):
    sc = FakeSlurm.cluster(3)
    gcp.add_instance("n1", ZONE, mig="mig-r", region="us-central1", **FLEX)
    gcp.add_instance("n2", ZONE_B, mig="mig-r", region="us-central1", **FLEX)
    drain(sc, ["n1", "n2"])
    res, out, err = repair(cfg_for(tmp_path, gcp, gcp={"zones": zones}), sc)
    assert res.exit_code == 0, err
    [call] = gcp.calls_of(RRECREATE)
    assert call.path.endswith("/regions/us-central1/instanceGroupManagers/mig-r/recreateInstances")
    assert call.body["instances"] == [f"zones/{ZONE}/instances/n1", f"zones/{ZONE_B}/instances/n2"]
    lookups = [c.kind for c in gcp.calls if c.kind.startswith("instances.")]
    assert lookups == ["instances.get", "instances.get"] + (
        ["instances.list"] if zones else ["instances.aggregatedList"])
    assert gcp.instances[(ZONE_B, "n2")].recreated == 1


def test_a_vm_found_nowhere_is_one_clear_failure(tmp_path, gcp):
    sc = FakeSlurm.cluster(2)
    drain(sc, ["n2"])
    res, out, err = repair(cfg_for(tmp_path, gcp), sc)
    assert res.exit_code == 1 and gcp.mutations == []
    assert "n2: FAILED: cannot find its VM: instances.get: HTTP 404" in err and "nor in any zone of the project" in err


# --- an admin's resume, the opt-out ---------------------------------------------------------------


def test_an_admins_resume_cancels_our_pending_repair(tmp_path, gcp):
    sc = FakeSlurm.cluster(3)
    gcp.add_instance("n1", ZONE, mig="mig-a", **FLEX)
    drain(sc, ["n1"])
    cfg = cfg_for(tmp_path, gcp, repair={"retry_after_s": 0.0})
    repair(cfg, sc)
    assert len(gcp.calls_of(RECREATE)) == 1
    sc.nodes["n1"].update(State="IDLE", Reason="")  # `scontrol update nodename=n1 state=resume` by an admin
    res, out, err = repair(cfg, sc)
    assert "n1: repair cancelled: n1 resumed by hand" in out
    assert len(gcp.mutations) == 1  # nothing asked again
    [note] = journal_done(tmp_path, "repair_cancelled")
    assert note["payload"]["node"] == "n1" and note["outcome"].startswith("repair cancelled")
    _, out, _ = repair(cfg, sc)
    assert "cancelled" not in out  # said once


def test_a_pending_repair_request_is_moot_after_an_admins_resume(tmp_path, gcp):
    sc = FakeSlurm.cluster(3)
    cfg = cfg_for(tmp_path, gcp)
    j = Journal.for_config(cfg, "ctl")
    j.add("repair", strategy="recreate", project="p", request_id="0b3e6d3c-4a3f-4f55-9a0a-7d1f7c1f9e11",
          mig={"project": "1", "scope": "zones", "location": ZONE, "name": "mig-a"},
          nodes={"n2": {"zone": ZONE, "reason": XID79}}, deadline_s=5)  # sent never: Compute was down
    res, out, _ = repair(cfg, sc)  # n2 is IDLE: an admin resumed it meanwhile
    assert "journal: replayed repair n2: moot" in out and gcp.mutations == []


def test_opted_out_nodes_are_neither_drained_requeued_nor_repaired(tmp_path, gcp):
    sc = FakeSlurm.cluster(4)
    sc.nodes["n1"]["AvailableFeatures"] = "h100,slurmagent_off"
    sc.nodes["n1"]["ActiveFeatures"] = "h100,slurmagent_off"
    sc.add_job("7", "RUNNING", node="n1")
    sc.add_job("8", "RUNNING", node="n3")
    gcp.add_instance("n2", ZONE, mig="mig-a", **FLEX)
    cfg = cfg_for(tmp_path, gcp, repair={"exclude_nodes": ["n[2-3]"]})
    slurm = Slurm(runner=sc)
    d = JournalExecutor(cfg, slurm, "n1").drain_fault(XID79, source="prolog", job="7")
    assert d.action == "excluded (node feature slurmagent_off): not drained" and not d.blocks_job
    assert JournalExecutor(cfg, slurm, "n3").drain_planned("slurmagent: expiry: flex expiry at x").startswith("excluded")
    assert JournalExecutor(cfg, slurm, "n1").requeue_jobs(["7"]).startswith("excluded")
    assert JournalExecutor(cfg, slurm, "n3").requeue_each(["8"])[0] == []
    assert sc.drains == [] and sc.of("scontrol", "requeue") == []
    drain(sc, ["n2"])  # drained by slurmagent before the admin listed it
    res, out, _ = repair(cfg, sc)
    assert "n2: skipped: opted out ([repair] exclude_nodes)" in out and gcp.calls == []
    assert JournalExecutor(cfg, slurm, "n2").resume(XID79).startswith("excluded")


def test_a_passing_refusal_is_not_remembered(tmp_path, gcp):
    sc = FakeSlurm.cluster(2)
    gcp.add_instance("n1", ZONE, mig="mig-a", **ULTRA, refuse="INSTANCE_SHOULD_BE_RUNNING")
    drain(sc, ["n1"])
    cfg = cfg_for(tmp_path, gcp)
    res, out, err = repair(cfg, sc)
    assert res.exit_code == 0 and len(gcp.calls_of(RECREATE)) == 1  # fell back this time
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason=XID79)  # the next fault, on the running VM
    _, out, _ = repair(cfg, sc, "n1", dry_run=True)
    assert "n1: would report host as faulty" in out
