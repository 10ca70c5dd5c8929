"""The goodput ledger's arithmetic (core/goodput.py) on hand-made ledgers, every figure worked
out by hand in a comment; the page (core/goodput_html.py) and the wrapper's side (run/ledger.py)
with a fake bucket. The bucket and a real wrapped job: tests/cluster/test_ledger_slurm.py."""

from __future__ import annotations

import json
import contextlib
import os
import signal

import pytest

from slurmagent.checkpoint.manifest import Manifest
from slurmagent.core import goodput
from slurmagent.core.goodput import attempt_parts, build_report, end_of, format_text, parse_duration
from slurmagent.core.goodput_html import render_html
from slurmagent.run.job import Outcome
from slurmagent.run.ledger import AttemptLedger, LedgerReport, expiry_source
from slurmagent.run.supervisor import SELF_REQUEUE_CAUSE
from slurmagent.slurm.model import FAULT_FLUSH_SIGNAL


def rec(attempt, started, **kw):
    return {"schema": 1, "job": kw.pop("job", "77"), "attempt": attempt, "started": started, "state": "ended", **kw}


def test_one_attempt_splits_into_parts_that_add_up():
    # S=1000 R=20 P=1100 C=1900 E=2000 flush 10 -> F=1990
    # restore 20; startup 1100-1020=80; progress min(1900,1990)-1100=800; recompute 1990-1900=90; flush 10
    # 20+80+800+90+10 = 1000 = E-S
    parts = attempt_parts(rec(0, 1000.0, restore_s=20, first_progress=1100, last_commit=1900, ended=2000,
                              flush_s=10), None)["parts"]
    assert parts == {"progress": 800, "startup": 80, "restore": 20, "recompute": 90, "flush": 10, "pending": 0,
                     "unrecorded": 0, "hang_detection": 0}


def two_attempts():
    # attempt 0: S=0 R=10 P=100 C=3000 E=3600 flush 60 (F=3540), SIGTERM, requeued, 16 GPUs
    #   restore 10, startup 90, progress 2900, recompute 3540-3000=540, flush 60 (sum 3600)
    #   PENDING until attempt 1: 4200-3600 = 600
    # attempt 1: S=4200 R=120 P=4500 C=10000 E=10000 flush 30 (F=9970), completed
    #   restore 120, startup 4500-4320=180, progress min(10000,9970)-4500=5470, recompute 0, flush 30 (sum 5800)
    return [rec(1, 4200.0, restore_s=120, first_progress=4500, last_commit=10000, ended=10000, flush_s=30,
                end="completed", why="the job exited 0", gpus=16, nodes="a[1-2]", node_count=2),
            rec(0, 0.0, restore_s=10, first_progress=100, last_commit=3000, ended=3600, flush_s=60, end="sigterm",
                why="SIGTERM", requeued=True, gpus=16, nodes="a[1-2]", node_count=2)]


def test_ettr_and_losses_of_an_interrupted_job():
    report = build_report(two_attempts(), now=20000.0)
    (job,) = report["jobs"]
    assert [a["attempt"] for a in job["attempts"]] == [0, 1]
    # wall 10000 - 0 = 10000; progress 2900 + 5470 = 8370; ETTR 0.837
    assert job["wall_s"] == 10000 and job["progress_s"] == 8370 and job["ettr"] == 0.837
    # restore 10+120=130, startup 90+180=270, recompute 540, flush 60+30=90, pending 600: 8370+1630 = 10000
    assert {c: v["seconds"] for c, v in job["lost"].items()} == {
        "startup": 270, "restore": 130, "recompute": 540, "flush": 90, "pending": 600, "unrecorded": 0, "hang_detection": 0}
    # GPU-hours at 16 GPUs: 130*16/3600=0.5778, 270*16/3600=1.2, 540*16/3600=2.4, 90*16/3600=0.4, 600*16/3600=2.6667
    assert {c: v["gpu_hours"] for c, v in job["lost"].items()} == {
        "startup": 1.2, "restore": 0.5778, "recompute": 2.4, "flush": 0.4, "pending": 2.6667, "unrecorded": 0, "hang_detection": 0}
    assert job["interruptions"] == [{"attempt": 0, "at": 3600.0, "cause": "sigterm", "why": "SIGTERM"}]
    assert report["totals"]["ettr"] == 0.837 and report["totals"]["interruptions"] == 1


