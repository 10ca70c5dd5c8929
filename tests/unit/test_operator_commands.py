"""The operator's commands tell the truth to a monitoring script: `status`, `repair --dry-run`
and `journal` exit 0 (all good), 1 (problems found), 2 (usage/config error) or 3 (Slurm or the
Compute API could not be reached), and their text and `--json` say the same thing.

Each command runs as typed (`slurmagent.cli.main`) against the in-memory Slurm (`FakeSlurm`:
`down` plays a slurmctld that cannot be reached) and a stub Compute API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from support.fakes.slurm import FakeSlurm
from slurmagent import cli
from slurmagent.actions.executor import JournalExecutor
from slurmagent.errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE, EXIT_USAGE
from slurmagent.gcp.compute import ComputeError
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import load
from slurmagent.state.repair_state import save_state

XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
EXPIRY = "slurmagent: expiry: flex expiry at 2026-12-01T20:00:00Z"
MIG = {"project": "1", "scope": "zones", "location": "z", "name": "mig-a"}


class Cluster:
    """Four nodes, this one n1; `run(*argv)` -> (exit code, stdout, stderr), as typed."""

    def __init__(self, tmp_path, capsys, strategy: str = "recreate"):
        self.sc = FakeSlurm.cluster(4)
        self.tmp, self.capsys = tmp_path, capsys
        self.config = tmp_path / "c.toml"
        self.config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[gcp]\nproject = "p"\nzone = "z"\n'
                               f'compute_endpoint = "http://127.0.0.1:9"\n[repair]\nstrategy = "{strategy}"\nmax_drained_fraction = 1.0\n')

    def run(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = cli.main(["--config", str(self.config), *argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> tuple[int, dict, str]:
        code, out, err = self.run(*argv, "--json")
        return code, json.loads(out), err

    def executor(self, node: str = "n1") -> JournalExecutor:
        return JournalExecutor(load(str(self.config)), Slurm(runner=self.sc), node)


@pytest.fixture
def cluster(tmp_path, capsys, monkeypatch) -> Cluster:
    c = Cluster(tmp_path, capsys)
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: Slurm(runner=c.sc)))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    return c


def test_the_unreachable_code_is_its_own():
    assert len({EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_UNREACHABLE, 75, 76, 143}) == 7  # `run` uses 75, 76, 143


# --- status -------------------------------------------------------------------------------


def test_status_with_slurm_stopped_exits_3_and_claims_no_state_it_did_not_read(cluster):
    cluster.sc.down = True
    assert cluster.executor().drain_fault(XID79).action.startswith("drain-failed: pending in the journal")

    code, out, err = cluster.run("status")
    assert code == EXIT_UNREACHABLE, err
    assert out.splitlines()[0].startswith("slurm: cannot read the nodes: ") and "Unable to contact" in out
    assert "breaker: unknown (Slurm unreachable)" in out and "1 pending action(s)" in out

    code, st, _ = cluster.json("status")
    assert code == st["exit_code"] == EXIT_UNREACHABLE
    assert "Unable to contact" in st["slurm_error"]
    assert st["breaker"]["state"] == "unknown"  # never "closed": it was not read
    assert st["breaker"]["total"] is st["breaker"]["drained"] is st["breaker"]["allowed"] is None
    assert st["nodes"] is None  # not "no node is drained"
    assert st["journal"]["pending"] == 1  # what it could read, it says


def test_status_exits_0_on_a_quiet_cluster_and_1_with_a_fault_drain(cluster):
    cluster.sc.nodes["n4"].update(State="IDLE+DRAIN", Reason=EXPIRY)  # planned: not a problem
    code, out, _ = cluster.run("status")
    assert code == EXIT_OK and "problems:" not in out and "n4 " in out
    code, st, _ = cluster.json("status")
    assert code == st["exit_code"] == EXIT_OK and st["problems"] == []
    assert [(r["node"], r["drain"]) for r in st["nodes"]] == [("n4", "planned")]
    assert st["breaker"]["state"] in ("closed", "off")

    cluster.sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    code, out, _ = cluster.run("status")
    code_json, st, _ = cluster.json("status")
    assert code == code_json == st["exit_code"] == EXIT_PROBLEMS
    assert st["problems"] == ["1 node(s) drained by slurmagent for a fault: n2"]
    assert out.splitlines()[-1] == "problems: " + "; ".join(st["problems"])


def test_status_of_a_job_with_slurm_stopped_exits_3(cluster):
    cluster.sc.down = True
    code, out, _ = cluster.run("status", "--job", "77")
    assert code == EXIT_UNREACHABLE and out.startswith("job 77: slurm: ") and "Unable to contact" in out
    code, st, _ = cluster.json("status", "--job", "77")
    assert code == st["exit_code"] == EXIT_UNREACHABLE and st["slurm"] is None and "Unable to contact" in st["slurm_error"]


# --- repair --dry-run ---------------------------------------------------------------------


def test_repair_dry_run_with_slurm_stopped_exits_3_in_text_and_json(cluster):
    cluster.sc.down = True
    code, out, err = cluster.run("repair", "--dry-run")
    assert code == EXIT_UNREACHABLE and out == ""
    assert err.startswith("slurmagent: repair: cannot read the nodes from Slurm: ") and len(err.splitlines()) == 1
    code, plan, _ = cluster.json("repair", "--dry-run")
    assert code == plan["exit_code"] == EXIT_UNREACHABLE
    assert plan["nodes"] is None and "Unable to contact" in plan["slurm_error"] and plan["dry_run"] is True
    assert err.rstrip("\n").endswith(plan["slurm_error"])


def test_repair_json_goes_with_dry_run_only(cluster):
    code, out, err = cluster.run("repair", "--json")
    assert code == EXIT_USAGE and "--json goes with --dry-run" in err
    assert "--json goes with --dry-run" in json.loads(out)["error"]  # --json asked: the error as JSON too
    assert cluster.sc.calls == []


def parse_dry_run(out: str, err: str) -> dict[str, tuple[str, str]]:
    """The text of `repair --dry-run`, per node: (outcome, the rest of its line)."""
    nodes = {}
    for line in out.splitlines() + err.splitlines():
        name, _, rest = line.partition(": ")
        for word, outcome in (("would ", "planned"), ("skipped: ", "skipped"), ("refused: ", "refused"),
                              ("FAILED: ", "failed")):
            if rest.startswith(word):
                nodes[name] = (outcome, rest[len(word):] if outcome != "planned" else rest)
    return nodes


@pytest.mark.parametrize("strategy", ["recreate", "report-faulty"])
def test_repair_dry_run_json_is_the_text_plan_node_by_node(tmp_path, capsys, monkeypatch, strategy):
    c = Cluster(tmp_path, capsys, strategy)
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: Slurm(runner=c.sc)))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    c.sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    c.sc.nodes["n3"].update(State="IDLE+DRAIN", Reason=EXPIRY)  # not a fault a new VM fixes: skipped
    c.sc.nodes["n4"].update(State="IDLE+DRAIN", Reason="slurmagent: gpu-lost: gpu 1 GPU is lost")
    save_state(tmp_path / "state" / "n1", {"migs": {"n2": {"zone": "z", "mig": MIG}}})  # n4's MIG: unknown

    code, out, err = c.run("repair", "--dry-run", "n[2-4]", "n9")
    code_json, plan, _ = c.json("repair", "--dry-run", "n[2-4]", "n9")
    assert code == code_json == plan["exit_code"] == EXIT_PROBLEMS  # n9 is refused
    assert plan["slurm_error"] is None and plan["compute_error"] is None and plan["strategy"] == strategy
    text = parse_dry_run(out, err)
    nodes = {n["node"]: n for n in plan["nodes"]}
    assert sorted(nodes) == sorted(text) == ["n2", "n3", "n4", "n9"]
    for name, (outcome, rest) in text.items():
        assert nodes[name]["outcome"] == outcome, name
        if outcome != "planned":
            assert nodes[name]["why"] == rest and nodes[name]["action"] is None
    assert nodes["n9"]["why"] == "no such node in Slurm"
    n2, n4 = nodes["n2"], nodes["n4"]
    assert n2["fault"] == "xid 79 on gpu 3 (fallen off the bus)" and n2["fault"] in text["n2"][1]
    assert not n2["drain_first"] and "drain and" not in text["n2"][1]
    if strategy == "recreate":
        assert (n2["action"], n2["via"], n2["mig"]) == ("recreate", "mig", "zones/z/instanceGroupManagers/mig-a")
        assert text["n2"][1].startswith(f"would recreate via MIG {n2['mig']} ")
        assert (n4["action"], n4["via"], n4["mig"]) == ("recreate", "mig", None)  # looked up at run time
        assert "its MIG (looked up at run time)" in text["n4"][1]
    else:
        assert (n2["action"], n2["via"], n2["mig"], n2["fault_behavior"]) == (
            "report-faulty", "vm", None, "UNRECOVERABLE_GPU_ERROR")
        assert text["n2"][1].startswith("would report host as faulty [UNRECOVERABLE_GPU_ERROR]")
    assert c.sc.updates() == []  # a dry run changes nothing


class StubCompute:
    """The Compute API as `repair` sees it: instances.get answers `error`."""

    def __init__(self, error: ComputeError):
        self.error, self.total_calls = error, 0

    def vm(self, zone, name, deadline_s=None):
        self.total_calls += 1
        raise self.error


@pytest.mark.parametrize(("error", "expected"), [
    (ComputeError("instances.get: ConnectionError: connection refused (after 6 attempts)", None), EXIT_UNREACHABLE),
    (ComputeError("instances.get: HTTP 503 backendError (after 6 attempts)", 503), EXIT_UNREACHABLE),
    (ComputeError("instances.get: HTTP 403 Required 'compute.instances.get' permission", 403), EXIT_PROBLEMS),
])
def test_repair_dry_run_tells_an_unreachable_compute_api_from_a_refusal(tmp_path, capsys, monkeypatch, error, expected):
    c = Cluster(tmp_path, capsys, "auto")  # auto reads the VM's facts, even in a dry run
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: Slurm(runner=c.sc)))
    monkeypatch.setattr(JournalExecutor, "compute", lambda self, project: StubCompute(error))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    c.sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)

    code, out, err = c.run("repair", "--dry-run")
    assert code == expected and out == ""
    assert err == f"n2: FAILED: cannot find its VM: {error}\n"
    code, plan, _ = c.json("repair", "--dry-run")
    assert code == plan["exit_code"] == expected
    assert plan["compute_error"] == (str(error) if expected == EXIT_UNREACHABLE else None)
    assert [(n["node"], n["outcome"], n["why"]) for n in plan["nodes"]] == [
        ("n2", "failed", f"cannot find its VM: {error}")]


# --- journal ------------------------------------------------------------------------------


def journal_lines(out: str) -> list[tuple[str, dict, int]]:
    found = []
    for line in out.splitlines():
        if line.startswith("pending "):
            _, kind, rest = line.split(" ", 2)
            payload, _, tail = rest.partition("} attempts=")
            found.append((kind, json.loads(payload + "}"), int(tail.split()[0])))
    return found


def test_journal_with_slurm_stopped_exits_3_and_json_matches_the_lines(cluster):
    code, out, _ = cluster.run("journal")
    assert code == EXIT_OK and out.startswith("no pending actions in ")
    code, doc, _ = cluster.json("journal")
    assert code == doc["exit_code"] == EXIT_OK and doc["entries"] == [] and doc["node"] == "n1"

    cluster.sc.down = True
    cluster.executor().drain_fault(XID79)  # journaled, tried once: slurmctld unreachable
    code, out, _ = cluster.run("journal")
    assert code == EXIT_PROBLEMS  # an action is waiting
    code_json, doc, _ = cluster.json("journal")
    assert code_json == doc["exit_code"] == EXIT_PROBLEMS and doc["slurm_error"] is None and doc["replayed"] == []
    assert journal_lines(out) == [(e["kind"], e["payload"], e["attempts"]) for e in doc["entries"]]
    (entry,) = doc["entries"]
    assert (entry["kind"], entry["payload"]["node"], entry["payload"]["reason"]) == ("drain", "n1", XID79)
    assert entry["state"] == "pending" and entry["attempts"] == 1 and "slurmctld unreachable" in entry["last_error"]

    code, out, _ = cluster.run("journal", "--replay")
    assert code == EXIT_UNREACHABLE
    assert out.splitlines()[0].startswith("drain {") and ": pending: slurmctld unreachable: " in out
    code, doc, _ = cluster.json("journal", "--replay")
    assert code == doc["exit_code"] == EXIT_UNREACHABLE and doc["slurm_error"].startswith("slurmctld unreachable: ")
    assert [(r["kind"], r["state"]) for r in doc["replayed"]] == [("drain", "pending")]
    assert [e["attempts"] for e in doc["entries"]] == [3]  # each replay counted its try

    cluster.sc.down = False
    code, doc, _ = cluster.json("journal", "--replay")
    assert code == doc["exit_code"] == EXIT_OK and doc["slurm_error"] is None and doc["entries"] == []
    assert [(r["kind"], r["state"], r["outcome"]) for r in doc["replayed"]] == [("drain", "done", "drained")]
    assert cluster.sc.nodes["n1"]["State"] == "IDLE+DRAIN"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root refuses a journal others can write")
def test_journal_root_refuses_is_said_not_hidden(cluster):
    cluster.executor().drain_fault(XID79)  # drained now; the journal exists
    (cluster.tmp / "state" / "n1" / "journal" / "pending").chmod(0o777)
    code, out, _ = cluster.run("journal")
    assert code == EXIT_PROBLEMS and out.startswith("not read: ") and "no pending actions" not in out
    code, doc, _ = cluster.json("journal")
    assert code == doc["exit_code"] == EXIT_PROBLEMS and doc["untrusted"] and doc["entries"] == []


# --- shell completion (docs/admin/commands.md) ---------------------------------------------


def complete(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmagent.entry"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


@pytest.mark.parametrize(("shell", "needle"), [("bash", "complete -o nosort -F"), ("zsh", "compdef"),
                                               ("fish", "complete --no-files --command slurmagent")])
def test_completion_scripts_come_from_the_documented_variable(shell, needle):
    proc = complete({"_SLURMAGENT_COMPLETE": f"{shell}_source"})
    assert proc.returncode == 0 and needle in proc.stdout and "_SLURMAGENT_COMPLETE" in proc.stdout, proc.stderr


def completions(words: str) -> set[str]:
    """What bash gets for the last word (click answers `type,value` lines)."""
    proc = complete({"_SLURMAGENT_COMPLETE": "bash_complete", "COMP_WORDS": words,
                     "COMP_CWORD": str(len(words.split()) - 1)})
    assert proc.returncode == 0, proc.stderr
    return {line.partition(",")[2] for line in proc.stdout.splitlines()}


def test_completion_completes_commands_and_options():
    assert completions("slurmagent rep") == {"repair", "report"}
    assert completions("slurmagent ck") == {"ckpt"}  # a group registered from cli_bucket completes too
    assert {"--json", "--replay", "--node"} <= completions("slurmagent journal --")
    assert {"--dry-run", "--json", "--force"} <= completions("slurmagent repair --")


def test_status_says_a_journal_it_cannot_read_instead_of_no_pending_actions(cluster):
    (cluster.tmp / "state" / "n1" / "journal").mkdir(parents=True)
    (cluster.tmp / "state" / "n1" / "journal" / "pending").write_text("")  # unreadable as a directory
    code, out, _ = cluster.run("status")
    assert code == EXIT_PROBLEMS and "no pending actions" not in out
    assert "journal: cannot read " in out
    code, st, _ = cluster.json("status")
    assert code == st["exit_code"] == EXIT_PROBLEMS
    assert st["journal"]["pending"] is None and list(st["journal"]["unreadable"]) == ["n1"]
    assert out.splitlines()[-1] == "problems: " + "; ".join(st["problems"])


@pytest.mark.parametrize("argv", [["status", "--json"], ["status"], ["repair", "--dry-run", "--json"],
                                  ["journal", "--json"], ["check", "--json"]])
def test_a_missing_config_file_is_exit_2_one_line_and_a_json_error_object_with_json(cluster, argv):
    cluster.config = cluster.tmp / "absent.toml"
    code, out, err = cluster.run(*argv)
    assert code == EXIT_USAGE
    assert err == f"slurmagent: config {cluster.config}: file not found\n"
    if "--json" in argv:  # scripts read stdout: one JSON object saying what failed
        doc = json.loads(out)
        assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"] == f"config {cluster.config}: file not found"
    else:
        assert out == ""
    assert cluster.sc.calls == []
