"""Multi-node checkpoints without Slurm: the merge and cut rules, and the node agents run in
this process against a real Cloud Storage emulator, one directory per "node".

The agent step itself (srun --overlap on a real allocation) is covered in test_multinode.py.

The same subject without a cluster, emulator or fake server: tests/unit/test_multinode_store.py.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, uncommitted_tree
from slurmagent.run.multinode import Allocation, AllocationStore
from slurmagent.run.agent_reports import NodeReport
from slurmagent.run.agent_channel import read_frames
from slurmagent.run.node_agent import agent_restore, agent_sync
from slurmagent.checkpoint.errors import CheckpointError, RestoreError, StorageUnavailableError


# --- agents in this process, against the emulator --------------------------------------------


class Nodes:
    """N node-local directories and agents run in this process, in node order, instead of srun.
    `before_agent(i)` runs just before node i's agent (a trainer writing meanwhile)."""

    def __init__(self, root: Path, n: int, remote: str, fail: dict[int, str] | None = None):
        from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

        self.dirs = [root / f"node{i}" / "ckpt" for i in range(n)]
        self.remote = remote
        self.store = GcsCheckpointStore(remote)
        self.fail = fail or {}
        self.before_agent = lambda i: None
        self.order = list(range(n))
        self.skew_ns: dict[int, int] = {}  # node index -> how far its clock is off

    def run(self, args: list[str], deadline_s: float, cancel=None) -> list[NodeReport]:
        action, opts = args[0], dict(zip(args[1::2], args[2::2]))
        reports = {}
        for i in self.order:
            self.before_agent(i)
            store = FailingStore(self.store, self.fail[i]) if i in self.fail else self.store
            if action == "restore":
                reports[i] = agent_restore(store, self.dirs[i], index=i, node=f"v{i}", num_nodes=len(self.dirs),
                                           generation=int(opts["--generation"]), scope=opts["--scope"],
                                           deadline_s=deadline_s)
            else:
                skew = self.skew_ns.get(i, 0)
                reports[i] = agent_sync(store, self.dirs[i], index=i, node=f"v{i}", attempt=int(opts["--attempt"]),
                                        state_file=Path(str(self.dirs[i]) + ".state.json"), deadline_s=deadline_s,
                                        clock_ns=lambda: time.time_ns() + skew)
        return [reports[i] for i in range(len(self.dirs))]


class FailingStore:
    """The real store, except that this node's uploads or downloads are refused."""

    def __init__(self, inner, what: str):
        self.inner, self.what = inner, what

    def read_manifest(self, **kw):
        return self.inner.read_manifest(**kw)

    def restore_manifest(self, *a, **kw):
        if self.what == "restore":
            raise StorageUnavailableError("downloading refused (test)")
        return self.inner.restore_manifest(*a, **kw)

    def sync(self, *a, **kw):
        if self.what == "sync":
            raise StorageUnavailableError("uploading refused (test)")
        return self.inner.sync(*a, **kw)


@pytest.fixture
def remote(gcs_emulator, monkeypatch, request):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return f"gs://ckpt/{request.node.name[:40]}"


def job_store(nodes: Nodes, scope: str = "all") -> tuple[AllocationStore, io.StringIO]:
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    err = io.StringIO()
    return AllocationStore(Allocation("1", len(nodes.dirs)), GcsCheckpointStore(nodes.remote), nodes, scope=scope,
                           err=err), err


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def dcp_like_checkpoint(nodes: Nodes, step: str = "step_1") -> None:
    write(nodes.dirs[0] / step / "__0_0.distcp", f"{step} shard 0")
    write(nodes.dirs[1] / step / "__1_0.distcp", f"{step} shard 1")
    write(nodes.dirs[0] / step / ".metadata", f"{step} index")


