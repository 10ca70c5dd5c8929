"""Checkpoint store: local scan/hash/manifest and the Cloud Storage side on emulators.

Emulators come from tests/gcs_emulator.py: fake-gcs-server for everything (it
enforces ifGenerationMatch on the manifest's simple uploads), plus a round trip
on gcp-storage-emulator.  STORAGE_EMULATOR_HOST is only ever set with monkeypatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurmagent.devtools.localgcs import GcsEmulator

from slurmagent import checkpoint as ck  # noqa: E402
from slurmagent.checkpoint import (  # noqa: E402
    LocalChangedError,
    Manifest,
    ManifestError,
    RemoteURLError,
    RestoreError,
    StaleAttemptError,
    StorageUnavailableError,
    is_in_progress_name,
    parse_remote,
    scan_checkpoint_dir,
)
from slurmagent.errors import SlurmagentError  # noqa: E402
from slurmagent.gcp.storage import GcsCheckpointStore, make_client  # noqa: E402

KiB = 1024
REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------- helpers


def write_tree(root: Path, files: dict[str, bytes], age_s: float = 100.0) -> None:
    """Write files with an mtime in the past (outside the racy-timestamp window)."""
    t = time.time() - age_s
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (t, t))


def read_tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """relpath -> (sha256, size, mtime_ns) of every file, temp files included."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s = p.stat()
            out[p.relative_to(root).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest(), s.st_size, s.st_mtime_ns)
    return out


@pytest.fixture
def emu(gcs_emulator, monkeypatch) -> GcsEmulator:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


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


# ------------------------------------------------------------------ local part


@pytest.mark.parametrize(
    "name,skipped",
    [
        ("model.pt", False),
        ("step-100", False),
        ("tmp", False),
        ("notes.tmpl", False),
        (".hidden", False),
        (".metadata", False),
        (".slurmagent-restore-x1", True),
        ("model.pt.tmp", True),
        ("model.pt.TMP", True),
        ("model.part", True),
        ("model.partial", True),
        ("model.pt~", True),
        ("model.tmp.1234", True),
        ("x.tmp.pt", True),
    ],
)
def test_in_progress_rule(name, skipped):
    assert is_in_progress_name(name) is skipped


def test_scan_skips_files_being_written(tmp_path):
    write_tree(
        tmp_path,
        {
            "a/model.pt": b"1",
            "a/model.pt.tmp": b"2",
            ".slurmagent-restore-1/model.pt": b"3",
            "b.tmp/x": b"4",
            "c/.opt.pt": b"5",
            "d.part": b"6",
            "e~": b"7",
            "f.tmp.99": b"8",
            "g/h/i.bin": b"9",
        },
    )
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "a", tmp_path / "dirlink")
    os.symlink(tmp_path / "g/h/i.bin", tmp_path / "filelink")
    got = [f.relpath for f in scan_checkpoint_dir(tmp_path)]
    assert got == ["a/model.pt", "c/.opt.pt", "filelink", "g/h/i.bin"]
    assert scan_checkpoint_dir(tmp_path / "missing") == []


def test_hash_cache_never_rehashes_unchanged_files(tmp_path, monkeypatch):
    write_tree(tmp_path / "c", {"a": b"hello", "b/c": b"world"})
    calls = []
    real = ck.hash_file
    monkeypatch.setattr(ck, "hash_file", lambda p, f=ck.PyCrc32c: calls.append(p) or real(p, f))
    state_path = tmp_path / "state.json"
    s1 = ck.LocalState(state_path, tmp_path / "c")
    d1 = [s1.digest(f) for f in scan_checkpoint_dir(tmp_path / "c")]
    s1.save()
    assert len(calls) == 2
    assert d1[0].sha256 == hashlib.sha256(b"hello").hexdigest()
    assert d1[0].crc32c == "mnG7TA=="  # GCS's crc32c of b"hello"
    s2 = ck.LocalState(state_path, tmp_path / "c")
    assert [s2.digest(f) for f in scan_checkpoint_dir(tmp_path / "c")] == d1
    assert len(calls) == 2
    # a fresh file (mtime within the racy window) is hashed but not cached
    (tmp_path / "c" / "a").write_bytes(b"HELLO")
    s2.digest(scan_checkpoint_dir(tmp_path / "c")[0])
    s2.save()
    assert "a" not in ck.LocalState(state_path, tmp_path / "c").files


def test_state_file_must_be_outside_ckpt_dir(tmp_path):
    with pytest.raises(ck.CheckpointError, match="outside"):
        ck.LocalState(tmp_path / "ckpt" / "state.json", tmp_path / "ckpt")


