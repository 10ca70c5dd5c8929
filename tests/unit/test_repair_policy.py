"""Pure decisions: breaker arithmetic, race-safe drains, repair planning, reasons."""

from __future__ import annotations

import random

import pytest

from slurmagent.policy import breaker as breaker_policy, drain as drain_policy, repair as repair_policy
from slurmagent.core import reasons
from slurmagent.core.checks import Finding, Severity
from slurmagent.slurm.model import NodeInfo, node_from_kv, parse_comment, parse_kv
from slurmagent.core.timefmt import parse_slurm_time
from slurmagent.core.vm import VmFacts

T0 = 1_800_000_000.0


def view(name, state="IDLE", reason="", t=None, comment=""):
    return NodeInfo(name, frozenset(state.split("+")), reason, t, comment)


def cluster(n, **special):
    return [special.get(f"n{i}", view(f"n{i}")) for i in range(1, n + 1)]


@pytest.mark.parametrize("total,fraction,allowed", [(8, 0.25, 2), (3, 0.25, 1), (16, 0.25, 4), (10, 0.1, 1),
                                                    (0, 0.25, 0), (10, 1.0, 10), (7, 0.5, 3), (20, 0.0, 1)])
def test_allowed_drained(total, fraction, allowed):
    assert breaker_policy.allowed_drained(total, fraction) == allowed


def test_node_parses_reason_time_and_comment():
    line = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1 State=IDLE+DRAIN ThreadsPerCore=1 Partitions=gpu "
            "BootTime=2026-11-30T09:37:42 SlurmdStartTime=2026-11-30T09:49:04 "
            "Reason=slurmagent: xid 79 on gpu 3 (fallen off the bus) [root@2026-11-30T09:49:04] "
            "Comment=slurmagent drained@1764495944.125")
    n = node_from_kv(parse_kv(line))
    assert n.ours and n.drained and not n.repairing and n.registered
    assert n.reason == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    assert n.reason_time == parse_slurm_time("2026-11-30T09:49:04")
    assert n.marks.drained_at == 1764495944.125  # an older comment format still parses
    down = node_from_kv(parse_kv("NodeName=n2 State=DOWN+DRAIN+NOT_RESPONDING Reason=Not responding [slurm@2026-11-30T09:00:00]"))
    assert down.held_by_other and not down.registered and not down.ours


def test_reasons_round_trip():
    r = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    rep = reasons.repairing_reason(r)
    assert rep == "slurmagent: repairing: xid 79 on gpu 3 (fallen off the bus)"
    assert reasons.repairing_reason(rep) == rep
    assert reasons.fault_reason(rep) == r
    assert reasons.rule_of(rep) == "xid 79" and reasons.rule_of("slurmagent: ecc-uncorrectable: gpu 2 3 errs") == "ecc-uncorrectable"
    assert not reasons.repairable("slurmagent: expiry: terminates at 2026-11-30T10:00:00Z")
    assert reasons.repairable(r)
    assert repair_policy.fault_behavior("hw-slowdown") == "PERFORMANCE"
    assert repair_policy.fault_behavior("xid 79") == "UNRECOVERABLE_GPU_ERROR"


def test_comment_marks():
    c = reasons.suppressed_comment(T0, "hw-slowdown: gpu 0 clocks slowed by hw_power_brake_slowdown")
    m = parse_comment(c)
    assert m.suppressed_at == T0 and m.suppressed_summary.startswith("hw-slowdown: gpu 0")
    assert parse_comment("admin: RMA ticket 42").empty
    assert not view("n1", comment="admin note").comment_free and view("n1", comment=c).comment_free


def test_blocks_job_only_when_gpus_unusable():
    lost = Finding("gpu-lost", Severity.DRAIN, 2, "GPU is lost", True)
    xid79 = Finding("xid", Severity.DRAIN, 3, "fallen off the bus", 79)
    slow = Finding("hw-slowdown", Severity.DRAIN, 0, "power brake", ["hw_power_brake_slowdown"])
    warn = Finding("gpu-count", Severity.WARN, None, "x", 7)
    assert drain_policy.blocks_job([lost]) and drain_policy.blocks_job([slow, xid79])
    assert not drain_policy.blocks_job([slow]) and not drain_policy.blocks_job([warn])


