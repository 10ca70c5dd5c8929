"""The node-local cache against the Cloud Storage emulator: a node that held the bytes downloads nothing.

The cache's own rules (bound, trim order, hash check, hard links) are in tests/unit/test_local_cache.py.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.checkpoint.local_cache import default_cache_dir
from test_checkpoint import KiB, write_tree

MiB = 1024 * KiB


def store(**kw) -> GcsCheckpointStore:
    kw.setdefault("timeout_s", 5)
    kw.setdefault("local_cache_gib", 1)
    return GcsCheckpointStore("gs://ckpt/cachejob", **kw)


def counting(s: GcsCheckpointStore) -> list[str]:
    """Every object the store reads the bytes of under ``blobs/`` (a file's, or a pack's)."""
    got: list[str] = []
    url = s.objects.object_url

    def object_url(name, *a, **kw):
        if "/blobs/" in name:
            got.append(name)
        return url(name, *a, **kw)

    s.objects.object_url = object_url
    return got


def tree() -> dict[str, bytes]:
    return {"step10/model.pt": os.urandom(3 * MiB), "step10/optim.pt": os.urandom(2 * MiB),
            "step10/meta.json": b'{"step": 10}', "latest": b"step10"}


def entries(cache_dir: Path) -> list[str]:
    """The cache's entries (named by content id; its verification records left out)."""
    return [n for n in os.listdir(cache_dir) if n.startswith(("blake3-", "sha256-"))]


def read(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_node_whose_checkpoint_dir_was_emptied_restores_from_its_cache_with_no_bucket_download(emu, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "ckpt.state.json"
    files = tree()
    write_tree(ckpt, files)
    GcsCheckpointStore("gs://ckpt/cachejob", timeout_s=5).sync(ckpt, 0, tmp_path / "other.json")  # no cache
    s = store()
    s.sync(ckpt, 0, state)  # nothing new to upload; the files enter the cache
    cache_dir = default_cache_dir(ckpt)
    assert len(entries(cache_dir)) == 4
    assert os.stat(ckpt / "step10/model.pt").st_ino in {os.stat(cache_dir / n).st_ino for n in entries(cache_dir)}

    shutil.rmtree(ckpt)  # the job's directory went (a wiped node-local path), the cache stayed
    again = store()
    fetched = counting(again)
    again.restore(ckpt, state_file=state)
    assert read(ckpt) == files
    assert fetched == []  # not one blob or pack read from the bucket
    assert again.last_cache.taken == 4


def test_a_cache_entry_with_other_bytes_is_dropped_and_that_file_comes_from_the_bucket(emu, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "ckpt.state.json"
    files = tree()
    write_tree(ckpt, files)
    store().sync(ckpt, 0, state)
    with open(ckpt / "step10/model.pt", "r+b") as fh:  # rewritten in place: the cache's hard link too
        fh.write(b"garbage")
    shutil.rmtree(ckpt)
    again = store()
    fetched = counting(again)
    again.restore(ckpt, state_file=state)
    assert read(ckpt) == files
    assert len(fetched) == 1 and fetched[0].endswith("/blobs/" + again.last_cache.rejected[0].replace(":", "-"))
    assert again.last_cache.taken == 3


def test_a_first_restore_fills_the_cache_so_the_next_one_on_that_node_downloads_nothing(emu, tmp_path):
    src, ckpt = tmp_path / "src", tmp_path / "node" / "ckpt"
    files = tree()
    write_tree(src, files)
    store(local_cache_gib=-1).sync(src, 0, tmp_path / "src.json")
    first = store()
    fetched_first = counting(first)
    first.restore(ckpt, state_file=tmp_path / "node" / "state.json")
    assert read(ckpt) == files and first.last_cache.taken == 0
    # the node held nothing: the bytes came from the bucket (each big file's own blob; the small
    # ones may come in a pack), and they filled this node's cache, one entry per file
    cache_dir = default_cache_dir(ckpt)
    cached = entries(cache_dir)
    big = {n for n in cached if (cache_dir / n).stat().st_size >= MiB}
    assert len(cached) == 4 and len(big) == 2, cached
    assert big <= {name.rsplit("/", 1)[1] for name in fetched_first}, fetched_first
    shutil.rmtree(ckpt)
    second = store()
    fetched = counting(second)
    second.restore(ckpt)
    assert read(ckpt) == files and fetched == []


def test_the_cache_is_trimmed_to_its_bound_before_a_restore_keeping_what_it_restores(emu, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state.json"
    old = {"old.bin": os.urandom(3 * MiB)}
    write_tree(ckpt, old)
    store().sync(ckpt, 0, state)
    shutil.rmtree(ckpt)
    new = {"new.bin": os.urandom(3 * MiB)}
    write_tree(ckpt, new)
    store().sync(ckpt, 0, state)  # the commit now holds new.bin only; old.bin's entry is cache-only
    shutil.rmtree(ckpt)
    tight = store(local_cache_gib=4 / 1024)  # 4 MiB: room for one of the two
    fetched = counting(tight)
    tight.restore(ckpt, state_file=state)
    assert read(ckpt) == new and fetched == []
    assert len(entries(default_cache_dir(ckpt))) == 1  # old.bin's entry went first


def test_files_written_just_before_the_final_sync_enter_the_cache_without_being_read_again(emu, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state.json"
    files = tree()
    write_tree(ckpt, files, age_s=0)  # the flush's checkpoint: too fresh for the hash cache to keep
    time.sleep(0.1)  # the checkpoint signal's handler returned; then the final sync
    s = store()
    s.sync(ckpt, 0, state)
    assert len(entries(default_cache_dir(ckpt))) == 4
    shutil.rmtree(ckpt)
    again = store()
    fetched = counting(again)
    again.restore(ckpt)
    assert read(ckpt) == files and fetched == []
