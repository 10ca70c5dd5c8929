"""The node agents' report channel and step, without Slurm: framed reports survive srun's
interleaving whatever their size, a silent or hung node is named, the flush cancels a round.

On the real cluster: test_multinode.py (4 nodes x 2,000 files, a hung agent at the flush).

Timing (parallel lanes, loaded machine): nothing here is in the serial group. The deadline
counts from the moment the fake srun has written the answering node's report (a clock that
stands still until then), and the cancel comes once that report is written, so a slow start
of the fake srun can neither lose that report nor pass the test without it.
"""

from __future__ import annotations

import io
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import wait_for
from slurmagent.run.agent_channel import FRAME_TAG, frame_lines, read_frames
from slurmagent.run import agent_step
from slurmagent.run.agent_step import Rounds
from slurmagent.run.multinode import Allocation, AllocationStore, SrunLauncher
from slurmagent.run.agent_reports import NodeReport
from slurmagent.checkpoint.errors import CheckpointError
from slurmagent.checkpoint.manifest import Manifest


def big_report(index: int, files: int = 2000) -> NodeReport:
    rnd = random.Random(index)
    return NodeReport(index=index, node=f"n{index + 1}", ok=True, started_ns=10**18 + index,
                      files={f"step_9/shard-{index}-{k:05d}.distcp": {"sha256": f"{rnd.getrandbits(256):064x}",
                                                                     "size": rnd.randrange(10**9), "crc32c": "AAAAAA=="}
                             for k in range(files)},
                      units={"": "5", "step_9": "7"})


def srun_output(streams: dict[int, str], *, label: bool, seed: int) -> list[str]:
    """What srun's stdout holds when the tasks write `streams` at once: slurmstepd sends each
    task's output in pieces of at most 1 KiB (whole lines when they fit), and srun writes the
    pieces of all tasks in the order they come, each prefixed `N: ` with --label."""
    pieces: dict[int, list[str]] = {}
    for task, text in streams.items():
        out = pieces.setdefault(task, [])
        for line in text.splitlines(keepends=True):
            out.extend(line[i : i + 1024] for i in range(0, len(line), 1024))
    rnd = random.Random(seed)
    written = []
    while any(pieces.values()):
        task = rnd.choice([t for t, p in pieces.items() if p])
        piece = pieces[task].pop(0)
        written.append((f"{task}: " if label else "") + piece)
    return "".join(written).splitlines()


@pytest.mark.parametrize("label", [False, True])
def test_reports_of_thousands_of_files_from_four_nodes_arrive_whole_through_srun_interleaving(label):
    reports = [big_report(i) for i in range(4)]
    streams = {r.index: "".join(line + "\n" for line in frame_lines(r.index, r.payload())) for r in reports}
    streams[2] = "a line the user's task prolog printed\n" + streams[2]
    assert all(len(line) < 700 for text in streams.values() for line in text.splitlines())
    got = read_frames(srun_output(streams, label=label, seed=7))
    assert got.damaged == {}
    assert [NodeReport.from_payload(got.reports[i]) for i in range(4)] == reports


@pytest.mark.parametrize("cut", [40, -101], ids=["in-its-header", "in-its-data"])
def test_a_frame_line_torn_in_two_names_its_node_and_never_passes_a_wrong_report(cut):
    """A frame line cut in two (srun cuts output into 1 KiB pieces; a frame stays under 700
    bytes, but a user's settings could still cut one), its tail on a line of its own after
    another node's lines: that node is named, the other's report arrives whole."""
    reports = {i: big_report(i, 300) for i in range(2)}
    frames = {i: frame_lines(i, r.payload()) for i, r in reports.items()}
    torn = frames[1][1]
    lines = [frames[1][0], torn[:cut], *frames[0], torn[cut:], *frames[1][2:]]
    got = read_frames(lines)
    assert NodeReport.from_payload(got.reports[0]) == reports[0]
    assert 1 not in got.reports
    if cut == 40:  # the head lacks its data field: that part is lost
        assert got.damaged[1] == f"{len(frames[1]) - 1} of {len(frames[1])} parts arrived"
    else:  # the head holds part of the data: the report fails its checksum (or base64)
        assert got.damaged[1] in ("its parts fail the checksum", "its parts are damaged (not base64)")


def test_a_missing_or_damaged_part_names_the_node_and_never_passes_a_wrong_report():
    reports = {i: big_report(i, 300) for i in range(3)}
    frames = {i: frame_lines(i, r.payload()) for i, r in reports.items()}
    assert all(len(f) > 3 for f in frames.values())
    del frames[1][2]  # a part of node 1 lost
    tag, index, seq, total, digest, data = frames[2][1].split(" ")
    frames[2][1] = " ".join([tag, index, seq, total, digest, data[:-8] + "AAAAAAAA"])  # a part of node 2 changed
    got = read_frames([line for i in (2, 0, 1) for line in reversed(frames[i])])
    assert NodeReport.from_payload(got.reports[0]) == reports[0]
    assert 1 not in got.reports and got.damaged[1] == f"{len(frames[1])} of {len(frames[1]) + 1} parts arrived"
    assert 2 not in got.reports and got.damaged[2] == "its parts fail the checksum"
    assert read_frames([FRAME_TAG + "x y z", FRAME_TAG + "0 5 2 d e", "hello"]).reports == {}


def fake_srun(tmp_path, body: str) -> str:
    path = tmp_path / "srun"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def two_nodes() -> Allocation:
    return Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"})


