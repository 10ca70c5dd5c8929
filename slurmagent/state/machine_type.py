"""The machine-type cache: the ONE reader and writer of `<state_dir>/machine-type.json`.

`expiry-watch` (root, already a metadata client, and run once at boot before slurmd) asks the
metadata server for `instance/machine-type` once per boot and writes it here with the boot
id; the prolog, `check`, `doctor` and `watch` only read this file (never the network), to
know how many GPUs the VM has when Slurm does not say it. A file of an earlier boot is
ignored (a stopped VM can be started as another machine type), as is, read by root, a file a
user could have written.
"""

from __future__ import annotations

import json
from pathlib import Path

from .fsutil import UntrustedFile, atomic_write_text, read_state_file

NAME = "machine-type.json"


def cache_file(state_dir: Path) -> Path:
    return state_dir / NAME


def read_entry(path: Path, boot_id: str) -> dict | None:
    """This boot's entry (`machine_type`, or `error` and `final` when the metadata server did
    not give it); None when absent, of another boot, or untrusted."""
    if not boot_id:
        return None
    try:
        data = json.loads(read_state_file(path))
    except (UntrustedFile, OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("boot_id") == boot_id else None


def read(path: Path, boot_id: str) -> str | None:
    """The cached machine type of boot `boot_id`, or None."""
    value = (read_entry(path, boot_id) or {}).get("machine_type")
    return value if isinstance(value, str) and value else None


def write(path: Path, boot_id: str, machine_type: str, error: str = "", final: bool = False) -> None:
    """The machine type, or why it is not known (`final`: not asked again this boot). Raises OSError."""
    entry: dict = {"boot_id": boot_id, "machine_type": machine_type}
    if error:
        entry.update(error=error, final=final)
    atomic_write_text(path, json.dumps(entry, sort_keys=True) + "\n", 0o644)
