"""A straggler in a 2-node data-parallel job, on the 4-node cluster with node-local disks and
TMPDIR: two ranks in lockstep over CPU gloo, rank 1 (on the node that is not the batch host)
computes three times longer each step, and each rank calls `progress` after its compute and
before the step's all-reduce. Both ranks go at rank 1's pace; the batch step's straggler
watch, seeing rank 1 through its node's agent, says it with its node and rank on the job's
stderr and in root's decision log while the job runs, and the job runs to its end
(`straggler_action = "report"`). The same job calling `progress` after the all-reduce says
nothing.

The rule on a fake clock (lockstep, after the collective, jitter, no collective):
tests/unit/test_straggler.py.
"""

from __future__ import annotations

import sys
import time

import pytest

from support import SUPPORT, need_module, wait_for
from slurmagent.devtools.localcluster import free_ports
from slurmagent.state.decisionlog import read_records
from test_fault_slurm import land_on
from test_hang_multinode import served_env
from test_multinode import ledger, nodes_of, starts, submit, wait_end

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
need_module("torch")

TOY = str(SUPPORT / "toy_straggler.py")
WINDOW_S, WINDOWS = 3, 3
STEP_S, TOTAL = 0.05, 400  # rank 1: 0.15 s a step; ~60 s in all, some 20 windows


@pytest.fixture
def straggler_cluster(cl, tmp_path):
    """[run] short straggler windows (a sync round every second, so the other node's ranks come
    often), healthy nodes with node-local TMPDIR, root's channel on every node."""
    yield from served_env(cl, tmp_path, f'[run]\nstraggler_window_s = {WINDOW_S}\nstraggler_windows = {WINDOWS}\n'
                                        'straggler_action = "report"\n')


def straggler_lines(tmp_path) -> list[str]:
    out = tmp_path / "out"
    return [line for line in out.read_text().splitlines() if "straggler on node" in line] if out.exists() else []


def run(cl, emu, env, tmp_path, *extra: str) -> tuple[str, str, float]:
    """Start the job on n1 and n2: (its id, rank 1's node (not the batch host), when both ranks started)."""
    (tmp_path / "ledger").mkdir()
    job, running = land_on(cl, "n1,n2", lambda: submit(
        cl, tmp_path, emu.url, [], [sys.executable, TOY, str(TOTAL), str(tmp_path / "ledger"), str(STEP_S), "1", *extra],
        config=env.config, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
        TMPDIR=str(cl.local_path / "tmp")))
    (other,) = set(nodes_of(cl, job)) - {running["BatchHost"]}
    wait_for(lambda: starts(ledger(tmp_path, 1)) and starts(ledger(tmp_path, 0)), 120, "both ranks started")
    assert starts(ledger(tmp_path, 1))[0]["node"] == other
    return job, other, max(float(starts(ledger(tmp_path, r))[0]["at"]) for r in (0, 1))


def test_a_rank_three_times_slower_in_lockstep_is_reported_with_its_node_and_the_job_completes(
        cl, emu, straggler_cluster, tmp_path):
    env = straggler_cluster
    job, other, started = run(cl, emu, env, tmp_path)
    wait_for(lambda: straggler_lines(tmp_path) or cl.job(job)["JobState"] != "RUNNING", 300, "a straggler said")
    seen = time.time()
    end = wait_end(cl, job, 300)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", out

    said = straggler_lines(tmp_path)
    assert len(said) == 1 and f"straggler on node {other}: rank 1 straggles: busy " in said[0], out
    assert "in lockstep at" in said[0], said[0]
    done = float(ledger(tmp_path, 1)[-1].split("at=")[1])
    assert seen < done, "the straggler was said only after the job's last step"  # reported while it ran
    print(f"straggler said {seen - started:.1f} s after both ranks started "
          f"(windows of {WINDOW_S} s, {WINDOWS} in a row): {said[0]}")
    [rec] = [r for r in read_records(env.state_dir(cl.job(job)["BatchHost"]) / "hooks.log") if r.get("op") == "report"]
    assert rec["rule"] == "straggler" and rec["about"] == other and rec["detail"].startswith("rank 1 straggles"), rec


def test_progress_after_the_collective_reports_no_straggler(cl, emu, straggler_cluster, tmp_path):
    """Every rank leaves the all-reduce together: the same job says nothing (and sees nothing)."""
    env = straggler_cluster
    job, _, _ = run(cl, emu, env, tmp_path, "after")
    end = wait_end(cl, job, 300)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", out
    assert straggler_lines(tmp_path) == [], out
    assert not [r for r in read_records(env.state_dir(end["BatchHost"]) / "hooks.log") if r.get("op") == "report"]
