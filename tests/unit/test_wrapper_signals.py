"""Signals at the edges of a flush, without a cluster: a flush signal that comes with the
command's exit, a job Slurm is cancelling, the requeue retried while slurmctld is away, the exit
code of a command that died of a signal, the job's own requeue in every form scontrol takes, and
Slurm killing the wrapper during its final sync. The cluster versions are in
test_wrapper_signals_slurm.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import REPO
from slurmagent.run.child import EXIT_CHILD_SIGNALLED, RequeueHold, death_signal
from slurmagent.errors import SlurmError
from slurmagent.slurm.model import JobInfo
from slurmagent.run.requeue import RequeueVerb, requeue_own_job
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.slurm.commands import retry_with_backoff
from slurmagent.run.supervisor import EXIT_FLUSHED, EXIT_REQUEUE_REFUSED, Supervisor


class Requeues(list):
    """Slurm's requeue, recorded with the verb asked (`requeue` unless a held requeuehold)."""

    def __call__(self, job_id: str, verb: RequeueVerb = RequeueVerb()) -> None:
        self.append((job_id, str(verb)))


def supervise(tmp_path: Path, script: str, *, read_job=None, hold=None, store=None, requeues=None,
              restart: int = 0) -> tuple:
    """Job 77 runs `sh -c script` under the supervisor (in this process); returns (outcome, stderr, requeues)."""
    ident = JobIdentity("slurm", "77", "77", restart, ("77",))
    opts = RunOptions(cmd=["sh", "-c", script], ckpt_dir=tmp_path / "ckpt", grace_s=20, sync_interval_s=3600,
                      stop_wait_s=5)
    err = io.StringIO()
    requeues = Requeues() if requeues is None else requeues
    sup = Supervisor(opts, ident, store, requeues, dict(os.environ, WRAPPER_PID=str(os.getpid())), err=err,
                     hold=hold, read_job=read_job)
    outcome = sup.run()
    return outcome, err.getvalue(), requeues


# The checkpoint_handler recipe (docs/user/recipes/) in sh: on SIGTERM or SIGUSR1 save and exit 0 at once.
SAVER = 'trap \'printf saved > "$SLURMAGENT_CKPT_DIR/state"; exit 0\' TERM USR1; '


# --- a flush signal that comes with the command's exit (21.2 a) -------------------------------


def test_sigterm_to_trainer_and_wrapper_together_requeues(tmp_path):
    # a node shutdown: the wrapper's SIGTERM is sent as the trainer saves and exits 0
    outcome, err, requeues = supervise(tmp_path, SAVER + 'kill -TERM "$WRAPPER_PID"; kill -TERM $$; sleep 30')
    assert outcome.flushed and outcome.flush_cause == "SIGTERM", err
    assert outcome.requeued and outcome.exit_code == EXIT_FLUSHED and requeues == [("77", "requeue")]
    assert "SIGTERM came as the job exited (exit 0)" in err
    assert (tmp_path / "ckpt" / "state").read_text() == "saved"


def test_a_flush_signal_still_on_its_way_at_the_exit_counts(tmp_path):
    # the wrapper's SIGTERM lands 0.1 s after the trainer exited (the sender goes process by process)
    outcome, err, requeues = supervise(tmp_path, 'printf saved > "$SLURMAGENT_CKPT_DIR/state"; '
                                                 '(sleep 0.1; kill -TERM "$WRAPPER_PID") & exit 0')
    assert outcome.flushed and outcome.requeued and requeues == [("77", "requeue")], err


def test_a_job_that_ends_by_itself_with_no_signal_is_not_requeued(tmp_path):
    outcome, err, requeues = supervise(tmp_path, "exit 0")
    assert not outcome.flushed and outcome.exit_code == 0 and requeues == []


# --- a job Slurm is ending is never requeued (21.2 b) ------------------------------------------


def job(state: str, restarts: int = 0) -> JobInfo:
    return JobInfo(job_id="77", state=state, restarts=restarts)


