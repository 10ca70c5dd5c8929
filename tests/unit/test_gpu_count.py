"""The expected GPU count is never silently off (issue 24).

Every source is pointed at a temporary tree (`health.CountSources`): the configless cache, the
spool dir, /etc/slurm, sysfs and the boot id are fakes; nothing here reads /run, /var or the
real PCI bus. The configless case is the issue's: a node whose slurm.conf lives only in
slurmd's conf cache, with $SLURM_CONF unset, judging a replay of 7 of its 8 GPUs.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from support import healthy_snapshot_dict, write_json
from support.fakes.slurm import FakeSlurm
from slurmagent.commands import doctor, expiry, health
from slurmagent.commands.health import CountSources, evaluate, expected
from slurmagent.commands.hooks import HookContext, run_hook
from slurmagent.core.checks import Severity
from slurmagent.core.machine_gpus import gpus_for_machine_type
from slurmagent.errors import SlurmagentError
from slurmagent.gcp.metadata import MetadataError
from slurmagent.gpu.pci import count_nvidia_gpus
from slurmagent.slurm.commands import Slurm
from slurmagent.state import machine_type
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import path_for, read_records

NODE = "n1"
BOOT = "0b5e1d6c-1111-4222-8333-944455556666"


class Node:
    """A fake machine: Slurm's candidate paths, sysfs and the boot id under one directory."""

    def __init__(self, root: Path):
        self.root = root
        self.run_cache = root / "run/slurm/conf/slurm.conf"
        self.spool_cache = root / "var/spool/slurmd/conf-cache/slurm.conf"
        self.etc = root / "etc/slurm/slurm.conf"
        self.sysfs = root / "sys"
        self.boot_file = root / "boot_id"
        self.boot_file.write_text(BOOT + "\n")
        self.env: dict[str, str] = {}
        (self.sysfs / "bus/pci/devices").mkdir(parents=True)

    def sources(self) -> CountSources:
        return CountSources(conf_search=(self.run_cache, self.spool_cache, self.etc), sysfs=self.sysfs,
                            boot_id_path=str(self.boot_file), env=self.env)

    def cfg(self, **health_keys):
        conf = health_keys.pop("slurm_conf", "")
        return parse({"state_dir": str(self.root / "state" / "%n"), "hooks": {"syslog": False},
                      "slurm": {"conf": conf}, "health": {"kernel_log_enabled": False, **health_keys}})

    def pci(self, address: str, vendor: str, cls: str) -> None:
        d = self.sysfs / "bus/pci/devices" / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")

    def gpus_on_bus(self, n: int) -> None:
        for i in range(n):
            self.pci(f"0000:{0x10 + i:02x}:00.0", "0x10de", "0x030200")

    def cache_machine_type(self, value: str, boot: str = BOOT) -> None:
        machine_type.write(machine_type.cache_file(self.root / "state" / NODE), boot, value)