def test_decide_drain():
    ours = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    nodes = cluster(8, n1=view("n1", "IDLE+DRAIN", ours, T0), n2=view("n2", "IDLE+DRAIN", "admin: PSU", T0),
                    n3=view("n3", "DOWN", "Not responding", T0), n4=view("n4", "IDLE+DRAIN", "Prolog error", T0))
    assert drain_policy.decide_drain(nodes, "n1", ours, 0.25) == "already-drained"
    assert drain_policy.decide_drain(nodes, "n1", "slurmagent: gpu-lost: gpu 1", 0.25) == "update-reason"
    assert drain_policy.decide_drain(nodes, "n2", ours, 0.25) == "kept-admin-drain"
    assert drain_policy.decide_drain(nodes, "n3", ours, 0.25) == "kept-admin-drain"
    assert drain_policy.decide_drain(nodes, "n4", ours, 0.25) == "kept-admin-drain"
    assert drain_policy.decide_drain(nodes, "n4", ours, 0.25, takeover_reasons=("Prolog error",)) == "drain"
    assert drain_policy.decide_drain(nodes, "n5", ours, 0.25) == "drain"  # 1 of 2 used
    assert drain_policy.decide_drain(nodes, "n9", ours, 0.25) == "no-such-node"
    full = [*nodes[:4], view("n5", "IDLE+DRAIN", ours, T0), *nodes[5:]]
    assert drain_policy.decide_drain(full, "n6", ours, 0.25) == "suppress"
    assert drain_policy.decide_drain(full, "n6", ours, 1.0) == "drain"  # breaker off


def simulate_burst(n_nodes, racers, fraction, rng, established=()):
    """Racers drain optimistically at (second, order); each verifies with a view that holds
    every update applied in its own second or earlier plus a random subset of later ones."""
    base = {f"n{i}": view(f"n{i}") for i in range(1, n_nodes + 1)}
    for name in established:
        base[name] = view(name, "IDLE+DRAIN", "slurmagent: xid 48 on gpu 0", T0 - 600)
    # first look: every racer sees only the established drains (they all start together)
    start = list(base.values())
    movers = [r for r in racers if drain_policy.decide_drain(start, r, "slurmagent: hw-slowdown: gpu 0", fraction) == "drain"]
    applied = {r: T0 + rng.choice([0, 0, 0, 1]) for r in movers}  # the second slurmctld applied each drain in
    kept = []
    for r in movers:
        visible = {m for m, s in applied.items() if s <= applied[r] or rng.random() < 0.5}
        nodes = [view(name, "IDLE+DRAIN", "slurmagent: hw-slowdown: gpu 0", applied[name]) if name in visible
                 else node for name, node in base.items()]
        if breaker_policy.keeps_drain(nodes, r, fraction):
            kept.append(r)
    return kept


@pytest.mark.parametrize("seed", range(200))
def test_burst_keeps_exactly_the_limit(seed):
    rng = random.Random(seed)
    racers = rng.sample([f"n{i}" for i in range(1, 9)], 4)
    kept = simulate_burst(8, racers, 0.25, rng)
    assert len(kept) == 2, kept


@pytest.mark.parametrize("seed", range(50))
def test_burst_respects_established_drains(seed):
    rng = random.Random(seed)
    kept = simulate_burst(16, ["n2", "n5", "n9", "n11", "n14", "n15"], 0.25, rng, established=("n1",))
    assert len(kept) == 3, kept  # 4 allowed, 1 already taken


def test_breaker_state():
    ours = "slurmagent: hw-slowdown: gpu 0"
    nodes = cluster(8, n1=view("n1", "IDLE+DRAIN", ours, T0), n2=view("n2", "IDLE+DRAIN", ours, T0),
                    n3=view("n3", comment=reasons.suppressed_comment(T0, "hw-slowdown: gpu 0")),
                    n4=view("n4", "IDLE+DRAIN", "Prolog error", T0, comment=reasons.suppressed_comment(T0, "gpu-lost")),
                    n5=view("n5", comment=reasons.suppressed_comment(T0 - 2 * 86400, "old")))
    b = breaker_policy.breaker(nodes, 0.25, now=T0 + 10)
    assert b.drained == ("n1", "n2") and b.suppressed == ("n3", "n4") and b.open and b.full
    assert "OPEN" in b.describe() and "n3, n4" in b.describe()
    assert b.to_dict()["state"] == "open"
    calm = nodes[:2] + [view(f"n{i}") for i in (3, 4, 5)] + nodes[5:]
    at_limit = breaker_policy.breaker(calm, 0.25, now=T0)
    assert not at_limit.open and at_limit.full
    # the JSON says what the text says: no room for one more drain is not "closed"
    assert at_limit.describe().startswith("at limit: 2 of 8") and at_limit.to_dict()["state"] == "at-limit"
    one = breaker_policy.breaker(nodes[:1] + [view(f"n{i}") for i in range(2, 9)], 0.25, now=T0)
    assert one.describe().startswith("closed: 1 of 8") and one.to_dict()["state"] == "closed"
    assert breaker_policy.breaker(calm, 1.0, now=T0).to_dict()["state"] == "off"


