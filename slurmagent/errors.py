"""One base class for every domain error; the CLI turns them into one line and an exit code."""


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


class NvmlTimeout(SlurmagentError):
    """The NVML read did not finish within its deadline."""

    exit_code = 1


class ExpiryError(SlurmagentError):
    """The expiry watch cannot learn the termination time or cannot keep its state."""

    exit_code = 1