def test_a_cancelled_job_is_not_requeued(tmp_path):
    # `scancel`: Slurm SIGTERMs everything; `scontrol show job` then says COMPLETING (22.05)
    outcome, err, requeues = supervise(tmp_path, SAVER + 'kill -TERM "$WRAPPER_PID"; while :; do sleep 0.05; done',
                                       read_job=lambda _job: job("COMPLETING"))
    assert requeues == [] and not outcome.requeued and outcome.exit_code == EXIT_REQUEUE_REFUSED, err
    assert "not requeueing job 77: Slurm is ending it (JobState=COMPLETING" in err
    assert "NOT requeued: Slurm is ending it" in outcome.summary


@pytest.mark.parametrize("state", ["CANCELLED", "CANCELLED+COMPLETING", "TIMEOUT"])
def test_other_ending_states_are_not_requeued(state):
    calls = []
    result = requeue_own_job("77", 0, lambda: calls.append(1), lambda: job(state), 100.0, print)
    assert result.ending and not result.requeued and calls == []


def test_a_job_requeued_by_someone_else_is_not_requeued_twice():
    calls = []
    result = requeue_own_job("77", 2, lambda: calls.append(1), lambda: job("COMPLETING", restarts=3), 100.0, print)
    assert result.requeued and "requeued already" in result.why and calls == []


def test_a_job_slurm_requeues_expedited_is_not_requeued_twice():
    # Slurm 25.11+: an --requeue=expedite job whose node failed is EXPEDITING before its count moves
    calls = []
    result = requeue_own_job("77", 0, lambda: calls.append(1), lambda: job("EXPEDITING"), 100.0, print)
    assert result.requeued and not result.ending and calls == []
    assert "Slurm is requeueing it itself (JobState=EXPEDITING" in result.why


def test_when_the_state_cannot_be_read_a_flush_is_a_flush():
    said, calls = [], []

    def unreadable():
        raise SlurmError("scontrol show job 77: Unable to contact slurm controller (connect failure)")

    result = requeue_own_job("77", 0, lambda: calls.append(1), unreadable, 100.0, said.append)
    assert result.requeued and calls == [1]
    assert said == ["cannot read job 77 from Slurm (scontrol show job 77: Unable to contact slurm controller "
                    "(connect failure)): requeueing it (a flush signal is a flush)"]


# --- the requeue retried while slurmctld is away (21.3) ----------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def flaky(failures: list[str]):
    """A call that fails with these scontrol messages, in order, then works."""
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= len(failures):
            raise SlurmError(f"scontrol requeue 77: {failures[len(calls) - 1]}")
        return "ok"

    return call, calls


def test_requeue_is_retried_with_backoff_until_slurmctld_answers():
    clock, said = FakeClock(), []
    call, calls = flaky(["Unable to contact slurm controller (connect failure)", "Unexpected message received for job 77",
                         "Socket timed out on send/recv operation"])
    assert retry_with_backoff(call, 60.0, lambda e: False, said.append, what="requeue of job 77", clock=clock,
                              sleep=clock.sleep) == "ok"
    assert len(calls) == 4 and clock.sleeps == [1.0, 2.0, 4.0]
    assert said[0] == ("requeue of job 77 failed (scontrol requeue 77: Unable to contact slurm controller (connect "
                       "failure)); try 2 in 1.0 s (60 s left)")
    assert len(said) == 3  # one line per wait


def test_the_retry_stops_at_the_deadline():
    clock, said = FakeClock(), []
    call, calls = flaky(["Unable to contact slurm controller (connect failure)"] * 100)
    with pytest.raises(SlurmError, match="gave up after 6 tries"):
        retry_with_backoff(call, 20.0, lambda e: False, said.append, clock=clock, sleep=clock.sleep)
    assert clock.now == 20.0 and clock.sleeps == [1.0, 2.0, 4.0, 8.0, 5.0]


