"""Pure node checks beyond the GPUs: what was read (metadata NICs, sysfs links, mountinfo,
probe results, `dcgmi diag -j` output) -> findings. No I/O here; the readers are adapters
(gcp/nics.py, state/mounts.py, gpu/dcgm.py) and commands/health.py joins them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from .checks import Finding, Severity
from .node_catalogue import DCGM_DIAG, FILESYSTEM_FULL, GPU_NICS, LOCAL_MOUNTS

# --- GPU NICs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttachedNic:
    """A NIC Google attached to the VM (metadata `instance/network-interfaces/N`)."""
    index: int
    mac: str
    network: str = ""


@dataclass(frozen=True)
class GuestLink:
    """A network device the guest sees: a netdev, with the RDMA device's port states when it has one."""
    name: str
    mac: str
    operstate: str
    rdma: str = ""  # the infiniband device over this netdev (mlx5_0), "" when none
    port_states: tuple[str, ...] = ()  # `/sys/class/infiniband/<dev>/ports/*/state`, e.g. "4: ACTIVE"


DOWN_OPERSTATES = ("down", "lowerlayerdown", "notpresent", "dormant")


def parse_network_interfaces(text: str) -> list[AttachedNic]:
    """`instance/network-interfaces/?recursive=true&alt=json` -> the attached NICs. ValueError when malformed."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("network-interfaces is not a JSON list")
    out = []
    for i, nic in enumerate(data):
        mac = nic.get("mac") if isinstance(nic, dict) else None
        if not isinstance(mac, str) or not mac:
            raise ValueError(f"network-interfaces/{i} has no mac")
        out.append(AttachedNic(i, mac.lower(), str(nic.get("network") or "").rsplit("/", 1)[-1]))
    return out


def nic_findings(attached: Iterable[AttachedNic], links: Iterable[GuestLink]) -> list[Finding]:
    """Each attached NIC, matched by MAC, must be in the guest and up (never a per-machine-type
    count: a VM may be created with fewer NICs by design)."""
    by_mac = {link.mac.lower(): link for link in links}
    out = []
    for nic in attached:
        label = f"nic{nic.index} ({nic.mac}{', ' + nic.network if nic.network else ''})"
        link = by_mac.get(nic.mac)
        if link is None:
            out.append(Finding(GPU_NICS, Severity.DRAIN, None, f"{label} attached but not in the guest", nic.mac))
            continue
        if link.operstate in DOWN_OPERSTATES:
            out.append(Finding(GPU_NICS, Severity.DRAIN, None, f"{label} is {link.name}: link {link.operstate}",
                               link.name))
            continue
        inactive = [s for s in link.port_states if "ACTIVE" not in s.upper()]
        if inactive:
            out.append(Finding(GPU_NICS, Severity.DRAIN, None,
                               f"{label} is {link.name}/{link.rdma}: RDMA port {inactive[0]}", link.rdma))
    return out


# --- local mounts and full filesystems ------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where, the per-mount options and the superblock's."""
    point: str
    fstype: str
    source: str
    mount_options: tuple[str, ...]
    super_options: tuple[str, ...]

    @property
    def fs_read_only(self) -> bool:
        """The filesystem itself is read-only (ext4/xfs `errors=remount-ro` after an I/O error sets
        the superblock's `ro`); a read-only bind (a sandbox's ProtectSystem) is not."""
        return "ro" in self.super_options


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> dict[str, Mount]:
    """mount point -> its mount (the last one mounted there wins: it hides the others)."""
    mounts: dict[str, Mount] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        parts, tail = left.split(), right.split()
        if not sep or len(parts) < 6 or len(tail) < 2:
            continue
        point = _unescape(parts[4])
        mounts[point] = Mount(point, tail[0], _unescape(tail[1]), tuple(parts[5].split(",")),
                              tuple(tail[2].split(",")) if len(tail) > 2 else ())
    return mounts


@dataclass(frozen=True)
class Probe:
    """The write probe of one mount point: error is "" when create+fsync+unlink worked."""
    error: str = ""
    errno_name: str = ""
    timed_out: bool = False


