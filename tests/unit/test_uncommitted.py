"""Setting files aside at a start is never a no-op and never unbounded (issue 35, "Never
foreign"): an earlier job's file whose inode `<dir>.uncommitted/` already holds (a restored
file is a hard link into the node-local cache; the old flat layout moved it there before)
really leaves the directory; a file that cannot be moved stops the start, never reaches the
trainer; `<dir>.uncommitted/` keeps the newest `[checkpoint] keep_uncommitted` sets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmagent.run.main import node_agent_options
from slurmagent.run.uncommitted import moved_message, set_aside_uncommitted
from slurmagent.state.config import parse
from slurmagent.state.private_dirs import UnusableDirError
from support import uncommitted_sets, uncommitted_tree
from test_ckpt_dirs import earlier_job, run_shown


def aside(d: Path) -> Path:
    return Path(str(d) + ".uncommitted")


def test_a_file_whose_inode_the_uncommitted_folder_already_holds_really_leaves(tmp_path):
    """rename() onto a hard link of the same inode does nothing and returns success: the file
    stayed, the log said it moved, and the next job committed it."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_5").mkdir(parents=True)
    (ckpt / "step_5" / "model.pt").write_text("an earlier job's model")
    aside(ckpt).mkdir(mode=0o700)
    (aside(ckpt) / "step_5").mkdir()
    os.link(ckpt / "step_5" / "model.pt", aside(ckpt) / "step_5" / "model.pt")  # the old flat layout's copy

    done = set_aside_uncommitted(ckpt, ())

    assert not (ckpt / "step_5" / "model.pt").exists()
    assert list(ckpt.iterdir()) == []
    assert done.moved == ["step_5/model.pt"]
    assert (done.folder / "step_5" / "model.pt").read_text() == "an earlier job's model"
    assert str(done.folder) in moved_message(ckpt, done, "not this job's")


def test_the_trainer_never_sees_an_earlier_jobs_hard_linked_files_and_the_message_is_true(tmp_path):
    ckpt = tmp_path / "n1" / "ckpt"
    earlier_job(ckpt)
    aside(ckpt).mkdir(mode=0o700)
    os.link(ckpt / "model.pt", aside(ckpt) / "model.pt")  # same inode already where the flat move went

    _, err, shown = run_shown(tmp_path, 0, ckpt, store=False)

    assert shown == ["0"], (shown, err)  # an empty directory, not resumed
    assert "2 file(s) another job left moved to" in err, err
    assert uncommitted_tree(ckpt) == {"step_300/shard0": "old shard", "model.pt": "old model"}


def test_a_file_that_cannot_be_moved_stops_the_start_and_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.pt").write_text("theirs")

    def rename_that_moves_nothing(src, dst):  # what rename() onto the same inode does
        return None

    with pytest.raises(UnusableDirError, match=r"cannot move .*model\.pt .* still there after the move"):
        set_aside_uncommitted(ckpt, (), move=rename_that_moves_nothing)


def test_uncommitted_keeps_the_newest_sets_and_says_what_it_deleted(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    aside(ckpt).mkdir(mode=0o700)
    (aside(ckpt) / "flat-old.pt").write_bytes(b"x" * 2048)  # the old flat layout: older than any set
    messages = []
    for job in range(5):
        (ckpt / f"job{job}.pt").write_bytes(b"y" * 1024)
        done = set_aside_uncommitted(ckpt, (), keep_sets=3)
        messages.append(moved_message(ckpt, done, "not this job's"))

    assert [sorted(s) for s in uncommitted_sets(ckpt)] == [["job2.pt"], ["job3.pt"], ["job4.pt"]]
    assert sorted(p.name for p in aside(ckpt).iterdir()) == sorted(p.name for p in aside(ckpt).iterdir()
                                                                  if p.is_dir())
    assert "deleted 1 older set(s)" in messages[0] and "flat-old.pt 2.0 KiB" in messages[0], messages[0]
    assert "deleted" not in messages[1] and "deleted" not in messages[2]
    assert "deleted 1 older set(s)" in messages[3] and "1.0 KiB" in messages[3], messages[3]


def test_the_config_key_bounds_it_in_the_wrapper_and_the_node_agents(tmp_path):
    cfg = parse({"checkpoint": {"keep_uncommitted": 1}}, "test")
    assert node_agent_options(cfg)[node_agent_options(cfg).index("--keep-uncommitted") + 1] == "1"
    ckpt = tmp_path / "n1" / "ckpt"
    for restart in range(3):
        earlier_job(ckpt)
        (ckpt / "model.pt").write_text(f"old model {restart}")
        _, err, shown = run_shown(tmp_path, restart, ckpt, store=False, keep_uncommitted=1)
        assert shown == ["0"], (shown, err)
    assert [s["model.pt"] for s in uncommitted_sets(ckpt)] == ["old model 2"]
