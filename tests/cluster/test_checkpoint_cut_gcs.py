"""A single-node job's periodic commits take only units quiet for a whole round (22.1), the
wrapper's books after a commit that held units back (22.5), and a toy HF-style trainer killed
hard at random moments whose every restore holds only complete `checkpoint-N/` folders.

The same subject without a cluster, emulator or fake server: tests/unit/test_checkpoint_cut.py.
"""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, wait_for
from slurmagent.run.cut_store import QuietCutStore

HF_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")  # trainer_state.json last

# A Hugging Face Trainer's save as it happens on disk: checkpoint-N/ filled in place, file by
# file (each in chunks, with pauses shorter than a sync round), trainer_state.json last; the
# oldest folders rotated away (save_total_limit=2). A new checkpoint every PERIOD seconds.
HF_WRITER = r'''
import os, shutil, sys, time
d = os.environ["SLURMAGENT_CKPT_DIR"]
period, chunk = float(sys.argv[1]), 64 * 1024
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")
open(sys.argv[2], "w").write(str(os.getpid()))
steps = [int(n.split("-")[1]) for n in os.listdir(d) if n.startswith("checkpoint-")]
step = max(steps, default=0)
while True:
    started = time.monotonic()
    step += 1
    folder = os.path.join(d, f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    for name in FILES:
        with open(os.path.join(folder, name), "wb") as fh:
            for part in range(3):
                fh.write(f"{step}:{name}:{part};".encode().ljust(chunk, b"."))
                fh.flush()
                time.sleep(0.05)
        time.sleep(0.15)
    for old in sorted(steps + [step])[:-2]:
        shutil.rmtree(os.path.join(d, f"checkpoint-{old}"), ignore_errors=True)
    steps = [s for s in steps + [step] if s > step - 2]
    time.sleep(max(0.0, period - (time.monotonic() - started)))
'''


def incomplete_folders(d: Path) -> list[str]:
    """checkpoint-N folders that are not whole: a file missing or cut short."""
    bad = []
    for folder in sorted(d.glob("checkpoint-*")):
        step = folder.name.split("-")[1]
        for name in HF_FILES:
            path = folder / name
            want = b"".join(f"{step}:{name}:{part};".encode().ljust(64 * 1024, b".") for part in range(3))
            if not path.is_file() or path.read_bytes() != want:
                bad.append(f"{folder.name}/{name}")
    return bad


def test_a_folder_being_filled_is_held_back_and_its_previous_version_stays(emu, tmp_path):
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    d, state = tmp_path / "ck", tmp_path / "state.json"
    inner = GcsCheckpointStore("gs://ckpt/held")
    store = QuietCutStore(inner, err=io.StringIO())
    store.trainer_running = lambda: True
    (d / "checkpoint-1").mkdir(parents=True)
    for name in HF_FILES:
        (d / "checkpoint-1" / name).write_text(f"1 {name}")
    store.sync(d, 0, state)  # first look
    assert store.sync(d, 0, state).manifest.files.keys() == {f"checkpoint-1/{n}" for n in HF_FILES}
    (d / "checkpoint-2").mkdir()
    (d / "checkpoint-2" / "model.safetensors").write_bytes(b"2" * 512 * 1024)  # the trainer pauses here
    result = store.sync(d, 0, state)
    assert result.held_back == ("checkpoint-2",)
    assert inner.latest_manifest().files.keys() == {f"checkpoint-1/{n}" for n in HF_FILES}
    time.sleep(0.01)
    (d / "checkpoint-1" / "optimizer.pt").write_text("rewritten")  # a new save into checkpoint-1: its mark
    store.sync(d, 0, state)                                         # (trainer_state.json) is now older
    assert inner.latest_manifest().files["checkpoint-1/optimizer.pt"]["size"] == len("1 optimizer.pt")
    store.trainer_running = lambda: False  # the trainer exited: everything as it is
    final = store.sync(d, 0, state)
    assert "checkpoint-2/model.safetensors" in final.manifest.files
    assert final.bytes_sent < 512 * 1024  # held back, not unsent: the round that held it uploaded it


