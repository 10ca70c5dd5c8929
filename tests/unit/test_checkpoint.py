"""Checkpoint store, local side: the scan, the hashes, the hash cache and the manifest format.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_checkpoint_gcs.py.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import DATA, REPO


from slurmagent.checkpoint.errors import CheckpointError  # noqa: E402
from slurmagent.checkpoint.hash_cache import LocalState  # noqa: E402
from slurmagent.checkpoint.hashing import crc32c_combine, hash_file  # noqa: E402
from slurmagent.checkpoint.manifest import no_progress_after  # noqa: E402
from slurmagent.checkpoint.remote import CheckpointLag, checkpoint_lag  # noqa: E402
from slurmagent.checkpoint.scan import LocalFile, RESERVED_PREFIX, parent_dirs  # noqa: E402
from slurmagent.checkpoint import hashing as checkpoint_hash  # noqa: E402
# noqa: E402
from slurmagent.checkpoint.manifest import Manifest, entry_content_id
from slurmagent.checkpoint.errors import ManifestError, RemoteURLError, StorageUnavailableError
from slurmagent.checkpoint.scan import is_in_progress_name, scan_checkpoint_dir
from slurmagent.checkpoint.remote import parse_remote
from slurmagent.errors import SlurmagentError  # noqa: E402
# noqa: E402
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

KiB = 1024
MiB = 1024 * KiB
LEGACY = DATA / "checkpoint-schema1"


# ----------------------------------------------------------------------- helpers


def write_tree(root: Path, files: dict[str, bytes], age_s: float = 100.0) -> None:
    """Write files with an mtime in the past (outside the racy-timestamp window)."""
    t = time.time() - age_s
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (t, t))


# ------------------------------------------------------------------ name rules


@pytest.mark.parametrize(
    "name,left_out",
    [
        # what frameworks write: all part of the checkpoint
        ("model.pt", False),
        ("step-100", False),
        ("tmp", False),
        ("notes.tmpl", False),
        (".metadata", False),  # torch.distributed.checkpoint's index
        ("__0_0.distcp", False),
        ("last.ckpt", False),  # Lightning
        ("hpc_ckpt_1.ckpt", False),
        ("epoch=3-step=1000.ckpt", False),
        ("_CHECKPOINT_METADATA", False),  # Orbax / TensorStore
        ("ocdbt.process_0", False),
        ("manifest.ocdbt", False),
        (".zarray", False),
        ("model-00001-of-00002.safetensors", False),  # safetensors / Hugging Face
        ("model.safetensors.index.json", False),
        (".hidden", False),
        ("a\\b.pt", False),
        # temporary names: files still being written
        ("model.pt.tmp", True),
        (".metadata.tmp", True),  # DCP writes its index there, then renames
        ("model.pt.TMP", True),
        ("model.part", True),
        ("model.partial", True),
        ("model.pt~", True),
        ("model.tmp.1234", True),
        ("x.tmp.pt", True),
        ("step_10.orbax-checkpoint-tmp-1700000000", True),
        ("d.__lock", True),  # TensorStore writes a key under <key>.__lock, then renames
        ("tmpk3x_9a2q", True),  # tempfile.mkstemp()'s default name
        # slurmagent's own working files
        (".slurmagent-restore-abc", True),
    ],
)
def test_which_names_are_left_out(name, left_out):
    assert is_in_progress_name(name) is left_out


FRAMEWORK_TREE = {
    # torch.distributed.checkpoint (FSDP2 / torchtitan step folders)
    "step-200/.metadata": b"dcp index",
    "step-200/__0_0.distcp": b"rank 0",
    "step-200/__1_0.distcp": b"rank 1",
    # torch.save
    "model.pt": b"weights",
    # Lightning
    "epoch=0-step=100.ckpt": b"lightning",
    "hpc_ckpt_1.ckpt": b"hpc",
    # Orbax / TensorStore
    "orbax/10/_CHECKPOINT_METADATA": b"{}",
    "orbax/10/default/ocdbt.process_0/manifest.ocdbt": b"ocdbt",
    "orbax/10/default/ocdbt.process_0/d/0123abcd": b"chunk",
    "orbax/10/default/params/.zarray": b"{}",
    # safetensors
    "hf/model-00001-of-00002.safetensors": b"st1",
    "hf/model.safetensors.index.json": b"{}",
}
TEMPORARIES = {
    "step-300/.metadata.tmp": b"half",
    "model.pt.tmp": b"half",
    "orbax/20.orbax-checkpoint-tmp-1700000000/_CHECKPOINT_METADATA": b"half",
    "orbax/10/default/ocdbt.process_0/d/feed.__lock": b"half",
    "tmpa1b2c3d4": b"half",
}


def test_scan_keeps_what_frameworks_write_and_says_what_it_leaves_out(tmp_path):
    write_tree(tmp_path, {**FRAMEWORK_TREE, **TEMPORARIES, ".slurmagent-restore-x/0": b"ours"})
    os.symlink("epoch=0-step=100.ckpt", tmp_path / "last.ckpt")  # Lightning save_last="link"
    os.mkfifo(tmp_path / "fifo")
    said = []
    got = scan_checkpoint_dir(tmp_path, on_skip=lambda rel, why: said.append((rel, why)))
    assert [f.relpath for f in got if not f.is_link] == sorted(FRAMEWORK_TREE)
    assert [(f.relpath, f.link) for f in got if f.is_link] == [("last.ckpt", "epoch=0-step=100.ckpt")]
    skipped = {rel for rel, _ in said}
    assert skipped == {
        "step-300/.metadata.tmp",
        "model.pt.tmp",
        "orbax/20.orbax-checkpoint-tmp-1700000000/",
        "orbax/10/default/ocdbt.process_0/d/feed.__lock",
        "tmpa1b2c3d4",
        "fifo",
    }  # slurmagent's own staging directory is not reported
    assert all("temporary" in why for rel, why in said if rel != "fifo")
    assert scan_checkpoint_dir(tmp_path / "missing") == []


def test_symlinks_are_never_followed(tmp_path):
    root = tmp_path / "ckpt"
    outside = tmp_path / "secret"
    outside.write_bytes(b"not yours")
    write_tree(root, {"step-1/model.pt": b"m", "model.pt.tmp": b"half"})
    os.symlink("step-1/model.pt", root / "rel-link")
    os.symlink(root / "step-1" / "model.pt", root / "abs-link")  # absolute, but inside
    os.symlink("step-1", root / "latest")  # a directory inside
    os.symlink("rel-link", root / "chain")  # a link to a link inside
    os.symlink(outside, root / "escape")
    os.symlink("../secret", root / "escape-rel")
    os.symlink("nowhere", root / "dangling")
    os.symlink("model.pt.tmp", root / "to-temp")
    os.symlink(tmp_path, root / "dir-outside")
    said = {}
    got = {f.relpath: f.link for f in scan_checkpoint_dir(root, on_skip=lambda r, w: said.__setitem__(r, w))}
    assert got == {
        "abs-link": "step-1/model.pt",
        "chain": "step-1/model.pt",
        "latest": "step-1",
        "rel-link": "step-1/model.pt",
        "step-1/model.pt": None,
    }
    for rel in ("escape", "escape-rel", "dir-outside"):
        assert "outside" in said[rel] and "not followed" in said[rel]
    assert "nowhere" in said["dangling"] or "dangling" in said["dangling"]
    assert "not part of the checkpoint" in said["to-temp"]


# ------------------------------------------------------------------ hashing


def test_hash_is_blake3_and_gcs_crc32c_in_one_read(tmp_path):
    import blake3

    data = os.urandom(3 * MiB + 17)
    (tmp_path / "f").write_bytes(data)
    for keep in (0, 8 * MiB):  # streamed through a buffer, or kept in memory
        d, _, kept = hash_file(str(tmp_path / "f"), keep_bytes=keep, want_sha256=True)
        assert d.blake3 == blake3.blake3(data).hexdigest()
        assert d.sha256 == hashlib.sha256(data).hexdigest()
        assert d.size == len(data) and (kept == data if keep else kept is None)
    (tmp_path / "h").write_bytes(b"hello")
    assert hash_file(str(tmp_path / "h"))[0].crc32c == "mnG7TA=="  # GCS's crc32c of b"hello"


def test_hash_cache_never_rehashes_unchanged_files(tmp_path, monkeypatch):
    write_tree(tmp_path / "c", {"a": b"hello", "b/c": b"world"})
    calls = []
    real = checkpoint_hash.hash_file
    monkeypatch.setattr(checkpoint_hash, "hash_file", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    state_path = tmp_path / "state.json"
    s1 = LocalState(state_path, tmp_path / "c")
    d1 = [s1.digest(f) for f in scan_checkpoint_dir(tmp_path / "c")]
    s1.save()
    assert len(calls) == 2
    s2 = LocalState(state_path, tmp_path / "c")
    assert [s2.digest(f) for f in scan_checkpoint_dir(tmp_path / "c")] == d1
    assert len(calls) == 2
    # a fresh file (mtime within the racy window) is hashed but not cached
    (tmp_path / "c" / "a").write_bytes(b"HELLO")
    s2.digest(scan_checkpoint_dir(tmp_path / "c")[0])
    s2.save()
    assert "a" not in LocalState(state_path, tmp_path / "c").files


def test_state_file_must_be_outside_ckpt_dir(tmp_path):
    with pytest.raises(CheckpointError, match="outside"):
        LocalState(tmp_path / "ckpt" / "state.json", tmp_path / "ckpt")


def test_corrupt_state_file_is_only_a_cache(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    s = LocalState(tmp_path / "state.json", tmp_path / "c")
    assert s.files == {}


@pytest.mark.parametrize("keep_bytes", [0, 1 << 20])  # read in chunks, or kept in memory
def test_hash_file_crc32c_is_the_castagnoli_check_value(tmp_path, keep_bytes):
    (tmp_path / "f").write_bytes(b"123456789")
    d, _, _ = hash_file(str(tmp_path / "f"), keep_bytes=keep_bytes)
    assert base64.b64decode(d.crc32c).hex() == "e3069283"  # CRC-32C of "123456789"


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3000), cut=st.integers(min_value=0, max_value=3000))
def test_crc32c_combine_of_two_parts_is_the_crc32c_of_the_whole(data, cut):
    import google_crc32c

    a, b = data[:cut], data[cut:]
    whole = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    assert whole == google_crc32c.value(data)


# ------------------------------------------------------------------ manifest

_relpaths = st.lists(
    st.text(alphabet="abcxyz019_-.\\ ", min_size=1, max_size=8).filter(
        lambda s: s not in (".", "..") and not s.startswith(RESERVED_PREFIX)
    ),
    min_size=1,
    max_size=3,
).map("/".join)
_hex = st.binary(min_size=32, max_size=32).map(bytes.hex)
_crc = st.binary(min_size=4, max_size=4).map(lambda b: base64.b64encode(b).decode())
_entries = st.one_of(
    st.fixed_dictionaries({"blake3": _hex, "size": st.integers(0, 2**40), "crc32c": _crc}),
    st.fixed_dictionaries({"sha256": _hex, "size": st.integers(0, 2**40), "crc32c": _crc}),
)


@settings(max_examples=50, deadline=None)
@given(attempt=st.integers(min_value=0, max_value=10**6), files=st.dictionaries(_relpaths, _entries, max_size=5))
def test_manifest_json_round_trip(attempt, files):
    names = set(files)
    files = {rel: e for rel, e in files.items() if not any(p in names for p in parent_dirs(rel))}
    m = Manifest(attempt=attempt, files=files)
    assert Manifest.from_json(m.to_json()) == m


GOOD = {"schema": 2, "attempt": 1, "created": "2026-11-30T05:00:00Z", "files": {}}
ENTRY = {"blake3": "a" * 64, "size": 1, "crc32c": "AAAAAA=="}


@pytest.mark.parametrize(
    "doc,why",
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ({**GOOD, "schema": 3}, "schema"),
        ({**GOOD, "attempt": -1}, "attempt"),
        ({**GOOD, "attempt": True}, "attempt"),
        ({**GOOD, "created": "yesterday"}, "created"),
        ({**GOOD, "created": "2026-11-30T05:00:00"}, "time zone"),
        ({**GOOD, "files": []}, "files"),
        ({**GOOD, "files": {"../etc/passwd": ENTRY}}, "'..'"),
        ({**GOOD, "files": {"/abs": ENTRY}}, "relative"),
        ({**GOOD, "files": {".slurmagent-restore-1/x": ENTRY}}, "reserved"),
        ({**GOOD, "files": {"a": {**ENTRY, "blake3": "XYZ"}}}, "blake3"),
        ({**GOOD, "files": {"a": {**ENTRY, "sha256": "a" * 64}}}, "exactly one"),
        ({**GOOD, "schema": 1, "files": {"a": ENTRY}}, "sha256"),
        ({**GOOD, "files": {"a": {**ENTRY, "size": "1"}}}, "size"),
        ({**GOOD, "files": {"a": {**ENTRY, "crc32c": "!!"}}}, "crc32c"),
        ({**GOOD, "files": {"a": {"link": "../../etc/shadow"}}}, "outside"),
        ({**GOOD, "files": {"a": {"link": "/etc/shadow"}}}, "relative"),
        ({**GOOD, "files": {"d": {"link": "e"}, "e/f": ENTRY, "d/f": ENTRY}}, "below the link"),
    ],
)
def test_malformed_manifest_is_a_clear_error(doc, why):
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(ManifestError, match=why) as ei:
        Manifest.from_json(text, source="gs://b/p/manifest.json")
    assert isinstance(ei.value, SlurmagentError)
    assert "\n" not in str(ei.value) and "gs://b/p/manifest.json" in str(ei.value)


def test_schema1_manifest_written_before_blake3_still_parses():
    m = Manifest.from_json((LEGACY / "manifest.json").read_bytes())
    assert m.attempt == 2 and set(m.files) == {"model.pt", "step", "optim/shard-0.pt", "optim/copy.pt", "optim/twin.pt", "empty"}
    assert entry_content_id(m.files["step"]) == "sha256:" + hashlib.sha256(b"100\n").hexdigest()


def test_progress_is_judged_by_content_not_by_where_the_bytes_are_stored():
    restored = Manifest(attempt=1, files={"a": {**ENTRY, "pack": "b" * 64, "offset": 0}}, no_progress=2)
    same_elsewhere = {"a": {**ENTRY}}  # the same content, now in its own blob
    changed = {"a": {**ENTRY, "blake3": "c" * 64}}
    assert no_progress_after(restored, same_elsewhere) == 3
    assert no_progress_after(restored, changed) == 0
    assert no_progress_after(None, changed) == 0
    doc = {**GOOD, "node_count": 2, "writers": {"a": [1, 0]}, "no_progress": 3, "files": {"a": ENTRY}}
    m = Manifest.from_json(json.dumps(doc))
    assert (m.node_count, m.writers, m.no_progress) == (2, {"a": [0, 1]}, 3)
    assert Manifest.from_json(m.to_json()) == m


def test_lag_is_the_age_of_what_the_bucket_does_not_hold_yet():
    now = 1_000_000.0
    local = [
        LocalFile("a", "/x/a", 1, int((now - 100) * 1e9)),
        LocalFile("b", "/x/b", 2, int((now - 30) * 1e9)),
        LocalFile("c", "/x/c", 4, int((now - 5) * 1e9)),
    ]
    committed = {"a": (1, int((now - 100) * 1e9)), "b": (2, int((now - 300) * 1e9))}
    lag = checkpoint_lag(local, committed, now)
    assert (lag.files, lag.bytes) == (2, 6)
    assert lag.seconds == pytest.approx(30) and lag.newest_seconds == pytest.approx(5)
    assert checkpoint_lag(local[:1], committed, now) == CheckpointLag(0.0, 0.0, 0, 0)


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
    code = (
        "import sys, slurmagent.checkpoint.gcs.store, slurmagent.checkpoint; "
        "print('google.cloud.storage' in sys.modules, 'blake3' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


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

    from slurmagent.checkpoint.gcs.transfer import is_transient

    if exc == "requests-connection":
        exc = requests.exceptions.ConnectionError("refused")
    elif exc == "requests-timeout":
        exc = requests.exceptions.ReadTimeout("slow")
    elif isinstance(exc, int):
        exc = _api_error(exc)
    assert is_transient(exc) is transient


def test_call_retries_transient_errors_then_succeeds():
    from slurmagent.checkpoint.gcs.transfer import Deadline

    s = GcsCheckpointStore("gs://ckpt/p", client=object(), timeout_s=7)
    seen = []

    def flaky(timeout):
        seen.append(timeout)
        if len(seen) < 3:
            raise _api_error(503 if len(seen) == 1 else 429)
        return "ok"

    assert s.objects.call(flaky, Deadline(10), "testing") == "ok"
    assert len(seen) == 3 and all(0 < t <= 7 for t in seen)


def test_call_does_not_retry_permanent_errors():
    from slurmagent.checkpoint.gcs.transfer import Deadline

    s = GcsCheckpointStore("gs://ckpt/p", client=object())
    seen = []

    def forbidden(timeout):
        seen.append(1)
        raise _api_error(403)

    with pytest.raises(StorageUnavailableError, match="testing on gs://ckpt/p failed: Forbidden"):
        s.objects.call(forbidden, Deadline(10), "testing")
    assert seen == [1]


def test_a_big_file_is_restored_as_a_few_large_slices_that_cover_it_once():
    """Few and large, as gcloud's sliced downloads: many small ranges lose on the disk and the CPU."""
    from slurmagent.checkpoint.gcs.restore import slices

    tunables = GcsCheckpointStore("gs://ckpt/job1").settings()
    one_gib = slices(1024 * MiB, tunables)
    assert one_gib == [(k * 256 * MiB, 256 * MiB) for k in range(4)]
    assert slices(100 * MiB, tunables) == [(0, 100 * MiB)]  # below the threshold: one stream
    assert len(slices(130 * MiB, tunables)) == 2  # no slice under range_size (64 MiB)
    for size in (128 * MiB, 200 * MiB + 3, 8 * 1024 * MiB + 1):
        parts = slices(size, tunables)
        assert 2 <= len(parts) <= tunables.slices_per_file
        assert [off for off, _ in parts] == list(itertools.accumulate([0] + [n for _, n in parts[:-1]]))
        assert sum(n for _, n in parts) == size and min(n for _, n in parts) > 0