def test_plan_repair():
    ours = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    nodes = [view("n1", "IDLE+DRAIN", ours, T0), view("n2", "IDLE+DRAIN", "admin: PSU", T0),
             view("n3", "IDLE+DRAIN", reasons.repairing_reason(ours), T0), view("n4", "MIXED+DRAIN", ours, T0),
             view("n5", "IDLE+DRAIN", "slurmagent: expiry: terminates soon", T0), view("n6", "IDLE"),
             view("n7", "IDLE+DRAIN", ours, T0), *[view(f"n{i}") for i in range(8, 30)]]
    b = breaker_policy.breaker(nodes, 0.25, now=T0)
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0 + 60,
                              history={"n7": [T0 - 100, T0 - 50, T0 - 10]})
    assert plan.todo == ["n1"]
    assert set(plan.skipped) == {"n3", "n4", "n5"} and "already requested" in plan.skipped["n3"]
    assert "n7" in plan.refused and "3 times" in plan.refused["n7"]
    named = repair_policy.plan_repair(nodes, ["n1", "n2", "n6", "nx"], force=False, breaker_state=b, now=T0 + 60)
    assert named.todo == ["n1"]
    assert "someone else" in named.refused["n2"] and "not drained" in named.refused["n6"] and "no such" in named.refused["nx"]
    later = repair_policy.plan_repair(nodes, ["n3"], force=False, breaker_state=b, now=T0 + 7200)
    assert later.todo == ["n3"]  # asked long ago and still drained: ask again
    forced = repair_policy.plan_repair(nodes, ["n4"], force=True, breaker_state=b, now=T0)
    assert forced.todo == ["n4"]


def test_plan_repair_with_open_breaker():
    ours = "slurmagent: hw-slowdown: gpu 0"
    nodes = cluster(8, n1=view("n1", "IDLE+DRAIN", ours, T0), n2=view("n2", "IDLE+DRAIN", ours, T0),
                    n3=view("n3", comment=reasons.suppressed_comment(T0, "hw-slowdown: gpu 0")),
                    n4=view("n4", comment=reasons.suppressed_comment(T0, "hw-slowdown: gpu 0")))
    b = breaker_policy.breaker(nodes, 0.25, now=T0)
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0)
    assert plan.todo == [] and plan.suppressed == ["n1", "n2"]
    forced = repair_policy.plan_repair(nodes, ["n3"], force=True, breaker_state=b, now=T0)
    assert forced.todo == ["n3"] and forced.needs_drain == ["n3"]


# --- planned drains: neither held back nor counted by the breaker ----------------------------

FLEX = "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"


def test_planned_drains_do_not_count_for_the_breaker():
    ours = "slurmagent: hw-slowdown: gpu 0"
    cohort = {f"n{i}": view(f"n{i}", "IDLE+DRAIN", FLEX, T0) for i in range(1, 5)}  # 4 of 8 expire together
    nodes = cluster(8, **cohort)
    b = breaker_policy.breaker(nodes, 0.25, T0)
    assert b.drained == () and not b.open and not b.full
    assert drain_policy.decide_drain(nodes, "n5", ours, 0.25) == "drain"  # both fault slots still free
    nodes = cluster(8, **cohort, n5=view("n5", "IDLE+DRAIN", ours, T0), n6=view("n6", "IDLE+DRAIN", ours, T0))
    assert breaker_policy.breaker(nodes, 0.25, T0).drained == ("n5", "n6")
    assert drain_policy.decide_drain(nodes, "n7", ours, 0.25) == "suppress"
    assert breaker_policy.keeps_drain(nodes, "n6", 0.25)
    # a fault on a node already drained ahead of its end counts from then on: held back when full
    assert drain_policy.decide_drain(nodes, "n1", ours, 0.25) == "suppress"
    assert drain_policy.decide_drain(cluster(8, n1=view("n1", "IDLE+DRAIN", FLEX, T0)), "n1", ours, 0.25) == "update-reason"


