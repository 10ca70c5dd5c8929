"""A default install: the wrapped job runs as its user (not root), the node's state dir is
root's alone, and the job's checkpoint lag still reaches the node's metrics, through `watch`'s
channel (actions/job_channel.py). The channel's judgement without a cluster:
tests/unit/test_job_channel.py.

Its own one-node cluster under a directory every user may traverse: the session cluster's
spool lies under pytest's root-only temp dir, where slurmd cannot start another user's script.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import REPO, cluster_config_text, need_slurm, wait_for
from slurmagent.devtools.localcluster import LocalSlurmCluster
from test_watch_slurm import WatchProcess
from test_wrapper_slurm import TOY

LAG = "slurmagent_checkpoint_lag_seconds"
AGE = "slurmagent_checkpoint_age_seconds"


def lag_series(textfile: Path, name: str = LAG) -> dict[str, float]:
    """job id -> value of the job's `name` series in the node's textfile (none when it is absent)."""
    if not textfile.exists():
        return {}
    return {s.labels["job_id"]: s.value for fam in text_string_to_metric_families(textfile.read_text())
            for s in fam.samples if s.name == name}


def python_for(user: str) -> tuple[str, str]:
    """(interpreter, PYTHONPATH) with which `user` runs this checkout: this interpreter, or
    where it lies under a directory the user cannot enter (a pyenv under /root), the system's
    python of the same version with this environment's packages on the path."""
    import site
    import sysconfig

    def runs(exe: str, path: str) -> bool:
        return subprocess.run(["runuser", "-u", user, "--", exe, "-c", "import slurmagent, google.cloud.storage"],
                              env=dict(os.environ, PYTHONPATH=path), capture_output=True, timeout=60).returncode == 0

    if runs(sys.executable, str(REPO)):
        return sys.executable, str(REPO)
    path = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], *site.getsitepackages()])
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system and runs(system, path):
        return system, path
    pytest.skip(f"user {user} can run neither {sys.executable} nor a system python3 with this environment's packages")


@pytest.fixture
def open_cluster(emu):
    need_slurm()
    if os.geteuid() != 0:
        pytest.skip("submits a job as another user: needs root")
    base = Path(tempfile.mkdtemp(prefix="sa-chan", dir="/tmp"))
    base.chmod(0o755)
    c = LocalSlurmCluster(base / "slurm", nodes=["n1"])
    try:
        c.start()
        yield base, c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_of_another_user_shows_its_checkpoint_lag_through_the_watch(open_cluster, emu):
    base, c = open_cluster
    user = pwd.getpwnam("nobody")
    state = base / "state" / "n1"
    state.mkdir(parents=True)
    state.chmod(0o700)  # root's alone, as the package installs it
    (base / "kern").mkdir()
    (base / "kern" / "n1.log").touch()
    mine = base / "job"  # what the job's user writes: its output, steps, checkpoint
    mine.mkdir()
    os.chown(mine, user.pw_uid, user.pw_gid)
    config = base / "c.toml"  # the socket under base/run/n1: as /run/slurmagent on a real node
    config.write_text(cluster_config_text(base) + '[checkpoint]\nremote = "gs://ckpt/chan"\nsync_interval_s = 1.0\n')
    config.chmod(0o644)
    python, pythonpath = python_for("nobody")
    w = WatchProcess(SimpleNamespace(cluster=c, config=config), "n1").start()
    try:
        steps, out = mine / "steps", mine / "out"
        env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=pythonpath, STORAGE_EMULATOR_HOST=emu.url)
        sub = subprocess.run(  # the batch script starts the wrapper with the interpreter that submitted it
            [python, "-m", "slurmagent.entry", "sbatch", "--parsable", f"--uid={user.pw_uid}",
             f"--gid={user.pw_gid}", "-o", str(out), "--", "--ckpt-dir", str(mine / "ckpt"),
             "--", python, TOY, "300", str(steps), "0.05"],
            env=env, capture_output=True, text=True, timeout=30)
        assert sub.returncode == 0, sub.stderr

        def seen() -> str:
            return f"job output:\n{out.read_text() if out.exists() else ''}\nwatch:\n{w.stderr()}"

        job_id = sub.stdout.strip().split(";")[0]
        try:
            job = wait_for(lambda: (lambda j: j if j["JobState"] != "PENDING" else None)(c.job(job_id)), 60,
                           "the job's start")
            assert job["JobState"] == "RUNNING" and job["UserId"].startswith("nobody"), (job, seen())
            textfile = state / "slurmagent.prom"
            try:
                wait_for(lambda: lag_series(textfile).get(job_id) is not None, 60, f"the lag of job {job_id}")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{seen()}") from None
            assert lag_series(textfile)[job_id] >= 0
            # the newest committed checkpoint's age: there once a round committed, seconds old
            age = wait_for(lambda: lag_series(textfile, AGE).get(job_id), 60, f"the checkpoint age of job {job_id}")
            assert 0 < age < 60, (age, seen())
            assert c.job(job_id)["JobState"] == "RUNNING"  # seen while the job ran
            job = c.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"), 120)
            assert job["JobState"] == "COMPLETED", seen()
            assert job_id not in lag_series(textfile), textfile.read_text()  # its series end with it
            assert job_id not in lag_series(textfile, AGE), textfile.read_text()
            assert "did not take this job's figures" not in seen(), seen()
        finally:
            c.run(["scancel", job_id], check=False)
    finally:
        w.close()
