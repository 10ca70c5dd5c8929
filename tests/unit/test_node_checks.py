"""The node checks beyond the GPUs (issue 39): GPU NICs against the metadata server's list,
configured mounts, full filesystems and `dcgmi diag`, over a fake sysfs tree, a fake
/proc/self/mountinfo, the fake metadata server and a fake `dcgmi` (tests/support/fakes/dcgm)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict, write_json
from support.fake_gcp import FakeGcp
from support.fakes.slurm import FakeSlurm
from slurmagent.commands.health import NodeSources, evaluate, evaluator, node_findings
from slurmagent.commands.repair import run_resume_if_healthy
from slurmagent.core import node_checks as nc
from slurmagent.core.checks import Severity
from slurmagent.errors import ConfigError
from slurmagent.gcp import metadata
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import parse

FAKE_DCGMI = REPO / "tests" / "support" / "fakes" / "dcgm" / "dcgmi"
MAC0, MAC1, MAC2 = "42:01:0a:00:00:02", "42:01:c0:a8:01:02", "42:01:c0:a8:02:02"


def config(tmp_path: Path, checks: dict | None = None, **health) -> object:
    snap = write_json(tmp_path / "snap.json", healthy_snapshot_dict())
    return parse({"state_dir": str(tmp_path / "state"),
                  "health": {"snapshot": str(snap), "kernel_log_enabled": False, "expected_gpus": 8, **health},
                  "checks": checks or {}})


def sources(tmp_path: Path, boot: str = "boot-1", jobs: tuple[str, ...] = ()) -> NodeSources:
    (tmp_path / "boot_id").write_text(boot + "\n")
    return NodeSources(sysfs=tmp_path / "sys", proc=tmp_path / "proc", boot_id_path=str(tmp_path / "boot_id"),
                       jobs_on_node=lambda cfg, node: list(jobs))


def netdev(tmp_path: Path, name: str, mac: str, operstate: str = "up") -> None:
    d = tmp_path / "sys" / "class" / "net" / name
    d.mkdir(parents=True)
    (d / "address").write_text(mac + "\n")
    (d / "operstate").write_text(operstate + "\n")


def rdma(tmp_path: Path, dev: str, over: str, *states: str) -> None:
    d = tmp_path / "sys" / "class" / "infiniband" / dev
    (d / "device" / "net" / over).mkdir(parents=True)
    for i, state in enumerate(states, 1):
        (d / "ports" / str(i)).mkdir(parents=True)
        (d / "ports" / str(i) / "state").write_text(state + "\n")


@pytest.fixture
def gcp(monkeypatch):
    fake = FakeGcp().start()
    fake.metadata["instance/network-interfaces"] = json.dumps([
        {"mac": MAC0, "network": "projects/1/networks/default", "mtu": 8896},
        {"mac": MAC1, "network": "projects/1/networks/gpu-net-1", "mtu": 8244},
        {"mac": MAC2, "network": "projects/1/networks/gpu-net-2", "mtu": 8244,
         "ipAliases": [f"10.{i}.0.0/24" for i in range(400)]}])  # longer than a notice (4 KiB)
    monkeypatch.setenv("GCE_METADATA_HOST", fake.host)
    metadata.reset_cache()
    yield fake
    fake.stop()
    metadata.reset_cache()


def asked_nics(fake: FakeGcp) -> int:
    return len([c for c in fake.calls if c.kind == "metadata" and "network-interfaces" in c.path])


def drains(findings) -> list[str]:
    return [f.summary for f in findings if f.severity is Severity.DRAIN]


# --- GPU NICs ----------------------------------------------------------------------------


def test_every_attached_nic_present_and_up_passes_and_the_metadata_is_asked_once_per_boot(tmp_path, gcp):
    netdev(tmp_path, "ens4", MAC0)
    netdev(tmp_path, "enp0s12", MAC1)
    netdev(tmp_path, "enp0s13", MAC2.upper())  # the kernel's case is not the metadata's
    rdma(tmp_path, "mlx5_0", "enp0s12", "4: ACTIVE")
    cfg, src = config(tmp_path), sources(tmp_path)
    assert evaluate(cfg, "n1", False, layer="healthcheck", node_sources=src).findings == []
    assert node_findings(cfg, "n1", "epilog", src) == []
    assert asked_nics(gcp) == 1  # the second read is the per-boot cache
    node_findings(cfg, "n1", "healthcheck", sources(tmp_path, boot="boot-2"))
    assert asked_nics(gcp) == 2  # a new boot asks again (a VM may come back with other NICs)


def test_an_attached_nic_missing_in_the_guest_drains_naming_it(tmp_path, gcp):
    netdev(tmp_path, "ens4", MAC0)
    netdev(tmp_path, "enp0s12", MAC1)
    report = evaluate(config(tmp_path), "n1", False, layer="healthcheck", node_sources=sources(tmp_path))
    assert not report.healthy
    assert report.worst.summary == f"gpu-nics: nic2 ({MAC2}, gpu-net-2) attached but not in the guest"


def test_a_nic_down_or_an_rdma_port_not_active_drains(tmp_path, gcp):
    netdev(tmp_path, "ens4", MAC0)
    netdev(tmp_path, "enp0s12", MAC1, operstate="down")
    netdev(tmp_path, "enp0s13", MAC2)
    rdma(tmp_path, "mlx5_1", "enp0s13", "1: DOWN")
    found = drains(node_findings(config(tmp_path), "n1", "resume", sources(tmp_path)))
    assert found == [f"gpu-nics: nic1 ({MAC1}, gpu-net-1) is enp0s12: link down",
                     f"gpu-nics: nic2 ({MAC2}, gpu-net-2) is enp0s13/mlx5_1: RDMA port 1: DOWN"]


def test_off_google_cloud_the_nic_check_says_not_available_once_and_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: refused at once
    metadata.reset_cache()
    cfg, src = config(tmp_path), sources(tmp_path)
    first = evaluate(cfg, "n1", True, layer="healthcheck", node_sources=src)
    assert first.healthy and [f.summary for f in first.findings] == [
        f.summary for f in first.findings if f.summary.startswith("gpu-nics: not available: no NIC list")]
    assert len(first.findings) == 1
    metadata.reset_cache()
    assert evaluate(cfg, "n1", True, layer="healthcheck", node_sources=src).findings == []  # said once


def test_a_failing_metadata_server_is_asked_again_not_taken_for_off_google_cloud(tmp_path, gcp):
    netdev(tmp_path, "ens4", MAC0)
    gcp.fail("metadata", 503)
    cfg, src = config(tmp_path), sources(tmp_path)
    first = node_findings(cfg, "n1", "healthcheck", src)
    assert [f.summary[:61] for f in first] == ["gpu-nics: not available: no NIC list from the metadata server"]
    assert "HTTP 503" in first[0].summary
    assert drains(node_findings(cfg, "n1", "healthcheck", src)) == [
        f"gpu-nics: nic1 ({MAC1}, gpu-net-1) attached but not in the guest",
        f"gpu-nics: nic2 ({MAC2}, gpu-net-2) attached but not in the guest"]
    assert asked_nics(gcp) == 2


def test_the_nic_check_honours_its_kill_switch_and_its_layers(tmp_path, gcp):
    assert node_findings(config(tmp_path, {"off": ["gpu-nics"]}), "n1", "healthcheck", sources(tmp_path)) == []
    assert node_findings(config(tmp_path), "n1", "prolog", sources(tmp_path)) == []  # not in the healthy prolog
    assert asked_nics(gcp) == 0
    assert drains(node_findings(config(tmp_path), "n1", "healthcheck", sources(tmp_path)))  # no NIC in the guest


# --- local mounts and full filesystems ------------------------------------------------------


def mountinfo(tmp_path: Path, *lines: tuple[str, str, str]) -> None:
    """(mount point, per-mount options, superblock options) lines of a fake /proc/self/mountinfo."""
    (tmp_path / "proc" / "self").mkdir(parents=True, exist_ok=True)
    text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    for i, (point, opts, sopts) in enumerate(lines):
        text += f"{40 + i} 22 259:{i} / {point.replace(' ', chr(92) + '040')} {opts} shared:{9 + i} - ext4 /dev/md{i} {sopts}\n"
    (tmp_path / "proc" / "self" / "mountinfo").write_text(text)


def test_an_unreadable_mountinfo_is_not_a_drain(tmp_path):
    found = node_findings(config(tmp_path, mounts=["/mnt/localssd"]), "n1", "prolog", sources(tmp_path))
    assert [(f.severity, f.summary) for f in found] == [
        (Severity.WARN, f"local-mounts: not available: cannot read {tmp_path / 'proc'}/self/mountinfo")]


def test_a_mounted_writable_disk_passes_and_the_probe_leaves_nothing(tmp_path):
    ssd = tmp_path / "local ssd"
    ssd.mkdir()
    mountinfo(tmp_path, (str(ssd), "rw,relatime", "rw,errors=remount-ro"))
    cfg = config(tmp_path, {"off": ["gpu-nics"]}, mounts=[str(ssd)], full_warn_percent=100)
    assert evaluate(cfg, "n1", True, layer="prolog", node_sources=sources(tmp_path)).findings == []
    assert list(ssd.iterdir()) == []


def test_a_missing_mount_drains_and_a_repair_answers_it(tmp_path):
    from slurmagent.core import reasons

    ssd = tmp_path / "ssd"
    ssd.mkdir()  # the directory is there, the array is not mounted on it
    mountinfo(tmp_path)
    report = evaluate(config(tmp_path, {"off": ["gpu-nics"]}, mounts=[str(ssd)]), "n1", True, layer="healthcheck",
                      node_sources=sources(tmp_path))
    assert report.worst.summary == f"local-mounts: {ssd} is not mounted"
    assert reasons.repairable(reasons.reason_for(report))  # hardware: a new VM brings a new array


def test_a_disk_remounted_read_only_drains(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    mountinfo(tmp_path, (str(ssd), "ro,relatime", "ro,errors=remount-ro"))
    found = drains(node_findings(config(tmp_path, mounts=[str(ssd)]), "n1", "prolog", sources(tmp_path)))
    assert found == [f"local-mounts: {ssd} (/dev/md0) is read-only (remounted after an I/O error?)"]


def test_a_mount_that_refuses_the_probe_drains(tmp_path):
    not_a_dir = tmp_path / "ssd"
    not_a_dir.write_text("")  # open(O_DIRECTORY) fails: the probe cannot write there
    mountinfo(tmp_path, (str(not_a_dir), "rw", "rw"))
    found = drains(node_findings(config(tmp_path, mounts=[str(not_a_dir)]), "n1", "epilog", sources(tmp_path)))
    assert found == [f"local-mounts: {not_a_dir}: write probe failed (cannot open: Not a directory)"]


def test_a_full_filesystem_is_a_warning_never_a_drain(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    mountinfo(tmp_path, (str(ssd), "rw", "rw"))
    asked = []

    def statvfs(point):  # 97 of 100 blocks used, 1 of the 3 free kept for root: 98 %
        asked.append(point)
        return os.statvfs_result((4096, 4096, 100, 3, 2, 0, 0, 0, 0, 255))

    src = dataclasses.replace(sources(tmp_path), statvfs=statvfs)
    cfg = config(tmp_path, {"off": ["gpu-nics"]}, mounts=[str(ssd)], ckpt_filesystem=str(tmp_path))
    report = evaluate(cfg, "n1", True, layer="healthcheck", node_sources=src)
    assert report.healthy
    assert sorted(f.rule for f in report.findings) == ["filesystem-full", "filesystem-full"]
    assert sorted(f.detail for f in report.findings) == sorted(
        f"{p} is 98% used (warn at 95%)" for p in (ssd, tmp_path))
    assert set(asked) == {str(ssd), str(tmp_path)}
    cfg = config(tmp_path, {"off": ["gpu-nics"]}, mounts=[str(ssd)], full_warn_percent=99)
    assert evaluate(cfg, "n1", True, layer="healthcheck", node_sources=src).findings == []
    cfg = config(tmp_path, {"off": ["gpu-nics", "filesystem-full"]}, mounts=[str(ssd)])
    assert evaluate(cfg, "n1", True, layer="healthcheck", node_sources=src).findings == []


def test_mountinfo_unescapes_and_reads_the_superblock_options():
    table = nc.parse_mountinfo("36 35 98:0 /mnt1 /mnt/local\\040ssd ro,noatime master:1 - ext3 /dev/root rw,errors=continue\n")
    mount = table["/mnt/local ssd"]
    assert mount.mount_options == ("ro", "noatime") and not mount.fs_read_only  # a read-only bind, not the disk


# --- DCGM diagnostics ----------------------------------------------------------------------


@pytest.fixture
def dcgmi(tmp_path, monkeypatch):
    log = tmp_path / "dcgmi.log"
    monkeypatch.setenv("FAKE_DCGMI_LOG", str(log))

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []
    return calls


def dcgm_config(tmp_path, **health):
    return config(tmp_path, {"off": ["gpu-nics"]}, dcgmi=str(FAKE_DCGMI), **health)


def test_dcgm_level_2_in_resume_passes_and_a_failing_test_drains_named(tmp_path, dcgmi, monkeypatch):
    cfg = dcgm_config(tmp_path)
    monkeypatch.setenv("FAKE_DCGMI_MODE", "pass")
    assert node_findings(cfg, "n1", "resume", sources(tmp_path)) == []
    monkeypatch.setenv("FAKE_DCGMI_MODE", "fail")
    found = drains(node_findings(cfg, "n1", "resume", sources(tmp_path)))
    assert found == ["dcgm-diag: level 2 failed Integration/PCIe (gpu 3): GPU 3: PCIe replay errors above the "
                     "threshold (62 > 8)"]
    assert dcgmi() == ["diag -r 2 -j", "diag -r 2 -j"]


def test_dcgm_never_runs_in_the_prolog_and_in_healthcheck_only_at_its_level(tmp_path, dcgmi, monkeypatch):
    monkeypatch.setenv("FAKE_DCGMI_MODE", "fail-level1")
    for layer in ("prolog", "epilog", "healthcheck"):
        assert node_findings(dcgm_config(tmp_path), "n1", layer, sources(tmp_path)) == []
    assert dcgmi() == []
    cfg = dcgm_config(tmp_path, dcgm_healthcheck_level=1)
    found = drains(node_findings(cfg, "n1", "healthcheck", sources(tmp_path)))
    assert found == ["dcgm-diag: level 1 failed Deployment/Permissions and OS Blocks (gpu 0,1,2,3,4,5,6,7): "
                     "Cannot open /dev/nvidiactl: permission denied"]
    assert dcgmi() == ["diag -r 1 -j"]
    late = node_findings(cfg, "n1", "healthcheck", sources(tmp_path), started=time.monotonic() - 41)
    assert [f.summary[:69] for f in late] == ["dcgm-diag: not run: the other checks took the health check's time (sl"]
    assert node_findings(cfg, "n1", "healthcheck", sources(tmp_path, jobs=("42",))) == []  # never under a job
    assert node_findings(dcgm_config(tmp_path), "n1", "resume", sources(tmp_path, jobs=("42",))) == []
    assert dcgmi() == ["diag -r 1 -j"]
    with pytest.raises(ConfigError, match="dcgm_healthcheck_level' = 2 is out of range"):
        dcgm_config(tmp_path, dcgm_healthcheck_level=2)


def test_dcgm_past_its_deadline_is_a_warning(tmp_path, dcgmi, monkeypatch):
    monkeypatch.setenv("FAKE_DCGMI_MODE", "timeout")
    monkeypatch.setenv("FAKE_DCGMI_SLEEP", "20")
    found = node_findings(dcgm_config(tmp_path, dcgm_timeout_s=1), "n1", "resume", sources(tmp_path))
    assert [(f.severity, f.summary) for f in found] == [
        (Severity.WARN, "dcgm-diag: `dcgmi diag -r 2` did not finish within 1 s")]


@pytest.mark.parametrize("mode, dcgmi_path, why", [
    ("engine-down", str(FAKE_DCGMI), "DCGM host engine not running (Error: unable to establish a connection"),
    ("pass", "/nonexistent/dcgmi", "/nonexistent/dcgmi not found (DCGM not installed)")])
def test_dcgm_absent_or_its_engine_down_is_not_available_said_once(tmp_path, monkeypatch, mode, dcgmi_path, why):
    monkeypatch.setenv("FAKE_DCGMI_MODE", mode)
    cfg = config(tmp_path, {"off": ["gpu-nics"]}, dcgmi=dcgmi_path)
    first = node_findings(cfg, "n1", "resume", sources(tmp_path))
    assert [(f.severity, f.summary[:len("dcgm-diag: not available: ") + len(why)]) for f in first] == [
        (Severity.WARN, "dcgm-diag: not available: " + why)]
    assert node_findings(cfg, "n1", "resume", sources(tmp_path)) == []  # said once this boot
    assert len(node_findings(cfg, "n1", "resume", sources(tmp_path, boot="boot-2"))) == 1
    assert len(node_findings(cfg, "n1", "check", sources(tmp_path))) == 0  # check's level: the healthcheck's (0)
    unknown = dataclasses.replace(sources(tmp_path), boot_id_path=str(tmp_path / "no-boot-id"))  # unreadable
    assert len(node_findings(cfg, "n1", "resume", unknown)) == 1
    assert node_findings(cfg, "n1", "resume", unknown) == []  # said once while the boot id is unknown too


def test_dcgm_4_shape_is_read_too():
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
        {"name": "memory", "results": [{"entity_group": "GPU", "entity_id": 5, "status": "Fail",
                                        "warnings": [{"warning": "ECC DBE", "error_id": 27}]},
                                       {"entity_group": "GPU", "entity_id": 1, "status": "Pass"}]},
        {"name": "pcie", "results": [{"entity_group": "GPU", "entity_id": 1, "status": "Skip"}]}]}]}}
    result = nc.parse_diag("Warning: something first\n" + json.dumps(doc))
    assert result.failed == ("Hardware/memory (gpu 5): ECC DBE",) and result.tests == 2


# --- resume-if-healthy, config ----------------------------------------------------------------


def test_resume_if_healthy_with_a_failing_level_2_leaves_the_node_drained_naming_the_test(tmp_path, dcgmi, monkeypatch):
    sc = FakeSlurm.cluster(2)
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason="slurmagent: repairing: xid 79 on gpu 3 (fallen off the bus)")
    cfg = dcgm_config(tmp_path)
    health = evaluator("resume", sources(tmp_path))
    monkeypatch.setenv("FAKE_DCGMI_MODE", "fail")
    out = io.StringIO()
    assert run_resume_if_healthy(cfg, "n1", out=out, slurm=Slurm(runner=sc), health=health, wait_s=5) == 1
    assert "DRAIN" in sc.nodes["n1"]["State"]
    assert sc.nodes["n1"]["Reason"].startswith("slurmagent: dcgm-diag: level 2 failed Integration/PCIe (gpu 3)")
    assert "UNHEALTHY" in out.getvalue() and dcgmi() == ["diag -r 2 -j"]
    monkeypatch.setenv("FAKE_DCGMI_MODE", "pass")
    assert run_resume_if_healthy(cfg, "n1", out=io.StringIO(), slurm=Slurm(runner=sc), health=health, wait_s=5) == 0
    assert sc.nodes["n1"]["State"] == "IDLE"


def test_a_check_name_not_in_the_catalogue_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'checks.off' names no check: 'gpu-nic' \(slurmagent check --list\)"):
        parse({"checks": {"off": ["gpu-nic"]}})
    assert parse({"checks": {"off": ["dcgm-diag"], "on": []}}).checks.off == ("dcgm-diag",)


def test_the_drains_of_the_node_checks_are_repaired_as_hardware():
    from slurmagent.core import reasons
    from slurmagent.policy.repair import fault_behavior

    for reason in ("slurmagent: gpu-nics: nic1 (42:01:c0:a8:01:02, gpu-net-1) attached but not in the guest",
                   "slurmagent: local-mounts: /mnt/localssd is read-only (remounted after an I/O error?)",
                   "slurmagent: repairing: dcgm-diag: level 2 failed Integration/PCIe (gpu 3)"):
        assert reasons.repairable(reason), reason
    assert fault_behavior("dcgm-diag") == "UNRECOVERABLE_GPU_ERROR"  # reportHostAsFaulty's reason: the GPU's
    assert fault_behavior("gpu-nics") == fault_behavior("local-mounts") == "BEHAVIOR_UNSPECIFIED"


def test_the_probe_verdicts_a_sandbox_a_hang_and_a_full_disk():
    rw_fs_ro_view = nc.Mount("/mnt/localssd", "ext4", "/dev/md0", ("ro", "relatime"), ("rw",))
    sandbox = nc.mount_findings("/mnt/localssd", rw_fs_ro_view, nc.Probe("Read-only file system", "EROFS"))
    assert [(f.severity, f.detail[:60]) for f in sandbox] == [
        (Severity.WARN, "/mnt/localssd is read-only in this process's view only (a sa")]
    rw = nc.Mount("/mnt/localssd", "ext4", "/dev/md0", ("rw",), ("rw",))
    hung = nc.Probe("no answer within 15 s", "ETIMEDOUT", timed_out=True)
    assert drains(nc.mount_findings("/mnt/localssd", rw, hung, idle=True)) == [
        "local-mounts: /mnt/localssd: write probe hung (no answer within 15 s)"]
    beside_a_job = nc.mount_findings("/mnt/localssd", rw, hung)  # its checkpoint's writeback may hold the fsync
    assert [f.severity for f in beside_a_job] == [Severity.WARN]
    assert nc.mount_findings("/mnt/localssd", rw, nc.Probe("No space left on device", "ENOSPC")) == []


def test_healthcheck_drains_a_node_whose_local_ssd_is_gone(tmp_path):
    """Through Slurm's HealthCheckProgram: the drain reason names the mount, the jobs stay (a
    lost scratch array is not a lost GPU under a job)."""
    from slurmagent.commands.healthcheck import run_healthcheck

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    mountinfo(tmp_path)
    sc = FakeSlurm.cluster(2)
    cfg = config(tmp_path, {"off": ["gpu-nics"]}, mounts=[str(ssd)])
    err = io.StringIO()
    code = run_healthcheck("n1", lambda: cfg, evaluator("healthcheck", sources(tmp_path)),
                           lambda c: Slurm(runner=sc), skip_recent=0, stderr=err)
    assert code == 1, err.getvalue()
    assert sc.nodes["n1"]["Reason"] == f"slurmagent: local-mounts: {ssd} is not mounted"
    assert "DRAIN" in sc.nodes["n1"]["State"]


def test_a_relative_mount_point_is_a_config_error():
    with pytest.raises(ConfigError, match="'health.mounts' entry 'mnt/localssd' is not an absolute path"):
        parse({"health": {"mounts": ["/mnt/a", "mnt/localssd"]}})


def test_the_node_checks_are_in_the_catalogue_and_documented():
    from slurmagent.core.catalogue import LAYERS
    from slurmagent.core.node_catalogue import NODE_CHECKS

    assert [s.name for s in NODE_CHECKS] == ["gpu-nics", "local-mounts", "filesystem-full", "dcgm-diag"]
    health_md = (REPO / "docs" / "admin" / "health.md").read_text()
    for spec in NODE_CHECKS:
        assert set(spec.layers) <= set(LAYERS), spec
        # the healthy prolog: cheap local reads only (no metadata server, no DCGM)
        assert "prolog" not in spec.layers or spec.name in ("local-mounts", "filesystem-full"), spec
        assert spec.severity in ("drain", "warn") and spec.default_on
        assert f"| `{spec.name}` | {', '.join(spec.layers)} |" in health_md, spec.name
