"""The config keys of the node checks (issue 39): `[health]` keys for mounts, full filesystems
and DCGM (HealthConfig inherits them) and the `[checks]` names' validation. Beside config.py,
which stays under the module size limit; `key` is the one definition of a config key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


def key(default: Any, doc: str, choices: tuple[str, ...] = (), *, low: float | None = None,
        high: float | None = None, regex: bool = False) -> Any:
    """A config key; a number's `low`..`high` (inclusive) is checked at load and shown in docs/admin/configuration.md;
    `regex`: each string must compile (checked at load, not when a node first matches)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "range": (low, high), "regex": regex})


@dataclass(frozen=True)
class NodeHealthKeys:
    """[health] keys of the node checks (`local-mounts`, `filesystem-full`, `dcgm-diag`)."""
    mounts: tuple[str, ...] = key(
        (), "mount points that must be mounted, not read-only and writable (`local-mounts`: e.g. the local SSD "
        "array `/mnt/localssd`); a failure drains, repaired as hardware")
    ckpt_filesystem: str = key(
        "", "the checkpoint directory's filesystem (e.g. `/mnt/localssd`): warned about when full, with `mounts` "
        "(`filesystem-full`: root does not know a job's `--ckpt-dir`)")
    full_warn_percent: float = key(95.0, "`filesystem-full` warns (never drains) at or above this percent used",
                                   low=1, high=100)
    dcgmi: str = key("dcgmi", "DCGM's `dcgmi` binary (`dcgm-diag`; absent or its host engine down: not available)")
    dcgm_healthcheck_level: int = key(
        0, "`dcgmi diag -r N` in `healthcheck` (0: off; 1 at most: slurmd kills it at 60 s); skipped while "
        "squeue lists a job on the node (never under a job)", low=0, high=1)
    dcgm_resume_level: int = key(
        2, "`dcgmi diag -r N` in `resume-if-healthy` (the node still drained; 0: off)", low=0, high=4)
    dcgm_timeout_s: float = key(
        300.0, "deadline of one `dcgmi diag` in `resume-if-healthy` (healthcheck's level 1: 40 s at most); "
        "past it: a warning", low=1, high=7200)


def validate_paths(health: NodeHealthKeys, source: str) -> None:
    """A mount point is absolute: a relative one would never be found mounted (a drain everywhere)."""
    for dotted, paths in (("health.mounts", health.mounts), ("health.ckpt_filesystem", (health.ckpt_filesystem,))):
        for path in paths:
            if path and not path.startswith("/"):
                raise ConfigError(f"config {source}: '{dotted}' entry {path!r} is not an absolute path")
