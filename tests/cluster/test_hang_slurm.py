"""A job that hangs leaves in minutes, on the real cluster: a wrapped job whose trainer is
SIGSTOPped mid-training is found by the wrapper's hang watch, its evidence lands beside the
job's output, its node is drained through root's channel with the hang reason, and the job is
requeued once and resumes on another node from its last committed checkpoint. A job that
never calls `progress()` but logs a line every 5 s is watched through its output file (its
hang, pointing at no node, is counted against its node for the lemon count). No false
positive: a slow restore and first step, and a long checkpoint write, run to their end.

The rule with a fake clock, the evidence of real stopped processes and the wrapper's whole
path without Slurm: tests/unit/test_hang.py.
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

from support import REPO, assert_py_spy_stack, cluster_config_text, need_py_spy, wait_for
from slurmagent.actions.job_channel import ChannelServer
from slurmagent.checkpoint.gcs.ledger import LedgerBucket
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import load
from slurmagent.state import repair_state
from slurmagent.state.decisionlog import DecisionLog, read_records
from test_wrapper_slurm import TOY, ledger_steps

HANG_TIMEOUT_S = 10


@pytest.fixture
def hang_setup(slurm, emu, tmp_path):
    """The config (bucket, [run] hang timeout, a breaker that lets one of three nodes go) and
    root's channel on every node, served in-process as `watch` would."""
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/hang"\nsync_interval_s = 1.0\n'
                      f"grace_s = 10.0\n[run]\nhang_timeout_s = {HANG_TIMEOUT_S}\n[repair]\nmax_drained_fraction = 0.5\n")
    cfg = load(str(config))

    def runner(argv, timeout):
        return subprocess.run(argv, env=c.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    servers = [ChannelServer(cfg, node, Slurm(runner=runner), DecisionLog(slurm.state_dir(node) / "hooks.log"),
                             say=lambda line: None, gpu_fault=lambda: "") for node in c.nodes]
    for s in servers:
        s.start()
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    yield env, config
    for s in servers:
        s.stop()


def submit(env, out, tmp_path, cmd):
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--open-mode=append",
         "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", *cmd], env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def ended(c, job_id, timeout):
    return wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") else None)(
        c.job(job_id)), timeout, "job end")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_stopped_trainer_is_found_its_node_drained_and_the_job_resumes_elsewhere(slurm, hang_setup, tmp_path):
    need_py_spy()
    c = slurm.cluster
    env, _ = hang_setup
    steps, out = tmp_path / "steps", tmp_path / "out"
    job_id = submit(env, out, tmp_path, [sys.executable, TOY, "120", str(steps), "0.2", "progress"])
    c.wait_job(job_id, ("RUNNING",), 60)
    wait_for(lambda: steps.exists() and len(ledger_steps(steps)) >= 22, 90, "22 steps")
    first_node = c.job(job_id)["NodeList"]
    pid = int((tmp_path / "steps.pid").read_text())
    os.kill(pid, signal.SIGSTOP)  # the trainer hangs mid-training: no step, no file, no line any more
    stopped_at = time.monotonic()
    stopped_step = ledger_steps(steps)[-1]
    wait_for(lambda: int(c.job(job_id).get("Restarts", 0)) >= 1, 120, "the requeue")
    print(f"SIGSTOP -> requeued: {time.monotonic() - stopped_at:.1f} s (hang_timeout_s {HANG_TIMEOUT_S})")
    job = ended(c, job_id, 240)
    log = out.read_text()
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 1, log

    said = [line for line in log.splitlines() if "hang: no progress for" in line]
    assert said and f"(limit {HANG_TIMEOUT_S} s" in said[0], log
    # progress() writes at most every 0.25 s: the step it names is at most that much older
    reported = int(re.search(r"rank 0 stopped at step (\d+) \(process stopped \(T\)", said[0]).group(1))
    assert stopped_step - 5 <= reported <= stopped_step, (reported, stopped_step)
    assert "no checkpoint signal to a hung trainer" in log
    node = c.node(first_node)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("slurmagent: hang: "), node
    assert f"rank 0 stopped at step {reported}" in node["Reason"], node
    # drained on root's own look at the rank the wrapper named, not on the wrapper's word
    [granted] = [r for r in read_records(slurm.state_dir(first_node) / "hooks.log") if r.get("op") == "drain"]
    assert granted["verdict"] == "granted" and granted["evidence"] == f"root saw pid {pid} of job {job_id} stopped (T)"

    folder = tmp_path / "out.hang-0"
    ranks = json.loads((folder / "ranks.json").read_text())
    assert [(r["rank"], r["state"], r["step"], r["pid"]) for r in ranks] == [(0, "T", reported, pid)]
    assert (folder / "processes.txt").read_text() and (folder / "summary.txt").read_text()
    # the stopped rank's own Python stack, in the toy trainer
    assert_py_spy_stack((folder / "py-spy-rank-0.txt").read_text(), pid, "toy_trainer.py")

    # resumed from the last committed checkpoint, on another node, no step lost beyond it
    starts = [line.split() for line in steps.read_text().splitlines() if line.startswith("start ")]
    assert len(starts) == 2, starts
    resumed_from = int(starts[1][1])
    assert resumed_from == stopped_step // 5 * 5 and starts[1][2] != f"node={first_node}", starts
    after = ledger_steps(steps)[ledger_steps(steps).index(stopped_step) + 1:]
    assert after == list(range(resumed_from + 1, 121)), after

    records, _ = LedgerBucket(f"gs://ckpt/hang/{job_id}").read_all(deadline_s=60)
    first = {r["attempt"]: r for r in records}[0]
    assert first["end"] == "hang" and first["requeued"], first


