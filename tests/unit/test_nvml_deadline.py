"""The NVML read under a hard deadline for a process that runs threads (the watch daemon):
children come from a forkserver, never from os.fork() in the threaded process, and a hung
read is abandoned at the deadline like in the hooks' forked reader."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from support.fakes import nvml_readers
from slurmagent.errors import NvmlTimeout
from slurmagent.gpu.nvml_deadline import NVML_READ_CRASHED, ThreadSafeReader


@pytest.fixture
def threaded(monkeypatch):
    """A process with another thread running, where os.fork() must not be called."""
    forks: list[int] = []

    def no_fork() -> int:
        forks.append(1)
        raise AssertionError("os.fork() in a threaded process")

    monkeypatch.setattr(os, "fork", no_fork)
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)
    busy.start()
    yield forks
    stop.set()
    busy.join(5)


def test_read_in_a_forkserver_child(threaded):
    snap = ThreadSafeReader(nvml_readers.healthy).start().read(20, hostname="n1")
    assert snap.hostname == "n1" and len(snap.gpus) == 8 and snap.gpus[7].pci_bus_id == "00000000:88:00.0"
    assert threaded == [] and multiprocessing.active_children() == []


def test_a_hung_read_is_abandoned_at_the_deadline(threaded):
    reader = ThreadSafeReader(nvml_readers.hung).start()
    with pytest.raises(NvmlTimeout, match="did not finish within 1.0 s"):
        reader.read(1.0, hostname="n1")
    assert multiprocessing.active_children() == []  # killed, reaped
    with pytest.raises(NvmlTimeout):
        reader.read(0.5, hostname="n1")
    assert threaded == []


def test_a_reader_that_dies_is_a_crashed_read_not_a_hang(threaded):
    snap = ThreadSafeReader(nvml_readers.dies).read(20, hostname="n1")
    assert snap.nvml_error == NVML_READ_CRASHED and snap.gpus == []


def test_a_bug_in_the_reader_is_raised_not_taken_for_a_gpu_fault(threaded):
    with pytest.raises(RuntimeError, match="ZeroDivisionError: a bug in the reader"):
        ThreadSafeReader(nvml_readers.buggy).read(20, hostname="n1")


def test_bad_deadline_is_refused():
    with pytest.raises(ValueError):
        ThreadSafeReader(nvml_readers.healthy).read(0)