@pytest.mark.slow
def test_hf_style_trainer_killed_hard_at_ten_random_moments_always_restores_whole_checkpoint_folders(emu, tmp_path):
    """22.1 done-when: a VM lost at any moment (SIGKILL to the wrapper's and the trainer's
    process groups) leaves a checkpoint whose every checkpoint-N/ folder is whole."""
    writer = tmp_path / "hf_writer.py"
    writer.write_text(HF_WRITER)
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/hf"\n')
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), CLOUD_RUN_JOB="hf",
               CLOUD_RUN_TASK_INDEX="0")
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED"):
        env.pop(key, None)
    rng = random.Random(22)
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    store = GcsCheckpointStore("gs://ckpt/hf/hf-task-0")
    committed_steps = set()
    for attempt in range(10):
        pid_file = tmp_path / f"writer-{attempt}.pid"
        err = open(tmp_path / f"wrapper-{attempt}.err", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / f"vm{attempt}"),
             "--sync-interval", "1", "--", sys.executable, str(writer), "2", str(pid_file)],
            env={**env, "CLOUD_RUN_TASK_ATTEMPT": str(attempt)}, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True)
        try:
            wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the trainer to start")
            time.sleep(rng.uniform(2.0, 7.0))
        finally:
            writer_pid = int(pid_file.read_text() or 0) if pid_file.exists() else 0
            for pid in (proc.pid, writer_pid):  # the VM is gone: every process at once
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait(10)
        restored = tmp_path / f"restored{attempt}"
        manifest = store.restore(restored, deadline_s=60)
        if manifest is None:
            continue
        assert incomplete_folders(restored) == [], (attempt, sorted(manifest.files),
                                                    (tmp_path / f"wrapper-{attempt}.err").read_text())
        committed_steps |= {p.name for p in restored.glob("checkpoint-*")}
    assert len(committed_steps) >= 3, committed_steps  # periodic commits happened, and went on after restores


def test_a_held_back_units_committed_blob_that_is_gone_is_never_committed_again(emu, tmp_path):
    """A single-node commit keeps a held-back unit's previous entries: their blobs must still be in
    the bucket (an age rule on blobs/ may have deleted one), else nothing is committed that round."""
    from slurmagent.checkpoint.errors import CheckpointError
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    d, state = tmp_path / "ck", tmp_path / "state.json"
    inner = GcsCheckpointStore("gs://ckpt/gone")
    store = QuietCutStore(inner, err=io.StringIO())
    store.trainer_running = lambda: True
    (d / "checkpoint-1").mkdir(parents=True)
    (d / "checkpoint-1" / "model.safetensors").write_bytes(b"1" * 600 * 1024)  # a blob of its own (no pack)
    store.sync(d, 0, state)
    first = store.sync(d, 0, state).manifest
    blobs = [b for b in inner.client.bucket("ckpt").list_blobs(prefix="gone/blobs/")]
    assert first is not None and len(blobs) == 1
    blobs[0].delete()  # a lifecycle rule, between two attempts
    inner = GcsCheckpointStore("gs://ckpt/gone")  # the next attempt: a new run, nothing seen yet
    store = QuietCutStore(inner, err=io.StringIO())
    store.trainer_running = lambda: True
    (d / "checkpoint-1" / "model.safetensors").write_bytes(b"2" * 600 * 1024)  # being rewritten: held back
    with pytest.raises(CheckpointError, match="no blob in gs://ckpt/gone any more"):
        store.sync(d, 1, state, restored=first)
    assert inner.latest_manifest() == first  # not committed again over a gone blob
    store.sync(d, 1, state, restored=first)  # quiet now: the new version is taken, with its blob
    restored = tmp_path / "restored"
    inner.restore(restored)
    assert (restored / "checkpoint-1" / "model.safetensors").read_bytes() == b"2" * 600 * 1024
