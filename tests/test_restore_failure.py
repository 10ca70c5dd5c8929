"""A restore that fails on a node's own disk requeues the job without that node; a restore
fits on a disk that held the previous version (staged in place, not beside it)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from test_checkpoint import KiB, MiB, dirs, emu, read_tree, store, write_tree  # noqa: F401
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.errors import NodeDiskError
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.restore_failure import no_progress_streak
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import EXIT_FLUSHED, EXIT_REQUEUE_REFUSED, Supervisor


# --------------------------------------------------------------- staging: old + new never both on disk

RESTORE_ON_SMALL_DISK = """
import os, subprocess, sys
disk, size, url, state = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", disk], check=True)
from test_checkpoint import write_tree
write_tree(__import__("pathlib").Path(disk) / "ckpt", {f"shard-{i}.pt": bytes([i]) * (1 << 20) for i in range(4)})
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
try:
    GcsCheckpointStore(url, timeout_s=5).restore(os.path.join(disk, "ckpt"), state_file=state)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
import hashlib
for name in sorted(os.listdir(os.path.join(disk, "ckpt"))):
    print(name, hashlib.sha256(open(os.path.join(disk, "ckpt", name), "rb").read()).hexdigest())
"""


def restore_on_a_disk_of(size: str, tmp_path: Path, emu) -> subprocess.CompletedProcess:
    """Restore gs://ckpt/job1 onto a tmpfs of `size` (private mount namespace: nothing leaks out)
    that already holds the previous version, four 1 MiB shards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "restore.py"
    script.write_text(RESTORE_ON_SMALL_DISK)
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", STORAGE_EMULATOR_HOST=emu.url)
    return subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(script), str(disk), size,
                           "gs://ckpt/job1", str(tmp_path / "state.json")], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a tmpfs")
def test_a_disk_that_held_the_previous_version_takes_the_new_one(emu, dirs, tmp_path):
    new = {f"shard-{i}.pt": os.urandom(1 << 20) for i in range(3)}
    new["shard-3.pt"] = bytes([3]) * (1 << 20)  # unchanged since the previous version: kept in place
    write_tree(dirs.ckpt, new)
    store().sync(dirs.ckpt, 1, dirs.state, 30)
    # 4 MiB held, 4.5 MiB of disk: the new version fits only if old bytes go before new ones come
    got = restore_on_a_disk_of("4608k", tmp_path, emu)
    assert got.returncode == 0, got.stdout + got.stderr
    import hashlib

    assert got.stdout.split() == [x for name in sorted(new) for x in (name, hashlib.sha256(new[name]).hexdigest())]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a tmpfs")
def test_a_disk_too_small_for_the_checkpoint_is_a_node_disk_error(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {f"shard-{i}.pt": os.urandom(2 << 20) for i in range(4)})  # 8 MiB: cannot fit
    store().sync(dirs.ckpt, 1, dirs.state, 30)
    got = restore_on_a_disk_of("4608k", tmp_path, emu)
    assert got.returncode == 3 and got.stdout.startswith("NodeDiskError: cannot restore into"), got.stdout + got.stderr
    assert "No space left on device" in got.stdout


def test_files_already_holding_their_content_are_kept_in_place(emu, dirs):
    files = {"a.pt": os.urandom(2 * MiB), "b.pt": os.urandom(2 * MiB)}
    write_tree(dirs.ckpt, files)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.restore, {"a.pt": files["a.pt"], "b.pt": os.urandom(2 * MiB)})
    kept = (dirs.restore / "a.pt").stat().st_ino
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == files
    assert (dirs.restore / "a.pt").stat().st_ino == kept  # not downloaded again


# --------------------------------------------------------------- the wrapper: requeued without the node


class Requeues(list):
    def __call__(self, job: str) -> None:
        self.append(job)


def supervise_a_restore_into(ckpt: Path, restart_count: int, max_requeues: int = 3):
    requeues, excluded, err = Requeues(), [], io.StringIO()
    opts = RunOptions(cmd=["touch", str(ckpt.parent / "started")], ckpt_dir=ckpt, remote="gs://ckpt/job1",
                      max_requeues=max_requeues)
    sup = Supervisor(opts, JobIdentity("slurm", "77", "77", restart_count, ("77",)),
                     GcsCheckpointStore(opts.remote, timeout_s=5), requeues, {"SLURMD_NODENAME": "n2"}, err=err)

    class Slurm:
        def excluded_nodes(self, job):
            return ["n7"]

        def exclude_nodes(self, job, nodes, keep=()):
            excluded.append((job, nodes, keep))
            return sorted({*keep, *nodes})

    sup.slurm_nodes = Slurm()
    return sup, sup.run(), requeues, excluded, err.getvalue()


