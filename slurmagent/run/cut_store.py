"""A single-node job's store with the multi-node job's guarantee: while the trainer runs, a
periodic commit takes only units quiet for a whole round (`checkpoint/cut.py`), so a
`checkpoint-N/` the trainer is still filling file by file is never committed half-done; its
previous committed version stays meanwhile. The final sync, after the trainer exited,
takes everything as it is.

Each sync uploads the blobs first (the store's `sync(commit=False)`: held-back files go up
too, so taking them later costs nothing), then looks at the units, then commits one fenced
manifest (`commit`), as a multi-node job's batch step does with its agents' reports.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol, TextIO

from ..checkpoint.errors import CheckpointError
from ..checkpoint.manifest import Manifest, entry_content_id, no_progress_after
from ..checkpoint.cut import SETTLE_S, QuietCut, round_views, unit_files, unit_marks, unit_signatures
from ..checkpoint.saved import declared_sets, read_declarations


class BlobStore(Protocol):
    """What this needs of slurmagent.checkpoint.gcs.store.GcsCheckpointStore."""

    url: str

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = ..., restored: Manifest | None = ..., *,
             commit: bool = ...) -> Any: ...

    def commit(self, manifest: Manifest, *, deadline_s: float = ...) -> int: ...

    def latest_manifest(self, *, deadline_s: float = ...) -> Manifest | None: ...

    def restore(self, ckpt_dir, *, deadline_s: float = ..., state_file=...) -> Manifest | None: ...


@dataclasses.dataclass(frozen=True)
class CutSyncResult:
    files_sent: int
    bytes_sent: int
    manifest: Manifest | None  # committed by this sync (None: nothing committed)
    held_back: tuple[str, ...] = ()  # units whose new content this commit left out
    inner: Any = None  # the store's own result of the upload


class QuietCutStore:
    """The wrapper's CheckpointStore for a single-node job (see module doc)."""

    def __init__(self, inner: BlobStore, err: TextIO = sys.stderr, settle_s: float = SETTLE_S):
        self.inner = inner
        self.err = err
        self.cut = QuietCut(settle_s=settle_s)
        self.trainer_running: Callable[[], bool] = lambda: False  # set by `run/main.py`
        # (rewritten, appended): the checkpoint's files the job's processes hold open for writing
        # now (core/job_processes; set by `run/main.py`)
        self.open_files: Callable[[], tuple[set[str], set[str]]] = lambda: (set(), set())
        self.torn: set[str] = set()  # open for writing when the wrapper killed the trainer (supervisor)
        self.last_committed: Manifest | None = None
        self._started = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def warn(self) -> Callable[[str], None] | None:
        return getattr(self.inner, "warn", None)

    @warn.setter
    def warn(self, callback: Callable[[str], None] | None) -> None:
        self.inner.warn = callback

    def say(self, message: str) -> None:
        (self.warn or (lambda m: print(f"slurmagent run: {m}", file=self.err, flush=True)))(message)

    def latest_manifest(self, *, deadline_s: float = 60.0) -> Manifest | None:
        return self.inner.latest_manifest(deadline_s=deadline_s)

    # The checkpoint identity (slurmagent.run.identity.OwnedStore) is the bucket store's: its commits
    # carry the owner settled at start.
    @property
    def owner(self) -> str | None:
        return getattr(self.inner, "owner", None)

    @owner.setter
    def owner(self, value: str | None) -> None:
        self.inner.owner = value

    def read_manifest(self, *, deadline_s: float = 60.0) -> tuple[Manifest | None, int]:
        return self.inner.read_manifest(deadline_s=deadline_s)

    def claim(self, manifest: Manifest, over: Manifest | None, generation: int, *, deadline_s: float = 60.0) -> int:
        return self.inner.claim(manifest, over, generation, deadline_s=deadline_s)

    def restore(self, ckpt_dir, *, deadline_s: float = 1800.0, state_file=None) -> Manifest | None:
        return self.inner.restore(ckpt_dir, deadline_s=deadline_s, state_file=state_file)

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = 600.0,
             restored: Manifest | None = None) -> CutSyncResult:
        with self._lock:
            if not self._started:  # what this attempt started from is committed until a unit moves
                self._started, self.last_committed = True, restored
            running = self.trainer_running()
            started = time.monotonic()
            before = unit_files(ckpt_dir) if running else {}
            up = self.inner.sync(ckpt_dir, attempt, state_file, deadline_s=deadline_s, restored=restored,
                                 commit=False)
            previous = self.last_committed
            writing, appending = self.open_files() if running else (set(self.torn), set())
            views, declared = None, []
            if running:
                after = unit_files(ckpt_dir)
                views = {0: round_views(before, after, appending, time.time_ns(), unit_marks(ckpt_dir, after))}
                declared = declared_sets(read_declarations(ckpt_dir), before, after)
            cut = self.cut.take(up.files or {}, {}, {0: unit_signatures(ckpt_dir)},
                                previous_files=previous.files if previous else None, running=running,
                                writing=writing, views=views, appending=appending, declared=declared)
            for message in cut.messages:
                self.say(message)
            result = CutSyncResult(up.files_sent, up.bytes_sent, None, tuple(cut.held_back), up)
            if not cut.files:  # an empty directory never replaces a checkpoint
                return result
            no_progress = no_progress_after(restored, cut.files)
            if previous is not None and (previous.attempt, previous.files, previous.no_progress) == (
                    attempt, cut.files, no_progress):
                return dataclasses.replace(result, manifest=previous)  # nothing new to commit
            check_held_back_objects(self.inner, cut.files, (up.files or {}).values(), deadline_s)
            manifest = Manifest(attempt=attempt, files=cut.files, no_progress=no_progress)
            self.inner.commit(manifest, deadline_s=max(deadline_s - (time.monotonic() - started), 2.0))
            self.last_committed = manifest
            return dataclasses.replace(result, manifest=manifest)


def check_held_back_objects(store: Any, files: dict[str, dict], reported: Iterable[dict], deadline_s: float) -> None:
    """Entries no node reported now (held back as previously committed) must still have their
    blob in the bucket: a lifecycle rule may have deleted it, and no node holds those bytes to
    send again. `store.missing_objects` (checkpoint/gcs/store.py) checks each object once per run."""
    check = getattr(store, "missing_objects", None)
    now = {entry_content_id(e) for e in reported if "link" not in e}
    held = {rel: e for rel, e in files.items() if "link" not in e and entry_content_id(e) not in now}
    if check is None or not held:
        return
    missing = check(held, deadline_s=max(deadline_s / 4, 10.0))
    if missing:
        raise CheckpointError(
            f"not committing: {len(missing)} file(s) kept as previously committed ({', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}) have no blob in {store.url} any more and no node "
            "holds them; the next round commits what the nodes hold")
