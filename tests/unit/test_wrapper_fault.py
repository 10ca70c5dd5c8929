"""The wrapper's fault flush: a short wait for a trainer that may hang on a dead GPU, and a
child that survives SIGKILL (uninterruptible sleep) never blocks the sync and the requeue."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

from support import REPO, SUPPORT, wait_for
from slurmagent.run import child as child_process, supervisor as wrapper
from slurmagent.slurm.model import FAULT_FLUSH_SIGNAL
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import EXIT_FLUSHED, Supervisor

TOY = str(SUPPORT / "toy_trainer.py")
REAL_POPEN = subprocess.Popen


def start_wrapper(tmp_path: Path, *args: str, trainer: tuple[str, ...] = ()):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    ledger = tmp_path / "ledger"
    proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"),
                             *args, "--", sys.executable, TOY, "100000", str(ledger), "0.02", *trainer],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    wait_for(lambda: ledger.exists(), 30, "trainer start")
    return proc, ledger


def test_fault_signal_flushes_with_a_short_grace_not_the_jobs(tmp_path):
    # the trainer ignores the checkpoint signal (hung on the dead GPU): --grace 600 is not waited for
    proc, ledger = start_wrapper(tmp_path, "--grace", "600", trainer=("ignore",))
    proc.send_signal(FAULT_FLUSH_SIGNAL)
    assert proc.wait(60) == EXIT_FLUSHED
    err = proc.stderr.read()
    assert f"SIGPWR: asking the job to checkpoint (SIGUSR1, grace {wrapper.FAULT_GRACE_S:g} s: a GPU failed" in err, err
    assert f"did not exit within {wrapper.FAULT_GRACE_S:g} s" in err
    assert "ckpt " not in ledger.read_text()  # it never checkpointed: the last committed checkpoint counts


def test_fault_signal_to_a_trainer_that_checkpoints_is_a_normal_flush(tmp_path):
    proc, ledger = start_wrapper(tmp_path, "--grace", "600")
    proc.send_signal(FAULT_FLUSH_SIGNAL)
    assert proc.wait(60) == EXIT_FLUSHED
    assert "ckpt " in ledger.read_text() and (tmp_path / "ck" / "state.json").exists()


class StuckChild:
    """A Popen whose process survives SIGKILL (uninterruptible sleep): wait() never returns
    unless it has a timeout. The signals land on a real, harmless process group."""

    def __init__(self, cmd, **kw):
        self.real = REAL_POPEN(["sleep", "300"], start_new_session=True)
        self.pid = self.real.pid
        self.returncode = None
        self.waits: list[float | None] = []

    def poll(self):
        return None

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is None:
            threading.Event().wait(30)  # what the unbounded wait would do: never come back
            raise AssertionError("child.wait() without a timeout")
        raise subprocess.TimeoutExpired("stuck", timeout)

    def send_signal(self, signum):
        pass


class Store:
    def __init__(self):
        self.syncs = 0

    url = "gs://b/p"

    def restore(self, ckpt_dir, *, deadline_s=0, state_file=None):
        return None

    def latest_manifest(self, *, deadline_s=0):
        return None

    def sync(self, ckpt_dir, attempt, state_file, deadline_s=0, **_):
        self.syncs += 1
        return type("Result", (), {"bytes_sent": 10, "files_sent": 1, "manifest": None})()


def test_child_stuck_after_sigkill_does_not_block_sync_and_requeue(tmp_path, monkeypatch):
    made: list[StuckChild] = []

    def spawn(cmd, **kw):
        made.append(StuckChild(cmd, **kw))
        sup.pending.append(FAULT_FLUSH_SIGNAL)  # the watch's signal, as the handler records it, once the job runs
        return made[-1]

    monkeypatch.setattr(subprocess, "Popen", spawn)
    monkeypatch.setattr(child_process, "REAP_WAIT_S", 0.5)
    requeued: list[str] = []
    store = Store()
    opts = RunOptions(cmd=["train"], ckpt_dir=tmp_path / "ck", remote="gs://b/p", grace_s=0.2, sync_interval_s=3600)
    err = io.StringIO()
    sup = Supervisor(opts, JobIdentity("slurm", "77", "77", 0), store, requeued.append, {}, err)
    try:
        outcome = sup.run()
    finally:
        made[0].real.kill()
        made[0].real.wait()
    assert outcome.exit_code == EXIT_FLUSHED and outcome.child_killed
    assert None not in made[0].waits  # every wait on the child had a deadline
    assert store.syncs >= 1 and outcome.synced and requeued == ["77"]
    assert "did not die 0.5 s after SIGKILL" in err.getvalue(), err.getvalue()
