"""Multi-node jobs on the local cluster with node-local directories (one mount namespace per
slurmd): every node restored, every node flushed, one job-level checkpoint, one requeue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from gcs_fault_proxy import GcsFaultProxy
from slurmagent import config as config_mod
from slurmagent.devtools.localcluster import LocalSlurmCluster, free_ports, slurm_available

RANKS = str(Path(__file__).with_name("toy_ranks.py"))
DDP_DCP = str(REPO / "examples" / "ddp_dcp_train.py")
NODES = ["n1", "n2", "n3", "n4"]

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm_available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"local Slurm cluster unavailable in CI: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("multinode")
    root.chmod(0o755)
    c = LocalSlurmCluster(root / "slurm", nodes=NODES, node_local=root)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def cl(cluster):
    cluster.reset_nodes()
    return cluster


def write_config(path: Path, **checkpoint) -> Path:
    keys = {"remote": "gs://ckpt/jobs", "sync_interval_s": 1.0, "grace_s": 20.0, **checkpoint}
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path.write_text(f'state_dir = "{path.parent}/state/%n"\n[checkpoint]\n{body}')
    return path


def submit(c: LocalSlurmCluster, tmp_path: Path, emulator_url: str, run_opts: list[str], cmd: list[str],
           **extra_env: str) -> str:
    env = dict(c.env, SLURMAGENT_CONFIG=str(write_config(tmp_path / "c.toml")), PYTHONPATH=str(REPO),
               STORAGE_EMULATOR_HOST=emulator_url, **extra_env)
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-N2", "--ntasks-per-node=1",
         "-o", str(tmp_path / "out"), "--open-mode=append", "--",
         "--ckpt-dir", str(c.local_path / "ckpt"), *run_opts, "--", "srun", *cmd],
        env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def nodes_of(c: LocalSlurmCluster, job_id: str) -> list[str]:
    return c.run(["scontrol", "show", "hostnames", c.job(job_id)["NodeList"]]).stdout.split()


def ledger(tmp_path: Path, rank: int) -> list[str]:
    path = tmp_path / "ledger" / f"rank{rank}.log"
    return path.read_text().splitlines() if path.exists() else []


def steps(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("step ")]


def starts(lines: list[str]) -> list[dict[str, str]]:
    out = []
    for line in lines:
        if line.startswith("start "):
            fields = dict(f.split("=", 1) for f in line.split()[2:])
            out.append({"step": line.split()[1], **fields})
    return out


def wait_end(c: LocalSlurmCluster, job_id: str, timeout: float = 240) -> dict[str, str]:
    return wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
                             else None)(c.job(job_id)), timeout, f"job {job_id} to end")


def bucket():
    from google.cloud import storage

    return storage.Client(project="test").bucket("ckpt")


def committed(job_id: str) -> dict | None:
    blob = bucket().blob(f"jobs/{job_id}/manifest.json")
    return json.loads(blob.download_as_bytes()) if blob.exists() else None


def committed_file(job_id: str, manifest: dict, rel: str) -> bytes:
    entry = manifest["files"][rel]
    if "pack" in entry:  # a small file travels in a pack
        data = bucket().blob(f"jobs/{job_id}/blobs/pack-{entry['pack']}").download_as_bytes()
        return data[entry["offset"] : entry["offset"] + entry["size"]]
    name = f"blake3-{entry['blake3']}" if "blake3" in entry else entry["sha256"]
    return bucket().blob(f"jobs/{job_id}/blobs/{name}").download_as_bytes()


@pytest.fixture
def emu(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


def drain(c: LocalSlurmCluster, nodes: list[str]) -> None:
    for n in nodes:
        c.run(["scontrol", "update", f"nodename={n}", "state=drain", "reason=test: gone"])


NODE_LOCAL_JOB = """#!{python}
import os, subprocess, sys
local = sys.argv[1]
def mark(tag):  # each process of the job writes where it is into the node-local path
    return [sys.executable, "-c", "import os, sys; open(os.path.join(sys.argv[1], sys.argv[2] + '-' + "
            "os.environ['SLURMD_NODENAME']), 'w').close()", local, tag]
open(os.path.join(local, "batch-" + os.environ["SLURMD_NODENAME"]), "w").close()
trainer = subprocess.Popen(["srun", "--ntasks-per-node=1", sys.executable, "-c",
                            "import time; time.sleep(4)"])
