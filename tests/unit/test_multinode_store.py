"""Multi-node checkpoints without Slurm or a bucket: the merge and cut rules of the node
agents' reports, one directory per "node".

The agent step itself (srun --overlap on a real allocation) is covered in test_multinode.py.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_multinode_store_gcs.py.
"""

from __future__ import annotations

import io
import json

import pytest

from slurmagent.run.multinode import (
    AGENT_STEP_NAME,
    Allocation,
    AllocationError,
    AllocationStore,
    SrunLauncher,
    allocation_store,
)
from slurmagent.run.agent_reports import NodeReport, merge_reports, select_for_node
from slurmagent.run.agent_channel import frame_lines
from slurmagent.checkpoint.cut import QuietCut, unit_of
from slurmagent.run.uncommitted import set_aside_uncommitted
from slurmagent.checkpoint.errors import ManifestError, RestoreError
from slurmagent.checkpoint.manifest import Manifest

SHA = {c: c * 64 for c in "abcdef"}


def entry(c: str, size: int = 1) -> dict:
    return {"sha256": SHA[c], "size": size, "crc32c": "AAAAAA=="}


def report(index: int, files: dict[str, str]) -> NodeReport:
    return NodeReport(index=index, node=f"v{index}", ok=True, files={k: entry(v) for k, v in files.items()})


# --- merge: conflicts ------------------------------------------------------------------------


def test_a_name_on_several_nodes_keeps_the_copy_changed_since_the_restore_without_a_warning():
    """After a restore of every file to every node, one rank rewrites its file: the normal case."""
    restored = Manifest(0, files={"cfg.json": entry("a")})
    merged = merge_reports([report(0, {"cfg.json": "a"}), report(1, {"cfg.json": "b"})], baseline=restored)
    assert merged.files["cfg.json"]["sha256"] == SHA["b"]
    assert merged.writers["cfg.json"] == [0, 1]
    assert merged.conflicts == {}


def test_several_changed_copies_or_no_restore_keep_the_lowest_node_index():
    restored = Manifest(0, files={"cfg.json": entry("a")})
    three = [report(0, {"cfg.json": "a"}), report(1, {"cfg.json": "c"}), report(2, {"cfg.json": "b"})]
    assert merge_reports(three, baseline=restored).files["cfg.json"]["sha256"] == SHA["c"]
    fresh = merge_reports([report(1, {"x": "c"}), report(0, {"x": "b"})], baseline=None)
    assert fresh.files["x"]["sha256"] == SHA["b"] and "lowest node index" in fresh.conflicts["x"]
    same = merge_reports([report(0, {"x": "a"}), report(1, {"x": "a"})], baseline=None)
    assert not same.conflicts and same.writers["x"] == [0, 1]


# --- merge: files their writer deleted -------------------------------------------------------


def test_a_file_its_writer_deleted_leaves_the_checkpoint_whatever_restored_copies_other_nodes_hold():
    """Rank 0 rotates old checkpoints on its node only; node 1 still holds the restored copies."""
    restored = Manifest(0, files={"checkpoint-1/a": entry("a"), "checkpoint-2/a": entry("b"), "shard1": entry("c")},
                        node_count=2, writers={"checkpoint-1/a": [0], "checkpoint-2/a": [0], "shard1": [1]})
    reports = [report(0, {"checkpoint-2/a": "b", "shard1": "c"}),  # node 0 deleted checkpoint-1
               report(1, {"checkpoint-1/a": "a", "checkpoint-2/a": "b", "shard1": "c"})]
    merged = merge_reports(reports, baseline=restored)
    assert merged.files.keys() == {"checkpoint-2/a", "shard1"} and merged.dropped == ["checkpoint-1/a"]
    assert merged.writers == {"checkpoint-2/a": [0], "shard1": [1]}  # a restored copy makes no writer
    # its writer is not in this job (4 nodes before, 2 now): the restored copies stay
    wider = Manifest(0, files={"rank3.pt": entry("d")}, node_count=4, writers={"rank3.pt": [3]})
    assert merge_reports([report(0, {"rank3.pt": "d"}), report(1, {"rank3.pt": "d"})],
                         baseline=wider).files.keys() == {"rank3.pt"}


# --- the consistent cut: quiet for a whole round -------------------------------------------------