def test_a_killed_attempt_counts_as_unrecorded_until_the_next_start():
    # attempt 0: only its "started" record: S=0 R=50, killed; attempt 1 starts at 1000
    #   restore 50, unrecorded 1000-50 = 950, PENDING 0 (its end is taken as the next start)
    # attempt 1: S=1000 R=0 P=1100 C=1900 E=2000: startup 100, progress 800, recompute 100
    # wall 2000, ETTR 800/2000 = 0.4
    killed = {"schema": 1, "job": "5", "attempt": 0, "started": 0.0, "restore_s": 50, "state": "started"}
    done = rec(1, 1000.0, job="5", restore_s=0, first_progress=1100, last_commit=1900, ended=2000, flush_s=0,
               end="completed")
    job = build_report([killed, done], now=3000.0)["jobs"][0]
    assert job["ettr"] == 0.4
    assert job["lost"]["unrecorded"]["seconds"] == 950 and job["lost"]["restore"]["seconds"] == 50
    assert job["lost"]["pending"]["seconds"] == 0
    assert job["interruptions"][0]["cause"] == "lost"


def test_an_attempt_without_progress_is_all_startup_and_the_last_unended_one_is_running():
    # S=0 R=10 E=100 flush 5 (F=95), no first progress: restore 10, startup 95-10 = 85, flush 5; ETTR 0
    job = build_report([rec(0, 0.0, restore_s=10, ended=100, flush_s=5, end="gpu-fault")], now=200.0)["jobs"][0]
    assert job["ettr"] == 0 and job["lost"]["startup"]["seconds"] == 85 and job["lost"]["flush"]["seconds"] == 5
    running = {"job": "9", "attempt": 0, "started": 0.0, "restore_s": 30}
    j = build_report([running], now=500.0)["jobs"][0]
    assert j["attempts"][0]["end"] == "running-or-lost" and j["interruptions"] == []


def test_records_are_grouped_per_prefix_and_job_filtered_and_bad_ones_skipped():
    a = rec(0, 0.0, ended=10, end="completed", prefix="gs://b/p/1", job="1")
    b = rec(0, 0.0, ended=10, end="completed", prefix="gs://b/p/2", job="1")  # a recycled id, another prefix
    c = rec(0, 50000.0, ended=50010, end="completed", job="3")
    report = build_report([a, b, c, {"job": 4}, "junk"], now=50020.0)
    assert len(report["jobs"]) == 3 and report["skipped_records"] == 2
    assert [j["job"] for j in build_report([a, b, c], now=50020.0, job="3")["jobs"]] == ["3"]
    # --since 60 s at now=50020: only jobs that ended at or after 49960
    assert [j["job"] for j in build_report([a, b, c], now=50020.0, since_s=60)["jobs"]] == ["3"]


@pytest.mark.parametrize("kw, end", [
    (dict(flushed=False, flush_cause="", child_code=0), "completed"),
    (dict(flushed=False, flush_cause="", child_code=3), "failed"),
    (dict(flushed=False, flush_cause="", child_code=None, summary="restore failed on n1"), "restore-failed"),
    (dict(flushed=True, flush_cause="SIGTERM", child_code=0), "sigterm"),
    (dict(flushed=True, flush_cause="SIGUSR1", child_code=0), "time-limit"),
    (dict(flushed=True, flush_cause="SIGUSR1", child_code=0, expiry_source="preempted"), "preemption"),
    (dict(flushed=True, flush_cause="SIGTERM", child_code=0, expiry_source="maintenance-event"), "maintenance"),
    (dict(flushed=True, flush_cause="VM expiry in 90 s", child_code=0, expiry_source="compute-api"), "expiry"),
    (dict(flushed=True, flush_cause="SIGPWR", child_code=None, fault_node="g3", fault="xid 79"), "gpu-fault"),
    (dict(flushed=True, flush_cause=SELF_REQUEUE_CAUSE, child_code=0), "self-requeue"),
])
def test_how_an_attempt_ended(kw, end):
    got, why = end_of(**kw)
    assert got == end and got in goodput.ENDS and why
    if end == "gpu-fault":
        assert "GPU fault on node g3 (xid 79)" in why


