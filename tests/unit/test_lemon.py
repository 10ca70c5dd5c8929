"""Lemon nodes (policy/lemon.py): counted from the repair loop's history, listed by `report`,
exported as metrics, and with `[repair] lemon_action = "report-faulty"` repaired through
reportHostAsFaulty instead of a recreate. The root side's decision-log lines joined to a job's
report by its id. In memory: a fake scontrol, a stub Compute, hand-made ledgers."""

from __future__ import annotations

import io
import json

from support.fakes.slurm import FakeSlurm
from slurmagent.commands.repair import run_repair
from slurmagent.commands.report import run_report
from slurmagent.core.goodput_html import render_html
from slurmagent.gcp.compute import OpRef
from slurmagent.policy import lemon
from slurmagent.core.vm import VmFacts
from slurmagent.policy.repair import choose_repair
from slurmagent.slurm.commands import Slurm
from slurmagent.slurm.model import NodeInfo
from slurmagent.state import metrics, repair_state
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import DecisionLog

DAY = 86400.0
NOW = 1_800_000_000.0
XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
A3U = VmFacts("z", "RUNNING", "a3-ultragpu-8g", "RESERVATION_BOUND", mig={"project": "1", "scope": "zones",
                                                                          "location": "z", "name": "mig-a"}, gpus=8)


def test_a_node_is_a_lemon_from_the_nth_fault_within_the_window():
    history = {"n1": [NOW - 8 * DAY, NOW - 3 * DAY, NOW - 2 * DAY, NOW - 60], "n2": [NOW - DAY], "n3": [NOW - 9 * DAY],
               "n4": ["junk", True, None]}
    rows = lemon.node_faults(history, NOW, faults=3, window_s=7 * DAY)
    assert rows == [{"node": "n1", "faults": 3, "hangs": 0, "last_fault": NOW - 60, "lemon": True, "hang_evidence": ""},
                    {"node": "n2", "faults": 1, "hangs": 0, "last_fault": NOW - DAY, "lemon": False, "hang_evidence": ""}]  # n3: out of the window
    assert lemon.gauges(rows) == {("slurmagent_lemon_nodes", ()): 1.0, ("slurmagent_node_faults", (("node", "n1"),)): 3.0,
                                  ("slurmagent_node_faults", (("node", "n2"),)): 1.0}
    # the repair about to be asked counts: 2 past + this one = 3
    assert lemon.escalation("n2", {"n2": [NOW - DAY, NOW - 2 * DAY]}, NOW, faults=3, window_s=7 * DAY).startswith(
        "lemon: 3 faults within 7 days")
    assert lemon.escalation("n2", {"n2": [NOW - DAY]}, NOW, faults=3, window_s=7 * DAY) == ""
    assert lemon.node_faults(history, NOW, faults=0, window_s=7 * DAY)[0]["lemon"] is False  # 0: never


def test_hangs_whose_evidence_named_the_node_count_toward_a_lemon_beside_its_repairs():
    history = {"n1": [NOW - 2 * DAY]}
    hangs = {"n1": [NOW - DAY, NOW - 60], "n2": [NOW - 60], "n3": [NOW - 30 * DAY]}
    whys = {"n1": [[NOW - DAY, "job 4: rank 1 stuck outside the collective"], [NOW - 60, "job 9: rank 3 stopped"]]}
    rows = lemon.node_faults(history, NOW, faults=3, window_s=7 * DAY, hangs=hangs, whys=whys)
    assert rows == [{"node": "n1", "faults": 3, "hangs": 2, "last_fault": NOW - 60, "lemon": True,
                     "hang_evidence": "job 9: rank 3 stopped"},  # what counted, shown by `report --state-dir`
                    {"node": "n2", "faults": 1, "hangs": 1, "last_fault": NOW - 60, "lemon": False, "hang_evidence": ""}]
    assert lemon.escalation("n2", {}, NOW, faults=2, window_s=7 * DAY, hangs=hangs).startswith("lemon: 2 faults")
    # a repair of a lemon says which of its faults were hangs and the evidence that counted the last
    assert lemon.escalation("n1", history, NOW, faults=3, window_s=7 * DAY, hangs=hangs, whys=whys) == (
        "lemon: 4 faults within 7 days ([repair] lemon_faults = 3), 2 of them hang(s), the last: job 9: rank 3 stopped")
    assert lemon.escalation("n2", {}, NOW, faults=2, window_s=7 * DAY) == ""


