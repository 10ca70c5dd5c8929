"""Checkpoint identity (issue 21 item 7): the same for every attempt of one submission, new for
every submission; a reused job id or a new Cloud Run execution never restores another job's
checkpoint, and the fence never repeats across submissions.

The same subject without a cluster, emulator or fake server: tests/unit/test_identity.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, SUPPORT, cluster_config_text, wait_for
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.errors import StaleAttemptError
from slurmagent.run.identity import settle

TOY = str(SUPPORT / "toy_trainer.py")


# --------------------------------------------------------------------------- on the emulator


def store(prefix: str, owner: str | None = None):
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    s = GcsCheckpointStore(f"gs://ckpt/{prefix}", timeout_s=5)
    s.owner = owner
    return s


def commit(prefix: str, tmp_path: Path, owner: str | None, attempt: int, content: bytes) -> Manifest:
    d = tmp_path / f"d-{time.monotonic_ns()}"
    d.mkdir()
    (d / "state").write_bytes(content)
    return store(prefix, owner).sync(d, attempt, tmp_path / f"s-{time.monotonic_ns()}.json", 30).manifest


class Attempt:
    def __init__(self, submission: str, restart_count: int):
        self.submission, self.restart_count = submission, restart_count


def test_fence_compares_attempts_within_one_submission_only(emu, tmp_path):
    commit("jobs/9", tmp_path, "old-job", 5, b"old job, attempt 5")
    lines: list[str] = []
    new = store("jobs/9")
    assert settle(new, Attempt("new-job", 0), True, lines.append) is None  # never restored
    assert "NOT restoring" in lines[0]
    # the new submission's attempt 0 commits, though the old one's restart count was higher
    assert commit("jobs/9", tmp_path, "new-job", 0, b"new job, attempt 0").owner == "new-job"
    with pytest.raises(StaleAttemptError, match="another submission"):  # the old job's writer is fenced off
        commit("jobs/9", tmp_path, "old-job", 5, b"old job, late")
    commit("jobs/9", tmp_path, "new-job", 1, b"new job, attempt 1")
    with pytest.raises(StaleAttemptError, match="attempt 1, newer than ours"):  # a zombie of attempt 0
        commit("jobs/9", tmp_path, "new-job", 0, b"new job, attempt 0, zombie")
    assert store("jobs/9").latest_manifest().owner == "new-job"
    kept = [b.name for b in store("jobs/9").objects.bucket.list_blobs(prefix="jobs/9/superseded/")]
    assert len(kept) == 1  # the old job's manifest is still reachable


def test_plain_sbatch_first_attempt_takes_the_prefix_over_and_later_attempts_adopt_it(emu, tmp_path):
    commit("jobs/10", tmp_path, "earlier", 2, b"an earlier job's")
    said: list[str] = []
    s0 = store("jobs/10")
    assert settle(s0, Attempt("", 0), True, said.append) is None
    claimed = store("jobs/10").latest_manifest()
    assert claimed.owner == s0.owner != "earlier" and claimed.files == {}  # claimed before the trainer starts
    # attempt 0 is requeued before it committed anything: attempt 1 finds the claim, not the foreign files
    s1 = store("jobs/10")
    assert settle(s1, Attempt("", 1), True, said.append) is None and s1.owner == s0.owner
    commit("jobs/10", tmp_path, s1.owner, 1, b"ours, attempt 1")
    s2 = store("jobs/10")
    got = settle(s2, Attempt("", 2), True, said.append)
    assert got is not None and got.owner == s0.owner and got.attempt == 1


def test_a_job_requeued_across_the_upgrade_restores_its_checkpoint(emu, tmp_path):
    commit("jobs/11", tmp_path, None, 1, b"written by the old version")  # no owner in it
    s = store("jobs/11")
    got = settle(s, Attempt("", 2), True, print)
    assert got is not None and got.owner == "" and got.attempt == 1
    commit("jobs/11", tmp_path, s.owner, 2, b"written by the new version")  # and commits over it


def test_an_explicit_remote_is_resumed_by_a_new_submission_which_then_owns_it(emu, tmp_path):
    commit("runs/r7", tmp_path, "monday", 5, b"monday's")
    s = store("runs/r7")
    got = settle(s, Attempt("tuesday", 0), False, print)
    assert got is not None and set(got.files) == {"state"} and got.owner == "tuesday"
    commit("runs/r7", tmp_path, "tuesday", 0, b"tuesday's")  # the restart count reset: never blocked
    with pytest.raises(StaleAttemptError, match="another submission"):
        commit("runs/r7", tmp_path, "monday", 5, b"monday's late writer")


@pytest.mark.parametrize("per_job_prefix", [True, False])
def test_a_multi_node_job_decides_once_and_its_agents_restore_only_what_it_decided(emu, tmp_path, per_job_prefix):
    from test_multinode_store_gcs import Nodes, dcp_like_checkpoint, job_store, tree

    remote = "gs://ckpt/jobs/12"
    monday = Nodes(tmp_path / "monday", 2, remote)
    old, _ = job_store(monday)
    old.owner = "monday"
    old.restore(monday.dirs[0], deadline_s=60)
    dcp_like_checkpoint(monday)
    old.sync(monday.dirs[0], 3, tmp_path / "unused", deadline_s=60)

    tuesday = Nodes(tmp_path / "tuesday", 2, remote)
    new, err = job_store(tuesday)
    manifest = settle(new, Attempt("tuesday", 0), per_job_prefix, print)  # in the batch step, once
    if per_job_prefix:
        assert manifest is None  # never restored: the agents are not even asked
    else:  # an explicit --remote: resumed; the agents find the claim's generation and restore it whole
        assert new.restore(tuesday.dirs[0], deadline_s=60).owner == "tuesday"
        assert tree(tuesday.dirs[1]) == tree(tuesday.dirs[0]) and len(tree(tuesday.dirs[1])) == 3
    dcp_like_checkpoint(tuesday, "step_2")
    result = new.sync(tuesday.dirs[0], 0, tmp_path / "unused", deadline_s=60)  # attempt 0 after monday's 3
    assert result.manifest_generation and new.latest_manifest().owner == "tuesday"
    with pytest.raises(StaleAttemptError, match="another submission"):
        old.sync(monday.dirs[0], 3, tmp_path / "unused", deadline_s=60)


# --------------------------------------------------------------------------- the wrapper as a process


def run_wrapper(tmp_path: Path, env_extra: dict, ckpt: Path, ledger: Path, steps: int, signal_at: int | None):
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 1.0\ngrace_s = 10.0\n")
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), **env_extra)
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED", "SLURMAGENT_SUBMISSION"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(ckpt), "--",
                             sys.executable, TOY, str(steps), str(ledger), "0.05"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    if signal_at is not None:
        wait_for(lambda: ledger.exists() and ledger.read_text().count("\nstep ") >= signal_at, 60, "steps")
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    return proc.returncode, err


def starts(ledger: Path) -> list[str]:
    return [line for line in ledger.read_text().splitlines() if line.startswith("start")]


def test_two_cloud_run_executions_of_one_job_never_share_a_checkpoint(emu, tmp_path):
    task = {"CLOUD_RUN_JOB": "train", "CLOUD_RUN_TASK_INDEX": "0"}
    first, second = tmp_path / "first", tmp_path / "second"
    code, err = run_wrapper(tmp_path, {**task, "CLOUD_RUN_EXECUTION": "train-aaaa1", "CLOUD_RUN_TASK_ATTEMPT": "3"},
                            tmp_path / "a", first, 1000, signal_at=10)
    assert code == 143, err
    # a new execution, same job name and task index, on a fresh instance: starts from step 0
    code, err = run_wrapper(tmp_path, {**task, "CLOUD_RUN_EXECUTION": "train-bbbb2", "CLOUD_RUN_TASK_ATTEMPT": "0"},
                            tmp_path / "b", second, 1000, signal_at=10)
    assert code == 143, err
    assert "NOT restoring the checkpoint" in err and "failed" not in err, err  # and every sync works
    assert "resumed=1" not in starts(second)[0]
    assert store("jobs/train-task-0").latest_manifest().owner == "train-bbbb2"
    # its own retry resumes its own checkpoint, not the first execution's
    code, err = run_wrapper(tmp_path, {**task, "CLOUD_RUN_EXECUTION": "train-bbbb2", "CLOUD_RUN_TASK_ATTEMPT": "1"},
                            tmp_path / "c", second, 30, signal_at=None)
    assert code == 0, err
    assert "restored checkpoint of attempt 0" in err
    assert "resumed=1" in starts(second)[1]
    with open(tmp_path / "c" / "state.json") as fh:
        assert json.load(fh)["step"] == 30


# --------------------------------------------------------------------------- on the real Slurm cluster

# Each attempt logs what its directory held at start, then checkpoints "mine-<restart>"; the
# attempt whose restart count is $2 ends by itself, the others wait for the flush.
ATTEMPT = ('echo "start restart=$SLURMAGENT_RESTART_COUNT resumed=${SLURMAGENT_RESUMED:-0} '
           'found=$(cat "$SLURMAGENT_CKPT_DIR/state" 2>/dev/null || echo none)" >> "$1"; '
           'printf "%s" "mine-$SLURMAGENT_RESTART_COUNT" > "$SLURMAGENT_CKPT_DIR/state"; '
           '[ "$SLURMAGENT_RESTART_COUNT" -ge "$2" ] && exit 0; trap "exit 0" USR1; while :; do sleep 0.1; done')
PLAIN_SCRIPT = "#!/bin/sh\n#SBATCH --requeue\nexec {python} -m slurmagent.entry run \"$@\"\n"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("submit, requeues", [("slurmagent sbatch", 2), ("plain sbatch", 1)])
def test_a_reused_job_id_never_restores_the_earlier_jobs_checkpoint_and_requeues_keep_their_own(
        slurm, emu, tmp_path, submit, requeues):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 3600\ngrace_s = 10.0\n")
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    env.pop("SLURMAGENT_SUBMISSION", None)
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    job_args = ["--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", "sh", "-c", ATTEMPT, "sh", str(ledger), str(requeues)]
    common = ["--parsable", "--hold", "-o", str(out), "--open-mode=append"]
    if submit == "slurmagent sbatch":
        argv = [sys.executable, "-m", "slurmagent.entry", "sbatch", *common, "--", *job_args]
    else:
        script = tmp_path / "job.sh"
        script.write_text(PLAIN_SCRIPT.format(python=sys.executable))
        argv = ["sbatch", *common, str(script), *job_args]
    sub = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    # The id was an earlier job's (a controller redeployed with fresh state): its checkpoint,
    # from a later attempt than any of ours, is under jobs/<id>.
    commit(f"jobs/{job_id}", tmp_path, "earlier-job", 4, b"FOREIGN")
    c.run(["scontrol", "release", job_id])
    for restart in range(requeues):
        wait_for(lambda: ledger.exists() and f"start restart={restart}" in ledger.read_text(), 120, f"attempt {restart}")
        c.run(["scancel", "--batch", "--signal=TERM", job_id])
        wait_for(lambda: int(c.job(job_id)["Restarts"]) > restart, 60, f"attempt {restart} requeued")
        if restart == 0:  # the submission id is in the job's own script, which Slurm keeps across requeues
            script = c.run(["scontrol", "write", "batch_script", job_id, "-"]).stdout
    submission = next((line.split("=", 1)[1] for line in script.splitlines()
                       if line.startswith("SLURMAGENT_SUBMISSION=")), "")
    job = c.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    log = out.read_text()
    assert job["JobState"] == "COMPLETED", log
    found = [line.split(" ", 2)[1:] for line in ledger.read_text().splitlines()]
    assert found == [[f"restart={n}", f"resumed={int(n > 0)} found={'mine-' + str(n - 1) if n else 'none'}"]
                     for n in range(requeues + 1)], log
    assert log.count("NOT restoring the checkpoint") == 1 and "failed" not in log, log
    final = store(f"jobs/{job_id}").latest_manifest()
    assert final.owner not in ("", "earlier-job") and final.attempt == requeues  # its own commits went in
    assert final.owner == submission if submit == "slurmagent sbatch" else not submission