def answered_clock(answered: Path):
    """agent_step's clock, standing still until the fake srun has written the answering node's
    report (`answered` exists), then running: a deadline counts from there, however long a
    loaded machine takes to start the fake srun, so the report is always in before it."""
    real, since = time.monotonic, []

    def monotonic() -> float:
        if not since:
            if not answered.exists():
                return 0.0
            since.append(real())
        return real() - since[0]

    return SimpleNamespace(monotonic=monotonic)


def test_a_node_that_hangs_is_named_at_the_deadline_and_the_others_reports_are_kept(tmp_path, monkeypatch):
    done, answered = tmp_path / "done", tmp_path / "answered"
    done.write_text("".join(line + "\n" for line in frame_lines(0, big_report(0, 50).payload())))
    srun = fake_srun(tmp_path, f"cat {done}\ntouch {answered}\nexec sleep 600\n")  # node index 1 never answers
    monkeypatch.setattr(agent_step, "time", answered_clock(answered))
    reports = SrunLauncher(two_nodes(), {}, srun=srun, err=io.StringIO()).run(["sync"], deadline_s=1.5)
    assert reports[0] == big_report(0, 50)
    assert reports[1].error == "no report from n2 (node index 1) within 1.5 s"


def test_a_cancelled_step_ends_at_once_and_names_the_nodes_that_had_not_answered(tmp_path):
    done, answered = tmp_path / "done", tmp_path / "answered"
    done.write_text("".join(line + "\n" for line in frame_lines(1, big_report(1, 50).payload())))
    srun = fake_srun(tmp_path, f"cat {done}\ntouch {answered}\nexec sleep 600\n")
    cancel = threading.Event()

    def cancel_once_answered():  # the flush comes after node index 1 answered, before node index 0 does
        wait_for(answered.exists, 60, "the fake srun's output", interval=0.05)
        cancel.set()

    threading.Thread(target=cancel_once_answered, daemon=True).start()
    reports = SrunLauncher(two_nodes(), {}, srun=srun, err=io.StringIO()).run(["sync"], deadline_s=300, cancel=cancel)
    assert reports[1].ok and reports[0].error.startswith("no report from n1 (node index 0): cancelled after ")


class HangingLauncher:
    """Node index 1's agent hangs in the first round until the round is cancelled; later rounds answer."""

    def __init__(self):
        self.rounds = 0
        self.started = threading.Event()

    def run(self, args, deadline_s, cancel=None):
        self.rounds += 1
        ok = [NodeReport(index=0, node="n1", ok=True, files={"a": {"sha256": "a" * 64, "size": 1}})]
        if self.rounds == 1:
            self.started.set()
            if cancel.wait(deadline_s):
                return ok + [NodeReport(index=1, node="n2", ok=False, error="no report from n2 (node index 1): cancelled after 3 s")]
        return ok + [NodeReport(index=1, node="n2", ok=True, files={"b": {"sha256": "b" * 64, "size": 1}})]


class Bucket:
    url = "gs://b/j"

    def __init__(self):
        self.commits: list[Manifest] = []

    def read_manifest(self, *, deadline_s=60.0):
        return (self.commits[-1] if self.commits else None), len(self.commits)

    def commit(self, manifest, *, deadline_s=60.0):
        self.commits.append(manifest)
        return len(self.commits)


def test_the_flush_cancels_a_round_held_by_a_hung_agent_and_the_final_sync_commits(tmp_path):
    launcher, bucket, err = HangingLauncher(), Bucket(), io.StringIO()
    store = AllocationStore(Allocation("7", 2), bucket, launcher, err=err)
    failed: list[BaseException] = []

    def periodic():
        try:
            store.sync(tmp_path, 0, tmp_path / "state", deadline_s=600)
        except CheckpointError as exc:
            failed.append(exc)

    thread = threading.Thread(target=periodic)
    thread.start()
    assert launcher.started.wait(10)
    store.cancel_rounds()  # the flush begins
    thread.join(10)
    assert not thread.is_alive() and "no report from n2 (node index 1): cancelled" in str(failed[0])
    assert "the flush cancelled the node agents' round in flight: no report from n2 (node index 1)" in err.getvalue()
    result = store.sync(tmp_path, 0, tmp_path / "state", deadline_s=30)  # the final sync
    assert result.manifest is not None and set(bucket.commits[-1].files) == {"a", "b"}


def test_a_round_asked_for_before_the_flush_is_cancelled_even_if_it_had_not_started():
    """A periodic round waiting for its turn when the flush begins must not start after it."""
    rounds = Rounds()
    waiting = rounds.ticket()
    rounds.cancel()
    with rounds.running(waiting) as cancel:
        assert cancel.is_set()
    final = rounds.ticket()
    with rounds.running(final) as cancel:
        assert not cancel.is_set()
        rounds.cancel()  # a later cancel reaches the round in flight
        assert cancel.is_set()


def test_a_report_missing_a_part_is_named_as_not_whole(tmp_path):
    frames = frame_lines(0, big_report(0, 300).payload())
    sent = tmp_path / "sent"
    sent.write_text("".join(f"0: {line}\n" for line in frames[:-1]))  # labelled, the last part lost
    reports = SrunLauncher(two_nodes(), {}, srun=fake_srun(tmp_path, f"cat {sent}\n"), err=io.StringIO()).run(
        ["sync"], deadline_s=30)
    assert reports[0].error == (f"no whole report from n1 (node index 0): {len(frames) - 1} of {len(frames)} parts "
                                "arrived (srun exited 0: no output)")
