"""The goodput ledger on the real cluster: a wrapped job interrupted once (SIGTERM to its batch
step, as Slurm's preemption or an admin's requeue sends it) and then completed leaves one record
per attempt beside its checkpoint, and `slurmagent report` reads them back.

The arithmetic on hand-made ledgers: tests/unit/test_goodput.py; the page in a browser:
tests/unit/test_report_page.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import REPO, cluster_config_text, wait_for
from slurmagent.checkpoint.gcs.ledger import LedgerBucket
from test_wrapper_slurm import TOY, ledger_steps


@pytest.mark.slurm
@pytest.mark.slow
def test_an_interrupted_job_leaves_two_records_and_report_shows_the_interruption(slurm, emu, tmp_path):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 1.0\n'
                      "grace_s = 10.0\n")
    steps, out = tmp_path / "steps", tmp_path / "out"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--open-mode=append",
         "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", sys.executable, TOY, "200", str(steps), "0.05"],
        env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    c.wait_job(job_id, ("RUNNING",), 60)
    wait_for(lambda: steps.exists() and len(ledger_steps(steps)) >= 20, 60, "20 steps")
    c.run(["scancel", "--batch", "--signal=TERM", job_id])
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 150,
                   "job end")
    log = out.read_text()
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 1, log
    assert "could not write the goodput ledger" not in log, log

    records, errors = LedgerBucket(f"gs://ckpt/jobs/{job_id}").read_all(deadline_s=60)
    assert errors == []
    by_attempt = {r["attempt"]: r for r in records}
    assert sorted(by_attempt) == [0, 1], records
    first, second = by_attempt[0], by_attempt[1]
    assert first["state"] == second["state"] == "ended"
    assert first["end"] == "sigterm" and first["requeued"] and first["job"] == job_id
    assert second["end"] == "completed" and not second["requeued"] and second["exit_code"] == 0
    assert first["started"] < first["ended"] <= second["started"] < second["ended"]
    assert first["last_commit"] is not None and first["first_progress"] <= first["last_commit"]
    assert second["restore_s"] >= 0 and second["nodes"]

    shown = subprocess.run([sys.executable, "-m", "slurmagent.entry", "report", "--remote", "gs://ckpt/jobs",
                            "--job", job_id, "--json", "--html", str(tmp_path / "report.html")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    (j,) = report["jobs"]
    assert [a["attempt"] for a in j["attempts"]] == [0, 1]
    assert [i["cause"] for i in j["interruptions"]] == ["sigterm"]
    assert 0 < j["ettr"] <= 1
    assert j["lost"]["pending"]["seconds"] == pytest.approx(second["started"] - first["ended"], abs=0.01)
    page = (tmp_path / "report.html").read_text()
    assert f'data-job="{job_id}"' in page and 'class="interruption" data-cause="sigterm"' in page

    text = subprocess.run([sys.executable, "-m", "slurmagent.entry", "report", "--remote", "gs://ckpt/jobs",
                           "--job", job_id], env=env, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and f"job {job_id}" in text.stdout and "ETTR " in text.stdout, text.stderr
    assert "attempt 0:" in text.stdout and "sigterm (requeued)" in text.stdout