def test_corrupt_state_file_is_only_a_cache(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    s = ck.LocalState(tmp_path / "state.json", tmp_path / "c")
    assert s.files == {}


def test_py_crc32c_matches_known_vector():
    c = ck.PyCrc32c()
    c.update(b"123456789")
    assert c.digest().hex() == "e3069283"


_relpaths = st.lists(
    st.text(alphabet="abcxyz019_-.", min_size=1, max_size=8).filter(lambda s: s not in (".", "..")),
    min_size=1,
    max_size=3,
).map("/".join)
_entries = st.fixed_dictionaries(
    {
        "sha256": st.binary(min_size=32, max_size=32).map(bytes.hex),
        "size": st.integers(min_value=0, max_value=2**40),
        "crc32c": st.binary(min_size=4, max_size=4).map(lambda b: __import__("base64").b64encode(b).decode()),
    }
)


@settings(max_examples=50, deadline=None)
@given(attempt=st.integers(min_value=0, max_value=10**6), files=st.dictionaries(_relpaths, _entries, max_size=5))
def test_manifest_json_round_trip(attempt, files):
    m = Manifest(attempt=attempt, files=files)
    assert Manifest.from_json(m.to_json()) == m


GOOD = {"schema": 1, "attempt": 1, "created": "2026-11-30T05:00:00Z", "files": {}}
ENTRY = {"sha256": "a" * 64, "size": 1, "crc32c": "AAAAAA=="}


@pytest.mark.parametrize(
    "doc,why",
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ({**GOOD, "schema": 2}, "schema"),
        ({**GOOD, "attempt": -1}, "attempt"),
        ({**GOOD, "attempt": True}, "attempt"),
        ({**GOOD, "created": "yesterday"}, "created"),
        ({**GOOD, "created": "2026-11-30T05:00:00"}, "time zone"),
        ({**GOOD, "files": []}, "files"),
        ({**GOOD, "files": {"../etc/passwd": ENTRY}}, "'..'"),
        ({**GOOD, "files": {"/abs": ENTRY}}, "relative"),
        ({**GOOD, "files": {"a": {**ENTRY, "sha256": "XYZ"}}}, "sha256"),
        ({**GOOD, "files": {"a": {**ENTRY, "size": "1"}}}, "size"),
        ({**GOOD, "files": {"a": {**ENTRY, "crc32c": "!!"}}}, "crc32c"),
    ],
)
def test_malformed_manifest_is_a_clear_error(doc, why):
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(ManifestError, match=why) as ei:
        Manifest.from_json(text, source="gs://b/p/manifest.json")
    assert isinstance(ei.value, SlurmagentError)
    assert "\n" not in str(ei.value) and "gs://b/p/manifest.json" in str(ei.value)


@pytest.mark.parametrize(
    "url,want",
    [
        ("gs://bucket/prefix", ("bucket", "prefix")),
        ("gs://my-bucket_1/a/b/c/", ("my-bucket_1", "a/b/c")),
        ("gs://my.bucket.example", ("my.bucket.example", "")),
    ],
)
def test_parse_remote(url, want):
    assert parse_remote(url) == want


@pytest.mark.parametrize(
    "url",
    ["", "bucket/prefix", "s3://bucket/p", "gs://", "gs:///p", "gs://Bucket/p", "gs://ab/p", "gs://b..c/p",
     "gs://bucket/a//b", "gs://bucket/a/../b", "gs://bucket/p\n", "gs://-bucket/p"],
)  # fmt: skip
def test_bad_remote_url_is_a_clear_error(url):
    with pytest.raises(RemoteURLError) as ei:
        GcsCheckpointStore(url)
    assert "\n" not in str(ei.value) and "gs://BUCKET/PREFIX" in str(ei.value)
    assert ei.value.exit_code == 2


def test_importing_storage_module_does_not_import_google():
    code = "import sys, slurmagent.gcp.storage, slurmagent.checkpoint; print('google.cloud.storage' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------- sync / restore


