"""Checkpoint identity (issue 21 item 7): the same for every attempt of one submission, new for
every submission; a reused job id or a new Cloud Run execution never restores another job's
checkpoint, and the fence never repeats across submissions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cluster_config_text, wait_for
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.errors import ManifestError, StaleAttemptError
from slurmagent.run.identity import decide, settle
from slurmagent.run.job import JobIdentity, WrapperError

TOY = str(Path(__file__).with_name("toy_trainer.py"))
ENTRY = {"blake3": "a" * 64, "size": 1, "crc32c": "AAAAAA=="}


# --------------------------------------------------------------------------- the rules (pure)


def m(owner: str = "", attempt: int = 0) -> Manifest:
    return Manifest(attempt=attempt, files={"state": dict(ENTRY)}, owner=owner)


@pytest.mark.parametrize("current, submission, restart, per_job, action, owner", [
    (None, "s1", 0, True, "fresh", "s1"),
    (None, "", 3, True, "fresh", "NEW"),
    (m("s1", 4), "s1", 5, True, "ours", "s1"),  # a requeue of the same submission
    (m("s1", 0), "s1", 0, True, "ours", "s1"),  # attempt 0's own commit (the prefix claimed, then restarted)
    (m("s0", 7), "s1", 0, True, "foreign", "s1"),  # a reused job id / a new Cloud Run execution
    (m("s0", 7), "s1", 3, True, "foreign", "s1"),  # whatever the restart count
    (m("", 2), "s1", 1, True, "foreign", "s1"),  # no owner: not this submission's
    (m("s0", 2), "", 0, True, "foreign", "NEW"),  # plain sbatch, first attempt: an earlier job's
    (m("NEWER", 0), "", 1, True, "ours", "NEWER"),  # plain sbatch, later attempt: adopts attempt 0's claim
    (m("", 2), "", 3, True, "ours", ""),  # requeued across the upgrade: its own checkpoint, no owner
    (m("s0", 2), "s1", 0, False, "adopt", "s1"),  # an explicit --remote: the user named it, resumed
])
def test_whose_checkpoint_is_it(current, submission, restart, per_job, action, owner):
    d = decide(current, submission=submission, restart_count=restart, per_job_prefix=per_job,
               fresh_owner=lambda: "NEW")
    assert (d.action, d.owner) == (action, owner)
    if action == "foreign":
        assert "NOT restoring" in d.why


def test_owner_is_an_optional_manifest_key_and_old_manifests_stay_readable():
    old = Manifest.from_json(json.dumps({"schema": 2, "attempt": 3, "created": "2026-11-30T05:00:00Z", "files": {}}))
    assert old.owner == "" and "owner" not in json.loads(old.to_json())  # written back as before
    new = Manifest.from_json(Manifest(attempt=1, owner="a1b2").to_json())
    assert new.owner == "a1b2" and json.loads(new.to_json())["schema"] == 2
    with pytest.raises(ManifestError, match="owner"):
        Manifest.from_json(json.dumps({"schema": 2, "attempt": 0, "created": "2026-11-30T05:00:00Z", "files": {},
                                       "owner": "../x"}))


def test_submission_comes_from_slurmagent_sbatch_or_the_cloud_run_execution():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "SLURMAGENT_SUBMISSION": "f00d"}
    assert JobIdentity.from_env(slurm).submission == "f00d"
    assert JobIdentity.from_env({"SLURM_JOB_ID": "7"}).submission == ""  # plain sbatch
    run = {"CLOUD_RUN_JOB": "train", "CLOUD_RUN_TASK_INDEX": "1", "CLOUD_RUN_EXECUTION": "train-x2k9v"}
    ident = JobIdentity.from_env(run)
    assert (ident.name, ident.submission) == ("train-task-1", "train-x2k9v")
    with pytest.raises(WrapperError, match="SLURMAGENT_SUBMISSION"):
        JobIdentity.from_env({**slurm, "SLURMAGENT_SUBMISSION": "a b"})


SCRIPT_RECORDER = """#!{python}
import sys
script = next(a for a in sys.argv[1:] if a.endswith(".sh"))
with open({log!r}, "a") as fh:
    fh.write(open(script).read() + "\\0")
print("77")
"""


def test_every_slurmagent_sbatch_is_a_new_submission_whatever_its_export_option(tmp_path):
    log, recorder = tmp_path / "scripts", tmp_path / "sbatch"
    recorder.write_text(SCRIPT_RECORDER.format(python=sys.executable, log=str(log)))
    recorder.chmod(0o755)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[slurm]\nsbatch = "{recorder}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), PYTHONPATH=str(REPO), SLURMAGENT_SUBMISSION="inherited")
    for export in ("--export=ALL", "--export=NONE", "-N1"):
        proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", export, "--", "python", "t.py"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    ids = [next(line.split("=", 1)[1] for line in script.splitlines() if line.startswith("SLURMAGENT_SUBMISSION="))
           for script in log.read_text().split("\0")[:-1]]
    assert len(ids) == 3 and len(set(ids)) == 3 and "inherited" not in ids  # in the script: every attempt sees it
    assert all(JobIdentity.from_env({"SLURM_JOB_ID": "5", "SLURMAGENT_SUBMISSION": i}).submission == i for i in ids)


# --------------------------------------------------------------------------- on the emulator


@pytest.fixture
def emu(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


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
    from test_allocation import Nodes, dcp_like_checkpoint, job_store, tree

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
