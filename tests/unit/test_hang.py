"""A job that hangs leaves in minutes: the stall rule (fake clock), the suspect node, the
stragglers, the ranks' progress files, the evidence of real stopped processes, and the
wrapper's whole hang path (evidence, drain asked, processes killed, requeue) on a real child.

Timing (parallel lanes): nothing here is in the serial group. Process states are asserted
once the kernel shows them (waited for, not slept for); the real child's stall limit is 5 s
against a 0.3 s progress period; its evidence holds the stopped rank's real py-spy stack."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import REPO, wait_for
from slurmagent import trainer
from slurmagent.core.goodput import end_of
from slurmagent.hang import evidence
from slurmagent.hang.monitor import CountingStream, HangMonitor
from slurmagent.run.child import kill_group
from slurmagent.policy.stall import Evidence, RankState, StallRule, StallWatch, StragglerRule, StragglerWatch, suspect
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import EXIT_FLUSHED, Supervisor
from slurmagent.state import progress


# --- the stall rule -----------------------------------------------------------------------------

def test_first_progress_has_its_own_grace():
    w = StallWatch(StallRule(timeout_s=30, first_progress_s=600), started=0.0)
    assert not w.stalled(599)  # a 10-minute restore-and-first-step is not a hang
    assert "after start" in w.stalled(600)


def test_fixed_timeout_counts_from_the_last_progress():
    w = StallWatch(StallRule(timeout_s=30, first_progress_s=600), started=0.0)
    for t in range(0, 100, 5):
        w.progressed(float(t))
        assert not w.stalled(t + 4.9)
    assert not w.stalled(95 + 29)
    assert "no progress for 30 s (limit 30 s" in w.stalled(95 + 30)


def test_adaptive_limit_is_bounded_multiple_of_the_longest_gap():
    w = StallWatch(StallRule(), started=0.0)
    for t in range(10, 200, 5):  # a progress() every 5 s: the floor (120 s) holds, not 25 s
        w.progressed(float(t), "progress")
    assert w.limit() == 120
    still = Evidence(stacks="still", detail="every rank's stack unchanged across 3 samples")
    assert not w.stalled(195 + 119, still) and w.stalled(195 + 120, still)
    w.progressed(195 + 100.0, "checkpoint directory")  # one 100 s gap (a checkpoint save): 5 x 100 = 500 s
    assert w.limit() == 500
    w.progressed(295 + 1000.0)  # a gap longer than anything: the ceiling
    assert w.limit() == 1800


def test_adaptive_a_hang_needs_evidence_and_activity_only_extends_the_limit():
    """Before: 5 x the longest gap (at least 120 s) of silence alone was a hang: a job stepping
    every 0.1 s, then evaluating for 200 s without progress(), was killed on every attempt."""
    rule = StallRule(floor_s=120, ceiling_s=1800, blind_floor_s=600)
    w = StallWatch(rule, started=0.0)
    for t in range(10, 200, 5):
        w.progressed(float(t), "progress")
    at = 195.0
    assert not w.stalled(at + 1000)  # silence, nothing sampled yet: only the ceiling
    assert not w.stalled(at + 1000, Evidence(stacks="moving", detail="rank 0's stack moved"))  # an eval: running
    assert "the ceiling; rank 0's stack moved" in w.stalled(at + 1800, Evidence(stacks="moving", detail="rank 0's stack moved"))
    assert not w.stalled(at + 599, Evidence(stacks="blind", detail="py-spy is not installed"))
    assert "no stacks to show the ranks stuck (py-spy is not installed): the 600 s floor" in w.stalled(
        at + 600, Evidence(stacks="blind", detail="py-spy is not installed"))
    stopped = Evidence(stopped="rank 1 on n2 process stopped (T) (pid 9)")
    assert not w.stalled(at + 119, stopped)
    assert "evidence: rank 1 on n2 process stopped (T) (pid 9)" in w.stalled(at + 120, stopped)
    # an announced phase: no hang while it lasts, whatever the stacks say
    assert not w.stalled(at + 5000, Evidence(phase="rank 0 in 'eval' for 4000 s", stacks="still"))
    # an explicit timeout keeps its meaning: silence alone
    explicit = StallWatch(StallRule(timeout_s=30), started=0.0)
    explicit.progressed(1.0, "progress")
    assert "limit 30 s" in explicit.stalled(31.0, Evidence(stacks="moving"))


def test_the_stacks_verdict_moving_still_blind_or_not_yet():
    from slurmagent.policy.stall import stacks_verdict

    a, b = "all_reduce (torch/distributed/c10d.py:10)\nstep (train.py:5)", "evaluate (train.py:40)\nmain (train.py:60)"
    assert stacks_verdict([{0: a, 1: b}, {0: a, 1: b.replace("40", "41")}], {0, 1}, 3)[0] == "moving"
    assert stacks_verdict([{0: a, 1: a}] * 3, {0, 1}, 3) == (
        "still", "every rank's stack unchanged across 3 samples (in all_reduce (torch/distributed/c10d.py:10))")
    assert stacks_verdict([{0: a, 1: a}] * 2, {0, 1}, 3) == ("", "")  # not enough samples yet
    assert stacks_verdict([{0: a}] * 3, {0, 1}, 3) == ("", "")  # rank 1 unread: never "still" on part of the job
    assert stacks_verdict([{0: a, 1: None}] * 6, {0, 1}, 3)[0] == "blind"
    assert stacks_verdict([{0: None, 1: None}] * 3, {0, 1}, 3)[0] == "blind"
    assert stacks_verdict([{0: a, 1: None}, {0: a.replace("10", "11"), 1: None}], {0, 1}, 3)[0] == "moving"


def test_a_py_spy_dump_gives_the_main_threads_frames():
    from slurmagent.hang.samples import main_frames

    dump = ('Process 9468: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n'
            'Thread 9470 (idle): "Thread-1 (bg)"\n    bg (slp.py:3)\n    Thread.run (threading.py:982)\n'
            'Thread 9468 (active): "MainThread"\n    f (slp.py:6)\n    <module> (slp.py:7)\n')
    assert main_frames(dump) == "f (slp.py:6)\n<module> (slp.py:7)"
    assert main_frames("py-spy is not installed (pip install 'slurmagent[hang]')") is None
    assert main_frames("Error: Permission Denied (os error 13)\n(py-spy exit 1)") is None


def test_adaptive_learns_no_pace_from_output_and_checkpoint_files_alone():
    """A trainer that logs at start, then trains (or compiles, or evaluates) in silence is not
    hung: without the ranks' own progress() the adaptive limit is the ceiling."""
    w = StallWatch(StallRule(), started=0.0)
    for t in range(10, 60, 5):  # start-up lines every 5 s, then nothing
        w.progressed(float(t), "output")
    w.progressed(70.0, "checkpoint directory")
    assert w.limit() == 1800 and not w.stalled(70 + 1799)
    assert "no trainer.progress from the ranks, so the ceiling" in w.stalled(70 + 1800)
    w.progressed(100.0, "progress on other nodes")  # a rank's own progress: from now on it learns
    assert w.limit() == 5 * (100 - 70)
    explicit = StallWatch(StallRule(timeout_s=30), started=0.0)
    explicit.progressed(5.0, "output")  # an explicit timeout holds for every signal
    assert explicit.limit() == 30


