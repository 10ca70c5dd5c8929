"""The wrapper's signals on the real cluster: SIGTERM to trainer and wrapper together (a node
shutdown) requeues, a user's plain `scancel` never does (20 tries each), a requeue asked while
slurmctld is down is retried until it comes back, and the job's own `scontrol -Q requeuehold
State=SpecialExit OURS,OTHER` is held and replayed once. No bucket: the checkpoint directory is
shared by the nodes of this one host, which keeps each try short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, cluster_config_text, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# The checkpoint_handler recipe (docs/user/recipes/) in sh: on SIGTERM or SIGUSR1 save and exit 0 at once
# (`wait` is interrupted by a trapped signal); "$1" gets "TRAINER_PID WRAPPER_PID" when it runs.
SAVER = ('trap \'printf saved > "$SLURMAGENT_CKPT_DIR/state"; exit 0\' TERM USR1; '
         'echo "$$ $PPID" > "$1.tmp"; mv "$1.tmp" "$1"; while :; do sleep 5 & wait $!; done')


def submit(slurm, tmp_path: Path, name: str, cmd: list[str], run_opts: tuple[str, ...] = ()) -> tuple[str, Path]:
    """`slurmagent sbatch` of CMD (no bucket); returns (job id, its output file)."""
    c = slurm.cluster
    config = tmp_path / "c.toml"
    if not config.exists():
        config.write_text(cluster_config_text(slurm.root))
    out = tmp_path / f"{name}.out"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO))
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out),
                          "--open-mode=append", "--", "--grace", "5", *run_opts, "--ckpt-dir",
                          str(tmp_path / f"{name}.ckpt"), "--", *cmd], env=env, capture_output=True, text=True,
                         timeout=30)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0], out


def summary(out: Path) -> str | None:
    """The wrapper's last line (`slurmagent run: exit N: ...`); Slurm may write after it."""
    lines = [l for l in out.read_text().splitlines() if l.startswith("slurmagent run: exit ")] if out.exists() else []
    return lines[-1] if lines else None


def pids(ready: Path) -> tuple[int, int] | None:
    try:
        trainer, wrapper = ready.read_text().split()
        return int(trainer), int(wrapper)
    except (OSError, ValueError):
        return None


def in_batches(total: int, size: int):
    for start in range(0, total, size):
        yield range(start, min(start + size, total))


def test_sigterm_to_trainer_and_wrapper_together_requeues_20_of_20(slurm, tmp_path):
    c, lines = slurm.cluster, {}
    for batch in in_batches(20, 5):
        jobs = {}
        for i in batch:
            ready = tmp_path / f"ready-{i}"
            jobs[i] = (*submit(slurm, tmp_path, f"a{i}", ["sh", "-c", SAVER, "sh", str(ready)]), ready)
        for i, (job_id, out, ready) in jobs.items():
            trainer, wrapper = wait_for(lambda: pids(ready), 120, f"job {job_id} to start")
            # a node shutdown signals every process, in no order the job can know
            for pid in ((trainer, wrapper) if i % 2 else (wrapper, trainer)):
                os.kill(pid, signal.SIGTERM)
        for i, (job_id, out, _) in jobs.items():
            lines[job_id] = wait_for(lambda: summary(out), 60, f"job {job_id}'s last line")
        c.run(["scancel", *(job_id for job_id, _, _ in jobs.values())])
    wrong = {j: line for j, line in lines.items() if line != f"slurmagent run: exit 143: checkpoint flushed, job {j} requeued"}
    assert not wrong, wrong
    assert all("saved" == (tmp_path / f"a{i}.ckpt" / "state").read_text() for i in range(20))


def test_a_users_scancel_never_requeues_20_of_20(slurm, tmp_path):
    c, ends = slurm.cluster, {}
    for batch in in_batches(20, 5):
        jobs = {}
        for i in batch:
            ready = tmp_path / f"ready-{i}"
            jobs[i] = (*submit(slurm, tmp_path, f"b{i}", ["sh", "-c", SAVER, "sh", str(ready)]), ready)
        for job_id, out, ready in jobs.values():
            wait_for(lambda: pids(ready), 120, f"job {job_id} to start")
            c.run(["scancel", job_id])
        for job_id, out, _ in jobs.values():
            job = wait_for(lambda: (lambda j: j if j["JobState"] not in ("RUNNING", "COMPLETING") else None)(c.job(job_id)),
                           60, f"job {job_id} to end")
            ends[job_id] = (job["JobState"], job["Restarts"], summary(out), out.read_text())
    requeued = {j: e for j, e in ends.items() if e[:2] != ("CANCELLED", "0") or "requeued job" in e[3]}
    assert not requeued, requeued
    # Slurm SIGKILLs a wrapper still busy KillWait (5 s) after the scancel: its line may be missing
    lines = {job_id: line for job_id, (_, _, line, _) in ends.items() if line}
    assert lines and all(line.startswith(f"slurmagent run: exit 75: checkpoint flushed, job {job_id} NOT requeued: "
                                         "Slurm is ending it (JobState=") for job_id, line in lines.items()), lines