def test_a_checkpoint_dir_that_is_a_file_on_this_node_requeues_the_job_without_the_node(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"model.pt": os.urandom(KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    bad = tmp_path / "n2" / "ckpt"
    bad.parent.mkdir()
    bad.write_text("not a directory")  # the node's path is unusable
    _, outcome, requeues, excluded, err = supervise_a_restore_into(bad, restart_count=1)
    assert not (tmp_path / "n2" / "started").exists()
    assert requeues == ["77"] and excluded == [("77", ["n2"], ["n7"])] and outcome.exit_code == EXIT_FLUSHED, err
    assert "restore failed on n2" in err and "will not run on n2 again (ExcNodeList=n2,n7)" in err
    assert "without progress 1 of at most 3" in err


def test_restore_failures_spend_the_requeue_budget(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"model.pt": os.urandom(KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    bad = tmp_path / "n2" / "ckpt"
    bad.parent.mkdir()
    bad.write_text("x")
    # attempts 1-3 could not restore either (on other nodes): attempt 4 is the 4th without progress
    _, outcome, requeues, excluded, err = supervise_a_restore_into(bad, restart_count=4, max_requeues=3)
    assert requeues == [] and excluded == [] and outcome.exit_code == EXIT_REQUEUE_REFUSED, err
    assert "4 attempts in a row committed no new checkpoint" in err


def test_the_no_progress_streak_of_an_attempt_that_could_not_restore():
    m = Manifest(attempt=2, no_progress=1)
    assert [no_progress_streak(m, r) for r in (3, 4, 5)] == [2, 3, 4]
    assert no_progress_streak(None, 0) == 1


def test_a_node_disk_error_of_the_agents_names_their_nodes():
    exc = NodeDiskError("restore failed on n3 (node index 1): ...", nodes=["n3"])
    from slurmagent.run.restore_failure import failed_nodes

    assert failed_nodes(exc, {"SLURMD_NODENAME": "n1"}) == ["n3"]
    assert failed_nodes(OSError(28, "No space left on device"), {"SLURMD_NODENAME": "n1"}) == ["n1"]
    assert failed_nodes(ConnectionResetError(104, "reset"), {"SLURMD_NODENAME": "n1"}) == []


def test_exclude_nodes_keeps_the_nodes_a_job_already_excludes():
    import subprocess as sp

    from slurmagent.errors import SlurmError
    from slurmagent.slurm.commands import Slurm

    calls = []

    def runner(argv, timeout):
        calls.append(argv)
        return sp.CompletedProcess(argv, 0, "n4\n" if argv[0] == "squeue" else "", "")

    slurm = Slurm(runner=runner)
    assert slurm.excluded_nodes("77") == ["n4"] and calls[-1][-2:] == ["-o", "%x"]
    assert slurm.exclude_nodes("77", ["n1"], keep=["n4"]) == ["n1", "n4"]
    assert calls[-1] == ["scontrol", "update", "JobId=77", "ExcNodeList=n[1,4]"]
    with pytest.raises(SlurmError):
        slurm.exclude_nodes("77", ["n1,n2"])  # never a hostlist smuggled in a name


def test_the_exclusion_is_tried_again_while_slurm_refuses_it_for_a_moment():
    from slurmagent.errors import SlurmError
    from slurmagent.run.restore_failure import exclude_with_retries

    answers = [SlurmError("scontrol update JobId=77: failed"), SlurmError("failed"), ["n1"]]

    def exclude(job, nodes):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    now = [0.0]
    assert exclude_with_retries(exclude, "77", ["n1"], sleep=lambda s: now.__setitem__(0, now[0] + s),
                                clock=lambda: now[0]) == ["n1"]
    with pytest.raises(SlurmError):  # never past its deadline
        exclude_with_retries(lambda j, n: (_ for _ in ()).throw(SlurmError("no")), "77", ["n1"], deadline_s=3,
                             sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])


def test_an_explicit_ckpt_dir_this_node_cannot_hold_is_left_to_the_restore_under_slurm(tmp_path):
    """A file where `--ckpt-dir` should be is this node's problem: a Slurm job gets as far as the
    restore (which requeues it without the node); a plain run is refused in one line. A refusal of
    another user's directory stays a refusal either way (tests/test_ckpt_dirs.py)."""
    from slurmagent.state.config import Config
    from slurmagent.run.job import WrapperError
    from slurmagent.run.main import build_options

    bad = tmp_path / "ckpt"
    bad.write_text("not a directory")
    slurm_env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "TMPDIR": str(tmp_path)}
    opts = build_options(Config(), ["true"], slurm_env, JobIdentity.from_env(slurm_env), ckpt_dir=str(bad))
    assert opts.ckpt_dir == bad and bad.is_file()
    with pytest.raises(WrapperError, match="Not a directory"):
        build_options(Config(), ["true"], {"TMPDIR": str(tmp_path)}, JobIdentity.from_env({}), ckpt_dir=str(bad))
