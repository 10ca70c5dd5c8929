"""Peers before the bucket, against the Cloud Storage emulator: two node agents run in this process
(threads, each with its own "node-local" directory and cache), the batch step's coordinator on
127.0.0.1. A new node takes what an old node's cache holds from it; a peer that serves other bytes,
dies mid-transfer or cannot be reached costs one line and a bucket download, never the restore.

The whole job on a real allocation (srun, requeue): test_local_cache_slurm.py.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from slurmagent.checkpoint.gcs.peers import Coordinator, PeerServer, PeerSession, new_token
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.node_agent import agent_restore
from test_checkpoint import KiB, write_tree
from test_local_cache_gcs import counting, read

MiB = 1024 * KiB
REMOTE = "gs://ckpt/peerjob"


def files() -> dict[str, bytes]:
    # one file larger than a socket's buffers: a peer waits for its reader, it does not give up
    return {"rank0/model.pt": os.urandom(24 * MiB), "rank1/model.pt": os.urandom(2 * MiB),
            "meta.json": b'{"step": 7}'}


class Corrupt(PeerServer):
    def send_body(self, sock, fd, size):
        data = bytearray(os.pread(fd, size, 0))
        data[size // 2] ^= 0xFF
        sock.sendall(bytes(data))


class DiesMidway(PeerServer):
    def send_body(self, sock, fd, size):
        sock.sendall(os.pread(fd, size // 3, 0))  # then the connection drops


def unreachable(cache, token, host):
    server = PeerServer(cache, token, host)
    server.close()  # checked in with a port nobody listens on any more
    return server


def setup(tmp_path: Path) -> tuple[list[Path], dict[str, bytes]]:
    """A committed checkpoint; node 0 restored it once (its cache holds it) and then lost its
    directory; node 1 is new."""
    tree = files()
    src = tmp_path / "src"
    write_tree(src, tree)
    GcsCheckpointStore(REMOTE, timeout_s=5).sync(src, 0, tmp_path / "src.json")
    dirs = [tmp_path / f"node{i}" / "ckpt" for i in range(2)]
    GcsCheckpointStore(REMOTE, timeout_s=5, local_cache_gib=1).restore(dirs[0])
    shutil.rmtree(dirs[0])
    return dirs, tree


def restore_both(dirs: list[Path], server_factories: dict[int, object] | None = None, *, hand: int | None = None,
                 manifest_reads: list[int] | None = None):
    """Both agents at once, as srun starts them; returns their reports, stores and bucket reads.
    ``hand``: the coordinator hands out the manifest as of that generation offset (0: the one read),
    as the batch step does; ``manifest_reads``: counts each agent's reads of the manifest in the bucket."""
    token = new_token()
    stores = [GcsCheckpointStore(REMOTE, timeout_s=5, local_cache_gib=1) for _ in dirs]
    manifest, generation = stores[0].read_manifest()
    sizes = {}
    handed = {} if hand is None else {"manifest": manifest.to_json().encode(), "generation": generation + hand}
    coord = Coordinator(len(dirs), token, sizes, "127.0.0.1", barrier_s=30, **handed)
    fetched = [counting(s) for s in stores]
    if manifest_reads is not None:
        manifest_reads.extend([0] * len(dirs))
        for i, s in enumerate(stores):
            def read_manifest(*a, _i=i, _real=s.read_manifest, **kw):
                manifest_reads[_i] += 1
                return _real(*a, **kw)
            s.read_manifest = read_manifest
    reports = [None] * len(dirs)

    def agent(i: int) -> None:
        kw = {"server_factory": server_factories[i]} if server_factories and i in server_factories else {}
        session = PeerSession(coord.address, token, i, f"v{i}", **kw)
        reports[i] = agent_restore(stores[i], dirs[i], index=i, node=f"v{i}", num_nodes=len(dirs),
                                   generation=generation, scope="all", deadline_s=60,
                                   state_file=Path(str(dirs[i]) + ".state.json"), peers=session)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    coord.close()
    return reports, stores, fetched


def test_a_new_node_takes_what_an_old_nodes_cache_holds_from_it_and_nothing_from_the_bucket(emu, tmp_path):
    dirs, tree = setup(tmp_path)
    reports, stores, fetched = restore_both(dirs)
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert read(dirs[0]) == tree and read(dirs[1]) == tree
    assert fetched == [[], []]  # node 0 from its cache, node 1 from node 0: no bucket read at all
    assert stores[0].last_cache.taken == 3
    assert any("3 file(s)" in m and "other nodes" in m for m in reports[1].messages), reports[1].messages
    assert not any("failed" in m for m in reports[0].messages + reports[1].messages)
    # node 1's own cache now holds them too: a later restore there reads nothing either
    assert stores[1].last_cache.ids() == stores[0].last_cache.ids()


@pytest.mark.parametrize("fault, why", [(Corrupt, "served bytes that are not"),
                                        (DiesMidway, "closed the connection after"),
                                        (unreachable, "unreachable at 127.0.0.1:")])
def test_a_peer_that_fails_costs_one_line_and_a_bucket_download_never_the_restore(emu, tmp_path, fault, why):
    dirs, tree = setup(tmp_path)
    reports, stores, fetched = restore_both(dirs, {0: fault})
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert read(dirs[1]) == tree and read(dirs[0]) == tree
    lines = [m for m in reports[1].messages if "failed" in m]
    assert len(lines) == 1 and lines[0].startswith("peer v0 (node index 0) failed (") and why in lines[0], lines
    assert "from the bucket instead" in lines[0]
    assert fetched[0] == [] and fetched[1]  # the old node still reads nothing; the new one falls back


def test_the_agents_restore_the_manifest_the_batch_step_hands_them_and_read_no_bucket_at_all(emu, tmp_path):
    dirs, tree = setup(tmp_path)
    reads: list[int] = []
    reports, stores, fetched = restore_both(dirs, hand=0, manifest_reads=reads)
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert read(dirs[0]) == tree and read(dirs[1]) == tree
    assert reads == [0, 0] and fetched == [[], []]  # neither the manifest nor a blob from the bucket


def test_a_handed_manifest_of_another_generation_is_not_taken_the_agent_reads_the_bucket(emu, tmp_path):
    dirs, tree = setup(tmp_path)
    reads: list[int] = []
    reports, _, _ = restore_both(dirs, hand=1, manifest_reads=reads)
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert read(dirs[0]) == tree and read(dirs[1]) == tree
    assert reads == [1, 1]
