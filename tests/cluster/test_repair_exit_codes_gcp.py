"""`repair`'s exit code, text and JSON agree when the Compute API refuses one method (HTTP 403:
exit 1, that node failed) and when it cannot be reached (503 until the retries run out: exit 3).

The real google-cloud-compute client talks to tests/support/fake_gcp.py over HTTP; Slurm is
the in-memory `FakeSlurm` (no cluster needed), and the command runs as typed, in this process.
"""

from __future__ import annotations

import json

import pytest

from support.fake_gcp import FakeGcp
from support.fakes.slurm import FakeSlurm
from slurmagent import cli
from slurmagent.errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE
from slurmagent.slurm.commands import Slurm

ZONE = "us-central1-a"
XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
RECREATE = "instanceGroupManagers.recreateInstances"


@pytest.fixture
def gcp():
    fake = FakeGcp().start()
    for name, mig in (("n1", "mig-a"), ("n2", "mig-a"), ("n3", "mig-b")):
        fake.add_instance(name, ZONE, mig=mig)
    yield fake
    fake.stop()


@pytest.fixture
def repair(gcp, tmp_path, capsys, monkeypatch):
    """`repair(strategy, *args)` -> (exit code, stdout, stderr), with n2 drained for a fault."""
    sc = FakeSlurm.cluster(3)
    sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: Slurm(runner=sc)))
    monkeypatch.setattr(cli, "_require_root_for_repair", lambda cfg: None)  # tested in test_hostile
    monkeypatch.setattr("slurmagent.gcp.compute.API_BACKOFF_S", 0.01)  # the retries, without their waits
    monkeypatch.setenv("SLURMD_NODENAME", "ctl")

    def run(strategy: str, *args: str) -> tuple[int, str, str]:
        config = tmp_path / f"{strategy}.toml"
        config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[gcp]\nproject = "{gcp.project}"\nzone = "{ZONE}"\n'
                          f'compute_endpoint = "{gcp.url}"\n[repair]\nstrategy = "{strategy}"\n'
                          'max_drained_fraction = 1.0\n')
        capsys.readouterr()
        code = cli.main(["--config", str(config), "repair", *args])
        out, err = capsys.readouterr()
        return code, out, err

    run.slurm = sc
    return run


def test_a_403_on_instances_get_fails_the_node_in_text_and_json(gcp, repair):
    gcp.fail("instances.get", 403)
    code, out, err = repair("auto", "--dry-run")  # auto reads the VM's facts, even in a dry run
    assert code == EXIT_PROBLEMS and out == ""
    assert err.startswith("n2: FAILED: cannot find its VM: instances.get: HTTP 403 ") and len(err.splitlines()) == 1

    gcp.fail("instances.get", 403)
    code, out, _ = repair("auto", "--dry-run", "--json")
    plan = json.loads(out)
    assert code == plan["exit_code"] == EXIT_PROBLEMS and plan["compute_error"] is None  # it answered: no outage
    (n2,) = plan["nodes"]
    assert (n2["node"], n2["outcome"]) == ("n2", "failed") and err == f"n2: FAILED: {n2['why']}\n"

    code, out, _ = repair("auto", "--dry-run", "--json")  # the API answers again
    (n2,) = json.loads(out)["nodes"]
    assert code == EXIT_OK and (n2["outcome"], n2["action"], n2["via"]) == ("planned", "recreate", "mig")
    assert n2["mig"] == f"zones/{ZONE}/instanceGroupManagers/mig-a"
    assert gcp.mutations == []


def test_a_403_on_recreate_instances_exits_1_and_puts_the_fault_back(gcp, repair):
    gcp.fail(RECREATE, 403)
    code, out, err = repair("recreate")
    assert code == EXIT_PROBLEMS
    assert err.startswith(f"n2: FAILED: {RECREATE}: HTTP 403 ") and "recreate requested" not in out
    assert [c.status for c in gcp.calls_of(RECREATE)] == [403]  # a refusal is not retried
    assert repair.slurm.nodes["n2"]["Reason"] == XID79  # back from `repairing` to the fault


def test_a_compute_api_that_stays_unavailable_exits_3(gcp, repair):
    gcp.fail(RECREATE, *[503] * 10)
    code, out, err = repair("recreate")
    assert code == EXIT_UNREACHABLE
    assert err.startswith(f"n2: FAILED: {RECREATE}: HTTP 503 ") and "attempts" in err
    assert len(gcp.calls_of(RECREATE)) > 1  # retried before it said so
    assert repair.slurm.nodes["n2"]["Reason"] == XID79
