"""The multi-node recipes on the 4-node cluster with node-local disks (tests/cluster/test_multinode.py's
cluster): DCP's rename layout (examples/dcp_train.py, 2 ranks on 2 nodes) and the Hugging Face
Trainer with `save_total_limit` (examples/hf_train.py) over several requeues."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, need_module, wait_for
from slurmagent.devtools.localcluster import LocalSlurmCluster, free_ports
from test_multinode import committed, drain, nodes_of, submit, wait_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
need_module("torch")

DCP_TRAIN = str(REPO / "examples" / "dcp_train.py")
HF_TRAIN = str(REPO / "examples" / "hf_train.py")


def lines(path: Path, word: str) -> list[int]:
    text = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[1]) for line in text if line.startswith(word + " ")]


def single_process_params(tmp_path: Path, steps: int, every: int) -> bytes:
    """The final parameters of one uninterrupted process, no wrapper: the reference."""
    ref = tmp_path / "reference"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("SLURM", "SLURMAGENT"))}
    subprocess.run([sys.executable, DCP_TRAIN, "--steps", str(steps), "--every", str(every),
                    "--params-out", str(ref)], env=dict(env, PYTHONPATH=str(REPO),
                                                        SLURMAGENT_CKPT_DIR=str(tmp_path / "ref-ckpt")),
                   check=True, timeout=300)
    return ref.read_bytes()


def test_dcp_rename_recipe_on_two_nodes_resumes_every_rank_bit_identical(cl: LocalSlurmCluster, emu, tmp_path):
    """Each node renames its own `step-N.tmp/` (rank 0 alone would leave rank 1's shard
    unrenamed on its disk: never synced, and the requeued job dies with FileNotFoundError)."""
    need_module("numpy")  # DCP's planning uses torch.distributed's object collectives
    steps, every = 300, 40
    reference = single_process_params(tmp_path, steps, every)
    log, params = tmp_path / "log", tmp_path / "params.bin"
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, DCP_TRAIN, "--steps", str(steps), "--every", str(every),
                                             "--layout", "rename", "--step-seconds", "0.05", "--log", str(log),
                                             "--params-out", str(params)],
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    cl.wait_job(job, ("RUNNING",), 60)
    first = nodes_of(cl, job)
    wait_for(lambda: (tmp_path / "out").exists() and lines(log, "start"), 120, "the ranks to start")
    wait_for(lambda: any(n.endswith("/.metadata") for n in (committed(job) or {}).get("files", {})), 120,
             "a committed step folder")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    drain(cl, first)  # the requeued job lands on the two other nodes
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)
    end = wait_end(cl, job, 300)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert end["Restarts"] == "1", out
    (saved,) = lines(log, "ckpt")
    assert {f"step-{saved:08d}/__0_0.distcp", f"step-{saved:08d}/__1_0.distcp",
            f"step-{saved:08d}/.metadata"} <= set(flushed["files"])  # both ranks' shards committed
    assert not any(".tmp" in name for name in flushed["files"])
    assert lines(log, "start") == [0, saved]
    assert params.read_bytes() == reference
    for n in first:  # each node kept only the two newest step folders
        assert len([p for p in (cl.node_dir(n) / "ckpt").iterdir() if p.name.startswith("step-")]) <= 2


def checkpoint_folders(manifest: dict | None) -> set[str]:
    return {name.split("/")[0] for name in (manifest or {}).get("files", {}) if name.startswith("checkpoint-")}


def half_empty(manifest: dict | None) -> set[str]:
    """checkpoint-N folders without the trainer's state (rank 0 writes it last)."""
    names = set((manifest or {}).get("files", {}))
    return {f for f in checkpoint_folders(manifest) if f"{f}/trainer_state.json" not in names}


def test_hf_save_total_limit_on_two_nodes_holds_two_checkpoints_over_three_requeues(cl: LocalSlurmCluster, emu,
                                                                                    tmp_path):
    """HF defaults (no `save_on_each_node`): every rank writes its `rng_state_<rank>.pth` into
    `checkpoint-N/` on its own node's disk, rank 0 alone rotates old folders, and the other
    node keeps its files of them (and, after a requeue, every restored copy). A step folder its
    writer removed whole leaves the checkpoint whole: never 3+ folders, never half-empty ones."""
    need_module("transformers")
    need_module("accelerate")
    log = tmp_path / "log"
    cmd = [sys.executable, HF_TRAIN, "--max-steps", "100", "--save-steps", "10", "--save-total-limit", "2",
           "--step-seconds", "0.1", "--log", str(log)]
    job = submit(cl, tmp_path, emu.url, [], cmd, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    seen: list[set[str]] = []
    halves: list[set[str]] = []

    def sample() -> dict | None:
        m = committed(job)
        seen.append(checkpoint_folders(m))
        halves.append(half_empty(m))
        return m

    for attempt in range(3):
        cl.wait_job(job, ("RUNNING",), 120)
        before = len(lines(log, "save"))
        # two periodic saves in this attempt, so old folders must rotate, then a flush
        wait_for(lambda: sample() is not None and len(lines(log, "save")) >= before + 2, 240,
                 f"two saves in attempt {attempt}")
        cl.run(["scancel", "--batch", "--signal=TERM", job])
        cl.wait_job(job, ("PENDING",), 60)
        sample()
    end = wait_end(cl, job, 300)
    sample()
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "3", out
    starts, saves = lines(log, "start"), lines(log, "save")
    assert len(starts) == 4 and starts[0] == 0 and all(s in saves for s in starts[1:]), (starts, saves)
    assert starts == sorted(starts) and len(set(starts)) == 4  # each attempt resumed where the last one saved
    # save_total_limit 2: a commit may hold a third folder only between a whole new save (its
    # trainer_state.json is the mark: taken at once) and rank 0's rotation right after it; a
    # folder that left the checkpoint never comes back (a rotation is never undone by a node
    # still holding its files, nor by a restore)
    assert all(len(folders) <= 3 for folders in seen), [sorted(f) for f in seen if len(f) > 3]
    gone: set[str] = set()
    for earlier, later in zip(seen, seen[1:]):
        gone |= earlier - later
        assert not (later & gone), (sorted(later & gone), [sorted(f) for f in seen])
    assert not any(halves), [sorted(h) for h in halves if h]
    assert checkpoint_folders(committed(job)) == {"checkpoint-90", "checkpoint-100"}
