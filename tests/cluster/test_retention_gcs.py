"""Retention on the Cloud Storage emulator: the bucket keeps the objects of `keep_commits` commits.

The pure rule (which commits are kept, which objects may go) is in tests/unit/test_retention.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

from slurmagent.checkpoint.errors import StaleAttemptError
from slurmagent.checkpoint.gcs.bucket import make_client
from slurmagent.checkpoint.gcs.retention import manifest_objects
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.checkpoint.manifest import Manifest
from test_checkpoint import KiB, write_tree

PREFIX = "job1"


def store(**kw) -> GcsCheckpointStore:
    kw.setdefault("timeout_s", 5)
    kw.setdefault("keep_commits", 2)
    kw.setdefault("gc_grace_s", 0)
    return GcsCheckpointStore(f"gs://ckpt/{PREFIX}", **kw)


def names(sub: str) -> set[str]:
    return {b.name for b in make_client().list_blobs("ckpt", prefix=f"{PREFIX}/{sub}")}


def records() -> list[Manifest]:
    bucket = make_client().bucket("ckpt")
    return [Manifest.from_json(bucket.blob(n).download_as_bytes()) for n in sorted(names("commits/"))]


def payload(tag: str, size: int = 300 * KiB) -> bytes:
    """Bytes of its own blob (larger than a pack member), distinct per tag."""
    return (tag.encode() * (size // len(tag) + 1))[:size]


def train_step(ckpt: Path, step: int, keep_folders: int = 2) -> None:
    """What a trainer with save_total_limit=2 does: write step N, delete the folders beyond the last two."""
    write_tree(ckpt, {f"step{step}/model.pt": payload(f"model{step}"), f"step{step}/meta.json": b'{"step": %d}' % step})
    old = ckpt / f"step{step - keep_folders}"
    if old.exists():
        for p in sorted(old.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        old.rmdir()


def restore_tree(s: GcsCheckpointStore, dest: Path) -> dict[str, bytes]:
    s.restore(dest)
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_ten_commits_keeping_two_step_folders_leave_only_the_kept_commits_blobs(emu, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state.json"
    ckpt.mkdir()
    make_client().bucket("ckpt").blob(f"{PREFIX}/ledger/attempt-0.json").upload_from_string(b"{}")
    s = store()
    for step in range(1, 11):
        train_step(ckpt, step)
        # a file whose bytes come back after their blob was collected (steps 1-3 and 9-10: "A")
        write_tree(ckpt, {"shared.bin": payload("A" if step <= 3 or step >= 9 else f"B{step}")})
        s.sync(ckpt, 0, state)
        assert s.last_gc is not None and not s.last_gc.fenced

    kept = records()
    assert len(kept) == 2  # keep_commits
    assert [sorted({r.split("/")[0] for r in m.files}) for m in kept] == [
        ["shared.bin", "step8", "step9"], ["shared.bin", "step10", "step9"]]
    referenced = set().union(*(manifest_objects(s.objects, m) for m in kept))
    assert names("blobs/") == referenced  # nothing else is left: at most the kept commits' blobs
    assert names("ledger/") == {f"{PREFIX}/ledger/attempt-0.json"}  # never touched

    # the newest commit restores whole, "A" included although its blob was deleted in between
    got = restore_tree(store(), tmp_path / "restored")
    assert got["shared.bin"] == payload("A")
    assert got["step10/model.pt"] == payload("model10") and "step8/model.pt" not in got
    # and the commit before it (kept) still has every object it needs
    assert manifest_objects(s.objects, kept[0]) <= names("blobs/")


def test_a_late_older_attempt_is_fenced_out_and_deletes_nothing_the_newest_references(emu, tmp_path):
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old_dir.mkdir()
    old = store(gc_grace_s=3600)  # attempt 1: no clean-up while it commits (every blob is young)
    for tag in ("P", "Q", "R"):
        write_tree(old_dir, {"model.pt": payload(tag)})
        old.sync(old_dir, 1, tmp_path / "old-state.json")
    p_blob = s_blob = store().blob_name(f"blake3:{records()[0].files['model.pt']['blake3']}")

    new = store(gc_grace_s=3600)

    def newer_attempt_commits_meanwhile() -> None:
        # attempt 2 restored and commits the bytes of commit 1 again: the blob the older attempt planned to delete
        new.restore(new_dir)
        write_tree(new_dir, {"model.pt": payload("P")})
        new.sync(new_dir, 2, tmp_path / "new-state.json")

    result = old.collect_garbage(attempt=1, grace_s=0, before_delete=newer_attempt_commits_meanwhile)
    assert result.fenced and "attempt 2" in result.fenced
    assert result.deleted == []
    assert s_blob in names("blobs/")
    newest = new.latest_manifest()
    assert newest.attempt == 2 and manifest_objects(new.objects, newest) <= names("blobs/")

    # the older attempt finishing late: its sync is refused and it cleans up nothing
    before = names("")
    write_tree(old_dir, {"model.pt": payload("late")})
    with pytest.raises(StaleAttemptError):
        old.sync(old_dir, 1, tmp_path / "old-state.json", deadline_s=30)
    assert old.collect_garbage(attempt=1, grace_s=0).fenced
    assert {n for n in names("") if "/blobs/" in n} >= {n for n in before if "/blobs/" in n}
    assert restore_tree(store(), tmp_path / "restored") == {"model.pt": payload("P")}
    assert p_blob in names("blobs/")


def test_by_hand_gc_rereads_the_newest_manifest_before_deleting(emu, tmp_path):
    """No attempt, no fence: a commit made while the clean-up planned still keeps its blobs."""
    d = tmp_path / "ckpt"
    d.mkdir()
    s = store(gc_grace_s=3600)
    for tag in ("P", "Q", "R"):
        write_tree(d, {"model.pt": payload(tag)})
        s.sync(d, 0, tmp_path / "state.json")

    def commit_p_again() -> None:
        write_tree(d, {"model.pt": payload("P")})
        s.sync(d, 0, tmp_path / "state.json")

    result = store().collect_garbage(grace_s=0, before_delete=commit_p_again)
    assert not result.fenced
    newest = s.latest_manifest()
    assert manifest_objects(s.objects, newest) <= names("blobs/")
    assert restore_tree(store(), tmp_path / "restored") == {"model.pt": payload("P")}


def test_superseded_manifests_keep_their_blobs(emu, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    first = store(gc_grace_s=3600)
    first.owner = "job-a"
    write_tree(d, {"model.pt": payload("first")})
    first.sync(d, 0, tmp_path / "a.json")
    current, generation = first.read_manifest()
    second = store()
    second.owner = "job-b"
    second.claim(Manifest(attempt=0, files={}), current, generation)
    for tag in ("x", "y", "z"):
        write_tree(d, {"model.pt": payload(tag)})
        second.sync(d, 0, tmp_path / "b.json")
    assert manifest_objects(first.objects, current) <= names("blobs/")


# ------------------------------------------------------------------ marks for the bucket's lifecycle rule


def listed(sub: str) -> dict[str, object]:
    """name -> the listed object (customTime, updated, generation), as the lifecycle rule sees them."""
    return {b.name: b for b in make_client().list_blobs("ckpt", prefix=f"{PREFIX}/{sub}")}


def test_a_finished_jobs_garbage_is_marked_for_the_lifecycle_rule(emu, tmp_path):
    """A job's clean-ups delete nothing inside the grace; what it leaves when it ends carries a
    customTime (the moment the rule would delete it), what the kept commits need carries none."""
    ckpt, state = tmp_path / "ckpt", tmp_path / "state.json"
    ckpt.mkdir()
    s = store(gc_grace_s=3600)  # the production shape: a job's last commits are all inside the grace
    for step in range(1, 6):
        train_step(ckpt, step)
        s.sync(ckpt, 0, state)
    assert s.last_gc.deleted == []  # nothing is old enough to delete by the rule itself
    kept = records()[-2:]  # keep_commits; the 3 older records linger inside their grace
    referenced = set().union(*(manifest_objects(s.objects, m) for m in kept))
    blobs = listed("blobs/")
    garbage = set(blobs) - referenced
    old_models = {s.blob_name(f"blake3:{m.files[f'step{i}/model.pt']['blake3']}")
                  for i, m in enumerate(records()[:2], start=1)}
    assert old_models <= garbage and len(garbage) > 2  # steps 1-2's models and the pack(s) of their meta.json
    for name in garbage:
        b = blobs[name]
        assert b.custom_time is not None, name
        assert abs(b.custom_time.timestamp() - (b.updated.timestamp() + 3600)) < 2, name
    assert all(blobs[n].custom_time is None for n in referenced)
    recs = listed("commits/")
    kept_names = sorted(recs)[-2:]
    assert all(recs[n].custom_time is None for n in kept_names)
    assert all(recs[n].custom_time is not None for n in sorted(recs)[:-2])  # the 3 records beyond keep_commits
    # the job's commits restore whole (a mark never touched a byte)
    assert sorted(restore_tree(store(), tmp_path / "restored")) == ["step4/meta.json", "step4/model.pt",
                                                                      "step5/meta.json", "step5/model.pt"]


def test_a_marked_blob_referenced_again_is_revived_without_its_mark(emu, tmp_path):
    """customTime can never be cleared: bytes that come back are uploaded anew (a new generation, no
    mark), and a marked object a commit references without uploading it (a commit in flight from
    another node while a clean-up marked its young blobs) is rewritten unmarked at the clean-up after
    that commit, so the lifecycle rule never deletes a kept commit's bytes."""
    import datetime

    d, state = tmp_path / "ckpt", tmp_path / "state.json"
    d.mkdir()
    s = store(gc_grace_s=3600, keep_commits=1)
    write_tree(d, {"model.pt": payload("P"), "config.bin": payload("C")})
    s.sync(d, 0, state)
    p_blob = s.blob_name(f"blake3:{records()[-1].files['model.pt']['blake3']}")
    c_blob = s.blob_name(f"blake3:{records()[-1].files['config.bin']['blake3']}")
    write_tree(d, {"model.pt": payload("Q")})
    s.sync(d, 0, state)
    marked = listed("blobs/")[p_blob]
    assert marked.custom_time is not None and p_blob in s.last_gc.marked
    write_tree(d, {"model.pt": payload("P")})  # the bytes come back
    s.sync(d, 0, state)
    again = listed("blobs/")[p_blob]
    assert again.custom_time is None and again.generation != marked.generation

    # config.bin is in every commit; a concurrent clean-up marked it (as it would a young blob in flight)
    blob = make_client().bucket("ckpt").blob(c_blob)
    blob.custom_time = datetime.datetime.now(datetime.timezone.utc)
    blob.patch()
    write_tree(d, {"model.pt": payload("R")})
    s.sync(d, 0, state)
    assert c_blob in s.last_gc.revived
    assert listed("blobs/")[c_blob].custom_time is None
    assert restore_tree(store(), tmp_path / "restored") == {"model.pt": payload("R"), "config.bin": payload("C")}