# Each attempt: "start restart=N resumed=R pid=WRAPPER" to LEDGER, a checkpoint, then waits;
# SIGUSR1 (the wrapper's checkpoint signal) ends it cleanly.
ATTEMPT = ('echo "start restart=$SLURMAGENT_RESTART_COUNT resumed=${SLURMAGENT_RESUMED:-0} pid=$PPID" >> "$1"; '
           'printf "%s" "$SLURMAGENT_RESTART_COUNT" > "$SLURMAGENT_CKPT_DIR/state"; trap "exit 0" USR1 TERM; '
           'while :; do sleep 5 & wait $!; done')


def test_a_requeue_while_slurmctld_is_down_is_retried_and_the_job_resumes(slurm, tmp_path):
    c = slurm.cluster
    ledger = tmp_path / "ledger"
    job_id, out = submit(slurm, tmp_path, "c", ["sh", "-c", ATTEMPT, "sh", str(ledger)])
    first = wait_for(lambda: ledger.exists() and ledger.read_text().splitlines(), 120, "attempt 0")[0]
    wrapper = int(first.rsplit("pid=", 1)[1])
    c.stop_ctld()
    try:
        os.kill(wrapper, signal.SIGTERM)
        time.sleep(15)
    finally:
        c.restart_ctld()  # the same state (no -c): the job is still RUNNING there
    wait_for(lambda: "start restart=1 resumed=1" in ledger.read_text(), 180, "attempt 1, resumed")
    c.run(["scancel", job_id])
    log = out.read_text()
    assert log.count(f"requeued job {job_id} (restart 1") == 1, log
    # scontrol's own connect retries may span the outage; the waits between tries are said
    # (test_wrapper_signals.py::test_requeue_is_retried_with_backoff_until_slurmctld_answers)
    assert f"exit 143: checkpoint flushed, job {job_id} requeued" in log
    assert [l.split(" pid=")[0] for l in ledger.read_text().splitlines()] == ["start restart=0 resumed=0",
                                                                           "start restart=1 resumed=1"]


# Lightning-like: checkpoint, requeue itself and another job in one call, in a form the old
# shim let through, then go on training (the wrapper stops it).
SELF_REQUEUE = ('printf saved > "$SLURMAGENT_CKPT_DIR/state"; '
                'scontrol -Q requeuehold State=SpecialExit "$SLURM_JOB_ID,$1"; echo "rc=$?" > "$2"; '
                'trap "" TERM; while :; do sleep 0.1; done')


def test_the_jobs_own_requeuehold_of_itself_and_another_is_held_and_replayed_once(slurm, tmp_path):
    c = slurm.cluster
    other = c.sbatch("--requeue", "-o", "/dev/null", "--wrap", "sleep 300")
    c.wait_job(other, ("RUNNING",), 60)
    rc = tmp_path / "rc"
    job_id, out = submit(slurm, tmp_path, "d", ["sh", "-c", SELF_REQUEUE, "sh", other, str(rc)])
    line = wait_for(lambda: summary(out), 120, "the wrapper's last line")
    assert line == f"slurmagent run: exit 143: checkpoint flushed, job {job_id} requeued", out.read_text()
    assert rc.read_text().strip() == "rc=0"  # the trainer was told it worked
    log = out.read_text()
    assert f"slurmagent: requeuehold of job {job_id} held until the checkpoint is synced" in log
    mine = wait_for(lambda: (lambda j: j if j["JobState"] not in ("RUNNING", "COMPLETING") else None)(c.job(job_id)),
                    60, "the job to leave")
    assert held_special_exit(mine) and mine["Restarts"] == "1", mine  # requeued held, once
    theirs = wait_for(lambda: (lambda j: j if j["JobState"] not in ("RUNNING", "COMPLETING") else None)(c.job(other)),
                      60, "the other job to leave")
    assert held_special_exit(theirs) and theirs["Restarts"] == "1", theirs  # by the real scontrol, at once


def held_special_exit(job: dict) -> bool:
    """`requeuehold State=SpecialExit` done: SPECIAL_EXIT (22.05), or PENDING held on another version."""
    return job["JobState"] == "SPECIAL_EXIT" or (job["JobState"] == "PENDING" and "held" in job["Reason"].lower())