def cut_round(cut: QuietCut, reports: list[NodeReport], previous: Manifest | None, baseline=None, running=True):
    merged = merge_reports(reports, baseline=baseline)
    return cut.take(merged.files, merged.writers, {r.index: r.units for r in reports},
                    previous_files=previous.files if previous else None,
                    previous_writers=previous.writers if previous else None, running=running,
                    node_names={r.index: r.who for r in reports})


def sigs(report_: NodeReport, **units: str) -> NodeReport:
    report_.units = units
    return report_


def test_a_folder_changed_in_a_round_on_one_node_stays_as_previously_committed_until_quiet():
    """Rank 0's new index must never land beside rank 1's older shard."""
    previous = Manifest(0, files={"s/.metadata": entry("a"), "s/shard1": entry("b")},
                        node_count=2, writers={"s/.metadata": [0], "s/shard1": [1]})
    cut = QuietCut()
    old = [sigs(report(0, {"s/.metadata": "a"}), s="0a"), sigs(report(1, {"s/shard1": "b"}), s="1a")]
    assert cut_round(cut, old, previous).files == previous.files  # first round: nothing is known quiet
    moving = [sigs(report(0, {"s/.metadata": "c"}), s="0b"), sigs(report(1, {"s/shard1": "b"}), s="1a")]
    merged = cut_round(cut, moving, previous)
    assert merged.files == previous.files and merged.writers == previous.writers and merged.held_back == ["s"]
    merged = cut_round(cut, moving, previous)  # the same again: quiet for a whole round
    assert merged.files["s/.metadata"]["sha256"] == SHA["c"] and not merged.held_back


def test_skewed_node_clocks_never_decide_the_cut():
    """21.12: the cut compares each node with itself, round by round; report times play no part."""
    cut = QuietCut()
    rounds = []
    for skew in (0, 600 * 10**9, -600 * 10**9):
        rs = [sigs(report(0, {"step_1/a": "a"}), step_1="x"), sigs(report(1, {"step_1/b": "b"}), step_1="y")]
        rs[0].started_ns, rs[1].started_ns = 10**18, 10**18 + skew
        rounds.append(cut_round(cut, rs, None).files.keys())
    assert rounds[0] == set() and rounds[1] == rounds[2] == {"step_1/a", "step_1/b"}


def test_top_level_files_are_one_unit_of_the_cut():
    previous = Manifest(0, files={".metadata": entry("a"), "rank1.pt": entry("b")})
    cut = QuietCut()
    quiet = [sigs(report(0, {".metadata": "a"}), **{"": "0"}), sigs(report(1, {"rank1.pt": "b"}), **{"": "1"})]
    cut_round(cut, quiet, previous)
    reports = [sigs(report(0, {".metadata": "c"}), **{"": "0"}), sigs(report(1, {"rank1.pt": "d"}), **{"": "1b"})]
    merged = cut_round(cut, reports, previous)
    assert merged.files == previous.files  # neither the new index nor the new shard alone
    assert cut_round(cut, reports, previous, running=False).files.keys() == {".metadata", "rank1.pt"}  # final


def test_a_folder_only_some_nodes_write_joins_once_it_is_unchanged_for_a_round():
    cut = QuietCut()
    reports = [sigs(report(0, {"step_5/model.pt": "a"}), step_5="x"), report(1, {})]
    assert cut_round(cut, reports, None).files == {}
    assert cut_round(cut, reports, None).files.keys() == {"step_5/model.pt"}


def test_a_folder_gone_from_every_node_is_dropped_once_its_absence_is_quiet():
    previous = Manifest(0, files={"step_1/a": entry("a"), "step_2/a": entry("b")})
    cut = QuietCut()
    both = [sigs(report(0, {"step_1/a": "a", "step_2/a": "b"}), step_1="1", step_2="2"),
            sigs(report(1, {}))]
    cut_round(cut, both, previous)
    gone = [sigs(report(0, {"step_2/a": "b"}), step_2="2"), sigs(report(1, {}))]
    assert cut_round(cut, gone, previous).files.keys() == {"step_1/a", "step_2/a"}  # removed during the round
    assert cut_round(cut, gone, previous).files.keys() == {"step_2/a"}