def test_a_ten_minute_checkpoint_that_writes_files_is_never_flagged():
    w = StallWatch(StallRule(timeout_s=60, first_progress_s=600), started=0.0)
    w.progressed(5.0)
    for t in range(7, 7 + 600, 2):  # the poll sees the checkpoint directory change every 2 s
        w.progressed(float(t))
        assert not w.stalled(t + 1.0)


def test_off_never_flags():
    w = StallWatch(StallRule(timeout_s=0), started=0.0)
    assert w.limit() is None and not w.stalled(1e9)


# --- the suspect node ------------------------------------------------------------------------------

def test_a_stopped_rank_names_its_node():
    ranks = [RankState(0, "n1", 10, "S", 41, 100.0), RankState(1, "n2", 11, "T", 41, 100.0)]
    node, detail = suspect(ranks)
    assert node == "n2" and detail.startswith("rank 1 stopped at step 41 (process stopped (T)")


def test_a_gone_rank_names_its_node():
    node, detail = suspect([RankState(0, "n1", 10, "S", 3, 1.0), RankState(1, "n1", 11, "gone", 2, 1.0)])
    assert node == "n1" and "process gone" in detail


def test_nothing_points_at_a_node_then_none_is_named():
    node, why = suspect([RankState(0, "n1", 10, "S", 3, 1.0), RankState(1, "n1", 11, "S", 3, 50.0)])
    assert node == "" and "no node to blame" in why  # one node: the rank that stopped first says nothing


