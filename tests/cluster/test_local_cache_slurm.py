"""The node-local cache and peers on a real allocation (node-local directories, srun, requeue).

A 2-node job is requeued onto one of its old nodes and a new one: the old node's cache serves
the new node through the agent step (the token in the agents' environment, the coordinator in
the batch step), and what only the departed node held comes from the bucket.
"""

from __future__ import annotations

import os
import sys

import pytest

from support import wait_for
from test_multinode import RANKS, committed, drain, ledger, nodes_of, starts, steps, submit, wait_end, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_job_requeued_onto_an_old_and_a_new_node_fills_the_new_one_from_the_old_ones_cache(cl, emu, tmp_path):
    (tmp_path / "ledger").mkdir()
    config = write_config(tmp_path / "c.toml", local_cache_gib=1)
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, RANKS, "400", str(tmp_path / "ledger"), "0.05"],
                 config=config)
    cl.wait_job(job, ("RUNNING",), 60)
    first = nodes_of(cl, job)
    wait_for(lambda: all(len(steps(ledger(tmp_path, r))) >= 20 for r in (0, 1)), 90, "20 steps on both ranks")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    spare = [n for n in cl.nodes if n not in first]
    drain(cl, [first[1], spare[1]])  # the requeue lands on first[0] (old) and spare[0] (new)
    cl.wait_job(job, ("PENDING",), 60)
    flushed = committed(job)
    old_cache = cl.node_dir(first[0]) / f".slurmagent-cache-{os.geteuid()}"
    assert old_cache.is_dir()
    entered = [n for n in os.listdir(old_cache) if n.startswith("blake3-")]  # its records file left out
    assert len(entered) == 2, entered  # rank 0's two files, entered at the flush

    end = wait_end(cl, job)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert sorted(nodes_of(cl, job)) == sorted([first[0], spare[0]]), out
    whole = set(flushed["files"])
    for rank in (0, 1):
        assert set(starts(ledger(tmp_path, rank))[-1]["files"].split(",")) == whole
    # the new node took rank 0's files from the old node's cache, checked, and only rank 1's from the bucket
    assert f"slurmagent node-agent {spare[0]}: 2 file(s)" in out and "from the job's other nodes" in out, out
    assert "failed" not in out.split("requeued job")[-1], out
    new_cache = cl.node_dir(spare[0]) / f".slurmagent-cache-{os.geteuid()}"
    held = set(os.listdir(new_cache))  # it now holds the restored checkpoint too (and the final sync's files)
    assert {f"blake3-{e['blake3']}" for e in flushed["files"].values()} <= held, held