subprocess.run(["srun", "--overlap", "--ntasks-per-node=1", *mark("overlap")], check=True, timeout=60)
trainer.wait(60)
subprocess.run(["srun", "--ntasks-per-node=1", *mark("step")], check=True, timeout=60)
"""


def test_every_process_of_a_job_sees_its_own_nodes_local_directory(cl, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(NODE_LOCAL_JOB.format(python=sys.executable))
    script.chmod(0o755)
    job = cl.sbatch("-N2", "--ntasks-per-node=1", "-o", str(tmp_path / "out"), str(script), str(cl.local_path))
    end = cl.wait_job(job, ("COMPLETED", "FAILED"), 120)
    assert end["JobState"] == "COMPLETED", (tmp_path / "out").read_text()
    first, second = nodes_of(cl, job)
    assert {p.name for p in cl.node_dir(first).iterdir()} >= {f"batch-{first}", f"overlap-{first}", f"step-{first}"}
    assert {p.name for p in cl.node_dir(second).iterdir()} >= {f"overlap-{second}", f"step-{second}"}
    assert not any(p.name.endswith(first) for p in cl.node_dir(second).iterdir())
    assert not list(cl.local_path.iterdir())  # the host's own path stays empty


def test_two_node_job_sigtermed_is_requeued_once_and_every_node_resumes_the_whole_checkpoint(cl, emu, tmp_path):
    (tmp_path / "ledger").mkdir()
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, RANKS, "600", str(tmp_path / "ledger"), "0.05"])
    cl.wait_job(job, ("RUNNING",), 60)
    first = nodes_of(cl, job)
    wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1)), 90, "20 steps on both ranks")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    drain(cl, first)  # the requeued job must land on the two other nodes
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)  # what the first run's flush committed, before the second run starts

    end = wait_end(cl, job)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert end["Restarts"] == "1" and out.count("requeued job") == 1, out
    second = nodes_of(cl, job)
    assert len(second) == 2 and not set(second) & set(first)
    whole = {".metadata", "rank0.json", "rank1.json"}
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        assert steps(lines) == list(range(1, 601)), f"rank {rank}: a step lost or done twice"
        ckpt_step = int(next(l for l in lines if l.startswith("ckpt ")).split()[1])
        first_run, second_run = starts(lines)
        assert first_run["resumed"] == "0" and first_run["node"] in first
        # the node this rank resumed on held the whole checkpoint before the rank started
        assert second_run["node"] in second and second_run["resumed"] == "1" and second_run["restart"] == "1"
        assert set(second_run["files"].split(",")) == whole
        assert int(second_run["step"]) == ckpt_step
        assert json.loads(committed_file(job, flushed, f"rank{rank}.json"))["step"] == ckpt_step
    for n in first:  # node-local disks: each first node held only what its own rank wrote
        own = {p.name for p in (cl.node_dir(n) / "ckpt").iterdir()}
        assert own in ({"rank0.json", ".metadata"}, {"rank1.json"}), (n, own)
    for n in second:
        assert {p.name for p in (cl.node_dir(n) / "ckpt").iterdir()} == whole
    assert flushed["attempt"] == 0 and flushed["node_count"] == 2 and set(flushed["files"]) == whole
    assert flushed["writers"] == {".metadata": [0], "rank0.json": [0], "rank1.json": [1]}
    assert committed(job)["attempt"] == 1  # the second run's final sync, from its two nodes


def test_a_node_whose_upload_fails_at_the_flush_leaves_the_previous_checkpoint_and_the_job_is_requeued(
        cl, emu, tmp_path, monkeypatch):
    """The flush comes from a maintenance notice on the second node only: its expiry watch
    signals the batch step (on the first node), which flushes the whole job."""
    from slurmagent.expiry import flush_jobs
    from slurmagent.slurm import Slurm

    (tmp_path / "ledger").mkdir()
    # A periodic commit is a consistent cut: it needs the checkpoint left alone for one whole sync
    # round (first agent's start to last agent's end: 1.3-2.9 s measured on 2 busy cores), so the
    # toy checkpoints every 100 steps (5 s), not every 1.5 s, which only a lucky round fits.
    with GcsFaultProxy(emu.url, b"POISON-UPLOAD") as proxy:
        job = submit(cl, tmp_path, proxy.url, [],
                     [sys.executable, RANKS, "3000", str(tmp_path / "ledger"), "0.05", "every-100", "poison-rank-1"])
        cl.wait_job(job, ("RUNNING",), 60)
        first = nodes_of(cl, job)
        wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1))
                 and len((committed(job) or {}).get("files", {})) == 3, 120, "a committed checkpoint of both ranks")

        monkeypatch.setenv("SLURM_CONF", str(cl.conf))
        (tmp_path / "expiry").mkdir()
        expiry_cfg = config_mod.load(str(write_config(tmp_path / "expiry" / "c.toml")))
        notice = flush_jobs(expiry_cfg, Slurm("scontrol", 10.0), first[1], set())  # the expiry watch of node index 1
        assert notice.signaled == [job], notice
        drain(cl, first)
        cl.wait_job(job, ("PENDING",), 60)
        kept = committed(job)
        end = wait_end(cl, job)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert end["Restarts"] == "1" and out.count("requeued job") == 1, out
    assert proxy.refused >= 1
    assert f"final sync failed: upload failed on {first[1]} (node index 1)" in out, out
    assert kept["attempt"] == 0
    rank1 = json.loads(committed_file(job, kept, "rank1.json"))
    assert "marker" not in rank1
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        ckpt_step = int(next(l for l in lines if l.startswith("ckpt ")).split()[1])
        resumed = starts(lines)[1]
        restored_step = json.loads(committed_file(job, kept, f"rank{rank}.json"))["step"]
        assert resumed["resumed"] == "1" and int(resumed["step"]) == restored_step
        assert set(resumed["files"].split(",")) == {".metadata", "rank0.json", "rank1.json"}
        if rank == 1:
            assert restored_step < ckpt_step  # the failed flush was not committed
        assert steps(lines)[-1] == 3000


def run_uninterrupted(tmp_path: Path, total: int) -> Path:
    """The same 2-rank DDP training without Slurm or any interruption: the reference."""
    out, port = tmp_path / "reference", free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SLURMAGENT"))}
    procs = [subprocess.Popen([sys.executable, DDP_DCP, str(total), str(out), "0"],
                              env=dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       PYTHONPATH=str(REPO), SLURMAGENT_CKPT_DIR=str(tmp_path / f"ref-ckpt{r}")))
             for r in (0, 1)]
    assert [p.wait(300) for p in procs] == [0, 0]
    return out / "final.pt"


def test_ddp_dcp_two_ranks_on_two_nodes_resume_bit_identical_to_an_uninterrupted_run(cl, emu, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("numpy")  # torch.distributed's object collectives (DCP's planning) need it
    total = 300
    reference = torch.load(run_uninterrupted(tmp_path, total))
    out = tmp_path / "train"
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, DDP_DCP, str(total), str(out), "0.05"],
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    cl.wait_job(job, ("RUNNING",), 60)
    first = nodes_of(cl, job)
    log = lambda r: (out / f"rank{r}.log").read_text().splitlines() if (out / f"rank{r}.log").exists() else []  # noqa: E731
    wait_for(lambda: all(len(steps(log(r))) >= 30 for r in (0, 1)), 120, "30 steps on both ranks")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    drain(cl, first)
    end = wait_end(cl, job, 300)
    text = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", text
    assert end["Restarts"] == "1" and text.count("requeued job") == 1, text
    second = nodes_of(cl, job)
    assert not set(second) & set(first)
    for r in (0, 1):
        lines = log(r)
        assert steps(lines) == list(range(1, total + 1)), f"rank {r}: a step lost or done twice"
        ckpt_step = next(l for l in lines if l.startswith("ckpt ")).split()[1]
        resumed = [l for l in lines if l.startswith("start ")][1].split()
        assert resumed[1] == ckpt_step and "resumed=1" in resumed
    for n in first:  # each node wrote only its own rank's shard; the index is on rank 0's node
        shards = {p.name for p in (cl.node_dir(n) / "ckpt").glob("step_*/*")}
        assert shards <= {".metadata", "__0_0.distcp", "__1_0.distcp"} and len(shards & {"__0_0.distcp", "__1_0.distcp"}) == 1
    final = torch.load(out / "final.pt")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference), "the resumed model differs"
