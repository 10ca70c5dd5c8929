"""Checkpoint store: local scan/hash/manifest and the Cloud Storage side on emulators.

Emulators come from tests/support/gcs_emulator.py: fake-gcs-server for everything (it
enforces ifGenerationMatch on the manifest's simple uploads), plus round trips
on gcp-storage-emulator.  STORAGE_EMULATOR_HOST is only ever set with monkeypatch.

The same subject without a cluster, emulator or fake server: tests/unit/test_checkpoint.py.

Timing (parallel lanes): nothing here is in the serial group; the deadline tests bound the
time with LOADED_MARGIN_S over the deadline, far below what a missed deadline would take.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from support import REPO
from support.slow_proxy import SlowProxy

from slurmagent.checkpoint import hashing as checkpoint_hash  # noqa: E402
# noqa: E402
from slurmagent.checkpoint.manifest import entry_content_id
from slurmagent.checkpoint.errors import ManifestError, RestoreError, StaleAttemptError, StorageUnavailableError, SyncDeadlineError
# noqa: E402
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.checkpoint.gcs.bucket import make_client
from test_checkpoint import LEGACY, KiB, MiB, write_tree


# ----------------------------------------------------------------------- helpers


def read_tree(root: Path) -> dict[str, bytes]:
    """Regular files (not links) under root, by relpath."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def links_of(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): os.readlink(p) for p in sorted(root.rglob("*")) if p.is_symlink()}


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """relpath -> (sha256, size, mtime_ns) of every file, temp files included."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s = p.stat()
            out[p.relative_to(root).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest(), s.st_size, s.st_mtime_ns)
    return out


def remote_contents() -> set[bytes]:
    """The bytes of every object under job1/ (to prove what was, or was not, uploaded)."""
    return {b.download_as_bytes() for b in make_client().list_blobs("ckpt", prefix="job1/")}


@pytest.fixture
def dirs(tmp_path):
    class D:
        ckpt = tmp_path / "ckpt"
        state = tmp_path / "state" / "ckpt-state.json"
        restore = tmp_path / "restored"

    D.ckpt.mkdir()
    return D


def store(prefix: str = "job1", **kw) -> GcsCheckpointStore:
    kw.setdefault("timeout_s", 5)
    return GcsCheckpointStore(f"gs://ckpt/{prefix}", **kw)


def raw_bucket():
    return make_client().bucket("ckpt")


def object_of(entry: dict) -> str:
    """The object holding a manifest entry's bytes: its own blob, or the pack it travels in."""
    return store().blob_name(f"pack:{entry['pack']}" if "pack" in entry else entry_content_id(entry))


# ------------------------------------------------------------- sync / restore


@pytest.mark.parametrize("kind", ["fake-gcs-server", "gcp-storage-emulator"])
def test_sync_then_restore_into_empty_dir_is_identical(kind, gcs_emulator_factory, monkeypatch, dirs):
    emu = gcs_emulator_factory(kind)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    files = {
        "step100/model.pt": os.urandom(300 * KiB),
        "step100/.metadata": b"dcp index",
        "step100/optim/shard-0.pt": os.urandom(3 * MiB),
        "step100/optim/shard-1.pt": os.urandom(10 * MiB + 5),  # parts + compose, ranged reads
        "step100/copy.pt": b"same" * 1000,
        "step100/twin.pt": b"same" * 1000,  # same content, one blob
        "empty": b"",
        "latest": b"step100",
        "back\\slash.pt": b"a backslash is an ordinary character",
    }
    write_tree(dirs.ckpt, files)
    write_tree(dirs.ckpt, {"step200/model.pt.tmp": b"half"})
    os.symlink("step100/model.pt", dirs.ckpt / "last.ckpt")
    s = store()
    s.parallel_upload_threshold = 8 * MiB  # exercise the parallel paths with small files
    s.part_size = 1 * MiB
    s.small_file_max = 64 * KiB
    r = s.sync(dirs.ckpt, attempt=0, state_file=dirs.state, deadline_s=60)
    assert r.files_total == len(files) + 1
    assert r.files_sent == len(files) - 1  # the twin shares a blob
    assert r.bytes_sent == sum(len(v) for k, v in files.items() if k != "step100/twin.pt")
    assert r.skipped == ("step200/model.pt.tmp",)
    assert list(make_client().list_blobs("ckpt", prefix="job1/parts/")) == []  # parts removed once composed
    m = store().latest_manifest()
    assert set(m.files) == set(files) | {"last.ckpt"} and m.attempt == 0
    assert m.files["last.ckpt"] == {"link": "step100/model.pt"}
    r2 = store()
    r2.ranged_download_threshold = 4 * MiB
    r2.range_size = 1 * MiB
    got = r2.restore(dirs.restore)
    assert got == m
    assert read_tree(dirs.restore) == files
    assert links_of(dirs.restore) == {"last.ckpt": "step100/model.pt"}
    assert not [p for p in dirs.restore.iterdir() if p.name.startswith(".slurmagent")]  # staging removed


