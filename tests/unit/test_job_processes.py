"""The job's processes on a node and the files they hold open for writing (issue 35, "The
job's processes, one adapter"; "Never torn"): real processes, real /proc, real descriptors.

A process belongs to the job by its session (outside Slurm), by `SLURM_JOB_ID` in its
environment (`proctrack/linuxproc`) or by its cgroup (`job_<id>`); a descriptor counts as
"being written" by its open flags, and an appending one (a log) tears nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmagent.checkpoint.cut import QuietCut, unit_signatures
from slurmagent.slurm.job_processes import JobProcesses, torn_files
from support import wait_for

# Opens argv[1] with mode argv[2] (and writes a little if it may), says so, then holds it open.
HOLDER = ("import sys, time, pathlib\n"
          "f = open(sys.argv[1], sys.argv[2])\n"
          "if 'r' not in sys.argv[2] or '+' in sys.argv[2]:\n"
          "    f.write(b'x' * 1000); f.flush()\n"
          "pathlib.Path(sys.argv[3]).write_text('open')\n"
          "time.sleep(600)\n")


@pytest.fixture
def holders(tmp_path):
    procs = []

    def start(path: Path, mode: str, env: dict | None = None, session: bool = True) -> subprocess.Popen:
        ready = tmp_path / f"ready-{len(procs)}"
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode, str(ready)],
                             env=env, start_new_session=session)
        procs.append(p)
        wait_for(ready.exists, 30, f"{path.name} open ({mode})", interval=0.02)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_file_rewritten_in_place_is_being_written_a_log_and_a_reader_are_not(tmp_path, holders):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    model = holders(ckpt / "model.pt", "wb")
    log = holders(ckpt / "train.log", "ab")
    reader = holders(ckpt / "config.json", "rb")
    procs = JobProcesses(sessions=[model.pid, log.pid, reader.pid])

    held = {(Path(f.path).name, f.pid, f.appending) for f in procs.open_for_writing(ckpt)}

    assert held == {("model.pt", model.pid, False), ("train.log", log.pid, True)}
    assert torn_files(procs.open_for_writing(ckpt), ckpt) == {"model.pt"}
    assert {p.pid for p in procs.processes()} == {model.pid, log.pid, reader.pid}


def test_a_process_outside_the_job_is_not_the_jobs(tmp_path, holders):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ours = holders(ckpt / "model.pt", "wb")
    other = holders(ckpt / "other.pt", "wb")  # its own session, no job id: another job's, or the admin's
    assert torn_files(JobProcesses(sessions=[ours.pid]).open_for_writing(ckpt), ckpt) == {"model.pt"}
    assert other.pid not in {p.pid for p in JobProcesses(sessions=[ours.pid]).processes()}


def test_a_rank_srun_started_belongs_by_its_slurm_job_id(tmp_path, holders):
    """Ranks `srun` starts are slurmstepd's children in no session of the wrapper's; under
    proctrack/linuxproc they carry the job's id in their environment."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rank = holders(ckpt / "shard0.pt", "wb", env=dict(os.environ, SLURM_JOB_ID="424242"))
    holders(ckpt / "shard1.pt", "wb", env=dict(os.environ, SLURM_JOB_ID="4242420"))  # another job
    procs = JobProcesses(job_id="424242")
    assert [p.pid for p in procs.processes()] == [rank.pid]
    assert torn_files(procs.open_for_writing(ckpt), ckpt) == {"shard0.pt"}


def test_a_cgroup_names_the_job(tmp_path):
    """cgroup v2 under proctrack/cgroup: `/system.slice/slurmstepd.scope/job_77/step_0/user/task_0`
    (a fake /proc: the cgroup file is the evidence read)."""
    proc = tmp_path / "proc"
    for pid, cgroup in ((101, "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n"),
                        (102, "0::/system.slice/slurmstepd.scope/job_770/step_0/user/task_0\n")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (python) S 1 {pid} {pid} 0 -1\n")
        (proc / str(pid) / "cgroup").write_text(cgroup)
    assert [p.pid for p in JobProcesses(job_id="77", proc=str(proc)).processes()] == [101]


def files(**contents) -> dict[str, dict]:
    return {rel: {"sha256": text, "size": len(text)} for rel, text in contents.items()}


def test_a_unit_with_a_file_open_for_writing_keeps_its_committed_version_and_is_said(tmp_path):
    cut = QuietCut(say_after=2)
    committed = files(**{"model.pt": "v1", "optim.pt": "v1"})
    cut.take(committed, {}, {0: {"": "a"}}, previous_files=committed)  # the round that committed it
    half = files(**{"model.pt": "v2-half", "optim.pt": "v1"})
    first = cut.take(half, {}, {0: {"": "a"}}, previous_files=committed, writing={"model.pt"})
    second = cut.take(half, {}, {0: {"": "a"}}, previous_files=committed, writing={"model.pt"})
    assert first.files == committed and second.files == committed  # quiet, but being written
    assert first.held_back == [""] and not first.messages
    assert second.messages == ["checkpoint unit (top-level files) held back for 2 rounds: model.pt was open for "
                               "writing at every round; its last committed version stays until the file is closed"]
    whole = files(**{"model.pt": "v2", "optim.pt": "v2"})
    assert cut.take(whole, {}, {0: {"": "a"}}, previous_files=committed).files == whole  # closed: taken


def test_the_final_sync_after_a_kill_leaves_the_torn_unit_at_its_last_commit(tmp_path):
    cut = QuietCut()
    committed = files(**{"model.pt": "v1", "checkpoint-5/state.json": "5"})
    now = files(**{"model.pt": "v2-torn", "checkpoint-5/state.json": "5", "checkpoint-6/state.json": "6"})
    final = cut.take(now, {}, {0: {}}, previous_files=committed, running=False, writing={"model.pt"})
    assert final.files == {**committed, "checkpoint-6/state.json": now["checkpoint-6/state.json"]}
    assert final.held_back == [""]
    assert final.messages == ["checkpoint unit (top-level files) left out of the final commit: model.pt was open "
                              "for writing when the job was stopped (torn); its last committed version stays"]
    never = cut.take(now, {}, {0: {}}, previous_files=None, running=False, writing={"model.pt"})
    assert "model.pt" not in never.files and never.messages[0].endswith("it was never committed")
    assert cut.take(now, {}, {0: {}}, previous_files=committed, running=False).files == now  # exited by itself
