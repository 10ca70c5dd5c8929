"""Root trusts nothing a user wrote: the config every root command reads, the files in the state
dir, the interpreter's module path, the text of a job's record and batch script, and another
node's expiry state.

scontrol is the recording script of test_hostile (every call is checked); a user's "scontrol"
creates MARK, so a MARK on disk means root ran something a user controls.

The same subject without a cluster, emulator or fake server: tests/unit/test_root_trust.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support import REPO, wait_for
from test_root_trust import FORGED, expiry_text


# --- on the real cluster: a job's comment steers neither the prolog guard nor the release watcher


@pytest.mark.slurm
def test_a_forged_time_limit_in_a_comment_does_not_keep_a_long_job_on_an_expiring_node(slurm):
    c = slurm.cluster
    state = slurm.state_dir("n1") / "expiry.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    job = None
    try:
        state.write_text(expiry_text(1800))  # 30 min left; the job asks for 2 h
        for n in ("n2", "n3"):
            c.run(["scontrol", "update", f"nodename={n}", "state=drain", "reason=test: keep off"])
        job = c.sbatch("-w", "n1", "-t", "120", "-o", "/dev/null", f"--comment=x {FORGED}", "--wrap", "true")
        wait_for(lambda: [d for d in slurm.decisions("n1") if d.get("job") == job], 30, "the prolog's decision")
        decision = [d for d in slurm.decisions("n1") if d.get("job") == job][0]
        assert decision["verdict"] == "expiry" and re.search(r"time limit 0?2:00:00 ", decision["detail"]), decision
        wait_for(lambda: c.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip() == "PENDING", 30, "the requeue")
        assert "DRAIN" in c.node("n1")["State"]
    finally:
        state.unlink(missing_ok=True)
        if job:
            c.run(["scancel", job], check=False)


@pytest.mark.slurm
def test_a_forged_state_in_a_comment_does_not_stop_the_release_watcher(slurm):
    """The watcher releases a job Slurm holds; a comment saying `JobState=RUNNING Restarts=1`
    (which would make it give up) or `Reason=JobHeldAdmin` changes nothing."""
    c = slurm.cluster
    job = c.sbatch("-H", "-t", "5", "-o", "/dev/null", "--comment=x JobState=RUNNING Reason=None Restarts=1",
                   "--wrap", "true")
    try:
        env = dict(c.env, SLURMAGENT_CONFIG=str(slurm.config), PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, "-P", "-m", "slurmagent.entry", "release-held", job, "--deadline", "20"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        # (squeue's state: the harness's own scontrol parser would believe the comment)
        wait_for(lambda: c.run(["squeue", "-h", "-j", job, "-t", "all", "-o", "%T"]).stdout.strip() == "COMPLETED",
                 60, "the released job to run")
    finally:
        c.run(["scancel", job], check=False)
