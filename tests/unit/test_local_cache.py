"""The node-local cache of committed blobs (slurmagent.checkpoint.local_cache), on a real disk."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from slurmagent.checkpoint import local_cache
from slurmagent.checkpoint.hashing import hash_file
from slurmagent.checkpoint.local_cache import BlobCache, default_cache_dir, open_cache
from slurmagent.checkpoint.manifest import entry_content_id

KiB = 1024


def put(path: Path, data: bytes) -> dict:
    """Write ``data`` at ``path``; its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hash_file(str(path))[0].entry()


def test_the_default_cache_is_beside_the_checkpoint_dir_private_and_off_when_negative(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert default_cache_dir(ckpt) == tmp_path / f".slurmagent-cache-{os.geteuid()}"
    assert open_cache(ckpt, -1) is None
    cache = open_cache(ckpt, 1)
    assert cache is not None and cache.root == default_cache_dir(ckpt)
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o700


def test_a_zero_bound_is_room_for_keep_commits_checkpoints_the_size_of_the_one_at_hand(tmp_path):
    auto = open_cache(tmp_path / "ckpt", 0, copies=3)
    auto.fit(100 * KiB)
    assert auto.limit == 300 * KiB
    fixed = open_cache(tmp_path / "ckpt", 1, copies=3)
    fixed.fit(100 * KiB)
    assert fixed.limit == 1 << 30


def test_a_cache_dir_another_user_can_write_is_refused_with_one_line_and_no_failure(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.symlink(root, tmp_path / "link")
    said = []
    assert open_cache(tmp_path / "ckpt", 1, tmp_path / "link", said.append) is None
    assert len(said) == 1 and "cache off" in said[0] and "symlink" in said[0]


def test_an_entry_is_a_hard_link_so_no_byte_is_stored_twice_and_costs_nothing_while_shared(tmp_path):
    f = tmp_path / "ckpt" / "model.pt"
    entry = put(f, b"m" * 100 * KiB)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    cache.root.mkdir()
    assert cache.enter(str(f), entry)
    entered = Path(cache.path_of(entry_content_id(entry)))
    assert entered.name == entry_content_id(entry).replace(":", "-")
    assert os.stat(entered).st_ino == os.stat(f).st_ino
    assert cache.held_bytes() == 0  # shared with the checkpoint dir
    f.unlink()  # the trainer rotated it away: now only the cache holds the bytes
    assert cache.held_bytes() == 100 * KiB


def test_a_file_changed_since_it_was_hashed_is_not_entered(tmp_path):
    f = tmp_path / "model.pt"
    entry = put(f, b"a" * 10 * KiB)
    st = os.stat(f)
    f.write_bytes(b"b" * 10 * KiB)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    cache = BlobCache(tmp_path / "c", 1 << 30)
    cache.root.mkdir()
    assert not cache.enter(str(f), entry, (st.st_ino, st.st_size, st.st_mtime_ns))
    assert cache.ids() == set()


def test_where_hard_links_fail_the_entry_is_a_copy_within_the_bound(tmp_path, monkeypatch):
    def no_link(*a, **kw):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(local_cache.os, "link", no_link)
    small, big = tmp_path / "small", tmp_path / "big"
    e_small, e_big = put(small, b"s" * 10 * KiB), put(big, b"b" * 100 * KiB)
    cache = BlobCache(tmp_path / "c", 50 * KiB)
    cache.root.mkdir()
    assert cache.enter(str(small), e_small)
    assert not cache.enter(str(big), e_big)  # a copy would go over the bound
    assert cache.ids() == {entry_content_id(e_small)} and cache.held_bytes() == 10 * KiB
    dest = tmp_path / "restored"
    assert cache.take(e_small, str(dest))
    assert dest.read_bytes() == small.read_bytes() and os.stat(dest).st_ino != os.stat(small).st_ino


def test_a_take_checks_the_bytes_and_drops_an_entry_rewritten_in_place(tmp_path):
    f = tmp_path / "ckpt" / "model.pt"
    entry = put(f, b"x" * 64 * KiB)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    cache.root.mkdir()
    cache.enter(str(f), entry)
    good = tmp_path / "stage" / "a"
    good.parent.mkdir()
    assert cache.take(entry, str(good)) and good.read_bytes() == b"x" * 64 * KiB
    assert cache.taken == 1 and cache.taken_bytes == 64 * KiB
    good.unlink()
    with open(f, "r+b") as fh:  # torch.save over the same path: the shared inode changes too
        fh.write(b"y")
    assert not cache.take(entry, str(good))
    assert not good.exists() and cache.ids() == set() and cache.rejected == [entry_content_id(entry)]


def test_trim_keeps_what_the_restore_needs_and_drops_the_rest_oldest_first(tmp_path):
    cache = BlobCache(tmp_path / "c", 250 * KiB)
    cache.root.mkdir()
    entries = {}
    for i, name in enumerate(["old", "mid", "new", "wanted"]):
        f = tmp_path / name
        entries[name] = put(f, name.encode() * (100 * KiB // len(name)) + b"x" * (100 * KiB % len(name)))
        cache.enter(str(f), entries[name])
        f.unlink()  # only the cache holds it
        p = cache.path_of(entry_content_id(entries[name]))
        os.utime(p, (1000 + i, 1000 + i))
    (cache.root / ".tmp-1-blake3-00").write_bytes(b"half")
    ids = {k: entry_content_id(e) for k, e in entries.items()}
    assert cache.held_bytes() == 400 * KiB
    cache.trim(keep={ids["wanted"]})
    assert cache.ids() == {ids["new"], ids["wanted"]}  # the two oldest unwanted went
    assert not (cache.root / ".tmp-1-blake3-00").exists()
    cache.trim(keep={ids["wanted"]}, limit=0)
    assert cache.ids() == set()  # the bound wins over what is wanted


def test_an_entry_unchanged_since_it_was_verified_is_taken_without_reading_it_again(tmp_path, monkeypatch):
    f = tmp_path / "ckpt" / "model.pt"
    entry = put(f, b"v" * 64 * KiB)
    os.utime(f, (1000, 1000))  # written long ago: a rewrite would show in its mtime
    st = os.stat(f)
    first = BlobCache(tmp_path / "c", 1 << 30)
    first.root.mkdir()
    assert first.enter(str(f), entry, (st.st_ino, st.st_size, st.st_mtime_ns))  # the hash cache vouches for it
    first.save_records()
    reads = []
    real = local_cache.checkpoint_hash.hash_file
    monkeypatch.setattr(local_cache.checkpoint_hash, "hash_file", lambda *a, **kw: reads.append(a[0]) or real(*a, **kw))
    cache = BlobCache(first.root, 1 << 30)  # the next job on this node
    dest = tmp_path / "stage" / "a"
    dest.parent.mkdir()
    assert cache.take(entry, str(dest)) and dest.read_bytes() == b"v" * 64 * KiB
    assert reads == [] and cache.hashed == 0
    dest.unlink()
    with open(f, "r+b") as fh:  # rewritten in place through the shared hard link: its mtime moves
        fh.write(b"w")
    assert not cache.take(entry, str(dest))
    assert len(reads) == 1 and cache.rejected == [entry_content_id(entry)] and cache.ids() == set()
    cache.save_records()
    assert BlobCache(first.root, 1 << 30).records() == {}


def test_a_touched_entry_is_hashed_once_then_trusted_and_a_fresh_one_is_never_recorded(tmp_path, monkeypatch):
    old, fresh = tmp_path / "old.pt", tmp_path / "fresh.pt"
    e_old, e_fresh = put(old, b"o" * 32 * KiB), put(fresh, b"f" * 32 * KiB)
    cache = BlobCache(tmp_path / "c", 1 << 30)
    cache.root.mkdir()
    assert cache.enter(str(old), e_old) and cache.enter(str(fresh), e_fresh)
    assert cache.records() == {}  # just written: a rewrite in the same clock tick would not show
    os.utime(old, (2000, 2000))
    reads = []
    real = local_cache.checkpoint_hash.hash_file
    monkeypatch.setattr(local_cache.checkpoint_hash, "hash_file", lambda *a, **kw: reads.append(a[0]) or real(*a, **kw))
    for n in range(2):
        dest = tmp_path / f"take{n}"
        assert cache.take(e_old, str(dest)) and cache.take(e_fresh, str(tmp_path / f"fresh{n}"))
    assert reads.count(cache.path_of(entry_content_id(e_old))) == 1  # then recorded
    assert reads.count(cache.path_of(entry_content_id(e_fresh))) == 2  # never recorded while racy
    assert cache.hashed == 3 and set(cache.records()) == {entry_content_id(e_old)}