def test_a_lemon_gets_report_faulty_only_where_its_vm_takes_it():
    node = NodeInfo("n1", frozenset({"IDLE", "DRAIN"}), XID79, None, "")
    assert choose_repair("recreate", node, A3U, lemon="lemon: 3 faults").action == "report-faulty"
    assert choose_repair("recreate", node, A3U).action == "recreate"
    spot = VmFacts("z", "RUNNING", "a3-ultragpu-8g", "SPOT", mig=A3U.mig, gpus=8)
    assert choose_repair("recreate", node, spot, lemon="lemon: 3 faults").action == "recreate"
    assert choose_repair("recreate", node, A3U, refused="MACHINE_TYPE_NOT_SUPPORTED", lemon="x").action == "recreate"


class StubCompute:
    def __init__(self):
        self.calls, self.total_calls = [], 0

    def recreate(self, mig, instances, request_id, deadline_s=None):
        self.calls.append(("recreate", [i for _, i in instances]))
        return [OpRef("zones", "z", "op-r")]

    def report_faulty(self, zone, instance, behavior, description, request_id, deadline_s=None):
        self.calls.append(("report-faulty", [instance]))
        return OpRef("zones", "z", "op-f")

    def wait(self, op, deadline_s=None):
        pass


def repair_with_history(tmp_path, lemon_action: str, past: list[float]):
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"),
                 "gcp": {"project": "p", "zone": "z", "compute_endpoint": "http://127.0.0.1:9"},
                 "repair": {"max_drained_fraction": 1.0, "strategy": "recreate", "lemon_action": lemon_action,
                            "max_repairs_per_day": 10}})
    sdir = cfg.state_path("ctl")
    repair_state.save_state(sdir, {"history": {"n2": past}, "migs": {"n2": {"zone": "z", "mig": A3U.mig,
                                                                            "vm": A3U.to_dict()}}})
    sc = FakeSlurm.cluster(8)
    sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    stub = StubCompute()
    out = io.StringIO()
    res = run_repair(cfg, [], slurm=Slurm(runner=sc), compute_factory=lambda p: stub, local_node="ctl", out=out,
                     err=io.StringIO(), clock=lambda: NOW)
    return cfg, stub, res, out.getvalue()


def test_with_report_faulty_a_lemon_is_reported_instead_of_recreated(tmp_path):
    cfg, stub, res, out = repair_with_history(tmp_path, "report-faulty", [NOW - 2 * DAY, NOW - DAY])
    assert stub.calls == [("report-faulty", ["n2"])], out
    assert "lemon: 3 faults within 7 days" in out and "reported host as faulty" in res.ok["n2"]
    assert repair_state.load_state(cfg.state_path("ctl"))["history"]["n2"][-1] == NOW  # counted for the next time
    # the gauges count the repair just asked: n2's third within the window makes it a lemon now,
    # as `report` says, not at the next repair run
    values = metrics.read_values(cfg.state_path("ctl"))
    assert values['slurmagent_node_faults{node="n2"}'] == 3
    assert values["slurmagent_lemon_nodes"] == 1


def test_report_only_keeps_recreating_and_a_young_node_is_no_lemon(tmp_path):
    _, stub, _, out = repair_with_history(tmp_path, "report", [NOW - 2 * DAY, NOW - DAY])
    assert stub.calls == [("recreate", ["n2"])], out
    _, stub, _, out = repair_with_history(tmp_path / "b", "report-faulty", [NOW - 20 * DAY, NOW - DAY])
    assert stub.calls == [("recreate", ["n2"])], out  # one fault 20 days ago is out of the window: 2 faults


def ledger(job, attempt, started, **kw):
    return {"schema": 1, "job": job, "attempt": attempt, "started": started, "state": "ended", "gpus": 8, **kw}