@pytest.mark.parametrize("kind", ["fake-gcs-server", "gcp-storage-emulator"])
def test_sync_then_restore_into_empty_dir_is_identical(kind, gcs_emulator_factory, monkeypatch, dirs):
    emu = gcs_emulator_factory(kind)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    files = {
        "step100/model.pt": os.urandom(300 * KiB),
        "step100/optim/shard-0.pt": os.urandom(3 * 1024 * KiB),
        "step100/optim/shard-1.pt": os.urandom(10 * 1024 * KiB),  # > 8 MiB: resumable upload
        "step100/copy.pt": b"same" * 1000,
        "step100/twin.pt": b"same" * 1000,  # same content, one blob
        "empty": b"",
        "latest": b"step100",
    }
    write_tree(dirs.ckpt, files)
    write_tree(dirs.ckpt, {"step200/model.pt.tmp": b"half", "lock.part": b""})
    s = store()
    s.large_file_threshold = 8 * 1024 * KiB  # exercise chunked transfers (and the XML MPU fallback)
    s.parallel_chunk_size = 5 * 1024 * KiB
    r = s.sync(dirs.ckpt, attempt=0, state_file=dirs.state, deadline_s=60)
    assert r.files_total == len(files)
    assert r.files_sent == len(files) - 1  # the twin shares a blob
    assert r.bytes_sent == sum(len(v) for k, v in files.items() if k != "step100/twin.pt")
    assert s._xml_multipart is False  # neither emulator has the XML multipart API
    m = store().latest_manifest()
    assert set(m.files) == set(files) and m.attempt == 0
    got = store().restore(dirs.restore)
    assert got == m
    assert read_tree(dirs.restore) == files
    assert not [p for p in dirs.restore.iterdir() if p.name.startswith(".")]  # staging removed


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
    real = ck.hash_file
    monkeypatch.setattr(ck, "hash_file", lambda *a: hashed.append(a[0]) or real(*a))
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


