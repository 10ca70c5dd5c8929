"""A restore that fails on a node's own disk requeues the job without that node; a restore
fits on a disk that held the previous version (staged in place, not beside it).

The same subject without a cluster, emulator or fake server: tests/unit/test_restore_failure.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, need_tool
from test_checkpoint import KiB, MiB, write_tree  # noqa: F401
from test_checkpoint_gcs import dirs, read_tree, store  # noqa: F401 (dirs: a fixture)
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
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
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}:{REPO / 'tests' / 'unit'}", STORAGE_EMULATOR_HOST=emu.url)
    unshare = need_tool("unshare", install="apt-get install util-linux")
    return subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, str(script), str(disk), size,
                           "gs://ckpt/job1", str(tmp_path / "state.json")], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
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
