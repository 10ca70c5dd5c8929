"""The trainer helper: resumed() with or without a bucket, atomic_write under concurrent
writers, and ranks agreeing on a checkpoint request (torch.distributed, gloo).

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_wrapper_trainer_torch.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support import REPO
from slurmagent import trainer


@pytest.fixture(autouse=True)
def fresh_helper(monkeypatch, tmp_path):
    for key in ("SLURMAGENT_RESUMED", "SLURMAGENT_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURMAGENT_CKPT_DIR", str(tmp_path / "ck"))
    trainer.reset()
    yield
    trainer.reset()


def test_resumed_when_the_dir_holds_a_checkpoint_bucket_or_not(tmp_path):
    (tmp_path / "ck").mkdir()
    trainer.atomic_write(tmp_path / "ck" / "state.json", "{}")
    assert trainer.resumed()  # no SLURMAGENT_RESUMED (no bucket, shared file system)


def test_not_resumed_on_an_empty_dir_and_the_answer_does_not_change(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.pt.tmp").write_bytes(b"half")  # being written: not a checkpoint
    assert not trainer.resumed()
    trainer.atomic_write(trainer.ckpt_dir() / "state.json", "{}")  # this run's first checkpoint
    assert not trainer.resumed()


def test_resumed_from_the_wrappers_word(monkeypatch):
    monkeypatch.setenv("SLURMAGENT_RESUMED", "1")
    assert trainer.resumed()


WRITER = textwrap.dedent("""
    import sys
    from slurmagent import trainer
    path, rank = sys.argv[1], sys.argv[2]
    for i in range(300):
        trainer.atomic_write(path, (rank * 4096 + str(i)).encode())
    print("ok")
""")


def test_two_ranks_writing_the_same_name_at_once_never_crash(tmp_path):
    target = tmp_path / "latest"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    content = target.read_text()
    assert content[0] in "01" and content.startswith(content[0] * 4096)  # one whole write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary left behind


def test_atomic_write_replaces_a_symlink_never_writes_through_it(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    link = tmp_path / "latest"
    link.symlink_to(outside)
    trainer.atomic_write(link, "new")
    assert not link.is_symlink() and link.read_text() == "new" and outside.read_text() == "keep"


def test_any_rank_without_a_process_group_is_the_flag():
    assert trainer.any_rank(True) is True and trainer.any_rank(False) is False


def test_readme_helper_recipe_resumes_where_it_checkpointed(tmp_path):
    """examples/plain_loop.py under the wrapper, no bucket, on a shared directory: SIGTERM,
    then the next attempt resumes from the step it wrote."""
    import signal

    from support import wait_for

    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "SLURMAGENT_CKPT_DIR"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    run = [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "shared"), "--",
           sys.executable, str(REPO / "examples" / "plain_loop.py"), "300", "0.02"]
    first = subprocess.Popen(run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "shared" / "state.json").exists(), 60, "a first checkpoint")
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 143, err
    saved = int(out.split("checkpointed at step ")[1].split(",")[0])
    second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert f"starting at step {saved} " in second.stdout and "done at step 300" in second.stdout