def test_the_wrappers_names_are_the_ledgers():
    assert goodput.FAULT_SIGNAL == signal.Signals(FAULT_FLUSH_SIGNAL).name
    assert goodput.SELF_REQUEUE == SELF_REQUEUE_CAUSE


def test_durations():
    assert parse_duration("90m") == 5400 and parse_duration("7d") == 604800 and parse_duration("30") == 30
    for bad in ("", "x", "-1h", "inf", "5y"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_text_and_page_say_what_the_json_says():
    report = build_report(two_attempts(), now=20000.0)
    text = format_text(report)
    assert "ETTR 83.7%" in text and "attempt 0:" in text and "sigterm (requeued)" in text
    page = render_html(report)
    assert 'id="ettr" data-ettr="0.837"' in page and ">83.7%<" in page
    assert page.count('class="cause-bar"') == len(goodput.CAUSES)
    assert 'class="interruption" data-cause="sigterm"' in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "no ledger records found" in format_text(build_report([], now=0.0))


# --- the wrapper's side --------------------------------------------------------------------


class FakeBucket:
    def __init__(self, fail=False):
        self.writes, self.fail = [], fail

    def write(self, job, attempt, record, *, deadline_s):
        if self.fail:
            raise OSError("bucket says no")
        self.writes.append((job, attempt, json.loads(json.dumps(record))))

    def record_url(self, job, attempt):
        return f"gs://b/p/ledger/{job}-{attempt}.json"


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def entry(data: bytes) -> dict:
    return {"sha256": str(hash(data) & 0xFFFF).rjust(64, "0"), "size": len(data), "crc32c": "AAAAAA=="}


def test_attempt_ledger_dates_first_progress_by_the_file_and_writes_start_then_end(tmp_path):
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}
    clock, said, bucket = Clock(1000.0), [], FakeBucket()
    ledger = AttemptLedger(bucket, "77", 1, env, tmp_path, started=990.0, say=said.append, clock=clock)
    report = LedgerReport(type("Inner", (), {"restored": lambda s, m: None, "synced": lambda s, *a, **k: None,
                                             "line": lambda s: "inner"})(), ledger)
    base = Manifest(attempt=0, files={"a.pt": entry(b"a")})
    report.restored(base)  # the trainer starts at 1000: restore 10 s
    (tmp_path / "b.pt").write_bytes(b"b")
    os.utime(tmp_path / "b.pt", (1005.0, 1005.0))
    clock.t = 1060.0
    report.synced(base, 1.0, 0, 0, None)  # the restored content again: no progress
    report.synced(Manifest(attempt=1, files={"a.pt": entry(b"a"), "b.pt": entry(b"b")}), 1.0, 1, 1, None)
    clock.t = 1200.0
    report.synced(Manifest(attempt=1, files={"a.pt": entry(b"a"), "b.pt": entry(b"B")}), 1.0, 1, 1, None)
    assert report.line() == "inner"  # the owner's report is still there
    ledger.start_thread.join(5)
    clock.t = 1300.0
    ledger.ended(Outcome(exit_code=143, flushed=True, flush_cause="SIGTERM", requeued=True, flush_seconds=12.5,
                         child_code=0))
    (_, _, started), (job, attempt, ended) = bucket.writes
    assert started["state"] == "started" and started["restore_s"] == 10 and started["gpus"] == 16
    assert (job, attempt) == ("77", 1)
    assert ended["state"] == "ended" and ended["first_progress"] == 1005.0 and ended["last_commit"] == 1200.0
    assert ended["end"] == "sigterm" and ended["requeued"] and ended["flush_s"] == 12.5 and ended["ended"] == 1300.0
    assert ended["nodes"] == "n[1-2]" and ended["node_count"] == 2 and said == []


def test_a_failed_ledger_write_is_one_line_and_never_raises(tmp_path):
    said = []
    ledger = AttemptLedger(FakeBucket(fail=True), "77", 0, {}, tmp_path, started=0.0, say=said.append)
    ledger.ended(None, error="not started: restore failed")
    assert len(said) == 1 and "could not write the goodput ledger record (end)" in said[0]
    assert "bucket says no" in said[0]


