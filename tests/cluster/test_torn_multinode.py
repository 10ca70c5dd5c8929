"""Never torn, on two nodes: the wrapper kills a multi-node trainer whose rank on the second
node is rewriting its file in place (the grace ran out); just before the kill every node's
agent records what the job's ranks there hold open for writing (`node-agent writers`), and the
final sync leaves those files at their last commit. Before: a multi-node job recorded nothing
at the kill, and the final sync committed the other node's 400 kB of a 1 MB file.

The local cluster's "nodes" share one /proc, so here the batch node could see rank 1's open
file too; that each node's agent answers for its own node (and a silent one is named) is
tests/unit/test_multinode_store.py's `writers` tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from support import wait_for
from test_multinode import committed, submit, wait_end, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Each rank saves model-<rank>.pt (1 MB of "1") on its node and waits; on the test's word rank 1
# rewrites its file in place: 400 kB of "2", then stalls with it open. SIGUSR1 is ignored: the
# save never finishes, the grace runs out. The next attempt writes the sizes it restored and ends.
RANK = r'''
import os, signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
marks, rank = sys.argv[1], os.environ["SLURM_PROCID"]
path = os.path.join(os.environ["SLURMAGENT_CKPT_DIR"], f"model-{rank}.pt")
if os.environ.get("SLURMAGENT_RESUMED") == "1":
    open(os.path.join(marks, f"restored-{rank}"), "w").write(str(os.path.getsize(path)))
    sys.exit(0)
with open(path, "wb") as f:
    f.write(b"1" * 1_000_000)
while not os.path.exists(os.path.join(marks, "rewrite")):
    time.sleep(0.05)
if rank == "1":
    f = open(path, "wb")
    f.write(b"2" * 400_000)
    f.flush()
    open(os.path.join(marks, "stalled"), "w").close()
while True:
    time.sleep(1)
'''


def test_a_save_in_place_on_another_node_killed_at_the_grace_is_never_committed(cl, emu, tmp_path):
    marks, rank = tmp_path / "marks", tmp_path / "rank.py"
    marks.mkdir()
    rank.write_text(RANK)
    config = write_config(tmp_path / "c.toml", sync_interval_s=0.5, grace_s=2.0, settle_s=0.25)
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, str(rank), str(marks)], config=config)
    sizes = lambda: {rel: e["size"] for rel, e in ((committed(job) or {}).get("files") or {}).items()}  # noqa: E731
    wait_for(lambda: sizes() == {"model-0.pt": 1_000_000, "model-1.pt": 1_000_000}, 120, "v1 of both committed")
    (marks / "rewrite").touch()
    wait_for((marks / "stalled").exists, 60, "rank 1 stalled half-way")
    cl.run(["scancel", "--batch", "--signal=TERM", job])
    end = wait_end(cl, job, 240)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", out
    assert "did not exit within" in out, out
    assert "model-1.pt was open for writing when the job was stopped (torn)" in out, out
    assert sizes()["model-1.pt"] == 1_000_000, out  # before: 400000
    restored = {p.name: int(p.read_text()) for p in marks.glob("restored-*")}
    assert restored == {"restored-0": 1_000_000, "restored-1": 1_000_000}, out
