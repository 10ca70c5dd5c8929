"""The checkpoint store's errors, one class per thing a user can act on.

Its own module so that every part of the store (name rules, hashing, manifest,
the Cloud Storage side) raises the same classes without importing each other.
"""

from __future__ import annotations

from typing import Iterable

# the node-disk error's family lives in slurmagent/errors (state/private_dirs raises it too): the same classes
from ..errors import NODE_LOCAL_ERRNOS, CheckpointError, NodeDiskError, RestoreError

__all__ = [
    "CheckpointError",
    "RemoteURLError",
    "ManifestError",
    "StaleAttemptError",
    "StorageUnavailableError",
    "SyncDeadlineError",
    "ClaimRaceError",
    "RestoreError",
    "NodeDiskError",
    "LocalChangedError",
    "is_node_local",
]


class RemoteURLError(CheckpointError):
    """The checkpoint remote is not a valid ``gs://BUCKET[/PREFIX]`` URL."""

    exit_code = 2


class ManifestError(CheckpointError):
    """A checkpoint manifest is not valid JSON or does not follow the schema."""


class StaleAttemptError(CheckpointError):
    """A newer attempt (restart) already owns the remote checkpoint; ours must not overwrite it."""


class StorageUnavailableError(CheckpointError):
    """Cloud Storage kept failing (transient errors) until the caller's deadline, or refused."""


class SyncDeadlineError(StorageUnavailableError):
    """A sync or restore did not finish within its deadline; what was left is named.

    ``unfinished``: relpaths not transferred; ``unfinished_bytes``: their size.
    """

    def __init__(self, message: str, unfinished: Iterable[str] = (), unfinished_bytes: int = 0) -> None:
        super().__init__(message)
        self.unfinished = tuple(unfinished)
        self.unfinished_bytes = unfinished_bytes


class ClaimRaceError(StorageUnavailableError):
    """The manifest changed between reading it and taking the prefix over: read and decide again."""


def is_node_local(exc: BaseException) -> bool:
    """Did this fail because of the node's own disk or path (another node would do)?"""
    return isinstance(exc, NodeDiskError) or (isinstance(exc, OSError) and exc.errno in NODE_LOCAL_ERRNOS)


class LocalChangedError(CheckpointError):
    """A checkpoint file changed while it was being hashed or uploaded; sync again later."""
