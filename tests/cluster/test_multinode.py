"""Multi-node jobs on the local cluster with node-local directories (one mount namespace per
slurmd): every node restored, every node flushed, one job-level checkpoint, one requeue."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, SUPPORT, SlurmEnv, cluster_config_text, healthy_snapshot_dict, need_module, wait_for
from support.gcs_fault_proxy import GcsFaultProxy
from test_fault_slurm import evictions, land_on, restarts
from test_watch import append, nvrm
from test_watch_slurm import WatchProcess, drained
from slurmagent.state import config as config_mod
from slurmagent.devtools.localcluster import LocalSlurmCluster, free_ports

RANKS = str(SUPPORT / "toy_ranks.py")
DDP_DCP = str(REPO / "examples" / "ddp_dcp_train.py")
NODES = ["n1", "n2", "n3", "n4"]

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def write_config(path: Path, **checkpoint) -> Path:
    keys = {"remote": "gs://ckpt/jobs", "sync_interval_s": 1.0, "grace_s": 20.0, **checkpoint}
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path.write_text(f'state_dir = "{path.parent}/state/%n"\n[checkpoint]\n{body}')
    return path


def submit(c: LocalSlurmCluster, tmp_path: Path, emulator_url: str, run_opts: list[str], cmd: list[str],
           config: Path | None = None, cwd: Path | None = None, **extra_env: str) -> str:
    """`slurmagent sbatch` a 2-node job from `cwd` (the job's working directory)."""
    config = config or write_config(tmp_path / "c.toml")
    env = {**c.env, "SLURMAGENT_CONFIG": str(config), "PYTHONPATH": str(REPO), "STORAGE_EMULATOR_HOST": emulator_url,
           **extra_env}
    sub = subprocess.run(
        [sys.executable, "-P", "-m", "slurmagent.entry", "sbatch", "--parsable", "-N2", "--ntasks-per-node=1",
         "-o", str(tmp_path / "out"), "--open-mode=append", "--",
         "--ckpt-dir", str(c.local_path / "ckpt"), *run_opts, "--", "srun", *cmd],
        env=env, capture_output=True, text=True, timeout=30, cwd=cwd)
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
    from slurmagent.commands.expiry import flush_jobs
    from slurmagent.slurm.commands import Slurm

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


@pytest.fixture
def node_watchers():
    """`slurmagent watch` processes on nodes of a cluster, stopped at the end of the test."""
    started: list[WatchProcess] = []

    def start(env: SlurmEnv, node: str) -> WatchProcess:
        w = WatchProcess(env, node).start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def sha256s(field: str) -> dict[str, str]:
    """A start line's `sha256=` field: what the rank's node held when the rank started."""
    return dict(pair.split(":", 1) for pair in field.split(",") if pair)


def test_two_node_job_with_one_node_faulting_is_requeued_once_and_both_nodes_files_are_restored(
        cl, emu, node_watchers, tmp_path):
    """XID 79 on the node that is not the batch host: its `watch` drains it and sends the fault
    flush to the batch step on the other node; the wrapper flushes every node, commits one
    checkpoint, requeues once; the next run restores both ranks' files on its own two nodes."""
    for n in cl.nodes:  # the watch's inputs: kernel log (the XID source) and replay snapshot per node
        (tmp_path / "kern").mkdir(exist_ok=True)
        (tmp_path / "kern" / f"{n}.log").touch()
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(tmp_path).replace("[watch]\n", "[watch]\nflush_deadline_s = 120.0\n")
                      + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 1.0\ngrace_s = 20.0\n'
                      '[expiry]\npublish_run_file = false\n')
    env = SlurmEnv(cl, tmp_path, config)
    for n in cl.nodes:
        env.set_snapshot(n, healthy_snapshot_dict(hostname=n))
    (tmp_path / "ledger").mkdir()
    job, running = land_on(cl, "n1,n2", lambda: submit(
        cl, tmp_path, emu.url, [], [sys.executable, RANKS, "3000", str(tmp_path / "ledger"), "0.05", "every-200"],
        config=config))  # a checkpoint every 10 s: quiet time for a periodic commit
    first = nodes_of(cl, job)
    assert first == ["n1", "n2"], running
    healthy = running["BatchHost"]
    (faulty,) = set(first) - {healthy}
    wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1))
             and len((committed(job) or {}).get("files", {})) == 3, 120, "a committed checkpoint of both ranks")
    watches = [node_watchers(env, n) for n in first]
    append(env.kernel_log(faulty), nvrm(79))

    wait_for(lambda: restarts(cl, job) >= 1, 120, "the requeue")
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)  # the last checkpoint the first run committed, before the second run starts
    assert drained(env, faulty)["Reason"].startswith("slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    assert drained(env, healthy) is None

    end = wait_end(cl, job, 300)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert end["Restarts"] == "1" and out.count("requeued job") == 1, out  # once: not the watch's, not twice
    assert "SIGPWR: asking the job to checkpoint" in out, out
    second = nodes_of(cl, job)
    assert len(second) == 2 and faulty not in second, second
    whole = {".metadata", "rank0.json", "rank1.json"}
    assert flushed["attempt"] == 0 and flushed["node_count"] == 2 and set(flushed["files"]) == whole
    assert flushed["writers"] == {".metadata": [0], "rank0.json": [0], "rank1.json": [1]}
    committed_sha = {rel: hashlib.sha256(committed_file(job, flushed, rel)).hexdigest() for rel in whole}
    resumed_on = set()
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        assert steps(lines) == list(range(1, 3001)), f"rank {rank}: a step lost or done twice"
        first_run, second_run = starts(lines)
        assert first_run["resumed"] == "0" and first_run["node"] in first
        assert second_run["node"] in second and second_run["resumed"] == "1" and second_run["restart"] == "1"
        # the node this rank resumed on held the whole committed checkpoint, byte for byte, before it started
        assert sha256s(second_run["sha256"]) == committed_sha, (rank, second_run)
        restored = json.loads(committed_file(job, flushed, f"rank{rank}.json"))
        assert restored == {"rank": rank, "step": int(second_run["step"])}
        resumed_on.add(second_run["node"])
    assert resumed_on == set(second)  # both nodes of the second run were restored
    for n in second:
        assert {p.name for p in (cl.node_dir(n) / "ckpt").iterdir()} == whole

    ev = wait_for(lambda: [d for d in evictions(env, faulty, (job,)) if d.get("fault_to_leave_s") is not None],
                  30, "the job followed off the faulty node")[0]
    assert (ev["job_nodes"], ev["action"], ev["requeued_by"]) == (2, "flushed and requeued by its wrapper", "wrapper")
    assert evictions(env, healthy, (job,)) == []
    assert [w.terminate() for w in watches] == [0, 0], [w.stderr() for w in watches]


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
    torch = need_module("torch")
    need_module("numpy")  # torch.distributed's object collectives (DCP's planning) need it
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


# --- the node agents' step (issue 21 items 1, 8, 9, 10) ----------------------------------------

ROUNDS_DRIVER = """#!{python}
# The batch step of a 4-node job driving the wrapper's multi-node store directly: a restore, then
# every node writes FILES checkpoint files, then ROUNDS periodic syncs and a final one.
import os, subprocess, sys
from slurmagent.run.multinode import Allocation, AllocationStore, SrunLauncher
from slurmagent.checkpoint.hash_cache import state_file_for
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

ckpt, remote, rounds, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
write = ("import os, sys; d = os.path.join(sys.argv[1], 'step_1'); os.makedirs(d, exist_ok=True); r = os.environ['SLURM_NODEID']\\n"
         "for k in range(int(sys.argv[2])):\\n"
         "    open(os.path.join(d, f'shard-{{r}}-{{k:05d}}.distcp'), 'wb').write(os.urandom(48))")
env = dict(os.environ)
alloc = Allocation.from_env(env)
store = AllocationStore(alloc, GcsCheckpointStore(remote), SrunLauncher(alloc, env))
store.restore(ckpt, deadline_s=120)
subprocess.run(["srun", "--overlap", f"--nodes={{alloc.num_nodes}}", f"--ntasks={{alloc.num_nodes}}",
                "--ntasks-per-node=1", sys.executable, "-c", write, ckpt, str(files)], check=True, timeout=120)
for r in range(rounds + 1):
    store.trainer_running = lambda: r < rounds  # periodic rounds (a consistent cut), then the final sync
    try:
        result = store.sync(ckpt, 0, state_file_for(ckpt), deadline_s=120)
        print(f"round {{r}}: committed {{result.files_total}} files of {{result.nodes}} nodes", flush=True)
    except Exception as exc:
        print(f"round {{r}}: FAILED: {{exc}}", flush=True)
"""


def test_four_nodes_of_two_thousand_files_each_report_whole_in_every_round_and_the_final_sync(cl, emu, tmp_path):
    """Reports of ~2,000 files per node are hundreds of KiB: srun used to interleave them torn."""
    script = tmp_path / "driver.py"
    script.write_text(ROUNDS_DRIVER.format(python=sys.executable))
    script.chmod(0o755)
    env = dict(cl.env, PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run(["sbatch", "--parsable", "-N4", "-o", str(tmp_path / "out"), str(script),
                          str(cl.local_path / "ckpt"), "gs://ckpt/rounds", "30", "2000"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    end = cl.wait_job(sub.stdout.strip().split(";")[0], ("COMPLETED", "FAILED"), 900)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    # round 0 sees every unit for the first time: a periodic commit waits until a unit has been
    # quiet for a whole round (checkpoint/cut), so its reports arrive whole but commit nothing yet
    assert rounds == ["round 0: committed 0 files of 4 nodes"] + [
        f"round {r}: committed 8000 files of 4 nodes" for r in range(1, 31)], out
    manifest = json.loads(bucket().blob("rounds/manifest.json").download_as_bytes())
    assert len(manifest["files"]) == 8000 and manifest["node_count"] == 4


SHADOWING = "raise RuntimeError('the job directory\\'s {name} was imported instead of the standard library\\'s')\n"


def test_a_job_with_the_users_srun_settings_and_modules_in_its_directory_syncs_restores_and_commits(
        cl, emu, tmp_path):
    """The batch environment asks srun for labelled, unbuffered output to files and for no
    environment (`sbatch --export=NONE` leaves SLURM_EXPORT_ENV=NONE); the job's directory
    holds a `uuid.py` and a `json.py` that fail on import. The trainer's own srun copes
    (`--export=ALL`, its script's directory first on sys.path); the node agents must too. Each
    node also holds 1,000 files: the final sync's reports are far over srun's 1 KiB."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("uuid.py", "json.py"):
        (project / name).write_text(SHADOWING.format(name=name))
    (tmp_path / "ledger").mkdir()
    batch_env = {"SLURM_LABELIO": "1", "SLURM_UNBUFFEREDIO": "1", "SLURM_STDOUTMODE": str(tmp_path / "task-%t.out"),
                 "SLURM_STDERRMODE": str(tmp_path / "task-%t.err"), "SLURM_OPEN_MODE": "append",
                 "SLURM_EXPORT_ENV": "NONE"}
    job = submit(cl, tmp_path, emu.url, [],
                 ["--export=ALL", sys.executable, RANKS, "600", str(tmp_path / "ledger"), "0.05", "bulk-1000"],
                 cwd=project, **batch_env)
    cl.wait_job(job, ("RUNNING",), 60)
    wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1)), 90, "20 steps on both ranks")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)
    end = wait_end(cl, job)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert end["Restarts"] == "1" and "final sync:" in out and "final sync failed" not in out, out
    bulk = {f"bulk/rank{r}-{k:05d}.bin" for r in (0, 1) for k in range(1000)}
    assert flushed["attempt"] == 0 and set(flushed["files"]) == {".metadata", "rank0.json", "rank1.json", *bulk}
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        ckpt_step = int(next(line for line in lines if line.startswith("ckpt ")).split()[1])
        resumed = starts(lines)[1]
        assert resumed["resumed"] == "1" and int(resumed["step"]) == ckpt_step  # every node was restored
        assert set(resumed["files"].split(",")) == set(flushed["files"])
        assert steps(lines)[-1] == 600
    assert committed(job)["attempt"] == 1  # the second run's final sync


HUNG_AGENT = SUPPORT / "fakes" / "hung_agent"


def test_an_agent_hung_in_a_periodic_round_is_cancelled_by_the_flush_named_and_the_final_sync_commits(
        cl, emu, tmp_path):
    """Node index 1's first sync agent hangs (ignoring SIGTERM) and holds the periodic round,
    whose deadline (30 s) is longer than the flush's grace: the flush must cancel that round,
    not wait for it, and its final sync must commit the trainer's checkpoint."""
    (tmp_path / "ledger").mkdir()
    hung = tmp_path / "hung"
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, RANKS, "3000", str(tmp_path / "ledger"), "0.05"],
                 PYTHONPATH=f"{HUNG_AGENT}:{REPO}", SLURMAGENT_TEST_HANG_INDEX="1", SLURMAGENT_TEST_HANG_ONCE=str(hung))
    cl.wait_job(job, ("RUNNING",), 60)
    wait_for(hung.exists, 90, "a periodic round held by node index 1")
    held = len(steps(ledger(tmp_path, 0)))
    wait_for(lambda: len(steps(ledger(tmp_path, 0))) >= held + 60, 90, "node index 0's agent to answer")
    silent = nodes_of(cl, job)[1]
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    cl.wait_job(job, ("PENDING",), 60)
    out = (tmp_path / "out").read_text()
    cl.run(["scancel", job])
    cancelled = [line for line in out.splitlines() if "the flush cancelled the node agents' round in flight:" in line]
    assert len(cancelled) == 1 and f"no report from {silent} (node index 1): cancelled after" in cancelled[0], out
    assert "final sync:" in out and "final sync failed" not in out and "requeued job" in out, out
    flushed = committed(job)
    assert flushed is not None and set(flushed["files"]) == {".metadata", "rank0.json", "rank1.json"}, out
    for rank in (0, 1):
        ckpt_step = int(next(line for line in ledger(tmp_path, rank) if line.startswith("ckpt ")).split()[1])
        assert json.loads(committed_file(job, flushed, f"rank{rank}.json"))["step"] == ckpt_step


# Lightning's default layout on 2 nodes (22.2): lightning_logs/version_0/ holds metrics.csv,
# rewritten every step, and checkpoints/, where ModelCheckpoint saves every 50 steps (~15 s).
LIGHTNING_DEFAULT_LAYOUT = r'''
import os, sys, time
import lightning.pytorch as pl, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
root, log = os.environ["SLURMAGENT_CKPT_DIR"], sys.argv[1]
class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        time.sleep(0.3)
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss)
        return loss
    def on_save_checkpoint(self, checkpoint):
        if self.trainer.is_global_zero:
            with open(log, "a") as fh:
                fh.write(f"save {checkpoint['global_step']} {time.time()}\n")
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)
pl.Trainer(default_root_dir=root, max_steps=150, max_epochs=-1, accelerator="cpu", devices=1, num_nodes=2,
           strategy="ddp", logger=CSVLogger(root, flush_logs_every_n_steps=1), log_every_n_steps=1,
           callbacks=[ModelCheckpoint(every_n_train_steps=50)], enable_progress_bar=False,
           enable_model_summary=False).fit(Model())
'''


def test_lightning_default_layout_on_two_nodes_commits_each_checkpoint_while_it_trains(cl, emu, tmp_path):
    """metrics.csv, rewritten every step beside checkpoints/, used to hold back the whole
    lightning_logs/ folder: nothing was committed until the job ended."""
    need_module("lightning")
    import time

    script, log = tmp_path / "pl_train.py", tmp_path / "saves"
    script.write_text(LIGHTNING_DEFAULT_LAYOUT)
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, str(script), str(log)],
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    seen: dict[str, float] = {}  # committed checkpoint file -> when the bucket first showed it
    while (cl.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING")):
        for rel in (committed(job) or {}).get("files", {}):
            seen.setdefault(rel, time.time())
        time.sleep(0.3)
    text = (tmp_path / "out").read_text()
    assert cl.job(job)["JobState"] == "COMPLETED", text
    saves = [(int(line.split()[1]), float(line.split()[2])) for line in log.read_text().splitlines()]
    assert [s for s, _ in saves] == [50, 100, 150], saves
    ckpts = "lightning_logs/version_0/checkpoints/"
    delays = {}
    for (step, saved), (_, next_save) in zip(saves, saves[1:]):  # the last one is the final sync's
        name = next((rel for rel in seen if rel.startswith(ckpts) and rel.endswith(f"-step={step}.ckpt")), None)
        assert name is not None and seen[name] < next_save, (step, sorted(seen), text)  # before the next save
        delays[step] = round(seen[name] - saved, 1)
    print("save -> commit (s):", delays)
    final = committed(job)["files"]
    assert "lightning_logs/version_0/metrics.csv" in final and any(r.endswith("step=150.ckpt") for r in final)


def test_a_two_node_job_never_resumes_an_earlier_jobs_checkpoint_under_its_id_and_commits_its_own(cl, emu, tmp_path):
    """Issue 21 item 7: the id was an earlier job's (a controller redeployed with fresh state); its
    checkpoint, of a later attempt than any of ours, is under jobs/<id>. The batch step decides
    once; the nodes start fresh, the job commits and its requeue resumes its own checkpoint."""
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    (tmp_path / "ledger").mkdir()
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, RANKS, "300", str(tmp_path / "ledger"), "0.05"],
                 SBATCH_HOLD="1")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name, body in ((".metadata", {"world": 2, "step": 999}), ("rank0.json", {"rank": 0, "step": 999}),
                       ("rank1.json", {"rank": 1, "step": 999})):
        (earlier / name).write_text(json.dumps(body))
    old = GcsCheckpointStore(f"gs://ckpt/jobs/{job}")
    old.owner = "earlier-job"
    old.sync(earlier, 4, tmp_path / "earlier-state.json", 30)
    cl.run(["scontrol", "release", job])
    wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1)), 90, "20 steps on both ranks")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    end = wait_end(cl, job)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", out
    assert out.count("NOT restoring the checkpoint") == 1 and "failed" not in out, out
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        first_run, second_run = starts(lines)
        assert first_run["resumed"] == "0" and first_run["step"] == "0"
        ckpt_step = int(next(l for l in lines if l.startswith("ckpt ")).split()[1])
        assert second_run["resumed"] == "1" and int(second_run["step"]) == ckpt_step  # its own, not 999
    final = committed(job)
    assert final["attempt"] == 1 and final["owner"] != "earlier-job"