def test_lightning_metrics_rewritten_every_round_never_hold_back_its_checkpoints():
    """22.2: version_0/metrics.csv changes every step; version_0/checkpoints/ is its own unit."""
    cut = QuietCut(say_after=3)
    said = []
    files = {"lightning_logs/version_0/hparams.yaml": "a",
             "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt": "b"}
    committed = None
    for n in range(5):
        rs = [sigs(report(0, {**files, "lightning_logs/version_0/metrics.csv": "abcdef"[n]}),
                   **{"lightning_logs/version_0": f"m{n}", "lightning_logs/version_0/checkpoints": "c"}),
              sigs(report(1, {}))]
        merged = cut_round(cut, rs, committed)
        said += merged.messages
        committed = Manifest(0, files=merged.files, node_count=2, writers=merged.writers)
    assert "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt" in committed.files
    assert "lightning_logs/version_0/metrics.csv" not in committed.files  # never quiet: the final sync takes it
    assert len(said) == 1 and "lightning_logs/version_0 held back for 3 rounds" in said[0]  # once per streak
    assert "v0 (node index 0)" in said[0]


# --- rotation: step folders a writer node removed whole (22.4) ---------------------------------

HF_RANK0 = ("model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_0.pth")


class Scripted:
    """Node agents that report what the test says each node holds (content letters), with
    unit signatures that change when a unit's files do; no disks, no bucket."""

    def __init__(self, n: int):
        self.held: dict[int, dict[str, str]] = {i: {} for i in range(n)}

    def run(self, args: list[str], deadline_s: float, cancel=None) -> list[NodeReport]:
        if args[0] == "restore":
            return [NodeReport(index=i, node=f"v{i}", ok=True) for i in self.held]
        out = []
        for i, files in self.held.items():
            units: dict[str, list] = {}
            for rel, c in files.items():
                units.setdefault(unit_of(rel), []).append((rel, c))
            out.append(sigs(report(i, files), **{u: json.dumps(sorted(fs)) for u, fs in units.items()}))
        return out


class Bucket:
    url = "gs://b/p"

    def __init__(self, manifest: Manifest | None = None):
        self.manifest, self.generation = manifest, int(manifest is not None)

    def read_manifest(self, deadline_s=0):
        return self.manifest, self.generation

    def commit(self, manifest, deadline_s=0):
        self.manifest, self.generation = manifest, self.generation + 1
        return self.generation


def hf_save(agents: Scripted, step: int, c: str = "a") -> None:
    """HF defaults on 2 nodes: rank 0 writes the checkpoint, each rank its own RNG file."""
    agents.held[0].update({f"checkpoint-{step}/{name}": c for name in HF_RANK0})
    agents.held[1][f"checkpoint-{step}/rng_state_1.pth"] = c


def rotate_on_rank_0(agents: Scripted, step: int) -> None:
    agents.held[0] = {rel: c for rel, c in agents.held[0].items() if unit_of(rel) != f"checkpoint-{step}"}


def rounds(store: AllocationStore, n: int, running: bool = True) -> list[set[str]]:
    """The checkpoint-* folders of each of n commits."""
    store.trainer_running = lambda: running
    out = []
    for _ in range(n):
        store.sync("/ck", 0, "/state", deadline_s=10)
        files = store.committer.manifest.files if store.committer.manifest else {}
        out.append({rel.split("/")[0] for rel in files if rel.startswith("checkpoint-")})
    return out


def test_a_step_folder_rank_0_rotated_away_leaves_the_checkpoint_whatever_rank_1_wrote_into_it():
    """HF defaults (no save_on_each_node): rank 1's rng_state_1.pth kept every old checkpoint-N/."""
    agents = Scripted(2)
    store = AllocationStore(Allocation("1", 2), Bucket(), agents, err=io.StringIO())
    store.restore("/ck", deadline_s=10)
    hf_save(agents, 1)
    hf_save(agents, 2)
    assert rounds(store, 2)[-1] == {"checkpoint-1", "checkpoint-2"}
    hf_save(agents, 3)
    rotate_on_rank_0(agents, 1)  # save_total_limit=2, on rank 0 only
    assert rounds(store, 4)[1:] == [{"checkpoint-2", "checkpoint-3"}] * 3  # once quiet, and it stays out
    assert rounds(store, 1, running=False) == [{"checkpoint-2", "checkpoint-3"}]  # the final sync too
    assert store.committer.manifest.writers["checkpoint-3/rng_state_1.pth"] == [1]