def test_decide_planned_drain():
    fault = view("n1", "IDLE+DRAIN", "slurmagent: xid 79 on gpu 3 (fallen off the bus)", T0)
    assert drain_policy.decide_planned_drain(fault, FLEX) == "kept-slurmagent-drain"  # repair owns it
    assert drain_policy.decide_planned_drain(view("n1", "IDLE+DRAIN", "admin: PSU", T0), FLEX) == "kept-admin-drain"
    assert drain_policy.decide_planned_drain(view("n1", "DOWN", "Not responding", T0), FLEX) == "kept-admin-drain"
    assert drain_policy.decide_planned_drain(view("n1", "IDLE+DRAIN", FLEX, T0), FLEX) == "already-drained"
    assert drain_policy.decide_planned_drain(view("n1", "IDLE+DRAIN", FLEX.replace("10:00", "11:00"), T0), FLEX) == "drain"
    assert drain_policy.decide_planned_drain(view("n1"), FLEX) == "drain"
    assert drain_policy.decide_planned_drain(None, FLEX) == "no-such-node"
    # however many of a cohort are drained already, the next one is too (no breaker here)
    assert all(drain_policy.decide_planned_drain(n, FLEX) == "drain" for n in cluster(8))


# --- repair requests ---------------------------------------------------------------------------


def test_repair_requests_one_per_mig_or_per_node():
    mig_a = {"project": "1", "scope": "zones", "location": "z", "name": "a"}
    mig_b = {"project": "1", "scope": "regions", "location": "r", "name": "b"}
    targets = {"n1": {"zone": "z", "mig": mig_a}, "n3": {"zone": "z", "mig": mig_b}, "n2": {"zone": "z", "mig": mig_a}}
    reason_of = {n: f"slurmagent: xid 79 on gpu {n[-1]}" for n in targets}
    ids = iter(["id-1", "id-2", "id-3"])
    reqs = repair_policy.repair_requests(targets, "recreate", reason_of, "p", 120.0, lambda: next(ids))
    assert [(r["mig"]["name"], sorted(r["nodes"]), r["request_id"]) for r in reqs] == [
        ("a", ["n1", "n2"], "id-1"), ("b", ["n3"], "id-2")]
    assert reqs[0]["nodes"]["n2"] == {"zone": "z", "reason": "slurmagent: xid 79 on gpu 2"}
    assert reqs[0]["deadline_s"] == 120.0 and reqs[0]["project"] == "p" and reqs[0]["strategy"] == "recreate"
    faulty = repair_policy.repair_requests({"n1": {"zone": "z"}, "n2": {"zone": "y"}}, "report-faulty", reason_of, "p", 60.0,
                                    lambda: "x")
    assert [sorted(r["nodes"]) for r in faulty] == [["n1"], ["n2"]] and faulty[1]["nodes"]["n2"]["zone"] == "y"


def test_known_target_and_dry_run_line():
    cached = {"zone": "z", "mig": {"project": "1", "scope": "zones", "location": "z", "name": "a"}}
    assert repair_policy.known_target("recreate", cached, "z") == cached
    assert repair_policy.known_target("recreate", None, "z") is None  # look the VM up
    assert repair_policy.known_target("report-faulty", None, "z") == {"zone": "z"}
    assert repair_policy.known_target("report-faulty", {"zone": "y"}, "z") == {"zone": "y"}
    assert repair_policy.dry_run_line("n1", "recreate", cached, False, "slurmagent: xid 79 on gpu 3") == \
        "n1: would recreate via MIG zones/z/instanceGroupManagers/a (xid 79 on gpu 3)"
    assert repair_policy.dry_run_line("n2", "recreate", None, True, "") == \
        "n2: would drain and recreate via its MIG (looked up at run time) (suppressed fault)"
    assert repair_policy.dry_run_line("n3", "report-faulty", None, False, "slurmagent: gpu-lost: gpu 1") == \
        "n3: would report host as faulty [UNRECOVERABLE_GPU_ERROR] (gpu-lost: gpu 1)"
    assert repair_policy.dry_run_line("n4", "power-down", None, False, "slurmagent: xid 48 on gpu 0 (x)", "dynamic node") == \
        "n4: would power down (POWER_DOWN_ASAP) (xid 48 on gpu 0 (x)): dynamic node"
    assert repair_policy.known_target("auto", {"zone": "z", "vm": {"zone": "z"}}, "z") == {"zone": "z", "vm": {"zone": "z"}}
    assert repair_policy.known_target("auto", cached, "z") is None  # a cache entry without the VM's facts: look it up