def test_the_rank_that_stopped_first_names_its_node_across_nodes():
    node, detail = suspect([RankState(0, "n1", 10, "S", 9, 100.0), RankState(1, "n2", 11, "D", 7, 40.0)])
    assert node == "n2" and "60 s before any other rank" in detail


def test_a_gpu_fault_on_one_node_names_it():
    node, detail = suspect([RankState(0, "n1", 10, "D", 9, 100.0)], {"n1": "xid 79 on gpu 3"})
    assert node == "n1" and "xid 79" in detail


# --- stragglers --------------------------------------------------------------------------------

def _run_stragglers(slow_factor: float, windows: int = 6) -> list:
    sw = StragglerWatch(StragglerRule(window_s=60, factor=2.0, windows=3))
    found, t = [], 0.0
    while t <= 60 * windows:
        found += [(t, *f) for f in sw.observe(t, {0: (t, int(t)), 1: (t, int(t / slow_factor))})]
        t += 2
    return found


def test_a_rank_three_times_slower_is_reported_after_three_windows_once():
    found = _run_stragglers(3.0)
    assert len(found) == 1 and found[0][1] == 1
    assert 180 <= found[0][0] <= 240 and found[0][2] == pytest.approx(3.0, rel=0.1)


def test_ranks_at_the_same_pace_are_never_stragglers():
    assert _run_stragglers(1.2) == []


# --- the ranks' progress files -------------------------------------------------------------------