def test_report_lists_lemons_and_joins_the_root_sides_events_by_job_id(tmp_path):
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "checkpoint": {"remote": "gs://b/jobs"}})
    sdir = tmp_path / "ctl"
    repair_state.save_state(sdir, {"history": {"n1": [NOW - 3 * DAY, NOW - 2 * DAY, NOW - 100], "n2": [NOW - 50]}})
    log_path = tmp_path / "n1.log"
    log = DecisionLog(log_path, use_syslog=False)
    log.write("prolog", node="n1", job="41", verdict="healthy", action="none")  # nothing happened: left out
    log.write("prolog", node="n1", job="41", verdict="unhealthy", rule="xid", gpu=3, reason=XID79,
              action="drained; job requeued")
    log.write("fault-evict", node="n1", job="99", verdict="unhealthy", action="requeued")  # another job
    log.write("watch", node="n1", verdict="unhealthy", rule="xid", action="drained")  # names no job
    records = [ledger("41", 0, NOW - 4000, restore_s=5, first_progress=NOW - 3900, last_commit=NOW - 3100,
                      ended=NOW - 3000, flush_s=5, end="gpu-fault", why="GPU fault on node n1", requeued=True),
               ledger("41", 1, NOW - 2900, restore_s=5, first_progress=NOW - 2800, last_commit=NOW - 10,
                      ended=NOW - 5, end="completed", why="the job exited 0")]
    out = io.StringIO()
    html = tmp_path / "r.html"
    run_report(cfg, out, reader=lambda remote: (records, []), now=NOW, state_dir=str(sdir),
               decision_logs=(str(log_path),), html=str(html))
    text = out.getvalue()
    assert "root-side events for this job:" in text
    assert "n1  prolog: unhealthy xid gpu 3 -> drained; job requeued (slurmagent: xid 79" in text
    assert "fault-evict" not in text and "watch" not in text and "healthy ->" not in text
    assert "n1: 3 fault(s)" in text and "LEMON" in text.split("n1: 3 fault(s)")[1].splitlines()[0]
    assert "n2: 1 fault(s)" in text and "LEMON" not in text.split("n2: 1 fault(s)")[1].splitlines()[0]
    out = io.StringIO()
    run_report(cfg, out, reader=lambda remote: (records, []), now=NOW, state_dir=str(sdir),
               decision_logs=(str(log_path),), as_json=True)
    report = json.loads(out.getvalue())
    (job,) = report["jobs"]
    assert [e["event"] for e in job["root_events"]] == ["prolog"]
    assert [(n["node"], n["faults"], n["lemon"]) for n in report["nodes"]] == [("n1", 3, True), ("n2", 1, False)]
    page = render_html(report)
    assert 'class="root-event" data-event="prolog"' in page
    assert 'data-node="n1" data-faults="3" data-lemon="yes"' in page and 'data-lemon="no"' in page
    assert html.read_text() == page  # --html writes the page of the report --json prints (same `now`)


def test_an_unreadable_decision_log_is_a_warning_not_a_failure(tmp_path):
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n")})
    out = io.StringIO()
    records = [ledger("5", 0, NOW - 100, ended=NOW, end="completed")]
    assert run_report(cfg, out, remote="gs://b/p", reader=lambda r: (records, []), now=NOW,
                      decision_logs=(str(tmp_path / "missing.log"),)) == 0
    assert "warning: cannot read the decision log" in out.getvalue() and "job 5" in out.getvalue()
    assert "nodes (" not in out.getvalue()  # no repair history on this node: no nodes section, no warning
    assert "repair history" not in out.getvalue()


def test_report_says_the_evidence_of_the_last_hang_counted_against_a_node():
    from slurmagent.core.goodput import build_report, format_text

    report = build_report([], now=NOW)
    report["lemon"] = {"faults": 3, "window_s": 7 * DAY}
    report["nodes"] = lemon.node_faults({}, NOW, faults=3, window_s=7 * DAY, hangs={"n4": [NOW - 60]},
                                        whys={"n4": [[NOW - 60, "job 9: rank 3 stuck outside the collective"]]})
    text = format_text(report)
    assert "n4: 1 fault(s) (1 of them hangs whose evidence named it; the last: job 9: rank 3 stuck outside the " \
           "collective)" in text, text
