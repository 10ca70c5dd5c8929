"""The durable journal: written before, done after, crash-safe, bounded, replayed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from slurmagent.state.journal import Journal, Retry, StopReplay


def test_add_is_durable_and_done_moves_it(tmp_path):
    j = Journal(tmp_path / "journal")
    e = j.add("drain", node="n1", reason="slurmagent: xid 79 on gpu 3")
    files = list((tmp_path / "journal" / "pending").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["payload"]["node"] == "n1"
    assert j.has_pending() and [p.id for p in j.pending()] == [e.id]
    j.mark_done(e, "drained")
    assert not j.has_pending() and j.pending() == []
    assert [(d.id, d.outcome) for d in j.done()] == [(e.id, "drained")]


def test_replay_runs_oldest_first_and_marks_done(tmp_path):
    j = Journal(tmp_path)
    a = j.add("drain", node="n1")
    b = j.add("requeue", job_ids=["7"])
    seen = []
    results = j.replay({"drain": lambda e: seen.append(e.id) or "drained",
                        "requeue": lambda e: seen.append(e.id) or "requeued"})
    assert seen == [a.id, b.id]
    assert [o for _, o in results] == ["drained", "requeued"]
    assert not j.has_pending()


def test_stop_replay_keeps_this_and_the_rest_pending(tmp_path):
    j = Journal(tmp_path)
    j.add("drain", node="n1")
    j.add("drain", node="n2")
    calls = []

    def down(e):
        calls.append(e.payload["node"])
        raise StopReplay("slurmctld unreachable")

    results = j.replay({"drain": down})
    assert calls == ["n1"]
    assert [o for _, o in results] == ["pending: slurmctld unreachable"]
    pend = j.pending()
    assert len(pend) == 2 and pend[0].attempts == 1 and "unreachable" in pend[0].last_error
    assert j.replay({"drain": lambda e: "drained"})[-1][1] == "drained"
    assert not j.has_pending()


def test_retry_gives_up_after_max_attempts(tmp_path):
    j = Journal(tmp_path, max_attempts=2)
    j.add("requeue", job_ids=["1"])

    def nope(e):
        raise Retry("Invalid job id")

    assert j.replay({"requeue": nope})[0][1].startswith("pending")
    assert j.replay({"requeue": nope})[0][1].startswith("failed")
    assert not j.has_pending() and j.done()[0].outcome.startswith("failed")


def test_unknown_kind_stays_pending(tmp_path):
    j = Journal(tmp_path)
    j.add("future-kind", x=1)
    assert j.replay({}) == []
    assert j.has_pending()


def test_crash_between_done_and_unlink_counts_as_done(tmp_path):
    j = Journal(tmp_path)
    e = j.add("drain", node="n1")
    pending_file = tmp_path / "pending" / e.file
    saved = pending_file.read_bytes()
    j.mark_done(e, "drained")
    pending_file.write_bytes(saved)  # as if we died before unlinking it
    assert j.pending() == []
    assert not pending_file.exists()


def test_torn_or_garbage_files_are_ignored(tmp_path):
    j = Journal(tmp_path)
    j.add("drain", node="n1")
    (tmp_path / "pending" / ".x.json.123.tmp").write_text('{"id": ')  # a write that never got renamed
    (tmp_path / "pending" / "00000000000000000001-drain-bad.json").write_text("not json")
    assert [e.payload["node"] for e in j.pending()] == ["n1"]


def test_bounded_done_and_pending(tmp_path, capfd):
    j = Journal(tmp_path, max_done=3, max_pending=4)
    for i in range(6):
        j.mark_done(j.add("drain", node=f"n{i}"), "drained")
    assert [e.payload["node"] for e in j.done()] == ["n3", "n4", "n5"]
    for i in range(6):
        j.add("drain", node=f"p{i}")
    assert [e.payload["node"] for e in j.pending()] == ["p2", "p3", "p4", "p5"]
    assert "exceed the cap" in capfd.readouterr().err


def test_stale_entries_are_dropped_loudly(tmp_path, capfd):
    now = [1000.0]
    j = Journal(tmp_path, max_age_s=60, clock=lambda: now[0])
    j.add("drain", node="n1")
    now[0] += 61
    results = j.replay({"drain": lambda e: pytest.fail("stale entry replayed")})
    assert results[0][1] == "dropped: stale"
    assert "stale" in capfd.readouterr().err


def test_one_replayer_at_a_time(tmp_path):
    j = Journal(tmp_path)
    j.add("drain", node="n1")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX);"
         "print('locked', flush=True); time.sleep(30)", str(tmp_path / "lock")],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert j.replay({"drain": lambda e: "drained"}) == []  # skipped, not blocked
        assert j.has_pending()
    finally:
        holder.kill()
        holder.wait()
    assert j.replay({"drain": lambda e: "drained"})[0][1] == "drained"


def test_files_are_private(tmp_path):
    j = Journal(tmp_path / "j")
    e = j.add("drain", node="n1")
    assert oct((tmp_path / "j" / "pending" / e.file).stat().st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "j").st_mode & 0o777) == "0o700"
