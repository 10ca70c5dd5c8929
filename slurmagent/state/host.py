"""This machine: its Slurm node name, boot id, boot time, systemd's notify socket, and how to
start slurmagent on it again.

One reader of each, so every command agrees on who and which boot "this node" is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..slurm import env as slurm_env

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PROC_STAT_PATH = "/proc/stat"


def node_name(explicit: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """The node name: given, else `$SLURMD_NODENAME` (slurmd sets it), else the short host name."""
    return explicit or slurm_env.node_name(env, os.uname().nodename)


def slurmagent_argv(module: str = "slurmagent.entry") -> list[str]:
    """How to start slurmagent again (a detached helper, a batch script): this interpreter
    with `-P`, so the current directory (a user's, holding a `slurmagent/` of their own) is
    never put first on the module path."""
    return [sys.executable, "-P", "-m", module]


def boot_id(path: str | os.PathLike[str] = BOOT_ID_PATH) -> str:
    """The kernel's id of this boot ("" when unknown): state of an earlier life is told apart by it."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def boot_time(path: str | os.PathLike[str] = PROC_STAT_PATH) -> float | None:
    """When this machine booted (epoch seconds), from the kernel's `btime`."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def sd_notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send one notification to systemd over `$NOTIFY_SOCKET`; False when there is none."""
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return False
    import socket  # only the watch daemon talks to systemd: kept off the hooks' start-up

    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Half of systemd's WatchdogSec (`$WATCHDOG_USEC`) when it is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6
