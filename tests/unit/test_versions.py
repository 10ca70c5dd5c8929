"""Which slurmagent runs, everywhere an operator looks: `--version`, `status` (text and JSON),
`doctor`, every `--json` object, each decision-log line and the `slurmagent_build_info` metric.
A half-upgraded cluster shows. The version is faked here (state.build's per-process cache), so a
literal anywhere in the code would fail these; tests/unit/test_packaging.py checks the real one
against a built wheel."""

from __future__ import annotations

import json

import pytest

from support import healthy_snapshot_dict, xid_snapshot_dict
from test_operator_commands import Cluster, XID79  # noqa: F401 (the fixture's class)
from slurmagent import cli
from slurmagent.commands import doctor
from slurmagent.core.checks import run_checks
from slurmagent.core.snapshot import NodeSnapshot
from slurmagent.slurm.commands import Slurm
from slurmagent.state import build
from slurmagent.state.decisionlog import SEVERITIES, DecisionLog, read_records
from slurmagent.state.metrics import Metrics

FAKE = "7.7.7rc1"


@pytest.fixture
def fake_version(monkeypatch):
    monkeypatch.setattr(build, "_cached", FAKE)
    return FAKE


@pytest.fixture
def cluster(tmp_path, capsys, monkeypatch, fake_version) -> Cluster:
    c = Cluster(tmp_path, capsys)
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: Slurm(runner=c.sc)))
    monkeypatch.setattr(doctor, "external_results", lambda cfg, **kw: [])  # no network here
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    return c


def test_version_flag_prints_the_installed_version(cluster, capsys):
    code, out, _ = cluster.run("--version")
    assert code == 0 and out == f"slurmagent, version {FAKE}\n"


def test_status_says_the_version_in_text_and_json(cluster):
    cluster.sc.nodes["n2"].update(State="IDLE+DRAIN", Reason=XID79)
    code, out, _ = cluster.run("status")
    assert f"version: slurmagent {FAKE} (this node)" in out.splitlines()
    _, st, _ = cluster.json("status")
    assert st["version"] == FAKE
    _, job, _ = cluster.json("status", "--job", "77")
    assert job["version"] == FAKE


def test_doctor_says_the_version_in_a_line_and_in_json(cluster):
    _, out, _ = cluster.run("doctor")
    assert any(line.split()[:3] == ["ok", "version", "slurmagent"] and line.endswith(FAKE) for line in out.splitlines()), out
    _, doc, _ = cluster.json("doctor")
    assert doc["version"] == FAKE


@pytest.mark.parametrize("argv", [("repair", "--dry-run"), ("journal",), ("status",), ("doctor",)])
def test_every_json_object_carries_the_version(cluster, argv):
    _, doc, _ = cluster.json(*argv)
    assert isinstance(doc, dict) and doc["version"] == FAKE


def test_check_json_carries_the_version(cluster, tmp_path):
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(healthy_snapshot_dict(8)))
    code, doc, _ = cluster.json("check", "--snapshot", str(snap))
    assert code == 0 and doc["version"] == FAKE and doc["node"] == "n1"


def test_every_decision_log_line_has_a_cloud_logging_severity_and_the_version(tmp_path, fake_version):
    log = DecisionLog(tmp_path / "hooks.log", use_syslog=False)
    log.write("prolog", node="n1", verdict="healthy", action="none")
    log.write("prolog", node="n1", verdict="healthy", action="none", warnings=["gpu-count: expected unknown"])
    log.write("prolog", node="n1", verdict="unhealthy", rule="xid", action="drained")
    log.write("healthcheck", node="n1", verdict="internal-error", error="boom", action="none")
    log.write("watch", node="n1", severity="notice")
    records = read_records(tmp_path / "hooks.log")
    assert [r["severity"] for r in records] == ["INFO", "WARNING", "WARNING", "ERROR", "NOTICE"]
    assert all(r["severity"] in SEVERITIES and r["version"] == FAKE for r in records)


def test_build_info_metric_names_the_version_once(tmp_path, monkeypatch, fake_version):
    m = Metrics(tmp_path)
    monkeypatch.setattr(build, "_cached", "0.0.1")  # an older slurmagent wrote first
    m.record_check(run_checks(NodeSnapshot.from_dict(healthy_snapshot_dict()), expected_gpus=8))
    monkeypatch.setattr(build, "_cached", FAKE)
    m.record_check(run_checks(NodeSnapshot.from_dict(xid_snapshot_dict(79, gpu=3)), expected_gpus=8), drained_rule="xid")
    text = (tmp_path / "slurmagent.prom").read_text()
    assert [line for line in text.splitlines() if line.startswith("slurmagent_build_info")] == [
        f'slurmagent_build_info{{version="{FAKE}"}} 1']
    assert "# TYPE slurmagent_build_info gauge" in text


def test_the_hook_path_reads_the_version_without_importlib_metadata(tmp_path):
    """importlib.metadata costs as much as the prolog: the dist-info beside the package is read by hand."""
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "slurmagent-3.2.1.dist-info").mkdir(parents=True)
    (site / "slurmagent-3.2.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.4\nName: slurmagent\nVersion: 3.2.1\n\nbody\n")
    code = ("import sys; from slurmagent.state import build; v = build.version(); "
            "print(v, 'importlib.metadata' in sys.modules)")
    from support import REPO

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin"})
    built_from = build.commit()  # this checkout's HEAD (the same package), when it is a git checkout
    assert out.stdout.split() == [f"3.2.1+g{built_from}" if built_from else "3.2.1", "False"], out.stderr