# ------------------------------------------------------------------ the commands


def slurmagent(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def three_commits(emu, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    s = store(gc_grace_s=3600)  # the job itself deletes nothing yet
    for i, tag in enumerate(("P", "Q", "R")):
        write_tree(d, {"model.pt": payload(tag), "notes.txt": b"n%d" % i})
        s.sync(d, 3, tmp_path / "state.json")
    return s


def test_ckpt_ls_lists_the_commits(three_commits):
    r = slurmagent("ckpt", "ls", "--remote", f"gs://ckpt/{PREFIX}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["COMMIT", "ATTEMPT", "CREATED", "FILES", "BYTES", "STATUS"]
    rows = [line.split() for line in lines[1:]]
    assert [row[-1] for row in rows] == ["old", "kept", "latest"]
    assert all(row[1] == "3" and row[3] == "2" and row[4:6] == ["300.0", "KiB"] for row in rows)
    as_json = json.loads(slurmagent("ckpt", "ls", "--remote", f"gs://ckpt/{PREFIX}", "--json").stdout)
    assert [c["bytes"] for c in as_json] == [300 * KiB + 2] * 3


def test_ckpt_gc_dry_run_deletes_nothing_then_gc_deletes_what_it_said(three_commits):
    before = names("")
    url = f"gs://ckpt/{PREFIX}"
    dry = slurmagent("ckpt", "gc", "--remote", url, "--dry-run", "--grace-s", "0")
    assert dry.returncode == 0, dry.stderr
    assert names("") == before
    would = [line.split()[2] for line in dry.stdout.splitlines() if line.startswith("would delete gs://")]
    # commit 1's model.pt (its own blob) and the pack its notes.txt travelled in
    assert sorted(w.split("/")[-1].split("-")[0] for w in would) == ["blake3", "pack"]
    assert "would free 300.0 KiB" in dry.stdout
    assert "would delete commit" in dry.stdout

    real = slurmagent("ckpt", "gc", "--remote", url, "--grace-s", "0")
    assert real.returncode == 0, real.stderr
    assert [line.split()[1] for line in real.stdout.splitlines() if line.startswith("deleted gs://")] == would
    assert "freed 300.0 KiB" in real.stdout
    gone = {w.removeprefix("gs://ckpt/") for w in would}
    assert names("blobs/") == {n for n in before if "/blobs/" in n} - gone
    assert len(records()) == 2

    # with the default grace (600 s) nothing that young goes
    again = slurmagent("ckpt", "gc", "--remote", url, "--keep", "1")
    assert again.returncode == 0 and "deleted 0 object(s)" in again.stdout
    # ... it is marked for the lifecycle rule instead: commit 2's model.pt and pack, and its record
    assert "marked 3 object(s) for the bucket's daysSinceCustomTime lifecycle rule" in again.stdout


def test_ckpt_gc_refuses_a_bad_keep(emu):
    r = slurmagent("ckpt", "gc", "--remote", f"gs://ckpt/{PREFIX}", "--keep", "0")
    assert r.returncode == 2 and "--keep" in r.stderr


def test_after_a_clean_up_the_missing_blob_check_asks_again(emu, tmp_path):
    """What the store saw exist before a clean-up is not trusted after it: a multi-node commit
    (which checks its entries with missing_objects) never points at a deleted blob."""
    d = tmp_path / "ckpt"
    d.mkdir()
    s = store(keep_commits=1)
    write_tree(d, {"model.pt": payload("P")})
    first = s.sync(d, 0, tmp_path / "state.json").files
    assert s.missing_objects(first) == []  # seen: not asked again in this run
    write_tree(d, {"model.pt": payload("Q")})
    s.sync(d, 0, tmp_path / "state.json")
    assert s.last_gc.deleted  # commit 1's blob went
    assert s.missing_objects(first) == ["model.pt"]


def test_a_prefix_without_manifest_is_left_alone(emu):
    make_client().bucket("ckpt").blob(f"{PREFIX}/blobs/blake3-{'ab' * 32}").upload_from_string(b"x")
    result = store().collect_garbage(grace_s=0)
    assert result.deleted == [] and "no manifest.json" in result.fenced
    assert names("blobs/")


# ------------------------------------------------------------------ through the wrapper

# A trainer keeping its last 2 step folders: step N is written, step N-2 removed, then it waits for the flush.
KEEP_TWO = ('trap "exit 0" USR1; r=$1; mkdir -p "$SLURMAGENT_CKPT_DIR/step$r"; '
            'head -c 307200 /dev/urandom > "$SLURMAGENT_CKPT_DIR/step$r/model.pt"; '
            'rm -rf "$SLURMAGENT_CKPT_DIR/step$((r - 2))"; : > "$2"; while :; do sleep 0.02; done')


def test_a_requeued_job_keeping_two_step_folders_leaves_only_what_two_commits_reference(emu, tmp_path):
    import io
    import signal
    import threading

    from support import wait_for
    from slurmagent.run.job import JobIdentity, RunOptions
    from slurmagent.run.supervisor import Supervisor

    for restart in range(10):  # ten attempts, each on a fresh node: restore, one step, flush, commit
        ready = tmp_path / f"ready-{restart}"
        opts = RunOptions(cmd=["sh", "-c", KEEP_TWO, "sh", str(restart), str(ready)],
                          ckpt_dir=tmp_path / f"node-{restart}" / "ckpt", remote=f"gs://ckpt/{PREFIX}",
                          grace_s=20, max_requeues=3, sync_interval_s=3600, stop_wait_s=5)
        err = io.StringIO()
        sup = Supervisor(opts, JobIdentity("slurm", "77", "77", restart, ("77",), ""), store(), lambda job: None,
                         dict(os.environ), err=err)

        def flush_when_ready(ready=ready) -> None:
            wait_for(ready.exists, 30, "trainer start", interval=0.02)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=flush_when_ready, daemon=True).start()
        outcome = sup.run()
        assert outcome.synced and outcome.requeued, err.getvalue()

    kept = records()
    assert [sorted({r.split("/")[0] for r in m.files}) for m in kept] == [["step7", "step8"], ["step8", "step9"]]
    assert names("blobs/") == set().union(*(manifest_objects(store().objects, m) for m in kept))
    assert len(names("blobs/")) == 3  # the models of steps 7, 8 and 9, not of all ten
    got = restore_tree(store(), tmp_path / "restored")
    assert sorted(got) == ["step8/model.pt", "step9/model.pt"]


def test_ckpt_ls_shows_a_manifest_written_before_retention(emu, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    write_tree(d, {"model.pt": payload("old")})
    store(keep_commits=None).sync(d, 1, tmp_path / "state.json")  # as a release without records did
    r = slurmagent("ckpt", "ls", "--remote", f"gs://ckpt/{PREFIX}")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0::len(line.split()) - 1] for line in r.stdout.splitlines()[1:]] == [["-", "latest"]]
    assert names("commits/") == set()


def test_a_commit_never_names_a_marked_blob_even_without_a_clean_up_after_it(emu, tmp_path, monkeypatch):
    """The review's case: the final commit reuses a marked blob and no clean-up follows it (out of
    time, or failed). The sync itself writes a marked blob's bytes again, unmarked, before it
    commits; before, the lifecycle rule would have deleted bytes the newest commit needs."""
    import datetime

    from support.gcs_fault_proxy import GcsFaultProxy

    d, state = tmp_path / "ckpt", tmp_path / "state.json"
    d.mkdir()
    with GcsFaultProxy(emu.url, create_only=True) as proxy:  # uploads answered as Cloud Storage does
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        s = store(keep_commits=None)  # no records, no clean-up at all: only the sync can unmark
        write_tree(d, {"model.pt": payload("P"), "config.bin": payload("C")})
        first = s.sync(d, 0, state).files
        marked = {rel: s.blob_name(f"blake3:{first[rel]['blake3']}") for rel in ("model.pt", "config.bin")}
        for name in marked.values():  # both marked, as a clean-up marks young garbage
            blob = make_client().bucket("ckpt").blob(name)
            blob.custom_time = datetime.datetime.now(datetime.timezone.utc)
            blob.patch()
        write_tree(d, {"model.pt": payload("Q")})
        s.sync(d, 0, state)
        write_tree(d, {"model.pt": payload("P")})  # the same bytes again: there, but marked
        s.sync(d, 0, state)
        fresh = store(keep_commits=None)  # another attempt: config.bin's blob is not "known", its upload meets a 412
        write_tree(d, {"config.bin": payload("C"), "extra.bin": payload("E")})
        fresh.sync(d, 1, tmp_path / "fresh-state.json")
        assert {rel: listed("blobs/")[name].custom_time for rel, name in marked.items()} == {
            "model.pt": None, "config.bin": None}
        assert restore_tree(store(), tmp_path / "restored") == {
            "model.pt": payload("P"), "config.bin": payload("C"), "extra.bin": payload("E")}
