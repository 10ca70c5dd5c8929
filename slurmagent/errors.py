"""One base class for every domain error; the CLI turns them into one line and an exit code.

The exit codes of the commands that read the cluster (`status`, `repair`, `journal`, `check`),
documented in docs/admin/commands.md; `run` has its own (75, 76, 143: `run/`).
"""

from __future__ import annotations

import errno
from typing import Iterable

EXIT_OK = 0  # all good
EXIT_PROBLEMS = 1  # it read everything and found problems (or some repair failed)
EXIT_USAGE = 2  # usage or config error: one line on stderr
EXIT_UNREACHABLE = 3  # Slurm or the Compute API could not be read: an outage, not a verdict


class SlurmagentError(Exception):
    """A failure slurmagent reports to the user as one line (no traceback)."""

    exit_code = 2


class ConfigError(SlurmagentError):
    """The config file is missing, unreadable, unsafe or has a bad key/type."""


class SnapshotError(SlurmagentError):
    """A replay snapshot is unreadable, not JSON, or of an unsupported schema."""


class SlurmError(SlurmagentError):
    """An scontrol/sbatch call failed or timed out."""

    exit_code = 1


class SlurmUnreachable(SlurmError):
    """A command that reads the cluster could not read Slurm: said with its own exit code, so a
    monitor tells an outage from a verdict."""

    exit_code = EXIT_UNREACHABLE

    def __init__(self, message: str, slurm_error: str = ""):
        super().__init__(message)
        self.slurm_error = slurm_error or message  # Slurm's own words, for the JSON


class NvmlTimeout(SlurmagentError):
    """The NVML read did not finish within its deadline."""

    exit_code = 1


class ExpiryError(SlurmagentError):
    """The expiry watch cannot learn the termination time or cannot keep its state."""

    exit_code = 1


# --- a node's disk: the checkpoint store raises these, and so do the job's private directories
# (state/private_dirs); checkpoint/errors re-exports them

class CheckpointError(SlurmagentError):
    """Base class of checkpoint-store failures (one line for the user)."""

    exit_code = 1


class RestoreError(CheckpointError):
    """A checkpoint could not be restored (missing or corrupt blob); nothing was put in place."""


class NodeDiskError(RestoreError):
    """This node's checkpoint directory cannot take the checkpoint (the path is unusable, the disk
    is full or read-only): another node can, so the job is requeued without this node.
    ``nodes``: the nodes it happened on (empty: the node that raised it)."""

    def __init__(self, message: str, nodes: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


# errno values that say "this node's disk or path", never "the bucket" (a network failure is an
# OSError too, but with none of these)
NODE_LOCAL_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES,
    errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP, errno.EFBIG, errno.EMLINK, errno.ENXIO, errno.ENODEV,
})
