"""NVIDIA GPUs on the PCI bus, counted from sysfs: no driver, no NVML.

A GPU that NVML lost (or whose driver failed to bind) is still a device on the bus, so this
count is what the node should have when Slurm does not say it. NVIDIA's NVSwitches and
bridges are not display-class devices and do not count. A GPU missing at boot is missing here
too: that is why the machine type is asked as well (`commands/health.expected`).
"""

from __future__ import annotations

import os
from pathlib import Path

SYSFS = Path("/sys")
NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"  # 0x0300xx VGA, 0x0302xx 3D controller (the data-center parts)


def count_nvidia_gpus(sysfs: str | os.PathLike[str] = SYSFS) -> int | None:
    """NVIDIA display-class PCI functions under `<sysfs>/bus/pci/devices`; None when that
    directory cannot be read (no sysfs: the bus was not asked), else the count (0 included)."""
    devices = Path(sysfs) / "bus" / "pci" / "devices"
    try:
        entries = list(os.scandir(devices))
    except OSError:
        return None
    count = 0
    for entry in entries:
        if _read(entry.path, "vendor") == NVIDIA_VENDOR and _read(entry.path, "class").startswith(DISPLAY_CLASS):
            count += 1
    return count


def _read(device: str, name: str) -> str:
    try:
        with open(os.path.join(device, name), encoding="ascii", errors="replace") as f:
            return f.read(32).strip().lower()
    except OSError:
        return ""
