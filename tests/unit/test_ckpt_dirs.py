"""Whose files a job starts from: every directory it uses is the user's own (an explicit
`--ckpt-dir` included, and the files beside it), the requeue hold is private, and files that
are not this job's checkpoint (an earlier job's at the same path, an abandoned step) are moved
to `<dir>.uncommitted/` before the trainer starts: never shown to it, never uploaded.

Another user is `nobody`, acting in a forked child (`as_user`); the node agents run in this
process (their srun step is covered in test_multinode_dirs.py).

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_ckpt_dirs_gcs.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurmagent.run.child import RequeueHold
from slurmagent.run.node_agent import agent_restore
from test_wrapper_hardening import CLOUD_RUN, NOBODY, as_user, run_cli, shared_tmp  # noqa: F401 - fixture
from support import uncommitted_tree
from test_wrapper_requeue import attempt

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")

# The trainer says what it was shown, then writes its own checkpoint.
SHOWN = ('ls -A "$SLURMAGENT_CKPT_DIR" > "$1"; echo "${SLURMAGENT_RESUMED:-0}" >> "$1"; '
         'cat "$SLURMAGENT_CKPT_DIR/model.pt" >> "$1" 2>/dev/null; echo mine > "$SLURMAGENT_CKPT_DIR/model.pt"')


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def aside(d: Path) -> Path:
    return Path(str(d) + ".uncommitted")


# --- 21.4: an explicit --ckpt-dir follows the default directory's rules ----------------------


def plant(shared: Path, how: str) -> Path:
    """Another user (or a careless mode) prepares the victim's `--ckpt-dir` in a shared parent."""
    ckpt = shared / "ckpt"

    def as_nobody() -> None:
        if how == "foreign-0777":
            ckpt.mkdir()
            ckpt.chmod(0o777)
            (ckpt / "model.pt").write_text("planted")
        elif how == "symlink":
            (shared / "theirs").mkdir(mode=0o777)
            os.symlink(shared / "theirs", ckpt)
        elif how == "foreign-uncommitted":
            aside(ckpt).mkdir(mode=0o777)
        elif how == "foreign-hash-cache":
            Path(str(ckpt) + ".sync-state.json").write_text('{"version": 2, "files": {}}')

    assert as_user(NOBODY, as_nobody) == ""
    if how == "own-group-writable":
        ckpt.mkdir()
        ckpt.chmod(0o770)
    return ckpt


@needs_root
@pytest.mark.parametrize("how", ["foreign-0777", "symlink", "own-group-writable", "foreign-uncommitted",
                                 "foreign-hash-cache"])
def test_an_explicit_ckpt_dir_another_user_could_plant_or_read_is_refused_in_one_line(tmp_path, shared_tmp, how):
    ckpt = plant(shared_tmp, how)
    shown = tmp_path / "shown"
    proc = run_cli(tmp_path, ["run", "--ckpt-dir", str(ckpt), "--", "sh", "-c", SHOWN, "sh", str(shown)], CLOUD_RUN)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "refusing" in proc.stderr, proc.stderr
    assert not shown.exists()  # the trainer never started: nothing loaded, nothing written there
    if how == "foreign-0777":
        assert tree(ckpt) == {"model.pt": "planted"}


def test_an_explicit_ckpt_dir_is_created_private_with_its_parents(tmp_path, shared_tmp):
    ckpt = shared_tmp / "a" / "ckpt"
    proc = run_cli(tmp_path, ["run", "--ckpt-dir", str(ckpt), "--", "true"], CLOUD_RUN)
    assert proc.returncode == 0, proc.stderr
    assert (ckpt.stat().st_mode & 0o777) == 0o700 and ckpt.stat().st_uid == os.geteuid()


