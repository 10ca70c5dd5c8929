"""The wrapper against other users and faults: a private default ckpt dir, a local checkpoint
newer than the bucket's kept, signals and a dead bucket during the restore, visible sync
errors, signals that cannot be caught."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from slurmagent.checkpoint.manifest import entry_content_id
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.state.metrics import Metrics, read_values
from slurmagent.run.job import JobIdentity, RunOptions, WrapperError, default_ckpt_dir, make_private_dir
from slurmagent.run.supervisor import EXIT_FLUSHED, Supervisor
from test_wrapper_requeue import Requeues, attempt

NOBODY = 65534


def run_cli(tmp_path: Path, args: list[str], env_extra: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), **(env_extra or {}))
    for key in ("SLURM_JOB_ID", "STORAGE_EMULATOR_HOST") if "SLURM_JOB_ID" not in (env_extra or {}) else ():
        env.pop(key, None)
    if not (tmp_path / "c.toml").exists():
        (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.fixture
def shared_tmp():
    """A world-writable sticky directory like /tmp, which another user can reach."""
    d = Path(tempfile.mkdtemp(prefix="sa-shared-tmp-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_user(uid: int, fn, *args) -> str:
    """Run `fn(*args)` in a forked child as `uid`; returns what it raised ('' when nothing)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code, msg = 0, b""
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fn(*args)
        except BaseException as exc:  # noqa: BLE001
            code, msg = 1, f"{type(exc).__name__}: {exc}".encode()
        os.write(w, msg)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        out = fh.read().decode()
    os.waitpid(pid, 0)
    return out


# --- the default checkpoint dir is the user's own --------------------------------------------

CLOUD_RUN = {"CLOUD_RUN_JOB": "t", "CLOUD_RUN_TASK_INDEX": "0"}


def test_default_dir_is_private_and_per_user(tmp_path, shared_tmp):
    out = tmp_path / "dir"
    proc = run_cli(tmp_path, ["run", "--", "sh", "-c", f'echo "$SLURMAGENT_CKPT_DIR" > {out}'],
                   {"TMPDIR": str(shared_tmp), **CLOUD_RUN})
    assert proc.returncode == 0, proc.stderr
    ckpt = Path(out.read_text().strip())
    assert ckpt == shared_tmp / f"slurmagent-{os.geteuid()}" / "t-task-0"
    for d in (ckpt, ckpt.parent):
        assert (d.stat().st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_another_users_job_is_not_blocked_by_ours(shared_tmp):
    ident = JobIdentity.from_env(CLOUD_RUN)
    env = {"TMPDIR": str(shared_tmp)}
    make_private_dir(default_ckpt_dir(env, ident))  # root's job ran first
    assert as_user(NOBODY, lambda: make_private_dir(default_ckpt_dir(env, ident))) == ""
    theirs = shared_tmp / f"slurmagent-{NOBODY}" / "t-task-0"
    assert theirs.is_dir() and theirs.stat().st_uid == NOBODY
    # and neither can read the other's checkpoints
    assert "PermissionError" in as_user(NOBODY, lambda: os.listdir(shared_tmp / "slurmagent-0"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
@pytest.mark.parametrize("plant", ["symlink-user-dir", "foreign-user-dir", "symlink-job-dir"])
def test_planted_dir_is_refused_in_one_line_exit_2(tmp_path, shared_tmp, plant):
    attacker = shared_tmp / "attacker"
    mine = shared_tmp / f"slurmagent-{os.geteuid()}"

    def plant_it() -> None:
        attacker.mkdir()
        if plant == "symlink-user-dir":
            os.symlink(attacker, mine)
        elif plant == "foreign-user-dir":
            mine.mkdir(mode=0o777)
            mine.chmod(0o777)

    assert as_user(NOBODY, plant_it) == ""
    if plant == "symlink-job-dir":  # our own parent, but the job's dir inside is a link
        mine.mkdir(mode=0o700)
        os.symlink(attacker, mine / "t-task-0")
    proc = run_cli(tmp_path, ["run", "--", "sh", "-c", 'echo secret > "$SLURMAGENT_CKPT_DIR/model.pt"'],
                   {"TMPDIR": str(shared_tmp), **CLOUD_RUN})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "refusing checkpoint dir" in proc.stderr, proc.stderr
    assert list(attacker.iterdir()) == []  # nothing written where the attacker could read it


def test_own_dir_with_loose_mode_is_made_private(tmp_path):
    d = tmp_path / f"slurmagent-{os.geteuid()}"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    make_private_dir(d / "job")
    assert (d.stat().st_mode & 0o777) == 0o700


def test_unwritable_tmpdir_is_one_line(tmp_path):
    with pytest.raises(WrapperError, match="cannot create checkpoint dir"):
        make_private_dir(tmp_path / "missing" / "slurmagent-0" / "job")


@pytest.mark.parametrize("sig", ["99", "0", "KILL", "SIGSTOP", "NOPE"])
def test_uncatchable_or_unknown_ckpt_signal_is_refused_at_parse_time(tmp_path, sig):
    marker = tmp_path / "started"
    proc = run_cli(tmp_path, ["run", "--ckpt-signal", sig, "--ckpt-dir", str(tmp_path / "ck"), "--",
                              "touch", str(marker)])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--ckpt-signal" in proc.stderr and not marker.exists()


# --- a single node keeps its newer local checkpoint ------------------------------------------


@pytest.fixture
def emu(gcs_emulator_factory, monkeypatch):
    emu = gcs_emulator_factory()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    return emu


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
    errors = ("slurmagent_checkpoint_sync_errors_total", 'slurmagent_checkpoint_lag_seconds{job="lag-task-0"}')

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
    from slow_proxy import SlowProxy

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
