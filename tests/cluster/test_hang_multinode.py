"""A multi-node job that hangs, on the 4-node cluster with node-local disks (and node-local
TMPDIR, so each rank's `progress()` file stays on its own node as on real VMs): two ranks in
lockstep over CPU gloo; rank 1 is SIGSTOPped and rank 0 blocks in its all-reduce. The batch
step's hang watch sees it, its evidence holds both ranks (rank 1's state as node 2's agent
saw it), the stopped rank's node (not the batch node) is drained through the batch node's
root channel, and the job is requeued once and resumes from its last committed checkpoint.

The rules and the agents' reports without Slurm: tests/unit/test_hang_remote.py.
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

from support import (SUPPORT, SlurmEnv, assert_py_spy_stack, cluster_config_text, healthy_snapshot_dict,
                     need_module, need_py_spy, wait_for)
from slurmagent.actions.job_channel import ChannelServer
from slurmagent.devtools.localcluster import free_ports
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import load
from slurmagent.state.decisionlog import DecisionLog, read_records
from test_fault_slurm import land_on, restarts
from test_multinode import committed, committed_file, ledger, nodes_of, starts, steps, submit, wait_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
need_module("torch")

GLOO = str(SUPPORT / "toy_gloo.py")
HANG_TIMEOUT_S = 10
EVERY = 100  # steps between checkpoints: 10 s quiet between saves, so a busy machine still commits


def served_env(cl, tmp_path, middle: str):
    """The config (bucket, a sync round every second, `middle` for the [checkpoint] section's
    rest and what follows), healthy nodes with a node-local TMPDIR, and root's channel on every
    node, served in-process as `watch` would. A generator: a fixture yields from it."""
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(tmp_path) + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 1.0\n'
                      + middle + '[expiry]\npublish_run_file = false\n')
    env = SlurmEnv(cl, tmp_path, config)
    for n in cl.nodes:
        env.set_snapshot(n, healthy_snapshot_dict(hostname=n))
        (tmp_path / "kern").mkdir(exist_ok=True)
        (tmp_path / "kern" / f"{n}.log").touch()
        (cl.node_dir(n) / "tmp").mkdir()
    cfg = load(str(config))

    def runner(argv, timeout):
        return subprocess.run(argv, env=cl.env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    servers = [ChannelServer(cfg, n, Slurm(runner=runner), DecisionLog(env.state_dir(n) / "hooks.log"),
                             say=lambda line: None, gpu_fault=lambda: "") for n in cl.nodes]
    for s in servers:
        s.start()
    yield env
    for s in servers:
        s.stop()


@pytest.fixture
def hang_cluster(cl, tmp_path):
    """[run] hang timeout, a breaker that lets one node go, root's channel on every node."""
    yield from served_env(cl, tmp_path, f'grace_s = 20.0\n[run]\nhang_timeout_s = {HANG_TIMEOUT_S}\n'
                                        '[repair]\nmax_drained_fraction = 0.5\n')


