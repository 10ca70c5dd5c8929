"""The wrapper's goodput ledger: one record per attempt beside the checkpoint (`core/goodput.py`
says what the fields mean, `checkpoint/gcs/ledger.py` where they go).

Hooked where the wrapper already reports the checkpoint to its owner (`LedgerReport` wraps the
`CheckpointReport`: trainer start, every commit) and at the end of `run/main.py`. A "started"
record goes up in the background once the trainer starts (a killed attempt still shows); the
full record replaces it at the end. Each write has a deadline and never fails the job: a
failed write is one line on stderr.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..checkpoint.saved import file_signature, read_declarations
from ..core.goodput import SCHEMA, end_of
from ..core.hostlist import expand
from ..core.reasons import fault_text, is_ours, is_planned
from ..slurm import env as slurm_env
from ..state import expiry_state
from .job import stat_scan

START_DEADLINE_S = 10.0
END_DEADLINE_S = 10.0  # Slurm kills a requeued batch step after KillWait (30 s by default)


class AttemptLedger:
    """This attempt's times as the wrapper sees them, and the writes of its record."""

    def __init__(self, bucket: Any, job: str, attempt: int, env: Mapping[str, str], ckpt_dir: Path, *,
                 started: float, say: Callable[[str], None], clock: Callable[[], float] = time.time,
                 submission: str = "", platform: str = "slurm") -> None:
        self.bucket, self.job, self.attempt = bucket, job, attempt
        self.ckpt_dir, self.say, self.clock = ckpt_dir, say, clock
        nodes = slurm_env.node_list(env) or slurm_env.slurmd_node(env) or ""
        try:
            count = slurm_env.num_nodes(env)
        except ValueError:
            count = 1
        self.base = {"schema": SCHEMA, "job": job, "attempt": attempt, "submission": submission,
                     "platform": platform, "nodes": nodes, "node_count": count,
                     "gpus": slurm_env.gpus_on_node(env) * count, "started": started}
        self.lock = threading.Lock()
        self.trainer_at: float | None = None
        self.baseline: tuple = ()
        self.seen: tuple = ()  # the content last committed (the restored one at start)
        self.baseline_ids: dict[str, str] = {}
        self.first_progress: float | None = None
        self.last_commit: float | None = None
        self.committed_step: int | None = None  # the step the last commit of new content holds
        self.step_now: Callable[[], int | None] = lambda: None  # the ranks' progress step now (the hang watch's)
        self.final_sync_s: float | None = None
        self.start_scan: dict[str, list[int]] | None = None  # the directory as the trainer found it
        self.start_thread: threading.Thread | None = None
        self.done = False

    # --- hooks ------------------------------------------------------------------------------

    def trainer_started(self, baseline: Any | None) -> None:
        """The restore is over and the trainer starts: write the "started" record in the background."""
        with self.lock:
            self.trainer_at = self.clock()
            if baseline is not None:
                self.baseline = self.seen = baseline.content_signature()
                self.baseline_ids = dict(self.baseline)
            self.start_scan = self._scan()
        self.start_thread = threading.Thread(target=self._write_started, name="ledger-start", daemon=True)
        self.start_thread.start()

    def _scan(self) -> dict[str, list[int]] | None:
        try:
            return stat_scan(self.ckpt_dir)
        except (OSError, ValueError):
            return None

    def committed(self, manifest: Any | None, duration_s: float, final: bool) -> None:
        """A sync round ended: the first change in the directory since the trainer started is first
        progress (to within a round; else the first commit of new content); a commit of new content
        is the last commit."""
        now = self.clock()
        scan = self._scan() if self.first_progress is None and self.start_scan is not None else None
        with self.lock:
            if final:
                self.final_sync_s = duration_s
            if scan is not None and self.first_progress is None:
                changed = [v[1] / 1e9 for k, v in scan.items() if self.start_scan.get(k) != v]
                if changed:
                    self.first_progress = self._clamp(min(changed), now)
            if manifest is None:
                return
            sig = manifest.content_signature()
            if sig == self.seen:
                return
            self.seen = sig
            if sig == self.baseline:
                return
            self.last_commit = now
            self.committed_step = None  # until read below: a record meanwhile falls back to the times
            if self.first_progress is None:
                self.first_progress = self._first_change(sig, now)
        step = self._step_of(manifest)
        with self.lock:
            if self.seen == sig:  # no newer commit came in meanwhile
                self.committed_step = step

    def _step_of(self, manifest: Any) -> int | None:
        """The step a commit holds: the newest `trainer.saved(step=)` whose files it holds as they
        were declared (their size, and on disk still the declared file), else the ranks' progress
        step as the round ends (up to a round past the save: the recompute is then that short)."""
        try:
            files = manifest.files
            steps = [d.step for d in read_declarations(self.ckpt_dir)
                     if d.step is not None and d.files and all(self._holds(files, n, sig) for n, sig in d.files.items())]
        except (OSError, ValueError, TypeError, AttributeError):
            steps = []
        return max(steps) if steps else self.step_now()

    def _holds(self, files: Mapping[str, Any], name: str, declared: list[int]) -> bool:
        entry = files.get(name)
        if not isinstance(entry, Mapping) or entry.get("size") != declared[0]:
            return False
        return file_signature(self.ckpt_dir / name) == list(declared[:3])

    def _first_change(self, sig: tuple, now: float) -> float:
        """When the trainer first wrote a file of this commit that the restored checkpoint did not
        hold (its mtime), not earlier than the trainer's start; the commit time when none is here."""
        times = []
        for name, cid in sig:
            if self.baseline_ids.get(name) == cid:
                continue
            try:
                times.append(os.stat(self.ckpt_dir / name, follow_symlinks=False).st_mtime)
            except (OSError, ValueError):
                continue
        return self._clamp(min(times), now) if times else now

    def _clamp(self, t: float, now: float) -> float:
        """Not before the trainer started, not after now."""
        floor = self.trainer_at if self.trainer_at is not None else self.base["started"]
        return min(max(t, floor), now)

    # --- records ------------------------------------------------------------------------------

    def record(self, state: str, **end: Any) -> dict[str, Any]:
        with self.lock:
            rec = dict(self.base, state=state, first_progress=self.first_progress, last_commit=self.last_commit,
                       committed_step=self.committed_step,
                       restore_s=None if self.trainer_at is None else round(self.trainer_at - self.base["started"], 3))
        rec.update(end)
        return rec

    def _write_started(self) -> None:
        rec = self.record("started")
        with self.lock:
            if self.done:
                return
        self._write(rec, START_DEADLINE_S, "started")

    def _write(self, rec: dict, deadline_s: float, what: str) -> None:
        try:
            self.bucket.write(self.job, self.attempt, rec, deadline_s=deadline_s)
        except Exception as exc:  # noqa: BLE001 - the ledger never fails the job
            self.say(f"could not write the goodput ledger record ({what}) {self.bucket.record_url(self.job, self.attempt)}: "
                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    def ended(self, outcome: Any, *, expiry_source: str = "", fault_node: str = "", fault: str = "",
              error: str = "", progress: tuple[float | None, float | None] = (None, None),
              steps: tuple[int | None, int | None, float | None] = (None, None, None)) -> dict[str, Any]:
        """The full record, once, at the end of the attempt (waits for the "started" write first);
        returned for the node's goodput counters."""
        ended = self.clock()
        with self.lock:
            self.done = True
        if self.start_thread is not None:
            self.start_thread.join(START_DEADLINE_S)
        if error:
            end, why = "error", error
        else:
            end, why = end_of(flushed=outcome.flushed, flush_cause=outcome.flush_cause, child_code=outcome.child_code,
                              expiry_source=expiry_source, fault_node=fault_node, fault=fault,
                              summary=outcome.summary)
        flush_s = outcome.flush_seconds if outcome is not None and outcome.flushed else self.final_sync_s
        rec = self.record("ended", ended=ended, end=end, why=why, fault_node=fault_node,
                          exit_code=None if outcome is None else outcome.exit_code,
                          child_code=None if outcome is None else outcome.child_code,
                          flush_s=None if flush_s is None else round(flush_s, 3),
                          requeued=bool(outcome is not None and outcome.requeued),
                          first_rank_progress=progress[0], last_progress=progress[1],
                          last_progress_step=steps[1], step_s=steps[2],
                          resumed=bool(outcome is not None and outcome.resumed))
        self._write(rec, END_DEADLINE_S, "end")
        return rec


class LedgerReport:
    """The owner's `CheckpointReport`, with the ledger told of the trainer's start and each sync."""

    def __init__(self, inner: Any, ledger: AttemptLedger) -> None:
        self.inner, self.ledger = inner, ledger

    def restored(self, manifest: Any | None) -> None:
        self.inner.restored(manifest)
        self.ledger.trainer_started(manifest)

    def synced(self, manifest: Any | None, duration_s: float, files_sent: int, bytes_sent: int,
               lag_s: float | None, held_back: list[str] | None = None, say: bool = True) -> None:
        self.inner.synced(manifest, duration_s, files_sent, bytes_sent, lag_s, held_back=held_back, say=say)
        self.ledger.committed(manifest, duration_s, final=not say)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --- why it ended: what the node knows ----------------------------------------------------------


def expiry_source(files: tuple[Path, ...], lead_s: float, now: float | None = None) -> str:
    """The termination source (`state/expiry_state`) when this VM stops within `lead_s`, else ""."""
    now = time.time() if now is None else now
    for path in files:
        data = expiry_state.read(path)
        when = expiry_state.termination(data)
        if when is not None and when.timestamp() - now <= lead_s:
            return str((data or {}).get("source") or "unknown")
    return ""


def faulty_node(slurm: Any, env: Mapping[str, str]) -> tuple[str, str]:
    """(node, fault) of the job's node that slurmagent drained for a fault; ("", "") when none is known."""
    names = expand(slurm_env.node_list(env)) or [n for n in [slurm_env.slurmd_node(env)] if n]
    try:
        nodes = slurm.nodes(names) if names else []
    except Exception:  # noqa: BLE001 - Slurm unreachable: the record says "GPU fault" without a node
        return "", ""
    for n in nodes:
        if is_ours(n.reason) and not is_planned(n.reason):
            return n.name, fault_text(n.reason)
    return "", ""
