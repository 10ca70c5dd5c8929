"""The wrapper against other users and faults: a private default ckpt dir, a local checkpoint
newer than the bucket's kept, signals and a dead bucket during the restore, visible sync
errors, signals that cannot be caught.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_wrapper_hardening_gcs.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import REPO
from slurmagent.run.job import JobIdentity, WrapperError, default_ckpt_dir, make_private_dir

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
