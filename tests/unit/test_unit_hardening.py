"""The systemd units' sandboxes: `systemd-analyze security --offline=true` scores each unit (the
source in systemd/ and the copy `install` writes) under a ceiling, and the directives the
commands need to work are there (watch and resume-if-healthy keep the NVIDIA devices and
/dev/kmsg; repair and expiry-watch get no device; every writable path the code uses by default).

Needs systemd-analyze >= 250 (`--offline`); Debian 12's systemd package has it (the CI host)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from support import REPO, need_tool
from slurmagent.state.config import Config

# Overall exposure per unit (0 = fully sandboxed, 10 = none) as systemd 252 rates it: 1.7 for the
# device-free units, 2.1 for the two that read the GPUs and the kernel log (8.0-8.6 before).
# A ceiling leaves a little room for another systemd version's weights, not for a lost directive.
CEILING = {
    "slurmagent-repair.service": 2.0,
    "slurmagent-expiry.service": 2.0,
    "slurmagent-resume.service": 2.5,
    "slurmagent-watch.service": 2.5,
}
GPU_UNITS = {"slurmagent-watch.service", "slurmagent-resume.service"}  # NVML + /dev/kmsg
UNITS = sorted(CEILING)
SOURCE = REPO / "systemd"


def _analyzer() -> str:
    # every lane has it: the CI host's systemd, and the chroots' (slurmd pulls it in)
    exe = need_tool("systemd-analyze", install="Debian: the `systemd` package")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    m = re.match(r"systemd (\d+)", proc.stdout)
    assert m, (f"cannot read systemd-analyze's version (rc {proc.returncode}): "
               f"{proc.stdout[:200]!r} {proc.stderr[:200]!r}")
    if int(m.group(1)) < 250:  # only a version read and too old skips
        pytest.skip(f"systemd-analyze {m.group(1)} has no --offline (needs 250+)")
    return exe


def exposure(unit_file: Path) -> float:
    """The overall exposure level `systemd-analyze security --offline=true FILE` prints."""
    proc = subprocess.run([_analyzer(), "security", "--offline=true", "--no-pager", str(unit_file)],
                          capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    assert m, f"no score for {unit_file} (rc {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}"
    return float(m.group(1))


def service(unit_file: Path) -> dict[str, list[str]]:
    """The [Service] section: every assignment of a key, in order (continuation lines not used)."""
    keys: dict[str, list[str]] = {}
    section = ""
    for raw in unit_file.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def last(keys: dict[str, list[str]], key: str) -> str | None:
    return keys[key][-1] if keys.get(key) else None


def writable(keys: dict[str, list[str]]) -> list[str]:
    """What ProtectSystem=strict leaves writable: ReadWritePaths, and /var/lib|/run of the
    State/RuntimeDirectory."""
    paths = [p.lstrip("-+") for v in keys.get("ReadWritePaths", []) for p in v.split()]
    paths += [f"/var/lib/{d}" for v in keys.get("StateDirectory", []) for d in v.split()]
    paths += [f"/run/{d}" for v in keys.get("RuntimeDirectory", []) for d in v.split()]
    return paths


def under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def test_every_service_has_a_ceiling():
    assert sorted(p.name for p in SOURCE.glob("*.service")) == UNITS


@pytest.mark.parametrize("unit", UNITS)
def test_exposure_under_ceiling(unit):
    score = exposure(SOURCE / unit)
    assert score <= CEILING[unit], (
        f"{unit}: exposure {score} > {CEILING[unit]}; see `systemd-analyze security --offline=true systemd/{unit}`")


def test_installed_units_keep_their_sandbox(tmp_path):
    """`install` rewrites ExecStart= only: what it writes scores as the source does."""
    from slurmagent.commands.install import install

    _analyzer()
    install(tmp_path, binary="/opt/slurmagent/venv/bin/slurmagent")
    installed = {p.name: p for p in tmp_path.rglob("slurmagent-*.service")}
    assert sorted(installed) == UNITS
    for unit, path in installed.items():
        assert exposure(path) == exposure(SOURCE / unit) <= CEILING[unit], unit


@pytest.mark.parametrize("unit", UNITS)
def test_sandbox_keeps_what_the_command_needs(unit):
    keys = service(SOURCE / unit)
    cfg = Config()
    assert last(keys, "User") in (None, "root")  # Slurm authorises drain/resume by uid 0 (munge)
    assert last(keys, "NoNewPrivileges") == "yes"
    assert last(keys, "ProtectSystem") == "strict"
    # scontrol/squeue/scancel reach slurmctld (inet) and munge (unix); the Compute API and the
    # metadata server are inet; syslog and sd_notify are unix.
    assert set(" ".join(keys["RestrictAddressFamilies"]).split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert keys["SystemCallFilter"][0] == "@system-service"
    assert last(keys, "SystemCallArchitectures") == "native"
    # Every path the command writes by default stays writable.
    rw = writable(keys)
    assert under(cfg.state_dir, rw), rw
    assert under(str(cfg.state_path("n1") / "hooks.log"), rw)
    if unit == "slurmagent-watch.service":  # the wrapped jobs' channel lives there
        assert under(str(Path(cfg.node_path(cfg.watch.channel_socket, "n1")).parent), rw), rw
        # root drains for a job only on what it sees in /proc itself (the named rank stopped, by its
        # cgroup): `invisible`/`ptraceable` would hide every user's process from a root without
        # CAP_SYS_PTRACE, and every hang drain would be refused
        assert last(keys, "ProtectProc") in (None, "default"), last(keys, "ProtectProc")
    if unit == "slurmagent-expiry.service":
        assert under(str(Path(cfg.node_path(cfg.expiry.run_file, "n1")).parent), rw), rw
        assert last(keys, "UMask") == "0022"  # the run file is world-readable for the job's user
    devices = keys.get("DeviceAllow", [])
    if unit in GPU_UNITS:
        # NVML opens /dev/nvidiactl and /dev/nvidia0..N; the XIDs come from /dev/kmsg, which
        # needs CAP_SYSLOG where kernel.dmesg_restrict=1 and vanishes with ProtectKernelLogs.
        assert last(keys, "PrivateDevices") in (None, "no")
        assert last(keys, "DevicePolicy") == "closed"
        assert "char-nvidia* rw" in devices and "/dev/kmsg r" in devices, devices
        assert last(keys, "ProtectKernelLogs") in (None, "no")
        assert last(keys, "CapabilityBoundingSet") == "CAP_SYSLOG"
    else:
        assert last(keys, "PrivateDevices") == "yes" and not devices
        assert last(keys, "ProtectKernelLogs") == "yes"
        assert last(keys, "CapabilityBoundingSet") == ""
        assert last(keys, "MemoryDenyWriteExecute") == "yes"


def test_the_resume_unit_lets_the_node_checks_run():
    """resume-if-healthy runs the node checks with the node still drained: the local SSD array's
    probe file is writable (absent: ignored), and the unit outlives the registration wait, the
    GPU check and DCGM's level 2 (each at its configured deadline)."""
    keys = service(SOURCE / "slurmagent-resume.service")
    assert "-/mnt/localssd" in " ".join(keys["ReadWritePaths"]).split()
    cfg = Config()
    longest = (cfg.repair.resume_wait_s + cfg.health.timeout_s + cfg.health.dcgm_timeout_s + cfg.health.cuda_timeout_s
               + 2 * cfg.slurm.timeout_s)
    assert float(last(keys, "TimeoutStartSec")) > longest
    # cuda-init's cuInit runs here: libcuda's NUMA policy / affinity calls (@resources) are not denied
    denied = " ".join(f for f in keys["SystemCallFilter"] if f.startswith("~")).split()
    assert "~@privileged" in denied and "@resources" not in denied, denied