def test_progress_writes_at_most_once_a_second(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMAGENT_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    trainer.reset()
    trainer.progress(7)
    trainer.progress(8)  # within the second: a clock read only
    got = progress.read_all(tmp_path)
    assert list(got) == [3] and got[3].step == 7 and got[3].pid == os.getpid()
    monkeypatch.setattr(trainer, "_progress_due", 0.0)
    trainer.progress(9)
    assert progress.read_all(tmp_path)[3].step == 9
    trainer.reset()


def test_progress_outside_the_wrapper_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMAGENT_PROGRESS_DIR", raising=False)
    trainer.reset()
    trainer.progress(1)
    monkeypatch.setenv("SLURMAGENT_PROGRESS_DIR", str(tmp_path / "gone"))
    monkeypatch.setattr(trainer, "_progress_due", 0.0)
    trainer.progress(2)  # a directory that is not there: training goes on
    assert not (tmp_path / "gone").exists()
    trainer.reset()


def test_malformed_progress_files_are_skipped(tmp_path):
    (tmp_path / "rank-0").write_text("not numbers\n")
    (tmp_path / "rank-x").write_text("1 2 3\n")
    progress.write(tmp_path, 1, 5, 100.0)
    assert list(progress.read_all(tmp_path)) == [1]


# --- evidence from real processes ------------------------------------------------------------------

def state_of(pid: int) -> str:
    """The state letter of /proc/<pid>/stat, read here without the code under test."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_states_of_a_stopped_a_running_and_a_gone_rank(tmp_path):
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        # the states are the kernel's once it got there (a loaded machine may take a while to run
        # `sleep` up to its sleep, and the stopped one up to its stop)
        wait_for(lambda: [state_of(p.pid) for p in procs] == ["S", "T"], 30, "one sleeping, one stopped")
        reports = {i: progress.RankProgress(i, 10 + i, 1.0, p.pid) for i, p in enumerate([*procs, gone])}
        states = {r.rank: r.state for r in evidence.rank_states(reports, "n1")}
        assert states == {0: "S", 1: "T", 2: "gone"}
        assert suspect(evidence.rank_states(reports, "n1"))[1].startswith("rank 1 stopped at step 11")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_evidence_folder_beside_the_output_file_never_over_an_old_one(tmp_path):
    out = tmp_path / "slurm-5.out"
    first = evidence.evidence_dir(out, tmp_path, "x", 2)
    assert first == tmp_path / "slurm-5.out.hang-2"
    evidence.write_folder(first, {"summary.txt": "s\n"})
    assert evidence.evidence_dir(out, tmp_path, "x", 2) == tmp_path / "slurm-5.out.hang-2.2"
    assert evidence.evidence_dir(None, tmp_path, "slurmagent-5", 0) == tmp_path / "slurmagent-5.hang-0"


def test_py_spy_missing_is_said(monkeypatch):
    monkeypatch.setattr(evidence.shutil, "which", lambda name: None)
    assert "py-spy is not installed" in evidence.py_spy_dumps([1])[1]


# --- the output file as the only signal ----------------------------------------------------------

def test_a_growing_output_file_is_progress_and_its_silence_a_hang(tmp_path):
    now = [0.0]
    out = open(tmp_path / "out", "a")
    mon = HangMonitor(StallRule(timeout_s=10, first_progress_s=10), progress_dir=tmp_path / "p",
                      ckpt_dir=tmp_path / "ck", node="n1", job="5", attempt=0, say=lambda s: None, poll_s=1,
                      clock=lambda: now[0], out_fds=(out.fileno(),))
    child = type("C", (), {"pid": 1})()
    for t in range(0, 60):  # a log line every 5 s
        now[0] = float(t)
        if t % 5 == 0:
            out.write("step\n")
            out.flush()
        assert mon.poll(child) == ""
    for t in range(60, 65):  # the last line came at 55 s
        now[0] = float(t)
        assert mon.poll(child) == ""
    now[0] = 65.0
    assert mon.poll(child).startswith("hang: no progress for 10 s (limit 10 s; last: output)")
    out.close()


# --- the wrapper's whole hang path on a real child ------------------------------------------------

HUNG_TRAINER = """
import os, signal, sys, time
from slurmagent import trainer

def all_reduce_that_never_returns():
    os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 stops mid-training, as a hung rank would

for step in range(5):
    trainer.progress(step)
    time.sleep(0.3)
    trainer._progress_due = 0.0
trainer.progress(5)
all_reduce_that_never_returns()
"""


def py_spy_here(monkeypatch) -> bool:
    """py-spy on PATH, from this interpreter's environment (the lanes install it in their venv,
    which is not on their PATH); False where it is missing, a failure in CI."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if shutil.which("py-spy"):
        return True
    if os.environ.get("CI"):
        pytest.fail("py-spy is missing in CI: the test extra installs it (pip install -e '.[test]')")
    return False