@needs_root
def test_a_node_agent_refuses_a_planted_dir_and_a_foreign_private_parent(tmp_path, shared_tmp):
    ckpt = plant(shared_tmp, "foreign-0777")
    report = agent_restore(None, ckpt, index=1, node="v1", num_nodes=2, generation=0, scope="all", deadline_s=10)
    assert not report.ok and "refusing checkpoint dir" in report.error and "owned by uid 65534" in report.error
    assert tree(ckpt) == {"model.pt": "planted"}
    # the requeue hold's path on this node: its per-user parent planted by nobody
    theirs = shared_tmp / f"slurmagent-{os.geteuid()}"
    assert as_user(NOBODY, lambda: theirs.mkdir(mode=0o777)) == ""
    report = agent_restore(None, tmp_path / "ckpt", index=1, node="v1", num_nodes=2, generation=0, scope="all",
                           deadline_s=10, private=[str(theirs / "slurmagent-hold-x")])
    assert not report.ok and f"refusing private dir {theirs}: owned by uid {NOBODY}" in report.error, report.error
    assert not (theirs / "slurmagent-hold-x").exists()


# --- 21.5: the requeue hold is private, and made so on every node -----------------------------


def test_the_requeue_hold_lives_in_the_users_private_parent(tmp_path, monkeypatch, shared_tmp):
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    hold = RequeueHold(("77",), "/bin/true")
    try:
        assert hold.dir.parent == shared_tmp / f"slurmagent-{os.geteuid()}"
        assert all((d.stat().st_mode & 0o777) == 0o700 for d in (hold.dir, hold.dir.parent))
    finally:
        hold.cleanup()
    # another node: its agent creates the same path, private and empty, before the trainer starts
    other = tmp_path / "other-node-tmp"
    other.mkdir()
    same = other / hold.dir.relative_to(shared_tmp)
    report = agent_restore(None, tmp_path / "ckpt", index=1, node="v1", num_nodes=2, generation=0, scope="all",
                           deadline_s=10, private=[str(same)])
    assert report.ok, report.error
    assert list(same.iterdir()) == [] and (same.stat().st_mode & 0o777) == 0o700
    assert (same.parent.stat().st_mode & 0o777) == 0o700


# --- 22.3: a first run, or a restore of another commit, shows only this job's checkpoint -----


def earlier_job(ckpt: Path) -> None:
    """What an earlier job of the same user left at this node-local path."""
    (ckpt / "step_300").mkdir(parents=True)
    (ckpt / "step_300" / "shard0").write_text("old shard")
    (ckpt / "model.pt").write_text("old model")
    Path(str(ckpt) + ".slurmagent-run.json").write_text(json.dumps(  # its record, as DirRecord writes it
        {"version": 1, "owner": "slurm:55:55", "remote": "gs://ckpt/jobs/55", "manifest": None, "files": {}}))


def run_shown(tmp_path: Path, restart: int, ckpt: Path, **kw):
    shown = tmp_path / f"shown-{restart}"
    ready = tmp_path / f"ready-{restart}"
    cmd = ["sh", "-c", SHOWN + '; : > "$2"; while :; do sleep 0.02; done', "sh", str(shown), str(ready)]
    outcome, err = attempt(tmp_path, restart, "", ckpt_dir=ckpt, cmd=cmd, ready=ready, **kw)
    return outcome, err, shown.read_text().splitlines()


def test_without_a_remote_another_jobs_files_go_aside_and_a_restart_keeps_its_own(tmp_path):
    ckpt = tmp_path / "n1" / "ckpt"
    earlier_job(ckpt)
    _, err, shown = run_shown(tmp_path, 0, ckpt, store=False)
    assert shown == ["0"], shown
    assert uncommitted_tree(ckpt) == {"step_300/shard0": "old shard", "model.pt": "old model"}
    assert "another job left moved to" in err, err
    outcome, err, shown = run_shown(tmp_path, 1, ckpt, store=False)  # the same job, restarted here
    assert outcome.resumed and shown == ["model.pt", "1", "mine"], (shown, err)
