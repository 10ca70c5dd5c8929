"""The wrapper against other users and faults: a private default ckpt dir, a local checkpoint
newer than the bucket's kept, signals and a dead bucket during the restore, visible sync
errors, signals that cannot be caught.

The same subject without a cluster, emulator or fake server: tests/unit/test_wrapper_hardening.py.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading


from support import REPO, wait_for
from slurmagent.checkpoint.manifest import entry_content_id
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.state.metrics import Metrics, read_values
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import EXIT_FLUSHED, Supervisor
from test_wrapper_requeue import Requeues, attempt
from test_wrapper_hardening import CLOUD_RUN


# --- a single node keeps its newer local checkpoint ------------------------------------------


def committed_state() -> str:
    return entry_content_id(GcsCheckpointStore("gs://ckpt/jobs/77").latest_manifest().files["state"])


def test_after_a_failed_final_sync_the_same_node_keeps_the_newer_local_files(emu, tmp_path):
    node = tmp_path / "n1" / "ckpt"
    first, _ = attempt(tmp_path, 0, "A", ckpt_dir=node)
    assert first.synced
    a_sha = committed_state()
    # attempt 1 on the same node writes B; the bucket is down at its flush
    second, err = attempt(tmp_path, 1, "B", ckpt_dir=node, before_flush=emu.stop, grace_s=2, final_sync_floor_s=1)
    assert not second.synced and "final sync failed" in err and second.exit_code == EXIT_FLUSHED
    assert "kept the local checkpoint" in err  # A was already here: nothing downloaded over it
    emu.start()
    third, err = attempt(tmp_path, 2, "", ckpt_dir=node)
    assert third.resumed
    assert "kept the local checkpoint in" in err and "1 newer file(s) the last sync did not commit" in err, err
    assert (node / "state").read_text() == "B"  # not overwritten with the bucket's older A
    assert committed_state() != a_sha  # and B is now committed


def test_the_sync_after_a_restore_neither_reads_nor_sends_the_restored_files(emu, tmp_path, monkeypatch):
    """A restore of hundreds of GB would otherwise be read back whole by the first sync after it."""
    from slurmagent.checkpoint import hashing as checkpoint_hash

    attempt(tmp_path, 0, "A")
    hashed: list[str] = []
    real = checkpoint_hash.hash_file
    monkeypatch.setattr(checkpoint_hash, "hash_file", lambda path, *a, **k: hashed.append(str(path)) or real(path, *a, **k))
    outcome, err = attempt(tmp_path, 1, "")  # a fresh node: restores A, writes nothing new, flushes
    assert outcome.resumed and outcome.synced and "restored checkpoint of attempt 0" in err, err
    assert hashed == []
    assert (tmp_path / "node-1" / "ckpt" / "state").read_text() == "A"


def test_a_newer_checkpoint_from_another_node_replaces_an_older_local_one(emu, tmp_path):
    n1, n2 = tmp_path / "n1" / "ckpt", tmp_path / "n2" / "ckpt"
    attempt(tmp_path, 0, "A", ckpt_dir=n1)
    _, err = attempt(tmp_path, 1, "C", ckpt_dir=n2)  # requeued onto n2, committed C
    assert "restored checkpoint of attempt 0" in err
    _, err = attempt(tmp_path, 2, "", ckpt_dir=n1)  # back on n1, whose A is older
    assert "restored checkpoint of attempt 1" in err, err
    assert (n1 / "state").read_text() == "C"


def test_multi_node_restore_always_takes_the_committed_checkpoint(emu, tmp_path):
    n1 = tmp_path / "n1" / "ckpt"
    attempt(tmp_path, 0, "A", ckpt_dir=n1)
    (n1 / "state").write_text("local only")
    _, err = attempt(tmp_path, 1, "", ckpt_dir=n1, multi_node=True)
    assert "restored checkpoint of attempt 0" in err and (n1 / "state").read_text() == "A"


# --- signals and a dead bucket during the restore --------------------------------------------


def test_restore_with_bucket_down_says_what_it_does_and_a_flush_ends_it_cleanly(emu, tmp_path):
    attempt(tmp_path, 0, "A")
    emu.stop()
    err = io.StringIO()
    requeues = Requeues()
    opts = RunOptions(cmd=["touch", str(tmp_path / "started")], ckpt_dir=tmp_path / "n2" / "ckpt",
                      remote="gs://ckpt/jobs/77", progress_report_s=0.3, restore_deadline_s=20)
    sup = Supervisor(opts, JobIdentity("slurm", "77", "77", 1, ("77",)), GcsCheckpointStore(opts.remote), requeues,
                     dict(os.environ), err=err)

    def term_once_said() -> None:
        wait_for(lambda: "still restoring" in err.getvalue(), 60, "a progress line")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_once_said, daemon=True).start()
    outcome = sup.run()
    text = err.getvalue()
    assert "still restoring from gs://ckpt/jobs/77 after" in text and "gives up at 20 s" in text
    assert "last: reading the manifest" in text or "last: " in text, text
    assert "SIGTERM during the restore: not starting the job" in text
    assert outcome.exit_code == EXIT_FLUSHED and requeues == ["77"] and not (tmp_path / "started").exists()
    assert "never started" in outcome.summary


def test_sigterm_during_restore_is_a_clean_exit_143_not_a_kill(emu, tmp_path):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/jobs"\n')
    emu.stop()
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), **CLOUD_RUN)
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"),
                             "--", "touch", str(tmp_path / "started")], env=env, stderr=subprocess.PIPE, text=True)
    threading.Timer(3.0, proc.send_signal, (signal.SIGTERM,)).start()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_FLUSHED, stderr
    assert stderr.strip().splitlines()[-1].startswith("slurmagent run: exit 143: stopped during the restore")
    assert not (tmp_path / "started").exists()


# --- background sync errors are said, counted, and the lag is measured -----------------------


def test_background_sync_errors_are_said_once_counted_and_the_lag_shows(emu, tmp_path):
    metrics_dir = tmp_path / "state"
    err = io.StringIO()
    ckpt = tmp_path / "ckpt"
    stop = tmp_path / "stop"
    writer = ('i=0; while [ ! -e "$1" ]; do i=$((i+1)); printf "%s" "$i" > "$SLURMAGENT_CKPT_DIR/.s.tmp"; '
              'mv "$SLURMAGENT_CKPT_DIR/.s.tmp" "$SLURMAGENT_CKPT_DIR/state"; sleep 0.2; done')
    opts = RunOptions(cmd=["sh", "-c", writer, "sh", str(stop)], ckpt_dir=ckpt, remote="gs://ckpt/jobs/lag",
                      sync_interval_s=0.5, sync_deadline_s=1.0, error_report_s=3600)
    sup = Supervisor(opts, JobIdentity("cloud-run", "lag", "lag-task-0", 0), GcsCheckpointStore(opts.remote, timeout_s=2),
                     None, dict(os.environ), err=err, metrics=Metrics(metrics_dir))
    errors = ("slurmagent_checkpoint_sync_errors_total", 'slurmagent_checkpoint_lag_seconds{job_id="lag-task-0"}')

    def scenario() -> None:
        wait_for(lambda: GcsCheckpointStore(opts.remote).latest_manifest(), 30, "a first commit")
        emu.stop()
        wait_for(lambda: read_values(metrics_dir).get(errors[0], 0) >= 2, 120, "two failed syncs")
        wait_for(lambda: read_values(metrics_dir).get(errors[1], 0) > 1.0, 60, "a lag above 1 s")
        emu.start()
        wait_for(lambda: "works again" in err.getvalue(), 120, "a sync after the bucket came back")
        stop.touch()

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    outcome = sup.run()
    t.join(5)
    text = err.getvalue()
    assert outcome.exit_code == 0 and outcome.synced, text
    assert text.count("background sync to gs://ckpt/jobs/lag failed") == 1, text  # said once, not every try
    assert "the bucket lags behind" in text
    values = read_values(metrics_dir)
    assert values[errors[0]] >= 2
    assert errors[1] not in values  # the job is over: its lag series is gone
    prom = (metrics_dir / "slurmagent.prom").read_text()
    assert "# TYPE slurmagent_checkpoint_sync_errors_total counter" in prom


# --- the flush's deadline holds with a sync in flight, odd names and unreadable files --------


def test_a_background_sync_in_flight_on_a_slow_link_does_not_delay_the_requeue(emu, tmp_path, monkeypatch):
    """SIGTERM while the periodic sync is still pushing 12 MB at 1 MB/s: the final sync gets what is
    left of the grace (not the background sync's 30 s), then the job is requeued."""
    from support.slow_proxy import SlowProxy

    ready = tmp_path / "ready"
    trainer = ('trap "exit 0" USR1; head -c 12000000 /dev/urandom > "$SLURMAGENT_CKPT_DIR/shard.pt"; '
               ': > "$1"; while :; do sleep 0.02; done')
    with SlowProxy("127.0.0.1", emu.port, upload_bps=1_000_000) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        requeues = Requeues()
        err = io.StringIO()
        opts = RunOptions(cmd=["sh", "-c", trainer, "sh", str(ready)], ckpt_dir=tmp_path / "ckpt",
                          remote="gs://ckpt/jobs/77", grace_s=2.0, final_sync_floor_s=1.0, sync_interval_s=0.2,
                          sync_deadline_s=30.0, stop_wait_s=5)
        sup = Supervisor(opts, JobIdentity("slurm", "77", "77", 0, ("77",)), GcsCheckpointStore(opts.remote),
                         requeues, dict(os.environ), err=err)

        def term_during_the_background_sync() -> None:
            wait_for(ready.exists, 30, "trainer start", interval=0.02)
            wait_for(lambda: sup.sync_lock.locked(), 30, "a background sync in flight", interval=0.01)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=term_during_the_background_sync, daemon=True).start()
        outcome = sup.run()
    text = err.getvalue()
    assert outcome.exit_code == EXIT_FLUSHED and requeues == ["77"], text
    assert not outcome.synced and "final sync failed" in text, text
    # the flush kept its deadline: the grace (2 s) plus the stop, not the background sync's 12-30 s
    assert outcome.flush_seconds < 10, (outcome.flush_seconds, text)


