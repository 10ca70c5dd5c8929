"""Issue 37: under the default rule (limits shortened by config: a 10 s short limit, a 90 s
ceiling, a 30 s floor without stacks), no healthy job is called hung and a hung one still leaves.

A 2-node gloo job (tests/support/toy_gloo_silent.py) steps every 50 ms, then goes silent for
25 s -- 2.5 times its short limit -- the healthy ways: every rank evaluating, rank 0
evaluating while rank 1 waits at a barrier, a blocking sleep inside `trainer.phase("eval")`, a
save to memory that writes no file. Each ends COMPLETED with no restart and no hang counted
(before: each was killed at the short limit on every attempt). Then the hung ways: rank 1
sleeping forever before the all-reduce rank 0 waits in (every stack still across the samples:
requeued soon after the short limit, rank 1's node named), the same with stack samples turned
off (requeued only after the 30 s floor), and rank 1 SIGSTOPped (requeued, its node drained).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support import REPO, SUPPORT, need_module, need_py_spy, wait_for
from slurmagent.checkpoint.gcs.ledger import LedgerBucket
from slurmagent.devtools.localcluster import free_ports
from slurmagent.state import repair_state
from test_fault_slurm import land_on, restarts
from test_hang_multinode import served_env
from test_multinode import ledger, nodes_of, submit, wait_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
need_module("torch")

TOY = str(SUPPORT / "toy_gloo_silent.py")
FLOOR_S, CEILING_S, BLIND_S, SILENT_S = 10, 90, 30, 25  # CPU-busy silences: kept short (2 cores shared)
RULE = (f"[run]\nhang_floor_s = {FLOOR_S}\nhang_ceiling_s = {CEILING_S}\nhang_blind_floor_s = {BLIND_S}\n"
        "hang_first_progress_s = 60\n")


@pytest.fixture
def default_rule(cl, tmp_path):
    yield from served_env(cl, tmp_path, 'grace_s = 20.0\n' + RULE + '[repair]\nmax_drained_fraction = 0.5\n')


@pytest.fixture
def no_stacks(cl, tmp_path):
    yield from served_env(cl, tmp_path, 'grace_s = 20.0\n' + RULE + 'hang_stack_samples = false\n'
                                        '[repair]\nmax_drained_fraction = 0.5\n')


def start(cl, emu, env, tmp_path, mode: str, total: int = 100, at: int = 40, save_every: int = 20):
    (tmp_path / "ledger").mkdir()
    job, running = land_on(cl, "n1,n2", lambda: submit(
        cl, tmp_path, emu.url, [], [sys.executable, TOY, str(total), str(tmp_path / "ledger"), mode, str(at),
                                    str(SILENT_S)],
        config=env.config, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
        TMPDIR=str(cl.local_path / "tmp"), TOY_SAVE_EVERY=str(save_every)))
    return job, running


def stamp(path) -> float | None:
    """A rank's silence stamp, once it is written whole."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def job_srun(ledger_dir) -> int:
    """The pid of the `srun` that runs the toy's ranks (its argv names their ledger folder)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"srun" and str(ledger_dir).encode() in argv:
            return int(entry)
    raise AssertionError(f"no srun of {ledger_dir}")


def watch_redo(tmp_path, restored: int, until: int) -> float:
    """Seconds the next attempt's rank 0 takes from its start (at the restored step) to step
    `until`, read from its log as it grows (every 20 ms)."""
    def attempt_lines():
        lines = ledger(tmp_path, 0)
        starts = [i for i, line in enumerate(lines) if line.startswith("start ")]
        return lines[starts[-1]:] if len(starts) >= 2 else []

    wait_for(lambda: attempt_lines(), 120, "the next attempt's start", interval=0.02)
    began = time.monotonic()
    assert attempt_lines()[0].startswith(f"start {restored} "), attempt_lines()[:1]
    wait_for(lambda: f"step {until}" in attempt_lines(), 120, f"step {until} again", interval=0.02)
    return time.monotonic() - began


def hangs_counted(env, nodes) -> int:
    return sum(len(v) for n in nodes for v in repair_state.load_state(env.state_dir(n)).get("hangs", {}).values())


@pytest.mark.parametrize("mode", ["eval-all", "eval-rank0", "eval-phase", "save-nofile"])
def test_a_long_silence_of_a_healthy_job_is_not_a_hang(cl, emu, default_rule, tmp_path, mode):
    need_py_spy()
    env = default_rule
    job, running = start(cl, emu, env, tmp_path, mode)
    end = wait_end(cl, job, 240)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", out
    assert "hang:" not in out, out
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        assert f"silent {mode}" in lines and "talking again" in lines and lines[-1] == "done", lines
    assert hangs_counted(env, cl.nodes) == 0


def test_a_rank_sleeping_before_the_collective_is_a_hang_soon_after_the_short_limit(cl, emu, default_rule, tmp_path):
    need_py_spy()
    env = default_rule
    # saves every 100 steps, silent at step 190: the next attempt redoes steps 101-190
    job, running = start(cl, emu, env, tmp_path, "sleep-forever", total=200, at=190, save_every=100)
    wait_for(lambda: "silent sleep-forever" in ledger(tmp_path, 1), 120, "rank 1 asleep")
    asleep = time.monotonic()
    silent_at = wait_for(lambda: stamp(tmp_path / "ledger" / "rank0.silent"), 30, "rank 0's silence stamp")
    step = job_srun(tmp_path / "ledger")  # the wrapper's child: the hang watch kills it (the ranks go at the requeue)
    killed_at = wait_for(lambda: None if os.path.exists(f"/proc/{step}") else time.time(), 120,
                         "the job step killed", interval=0.02)
    wait_for(lambda: restarts(cl, job) >= 1, 120, "the requeue")
    took = time.monotonic() - asleep
    redo_s = watch_redo(tmp_path, 100, 190)
    end = wait_end(cl, job, 240)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", out
    [said] = [line for line in out.splitlines() if "hang: no progress for" in line]
    assert "evidence: every rank's stack unchanged across 3 samples" in said, said
    first = nodes_of_attempt(tmp_path, 1)
    assert f"rank 1 stuck outside the collective the other ranks wait in" in said and f"drain of {first}" in said, said
    # root on that node sees rank 1 alive (asleep): no drain on a word, the hang counted against that node only
    assert f"the hang counted against {first} instead: granted: counted against {first}" in said, said
    assert list(repair_state.load_state(env.state_dir(first)).get("hangs", {})) == [first]
    assert took < FLOOR_S + 45, (took, said)  # the short limit, its samples, the evidence and the requeue
    print(f"asleep -> requeued: {took:.1f} s (short limit {FLOOR_S} s)")
    # the report: the wait for the hang watch is its own cause, not recompute
    records, _ = LedgerBucket(f"gs://ckpt/jobs/{job}").read_all(deadline_s=60)
    shown = subprocess.run([sys.executable, "-m", "slurmagent.entry", "report", "--remote", "gs://ckpt/jobs",
                            "--job", job, "--json"], env=dict(cl.env, SLURMAGENT_CONFIG=str(env.config),
                                                              PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url),
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    [report] = json.loads(shown.stdout)["jobs"]
    hung = next(a for a in report["attempts"] if a["attempt"] == 0)
    waited = killed_at - silent_at  # measured here: the rank's own stamp -> the step's srun gone
    detection, recompute = hung["seconds"]["hang_detection"], hung["seconds"]["recompute"]
    print(f"hang detection {detection:.2f} s (measured {waited:.2f} s), recompute {recompute:.2f} s "
          f"(measured redo {redo_s:.2f} s)")
    raw = {k: records[0].get(k) for k in ("last_progress", "ended", "flush_s", "started")} if records else {}
    assert hung["end"] == "hang" and abs(detection - waited) <= 0.1 * waited + 1.0, (
        detection, waited, silent_at, killed_at, raw, said)
    # the steps after the last commit at the job's pace, not the time since the commit's upload
    assert abs(recompute - redo_s) <= 0.1 * redo_s + 1.0, (recompute, redo_s, hung)


def test_without_stacks_the_same_hang_waits_out_the_floor(cl, emu, no_stacks, tmp_path):
    env = no_stacks
    job, running = start(cl, emu, env, tmp_path, "sleep-forever")
    wait_for(lambda: "silent sleep-forever" in ledger(tmp_path, 1), 120, "rank 1 asleep")
    asleep = time.monotonic()
    wait_for(lambda: restarts(cl, job) >= 1, 180, "the requeue")
    took = time.monotonic() - asleep
    out = (tmp_path / "out").read_text()
    assert "hang watch: stack samples are off ([run] hang_stack_samples): no stacks to show the ranks stuck, " \
           f"so a silence is a hang only after {BLIND_S} s at least" in out, out
    [said] = [line for line in out.splitlines() if "hang: no progress for" in line]
    assert f"the {BLIND_S} s floor" in said, said
    assert BLIND_S <= took < BLIND_S + 45, (took, said)
    assert wait_end(cl, job, 240)["JobState"] == "COMPLETED"
    print(f"asleep -> requeued without stacks: {took:.1f} s (floor {BLIND_S} s)")


def test_a_stopped_rank_under_the_default_rule_is_requeued_and_its_node_drained(cl, emu, default_rule, tmp_path):
    env = default_rule
    job, running = start(cl, emu, env, tmp_path, "none", total=400)
    wait_for(lambda: len([x for x in ledger(tmp_path, 1) if x.startswith("step ")]) >= 60, 120, "60 steps")
    other = nodes_of_attempt(tmp_path, 1)
    os.kill(int((tmp_path / "ledger" / "rank1.pid").read_text()), signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: restarts(cl, job) >= 1, 120, "the requeue")
    took = time.monotonic() - stopped
    out = (tmp_path / "out").read_text()
    [said] = [line for line in out.splitlines() if "hang: no progress for" in line]
    assert "evidence: rank 1 on" in said and "process stopped (T)" in said, said
    assert f"drain of {other} asked: granted" in said, said
    assert "DRAIN" in cl.node(other)["State"]
    assert took < FLOOR_S + 30, (took, said)
    assert wait_end(cl, job, 240)["JobState"] == "COMPLETED"
    print(f"SIGSTOP -> requeued: {took:.1f} s (short limit {FLOOR_S} s)")


def nodes_of_attempt(tmp_path, rank: int) -> str:
    """The node a rank started on in the first attempt (its ledger's first `start` line)."""
    first = next(line for line in ledger(tmp_path, rank) if line.startswith("start "))
    return re.search(r"node=(\S+)", first).group(1)