def mount_findings(point: str, mount: Mount | None, probe: Probe | None, idle: bool = False) -> list[Finding]:
    """A configured mount missing, read-only or not writable drains: hardware (a new VM brings a
    new local SSD array). A probe refused only by this process's read-only view (EROFS on a
    filesystem that is read-write) is the sandbox's, a warning that says so. A probe past its
    deadline drains only on an `idle` node (resume-if-healthy: drained, nothing else writing):
    beside a job's checkpoint writes an fsync may wait on their writeback (ext4's journal)."""
    if mount is None:
        return [Finding(LOCAL_MOUNTS, Severity.DRAIN, None, f"{point} is not mounted", point)]
    if mount.fs_read_only:
        return [Finding(LOCAL_MOUNTS, Severity.DRAIN, None,
                        f"{point} ({mount.source}) is read-only (remounted after an I/O error?)", point)]
    if probe is None or not probe.error:
        return []
    if probe.timed_out:
        return [Finding(LOCAL_MOUNTS, Severity.DRAIN if idle else Severity.WARN, None,
                        f"{point}: write probe hung ({probe.error})", point)]
    if probe.errno_name == "EROFS" and "ro" in mount.mount_options:
        return [Finding(LOCAL_MOUNTS, Severity.WARN, None,
                        f"{point} is read-only in this process's view only (a sandbox? give the unit "
                        f"ReadWritePaths={point}): write probe not run", point)]
    if probe.errno_name == "ENOSPC":
        return []  # full: filesystem-full's business, never a drain
    return [Finding(LOCAL_MOUNTS, Severity.DRAIN, None, f"{point}: write probe failed ({probe.error})", point)]


def full_findings(point: str, used_percent: float | None, warn_percent: float) -> list[Finding]:
    """A full filesystem is the user's: a warning, never a drain (so never a VM recreate)."""
    if used_percent is None or used_percent < warn_percent:
        return []
    return [Finding(FILESYSTEM_FULL, Severity.WARN, None,
                    f"{point} is {used_percent:.0f}% used (warn at {warn_percent:g}%)", round(used_percent, 1))]


# --- DCGM diagnostics -----------------------------------------------------------------------

ROOT_KEYS = ("DCGM GPU Diagnostic", "DCGM Diagnostic")  # DCGM 3.x, 4.x


@dataclass(frozen=True)
class DiagResult:
    """One `dcgmi diag` run, parsed."""
    failed: tuple[str, ...]  # "Category/Test (gpu 0,3): warning text"
    tests: int
    runtime_error: str = ""


def parse_diag(text: str) -> DiagResult:
    """`dcgmi diag -r N -j` stdout -> result (both the 3.x `DCGM GPU Diagnostic` and the 4.x
    `DCGM Diagnostic` shapes: test_categories -> tests -> results with status Pass/Fail/Warn/Skip).
    ValueError when there is no JSON document."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON in dcgmi's output")
    data = json.loads(text[start:])
    if not isinstance(data, dict):
        raise ValueError("dcgmi's JSON is not an object")
    root = next((data[k] for k in ROOT_KEYS if isinstance(data.get(k), dict)), data)
    error = str(data.get("runtime_error") or root.get("runtime_error") or "")
    failed, count = [], 0
    for category in root.get("test_categories") or []:
        if not isinstance(category, dict):
            continue
        for test in category.get("tests") or []:
            if not isinstance(test, dict):
                continue
            count += 1
            bad = [r for r in test.get("results") or [] if isinstance(r, dict)
                   and str(r.get("status", "")).lower() in ("fail", "failed", "error")]
            if bad:
                failed.append(_failed_test(category.get("category", ""), test.get("name", "?"), bad))
    return DiagResult(tuple(failed), count, error)


def _failed_test(category: str, name: str, bad: list[dict[str, Any]]) -> str:
    gpus = sorted({str(r.get("gpu_ids", r.get("entity_id", "?"))) for r in bad})
    text = ""
    for r in bad:
        for w in r.get("warnings") or r.get("errors") or []:
            text = str((w.get("warning") or w.get("error") or "") if isinstance(w, dict) else w)
            if text:
                break
        if text:
            break
    where = f"{category}/{name}" if category else name
    return f"{where} (gpu {','.join(gpus)})" + (f": {text}" if text else "")


def diag_findings(level: int, result: DiagResult) -> list[Finding]:
    if result.failed:
        return [Finding(DCGM_DIAG, Severity.DRAIN, None,
                        f"level {level} failed {'; '.join(result.failed)}", list(result.failed))]
    if result.runtime_error:
        return [Finding(DCGM_DIAG, Severity.WARN, None, f"level {level} did not run: {result.runtime_error}", None)]
    return []


def not_available(check: str, why: str) -> Finding:
    """A check that cannot run here (off Google Cloud, no DCGM): said, never a failure."""
    return Finding(check, Severity.WARN, None, f"not available: {why}", None)