# --- which repair each VM gets -------------------------------------------------------------------

MIG = {"project": "1", "scope": "zones", "location": "z", "name": "m"}
ULTRA = VmFacts("z", "RUNNING", "a3-ultragpu-8g", "RESERVATION_BOUND", "SPECIFIC_RESERVATION", MIG, 8)


@pytest.mark.parametrize("rule,behavior", [
    ("xid 79", "UNRECOVERABLE_GPU_ERROR"), ("gpu-lost", "UNRECOVERABLE_GPU_ERROR"),
    ("ecc-uncorrectable", "UNRECOVERABLE_GPU_ERROR"), ("row-remap-failure", "UNRECOVERABLE_GPU_ERROR"),
    ("hw-slowdown", "PERFORMANCE"), ("pcie-width", "PERFORMANCE"), ("nvlink-down", "PERFORMANCE"),
    ("sdc", "SILENT_DATA_CORRUPTION"), ("something new", "BEHAVIOR_UNSPECIFIED")])
def test_fault_reason_per_rule(rule, behavior):
    assert repair_policy.fault_behavior(rule) == behavior


def test_auto_reports_where_google_takes_it_and_recreates_elsewhere():
    static = view("n1", "IDLE+DRAIN", "slurmagent: xid 79 on gpu 3")
    assert repair_policy.choose_repair("auto", static, ULTRA).action == "report-faulty"
    assert "reservation-bound a3-ultragpu-8g" in repair_policy.choose_repair("auto", static, ULTRA).why
    from dataclasses import replace
    flex = replace(ULTRA, provisioning_model="FLEX_START", reservation="")
    spot = replace(ULTRA, provisioning_model="SPOT", reservation="")
    a3high1 = replace(ULTRA, machine_type="a3-highgpu-1g")
    stopped = replace(ULTRA, status="TERMINATED")
    standard_in_reservation = replace(ULTRA, provisioning_model="STANDARD")
    for vm, why in ((flex, "flex-start VM"), (spot, "spot VM"), (a3high1, "machine type a3-highgpu-1g"),
                    (stopped, "TERMINATED, not RUNNING")):
        c = repair_policy.choose_repair("auto", static, vm)
        assert c.action == "recreate" and why in c.why, (vm, c)
    assert repair_policy.choose_repair("auto", static, standard_in_reservation).action == "report-faulty"
    no_mig = repair_policy.choose_repair("auto", static, replace(flex, mig=None))
    assert no_mig.action == "leave" and "never deleted" in no_mig.why
    assert repair_policy.choose_repair("auto", static, replace(ULTRA, mig=None)).action == "report-faulty"
    refused = repair_policy.choose_repair("auto", static, ULTRA, refused="INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED")
    assert refused.action == "recreate" and "refused" in refused.why
    assert repair_policy.choose_repair("auto", static, replace(ULTRA, mig=None), refused="x").action == "leave"


def test_dynamic_nodes_are_powered_down_and_explicit_strategies_are_literal():
    cloud = view("c1", "IDLE+CLOUD+DRAIN", "slurmagent: xid 79 on gpu 3")
    assert cloud.dynamic and not repair_policy.needs_vm("auto", cloud)
    assert repair_policy.choose_repair("auto", cloud, None).action == "power-down"
    static = view("n1", "IDLE+DRAIN", "slurmagent: xid 79 on gpu 3")
    assert repair_policy.needs_vm("auto", static) and repair_policy.needs_vm("recreate", static)
    assert not repair_policy.needs_vm("report-faulty", static) and not repair_policy.needs_vm("power-down", static)
    assert repair_policy.choose_repair("power-down", static, None).action == "power-down"
    assert repair_policy.choose_repair("recreate", static, ULTRA).action == "recreate"
    from dataclasses import replace
    assert repair_policy.choose_repair("recreate", static, replace(ULTRA, mig=None)).action == "fail"
    assert repair_policy.choose_repair("report-faulty", static, None).action == "report-faulty"
    assert repair_policy.choose_repair("report-faulty", static, ULTRA, refused="x").action == "recreate"
    assert repair_policy.choose_repair("auto", static, None).action == "fail"


