"""One base class for every domain error; the CLI turns them into one line and an exit code.

The exit codes of the commands that read the cluster (`status`, `repair`, `journal`, `check`),
documented in docs/admin/commands.md; `run` has its own (75, 76, 143: `run/`).
"""

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
