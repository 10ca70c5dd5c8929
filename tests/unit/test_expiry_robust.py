"""The expiry watch and its readers under bad input and flapping notices: garbage times from
the Compute API (through tests/support/fake_gcp_expiry.py and the real client), a maintenance notice
withdrawn and re-issued, a stale state file that a stopped watch left behind.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_expiry_robust_gcp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone


from support import REPO
from slurmagent.state import expiry_state, host
from slurmagent.policy import expiry as expiry_policy

BOOT = "boot-a"
T0 = 1_800_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- 21.15: a stale expiry state left by a watch that stopped ------------------------------------


def _run_wrapper(tmp_path, termination: float) -> subprocess.CompletedProcess:
    """`slurmagent run` (no Slurm) next to an expiry state of this boot holding `termination`."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "expiry.json").write_text(json.dumps({"termination_time": iso(termination), "boot_id": host.boot_id(),
                                                   "source": "compute-api"}))
    (tmp_path / "c.toml").write_text(f'state_dir = "{state}"\n[expiry]\npublish_run_file = false\n')
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"),
                           "--grace", "2", "--", sys.executable, "-c", "import time, sys; time.sleep(1); sys.exit(7)"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_termination_time_long_past_is_stale_the_job_runs_and_it_is_said_once(tmp_path):
    proc = _run_wrapper(tmp_path, time.time() - 600)  # the watch stopped 10 min ago; this VM lives on
    assert proc.returncode == 7, proc.stderr  # the job ran to its own end: no flush, no requeue
    assert "asking the job to checkpoint" not in proc.stderr
    assert proc.stderr.count("ignoring the termination time") == 1, proc.stderr
    assert "stale" in proc.stderr


def test_a_termination_time_just_past_still_flushes(tmp_path):
    proc = _run_wrapper(tmp_path, time.time() - 60)  # a VM a minute late: its end is still coming
    assert "VM expiry in 0 s: asking the job to checkpoint" in proc.stderr, proc.stderr
    assert "ignoring the termination time" not in proc.stderr


def test_the_reader_ignores_a_stale_time_past_the_watchs_own_grace(tmp_path, capsys):
    state = tmp_path / "expiry.json"
    state.write_text(json.dumps({"termination_time": iso(T0), "boot_id": BOOT}))
    assert expiry_state.STALE_AFTER_S == expiry_policy.NOTICE_GRACE_S
    at_margin = T0 + expiry_state.STALE_AFTER_S
    assert expiry_state.termination_time((state,), BOOT, now=at_margin).timestamp() == T0
    assert expiry_state.termination_time((state,), BOOT, now=at_margin + 1) is None
    copy = tmp_path / "copy.json"
    copy.write_text(state.read_text())
    assert expiry_state.termination_time((state, copy), BOOT, now=at_margin + 5) is None
    assert capsys.readouterr().err.count("ignoring the termination time") == 1
