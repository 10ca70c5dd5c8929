"""Whose files a job starts from: every directory it uses is the user's own (an explicit
`--ckpt-dir` included, and the files beside it), the requeue hold is private, and files that
are not this job's checkpoint (an earlier job's at the same path, an abandoned step) are moved
to `<dir>.uncommitted/` before the trainer starts: never shown to it, never uploaded.

Another user is `nobody`, acting in a forked child (`as_user`); the node agents run in this
process (their srun step is covered in test_multinode_dirs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurmagent.run.child import RequeueHold
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.node_agent import agent_restore
from slurmagent.run.job import DirRecord
from test_wrapper_hardening import CLOUD_RUN, NOBODY, as_user, run_cli, shared_tmp  # noqa: F401 - fixture
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


@pytest.fixture
def emu(gcs_emulator_factory, monkeypatch):
    emu = gcs_emulator_factory()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    return emu


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


def committed_names() -> set[str]:
    m = GcsCheckpointStore("gs://ckpt/jobs/77").latest_manifest()
    return set(m.files) if m else set()


def test_a_first_run_moves_an_earlier_jobs_files_aside_and_never_uploads_them(emu, tmp_path):
    ckpt = tmp_path / "node" / "ckpt"
    earlier_job(ckpt)
    outcome, err, shown = run_shown(tmp_path, 0, ckpt)
    assert shown == ["0"], shown  # an empty directory, not resumed
    assert not outcome.resumed and outcome.synced, err
    assert tree(aside(ckpt)) == {"step_300/shard0": "old shard", "model.pt": "old model"}
    assert "2 file(s) not this job's moved to" in err, err
    assert committed_names() == {"model.pt"}  # this job's own file only
    assert tree(ckpt) == {"model.pt": "mine\n"}


def test_a_restore_of_another_commit_moves_the_abandoned_step_aside(emu, tmp_path):
    n1, n2 = tmp_path / "n1" / "ckpt", tmp_path / "n2" / "ckpt"
    attempt(tmp_path, 0, "A", ckpt_dir=n1)
    (n1 / "step_200").mkdir()
    (n1 / "step_200" / "half").write_text("abandoned")  # written after that commit, never committed
    attempt(tmp_path, 1, "C", ckpt_dir=n2)  # requeued onto n2, which committed C
    outcome, err, shown = run_shown(tmp_path, 2, n1)  # back on n1
    assert "restored checkpoint of attempt 1" in err, err
    assert shown[:2] == ["state", "1"], shown
    assert tree(aside(n1)) == {"step_200/half": "abandoned"}
    assert committed_names() == {"state", "model.pt"}


def test_a_record_of_another_job_never_keeps_the_files_beside_the_same_commit(emu, tmp_path):
    ckpt = tmp_path / "n1" / "ckpt"
    attempt(tmp_path, 0, "A", ckpt_dir=ckpt)
    record = DirRecord(ckpt)
    data = record.read()
    assert data.get("owner") == "slurm:77:77" and data.get("remote") == "gs://ckpt/jobs/77"
    record.path.write_text(json.dumps({**data, "owner": "slurm:99:99"}))  # the same commit, another job's files
    (ckpt / "extra").write_text("theirs")
    outcome, err, shown = run_shown(tmp_path, 1, ckpt)
    assert "restored checkpoint of attempt 0" in err and "kept the local checkpoint" not in err, err
    assert "extra" not in shown and tree(aside(ckpt)) == {"extra": "theirs"}
    assert "extra" not in committed_names()


def test_a_restart_of_the_same_job_keeps_its_files_when_nothing_was_committed_yet(emu, tmp_path):
    ckpt = tmp_path / "n1" / "ckpt"
    first, err = attempt(tmp_path, 0, "A", ckpt_dir=ckpt, before_flush=emu.stop, grace_s=2, final_sync_floor_s=1,
                         submission="sub-1")  # `slurmagent sbatch`: one id for every attempt
    assert not first.synced, err
    emu.start()
    outcome, err, shown = run_shown(tmp_path, 1, ckpt, submission="sub-1")
    assert "kept the files of this job's earlier attempt" in err, err
    assert shown[:2] == ["state", "1"] and not aside(ckpt).exists()


def test_a_plain_sbatch_restart_never_keeps_uncommitted_files_a_reused_job_id_may_have_left(emu, tmp_path):
    """Without a submission id, attempt 1 of job 77 cannot tell its own attempt 0's uncommitted
    files from those of an earlier job 77 (a controller with fresh state) that never committed:
    they go aside, kept, never shown (the bucket held nothing of either)."""
    ckpt = tmp_path / "n1" / "ckpt"
    first, err = attempt(tmp_path, 0, "A", ckpt_dir=ckpt, before_flush=emu.stop, grace_s=2, final_sync_floor_s=1)
    assert not first.synced, err
    emu.start()
    outcome, err, shown = run_shown(tmp_path, 1, ckpt)
    assert "kept the files of this job's earlier attempt" not in err, err
    assert shown == ["0"], shown  # started fresh
    assert "state" in tree(aside(ckpt)), err


def test_without_a_remote_another_jobs_files_go_aside_and_a_restart_keeps_its_own(tmp_path):
    ckpt = tmp_path / "n1" / "ckpt"
    earlier_job(ckpt)
    _, err, shown = run_shown(tmp_path, 0, ckpt, store=False)
    assert shown == ["0"], shown
    assert tree(aside(ckpt)) == {"step_300/shard0": "old shard", "model.pt": "old model"}
    assert "another job left moved to" in err, err
    outcome, err, shown = run_shown(tmp_path, 1, ckpt, store=False)  # the same job, restarted here
    assert outcome.resumed and shown == ["model.pt", "1", "mine"], (shown, err)
