"""A single-node job's periodic commits take only units quiet for a whole round (22.1), the
wrapper's books after a commit that held units back (22.5), and a toy HF-style trainer killed
hard at random moments whose every restore holds only complete `checkpoint-N/` folders."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.cut import unit_of, unit_signatures
from slurmagent.run.cut_store import QuietCutStore
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import Supervisor

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


@pytest.fixture
def emu(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


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
    (d / "checkpoint-1" / "trainer_state.json").write_text("rewritten")  # and checkpoint-1 moves too
    store.sync(d, 0, state)
    assert inner.latest_manifest().files["checkpoint-1/trainer_state.json"]["size"] == len("1 trainer_state.json")
    store.trainer_running = lambda: False  # the trainer exited: everything as it is
    final = store.sync(d, 0, state)
    assert "checkpoint-2/model.safetensors" in final.manifest.files
    assert final.bytes_sent < 512 * 1024  # held back, not unsent: the round that held it uploaded it


@pytest.mark.parametrize("path, unit", [
    ("checkpoint-500/trainer_state.json", "checkpoint-500"),
    ("checkpoint-5/pytorch_model_fsdp_0/__0_0.distcp", "checkpoint-5"),  # the outermost step folder
    ("global_step100/mp_rank_00_model_states.pt", "global_step100"),
    ("iter_0000100/mp_rank_00/model_optim_rng.pt", "iter_0000100"),
    ("ck/epoch=0-step=10.ckpt/checkpoint/mp_rank_00.pt", "ck/epoch=0-step=10.ckpt"),
    ("lightning_logs/version_0/metrics.csv", "lightning_logs/version_0"),  # a logger's run folder
    ("lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt", "lightning_logs/version_0/checkpoints"),
    ("gpt2/checkpoint-5/model.safetensors", "gpt2/checkpoint-5"),  # a model's name is no step
    (".metadata", ""),
])
def test_units_follow_how_frameworks_write(path, unit):
    assert unit_of(path) == unit


def test_unit_signatures_see_names_still_being_written_and_ignore_other_units(tmp_path):
    d = tmp_path / "ck"
    (d / "checkpoint-3" / "sub").mkdir(parents=True)
    (d / "checkpoint-3" / "sub" / "a").write_text("a")
    (d / "lightning_logs" / "version_0" / "checkpoints").mkdir(parents=True)
    before = unit_signatures(d)
    (d / "checkpoint-3" / "optimizer.pt.tmp").write_text("being written")
    (d / "lightning_logs" / "version_0" / "metrics.csv").write_text("step,loss")
    after = unit_signatures(d)
    assert before["checkpoint-3"] != after["checkpoint-3"]
    assert before["lightning_logs/version_0/checkpoints"] == after["lightning_logs/version_0/checkpoints"]


class HeldBackStore:
    """A store whose commits hold back `checkpoint-2` (still being written) and, as a
    multi-node store does, say another node has had an uncommitted change for 30 s."""

    url = "gs://b/p"
    warn = print

    def __init__(self, pending_since: float | None = None):
        self.pending_since = pending_since

    def sync(self, ckpt_dir, attempt, state_file, deadline_s=0, restored=None):
        files = {"checkpoint-1/model.pt": {"sha256": "a" * 64, "size": 1, "crc32c": "AAAAAA=="}}
        return type("Result", (), dict(files_sent=1, bytes_sent=1, manifest=Manifest(0, files=files),
                                        held_back=("checkpoint-2",), pending_since=self.pending_since))()


def test_a_held_back_unit_counts_as_lag_and_not_as_committed(tmp_path):
    """22.5: the wrapper recorded the whole scan as committed, so the lag gauge said 0."""
    d = tmp_path / "ck"
    (d / "checkpoint-1").mkdir(parents=True)
    (d / "checkpoint-1" / "model.pt").write_text("1")
    opts = RunOptions(cmd=["train"], ckpt_dir=d, remote="gs://b/p")
    sup = Supervisor(opts, JobIdentity("local", "1", "l", 0), HeldBackStore(), None, {}, io.StringIO())
    (d / "checkpoint-2").mkdir()
    (d / "checkpoint-2" / "model.pt").write_text("2")
    old = time.time() - 20
    os.utime(d / "checkpoint-2" / "model.pt", (old, old))
    assert sup.sync(deadline_s=10)
    assert sup.lag_seconds() >= 19  # checkpoint-2 is on disk, not in the bucket
    assert "checkpoint-2/model.pt" not in sup.record.read()["files"]  # nor recorded as committed
    assert "checkpoint-1/model.pt" in sup.record.read()["files"]


def test_the_lag_gauge_counts_other_nodes_uncommitted_changes(tmp_path):
    """22.5: the gauge looked at the batch node's directory only."""
    d = tmp_path / "ck"
    d.mkdir()
    opts = RunOptions(cmd=["train"], ckpt_dir=d, remote="gs://b/p")
    sup = Supervisor(opts, JobIdentity("local", "1", "l", 0), HeldBackStore(pending_since=time.time() - 30), None,
                     {}, io.StringIO())
    assert sup.sync(deadline_s=10)
    assert sup.lag_seconds() >= 29


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


def test_a_multi_node_start_on_an_empty_claim_is_a_fresh_start(tmp_path):
    """The agents' restore of a prefix this job just took over (an empty claim) is no checkpoint:
    the trainer is not told to resume (SLURMAGENT_RESUMED unset)."""

    class ClaimedPrefix:
        url = "gs://ckpt/jobs/77"

        def latest_manifest(self, *, deadline_s=60.0):
            return None  # what `settle` returns for an empty claim

        def restore(self, ckpt_dir, *, deadline_s=1800.0, state_file=None):
            Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
            return Manifest(attempt=0)  # the agents hold the claim: no files

    opts = RunOptions(cmd=["true"], ckpt_dir=tmp_path / "ckpt", remote="gs://ckpt/jobs/77", multi_node=True)
    sup = Supervisor(opts, JobIdentity("slurm", "77", "77", 1, ("77",)), ClaimedPrefix(), None, {},
                     err=io.StringIO())
    assert sup.prepare_dir() is False
    assert sup.baseline is None and "starting fresh" in sup.err.getvalue()