def test_a_hung_child_is_stopped_with_evidence_its_node_asked_to_drain_and_requeued(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    spy = py_spy_here(monkeypatch)
    opts = RunOptions(cmd=[sys.executable, "-c", HUNG_TRAINER], ckpt_dir=tmp_path / "ck", grace_s=60,
                      sync_interval_s=3600)
    (tmp_path / "ck").mkdir(mode=0o700)
    err, requeued, drains = io.StringIO(), [], []
    env = dict(os.environ, SLURMAGENT_PROGRESS_DIR=str(tmp_path / "progress"))
    (tmp_path / "progress").mkdir()
    sup = Supervisor(opts, JobIdentity("slurm", "77", "77", 2), None, requeued.append, env, err)
    # 5 s without progress: the trainer reports every 0.3 s, so only its stop is a hang, even
    # on a loaded machine where a running trainer may wait a second or two for a CPU
    sup.hang = HangMonitor(StallRule(timeout_s=5, first_progress_s=30), progress_dir=tmp_path / "progress",
                           ckpt_dir=tmp_path / "ck", node="n1", job="77", attempt=2, say=sup.say,
                           ask_drain=lambda n, d, pid: drains.append(d) or "granted", poll_s=0.2, out_fds=(),
                           gpu_state=lambda: ('{"node": "n1"}', ""))
    outcome = sup.run()
    text = err.getvalue()
    assert outcome.exit_code == EXIT_FLUSHED and requeued == ["77"] and outcome.child_killed, text
    assert outcome.flush_cause.startswith("hang: no progress for 5 s")
    assert end_of(flushed=True, flush_cause=outcome.flush_cause, child_code=outcome.child_code)[0] == "hang"
    assert drains == [drains[0]] and drains[0].startswith("rank 0 stopped at step 5 (process stopped (T)"), drains
    folder = tmp_path / "slurmagent-77.hang-2"
    assert '"state": "T"' in (folder / "ranks.json").read_text()
    assert {"summary.txt", "processes.txt", "gpu-n1.json", "py-spy-rank-0.txt"} <= {p.name for p in folder.iterdir()}
    stack = (folder / "py-spy-rank-0.txt").read_text()
    if spy:  # the stopped rank's real Python stack, innermost frame first (py-spy dump)
        assert "\nThread " in stack, stack
        frames = [line.strip() for line in stack.split("\nThread ", 1)[1].splitlines()[1:]]
        assert frames[0].startswith("all_reduce_that_never_returns (<string>:") and frames[1].startswith(
            "<module> (<string>:"), stack
    else:
        assert "py-spy is not installed" in stack, stack
    assert "no checkpoint signal to a hung trainer" in text and "asking the job to checkpoint" not in text
    assert f"evidence in {folder}" in text


def test_the_wrappers_own_lines_in_the_output_are_not_progress(tmp_path):
    now = [0.0]
    out = open(tmp_path / "out", "a")
    own = CountingStream(out)
    mon = HangMonitor(StallRule(timeout_s=10, first_progress_s=10), progress_dir=tmp_path / "p",
                      ckpt_dir=tmp_path / "ck", node="n1", job="5", attempt=0, say=lambda s: None, poll_s=1,
                      clock=lambda: now[0], out_fds=(out.fileno(),), own_stream=own)
    child = type("C", (), {"pid": 1})()
    assert mon.poll(child) == ""
    for t in range(1, 10):
        now[0] = float(t)
        own.write("slurmagent run: checkpoint: last commit ...\n")  # the wrapper's report, every second
        own.flush()
        assert mon.poll(child) == ""
    now[0] = 10.0
    assert mon.poll(child).startswith("hang: no progress 10 s after start")
    out.close()


def _monitor(tmp_path, now, **kw):
    return HangMonitor(StallRule(timeout_s=10, first_progress_s=30), progress_dir=tmp_path / "p",
                       ckpt_dir=tmp_path / "ck", node="n1", job="5", attempt=0, poll_s=1, clock=lambda: now[0],
                       out_fds=(), **kw)


def test_a_checkpoint_written_for_three_times_the_timeout_is_not_a_hang(tmp_path):
    now, child = [0.0], type("C", (), {"pid": 1})()
    (tmp_path / "ck").mkdir()
    (tmp_path / "p").mkdir()
    mon = _monitor(tmp_path, now, say=lambda s: None)
    progress.write(tmp_path / "p", 0, 1, 0.0)
    assert mon.poll(child) == ""
    now[0] = 1.0
    progress.write(tmp_path / "p", 0, 2, 1.0)
    assert mon.poll(child) == ""
    with open(tmp_path / "ck" / ".model.pt.tmp", "ab") as fh:  # 30 s of writing, no progress() call
        for t in range(2, 33):
            now[0] = float(t)
            fh.write(b"x" * 4096)
            fh.flush()
            assert mon.poll(child) == "", t
    now[0] = 42.0
    assert "last: checkpoint directory" in mon.poll(child)


def test_a_straggler_rank_is_said_with_its_node_and_rank(tmp_path):
    now, child, said, reported = [0.0], type("C", (), {"pid": 1})(), [], []
    (tmp_path / "p").mkdir()
    mon = _monitor(tmp_path, now, say=said.append, straggler=StragglerRule(window_s=10, factor=2.0, windows=3),
                   straggler_report=lambda rank, detail, node: reported.append((rank, node)))
    for t in range(0, 60):
        now[0] = float(t)
        progress.write(tmp_path / "p", 0, t, float(t))
        progress.write(tmp_path / "p", 1, t // 3, float(t))  # three times slower
        assert mon.poll(child) == ""
    assert reported == [(1, "n1")]
    assert [s for s in said if s.startswith("straggler on node n1: rank 1 straggles")], said


def test_a_stopped_rank_does_not_outlive_its_launcher(tmp_path):
    launcher = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                "'import os, signal; os.kill(os.getpid(), signal.SIGSTOP)']); print(p.pid, flush=True); "
                "import time; time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    rank = int(child.stdout.readline())
    assert wait_state(rank, "T")
    assert kill_group(child, print) is True
    assert wait_state(rank, "gone"), evidence.proc_stat(rank)  # SIGKILL lands a moment later; a stop would stay


def wait_state(pid: int, state: str, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s  # a bound for a loaded machine: the states come, or never do
    while True:
        st = evidence.proc_stat(pid)
        if (st[0] if st is not None else "gone") in ((state, "Z") if state == "gone" else (state,)):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def test_the_flight_recorder_of_each_rank_is_asked_through_its_pipe_and_nothing_else_is_written(tmp_path):
    stem = str(tmp_path / "fr_")
    env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "trace_")}
    os.mkfifo(f"{stem}1.pipe")
    reader = os.open(f"{stem}1.pipe", os.O_RDONLY | os.O_NONBLOCK)  # what ProcessGroupNCCL holds open
    os.mkfifo(f"{stem}3.pipe")  # a pipe nobody reads: must not block
    Path(f"{stem}2.pipe").write_text("keep")  # a regular file under the name: never written
    os.symlink(f"{stem}1.pipe", f"{stem}4.pipe")  # a link, even to a pipe: never followed
    try:
        text = evidence.flight_recorder_dumps([0, 1, 2, 3, 4], env)
        assert os.read(reader, 16) == b"1\n"
    finally:
        os.close(reader)
    lines = text.splitlines()
    assert len(lines) == 5 and all(line.startswith("NCCL flight recorder (TORCH_NCCL_DEBUG_INFO_PIPE_FILE, "
                                                   "TORCH_NCCL_TRACE_BUFFER_SIZE=2000): rank ") for line in lines)
    assert f"rank 1: dump asked through {stem}1.pipe; PyTorch writes it to {tmp_path}/trace_1" in text
    assert "rank 0: " in text and "No such file or directory: no dump asked" in lines[0]
    assert f"rank 2: {stem}2.pipe is not a pipe: not written" in text
    assert "rank 3: " in lines[3] and "no dump asked" in lines[3]  # ENXIO: no reader
    assert f"rank 4: {stem}4.pipe is not a pipe: not written" in text
    assert Path(f"{stem}2.pipe").read_text() == "keep"


def test_no_flight_recorder_ask_without_the_jobs_settings():
    assert evidence.flight_recorder_dumps([0, 1], {}) == ""
    said = evidence.flight_recorder_dumps([0], {"TORCH_FR_DEBUG_INFO_PIPE_FILE": "/nonexistent/fr_"})
    assert said.startswith("NCCL flight recorder: TORCH_FR_DEBUG_INFO_PIPE_FILE is set but ") and "none asked" in said


def _adaptive(tmp_path, now, dumps, **kw):
    """A monitor under the default rule (a 10 s floor here), its ranks' stacks from `dumps()`."""
    rule = StallRule(first_progress_s=30, floor_s=10, ceiling_s=100, blind_floor_s=60)
    return HangMonitor(rule, progress_dir=tmp_path / "p", ckpt_dir=tmp_path / "ck", node="n1", job="5", attempt=0,
                       poll_s=1, clock=lambda: now[0], out_fds=(), wall=lambda: 1000.0 + now[0],
                       py_spy=lambda pids: {p: dumps() for p in pids}, **kw)


def _silence(mon, now, child, until: float) -> str:
    """Poll every second to `until`, letting each stack sample the monitor starts finish."""
    while now[0] < until:
        now[0] += 1.0
        cause = mon.poll(child)
        if cause:
            return cause
        deadline = time.monotonic() + 5
        while mon.stack_samples is not None and mon.stack_samples._running and time.monotonic() < deadline:
            time.sleep(0.005)
    return ""


def _stepping(tmp_path, now, mon, child) -> None:
    (tmp_path / "p").mkdir(exist_ok=True)
    for t in range(0, 10):  # ranks 0 and 1 (this process: alive, not stopped) step every second
        now[0] = float(t)
        for rank in (0, 1):
            progress.write(tmp_path / "p", rank, t, 1000.0 + t)
        assert mon.poll(child) == ""


def test_a_silent_eval_whose_stack_moves_is_not_a_hang_until_the_ceiling(tmp_path):
    now, child, said = [0.0], type("C", (), {"pid": 1})(), []
    line = [0]

    def moving():  # rank stacks in the evaluation loop, a new line each sample
        line[0] += 1
        return f'Thread 1 (active): "MainThread"\n    evaluate (train.py:{line[0]})\n    main (train.py:90)\n'

    mon = _adaptive(tmp_path, now, moving, say=said.append)
    _stepping(tmp_path, now, mon, child)
    assert _silence(mon, now, child, 9 + 99) == ""  # far past the 10 s short limit: running
    cause = _silence(mon, now, child, 9 + 101)
    assert "(limit 100 s, adaptive: the ceiling; rank 0's stack moved across" in cause, cause
    assert not said  # py-spy is there: nothing said at start


def test_every_rank_stuck_at_one_frame_is_a_hang_at_the_short_limit(tmp_path):
    now, child = [0.0], type("C", (), {"pid": 1})()
    stuck = 'Thread 1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2501)\n    step (train.py:12)\n'
    mon = _adaptive(tmp_path, now, lambda: stuck, say=lambda s: None)
    _stepping(tmp_path, now, mon, child)
    cause = _silence(mon, now, child, 9 + 100)
    assert cause.startswith("hang: no progress for 1") and "evidence: every rank's stack unchanged across 3 samples" in cause
    assert int(cause.split("no progress for ")[1].split(" ")[0]) <= 10 + 2  # the short limit, the samples in it


def test_a_rank_in_an_announced_phase_keeps_the_job_from_being_silent(tmp_path):
    now, child = [0.0], type("C", (), {"pid": 1})()
    stuck = 'Thread 1 (idle): "MainThread"\n    barrier (torch/distributed/distributed_c10d.py:4000)\n'
    mon = _adaptive(tmp_path, now, lambda: stuck, say=lambda s: None)
    _stepping(tmp_path, now, mon, child)
    progress.write_phase(tmp_path / "p", 0, "eval", 1000.0 + 9, 50.0)  # rank 0 evaluates, rank 1 waits at a barrier
    assert _silence(mon, now, child, 9 + 49) == ""  # within the phase's 50 s (and its start is no pace)
    cause = _silence(mon, now, child, 9 + 100)  # past its expected time: silent again, stuck
    assert "evidence: every rank's stack unchanged" in cause and "last: phases" in cause, cause
    assert now[0] <= 9 + 50 + 10, now  # soon after the phase's end: the samples were taken meanwhile


def test_without_stacks_the_limit_is_the_blind_floor_and_it_is_said_at_start(tmp_path):
    now, child, said = [0.0], type("C", (), {"pid": 1})(), []
    mon = _adaptive(tmp_path, now, lambda: "", say=said.append, stacks="py-spy is not installed")
    assert said == ["hang watch: py-spy is not installed: no stacks to show the ranks stuck, so a silence is a hang "
                    "only after 60 s at least (a stopped, gone or zombie rank sooner)"]
    _stepping(tmp_path, now, mon, child)
    assert _silence(mon, now, child, 9 + 59) == ""
    assert "the 60 s floor" in _silence(mon, now, child, 9 + 61)


def test_a_py_spy_sample_of_a_healthy_rank_never_reads_as_a_stopped_rank(tmp_path):
    """py-spy without --nonblocking ptrace-stopped the rank it read (`t`), which the stall rule took
    for a stopped rank. Now every dump is non-blocking and a tracer's `t` is no evidence."""
    from slurmagent.policy.stall import STOPPED_STATES

    assert "t" not in STOPPED_STATES
    if evidence.py_spy_exe() is None:
        pytest.skip("py-spy is not installed")
    rank = subprocess.Popen([sys.executable, "-c", "while True: sum(range(1000))"])
    try:
        time.sleep(1.0)
        seen = set()
        done = threading.Event()

        def watch_state():
            while not done.is_set():
                st = evidence.proc_stat(rank.pid)
                if st:
                    seen.add(st[0])

        t = threading.Thread(target=watch_state)
        t.start()
        for _ in range(5):
            dump = evidence.py_spy_dumps([rank.pid])[rank.pid]
        done.set()
        t.join()
        assert "<module>" in dump and "t" not in seen and "T" not in seen, (seen, dump)
    finally:
        rank.kill()
        rank.wait()


def test_a_rank_stuck_outside_the_collective_the_others_wait_in_names_its_node():
    from slurmagent.policy.stall import suspect

    ranks = [RankState(0, "n1", 10, "S", 40, 100.0), RankState(1, "n2", 11, "S", 40, 100.0)]
    frames = {0: "allreduce (torch/distributed/distributed_c10d.py:2501)\n<module> (toy.py:50)",
              1: "<module> (toy.py:47)"}
    assert suspect(ranks, frames=frames) == ("n2", "rank 1 stuck outside the collective the other ranks wait in "
                                                   "(at <module> (toy.py:47), step 40)")
    both_waiting = {0: frames[0], 1: frames[0]}
    assert suspect(ranks, frames=both_waiting)[0] == ""  # every rank in the collective: no node to blame


def test_the_watch_knows_the_steps_and_the_pace_the_ranks_showed_for_the_reports_recompute(tmp_path):
    now, child = [0.0], type("C", (), {"pid": 1})()
    mon = _adaptive(tmp_path, now, lambda: "", say=lambda line: None)
    assert mon.progress_steps() == (None, None, None) and mon.current_step() is None
    (tmp_path / "p").mkdir()
    for t in range(3, 12):  # steps 30..110, one every 0.5 s of the ranks' own clocks, polled every second
        now[0] = float(t)
        for rank in (0, 1):
            progress.write(tmp_path / "p", rank, 10 * t, 1000.0 + 5 * t)
        mon.poll(child)
    assert mon.progress_steps() == (30, 110, 0.5) and mon.current_step() == 110