def test_one_commit_after_every_node_then_every_new_node_holds_the_whole_checkpoint(remote, tmp_path):
    first = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(first)
    assert store.restore(first.dirs[0], deadline_s=60) is None  # fresh: every node's D created
    assert all(d.is_dir() for d in first.dirs)
    dcp_like_checkpoint(first)
    result = store.sync(first.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    assert (result.files_total, result.nodes, result.bytes_sent) == (3, 2, sum(len(v) for v in (
        "step_1 shard 0", "step_1 shard 1", "step_1 index")))
    committed = first.store.latest_manifest()
    assert committed.node_count == 2 and committed.writers == {
        "step_1/.metadata": [0], "step_1/__0_0.distcp": [0], "step_1/__1_0.distcp": [1]}

    second = Nodes(tmp_path / "run1", 2, remote)
    write(second.dirs[1] / "step_1" / "__1_0.distcp", "newer local copy: not a checkpoint")
    write(second.dirs[1] / "step_2" / "__1_0.distcp", "uncommitted")
    store2, err = job_store(second)
    assert store2.restore(second.dirs[0], deadline_s=60).attempt == 0
    whole = {"step_1/.metadata": "step_1 index", "step_1/__0_0.distcp": "step_1 shard 0",
             "step_1/__1_0.distcp": "step_1 shard 1"}
    assert tree(second.dirs[0]) == whole and tree(second.dirs[1]) == whole
    assert uncommitted_tree(second.dirs[1]) == {"step_2/__1_0.distcp": "uncommitted"}
    assert "every node of the job (2) holds the checkpoint of attempt 0" in err.getvalue()


def test_restore_scope_node_restores_each_node_its_own_shards(remote, tmp_path):
    first = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(first)
    store.restore(first.dirs[0], deadline_s=60)
    dcp_like_checkpoint(first)
    store.sync(first.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    second = Nodes(tmp_path / "run1", 2, remote)
    job_store(second, scope="node")[0].restore(second.dirs[0], deadline_s=60)
    assert tree(second.dirs[0]).keys() == {"step_1/.metadata", "step_1/__0_0.distcp"}
    assert tree(second.dirs[1]).keys() == {"step_1/__1_0.distcp"}


def test_restore_is_all_or_nothing(remote, tmp_path):
    first = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(first)
    store.restore(first.dirs[0], deadline_s=60)
    dcp_like_checkpoint(first)
    store.sync(first.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    second = Nodes(tmp_path / "run1", 2, remote, fail={1: "restore"})
    with pytest.raises(RestoreError, match=r"restore failed on v1 \(node index 1\): downloading refused"):
        job_store(second)[0].restore(second.dirs[0], deadline_s=60)


def test_a_node_whose_upload_fails_commits_nothing_and_the_last_checkpoint_stays(remote, tmp_path):
    nodes = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(nodes)
    store.restore(nodes.dirs[0], deadline_s=60)
    dcp_like_checkpoint(nodes, "step_1")
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    before = nodes.store.read_manifest()
    dcp_like_checkpoint(nodes, "step_2")
    nodes.fail = {1: "sync"}
    with pytest.raises(CheckpointError, match=r"upload failed on v1 \(node index 1\).*last complete checkpoint stays"):
        store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    assert nodes.store.read_manifest() == before


def test_a_periodic_commit_while_ranks_write_is_never_a_new_index_beside_an_old_shard(remote, tmp_path):
    """Node 1 is looked at first; then rank 1 rewrites its shard in place and rank 0 its index;
    then node 0 is looked at: the cut keeps the folder as it was committed before."""
    nodes = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(nodes)
    store.restore(nodes.dirs[0], deadline_s=60)
    dcp_like_checkpoint(nodes, "latest")
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    old = nodes.store.latest_manifest().files

    def trainer_writes_between_agents(i: int) -> None:
        if i == 0:
            time.sleep(0.01)
            dcp_like_checkpoint(nodes, "latest")  # rank 1's new shard, then rank 0's new index
            for d in nodes.dirs:
                for p in (d / "latest").iterdir():
                    write(p, p.read_text() + " v2")

    nodes.order = [1, 0]
    nodes.before_agent = trainer_writes_between_agents
    store.trainer_running = lambda: True
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    assert nodes.store.latest_manifest().files == old  # not node 0's v2 index beside node 1's v1 shard
    nodes.before_agent = lambda i: None
    store.trainer_running = lambda: False  # the trainer has exited: take everything
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    now = nodes.store.latest_manifest().files
    assert now.keys() == old.keys() and all(now[k] != old[k] for k in old)


def test_a_node_clock_600_s_behind_still_gets_periodic_commits_and_is_said(remote, tmp_path):
    """21.12: the cut used to compare node ctimes with the earliest agent's clock."""
    nodes = Nodes(tmp_path / "run0", 2, remote)
    store, err = job_store(nodes)
    store.restore(nodes.dirs[0], deadline_s=60)
    nodes.skew_ns = {1: -600 * 10**9}
    store.trainer_running = lambda: True
    dcp_like_checkpoint(nodes, "step_1")
    for _ in range(2):  # seen, then quiet for a whole round
        store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    assert nodes.store.latest_manifest().files.keys() == {"step_1/.metadata", "step_1/__0_0.distcp",
                                                          "step_1/__1_0.distcp"}
    said = re.findall(r"the clock of v1 \(node index 1\) is (\d+\.\d) s behind the batch step's", err.getvalue())
    assert len(said) == 1 and abs(float(said[0]) - 600) <= 1, said  # measured across a call: 599.9 or 600.0


def test_checkpoints_rank_0_rotates_away_leave_the_bucket_after_a_requeue(remote, tmp_path):
    """22.4: every node holds the restored folders; only rank 0 (node 0) deletes old ones."""
    first = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(first)
    store.restore(first.dirs[0], deadline_s=60)
    for n in (1, 2):
        write(first.dirs[0] / f"checkpoint-{n}" / "model.pt", f"model {n}")
    store.sync(first.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    second = Nodes(tmp_path / "run1", 2, remote)
    store2, _ = job_store(second)
    store2.restore(second.dirs[0], deadline_s=60)
    assert tree(second.dirs[1]).keys() == {"checkpoint-1/model.pt", "checkpoint-2/model.pt"}
    write(second.dirs[0] / "checkpoint-3" / "model.pt", "model 3")
    shutil.rmtree(second.dirs[0] / "checkpoint-1")  # save_total_limit=2, on rank 0 only
    store2.sync(second.dirs[0], 1, tmp_path / "unused", deadline_s=60)
    committed = second.store.latest_manifest()
    assert committed.files.keys() == {"checkpoint-2/model.pt", "checkpoint-3/model.pt"}
    assert committed.writers == {"checkpoint-2/model.pt": [0], "checkpoint-3/model.pt": [0]}


@pytest.mark.parametrize("parallel_upload_mib", [0, 1])
def test_node_agents_move_files_with_the_tunables_the_wrapper_hands_them(gcs_emulator, tmp_path, parallel_upload_mib):
    """`[checkpoint] parallel_upload_mib` reaches every node of a multi-node job: the batch step
    passes its store's tunables to `slurmagent node-agent`, which does not read the config."""
    from support.gcs_fault_proxy import GcsFaultProxy
    from slurmagent.state.config import load
    from slurmagent.run.main import node_agent_options

    config = tmp_path / "c.toml"
    config.write_text(f"[checkpoint]\ntransfers = 4\nparallel_upload_mib = {parallel_upload_mib}\n")
    options = node_agent_options(load(str(config)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "shard.pt").write_bytes(os.urandom(3 * 1024 * 1024))
    with GcsFaultProxy(gcs_emulator.url, b"never-in-random-bytes-\x00\xff") as proxy:
        env = dict(os.environ, PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=proxy.url, SLURM_NODEID="0")
        proc = subprocess.run(
            [sys.executable, "-m", "slurmagent.entry", "node-agent", "sync", "--ckpt-dir", str(ckpt),
             "--remote", f"gs://ckpt/tun{parallel_upload_mib}", "--state-file", str(tmp_path / "s.json"), *options],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    report = NodeReport.from_payload(read_frames(proc.stdout.splitlines()).reports[0])
    assert proc.returncode == 0 and report.ok and report.bytes_sent == 3145728, proc.stderr + proc.stdout
    composed = [path for method, path in proxy.requests if method == "POST" and "/compose" in path]
    assert bool(composed) == bool(parallel_upload_mib), proxy.requests


def test_a_unit_held_back_whose_committed_blob_is_gone_is_never_committed_pointing_at_it(remote, tmp_path):
    """The committed folder's pack is deleted while the job runs (a lifecycle rule); the nodes rewrite
    the folder while their agents look, so the cut would keep it as committed: not with a missing pack.
    (A new attempt would find it at its restore; the agents check once per attempt.)"""
    from google.cloud import storage

    nodes = Nodes(tmp_path / "run0", 2, remote)
    store, _ = job_store(nodes)
    store.restore(nodes.dirs[0], deadline_s=60)
    dcp_like_checkpoint(nodes, "latest")
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    pack = next(e["pack"] for e in nodes.store.latest_manifest().files.values())
    prefix = remote.split("/", 3)[3]
    storage.Client(project="test").bucket("ckpt").blob(f"{prefix}/blobs/pack-{pack}").delete()

    def trainer_writes_between_agents(i: int) -> None:
        if i == 0:
            time.sleep(0.01)
            for d in nodes.dirs:
                for p in (d / "latest").iterdir():
                    write(p, p.read_text() + " v2")

    nodes.order = [1, 0]
    nodes.before_agent = trainer_writes_between_agents
    store.trainer_running = lambda: True
    with pytest.raises(CheckpointError, match="no blob in .* any more and no node holds them"):
        store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)
    nodes.before_agent = lambda i: None
    store.trainer_running = lambda: False
    store.sync(nodes.dirs[0], 0, tmp_path / "unused", deadline_s=60)  # the nodes' files: restorable
    after = Nodes(tmp_path / "run1", 2, remote)
    job_store(after)[0].restore(after.dirs[0], deadline_s=60)
    assert tree(after.dirs[0]) == {**tree(nodes.dirs[0]), **tree(nodes.dirs[1])}
