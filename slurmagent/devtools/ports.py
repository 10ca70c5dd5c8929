"""Free TCP ports on 127.0.0.1 for the local Slurm cluster and the emulators (devtools only)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1, for servers that bind them later (a CLOUD
    node's slurmd binds its port minutes later, when powered up). Drawn below the kernel's
    ephemeral range, so no outgoing connection on this machine takes one meanwhile (seen:
    "Unable to bind listen port ... Address already in use" with several clusters running);
    from the ephemeral range only when there is no room below it."""
    low = _ephemeral_range()[0]
    if low - _LOW_PORTS_FROM < 1000:
        return _kernel_ports(n)
    ports: list[int] = []
    for port in random.sample(range(_LOW_PORTS_FROM, low), min(low - _LOW_PORTS_FROM, 50 * n)):
        if _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    return ports + _kernel_ports(n - len(ports))


_LOW_PORTS_FROM = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports
