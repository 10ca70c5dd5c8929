"""Checkpoint identity (issue 21 item 7): the same for every attempt of one submission, new for
every submission; a reused job id or a new Cloud Run execution never restores another job's
checkpoint, and the fence never repeats across submissions.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_identity_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.errors import ManifestError
from slurmagent.run.identity import decide
from slurmagent.run.job import JobIdentity, WrapperError

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