def test_a_permanent_refusal_is_not_retried():
    clock = FakeClock()
    call, calls = flaky(["Requested operation is presently disabled for job 77"] * 3)
    result = requeue_own_job("77", 0, call, None, 60.0, print, clock=clock, sleep=clock.sleep)
    assert not result.requeued and "presently disabled" in result.why and len(calls) == 1 and clock.sleeps == []


def test_an_earlier_try_that_went_through_counts_as_requeued():
    clock = FakeClock()
    call, calls = flaky(["Socket timed out on send/recv operation", "Job is pending execution for job 77"])
    result = requeue_own_job("77", 0, call, None, 60.0, print, clock=clock, sleep=clock.sleep)
    assert result.requeued and len(calls) == 2


def test_a_try_that_timed_out_but_took_is_our_requeue_not_someone_elses():
    """Under load scontrol's answer may time out after slurmctld requeued the job: the next try
    reads the restart count moved, and that was ours (said as requeued, not "not requeueing")."""
    clock = FakeClock()
    call, calls = flaky(["Socket timed out on send/recv operation"])
    reads = iter([job("RUNNING", restarts=0), job("PENDING", restarts=1)])
    result = requeue_own_job("77", 0, call, lambda: next(reads), 60.0, print, clock=clock, sleep=clock.sleep)
    assert result.requeued and result.why == "" and len(calls) == 1


# --- a command that died of a signal (22.6) ------------------------------------------------------


@pytest.mark.parametrize("script, code, line", [
    ("kill -TERM $$", EXIT_CHILD_SIGNALLED, "exit 76: the job died of SIGTERM without a flush (killed by it)"),
    ("exit 143", EXIT_CHILD_SIGNALLED, "exit 76: the job died of SIGTERM without a flush (it exited 143, as a shell "
                                       "or srun reports a signal)"),
    ("kill -KILL $$", EXIT_CHILD_SIGNALLED, "exit 76: the job died of SIGKILL without a flush (killed by it)"),
    ("exit 3", 3, "exit 3: the job's own exit code (it ended by itself)"),
    ("exit 128", 128, "exit 128: the job's own exit code (it ended by itself)"),
])
def test_a_command_that_died_of_a_signal_never_exits_143(tmp_path, script, code, line):
    outcome, err, requeues = supervise(tmp_path, script)
    assert (outcome.exit_code, outcome.summary) == (code, line)
    assert not outcome.flushed and requeues == []


def test_death_signal_reads_shell_codes():
    assert [death_signal(c) for c in (-9, 137, 143, 130, 0, 1, 128, 255)] == [9, 9, 15, 2, None, None, None, None]


def test_cli_last_line_names_the_signal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), "--",
                           "sh", "-c", "exit 143"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CHILD_SIGNALLED
    assert proc.stderr.strip().splitlines()[-1] == ("slurmagent run: exit 76: the job died of SIGTERM without a "
                                                    "flush (it exited 143, as a shell or srun reports a signal)")


