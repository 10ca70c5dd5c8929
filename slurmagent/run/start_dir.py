"""The job's checkpoint directory at start: the committed checkpoint put in place, or this
job's newer local files kept, anything else moved aside; a slow restore watched and said.

Who may keep what is decided from the directory record (`job.DirRecord`: which job wrote the
files, and which commit they hold) and the job's identity (`identity.settle`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..checkpoint.manifest import Manifest
from ..state.private_dirs import private_ckpt_dir
from .identity import settle
from .job import DirRecord, JobIdentity, RunOptions, manifest_id, stat_scan
from .uncommitted import keep_own_files, moved_aside, set_aside


@dataclass(frozen=True)
class Start:
    resumed: bool  # the directory holds a checkpoint (SLURMAGENT_RESUMED=1)
    baseline: Manifest | None = None  # the committed checkpoint it holds


def prepare_dir(opts: RunOptions, ident: JobIdentity, store, record: DirRecord, state_file: Path,
                remote: str, say: Callable[[str], None]) -> Start:
    """Put the committed checkpoint in place (or keep a newer local one of this job), other
    files moved aside (`uncommitted.py`; on every node: the agents); `resumed` when the directory
    then holds a checkpoint (SLURMAGENT_RESUMED=1), `baseline` the committed checkpoint it holds."""
    ckpt = opts.ckpt_dir
    private_ckpt_dir(ckpt)  # the user's, writable by nobody else (checked at every attempt)
    if not remote:  # the directory is the only copy: this job's own files stay
        moved_aside(ckpt, keep_own_files(ckpt, record, opts.keep_uncommitted), say, "another job left")
        if store is not None:  # a multi-node job: the same on every node
            store.restore(ckpt, deadline_s=opts.restore_deadline_s, state_file=state_file)
        return Start(bool(stat_scan(ckpt)))
    # this submission's committed checkpoint (None: none, or another's, now taken over)
    manifest = settle(store, ident, opts.per_job_remote, say, opts.restore_deadline_s)
    mid = manifest_id(manifest) if manifest is not None else None
    local = stat_scan(ckpt)
    held = record.read()  # what the directory last held, as its record says
    keep = not opts.multi_node and local and record.is_mine(held) and held.get("manifest") == mid
    if keep and manifest is None and not (ident.submission or ident.platform == "local"):
        keep = False  # only a submission id tells this job's earlier attempt from an earlier job with
        # the same (reused) job id that never committed either: its files go aside, never deleted
    if keep:
        if manifest is None:
            say(f"kept the files of this job's earlier attempt in {ckpt}: nothing is committed to "
                     f"{remote} yet")
            return Start(True)
        changed = sorted(rel for rel, st in local.items() if (held.get("files") or {}).get(rel) != st)
        say(f"kept the local checkpoint in {ckpt}: it holds the committed checkpoint of attempt "
                 f"{manifest.attempt} (the last one in {remote})"
                 + (f" and {len(changed)} newer file(s) the last sync did not commit" if changed else "")
                 + "; not restoring over it")
        return Start(True, manifest)
    set_aside(ckpt, manifest.files if manifest is not None else (), say, opts.keep_uncommitted)
    restored = None
    if manifest is not None or opts.multi_node:  # the agents do the same on every node
        # the hash cache learns the restored files, so the next sync neither reads nor sends them
        restored = store.restore(ckpt, deadline_s=opts.restore_deadline_s, state_file=state_file)
    if restored is None or not restored.files:  # none committed (deleted between the reads, or a claim)
        set_aside(ckpt, (), say, opts.keep_uncommitted)
        record.write(manifest=None, files={})
        say(f"no checkpoint at {remote}: starting fresh")
        return Start(False)
    if manifest_id(restored) != mid:  # another commit came between the two reads
        set_aside(ckpt, restored.files, say, opts.keep_uncommitted)
    record.write(manifest=manifest_id(restored), files=stat_scan(ckpt))
    say(f"restored checkpoint of attempt {restored.attempt} ({len(restored.files)} files) from {remote}")
    return Start(True, restored)


class _LastRetry(logging.Handler):
    """Keeps the storage layer's last retry message, so a slow restore can say what it waits on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.last = record.getMessage()
        except Exception:  # noqa: BLE001 - a log record must never break the restore
            pass


def run_watched(work: Callable[[], bool], flush_pending: Callable[[], bool], clock: Callable[[], float],
                report_s: float, deadline_s: float, remote: str, say: Callable[[str], None]) -> bool | None:
    """`work` (the restore) in a thread: flush signals stay handled (None: one came, do not
    start) and a slow restore (bucket down, large checkpoint) says what it is doing."""
    box: dict = {}
    watcher = _LastRetry()
    store_log = logging.getLogger("slurmagent.checkpoint.gcs.store")
    old_level = store_log.level
    store_log.addHandler(watcher)
    store_log.setLevel(logging.DEBUG)

    def run() -> None:
        try:
            box["resumed"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            box["error"] = exc

    worker = threading.Thread(target=run, name="ckpt-restore", daemon=True)
    started = clock()
    next_report = started + report_s
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
            if flush_pending():
                return None
            now = clock()
            if worker.is_alive() and now >= next_report:
                next_report = now + report_s
                last = f"; last: {watcher.last}" if watcher.last else ""
                say(f"still restoring from {remote} after {now - started:.0f} s (gives up at {deadline_s:g} s){last}")
    finally:
        store_log.removeHandler(watcher)
        store_log.setLevel(old_level)
    if "error" in box:
        raise box["error"]
    return box["resumed"]