def test_no_manifest_means_fresh_start(emu, dirs):
    assert store().latest_manifest() is None
    assert store().restore(dirs.restore) is None
    assert not dirs.restore.exists()


def test_missing_bucket_is_a_clear_error(emu, dirs):
    with pytest.raises(StorageUnavailableError, match="does not exist"):
        GcsCheckpointStore("gs://no-such-bucket/p", timeout_s=5).restore(dirs.restore)


def test_unchanged_sync_sends_nothing_and_hashes_nothing(emu, dirs, monkeypatch):
    write_tree(dirs.ckpt, {f"s/{i}.pt": os.urandom(64 * KiB) for i in range(4)})
    r1 = store().sync(dirs.ckpt, 0, dirs.state, 30)
    assert r1.files_sent == 4
    hashed = []
    real = checkpoint_hash.hash_file
    monkeypatch.setattr(checkpoint_hash, "hash_file", lambda *a, **k: hashed.append(a[0]) or real(*a, **k))
    r2 = store().sync(dirs.ckpt, 0, dirs.state, 30)
    assert (r2.files_sent, r2.bytes_sent, r2.skipped_unchanged) == (0, 0, 4)
    assert r2.manifest_generation == r1.manifest_generation  # nothing changed: manifest kept
    assert hashed == []
    # a restart (new attempt) with the same files rewrites only the manifest
    r3 = store().sync(dirs.ckpt, 1, dirs.state, 30)
    assert (r3.files_sent, r3.bytes_sent) == (0, 0) and r3.manifest_generation != r1.manifest_generation
    assert store().latest_manifest().attempt == 1