def test_a_step_folder_rotated_before_any_commit_took_it_never_enters_the_checkpoint():
    agents = Scripted(2)
    store = AllocationStore(Allocation("1", 2), Bucket(), agents, err=io.StringIO())
    store.restore("/ck", deadline_s=10)
    hf_save(agents, 1)
    rounds(store, 1)  # seen, not yet quiet
    rotate_on_rank_0(agents, 1)
    assert rounds(store, 3) == [set()] * 3  # not rank 1's rng_state_1.pth alone


@pytest.mark.parametrize("scope", ["all", "node"])
def test_after_a_requeue_rank_0_rotation_removes_a_folder_every_node_holds_from_the_restore(scope):
    files = {f"checkpoint-{s}/{n}": entry("a") for s in (1, 2) for n in (*HF_RANK0, "rng_state_1.pth")}
    writers = {rel: [1] if rel.endswith("rng_state_1.pth") else [0] for rel in files}
    agents = Scripted(2)
    store = AllocationStore(Allocation("1", 2), Bucket(Manifest(0, files=files, node_count=2, writers=writers)),
                            agents, scope=scope, err=io.StringIO())
    store.restore("/ck", deadline_s=10)
    for i in (0, 1):  # what the restore put on each node
        agents.held[i] = {rel: "a" for rel, w in writers.items() if scope == "all" or i in w}
    hf_save(agents, 3)
    rotate_on_rank_0(agents, 1)
    assert rounds(store, 1, running=False) == [{"checkpoint-2", "checkpoint-3"}]
    assert store.committer.manifest.writers["checkpoint-2/rng_state_1.pth"] == [1]  # restored copies make no writer


def test_rotation_never_drops_what_a_node_outside_this_job_wrote_nor_loose_files_nor_a_reader_removed():
    """Writers 2 and 3 of a 4-node checkpoint are not in this 2-node job; node 1 holds only
    restored copies of checkpoint-1 and removes them; top-level files keep the per-file rule."""
    files = {"checkpoint-1/model.pt": entry("a"), "checkpoint-1/rng_state_2.pth": entry("b"),
             "checkpoint-1/rng_state_3.pth": entry("c"), "rank0.pt": entry("d"), "rank1.pt": entry("e")}
    writers = {"checkpoint-1/model.pt": [0], "checkpoint-1/rng_state_2.pth": [2],
               "checkpoint-1/rng_state_3.pth": [3], "rank0.pt": [0], "rank1.pt": [1]}
    agents = Scripted(2)
    store = AllocationStore(Allocation("1", 2), Bucket(Manifest(0, files=files, node_count=4, writers=writers)),
                            agents, err=io.StringIO())
    store.restore("/ck", deadline_s=10)
    agents.held[0] = {rel: SHA_OF[e["sha256"]] for rel, e in files.items() if rel != "rank0.pt"}  # rank 0 removed it
    agents.held[1] = {rel: SHA_OF[e["sha256"]] for rel, e in files.items() if not rel.startswith("checkpoint-1/")}
    store.sync("/ck", 1, "/state", deadline_s=10)
    assert store.committer.manifest.files.keys() == files.keys() - {"rank0.pt"}


SHA_OF = {v: k for k, v in SHA.items()}


# --- restore scope ------------------------------------------------------------------------------


def test_restore_scope_node_gives_each_node_the_files_it_held_and_needs_the_same_node_count():
    m = Manifest(0, files={"r0": entry("a"), "r1": entry("b"), "cfg": entry("c")}, node_count=2,
                 writers={"r0": [0], "r1": [1], "cfg": [0, 1]})
    assert select_for_node(m, 1, 2, "node").files.keys() == {"r1", "cfg"}
    assert select_for_node(m, 1, 2, "all").files.keys() == {"r0", "r1", "cfg"}
    with pytest.raises(RestoreError, match="written by 2 nodes, this job has 4"):
        select_for_node(m, 1, 4, "node")
    single = Manifest(0, files={"model.pt": entry("a")})  # from a single-node job: no writers known
    assert select_for_node(single, 1, 2, "node").files.keys() == {"model.pt"}