def test_the_expiry_source_counts_only_a_near_termination(tmp_path):
    path = tmp_path / "expiry.json"
    path.write_text(json.dumps({"termination_time": "2030-01-01T00:00:00Z", "source": "preempted"}))
    t = 1893456000.0  # 2030-01-01T00:00:00Z
    assert expiry_source((path,), 420.0, now=t - 60) == "preempted"
    assert expiry_source((path,), 420.0, now=t - 86400) == ""


def test_a_change_in_the_directory_is_first_progress_before_any_commit(tmp_path):
    clock, bucket = Clock(100.0), FakeBucket()
    ledger = AttemptLedger(bucket, "8", 0, {}, tmp_path, started=90.0, say=print, clock=clock)
    ledger.trainer_started(None)
    (tmp_path / "step1").write_bytes(b"x")  # written, not yet quiet for a round: no commit holds it
    os.utime(tmp_path / "step1", (104.0, 104.0))
    clock.t = 106.0
    ledger.committed(None, 0.5, final=False)
    ledger.start_thread.join(5)
    rec = ledger.record("started")
    assert rec["first_progress"] == 104.0 and rec["last_commit"] is None and rec["restore_s"] == 10.0


def test_report_usage_errors_exit_2(tmp_path, capsys, monkeypatch):
    from slurmagent.cli import main

    config = tmp_path / "c.toml"
    config.write_text("")
    monkeypatch.setenv("SLURMAGENT_CONFIG", str(config))
    for args, said in ((["report"], "no --remote"), (["report", "--remote", "s3://x"], "not a gs://"),
                       (["report", "--remote", "gs://b/p", "--since", "soon"], "--since 'soon' is not a duration")):
        assert main(args) == 2, args
        assert said in capsys.readouterr().err


def test_report_json_and_html_from_one_read(tmp_path):
    import io

    from slurmagent.commands.report import run_report
    from slurmagent.state.config import Config

    out, page = io.StringIO(), tmp_path / "r.html"
    assert run_report(Config(), out, remote="gs://b/p", as_json=True, html=str(page), now=20000.0,
                      reader=lambda remote: (two_attempts(), ["gs://b/p/x/ledger/bad.json: not JSON"])) == 0
    report = json.loads(out.getvalue())
    assert report["remote"] == "gs://b/p" and report["errors"] == ["gs://b/p/x/ledger/bad.json: not JSON"]
    assert report["totals"]["ettr"] == 0.837 and 'data-ettr="0.837"' in page.read_text()
    assert "not JSON" in page.read_text()


# --- records are untrusted input (issue 36): a bad one is skipped and counted, never a crash --------


BAD_RECORDS = [
    (rec(0, 1000.0, gpus="eight"), "gpus: not a whole number in [0, 100000]"),
    (rec(0, 1000.0, gpus=float("inf")), "gpus: not a whole number in [0, 100000]"),
    (rec(0, 1000.0, node_count=[1]), "node_count: not a whole number in [0, 100000]"),
    (rec(0, 1e308), "started: not a time between 1970 and 2099"),
    (rec(0, float("nan")), "started: not a time between 1970 and 2099"),
    (rec(0, -1e20), "started: not a time between 1970 and 2099"),
    (rec(0, 1000.0, ended=float("inf")), "ended: not a time between 1970 and 2099"),
    (rec(0, 1000.0, flush_s=-5), "flush_s: not a number of seconds in [0, 1e+07]"),
    (rec(0, 1000.0, why={"a": 1}), "why: not text"),
    ({"job": "x" * 300, "attempt": 0, "started": 1000.0}, "job: not a job id"),
    (rec(True, 1000.0), "attempt: not a whole number in [0, 1000000]"),
    ([[[]]], "not a JSON object"),
]