# --- the job's own requeue in every form (21.17) -------------------------------------------------


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the real scontrol: one line per call, its argv joined by `|`."""
    log = tmp_path / "real-scontrol.log"
    real = tmp_path / "bin" / "scontrol"
    real.parent.mkdir(exist_ok=True)
    real.write_text(f'#!/bin/sh\nIFS="|"; printf "%s\\n" "$*" >> {log}\n')
    real.chmod(0o755)
    return real, log


@pytest.fixture
def shim(tmp_path):
    real, log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77", "70_7"), str(real))
    env = dict(os.environ, PATH=hold.child_path(os.environ["PATH"]))

    def run(*args: str) -> tuple[int, str, list[str]]:
        proc = subprocess.run(["scontrol", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=10)
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return proc.returncode, proc.stderr, calls

    yield run, hold
    hold.cleanup()


@pytest.mark.parametrize("args, verb, passed", [
    (["requeue", "77"], "requeue", None),
    (["-Q", "requeue", "77"], "requeue", None),
    (["--quiet", "requeue", "77"], "requeue", None),
    (["-v", "-o", "requeue", "77"], "requeue", None),
    (["-vQ", "requeue", "70_7"], "requeue", None),
    (["requeue", "-Q", "77"], "requeue", None),  # scontrol's getopt takes options anywhere
    (["REQUEUE", "77"], "requeue", None),
    (["requ", "JobId=77"], "requeue", None),
    (["requeue", "Incomplete", "77"], "requeue", None),
    (["requeue", "77,12"], "requeue", "requeue|12"),
    (["-Q", "requeue", "12,77,13", "14"], "requeue", "-Q|requeue|12,13,14"),
    (["requeuehold", "77"], "requeuehold", None),
    (["requeuehold", "State=SpecialExit", "77"], "requeuehold State=SpecialExit", None),
    (["-Q", "requeuehold", "state=se", "12,77"], "requeuehold State=SpecialExit", "-Q|requeuehold|state=se|12"),
])
def test_every_form_of_the_jobs_own_requeue_is_held(shim, args, verb, passed):
    run, hold = shim
    code, err, calls = run(*args)
    assert code == 0 and hold.requested(), err
    assert str(hold.verb()) == verb
    assert "held until the checkpoint is synced" in err
    assert calls == ([passed] if passed else [])  # the other jobs named with ours go to the real scontrol


@pytest.mark.parametrize("args", [
    ["requeue", "12"], ["requeue", "770"], ["requeue", "7"], ["show", "job", "77"], ["-M", "other", "requeue", "77"],
    ["--clusters=other", "requeue", "77"], ["re", "77"], ["requeueh", "77"], ["requeue"], ["hold", "77"],
    ["requeue", "Incomplete"],
])
def test_other_calls_go_to_the_real_scontrol_unchanged(shim, args):
    run, hold = shim
    code, err, calls = run(*args)
    assert calls == ["|".join(args)] and not hold.requested(), err


def test_shim_arguments_stay_data(shim, tmp_path):
    run, hold = shim
    for args in (["requeue", "77;touch x"], ["requeue", "$(touch x)", "77"], ["requeue", "*", "77"],
                 ["requeue", "77,$(touch x),*"], ["requeue", "77", "a b"]):
        run(*args)
    assert not (tmp_path / "x").exists()
    code, err, calls = run("requeue", "77,*,a b")
    assert calls == ["requeue|*,a b"]


def test_a_held_requeuehold_is_replayed_once_after_the_final_sync(tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77",), str(real))
    outcome, err, requeues = supervise(tmp_path, 'printf s > "$SLURMAGENT_CKPT_DIR/m"; '
                                                 'scontrol -Q requeuehold State=SpecialExit 77; exit 0', hold=hold)
    assert outcome.held_requeue and outcome.requeued, err
    assert requeues == [("77", "requeuehold State=SpecialExit")] and not real_log.exists()


# --- Slurm kills the wrapper during its final sync (21.17) -------------------------------------


class SlowStore:
    """A store whose final sync takes a while; Slurm's SIGCONT + SIGTERM arrive meanwhile."""

    url = "gs://b/p"
    warn = None

    def latest_manifest(self, **_):
        return None

    def sync(self, *_args, **_kw):
        os.kill(os.getpid(), signal.SIGCONT)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(0.5)
        return type("R", (), {"files_sent": 0, "bytes_sent": 0, "manifest": None})()


def test_a_kill_during_the_final_sync_is_said_first(tmp_path):
    outcome, err, _ = supervise(tmp_path, SAVER + 'kill -USR1 "$WRAPPER_PID"; while :; do sleep 0.05; done',
                                store=SlowStore())
    assert ("job 77 is being requeued/killed by Slurm during the final sync (it kills this wrapper KillWait "
            "seconds later); a framework that calls scontrol by its absolute path (e.g. /usr/bin/scontrol requeue) "
            "cannot be held") in err
    assert err.index("being requeued/killed") < err.index("final sync: 0 file(s)")  # said before the sync ended
