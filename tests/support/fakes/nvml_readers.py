"""NVML reads for `nvml_deadline.ThreadSafeReader` children (module-level: a forkserver child
finds them by name): a healthy H100 node, a hung driver, a reader that dies, a slurmagent bug."""

from __future__ import annotations

import os
import time


def healthy(hostname: str) -> dict:
    gpus = [{"index": i, "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "name": "NVIDIA H100 80GB HBM3",
             "lost": False} for i in range(8)]
    return {"schema": 1, "hostname": hostname, "driver_version": "550.90.07", "nvml_error": None, "gpus": gpus}


def hung(hostname: str) -> dict:
    time.sleep(3600)  # a driver call that never returns
    return {}


def dies(hostname: str) -> dict:
    os._exit(3)


def buggy(hostname: str) -> dict:
    raise ZeroDivisionError("a bug in the reader")
