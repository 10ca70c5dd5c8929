"""The GPU NICs: what Google attached (metadata, cached per boot) and what the guest sees (sysfs).

The metadata server is asked once per boot (`instance/network-interfaces/`, with the metadata
adapter's deadline); the answer, or why there is none (off Google Cloud), is kept in
`<state_dir>/network-interfaces.json` with the boot id, so the hooks and `healthcheck` read a
file, not the network, and "not available" is said once per boot (a 5xx/429 answer is not
kept: asked again, and said, next time). Read by root, a file a user
could have written is ignored (asked again).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from ..core.node_checks import AttachedNic, GuestLink, parse_network_interfaces
from ..state.fsutil import UntrustedFile, atomic_write_text, read_state_file
from . import metadata

CACHE_NAME = "network-interfaces.json"
PATH = "instance/network-interfaces/?recursive=true&alt=json"
# The server is there but failing (Google Cloud, briefly): not "off Google Cloud" for the whole boot.
TRANSIENT = re.compile(r"HTTP (5\d\d|429)\b")


def cache_file(state_dir: Path) -> Path:
    return state_dir / CACHE_NAME


def attached_nics(cache: Path, boot_id: str, timeout_s: float = metadata.DEFAULT_TIMEOUT_S
                  ) -> tuple[list[AttachedNic] | None, str]:
    """(the attached NICs or None when not available, a note to say: "" when already said this boot)."""
    entry = _read(cache, boot_id)
    if entry is not None:
        if "error" in entry:
            return None, ""
        return [AttachedNic(int(n["index"]), str(n["mac"]), str(n.get("network", ""))) for n in entry["nics"]], ""
    try:
        nics = parse_network_interfaces(metadata.read(PATH, timeout_s, limit=1 << 20)[0])  # our own per-boot cache, not get()'s per process
        note, record = "", {"nics": [asdict(n) for n in nics]}
    except (metadata.MetadataError, ValueError, AttributeError) as exc:
        note = f"no NIC list from the metadata server ({exc})"
        if TRANSIENT.search(str(exc)):
            return None, note  # a metadata server that is there but failing: asked again next time
        nics, record = None, {"error": note}
    if boot_id:
        try:
            atomic_write_text(cache, json.dumps({"boot_id": boot_id, **record}, sort_keys=True) + "\n", 0o644)
        except OSError:
            pass  # asked again next time: slower, never wrong
    return nics, note


def _read(cache: Path, boot_id: str) -> dict | None:
    if not boot_id:
        return None
    try:
        data = json.loads(read_state_file(cache))
    except (UntrustedFile, OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("boot_id") != boot_id:
        return None
    if "error" in data or isinstance(data.get("nics"), list):
        return data
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def guest_links(sysfs: Path) -> list[GuestLink]:
    """Every netdev under `<sysfs>/class/net` with its MAC and operstate, and for those under an
    RDMA device (`class/infiniband/<dev>/device/net/<if>`) the device's port states."""
    rdma: dict[str, tuple[str, tuple[str, ...]]] = {}
    ib = sysfs / "class" / "infiniband"
    for dev in sorted(ib.iterdir()) if ib.is_dir() else ():
        ports = dev / "ports"
        states = tuple(_text(p / "state") for p in sorted(ports.iterdir())) if ports.is_dir() else ()
        netdir = dev / "device" / "net"
        for netdev in sorted(netdir.iterdir()) if netdir.is_dir() else ():
            rdma[netdev.name] = (dev.name, states)
    links = []
    net = sysfs / "class" / "net"
    for dev in sorted(net.iterdir()) if net.is_dir() else ():
        mac = _text(dev / "address").lower()
        if not mac or dev.name == "lo":
            continue
        dev_rdma, states = rdma.get(dev.name, ("", ()))
        links.append(GuestLink(dev.name, mac, _text(dev / "operstate") or "unknown", dev_rdma, states))
    return links