LOGGER = """
import os, signal, sys, time
restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
for i in range(5):
    print(f"attempt {restart} line {i}", flush=True)
    time.sleep(5)
if restart == 0:
    os.kill(os.getpid(), signal.SIGSTOP)  # silent from here on
print("done", flush=True)
"""


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_without_progress_calls_is_watched_through_its_output(slurm, hang_setup, tmp_path):
    need_py_spy()
    c = slurm.cluster
    env, _ = hang_setup
    out = tmp_path / "out"
    job_id = submit(env, out, tmp_path, [sys.executable, "-c", LOGGER])
    job = ended(c, job_id, 300)
    log = out.read_text()
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 1, log
    # a line every 5 s for 25 s is never a hang with a 10 s limit; the silence after it is
    assert [line for line in log.splitlines() if line.startswith("attempt 0 line")] == \
        [f"attempt 0 line {i}" for i in range(5)]
    said = [line for line in log.splitlines() if "hang: no progress for" in line]
    assert len(said) == 1 and "last: output" in said[0] and "no node to blame" in said[0], log
    assert "done" in log.splitlines()
    # the evidence lists the job's processes as `PID STATE COMMAND` (a command line may run over
    # several lines): the logger, stopped, is the one process in state T, and py-spy, with no
    # rank to name, dumped it by pid: its stack in the `-c` script
    folder = tmp_path / "out.hang-0"
    listed = re.findall(r"^(\d+) (\S+) (.*)$", (folder / "processes.txt").read_text(), re.M)
    stopped = [(int(p), cmd) for p, state, cmd in listed if state == "T"]
    assert len(stopped) == 1 and stopped[0][1].startswith(f"{sys.executable} -c "), listed
    assert_py_spy_stack((folder / f"py-spy-pid-{stopped[0][0]}.txt").read_text(), stopped[0][0], "<string>")
    # nothing pointed at a node: none drained, and a blameless hang counts against no node (lemon)
    assert "no node to blame: none drained, no hang counted" in said[0], said[0]
    for n in c.nodes:
        assert "DRAIN" not in c.node(n)["State"] and not repair_state.load_state(slurm.state_dir(n)).get("hangs"), n


SLOW_START = """
import time
from slurmagent import trainer
time.sleep(3 * {timeout})  # the trainer's own restore: no line, no file, no progress
time.sleep({timeout} + 5)  # then a slow first step
for step in range(1, 21):
    trainer.progress(step)
    time.sleep(0.2)
print("done", flush=True)
"""

LONG_CHECKPOINT = """
import os, time
from slurmagent import trainer
d = trainer.ckpt_dir()
for step in range(1, 11):
    trainer.progress(step)
    time.sleep(0.2)
with open(d / ".model.pt.tmp", "wb") as fh:  # a checkpoint written for 3x the timeout: no progress(), no line
    for _ in range(3 * {timeout}):
        fh.write(os.urandom(4096))
        fh.flush()
        time.sleep(1)
os.replace(d / ".model.pt.tmp", d / "model.pt")
for step in range(11, 21):
    trainer.progress(step)
    time.sleep(0.2)
print("done", flush=True)
"""


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slow_restore_and_first_step_and_a_long_checkpoint_write_run_to_their_end_untouched(slurm, hang_setup,
                                                                                              tmp_path):
    """No false positive: the first-progress grace (here 6x the timeout) covers a restore of 3x the
    timeout and a slow first step; a checkpoint directory that changes is progress."""
    c = slurm.cluster
    env, config = hang_setup
    config.write_text(config.read_text().replace("[run]\n", f"[run]\nhang_first_progress_s = {6 * HANG_TIMEOUT_S}\n"))
    jobs = {}
    for name, script in (("slow-start", SLOW_START), ("long-checkpoint", LONG_CHECKPOINT)):
        (tmp_path / name).mkdir()
        jobs[name] = submit(env, tmp_path / name / "out", tmp_path / name,
                            [sys.executable, "-c", script.format(timeout=HANG_TIMEOUT_S)])
    for name, job_id in jobs.items():
        job = ended(c, job_id, 240)
        log = (tmp_path / name / "out").read_text()
        assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 0, (name, log)
        assert "done" in log.splitlines() and "hang:" not in log, (name, log)
        assert not list((tmp_path / name).glob("out.hang-*")), name
        print(f"{name}: ran {job['RunTime']} untouched (hang_timeout_s {HANG_TIMEOUT_S})")
    assert not [n for n in c.nodes if "DRAIN" in c.node(n)["State"]]
