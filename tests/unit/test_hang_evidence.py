"""The hang evidence's Python stacks from the real py-spy (the test extra installs it in every
lane): a rank running and a rank stopped (SIGSTOP: py-spy cannot suspend a stopped process, so
it is read as it stands), with py-spy only in the venv's bin/ and not on PATH, as in a job.

The rest of the evidence, with fakes: tests/unit/test_hang.py; on the cluster:
tests/cluster/test_hang_slurm.py, tests/cluster/test_hang_multinode.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support import assert_py_spy_stack, need_py_spy
from slurmagent.hang import evidence

RANK = """
import sys, time
def train_step():
    print("ready", flush=True)
    time.sleep(60)
train_step()
"""


@pytest.fixture
def rank():
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    yield proc
    proc.kill()
    proc.wait(10)


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_py_spy_dumps_a_running_and_a_stopped_rank_with_py_spy_off_path(rank, stopped, monkeypatch):
    need_py_spy()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a job's PATH: py-spy is found beside the interpreter
    if stopped:
        os.kill(rank.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while evidence.proc_stat(rank.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
    text = evidence.py_spy_dumps([rank.pid])[rank.pid]
    if os.geteuid() != 0 and "ermission" in text and not os.environ.get("CI"):
        pytest.skip(f"py-spy may not read another process here (not root): {text.splitlines()[-1]}")
    assert_py_spy_stack(text, rank.pid, "<string>")
    assert "train_step (<string>:" in text, text
