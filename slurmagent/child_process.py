"""The wrapped command's process group: signals to it, stopping and reaping it, and its
own requeue held until the final checkpoint sync (`RequeueHold`).

The child runs in a session of its own, so a signal reaches every process of the trainer;
a process stuck in the kernel on a dead GPU is left behind rather than waited on forever.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from .private_dirs import user_tmp_parent
from .run_setup import JOB_ID_RE

REAP_WAIT_S = 10.0  # after SIGKILL: a child stuck in uninterruptible sleep is left behind after this


# --- the job's own requeue, held ----------------------------------------------------------

SHIM = """#!/bin/sh
# Written by `slurmagent run` for this job only. The job's own `scontrol requeue` of itself
# (PyTorch Lightning's auto-requeue, submitit) is held: the wrapper requeues the job once,
# after its final checkpoint sync. Every other scontrol call goes to the real one.
if [ "$#" -eq 2 ] && [ "$1" = requeue ]; then
  case "$2" in
    {ids})
      printf '%s\\n' "$2" >> {request}
      echo "slurmagent: requeue of job $2 held until the checkpoint is synced" >&2
      exit 0 ;;
  esac
fi
exec {real} "$@"
"""


class RequeueHold:
    """A private directory (0700, in `${TMPDIR:-/tmp}/slurmagent-<uid>/`) put first on the
    child's PATH, holding an `scontrol` that records the child's requeue of its own job in a
    file there and exits 0."""

    def __init__(self, job_ids: tuple[str, ...], real_scontrol: str, base: str | None = None):
        if not job_ids or not all(JOB_ID_RE.fullmatch(i) for i in job_ids):
            raise ValueError(f"not Slurm job ids: {job_ids!r}")
        # In the user's private parent (0700), never in a shared TMPDIR: srun carries the PATH
        # to every node, where a multi-node job's node agents create this same path privately.
        self.dir = Path(tempfile.mkdtemp(prefix="slurmagent-hold-", dir=base or user_tmp_parent()))
        self.request = self.dir / "requeue-requested"
        shim = self.dir / "scontrol"
        shim.write_text(SHIM.format(ids="|".join(job_ids), request=shlex.quote(str(self.request)),
                                    real=shlex.quote(real_scontrol)))
        shim.chmod(0o700)

    def child_path(self, path: str | None) -> str:
        return f"{self.dir}{os.pathsep}{path}" if path else str(self.dir)

    def requested(self) -> bool:
        return self.request.exists()

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)



# --- the child's process group ------------------------------------------------------------


def terminate_group(child: subprocess.Popen, wait_s: float, say: Callable[[str], None]) -> bool:
    """SIGTERM to the child's group, then SIGKILL after `wait_s`; True when it left by itself."""
    killpg(child, signal.SIGTERM)
    try:
        child.wait(timeout=wait_s)
        return True
    except subprocess.TimeoutExpired:
        killpg(child, signal.SIGKILL)
        if not reap(child, REAP_WAIT_S):
            say(f"the job did not die {REAP_WAIT_S:g} s after SIGKILL (stuck in the kernel?): "
                "leaving it behind to sync and requeue")
        return False


def reap(child: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for a killed child at most `timeout_s`; False when it is still there (a process in
    uninterruptible sleep, e.g. a driver call on a dead GPU, dies only when that call returns)."""
    try:
        child.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def killpg(child: subprocess.Popen, signum: int) -> None:
    """Signal the child's whole group (the trainer's workers too); the child alone when the group is not ours."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass
