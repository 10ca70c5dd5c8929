"""Whose files a job starts from: every directory it uses is the user's own (an explicit
`--ckpt-dir` included, and the files beside it), the requeue hold is private, and files that
are not this job's checkpoint (an earlier job's at the same path, an abandoned step) are moved
to `<dir>.uncommitted/` before the trainer starts: never shown to it, never uploaded.

Another user is `nobody`, acting in a forked child (`as_user`); the node agents run in this
process (their srun step is covered in test_multinode_dirs.py).

The same subject without a cluster, emulator or fake server: tests/unit/test_ckpt_dirs.py.
"""

from __future__ import annotations

import json


from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.job import DirRecord
from support import uncommitted_tree
from test_wrapper_requeue import attempt
from test_ckpt_dirs import aside, earlier_job, run_shown, tree


# --- 22.3: a first run, or a restore of another commit, shows only this job's checkpoint -----


def committed_names() -> set[str]:
    m = GcsCheckpointStore("gs://ckpt/jobs/77").latest_manifest()
    return set(m.files) if m else set()


def test_a_first_run_moves_an_earlier_jobs_files_aside_and_never_uploads_them(emu, tmp_path):
    ckpt = tmp_path / "node" / "ckpt"
    earlier_job(ckpt)
    outcome, err, shown = run_shown(tmp_path, 0, ckpt)
    assert shown == ["0"], shown  # an empty directory, not resumed
    assert not outcome.resumed and outcome.synced, err
    assert uncommitted_tree(ckpt) == {"step_300/shard0": "old shard", "model.pt": "old model"}
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
    assert uncommitted_tree(n1) == {"step_200/half": "abandoned"}
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
    assert "extra" not in shown and uncommitted_tree(ckpt) == {"extra": "theirs"}
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
    assert "state" in uncommitted_tree(ckpt), err
