"""For training code run under `slurmagent run`: know when to checkpoint, where, and whether
this run resumes one. Stdlib only; no dependency on torch.

    from slurmagent import trainer

    with trainer.checkpoint_handler():          # installs the SIGUSR1/SIGTERM handler
        state = load(trainer.ckpt_dir()) if trainer.resumed() else fresh()
        for step in range(state.step, total):
            train_step(state)
            if trainer.checkpoint_requested():  # the flag is checked between steps
                trainer.atomic_write(trainer.ckpt_dir() / "state.json", dump(state))
                sys.exit(0)
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_requested = False
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def _on_signal(signum: int, _frame) -> None:
    global _requested
    _requested = True


def checkpoint_requested() -> bool:
    """True once the wrapper (or Slurm) asked for a checkpoint; cheap, call it every step."""
    return _requested


def reset() -> None:
    global _requested
    _requested = False


@contextmanager
def checkpoint_handler(signals: tuple[int, ...] = DEFAULT_SIGNALS) -> Iterator[None]:
    """Install a handler that only records the request (no work in signal context)."""
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def ckpt_dir() -> Path:
    """`SLURMAGENT_CKPT_DIR`: where to write checkpoints (synced to Cloud Storage)."""
    path = Path(os.environ.get("SLURMAGENT_CKPT_DIR") or "checkpoints")
    path.mkdir(parents=True, exist_ok=True)
    return path


def resumed() -> bool:
    """True when a checkpoint was restored into ckpt_dir() before this run started."""
    return os.environ.get("SLURMAGENT_RESUMED") == "1"


def restart_count() -> int:
    return int(os.environ.get("SLURMAGENT_RESTART_COUNT") or 0)


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write to a `.tmp` name, fsync, rename: the syncer never uploads half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
