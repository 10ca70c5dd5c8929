"""The wrapper's requeue: the budget counts restarts without progress, the job's own requeue is
held until the final sync, exit codes and the last stderr line say what happened.

The supervisor runs in-process against a real Cloud Storage emulator; Slurm's requeue is the
injected callable (the cluster tests in test_wrapper_slurm.py use the real one).

The same subject without a cluster, emulator or fake server: tests/unit/test_wrapper_requeue.py.
"""

from __future__ import annotations

import time


from slurmagent.run.child import RequeueHold
from slurmagent.run.supervisor import EXIT_FLUSHED, EXIT_REQUEUE_REFUSED
from test_wrapper_requeue import attempt, fake_scontrol, Requeues


def test_six_progressing_attempts_are_all_requeued(emu, tmp_path):
    requeues = Requeues()
    for restart in range(6):  # SLURM_RESTART_COUNT 0..5, each attempt on another node
        outcome, err = attempt(tmp_path, restart, f"step {restart * 100}", max_requeues=1, requeues=requeues)
        assert outcome.exit_code == EXIT_FLUSHED and outcome.requeued, err
        assert outcome.no_progress == 0
        assert outcome.resumed == (restart > 0)
    assert requeues == ["77"] * 6
    assert "it made progress" in err


def test_attempts_without_progress_stop_within_max_requeues_plus_one(emu, tmp_path):
    requeues = Requeues()
    outcome, _ = attempt(tmp_path, 0, "step 100", requeues=requeues)  # progress: a first checkpoint
    assert outcome.requeued and outcome.no_progress == 0
    codes = []
    for restart in range(1, 10):
        outcome, err = attempt(tmp_path, restart, "", requeues=requeues)  # restores, adds nothing
        codes.append(outcome.exit_code)
        if not outcome.requeued:
            break
    assert codes == [EXIT_FLUSHED] * 3 + [EXIT_REQUEUE_REFUSED]  # --max-requeues 3: the 4th stops
    assert outcome.no_progress == 4 and len(requeues) == 4
    assert "not requeueing job 77: 4 attempts in a row committed no new checkpoint (--max-requeues 3)" in err
    assert outcome.summary.startswith(f"exit {EXIT_REQUEUE_REFUSED}: ") and "NOT requeued" in outcome.summary


def test_progress_resets_the_streak(emu, tmp_path):
    requeues = Requeues()
    for restart, content in enumerate(["a", "", "", "b", "", "", "c"]):
        outcome, err = attempt(tmp_path, restart, content, max_requeues=2, requeues=requeues)
        assert outcome.requeued, (restart, err)
    assert attempt(tmp_path, 7, "", max_requeues=2)[0].no_progress == 1  # counted again from 0


def test_a_job_that_never_checkpoints_stops_within_max_requeues_plus_one(emu, tmp_path):
    results = [attempt(tmp_path, restart, "", max_requeues=2)[0] for restart in range(3)]
    assert [o.requeued for o in results] == [True, True, False]
    assert results[-1].exit_code == EXIT_REQUEUE_REFUSED


def test_requeue_refused_by_slurm_is_exit_75_and_said_last(emu, tmp_path):
    requeues = Requeues()
    requeues.refuse = "Requested operation is presently disabled"
    outcome, err = attempt(tmp_path, 0, "a", requeues=requeues)
    assert outcome.exit_code == EXIT_REQUEUE_REFUSED and not outcome.requeued
    assert "presently disabled" in outcome.summary and outcome.synced


def test_child_exit_code_summary_and_final_sync(emu, tmp_path):
    outcome, err = attempt(tmp_path, 0, "", flush=False,
                           cmd=["sh", "-c", 'echo x > "$SLURMAGENT_CKPT_DIR/m.pt"; exit 7'])
    assert outcome.exit_code == 7 and outcome.synced and not outcome.flushed
    assert outcome.summary == "exit 7: the job's own exit code (it ended by itself)"


# --- the job's own `scontrol requeue`, held --------------------------------------------------


# Lightning's SIGUSR1 handler in sh: save, `scontrol requeue $SLURM_JOB_ID`, then GO ON training.
# It ignores the wrapper's SIGTERM (sent as soon as the requeue is held, maybe before the trap's
# echo ran) and trains on, as Lightning does after requeueing itself: the wrapper's KILL ends it.
SELF_REQUEUER = ('trap "" TERM; trap \'printf saved > "$SLURMAGENT_CKPT_DIR/hpc_ckpt_1.ckpt"; scontrol requeue 77; '
                 'echo "requeue rc=$?" >> "$2"\' USR1; scontrol show job 77 >> "$2"; : > "$1"; '
                 'while :; do sleep 0.02; done')


def test_own_requeue_is_held_child_stopped_without_waiting_grace_requeued_once(emu, tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77",), str(real))
    ready, log = tmp_path / "ready", tmp_path / "child.log"
    requeues = Requeues()
    started = time.monotonic()
    outcome, err = attempt(tmp_path, 0, "", requeues=requeues, hold=hold, grace_s=600, ready=ready,
                           cmd=["sh", "-c", SELF_REQUEUER.replace('"$1"', str(ready)).replace('"$2"', str(log)),
                                "sh", str(ready), str(log)])
    assert time.monotonic() - started < 600  # not the grace: stopped once it asked for its requeue
    assert outcome.held_requeue and outcome.requeued and requeues == ["77"], err
    assert outcome.exit_code == EXIT_FLUSHED and outcome.synced
    assert "requeue rc=0" in log.read_text()  # the trainer was told its requeue worked
    assert real_log.read_text().splitlines() == ["show job 77"]  # other subcommands pass through; no requeue
    assert "asked for its requeue" in err and "stopping the job" in err
    assert not hold.dir.exists()  # cleaned up


def test_a_trainer_that_requeues_itself_unasked_is_flushed_once(emu, tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77", "70_7"), str(real))
    requeues = Requeues()
    cmd = ["sh", "-c", 'printf s > "$SLURMAGENT_CKPT_DIR/step"; scontrol requeue 70_7; scontrol requeue 70_7; '
           'scontrol requeue 12; exit 0']
    outcome, err = attempt(tmp_path, 0, "", requeues=requeues, hold=hold, flush=False, cmd=cmd)
    assert outcome.flush_cause == "the job requeued itself" and outcome.held_requeue
    assert requeues == ["77"] and outcome.exit_code == EXIT_FLUSHED
    assert real_log.read_text().splitlines() == ["requeue 12"]  # another job's requeue is not ours to hold
