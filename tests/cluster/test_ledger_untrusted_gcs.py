"""The goodput ledger is written by every job's user under their own prefix: `slurmagent report`
reads it as untrusted input, on the Cloud Storage emulator (issue 36).

* Bad records (wrong types, infinities, 30 kB of nesting) are skipped and counted; the good
  ones are reported. Before: one of them was a traceback and no report for the whole fleet.
* 3,000 records (30 jobs x 100 attempts) behind a slow network (40 ms a request) are read 16 at a time; past the
  deadline the report says what it read and that it is partial. Before: one after another
  under one deadline, and past it no output at all.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from support import REPO
from support.gcs_fault_proxy import GcsFaultProxy

from slurmagent.checkpoint.gcs.bucket import make_client
from slurmagent.checkpoint.gcs.ledger import LedgerBucket
from slurmagent.core.goodput import build_report, format_text


def put(name: str, data: bytes) -> None:
    make_client().bucket("ckpt").blob(name).upload_from_string(data, content_type="application/json")


def good(job: str, attempt: int = 0) -> bytes:
    return json.dumps({"job": job, "attempt": attempt, "started": 1000.0, "ended": 2000.0, "end": "completed",
                       "first_progress": 1100.0, "last_commit": 1900.0, "gpus": 8}).encode()


def test_bad_records_are_skipped_and_counted_and_the_fleet_still_gets_its_report(emu, tmp_path):
    put("fleet/1/ledger/1-0.json", good("1"))
    put("fleet/2/ledger/2-0.json", json.dumps({"job": "2", "attempt": 0, "started": 1000.0, "gpus": "eight"}).encode())
    put("fleet/3/ledger/3-0.json", b"[" * 30000)
    put("fleet/4/ledger/4-0.json", b'{"job": "4", "attempt": 0, "started": 1000.0, "ended": Infinity}')
    put("fleet/5/ledger/5-0.json", json.dumps({"job": "5", "attempt": 0, "started": 1e308}).encode())
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURMAGENT_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    r = subprocess.run([sys.executable, "-m", "slurmagent.entry", "report", "--remote", "gs://ckpt/fleet", "--json",
                        "--html", str(tmp_path / "r.html")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.split("\nwrote")[0])
    assert [j["job"] for j in report["jobs"]] == ["1"] and report["jobs"][0]["ettr"] == 0.8
    assert report["skipped_records"] == 3 and report["skipped_why"] == {
        "ended: not a time between 1970 and 2099": 1,  # Infinity: Python's JSON reads it; the report never writes it
        "gpus: not a whole number in [0, 100000]": 1, "started: not a time between 1970 and 2099": 1}
    assert [e.split(": ", 1)[1] for e in report["errors"]] == ["not JSON"]  # the nested one, never parsed deeper
    assert "Infinity" not in r.stdout and "NaN" not in r.stdout
    assert "Traceback" not in r.stderr and (tmp_path / "r.html").stat().st_size > 0


def test_three_thousand_records_behind_a_slow_network_give_a_partial_report_with_a_note(emu, monkeypatch):
    with ThreadPoolExecutor(16) as pool:
        # 30 jobs of 100 attempts each (a requeue-heavy fleet)
        list(pool.map(lambda i: put(f"many/j{i // 100}/ledger/{i // 100}-{i % 100}.json", good(str(i // 100), i % 100)),
                      range(3000)))
    with GcsFaultProxy(emu.url, delay_s=0.04) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        seen: list[tuple[int, int]] = []  # what a terminal's progress line is drawn from
        records, errors = LedgerBucket("gs://ckpt/many").read_all(deadline_s=4, progress=lambda d, t: seen.append((d, t)))
    assert 0 < len(records) < 3000
    assert {t for _, t in seen} == {3000} and [d for d, _ in seen] == list(range(1, len(seen) + 1))
    assert len(records) <= len(seen) < 3000
    assert len(errors) == 1 and "the report is partial" in errors[0], errors
    report = build_report(records, now=3000.0, errors=errors)
    assert report["totals"]["attempts"] == len(records)
    text = format_text(report)
    assert "the report is partial" in text
