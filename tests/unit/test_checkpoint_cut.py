"""A single-node job's periodic commits take only units quiet for a whole round (22.1), the
wrapper's books after a commit that held units back (22.5), and a toy HF-style trainer killed
hard at random moments whose every restore holds only complete `checkpoint-N/` folders.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_checkpoint_cut_gcs.py.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.cut import unit_of, unit_signatures
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import Supervisor


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