def test_manifest_keeps_node_count_and_writers_and_refuses_bad_ones():
    m = Manifest(3, files={"r0": entry("a")}, node_count=2, writers={"r0": [0]})
    back = Manifest.from_json(m.to_json())
    assert (back.node_count, back.writers) == (2, {"r0": [0]})
    assert "writers" not in json.loads(Manifest(3, files={"r0": entry("a")}).to_json())
    for bad in ({"node_count": 2, "writers": {"r9": [0]}}, {"node_count": 2, "writers": {"r0": [2]}},
                {"node_count": -1}):
        raw = json.loads(m.to_json())
        raw.update(bad)
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(raw))


# --- who we are ---------------------------------------------------------------------------------


def test_the_batch_step_of_a_multi_node_job_covers_the_allocation_and_a_wrapper_per_rank_is_refused():
    batch = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}
    assert Allocation.from_env(batch) == Allocation("7", 2)
    assert Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}) is None
    assert Allocation.from_env({}) is None
    with pytest.raises(AllocationError, match="as the batch step around srun"):
        Allocation.from_env({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    assert Allocation.from_env({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}) == Allocation("7", 2)
    with pytest.raises(AllocationError, match="%n would name the batch host"):
        allocation_store(batch, None, ckpt_dir_option="/mnt/localssd/ckpt-%n")


def test_the_agent_step_is_one_task_per_node_overlapping_the_trainer_without_its_step_shape():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "12", "SLURM_GPUS_PER_NODE": "8",
           "STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}
    launcher = SrunLauncher(Allocation("7", 4), env, python="/py")
    argv = launcher.argv(["sync", "--ckpt-dir", "/d"])
    for opt in ("--overlap", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpus-per-task=1",
                "--kill-on-bad-exit=1", f"--job-name={AGENT_STEP_NAME}"):
        assert opt in argv
    assert argv[-8:] == ["/py", "-P", "-m", "slurmagent.entry", "node-agent", "sync", "--ckpt-dir", "/d"]
    assert launcher.env == {"SLURM_JOB_ID": "7", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}


def test_the_agent_step_sets_its_io_environment_and_directory_whatever_the_batch_environment_says():
    """`srun --label`, output to files, unbuffered I/O, `sbatch --export=NONE` (SLURM_EXPORT_ENV)
    and a `--chdir` of the user's would lose or tear the reports or strip the agents' environment."""
    batch = {"SLURM_JOB_ID": "7", "PYTHONPATH": "/repo", "SLURM_LABELIO": "1", "SLURM_STDOUTMODE": "out-%t",
             "SLURM_STDERRMODE": "err-%t", "SLURM_STDINMODE": "0", "SLURM_UNBUFFEREDIO": "1", "SLURM_OPEN_MODE": "a",
             "SLURM_EXPORT_ENV": "NONE", "SRUN_EXPORT_ENV": "NONE", "SLURM_WORKING_DIR": "/elsewhere",
             "SLURM_WAIT": "1", "SLURM_TASK_PROLOG": "/p"}
    launcher = SrunLauncher(Allocation("7", 2), batch, python="/py")
    assert launcher.env == {"SLURM_JOB_ID": "7", "PYTHONPATH": "/repo"}
    argv = launcher.argv(["sync"])
    assert {"--export=ALL", "--input=none", "--chdir=/"} <= set(argv)
    assert argv[argv.index("/py") + 1] == "-P"  # neither the job's directory nor a script's on sys.path


def test_a_report_round_trips_and_a_node_without_one_is_named(tmp_path):
    r = NodeReport(index=1, node="n2", ok=False, error="boom", units={"": "5"})
    assert NodeReport.from_payload(r.payload()) == r
    assert NodeReport.from_payload(b"{not json") is None
    fake_srun = tmp_path / "srun"
    frames = tmp_path / "frames"
    frames.write_text("".join(line + "\n" for line in frame_lines(1, r.payload())))
    fake_srun.write_text(f"#!/bin/sh\necho 'srun: error: n1: task 0: Exited with exit code 1' >&2\ncat {frames}\n")
    fake_srun.chmod(0o755)
    alloc = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"})
    err = io.StringIO()
    reports = SrunLauncher(alloc, {}, srun=str(fake_srun), err=err).run(["sync"], deadline_s=30)
    assert reports[1] == r
    assert reports[0].error == "no report from n1 (node index 0) (srun exited 0: srun: error: n1: task 0: Exited with exit code 1)"
    assert "task 0: Exited" in err.getvalue()


def test_files_not_in_the_checkpoint_are_moved_aside_into_one_fresh_set(tmp_path):
    d = tmp_path / "ckpt"
    (d / "step_1").mkdir(parents=True)
    (d / "step_1" / "keep").write_text("k")
    (d / "step_9").mkdir()
    (d / "step_9" / "newer").write_text("n")
    (d / "link").symlink_to("step_1/keep")
    done = set_aside_uncommitted(d, {"step_1/keep"})
    assert sorted(done.moved) == ["link", "step_9/newer"]
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == ["step_1", "step_1/keep"]
    assert done.folder.parent == tmp_path / "ckpt.uncommitted"
    assert (done.folder / "step_9" / "newer").read_text() == "n" and (done.folder / "link").is_symlink()


# --- agents in this process, against the emulator --------------------------------------------


def test_no_srun_is_a_failed_round_on_every_node_not_a_crash(tmp_path):
    launcher = SrunLauncher(Allocation("7", 2), {}, srun=str(tmp_path / "no-srun"))
    reports = launcher.run(["sync", "--ckpt-dir", "/d"], deadline_s=5)
    assert [(r.index, r.ok) for r in reports] == [(0, False), (1, False)]
    assert "cannot run" in reports[0].error


# --- the kill-time record of open files on every node (issue 35, "Never torn") -----------------


def test_the_writers_agent_reports_what_this_jobs_processes_hold_open_here(tmp_path):
    """`node-agent writers`: the files below --ckpt-dir a process of this job (SLURM_JOB_ID in its
    environment) holds open for writing, rewriting apart from appending; no bucket, no google import."""
    import subprocess
    import sys

    from slurmagent.run.agent_channel import read_frames
    from slurmagent.run.node_agent import node_agent_main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; a = open(sys.argv[1], 'wb'); b = open(sys.argv[2], 'a'); "
         "a.write(b'x'); a.flush(); print('open', flush=True); time.sleep(60)", str(ckpt / "model.pt"),
         str(ckpt / "train.log")], env={"SLURM_JOB_ID": "4242", "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        out = io.StringIO()
        env = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURMD_NODENAME": "n2"}
        assert node_agent_main("writers", ckpt_dir=str(ckpt), remote="gs://never/read", state_file=None, attempt=0,
                               generation=0, scope="all", deadline_s=5, env=env, out=out) == 0
        report = NodeReport.from_payload(read_frames(out.getvalue().splitlines()).reports[1])
        assert report.ok and report.writing == ["model.pt"] and report.appending == ["train.log"]
        other = io.StringIO()  # another job's agent on the same node sees none of them
        node_agent_main("writers", ckpt_dir=str(ckpt), remote="", state_file=None, attempt=0, generation=0,
                        scope="all", deadline_s=5, env={**env, "SLURM_JOB_ID": "4243"}, out=other)
        assert NodeReport.from_payload(read_frames(other.getvalue().splitlines()).reports[1]).writing == []
    finally:
        holder.kill()
        holder.wait()


class Writers:
    """Agents whose `writers` round says node 1 holds model-1.pt open and node 2 gives no report."""

    def __init__(self):
        self.asked: list[list[str]] = []

    def run(self, args, deadline_s, cancel=None):
        self.asked.append(args)
        return [NodeReport(index=0, node="v0", ok=True), NodeReport(index=1, node="v1", ok=True, writing=["model-1.pt"]),
                NodeReport(index=2, node="v2", ok=False, error="no report from v2 (node index 2)")]


def test_the_kill_time_record_asks_every_node_and_names_a_silent_one():
    alloc = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "v[0-2]"})
    err = io.StringIO()
    launcher = Writers()
    store = AllocationStore(alloc, Bucket(), launcher, err=err)
    store.record_torn("/ck")
    assert launcher.asked == [["writers", "--ckpt-dir", "/ck"]]
    assert store.torn == {"model-1.pt"}
    assert "no report from v2 (node index 2); that node's files are judged by the final sync's evidence alone" \
        in err.getvalue()