@pytest.mark.parametrize("bad,why", BAD_RECORDS)
def test_a_bad_record_is_skipped_with_its_reason_and_the_good_ones_reported(bad, why, tmp_path):
    """Before: `gpus: "eight"`, `node_count: [1]`, `started: 1e308` raised; `ended: Infinity` gave
    ETTR 0.0 and `Infinity` in the JSON; `started: NaN` crashed only --html."""
    good = rec(0, 1000.0, ended=2000.0, end="completed", first_progress=1100.0, last_commit=1900.0, gpus=8)
    report = build_report([good, bad], now=3000.0)
    assert [j["job"] for j in report["jobs"]] == ["77"] and report["jobs"][0]["ettr"] == 0.8
    assert report["skipped_records"] == 1 and report["skipped_why"] == {why: 1}
    json.dumps(report, allow_nan=False)  # standard JSON: no Infinity, no NaN
    assert f"warning: 1 unreadable record(s) skipped (1 x {why})" in format_text(report)
    (tmp_path / "r.html").write_text(render_html({**report, "remote": "gs://b/p"}))


def test_reading_a_large_ledger_shows_its_progress_on_a_terminal_and_nothing_in_a_pipe():
    """`report` over thousands of records takes a while: a terminal sees how far it got, redrawn on
    one line and cleared at the end; a pipe or a file (cron, `| jq`) gets no such line."""
    import io
    import pty
    import select

    from slurmagent.commands.report import TerminalProgress

    master, slave = pty.openpty()
    tty = open(slave, "w")
    clock = [0.0]
    bar = TerminalProgress(tty, every_s=0.2, clock=lambda: clock[0])
    for done in range(1, 3001):
        clock[0] = done * 0.001  # 3 s in all: a redraw every 0.2 s, and the last one
        bar(done, 3000)
    bar.close()
    tty.close()
    shown = ""
    while not shown.endswith("records\r" + " " * 37 + "\r") and select.select([master], [], [], 2)[0]:
        shown += os.read(master, 65536).decode()  # a pty hands over what it holds, maybe in parts
    os.close(master)
    draws = [d for d in shown.split("\r") if d.strip()]
    assert 10 <= len(draws) <= 20, draws  # throttled: not 3000 writes to the terminal
    assert draws[0].startswith("reading the ledger: 1/3000 records") and draws[-1].strip() == "reading the ledger: 3000/3000 records"
    assert shown.endswith("\r" + " " * len("reading the ledger: 3000/3000 records") + "\r")  # cleared: the report starts clean
    piped = io.StringIO()
    bar = TerminalProgress(piped)
    bar(1, 2)
    bar(2, 2)
    bar.close()
    assert piped.getvalue() == ""


def test_a_terminal_that_goes_away_ends_the_progress_line_not_the_report():
    import pty

    from slurmagent.commands.report import TerminalProgress

    master, slave = pty.openpty()
    tty = open(slave, "w")
    bar = TerminalProgress(tty, every_s=0.0)
    bar(1, 3)
    os.close(master)  # the terminal is gone: writes fail with EIO
    bar(2, 3)
    bar(3, 3)
    bar.close()  # no exception: the line is off, the report still comes (on stdout)
    assert bar.on is False
    with contextlib.suppress(OSError):
        tty.close()


def test_a_hung_attempts_wait_for_the_hang_watch_is_its_own_cause_and_training_is_not_startup():
    """Before: the ~120 s from a hang to its kill showed as recompute, and an attempt killed after
    30 s of training without a commit showed all of it as startup."""
    from slurmagent.core.goodput import attempt_parts

    hung = {"started": 1000.0, "restore_s": 10.0, "first_progress": 1040.0, "first_rank_progress": 1020.0,
            "last_commit": 1500.0, "last_progress": 1560.0, "ended": 1700.0, "flush_s": 5.0, "end": "hang"}
    parts = attempt_parts(hung, None)["parts"]
    assert parts["startup"] == 10.0 and parts["progress"] == 480.0  # training from the ranks' first progress
    assert parts["recompute"] == 60.0  # the steps after the last commit, redone by the next attempt
    assert parts["hang_detection"] == 135.0 and parts["flush"] == 5.0  # last progress -> the flush's start
    killed = {"started": 1000.0, "restore_s": 10.0, "first_rank_progress": 1020.0, "last_progress": 1050.0,
              "ended": 1080.0, "flush_s": 0.0, "end": "hang"}
    parts = attempt_parts(killed, None)["parts"]
    assert parts["startup"] == 10.0 and parts["recompute"] == 30.0 and parts["hang_detection"] == 30.0
    requeued = dict(hung, end="requeue")  # not a hang: the time after the last commit is all recompute
    assert attempt_parts(requeued, None)["parts"]["recompute"] == 195.0


