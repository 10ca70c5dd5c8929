"""A checkpoint file rewritten in place is never committed half-written (issue 35, "Never
torn"): the real `slurmagent run` (a Cloud Run task, so no Slurm is needed) against the
Cloud Storage emulator, a trainer that saves `model.pt` in place (`open(..., "wb")`, as
`torch.save(obj, path)` does) and stalls half-way with the file open.

* While it is open for writing, no periodic round takes it (before: it was "quiet for a
  round" once the stalled writer stopped changing it, and a round committed 400 kB of 1 MB).
* When the grace runs out and the wrapper kills the trainer, the file was open for writing
  at the kill: the final sync leaves its unit at the last commit and says so (before: the
  final sync took every file as it was).
* A hard kill (the VM gone) restores the previous whole file.
* The hang watch's kill of the stalled save (silence past `--hang-timeout`) does the same as
  the grace's: the torn file stays out of the final commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import REPO, wait_for

SIZE = 1_000_000
# v1 saved in place and closed; on the test's word, v2 rewritten in place: 400 kB, then stalled
# with the file open. The checkpoint signal (SIGUSR1) is ignored: the save never finishes.
IN_PLACE_WRITER = r'''
import os, signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
d, marks = os.environ["SLURMAGENT_CKPT_DIR"], sys.argv[1]
open(os.path.join(marks, "pid"), "w").write(str(os.getpid()))
if os.environ.get("SLURMAGENT_RESUMED") != "1":
    with open(os.path.join(d, "model.pt"), "wb") as f:
        f.write(b"1" * 1_000_000)
    if sys.argv[2] == "exit":  # this attempt ends here: its final sync commits v1
        sys.exit(0)
while not os.path.exists(os.path.join(marks, "rewrite")):
    time.sleep(0.05)
f = open(os.path.join(d, "model.pt"), "wb")
f.write(b"2" * 400_000)
f.flush()
open(os.path.join(marks, "stalled"), "w").close()
while True:
    time.sleep(1)
'''


def start(tmp_path: Path, name: str, grace: float = 1.0, sync_interval: float = 0.5, attempt: int = 0,
          then: str = "rewrite", code: str = IN_PLACE_WRITER, settle_s: float = 2.0, run_opts: tuple = (), config_extra: str = ""):
    """`slurmagent run` of the trainer `code` (argv: a folder for its marks, `then`) as attempt
    `attempt` of Cloud Run task `name`; (wrapper, marks folder, its stderr file, the task's store)."""
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    writer, marks = tmp_path / "writer.py", tmp_path / f"marks{attempt}"
    writer.write_text(code)
    marks.mkdir()
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/{name}"\n'
                      f'settle_s = {settle_s}\n{config_extra}')
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), CLOUD_RUN_JOB=name,
               CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_ATTEMPT=str(attempt))
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED"):
        env.pop(key, None)
    err = tmp_path / f"wrapper{attempt}.err"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "vm"),
         "--sync-interval", str(sync_interval), "--grace", str(grace), *run_opts, "--", sys.executable, str(writer),
         str(marks),
         then],
        env=env, stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True,
        cwd=tmp_path)  # the hang evidence goes beside the job's output: the test's folder
    return proc, marks, err, GcsCheckpointStore(f"gs://ckpt/{name}/{name}-task-0")


def committed_size(store) -> int | None:
    m = store.latest_manifest()
    return m.files["model.pt"]["size"] if m is not None and "model.pt" in m.files else None


def stall_after_v1_is_committed(proc, marks: Path, err: Path, store) -> None:
    """v1 committed, then the rewrite stalled half-way; four more rounds (0.5 s each) pass."""
    wait_for(lambda: committed_size(store) == SIZE, 60, "v1 committed: " + err.read_text()[-2000:])
    (marks / "rewrite").touch()
    wait_for((marks / "stalled").exists, 30, "the rewrite to stall")
    time.sleep(2.0)  # four sync rounds of 0.5 s with the half-written file quiet and open
    assert proc.poll() is None, err.read_text()


def test_a_stalled_in_place_save_is_never_committed_and_the_kill_at_the_grace_keeps_the_last_whole(emu, tmp_path):
    proc, marks, err, store = start(tmp_path, "torn-grace")
    try:
        stall_after_v1_is_committed(proc, marks, err, store)
        assert committed_size(store) == SIZE, err.read_text()  # no round took the 400 kB
        os.kill(proc.pid, signal.SIGTERM)  # Cloud Run's stop: checkpoint signal, grace 1 s, kill
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.read_text()
    assert "model.pt was open for writing when the job was stopped (torn); its last committed version stays" in text, text
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    assert (restored / "model.pt").read_bytes() == b"1" * SIZE, text
    assert (tmp_path / "vm" / "model.pt").stat().st_size == 400_000  # the torn file stays on the node, uncommitted


def test_a_hard_kill_during_an_in_place_save_restores_the_previous_whole_file(emu, tmp_path):
    proc, marks, err, store = start(tmp_path, "torn-hard")
    try:
        stall_after_v1_is_committed(proc, marks, err, store)
    finally:
        trainer = int((marks / "pid").read_text()) if (marks / "pid").exists() else 0
        for pid in (proc.pid, trainer):  # the VM is gone: every process at once
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait(10)
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    assert (restored / "model.pt").read_bytes() == b"1" * SIZE, err.read_text()


def test_the_grace_kill_of_a_save_no_round_saw_keeps_the_last_whole_file(emu, tmp_path):
    """The kill path alone: attempt 0 commits v1 and exits; attempt 1 (sync interval an hour:
    no periodic round) rewrites model.pt in place and stalls; the wrapper's stop kills it."""
    first, _, err0, store = start(tmp_path, "torn-final", then="exit")
    assert first.wait(60) == 0, err0.read_text()
    assert committed_size(store) == SIZE, err0.read_text()
    proc, marks, err, _ = start(tmp_path, "torn-final", sync_interval=3600, attempt=1)
    try:
        (marks / "rewrite").touch()
        wait_for((marks / "stalled").exists, 30, "the rewrite to stall: " + err.read_text()[-2000:])
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.read_text()
    assert "model.pt was open for writing when the job was stopped (torn); its last committed version stays" in text, text
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    assert (restored / "model.pt").read_bytes() == b"1" * SIZE, text


def test_the_hang_watchs_kill_of_a_stalled_in_place_save_keeps_the_last_whole_file(emu, tmp_path):
    """Attempt 0 commits v1 and exits; attempt 1 rewrites model.pt in place and stalls with it
    open; it never reports progress, so after its first-progress limit (3 s here) the hang
    watch kills it."""
    first, _, err0, store = start(tmp_path, "torn-hang", then="exit")
    assert first.wait(60) == 0, err0.read_text()
    assert committed_size(store) == SIZE, err0.read_text()
    proc, marks, err, _ = start(tmp_path, "torn-hang", sync_interval=3600, attempt=1, run_opts=("--hang-timeout", "3"),
                          config_extra="[run]\nhang_first_progress_s = 3\n")
    try:
        (marks / "rewrite").touch()
        wait_for((marks / "stalled").exists, 30, "the rewrite to stall: " + err.read_text()[-2000:])
        proc.wait(120)  # the hang watch ends it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.read_text()
    assert "hang: no progress" in text and list(tmp_path.glob("slurmagent-torn-hang-task-0.hang-*")), text
    assert "model.pt was open for writing when the job was stopped (torn); its last committed version stays" in text, text
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    assert (restored / "model.pt").read_bytes() == b"1" * SIZE, text