def test_dynamic_nodes_are_not_left_down():
    expiry = "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"
    nodes = [view("c1", "DOWN+CLOUD+DRAIN", expiry),  # the flex VM is gone: power it down
             view("c2", "DOWN+CLOUD+POWERED_DOWN", "slurmagent: repairing: xid 79 on gpu 3"),  # powered down, still DOWN
             view("c3", "IDLE+CLOUD+POWERED_DOWN", ""),  # fine
             view("c4", "DOWN+CLOUD+POWERING_DOWN", expiry),  # on its way
             view("c5", "DOWN+CLOUD+POWERED_DOWN", "admin: broken"),  # an admin's
             view("n1", "DOWN+DRAIN", expiry)]  # static: resume-if-healthy's business
    assert repair_policy.dynamic_cleanup(nodes) == (["c1"], ["c2"])


def test_an_admins_resume_cancels_the_repair_we_asked_for():
    def node(name, state, slurmd_start=None):
        return NodeInfo(name, frozenset(state.split("+")), "", None, "", slurmd_start=slurmd_start)
    requested = {"n1": T0, "n2": T0, "n3": T0, "n4": T0}
    nodes = [node("n1", "IDLE", T0 - 3600),  # resumed by hand, same slurmd: cancelled
             node("n2", "IDLE", T0 + 300),  # the VM came back (new slurmd): done
             view("n3", "IDLE+DRAIN", "slurmagent: repairing: xid 79 on gpu 3"),  # still ours
             node("n4", "DOWN"),  # being recreated
             node("n5", "IDLE+NOT_RESPONDING", T0 - 3600),  # resumed by hand, not pinged yet: cancelled
             node("n6", "IDLE+CLOUD+POWERED_DOWN", T0 - 3600)]  # powered down by us
    requested.update(n5=T0, n6=T0)
    assert repair_policy.cancelled_repairs(nodes, requested) == ["n1", "n5"]


def test_opt_out_by_feature_or_config_list():
    line = "NodeName=n1 State=IDLE AvailableFeatures=h100,slurmagent_off ActiveFeatures=h100,slurmagent_off Reason=(null)"
    n1 = node_from_kv(parse_kv(line))
    assert n1.features == {"h100", "slurmagent_off"} and n1.opted_out
    assert drain_policy.opted_out(n1, "n1", ()) == "node feature slurmagent_off"
    plain = node_from_kv(parse_kv("NodeName=n2 State=IDLE AvailableFeatures=(null) ActiveFeatures=(null)"))
    assert plain.features == frozenset() and drain_policy.opted_out(plain, "n2", ()) == ""
    assert drain_policy.opted_out(plain, "n2", ("n[1-3]",)) == "[repair] exclude_nodes"
    assert drain_policy.opted_out(None, "n9", ("n1", "n9")) == "[repair] exclude_nodes"


def test_a_busy_dynamic_node_is_powered_down_asap_a_busy_static_one_waits():
    b = breaker_policy.breaker([], 1.0)
    nodes = [view("c1", "MIXED+CLOUD+DRAIN", "slurmagent: xid 79 on gpu 3"),
             view("n1", "MIXED+DRAIN", "slurmagent: xid 79 on gpu 3")]
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0, strategy="auto")
    assert plan.todo == ["c1"] and "jobs still running" in plan.skipped["n1"]
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0, strategy="recreate")
    assert plan.todo == [] and set(plan.skipped) == {"c1", "n1"}


# --- [repair] adopt_reasons: the one way another tool's drain reaches repair --------------

TOOLKIT_GPU_PROLOG = "Prolog error"  # Cluster Toolkit's a_chs_gpu_health_check.sh exits 1: Slurm's own reason
SLURMSYNC_DOWN = "Instance terminated"  # slurm-gcp slurmsync: `scontrol update state=down reason=...`