def test_changing_one_of_16_files_sends_only_that_file(emu, dirs):
    shard = 256 * KiB
    write_tree(dirs.ckpt, {f"shard-{i:02d}.pt": os.urandom(shard) for i in range(16)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {"shard-07.pt": os.urandom(shard)}, age_s=50)
    r = store().sync(dirs.ckpt, 0, dirs.state, 30)
    assert (r.files_sent, r.bytes_sent, r.skipped_unchanged, r.files_total) == (1, shard, 15, 16)
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == read_tree(dirs.ckpt)


def test_new_node_with_empty_cache_skips_blobs_in_manifest(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"a": os.urandom(KiB), "b": os.urandom(KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    store().restore(dirs.restore)  # "another node"
    r = store().sync(dirs.restore, 1, tmp_path / "other-state.json", 30)
    assert (r.files_sent, r.bytes_sent, r.skipped_unchanged) == (0, 0, 2)


def test_restore_tells_the_hash_cache_so_the_next_sync_reads_nothing(emu, dirs, tmp_path, monkeypatch):
    write_tree(dirs.ckpt, {"a": os.urandom(KiB), "d/b": os.urandom(100 * KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    state = tmp_path / "node2-state.json"
    store().restore(dirs.restore, state_file=state)
    hashed = []
    real = checkpoint_hash.hash_file
    monkeypatch.setattr(checkpoint_hash, "hash_file", lambda *a, **k: hashed.append(a[0]) or real(*a, **k))
    r = store().sync(dirs.restore, 1, state, 30)
    assert (r.files_sent, r.bytes_sent, hashed) == (0, 0, [])


def test_dotfiles_are_synced_temporary_names_are_not(emu, dirs):
    said = []
    write_tree(dirs.ckpt, {"m.pt": b"final", "m.pt.tmp": b"half", ".metadata": b"index", "d.tmp/x": b"h", "y.tmp.3": b"h"})
    s = store(warn=said.append)
    s.sync(dirs.ckpt, 0, dirs.state, 30)
    s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert set(store().latest_manifest().files) == {"m.pt", ".metadata"}
    assert sorted(said) == sorted(
        [
            "not syncing d.tmp/: a temporary name (still being written); it joins once renamed",
            "not syncing m.pt.tmp: a temporary name (still being written); it joins once renamed",
            "not syncing y.tmp.3: a temporary name (still being written); it joins once renamed",
        ]
    )  # each said once, over two syncs


def test_empty_dir_never_replaces_a_checkpoint(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"m.pt": b"final"})
    r1 = store().sync(dirs.ckpt, 0, dirs.state, 30)
    (tmp_path / "empty").mkdir()
    r2 = store().sync(tmp_path / "empty", 1, tmp_path / "s2.json", 30)
    assert (r2.files_total, r2.manifest_generation) == (0, r1.manifest_generation)
    assert set(store().latest_manifest().files) == {"m.pt"}


# ------------------------------------------------------- names, links, formats


def test_backslash_name_is_synced_and_restorable(emu, dirs):
    files = {"weird\\name.pt": b"1", "dir\\x/y.pt": b"2"}
    write_tree(dirs.ckpt, files)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == files


def test_a_name_that_is_not_utf8_is_synced_and_restorable(emu, dirs):
    raw_name = b"caf\xe9-\xff.pt"  # latin-1 bytes, as an old tool may write them
    (dirs.ckpt / os.fsdecode(raw_name)).write_bytes(b"bytes")
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    store().restore(dirs.restore)
    assert os.listdir(os.fsencode(dirs.restore)) == [raw_name]
    assert (dirs.restore / os.fsdecode(raw_name)).read_bytes() == b"bytes"


def test_lightning_last_link_is_restored_as_a_link(emu, dirs):
    write_tree(dirs.ckpt, {"epoch=1-step=200.ckpt": b"step 200", "epoch=0-step=100.ckpt": b"step 100"})
    os.symlink("epoch=1-step=200.ckpt", dirs.ckpt / "last.ckpt")
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    store().restore(dirs.restore)
    assert links_of(dirs.restore) == {"last.ckpt": "epoch=1-step=200.ckpt"}
    assert (dirs.restore / "last.ckpt").read_bytes() == b"step 200"
    # the link moves to the next checkpoint: only the link changes
    write_tree(dirs.ckpt, {"epoch=2-step=300.ckpt": b"step 300"}, age_s=50)
    (dirs.ckpt / "last.ckpt").unlink()
    os.symlink("epoch=2-step=300.ckpt", dirs.ckpt / "last.ckpt")
    r = store().sync(dirs.ckpt, 0, dirs.state, 30)
    assert r.bytes_sent == len(b"step 300")
    store().restore(dirs.restore)
    assert (dirs.restore / "last.ckpt").read_bytes() == b"step 300"


def test_a_link_leading_outside_is_never_followed(emu, dirs, tmp_path):
    """Even as root: a link to /etc/shadow-like data outside the directory uploads nothing."""
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$secret")
    write_tree(dirs.ckpt, {"model.pt": b"weights"})
    os.symlink(secret, dirs.ckpt / "innocent.pt")
    said = []
    r = store(warn=said.append).sync(dirs.ckpt, 0, dirs.state, 30)
    assert set(store().latest_manifest().files) == {"model.pt"} and r.skipped == ("innocent.pt",)
    assert b"root:$6$secret" not in remote_contents()
    assert said == ["not syncing innocent.pt: a symlink leading outside the checkpoint directory (not followed)"]


def test_manifest_written_before_blake3_restores_and_is_kept(emu, dirs, monkeypatch):
    """A job mid-run when the agent is upgraded: its schema-1 checkpoint restores, nothing is re-uploaded."""
    for path in sorted(LEGACY.rglob("*")):
        if path.is_file() and path.name != "README.md":
            raw_bucket().blob(f"job1/{path.relative_to(LEGACY).as_posix()}").upload_from_filename(str(path))
    m = store().restore(dirs.restore)
    assert m.attempt == 2
    tree = read_tree(dirs.restore)
    assert tree["step"] == b"100\n" and tree["optim/twin.pt"] == b"same" * 10 and tree["empty"] == b""
    assert {rel: hashlib.sha256(data).hexdigest() for rel, data in tree.items()} == {
        rel: e["sha256"] for rel, e in m.files.items()
    }
    # the next attempt syncs the restored files: the sha256 blobs are kept, nothing sent
    r = store().sync(dirs.restore, 3, dirs.state, 30)
    assert (r.files_sent, r.bytes_sent) == (0, 0)
    assert store().latest_manifest().files == m.files
    # a changed file gets a BLAKE3 entry; the unchanged ones keep theirs
    write_tree(dirs.restore, {"step": b"200\n"}, age_s=50)
    r = store().sync(dirs.restore, 3, dirs.state, 30)
    files = store().latest_manifest().files
    assert r.bytes_sent == 4 and "blake3" in files["step"] and files["model.pt"] == m.files["model.pt"]
    shutil.rmtree(dirs.restore)
    store().restore(dirs.restore)
    assert read_tree(dirs.restore)["step"] == b"200\n"


# --------------------------------------------------------------------- fencing


def test_stale_attempt_is_refused_and_manifest_unchanged(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"m.pt": b"attempt 2"})
    store().sync(dirs.ckpt, 2, dirs.state, 30)
    before = raw_bucket().get_blob("job1/manifest.json")
    old = tmp_path / "old"
    write_tree(old, {"m.pt": b"attempt 1, still alive"})
    with pytest.raises(StaleAttemptError, match="attempt 2"):
        store().sync(old, 1, tmp_path / "old-state.json", 30)
    after = raw_bucket().get_blob("job1/manifest.json")
    assert after.generation == before.generation
    assert store().latest_manifest().attempt == 2
    assert read_tree(old) == {"m.pt": b"attempt 1, still alive"}


def _race(write_a, dir_b, attempt_b, state_b):
    """B reads the manifest, then A commits before B writes: B's write hits a 412."""
    b = store()
    real = b.manifests.read
    reads = []

    def hooked(dl):
        got = real(dl)
        reads.append(got[1])
        if len(reads) == 1:
            write_a()
        return got

    b.manifests.read = hooked
    try:
        return b.sync(dir_b, attempt_b, state_b, 30), reads
    finally:
        del b.manifests.read


@pytest.mark.parametrize("attempt_a,attempt_b,b_wins", [(3, 2, False), (2, 2, True)])
def test_generation_race(emu, tmp_path, attempt_a, attempt_b, b_wins):
    da, db = tmp_path / "a", tmp_path / "b"
    write_tree(da, {"m.pt": b"from A"})
    write_tree(db, {"m.pt": b"from B"})
    write_tree(tmp_path / "c0", {"m.pt": b"initial"})
    store().sync(tmp_path / "c0", 1, tmp_path / "s0", 30)

    def write_a():
        store().sync(da, attempt_a, tmp_path / "sa", 30)

    if b_wins:
        r, reads = _race(write_a, db, attempt_b, tmp_path / "sb")
        assert len(reads) == 2 and reads[0] != reads[1]  # 412, read again, retried
        assert r.manifest_generation == raw_bucket().get_blob("job1/manifest.json").generation
        want = b"from B"
    else:
        with pytest.raises(StaleAttemptError):
            _race(write_a, db, attempt_b, tmp_path / "sb")
        want = b"from A"
    store().restore(tmp_path / "r")
    assert read_tree(tmp_path / "r") == {"m.pt": want}


def test_concurrent_writers_highest_attempt_wins(emu, tmp_path):
    n = 4
    for i in range(n):
        write_tree(tmp_path / f"w{i}", {"m.pt": f"writer {i}".encode(), f"only-{i}": b"x" * i})
    barrier = threading.Barrier(n)
    outcome: dict[int, object] = {}

    def run(i):
        s = store()
        barrier.wait()
        try:
            outcome[i] = s.sync(tmp_path / f"w{i}", i, tmp_path / f"s{i}", 30)
        except Exception as exc:  # noqa: BLE001
            outcome[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert all(isinstance(o, StaleAttemptError) or hasattr(o, "files_sent") for o in outcome.values()), outcome
    assert not isinstance(outcome[n - 1], Exception)
    store().restore(tmp_path / "r")
    assert read_tree(tmp_path / "r") == read_tree(tmp_path / f"w{n - 1}")
    assert store().latest_manifest().attempt == n - 1


# ------------------------------------------------------------- interruptions


def test_interrupted_sync_restores_previous_checkpoint(emu, dirs, monkeypatch):
    v1 = {"model.pt": os.urandom(100 * KiB), "step": b"100"}
    write_tree(dirs.ckpt, v1)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {"model.pt": os.urandom(100 * KiB), "step": b"200"}, age_s=50)
    s = store()

    def die(*a, **k):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(s.manifests, "write", die)
    with pytest.raises(KeyboardInterrupt):
        s.sync(dirs.ckpt, 0, dirs.state, 30)
    names = {b.name for b in make_client().list_blobs("ckpt", prefix="job1/blobs/")}
    assert len(names) == 2  # the new files were uploaded (each sync's small files in one pack)...
    assert store().restore(dirs.restore).files["step"]["size"] == 3
    assert read_tree(dirs.restore) == v1  # ...but the previous complete checkpoint is what restores


def test_killed_sync_process_restores_previous_checkpoint(emu, dirs):
    v1 = {"model.pt": os.urandom(100 * KiB)}
    write_tree(dirs.ckpt, v1)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {"model.pt": os.urandom(100 * KiB), "extra.pt": os.urandom(10 * KiB)}, age_s=50)
    code = textwrap.dedent(
        f"""
        import os, signal
        from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
        s = GcsCheckpointStore("gs://ckpt/job1", timeout_s=5)
        s.manifests.write = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        s.sync({str(dirs.ckpt)!r}, 0, {str(dirs.state)!r}, 30)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=os.environ.copy(), timeout=60)
    assert proc.returncode == -9
    assert len(list(make_client().list_blobs("ckpt", prefix="job1/blobs/"))) == 2  # one pack per sync
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == v1


@pytest.mark.parametrize("corruption", ["same-size", "truncated", "same-size-ranged", "packed", "packed-truncated"])
def test_corrupt_blob_fails_restore_without_partial_files(emu, dirs, corruption):
    size = 50 * KiB if corruption.startswith("packed") else 300 * KiB  # small files travel in a pack
    files = {f"d/f{i}.pt": os.urandom(size) for i in range(6)}
    write_tree(dirs.ckpt, files)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    entry = store().latest_manifest().files["d/f3.pt"]
    obj = raw_bucket().blob(object_of(entry))
    if corruption == "packed":  # one byte of f3's bytes inside the pack
        data = bytearray(obj.download_as_bytes())
        data[entry["offset"] + 7] ^= 0xFF
        bad = bytes(data)
    elif corruption == "packed-truncated":
        bad = obj.download_as_bytes()[: entry["offset"] + 10]
    else:
        bad = os.urandom(entry["size"]) if corruption.startswith("same-size") else b"short"
    obj.upload_from_string(bad)
    write_tree(dirs.restore, {"unrelated.txt": b"keep me", ".slurmagent-restore-old/0.part": b"killed restore"})
    s = store()
    if corruption.endswith("ranged"):
        s.ranged_download_threshold, s.range_size = 16 * KiB, 16 * KiB
    with pytest.raises(RestoreError, match=r"d/f3\.pt is corrupt") as ei:
        s.restore(dirs.restore)
    assert "\n" not in str(ei.value)
    assert read_tree(dirs.restore) == {"unrelated.txt": b"keep me"}
    assert sorted(p.name for p in dirs.restore.iterdir()) == ["unrelated.txt"]


def test_missing_blob_fails_restore_clearly(emu, dirs):
    write_tree(dirs.ckpt, {"a": b"1", "b": b"2"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    entry = store().latest_manifest().files["b"]
    raw_bucket().blob(object_of(entry)).delete()
    with pytest.raises(RestoreError, match="missing"):
        store().restore(dirs.restore)
    assert list(dirs.restore.iterdir()) == []


def test_malformed_remote_manifest_is_a_clear_error(emu, dirs):
    raw_bucket().blob("job1/manifest.json").upload_from_string(b'{"schema": 1, "attempt": "two"}')
    for call in (lambda: store().latest_manifest(), lambda: store().restore(dirs.restore)):
        with pytest.raises(ManifestError, match=r"gs://ckpt/job1/manifest\.json.*attempt"):
            call()
    write_tree(dirs.ckpt, {"a": b"1"})
    with pytest.raises(ManifestError):
        store().sync(dirs.ckpt, 0, dirs.state, 30)


# ------------------------------------------------- files that change or hide


def test_file_rewritten_between_hash_and_upload_is_read_again(emu, dirs):
    write_tree(dirs.ckpt, {"a": b"version one"})
    s = store()
    s.small_file_max = 0  # streamed from the file, not uploaded from the hashed bytes
    real = s.objects.post_media
    rewrites = []

    def rewrite_then_upload(*a, **k):  # after the hashing, before the bytes go
        if not rewrites:
            (dirs.ckpt / "a").write_bytes(b"version two")  # same size, written in place
            rewrites.append("a")
        return real(*a, **k)

    s.objects.post_media = rewrite_then_upload
    r = s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert rewrites == ["a"] and r.busy == ()
    assert remote_contents() >= {b"version two"} and b"version one" not in remote_contents()
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == {"a": b"version two"}


def test_a_file_that_keeps_changing_does_not_stop_the_others(emu, dirs):
    write_tree(dirs.ckpt, {"model.pt": b"weights v1", "train.log": b"line\n"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {"model.pt": b"weights v2", "new.pt": b"new"}, age_s=50)
    said = []
    s = store(warn=said.append)
    s.busy_pause_s = 0.05
    real = checkpoint_hash.hash_file

    def log_grows_while_read(path, *a, **k):  # a log appended between every look and every read
        if path.endswith("train.log"):
            with open(path, "ab") as fh:
                fh.write(b"another line\n")
        return real(path, *a, **k)

    checkpoint_hash.hash_file, saved = log_grows_while_read, checkpoint_hash.hash_file
    try:
        with open(dirs.ckpt / "train.log", "ab") as fh:
            fh.write(b"a line written since the last sync\n")
        r = s.sync(dirs.ckpt, 0, dirs.state, 30)
        with open(dirs.ckpt / "train.log", "ab") as fh:
            fh.write(b"a line written since the last sync\n")
        r2 = s.sync(dirs.ckpt, 0, dirs.state, 30)
    finally:
        checkpoint_hash.hash_file = saved
    assert r.busy == ("train.log",), r
    assert r2.busy == ("train.log",), r2
    m = store().latest_manifest()
    assert m.files["train.log"]["size"] == len(b"line\n")  # the previous committed version stays
    store().restore(dirs.restore)
    tree = read_tree(dirs.restore)
    assert (tree["model.pt"], tree["new.pt"], tree["train.log"]) == (b"weights v2", b"new", b"line\n")
    assert said == [
        "train.log kept changing while it was read (written in place?): "
        "its previous committed version stays in the checkpoint"
    ]  # said once over two syncs


def test_unreadable_file_is_left_out_with_one_line_and_the_rest_syncs(emu, tmp_path):
    """As a user (nobody): one file the job cannot read, the sync goes on and says so."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    base = Path(tempfile.mkdtemp(prefix="slurmagent-unreadable-"))
    try:
        base.chmod(0o755)
        ckpt, state, warm = base / "ckpt", base / "state", base / "warm"
        write_tree(ckpt, {"model.pt": b"weights", "opt.pt": b"optimizer"})
        write_tree(warm, {"w": b"w"})
        (ckpt / "secret.pt").write_bytes(b"root only")
        (ckpt / "secret.pt").chmod(0o000)
        state.mkdir()
        for p in (ckpt, state, ckpt / "model.pt", ckpt / "opt.pt"):
            os.chown(p, 65534, 65534)
        # The interpreter may live where nobody cannot read: load every module as root (a
        # sync of another prefix), then become nobody for the sync under test.
        code = textwrap.dedent(
            f"""
            import os
            from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
            GcsCheckpointStore("gs://ckpt/warm", timeout_s=5).sync({str(warm)!r}, 0, {str(base / "warm.json")!r}, 30)
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
            r = GcsCheckpointStore("gs://ckpt/job1", timeout_s=5).sync({str(ckpt)!r}, 0, {str(state / "s.json")!r}, 30)
            print(r.files_total, r.skipped)
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "2 ('secret.pt',)"
        assert proc.stderr.strip().splitlines() == ["not syncing secret.pt: unreadable (Permission denied)"]
        assert set(store().latest_manifest().files) == {"model.pt", "opt.pt"}
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------ deadlines and errors

# A deadline's test asserts the call ended at it, give or take what a loaded machine adds (the
# lanes run 4 workers on 2 cores: seconds), and well before what ignoring it would take: the
# whole transfer over the slow link (twice the bound at least), or retries without end.
LOADED_MARGIN_S = 5.0
SLOW_LINK_BPS = 300_000  # per connection (the proxy paces each one; the shards go up side by side)


def test_emulator_stopped_during_sync_gives_up_clearly_within_deadline(emu, dirs):
    write_tree(dirs.ckpt, {"a.pt": os.urandom(KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {f"b{i}.pt": os.urandom(64 * KiB) for i in range(4)}, age_s=50)
    before = snapshot(dirs.ckpt)
    state_before = dirs.state.read_bytes()
    s = store(timeout_s=2)
    real = s.objects.post_media

    def stop_then_upload(*a, **k):
        emu.stop()
        return real(*a, **k)

    s.objects.post_media = stop_then_upload
    deadline = 3.0
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"gave up after \d+ tries|deadline of 3s") as ei:
        s.sync(dirs.ckpt, 0, dirs.state, deadline)
    elapsed = time.monotonic() - t0
    # it retried up to its deadline (not giving up at the first refusal), then stopped: retrying
    # past it would go on for good (the emulator stays down); a loaded machine only adds seconds
    assert deadline - 1.0 < elapsed < deadline + LOADED_MARGIN_S
    assert "\n" not in str(ei.value)
    assert s.last_sync_error == str(ei.value)
    assert snapshot(dirs.ckpt) == before  # local files untouched
    assert json.loads(dirs.state.read_bytes())["version"] >= json.loads(state_before)["version"]
    emu.restart()
    assert set(store().latest_manifest().files) == {"a.pt"}  # previous checkpoint intact
    s.objects.post_media = real
    s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert s.last_sync_error == ""


def test_emulator_restarted_within_deadline_sync_succeeds(emu, dirs):
    write_tree(dirs.ckpt, {"a.pt": os.urandom(KiB), "b.pt": os.urandom(20 * KiB)})
    emu.stop()
    restarter = threading.Timer(1.5, emu.restart)
    restarter.start()
    try:
        t0 = time.monotonic()
        r = store(timeout_s=2).sync(dirs.ckpt, 0, dirs.state, deadline_s=20)
        assert time.monotonic() - t0 >= 1.0
    finally:
        restarter.join()
    assert r.files_sent == 2
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == read_tree(dirs.ckpt)


def test_final_sync_on_a_slow_link_stops_at_its_deadline_and_says_what_is_missing(emu, dirs, monkeypatch):
    """A link that moves 0.3 MB/s per connection: each 6 MiB shard takes 21 s to go up; the sync
    returns at its 3 s deadline."""
    write_tree(dirs.ckpt, {"step": b"100"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {"step": b"200", "shard-0.pt": os.urandom(6 * MiB), "shard-1.pt": os.urandom(6 * MiB)}, age_s=50)
    with SlowProxy("127.0.0.1", emu.port, upload_bps=SLOW_LINK_BPS) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        s = GcsCheckpointStore("gs://ckpt/job1")  # the default per-request timeout (30 s) is no excuse
        t0 = time.monotonic()
        with pytest.raises(SyncDeadlineError) as ei:
            s.sync(dirs.ckpt, 0, dirs.state, deadline_s=3.0)
        elapsed = time.monotonic() - t0
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    assert elapsed < 3.0 + LOADED_MARGIN_S < 6 * MiB / SLOW_LINK_BPS / 2  # far from a shard's whole upload
    msg = str(ei.value)
    assert "deadline of 3s" in msg and "shard-0.pt" in msg and "shard-1.pt" in msg and "\n" not in msg
    assert "previous checkpoint (attempt 0" in msg and "stays" in msg
    assert set(ei.value.unfinished) >= {"shard-0.pt", "shard-1.pt"}
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == {"step": b"100"}  # the last complete checkpoint


def test_restore_on_a_slow_link_stops_at_its_deadline_and_places_nothing(emu, dirs, monkeypatch):
    write_tree(dirs.ckpt, {"big.pt": os.urandom(8 * MiB), "small": b"s"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    with SlowProxy("127.0.0.1", emu.port, download_bps=SLOW_LINK_BPS) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        t0 = time.monotonic()
        with pytest.raises(SyncDeadlineError, match="deadline of 2s"):
            GcsCheckpointStore("gs://ckpt/job1").restore(dirs.restore, deadline_s=2.0)
        elapsed = time.monotonic() - t0
    assert elapsed < 2.0 + LOADED_MARGIN_S < 8 * MiB / SLOW_LINK_BPS / 2  # far from the whole download
    assert list(dirs.restore.iterdir()) == []


def test_lag_says_how_far_the_bucket_is_behind(emu, dirs):
    write_tree(dirs.ckpt, {"a": b"1"})
    s = store()
    s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert s.lag(dirs.ckpt).files == 0
    write_tree(dirs.ckpt, {"b": b"22"}, age_s=40)
    lag = s.lag(dirs.ckpt, now=time.time())
    assert (lag.files, lag.bytes) == (1, 2) and 39 < lag.seconds < 60
    s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert s.lag(dirs.ckpt).files == 0


def test_many_small_files_travel_in_packs_and_only_changed_ones_go_again(emu, dirs):
    files = {f"ocdbt.process_0/d/{i:04d}": os.urandom(1000 + i) for i in range(300)}
    write_tree(dirs.ckpt, files)
    s = store()
    s.pack_size = 128 * KiB  # several packs
    r = s.sync(dirs.ckpt, 0, dirs.state, 30)
    objects = [b.name for b in make_client().list_blobs("ckpt", prefix="job1/blobs/")]
    total = sum(len(v) for v in files.values())
    assert (r.files_sent, r.bytes_sent) == (300, total)
    assert 1 < len(objects) <= total // (128 * KiB) + 1 and all("/pack-" in o for o in objects)
    changed = {f"ocdbt.process_0/d/{i:04d}": os.urandom(500) for i in (3, 150, 299)}
    write_tree(dirs.ckpt, changed, age_s=50)
    r = s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert (r.files_sent, r.bytes_sent) == (3, 1500)  # exactly the changed bytes
    restorer = store()
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == {**files, **changed}
    shutil.rmtree(dirs.restore)
    restorer.pack_size = 4 * KiB  # one ranged read per few files
    restorer.restore(dirs.restore)
    assert read_tree(dirs.restore) == {**files, **changed}


def test_parallel_upload_of_more_than_32_parts_composes_in_a_tree(emu, dirs):
    data = os.urandom(40 * MiB + 3)
    write_tree(dirs.ckpt, {"big.pt": data})
    s = store()
    s.parallel_upload_threshold, s.part_size = 1 * MiB, 1 * MiB  # 41 parts: two levels of compose
    r = s.sync(dirs.ckpt, 0, dirs.state, 60)
    assert (r.files_sent, r.bytes_sent) == (1, len(data))
    assert list(make_client().list_blobs("ckpt", prefix="job1/parts/")) == []
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == {"big.pt": data}
