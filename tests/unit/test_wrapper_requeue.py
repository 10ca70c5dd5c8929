"""The wrapper's requeue: the budget counts restarts without progress, the job's own requeue is
held until the final sync, exit codes and the last stderr line say what happened.

The supervisor runs in-process against a real Cloud Storage emulator; Slurm's requeue is the
injected callable (the cluster tests in test_wrapper_slurm.py use the real one).

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_wrapper_requeue_gcs.py.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import REPO, wait_for
from slurmagent.errors import SlurmError
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.child import RequeueHold
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import Supervisor

# A trainer in sh: writes CONTENT as its checkpoint, says READY, checkpoints again on SIGUSR1.
SH_TRAINER = 'trap "exit 0" USR1; [ -n "$1" ] && printf "%s" "$1" > "$SLURMAGENT_CKPT_DIR/state"; : > "$2"; ' \
             'while :; do sleep 0.02; done'


class Requeues(list):
    """Slurm's requeue, recorded (or refused, like `scontrol requeue` of a Requeue=0 job)."""

    refuse = ""

    def __call__(self, job_id: str) -> None:
        if self.refuse:
            raise SlurmError(f"scontrol requeue {job_id}: {self.refuse}")
        self.append(job_id)


def attempt(tmp_path: Path, restart: int, content: str, *, store=True, max_requeues: int = 3, ckpt_dir=None,
            requeues: Requeues | None = None, cmd=None, flush: bool = True, hold=None, grace_s: float = 20.0,
            ready: Path | None = None, before_flush=None, submission: str = "", **options):
    """One attempt of job 77 on a fresh node (empty dir) unless `ckpt_dir` is given: the trainer
    writes `content`, then the wrapper gets SIGTERM (when `flush`). Returns (outcome, stderr)."""
    ckpt = ckpt_dir or tmp_path / f"node-{restart}" / "ckpt"
    ready = ready or tmp_path / f"ready-{restart}-{time.monotonic_ns()}"
    ident = JobIdentity("slurm", "77", "77", restart, ("77",), submission)
    opts = RunOptions(cmd=cmd or ["sh", "-c", SH_TRAINER, "sh", content, str(ready)], ckpt_dir=ckpt,
                      remote="gs://ckpt/jobs/77" if store else "", grace_s=grace_s, max_requeues=max_requeues,
                      sync_interval_s=3600, stop_wait_s=5, **options)
    err = io.StringIO()
    sup = Supervisor(opts, ident, GcsCheckpointStore(opts.remote) if store else None,
                     requeues if requeues is not None else Requeues(), dict(os.environ), err=err, hold=hold)
    if flush:
        def signal_when_ready() -> None:
            wait_for(ready.exists, 30, "trainer start", interval=0.02)
            if before_flush is not None:
                before_flush()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=signal_when_ready, daemon=True).start()
    outcome = sup.run()
    return outcome, err.getvalue()


def test_without_a_bucket_progress_is_seen_in_a_shared_dir(tmp_path):
    shared = tmp_path / "shared" / "ckpt"
    requeues = Requeues()
    outcomes = [attempt(tmp_path, r, c, store=False, ckpt_dir=shared, max_requeues=1, requeues=requeues)[0]
                for r, c in enumerate(["a", "b", "c", "d", "", ""])]
    assert [o.requeued for o in outcomes] == [True, True, True, True, True, False]
    assert [o.no_progress for o in outcomes] == [0, 0, 0, 0, 1, 2]
    assert all(o.resumed for o in outcomes[1:])  # bucket or not, the dir held a checkpoint


# --- the job's own `scontrol requeue`, held --------------------------------------------------


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the real scontrol the shim passes other commands to (records its argv)."""
    log = tmp_path / "real-scontrol.log"
    real = tmp_path / "bin" / "scontrol"
    real.parent.mkdir()
    real.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "JobId=$3 JobState=RUNNING"\n')
    real.chmod(0o755)
    return real, log


def test_shim_argv_is_data_not_code(tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77",), str(real))
    env = dict(os.environ, PATH=hold.child_path(os.environ["PATH"]))
    for args in (["requeue", "77;touch x"], ["requeue", "$(touch x)"], ["requeue", "*"]):
        subprocess.run(["scontrol", *args], env=env, cwd=tmp_path, check=True, timeout=10)
    assert not hold.requested() and not (tmp_path / "x").exists()
    assert len(real_log.read_text().splitlines()) == 3
    with pytest.raises(ValueError):
        RequeueHold(("77; rm -rf /",), str(real))
    hold.cleanup()


def test_cli_last_line_says_the_exit_code(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), "--",
                           "sh", "-c", "exit 3"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == "slurmagent run: exit 3: the job's own exit code (it ended by itself)"