def test_odd_names_sync_and_the_next_attempt_restores_them(emu, tmp_path):
    """A name with a backslash (or bytes that are not UTF-8) is committed, and the requeued job
    starts again with it restored: sync and restore apply one name rule."""
    node = tmp_path / "n1" / "ckpt"

    def plant() -> None:
        (node / "model\\v1.pt").write_bytes(b"weights")
        (node / os.fsdecode(b"opt-\xff.pt")).write_bytes(b"optimizer")

    first, err = attempt(tmp_path, 0, "A", ckpt_dir=node, before_flush=plant)
    assert first.synced and first.exit_code == EXIT_FLUSHED, err
    second, err = attempt(tmp_path, 1, "", ckpt_dir=tmp_path / "n2" / "ckpt")
    assert second.resumed and "restored checkpoint of attempt 0" in err, err
    n2 = tmp_path / "n2" / "ckpt"
    assert (n2 / "model\\v1.pt").read_bytes() == b"weights"
    assert (n2 / os.fsdecode(b"opt-\xff.pt")).read_bytes() == b"optimizer"


def test_a_file_the_sync_cannot_read_is_left_out_and_the_job_is_still_requeued(emu, tmp_path):
    """A FIFO or unreadable file in the checkpoint dir: one line, the rest committed, requeued."""
    node = tmp_path / "n1" / "ckpt"

    def plant() -> None:
        os.mkfifo(node / "pipe")
        os.symlink("/etc/shadow", node / "secret")

    requeues = Requeues()
    first, err = attempt(tmp_path, 0, "A", ckpt_dir=node, before_flush=plant, requeues=requeues)
    assert first.synced and first.exit_code == EXIT_FLUSHED and requeues == ["77"], err
    files = set(GcsCheckpointStore("gs://ckpt/jobs/77").latest_manifest().files)
    assert files == {"state"}, files
    assert "Traceback" not in err and "secret" in err, err