def test_temp_files_are_not_synced_but_dotfiles_are(emu, dirs):
    write_tree(dirs.ckpt, {"m.pt": b"final", "m.pt.tmp": b"half", ".metadata": b"dcp", "d.tmp/x": b"h", "y.tmp.3": b"h",
                           ".slurmagent-restore-1/0.part": b"h"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    assert set(store().latest_manifest().files) == {"m.pt", ".metadata"}


def test_empty_dir_never_replaces_a_checkpoint(emu, dirs, tmp_path):
    write_tree(dirs.ckpt, {"m.pt": b"final"})
    r1 = store().sync(dirs.ckpt, 0, dirs.state, 30)
    (tmp_path / "empty").mkdir()
    r2 = store().sync(tmp_path / "empty", 1, tmp_path / "s2.json", 30)
    assert (r2.files_total, r2.manifest_generation) == (0, r1.manifest_generation)
    assert set(store().latest_manifest().files) == {"m.pt"}


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
    real = b._read_manifest
    reads = []

    def hooked(dl):
        got = real(dl)
        reads.append(got[1])
        if len(reads) == 1:
            write_a()
        return got

    b._read_manifest = hooked
    try:
        return b.sync(dir_b, attempt_b, state_b, 30), reads
    finally:
        del b._read_manifest


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

    monkeypatch.setattr(s, "_commit_manifest", die)
    with pytest.raises(KeyboardInterrupt):
        s.sync(dirs.ckpt, 0, dirs.state, 30)
    names = {b.name for b in make_client().list_blobs("ckpt", prefix="job1/blobs/")}
    assert len(names) == 4  # the new blobs were uploaded...
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
        from slurmagent.gcp.storage import GcsCheckpointStore
        s = GcsCheckpointStore("gs://ckpt/job1", timeout_s=5)
        s._commit_manifest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        s.sync({str(dirs.ckpt)!r}, 0, {str(dirs.state)!r}, 30)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=os.environ.copy(), timeout=60)
    assert proc.returncode == -9
    assert len(list(make_client().list_blobs("ckpt", prefix="job1/blobs/"))) == 3
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == v1


@pytest.mark.parametrize("corruption", ["same-size", "truncated"])
def test_corrupt_blob_fails_restore_without_partial_files(emu, dirs, corruption):
    files = {f"d/f{i}.pt": os.urandom(50 * KiB) for i in range(6)}
    write_tree(dirs.ckpt, files)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    entry = store().latest_manifest().files["d/f3.pt"]
    bad = os.urandom(entry["size"]) if corruption == "same-size" else b"short"
    raw_bucket().blob(f"job1/blobs/{entry['sha256']}").upload_from_string(bad)
    write_tree(dirs.restore, {"unrelated.txt": b"keep me", ".slurmagent-restore-old/0.part": b"killed restore"})
    with pytest.raises(RestoreError, match=r"d/f3\.pt is corrupt") as ei:
        store().restore(dirs.restore)
    assert "\n" not in str(ei.value)
    assert read_tree(dirs.restore) == {"unrelated.txt": b"keep me"}
    assert sorted(p.name for p in dirs.restore.iterdir()) == ["unrelated.txt"]


def test_missing_blob_fails_restore_clearly(emu, dirs):
    write_tree(dirs.ckpt, {"a": b"1", "b": b"2"})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    sha = store().latest_manifest().files["b"]["sha256"]
    raw_bucket().blob(f"job1/blobs/{sha}").delete()
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


def test_file_changed_during_upload_is_detected(emu, dirs):
    write_tree(dirs.ckpt, {"a": b"version one"})
    s = store()
    real = s._upload_blob

    def rewrite_then_upload(f, d, dl):
        Path(f.path).write_bytes(b"version two")  # same size, written in place
        return real(f, d, dl)

    s._upload_blob = rewrite_then_upload
    with pytest.raises(LocalChangedError, match="changed while"):
        s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert store().latest_manifest() is None
    assert list(make_client().list_blobs("ckpt", prefix="job1/blobs/")) == []  # bad blob removed


def test_emulator_stopped_during_sync_gives_up_clearly_within_deadline(emu, dirs):
    write_tree(dirs.ckpt, {"a.pt": os.urandom(KiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    write_tree(dirs.ckpt, {f"b{i}.pt": os.urandom(64 * KiB) for i in range(4)}, age_s=50)
    before = snapshot(dirs.ckpt)
    state_before = dirs.state.read_bytes()
    s = store(timeout_s=2)
    real = s._upload_blob

    def stop_then_upload(f, d, dl):
        emu.stop()
        return real(f, d, dl)

    s._upload_blob = stop_then_upload
    deadline = 3.0
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"gave up after \d+ tries") as ei:
        s.sync(dirs.ckpt, 0, dirs.state, deadline)
    elapsed = time.monotonic() - t0
    assert deadline - 1.0 < elapsed < deadline + 2.0
    assert "\n" not in str(ei.value)
    assert snapshot(dirs.ckpt) == before  # local files untouched
    assert json.loads(dirs.state.read_bytes())["version"] == json.loads(state_before)["version"]
    emu.restart()
    assert read_tree_remote_files() == {"a.pt"}  # previous checkpoint intact


def read_tree_remote_files() -> set[str]:
    return set(store().latest_manifest().files)


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


# ------------------------------------------------------- retry / transfer paths


def _api_error(code):
    from google.api_core import exceptions

    return exceptions.from_http_status(code, f"HTTP {code}")


@pytest.mark.parametrize(
    "exc,transient",
    [
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        ("requests-connection", True),
        ("requests-timeout", True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (408, True),
        (400, False),
        (403, False),
        (404, False),
        (412, False),
        (ValueError("bug"), False),
    ],
)
def test_transient_classification(exc, transient):
    import requests

    from slurmagent.gcp.storage import is_transient

    if exc == "requests-connection":
        exc = requests.exceptions.ConnectionError("refused")
    elif exc == "requests-timeout":
        exc = requests.exceptions.ReadTimeout("slow")
    elif isinstance(exc, int):
        exc = _api_error(exc)
    assert is_transient(exc) is transient


def test_call_retries_transient_errors_then_succeeds():
    from slurmagent.gcp import storage as gs

    s = GcsCheckpointStore("gs://ckpt/p", client=object(), timeout_s=7)
    seen = []

    def flaky(timeout):
        seen.append(timeout)
        if len(seen) < 3:
            raise _api_error(503 if len(seen) == 1 else 429)
        return "ok"

    assert s._call(flaky, gs._Deadline(10), "testing") == "ok"
    assert len(seen) == 3 and all(0 < t <= 7 for t in seen)


def test_call_does_not_retry_permanent_errors():
    from slurmagent.gcp import storage as gs

    s = GcsCheckpointStore("gs://ckpt/p", client=object())
    seen = []

    def forbidden(timeout):
        seen.append(1)
        raise _api_error(403)

    with pytest.raises(StorageUnavailableError, match="testing on gs://ckpt/p failed: Forbidden"):
        s._call(forbidden, gs._Deadline(10), "testing")
    assert seen == [1]


def test_backend_with_xml_multipart_uses_chunked_uploads(emu, dirs):
    """Emulators lack the XML multipart API; stand in for one that has it."""
    files = {"big.pt": os.urandom(3 * 1024 * KiB), "small.pt": b"s"}
    write_tree(dirs.ckpt, files)
    s = store()
    s.large_file_threshold = 1024 * KiB
    chunked = []

    def fake_chunked(path, blob, timeout):
        chunked.append(path)
        blob.upload_from_filename(path, timeout=timeout, retry=None)

    s._upload_chunked = fake_chunked
    r = s.sync(dirs.ckpt, 0, dirs.state, 30)
    assert r.files_sent == 2 and s._xml_multipart is True
    assert [Path(p).name for p in chunked] == ["big.pt"]
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == files