def test_a_rank_stopped_on_the_second_node_drains_that_node_and_the_job_resumes_from_its_checkpoint(
        cl, emu, hang_cluster, tmp_path):
    need_py_spy()
    env = hang_cluster
    (tmp_path / "ledger").mkdir()
    total = 1500  # 150 s on the first run; the restarted one goes at 5 ms a step
    job, running = land_on(cl, "n1,n2", lambda: submit(
        cl, tmp_path, emu.url, [], [sys.executable, GLOO, str(total), str(tmp_path / "ledger"), "0.1", f"every-{EVERY}"],
        config=env.config, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
        TMPDIR=str(cl.local_path / "tmp")))
    first = nodes_of(cl, job)
    batch = running["BatchHost"]
    (other,) = set(first) - {batch}
    # a committed checkpoint of both ranks, then rank 1 (on the node that is not the batch host) stops
    wait_for(lambda: len(steps(ledger(tmp_path, 1))) >= 120
             and {"rank0.json", "rank1.json"} <= set((committed(job) or {}).get("files", {})), 120,
             "120 steps and a committed checkpoint of both ranks")
    assert starts(ledger(tmp_path, 1))[0]["node"] == other
    os.kill(int((tmp_path / "ledger" / "rank1.pid").read_text()), signal.SIGSTOP)
    stopped_at = time.monotonic()
    stopped_step = steps(ledger(tmp_path, 1))[-1]

    wait_for(lambda: restarts(cl, job) >= 1, HANG_TIMEOUT_S + 90, "the requeue")
    print(f"SIGSTOP -> requeued: {time.monotonic() - stopped_at:.1f} s (hang_timeout_s {HANG_TIMEOUT_S})")
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)  # the last checkpoint the first run committed, before the second run starts
    assert flushed["attempt"] == 0 and flushed["node_count"] == 2, flushed
    end = wait_end(cl, job, 300)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", out
    assert out.count("requeued job") == 1, out

    said = [line for line in out.splitlines() if "hang: no progress for" in line]
    assert len(said) == 1 and f"(limit {HANG_TIMEOUT_S} s" in said[0], out
    reported = int(re.search(r"rank 1 stopped at step (\d+) \(process stopped \(T\)", said[0]).group(1))
    assert stopped_step - 60 <= reported <= stopped_step, (reported, stopped_step)  # as of its last sync report
    assert f"drain of {other} asked: granted" in said[0], said[0]
    assert "no checkpoint signal to a hung trainer" in out
    node = cl.node(other)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("slurmagent: hang: "), node
    assert f"rank 1 stopped at step {reported}" in node["Reason"], node
    assert "DRAIN" not in cl.node(batch)["State"]  # the batch node's rank only waited for the stopped one
    # asked by the job's agent on that node of that node's root, which looked at the rank itself
    [granted] = [r for r in read_records(env.state_dir(other) / "hooks.log") if r.get("op") == "drain"]
    assert granted["verdict"] == "granted" and granted["evidence"].startswith("root saw pid ")
    assert granted["evidence"].endswith(f" of job {job} stopped (T)"), granted
    assert not [r for r in read_records(env.state_dir(batch) / "hooks.log") if r.get("op") == "drain"]

    folder = tmp_path / "out.hang-0"
    ranks = {r["rank"]: r for r in json.loads((folder / "ranks.json").read_text())}
    assert ranks[1]["node"] == other and ranks[1]["state"] == "T", ranks
    assert ranks[0]["node"] == batch and ranks[0]["state"] not in ("T", "gone"), ranks
    names = {p.name for p in folder.iterdir()}
    assert {"summary.txt", "processes.txt", f"gpu-{batch}.json", f"gpu-{other}.json",
            "py-spy-rank-0.txt", "py-spy-rank-1.txt"} <= names, names
    # each rank's own Python stack in the toy trainer: rank 0's from the batch node's wrapper (it
    # waits in its all-reduce), stopped rank 1's from its own node's agent
    for rank in (0, 1):
        assert_py_spy_stack((folder / f"py-spy-rank-{rank}.txt").read_text(), ranks[rank]["pid"], "toy_gloo.py")

    # resumed from the last committed checkpoint, off the drained node, no step lost beyond it
    second = nodes_of(cl, job)
    assert other not in second, second
    resumed_from = min(json.loads(committed_file(job, flushed, f"rank{r}.json"))["step"] for r in (0, 1))
    for rank in (0, 1):
        lines = ledger(tmp_path, rank)
        run_starts = starts(lines)
        assert len(run_starts) == 2 and int(run_starts[1]["step"]) == resumed_from, run_starts
        assert run_starts[1]["resumed"] == "1" and run_starts[1]["node"] in second
        second_run = lines[max(i for i, line in enumerate(lines) if line.startswith("start ")):]
        assert steps(second_run) == list(range(resumed_from + 1, total + 1)), rank
        assert steps(lines)[:steps(lines).index(resumed_from + 1)] == list(range(1, resumed_from + 1)), rank
    assert stopped_step - resumed_from <= EVERY  # at most one checkpoint interval lost