def test_recompute_is_the_steps_redone_at_the_jobs_pace_where_the_steps_are_known():
    """A commit lands a sync round after its save: by times alone, the steps between the save
    and the commit counted as progress although the next attempt redoes them."""
    hung = {"started": 1000.0, "restore_s": 10.0, "first_rank_progress": 1020.0, "last_commit": 1500.0,
            "last_progress": 1560.0, "ended": 1700.0, "flush_s": 5.0, "end": "hang",
            "last_progress_step": 540, "committed_step": 400, "step_s": 1.0}
    parts = attempt_parts(hung, None)["parts"]
    assert parts["recompute"] == 140.0  # steps 401..540 at 1 s a step, not 1560 - 1500
    assert parts["progress"] == 540.0 - 140.0 and parts["hang_detection"] == 135.0
    assert sum(parts.values()) == 1700.0 - 1000.0  # the parts still add up to the attempt
    # an attempt that committed nothing: the next one restores what an earlier one committed
    quiet = {"started": 2000.0, "restore_s": 10.0, "first_rank_progress": 2020.0, "last_progress": 2100.0,
             "ended": 2110.0, "flush_s": 0.0, "end": "requeue", "last_progress_step": 480, "step_s": 1.0}
    assert attempt_parts(quiet, None, restored_step=400)["parts"]["recompute"] == 80.0
    assert attempt_parts(quiet, None)["parts"]["recompute"] == 90.0  # unknown: by the times, as before
    report = build_report([rec(0, 1000.0, **{k: v for k, v in hung.items() if k != "started"}),
                           rec(1, 1710.0, **{k: v for k, v in quiet.items() if k != "started"}),
                           rec(2, 2120.0, restore_s=5.0, ended=2200.0, end="completed")], now=2300.0)
    [job] = report["jobs"]
    assert [a["seconds"]["recompute"] for a in job["attempts"][:2]] == [140.0, 80.0], job["attempts"]


def test_a_step_that_is_no_whole_number_makes_the_record_unusable_not_the_report():
    bad = rec(0, 1000.0, ended=1100.0, end="completed", committed_step="400")
    assert goodput.clean_record(bad) == (None, "committed_step: not a whole number in [0, 1e+15]")
    assert goodput.clean_record(rec(0, 1000.0, ended=1100.0, step_s=-1))[1].startswith("step_s: not a number")


def test_the_ledger_takes_the_committed_step_from_the_trainers_word_else_from_its_progress(tmp_path, monkeypatch):
    from slurmagent import trainer

    clock, bucket = Clock(1000.0), FakeBucket()
    ledger = AttemptLedger(bucket, "9", 0, {}, tmp_path, started=990.0, say=print, clock=clock)
    ledger.step_now = lambda: 77
    report = LedgerReport(type("Inner", (), {"restored": lambda s, m: None, "synced": lambda s, *a, **k: None})(),
                          ledger)
    report.restored(None)
    (tmp_path / "m.pt").write_bytes(b"step 60")
    monkeypatch.setenv("SLURMAGENT_CKPT_DIR", str(tmp_path))
    monkeypatch.setattr(trainer, "_saved", [])
    trainer.saved("m.pt", step=60)
    clock.t = 1010.0
    report.synced(Manifest(attempt=0, files={"m.pt": entry(b"step 60")}), 1.0, 1, 7, None)
    assert ledger.committed_step == 60  # the trainer said which step these files are
    (tmp_path / "m.pt").write_bytes(b"step 80!")  # saved again, not declared: the declaration is stale
    report.synced(Manifest(attempt=0, files={"m.pt": entry(b"step 80!")}), 1.0, 1, 8, None)
    assert ledger.committed_step == 77  # the ranks' progress at the commit
    ledger.start_thread.join(5)
    ended = ledger.ended(Outcome(exit_code=0, child_code=0), steps=(5, 90, 0.25))
    assert (ended["committed_step"], ended["last_progress_step"], ended["step_s"]) == (77, 90, 0.25)