def adoption_cluster():
    return cluster(12, n1=view("n1", "IDLE+DRAIN", TOOLKIT_GPU_PROLOG, T0),
                   n2=view("n2", "DOWN+NOT_RESPONDING", SLURMSYNC_DOWN, T0),
                   n3=view("n3", "IDLE+DRAIN", "admin: swap PSU", T0),
                   n4=view("n4", "IDLE+DRAIN", "slurmagent: xid 79 on gpu 3", T0))


def test_without_adopt_reasons_foreign_drains_and_slurmsync_downs_stay_untouched():
    nodes = adoption_cluster()
    b = breaker_policy.breaker(nodes, 1.0, now=T0)
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0)
    assert plan.todo == ["n4"] and plan.adopt == []
    named = repair_policy.plan_repair(nodes, ["n1", "n2"], force=False, breaker_state=b, now=T0)
    assert named.todo == [] and set(named.refused) == {"n1", "n2"}


def test_an_adopted_drain_is_repaired_after_being_re_drained_as_ours():
    nodes = adoption_cluster()
    b = breaker_policy.breaker(nodes, 1.0, now=T0)
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0, adopt_reasons=(r"^Prolog error",))
    assert plan.todo == ["n1", "n4"] and plan.adopt == ["n1"]
    assert "n2" not in plan.todo and "n3" not in plan.todo  # slurmsync's DOWN and the admin's drain stay
    assert reasons.adopted_reason(TOOLKIT_GPU_PROLOG) == "slurmagent: adopted: Prolog error"
    down = repair_policy.plan_repair(nodes, ["n2"], force=False, breaker_state=b, now=T0,
                                     adopt_reasons=(r"^Instance (terminated|stopped)",))
    assert down.todo == ["n2"] and down.adopt == ["n2"]  # adopted explicitly: a DOWN node too


def test_an_adopted_node_obeys_the_open_breaker_and_the_daily_limit():
    nodes = cluster(8, n1=view("n1", "IDLE+DRAIN", TOOLKIT_GPU_PROLOG, T0),
                    n2=view("n2", "IDLE+DRAIN", "slurmagent: xid 79", T0),
                    n3=view("n3", "IDLE+DRAIN", "slurmagent: xid 48", T0),
                    n4=view("n4", "IDLE+DRAIN", "slurmagent: xid 48", T0))
    b = breaker_policy.breaker(nodes, 0.25, now=T0)
    assert b.open
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=b, now=T0, adopt_reasons=("Prolog",))
    assert plan.todo == [] and plan.adopt == [] and "n1" in plan.suppressed
    calm = cluster(8, n1=view("n1", "IDLE+DRAIN", TOOLKIT_GPU_PROLOG, T0))
    limited = repair_policy.plan_repair(calm, [], force=False, breaker_state=breaker_policy.breaker(calm, 0.25, now=T0),
                                        now=T0, history={"n1": [T0 - 60] * 3}, adopt_reasons=("Prolog",))
    assert limited.todo == [] and "3 times" in limited.refused["n1"]


def test_a_busy_adopted_node_waits_for_its_jobs():
    nodes = cluster(4, n1=view("n1", "MIXED+DRAIN", TOOLKIT_GPU_PROLOG, T0))
    plan = repair_policy.plan_repair(nodes, [], force=False, breaker_state=breaker_policy.breaker(nodes, 1.0, now=T0),
                                     now=T0, adopt_reasons=("Prolog",))
    assert plan.todo == [] and "jobs still running" in plan.skipped["n1"]


def test_the_takeover_of_exactly_the_adopted_reason_is_allowed_and_nothing_else():
    nodes = adoption_cluster()
    assert drain_policy.decide_drain(nodes, "n1", "slurmagent: adopted: Prolog error", 1.0) == "kept-admin-drain"
    assert drain_policy.decide_drain(nodes, "n1", "slurmagent: adopted: Prolog error", 1.0,
                                     takeover_reasons=(TOOLKIT_GPU_PROLOG,)) == "drain"
    assert drain_policy.decide_drain(nodes, "n3", "slurmagent: adopted: admin: swap PSU", 1.0,
                                     takeover_reasons=(TOOLKIT_GPU_PROLOG,)) == "kept-admin-drain"