def slurm_conf(path: Path, gres: str | None = "gpu:8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    node_line = f"NodeName={NODE} CPUs=8" + (f" Gres={gres}" if gres else "")
    path.write_text(f"ClusterName=c\nGresTypes=gpu\n{node_line}\nPartitionName=p Nodes={NODE}\n")
    return path


@pytest.fixture
def node(tmp_path, monkeypatch) -> Node:
    n = Node(tmp_path)
    monkeypatch.setattr(health, "SOURCES", n.sources())  # what check/doctor/the prolog consult
    monkeypatch.delenv("SLURM_CONF", raising=False)
    return n


# --- each source alone --------------------------------------------------------------------------


def test_config_alone(node):
    assert expected(node.cfg(expected_gpus=4), NODE) == health.Expected(4, "[health] expected_gpus")


@pytest.mark.parametrize("where", ["slurm_conf", "SLURM_CONF", "run_cache", "spool_cache", "etc"])
def test_each_slurm_conf_location_alone(node, where):
    if where == "slurm_conf":
        cfg = node.cfg(slurm_conf=str(slurm_conf(node.root / "admin/slurm.conf", "gpu:h100:8")))
    elif where == "SLURM_CONF":
        node.env["SLURM_CONF"] = str(slurm_conf(node.root / "prolog/slurm.conf", "gpu:h100:8"))
        cfg = node.cfg()
    else:
        slurm_conf(getattr(node, where), "gpu:h100:8")
        cfg = node.cfg()
    got = expected(cfg, NODE)
    assert got.count == 8 and got.source.startswith(f"gres of {NODE} in ")


def test_configless_cache_gres_conf_counts_files(node):
    """slurm-gcp style: slurm.conf names the gres type only, gres.conf has the devices."""
    slurm_conf(node.spool_cache, "gpu")  # `Gres=gpu` alone is one gpu: gres.conf wins
    (node.spool_cache.parent / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File=/dev/nvidia[0-7]\n")
    got = expected(node.cfg(), NODE)
    assert (got.count, got.source) == (8, f"gres of {NODE} in {node.spool_cache}")


def test_gres_conf_count_alone(node):
    node.run_cache.parent.mkdir(parents=True)
    (node.run_cache.parent / "gres.conf").write_text("Name=gpu Count=4\n")
    assert expected(node.cfg(), NODE).count == 4


def test_machine_type_alone(node):
    node.cache_machine_type("a3-megagpu-8g")
    assert expected(node.cfg(), NODE) == health.Expected(8, "machine type a3-megagpu-8g")


def test_pci_bus_alone(node):
    node.gpus_on_bus(4)
    assert expected(node.cfg(), NODE) == health.Expected(4, "NVIDIA GPUs on the PCI bus")


# --- precedence ---------------------------------------------------------------------------------


def test_precedence_config_then_slurm_files_in_order(node):
    admin = slurm_conf(node.root / "admin/slurm.conf", "gpu:1")
    node.env["SLURM_CONF"] = str(slurm_conf(node.root / "prolog/slurm.conf", "gpu:2"))
    slurm_conf(node.run_cache, "gpu:3")
    slurm_conf(node.spool_cache, "gpu:4")
    slurm_conf(node.etc, "gpu:5")
    node.gpus_on_bus(8)
    node.cache_machine_type("a3-highgpu-8g")
    assert expected(node.cfg(expected_gpus=6, slurm_conf=str(admin)), NODE).count == 6
    counts = []
    for remove in (admin, Path(node.env["SLURM_CONF"]), node.run_cache, node.spool_cache, node.etc):
        counts.append(expected(node.cfg(slurm_conf=str(admin)), NODE).count)
        remove.unlink()
    assert counts == [1, 2, 3, 4, 5]
    assert expected(node.cfg(slurm_conf=str(admin)), NODE).count == 8  # then the bus and the type


def test_slurm_answer_wins_over_bus_and_type(node):
    """The admin's Gres is the truth (a node may keep a GPU out of Slurm on purpose)."""
    slurm_conf(node.run_cache, "gpu:4")
    node.gpus_on_bus(8)
    node.cache_machine_type("a3-highgpu-8g")
    assert expected(node.cfg(), NODE).count == 4


def test_a_conf_without_gpu_gres_for_the_node_falls_through(node):
    slurm_conf(node.run_cache, None)
    slurm_conf(node.etc, "gpu:8")
    assert expected(node.cfg(), NODE).count == 8


@pytest.mark.parametrize(("on_bus", "mtype", "want", "source"), [
    (7, "a3-highgpu-8g", 8, "machine type a3-highgpu-8g"),  # a GPU missing at boot: the type knows
    (8, "n1-standard-8", 8, "NVIDIA GPUs on the PCI bus"),  # N1 + attached GPUs: the type does not say
    (2, "g2-standard-12", 2, "NVIDIA GPUs on the PCI bus"),
])
def test_without_slurm_the_larger_of_bus_and_machine_type(node, on_bus, mtype, want, source):
    node.gpus_on_bus(on_bus)
    node.cache_machine_type(mtype)
    assert expected(node.cfg(), NODE) == health.Expected(want, source)


# --- the case: configless, $SLURM_CONF unset, 7 of 8 GPUs -------------------------------


def run_check(capsys, cfg_path: Path, *args: str) -> tuple[int, str]:
    from slurmagent.entry import main

    capsys.readouterr()
    code = main(["--config", str(cfg_path), "check", "--node", NODE, *args])
    return code, capsys.readouterr().out


def write_config(node: Node) -> Path:
    path = node.root / "config.toml"
    path.write_text(f'state_dir = "{node.root}/state/%n"\n[health]\nkernel_log_enabled = false\n'
                    f'[hooks]\nsyslog = false\n')
    return path


def test_configless_node_sees_seven_of_eight_as_unhealthy(node, capsys):
    slurm_conf(node.spool_cache, "gpu")
    (node.spool_cache.parent / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File=/dev/nvidia[0-7]\n")
    seven = write_json(node.root / "seven.json", healthy_snapshot_dict(n=7))
    code, out = run_check(capsys, write_config(node), "--snapshot", str(seven))
    assert code == 1, out  # docs/admin/commands.md: check exits 1 when unhealthy
    assert f"{NODE}: UNHEALTHY (7 GPU(s), 8 expected)" in out
    assert "drain reason: slurmagent: gpu-count: found 7 of 8 GPUs" in out
    code, out = run_check(capsys, write_config(node), "--snapshot", str(seven), "--json")
    data = json.loads(out)
    assert code == 1 and data["healthy"] is False and data["expected_gpus"] == 8
    assert data["expected_source"] == f"gres of {NODE} in {node.spool_cache}"
    assert [f["rule"] for f in data["findings"]] == ["gpu-count"]


def test_every_source_silent_is_a_warning_never_a_failure(node, capsys):
    slurm_conf(node.etc, None)  # a slurm.conf that does not give this node a gpu gres
    node.pci("0000:00:02.0", "0x8086", "0x030000")  # someone else's VGA
    node.pci("0000:05:00.0", "0x10de", "0x068000")  # an NVSwitch: not a GPU
    seven = write_json(node.root / "seven.json", healthy_snapshot_dict(n=7))
    code, out = run_check(capsys, write_config(node), "--snapshot", str(seven), "--json")
    data = json.loads(out)
    assert code == 0 and data["healthy"] is True and data["expected_gpus"] is None
    [f] = data["findings"]
    assert (f["rule"], f["severity"], f["gpu"]) == ("gpu-count-unknown", "warn", None)
    for tried in ("[health] expected_gpus", str(node.run_cache), str(node.spool_cache),
                  f"{node.etc} (no gpu gres for {NODE})", "machine type (no cache of this boot",
                  f"PCI bus (no NVIDIA GPU under {node.sysfs}"):
        assert tried in f["detail"], (tried, f["detail"])
    assert "set [health] expected_gpus" in f["detail"]
    code, out = run_check(capsys, write_config(node), "--snapshot", str(seven))
    assert code == 0 and "WARN  gpu-count-unknown: expected GPU count unknown" in out


def test_silent_sources_reach_the_prolog_decision_log(node):
    """The healthy prolog runs the job and logs the warning with its decision."""
    cfg = node.cfg(snapshot=str(write_json(node.root / "snap.json", healthy_snapshot_dict(n=8))))

    def no_slurm(_cfg):
        raise AssertionError("the healthy prolog calls no Slurm command")

    err = io.StringIO()
    code = run_hook(HookContext("prolog", NODE, "42"), lambda: cfg, evaluate, no_slurm, stderr=err)
    assert code == 0, err.getvalue()
    [d] = read_records(path_for(cfg, NODE))
    assert d["verdict"] == "healthy" and d["action"] == "none"
    assert len(d["warnings"]) == 1 and d["warnings"][0].startswith("gpu-count-unknown: expected GPU count unknown")


def test_doctor_fails_when_every_source_is_silent_and_says_the_fix(node):
    cfg = node.cfg(snapshot=str(write_json(node.root / "snap.json", healthy_snapshot_dict(n=8))))
    r = doctor._gpu_result(cfg, NODE)
    assert not r.ok and "expected count unknown" in r.detail and str(node.spool_cache) in r.detail
    assert "[health] expected_gpus" in r.fix and "slurm.conf" in r.fix
    slurm_conf(node.run_cache, "gpu:8")
    r = doctor._gpu_result(cfg, NODE)
    assert r.ok and r.detail == f"8 GPU(s) seen, 8 expected (gres of {NODE} in {node.run_cache})"


# --- the PCI bus --------------------------------------------------------------------------------


def test_pci_counts_nvidia_display_devices_only(tmp_path):
    n = Node(tmp_path)
    n.gpus_on_bus(8)
    n.pci("0000:00:02.0", "0x8086", "0x030000")  # Intel VGA
    n.pci("0000:05:00.0", "0x10de", "0x068000")  # NVSwitch (bridge class)
    n.pci("0000:06:00.0", "0x10de", "0x030000")  # an NVIDIA VGA-class part counts
    (n.sysfs / "bus/pci/devices/0000:07:00.0").mkdir()  # no vendor file: skipped
    assert count_nvidia_gpus(n.sysfs) == 9
    assert count_nvidia_gpus(tmp_path / "no-sysfs") is None


# --- the machine type ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mtype", "gpus"), [
    ("a3-highgpu-8g", 8), ("a3-megagpu-8g", 8), ("a3-ultragpu-8g", 8), ("a4-highgpu-8g", 8),
    ("a4x-highgpu-4g", 4), ("a4x-highgpu-4g-nolssd", 4), ("a3-highgpu-1g", 1), ("a3-highgpu-2g", 2),
    ("a3-highgpu-4g", 4), ("a2-highgpu-1g", 1), ("a2-megagpu-16g", 16), ("a2-ultragpu-8g", 8),
    ("g2-standard-4", 1), ("g2-standard-32", 1), ("g2-standard-24", 2), ("g2-standard-48", 4),
    ("g2-standard-96", 8), ("projects/123/machineTypes/a3-highgpu-8g", 8),
    ("n1-standard-8", None), ("e2-medium", None), ("g2-standard-5", None), ("", None),
])
def test_machine_type_gpu_count(mtype, gpus):
    assert gpus_for_machine_type(mtype) == gpus


def test_machine_type_is_read_once_per_boot_and_again_after_a_reboot(tmp_path):
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n")})
    asked: list[float] = []

    def reader(timeout_s: float) -> str:
        asked.append(timeout_s)
        return "a3-highgpu-8g"

    assert expiry.cache_machine_type(cfg, NODE, "boot-1", 2.0, reader) == (
        True, "machine type a3-highgpu-8g (8 GPUs) cached for this boot")
    assert expiry.cache_machine_type(cfg, NODE, "boot-1", 2.0, reader) is None
    assert len(asked) == 1
    cache = machine_type.cache_file(cfg.state_path(NODE))
    assert machine_type.read(cache, "boot-1") == "a3-highgpu-8g"
    assert machine_type.read(cache, "boot-2") is None  # a stopped VM may start as another type
    expiry.cache_machine_type(cfg, NODE, "boot-2", 2.0, reader)
    assert len(asked) == 2 and machine_type.read(cache, "boot-2") == "a3-highgpu-8g"


def test_machine_type_of_an_earlier_boot_is_not_expected(node):
    node.cache_machine_type("a3-highgpu-8g", boot="an-earlier-boot")
    assert expected(node.cfg(), NODE).count is None


def test_machine_type_failures_are_said_once_and_a_404_is_not_asked_again(tmp_path):
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n")})
    asked = []

    def failing(exc: SlurmagentError):
        def reader(timeout_s: float) -> str:
            asked.append(exc)
            raise exc
        return reader

    down = failing(MetadataError("metadata server 1.2.3.4: HTTP 503 for 'instance/machine-type'"))
    first = expiry.cache_machine_type(cfg, NODE, "b", 1.0, down)
    assert first is not None and first[0] is False and "HTTP 503" in first[1]
    assert expiry.cache_machine_type(cfg, NODE, "b", 1.0, down) is None  # asked again, said once
    assert len(asked) == 2
    gone = failing(MetadataError("metadata server 1.2.3.4: HTTP 404 for 'instance/machine-type'"))
    assert "HTTP 404" in expiry.cache_machine_type(cfg, NODE, "b", 1.0, gone)[1]
    assert expiry.cache_machine_type(cfg, NODE, "b", 1.0, gone) is None
    assert len(asked) == 3  # a 404 is the server's answer for this boot


def test_expiry_watch_once_caches_the_machine_type_the_check_then_reads(node, capsys, monkeypatch):
    """End to end without Slurm's files or GPUs on the bus: `expiry-watch --once` asks the
    (fake) metadata server; `check` of 7 GPUs then expects 8 and exits 1, with no network."""
    from support.fake_gcp import FakeGcp
    from slurmagent.gcp import metadata

    cfg = parse({"state_dir": str(node.root / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "p", "zone": "us-central1-a"},
                 "expiry": {"termination_time": "2099-01-01T00:00:00Z", "publish_run_file": False}})
    fake = FakeGcp().start()
    try:
        fake.set_identity(NODE)
        fake.metadata.update({"instance/maintenance-event": "NONE", "instance/preempted": "FALSE"})
        monkeypatch.setenv("GCE_METADATA_HOST", fake.host)
        metadata.reset_cache()
        out = io.StringIO()
        slurm = Slurm(runner=FakeSlurm([NODE]))
        assert expiry.run_expiry_watch(cfg, NODE, once=True, out=out, err=io.StringIO(), slurm=slurm) == 0
        asked = [c for c in fake.calls if c.path.endswith("instance/machine-type")]
        assert len(asked) == 1 and "machine type a3-highgpu-8g (8 GPUs) cached for this boot" in out.getvalue()
        expiry.run_expiry_watch(cfg, NODE, once=True, out=out, err=io.StringIO(), slurm=slurm)
        assert len([c for c in fake.calls if c.path.endswith("instance/machine-type")]) == 1
    finally:
        fake.stop()
        metadata.reset_cache()
    # the cache is keyed by the real boot id (expiry-watch read it): the check reads the same one
    monkeypatch.setattr(health, "SOURCES", CountSources(conf_search=node.sources().conf_search, sysfs=node.sysfs,
                                                        env={}))
    seven = write_json(node.root / "seven.json", healthy_snapshot_dict(n=7))
    code, text = run_check(capsys, write_config(node), "--snapshot", str(seven))
    assert code == 1 and "found 7 of 8 GPUs" in text


def test_watch_says_what_it_expects_at_start(node):
    from slurmagent.commands.watch import Watcher

    slurm_conf(node.spool_cache, "gpu:8")
    err = io.StringIO()
    w = Watcher(node.cfg(), NODE, Slurm(runner=FakeSlurm([NODE])), use_nvml=False, stderr=err)
    w._say_expected()
    assert f"8 GPU(s) expected (gres of {NODE} in {node.spool_cache})" in err.getvalue()
    node.spool_cache.unlink()
    w._say_expected()
    assert "warning: expected GPU count unknown" in err.getvalue()


def test_findings_keep_severity_warn_for_unknown_count(node):
    report = evaluate(node.cfg(snapshot=str(write_json(node.root / "s.json", healthy_snapshot_dict(n=8)))),
                      NODE, commit_cursor=False)
    assert report.healthy and [f.severity for f in report.findings] == [Severity.WARN]


# --- the healthy prolog stays light -------------------------------------------------------------

PROLOG_PROBE = """
import json, sys
from pathlib import Path
from slurmagent.commands import health
spec = json.loads(sys.argv[1])
health.SOURCES = health.CountSources(conf_search=tuple(Path(p) for p in spec["search"]), sysfs=Path(spec["sysfs"]),
                                     boot_id_path=spec["boot"], env={})
from slurmagent.entry import main
code = main(["prolog"])
print(sorted(m for m in sys.modules if m.startswith(("google", "click", "urllib.request", "http."))
             or m in ("subprocess", "slurmagent.gcp.metadata")))
print(code)
"""


@pytest.mark.parametrize("answer", ["conf-cache", "machine-type"])
def test_healthy_prolog_finds_the_count_without_network_or_heavy_imports(tmp_path, answer):
    """With the count from the configless cache, or from the cached machine type when Slurm is
    silent: no metadata client, no HTTP library, no subprocess on the healthy prolog path."""
    import os
    import subprocess
    import sys

    from support import REPO

    n = Node(tmp_path)
    if answer == "conf-cache":
        slurm_conf(n.spool_cache, "gpu:8")
    else:
        n.cache_machine_type("a3-ultragpu-8g")
    write_json(tmp_path / "snap.json", healthy_snapshot_dict(n=8))
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{tmp_path}/state/%n"\n[health]\nsnapshot = "{tmp_path}/snap.json"\n'
                      f'kernel_log_enabled = false\n[hooks]\nsyslog = false\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "GOOGLE", "CLOUDSDK", "GCE_"))}
    env.update(SLURMAGENT_CONFIG=str(config), SLURMD_NODENAME=NODE, SLURM_JOB_ID="7", PYTHONPATH=str(REPO))
    spec = json.dumps({"search": [str(p) for p in (n.run_cache, n.spool_cache, n.etc)], "sysfs": str(n.sysfs),
                       "boot": str(n.boot_file)})
    proc = subprocess.run([sys.executable, "-c", PROLOG_PROBE, spec], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    modules, code = proc.stdout.splitlines()[-2:]
    assert (modules, code) == ("[]", "0"), proc.stdout + proc.stderr
    [d] = read_records(tmp_path / "state" / NODE / "hooks.log")
    assert d["verdict"] == "healthy" and not d.get("warnings")  # the count was known: no warning
