"""For training code run under `slurmagent run`: know when to checkpoint, where, and whether
this run resumes one. Stdlib only; torch is used only when the caller already imported it.

    from slurmagent import trainer

    with trainer.checkpoint_handler():          # installs the SIGUSR1/SIGTERM handler
        state = load(trainer.ckpt_dir()) if trainer.resumed() else fresh()
        for step in range(state.step, total):
            train_step(state)
            trainer.progress(step)                  # the wrapper's hang watch sees the job advance
            if step % 1000 == 0:
                with trainer.phase("eval"):         # a long silent phase: not a hang
                    evaluate(state)
            if trainer.any_rank(trainer.checkpoint_requested()):   # every rank stops together
                trainer.atomic_write(trainer.ckpt_dir() / "state.json", dump(state))
                trainer.saved("state.json", step=step)   # whole: the next sync round commits it
                sys.exit(0)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_requested = False
_resumed_at_start: bool | None = None
# `progress` writes at most this often (a clock read otherwise): the last step a hung rank showed
# is at most this old, so the report's recompute misses at most this much of it
PROGRESS_INTERVAL_S = 0.25
_progress_due = 0.0
_saved: list = []  # this rank's `saved` declarations, newest last (checkpoint/saved.py)
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def _on_signal(signum: int, _frame) -> None:
    global _requested
    _requested = True


def checkpoint_requested() -> bool:
    """True once the wrapper (or Slurm) asked for a checkpoint; cheap, call it every step.
    Under torch.distributed only the ranks that got the signal see it: wrap it in `any_rank`."""
    return _requested


def reset() -> None:
    global _requested, _resumed_at_start, _progress_due
    _requested = False
    _resumed_at_start = None
    _progress_due = 0.0
    _saved.clear()


@contextmanager
def checkpoint_handler(signals: tuple[int, ...] = DEFAULT_SIGNALS) -> Iterator[None]:
    """Install a handler that only records the request (no work in signal context)."""
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def progress(step: int) -> None:
    """Tell the wrapper this rank advanced to `step` (its hang and straggler watch). Call it
    every step: at most one small file write per PROGRESS_INTERVAL_S, a clock read otherwise;
    nothing outside `slurmagent run`. Never raises. Ranks that meet in a collective every step:
    call it after the step's compute, before the collective, or no straggler shows
    (docs/user/hangs.md "Stragglers")."""
    global _progress_due
    now = time.monotonic()
    if now < _progress_due:
        return
    _progress_due = now + PROGRESS_INTERVAL_S
    directory = os.environ.get("SLURMAGENT_PROGRESS_DIR")
    if not directory:
        _progress_due = float("inf")  # not under the wrapper: never look again
        return
    from .slurm.env import slurmd_node  # start-up speed: a trainer pays only when it reports
    from .state.progress import write  # start-up speed: likewise

    try:
        write(directory, _rank(), step, time.time(), slurmd_node(os.environ) or "")
    except (OSError, ValueError, TypeError):
        pass  # the directory is gone (the attempt ends) or another node's path: training goes on


@contextmanager
def phase(name: str, expected_s: float | None = None) -> Iterator[None]:
    """Announce a long silent phase of this rank (evaluation, compilation, a save that writes
    no file): inside it the wrapper's hang watch does not take this rank's silence, nor the
    other ranks' wait for it, for a hang -- up to `expected_s` (default: the watch's ceiling,
    30 minutes). Per rank; nest-free (an inner phase replaces the outer one until it ends).
    Never raises, nothing outside `slurmagent run`.

        with trainer.phase("eval"):
            evaluate(model)
    """
    directory = os.environ.get("SLURMAGENT_PROGRESS_DIR")
    if not directory:
        yield
        return
    from .slurm.env import slurmd_node  # start-up speed: a trainer pays only when it reports
    from .state.progress import end_phase, write_phase  # start-up speed: likewise

    rank = _rank()
    try:
        write_phase(directory, rank, str(name), time.time(), float(expected_s or 0), slurmd_node(os.environ) or "")
    except (OSError, ValueError, TypeError):
        pass  # the directory is gone (the attempt ends): training goes on
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            end_phase(directory, rank)


def saved(paths, step: int | None = None) -> None:
    """Tell the wrapper a save is whole: `paths` (files or folders, in `ckpt_dir()`) are what
    this rank wrote, closed. Call it after the save returns, on every rank that wrote part of
    it. With `step`, every rank's files of that step form one set; without, this call's files
    do. A set is committed whole or not at all, at the next sync round -- never a model from
    one save beside an optimizer from another, and never a file rewritten since this call.
    Never raises, never blocks (a few stats and one small file write); nothing outside
    `slurmagent run`."""
    directory = os.environ.get("SLURMAGENT_CKPT_DIR")
    if not directory:
        return
    from .checkpoint.saved import KEEP_PER_RANK, Declaration, declaration_files, write_declarations  # start-up speed

    try:
        names = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        files = declaration_files(directory, names)
        rank = _rank()
        _saved.append(Declaration(rank, (_saved[-1].seq + 1) if _saved else 0,
                                  None if step is None else int(step), files))
        del _saved[:-KEEP_PER_RANK]
        write_declarations(directory, rank, _saved)
    except (OSError, ValueError, TypeError):
        pass  # the directory is gone (the attempt ends): training goes on; the other evidence still holds


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def ckpt_dir() -> Path:
    """`SLURMAGENT_CKPT_DIR`: where to write checkpoints (synced to Cloud Storage)."""
    path = Path(os.environ.get("SLURMAGENT_CKPT_DIR") or "checkpoints")
    path.mkdir(parents=True, exist_ok=True)
    return path


def resumed() -> bool:
    """True when this run starts from a checkpoint: the wrapper restored or found one
    (`SLURMAGENT_RESUMED=1`), or, bucket or not, the directory held checkpoint files when this
    process first asked (a shared file system, a run without the wrapper). Decided once, so
    the checkpoints this run writes later do not change the answer."""
    global _resumed_at_start
    if _resumed_at_start is None:
        _resumed_at_start = os.environ.get("SLURMAGENT_RESUMED") == "1" or _holds_checkpoint(ckpt_dir())
    return _resumed_at_start


def _holds_checkpoint(path: Path) -> bool:
    from .checkpoint.scan import scan_checkpoint_dir  # start-up speed (a trainer pays only when it asks); the syncer's own rule

    return bool(scan_checkpoint_dir(path))


def restart_count() -> int:
    return int(os.environ.get("SLURMAGENT_RESTART_COUNT") or 0)


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write to a unique temporary name beside `path`, fsync, rename: the syncer never uploads
    half a file, and several ranks may write the same name at once (the last rename wins; none
    fails). The temporary file is created exclusively and never through a symlink."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one: the ranks agree to checkpoint
    (and stop) at the same step, instead of one rank leaving while the others hang in the next
    collective. An all-reduce (MAX) of the flag when a torch.distributed process group is
    initialized; otherwise the flag itself (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return bool(flag)
    torch = sys.modules["torch"]
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
