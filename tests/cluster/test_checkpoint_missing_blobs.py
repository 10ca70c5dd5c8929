"""A blob or pack the committed checkpoint references was deleted from the bucket (a lifecycle
rule, a hand): the next commit uploads it again from the local files, never points at it blindly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from support import REPO
from test_checkpoint import KiB, MiB, write_tree
from test_checkpoint_gcs import dirs, object_of, raw_bucket, read_tree, store  # noqa: F401
from slurmagent.checkpoint import hashing as checkpoint_hash
from slurmagent.checkpoint.errors import LocalChangedError
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.checkpoint.gcs.bucket import make_client
from slurmagent.run.node_agent import agent_sync


def counting_client():
    """A client whose requests are counted (the cost of a sync in requests)."""
    client = make_client()
    calls: list[str] = []
    client._http.hooks["response"].append(lambda r, *a, **k: calls.append(f"{r.request.method} {r.url}"))
    return client, calls


def files_of_a_checkpoint() -> dict[str, bytes]:
    return {"config.json": b'{"lr": 0.1}', "tokenizer/vocab.txt": os.urandom(3 * KiB),
            "model.pt": os.urandom(2 * MiB)}


def delete_objects_of(prefix: str, *rels: str) -> list[str]:
    manifest = store(prefix).latest_manifest()
    names = sorted({object_of(manifest.files[rel]).replace("job1/", f"{prefix}/", 1) for rel in rels})
    for name in names:
        raw_bucket().blob(name).delete()
    return names


def all_objects_exist(prefix: str) -> bool:
    s = store(prefix)
    manifest = s.latest_manifest()
    names = {b.name for b in make_client().list_blobs("ckpt", prefix=f"{prefix}/blobs/")}
    want = {s.blob_name(f"pack:{e['pack']}" if "pack" in e else f"blake3:{e['blake3']}")
            for e in manifest.regular_files().values()}
    return want <= names


def test_a_deleted_blob_and_pack_are_uploaded_again_and_the_checkpoint_restores_byte_identical(emu, dirs):
    files = files_of_a_checkpoint()
    write_tree(dirs.ckpt, files)
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    deleted = delete_objects_of("job1", "model.pt", "config.json")  # a blob and the pack of the small files
    assert len(deleted) == 2 and any("/pack-" in n for n in deleted)
    write_tree(dirs.ckpt, {"step2.pt": os.urandom(300 * KiB)}, age_s=50)  # a later attempt's new file
    warned: list[str] = []
    r = store(warn=warned.append).sync(dirs.ckpt, 1, dirs.state, 30)
    assert r.files_sent == 4  # the new file, model.pt, and both packed files again
    assert any("missing from gs://ckpt/job1" in w and "model.pt" in w for w in warned), warned
    assert all_objects_exist("job1")
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == read_tree(dirs.ckpt)


def test_objects_are_checked_once_per_run_and_what_a_run_has_seen_costs_nothing_more(emu, dirs):
    write_tree(dirs.ckpt, files_of_a_checkpoint())
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    client, calls = counting_client()
    s = GcsCheckpointStore("gs://ckpt/job1", client=client, timeout_s=5)
    s.sync(dirs.ckpt, 1, dirs.state, 30)  # a new run: the manifest's 2 objects are checked once
    first = list(calls)
    calls.clear()
    s.sync(dirs.ckpt, 1, dirs.state, 30)
    assert len([c for c in first if c.startswith("GET") and "/o/job1%2Fblobs%2F" in c]) == 2, first
    assert not [c for c in calls if "blobs" in c], calls  # seen in this run: not checked again
    print(f"\nrequests: first sync of a run {len(first)}, the next unchanged one {len(calls)}")


def test_a_file_whose_blob_is_gone_and_that_has_no_local_copy_is_never_committed(emu, dirs, monkeypatch):
    write_tree(dirs.ckpt, {"a.pt": os.urandom(2 * MiB), "b.pt": os.urandom(2 * MiB)})
    store().sync(dirs.ckpt, 0, dirs.state, 30)
    delete_objects_of("job1", "a.pt")
    os.utime(dirs.ckpt / "a.pt", None)  # changed now: read again, and it keeps changing while read
    real = checkpoint_hash.hash_file

    def changing(path, *a, **k):
        if path.endswith("a.pt"):
            raise LocalChangedError("a.pt changed while it was read")
        return real(path, *a, **k)

    monkeypatch.setattr(checkpoint_hash, "hash_file", changing)
    warned: list[str] = []
    s = store(warn=warned.append)
    s.busy_retries = 0
    r = s.sync(dirs.ckpt, 1, dirs.state, 30)
    # its committed version would be kept for a busy file, but that version is gone: left out, said
    assert "a.pt" not in r.files and "a.pt" in r.busy
    assert any("a.pt" in w and "missing" in w for w in warned), warned
    assert all_objects_exist("job1")


def test_node_agents_keep_what_they_saw_in_the_state_file_and_a_new_attempt_checks_again(emu, dirs):
    """A node agent is a new process every round: its run's set lives in the node's state file."""
    write_tree(dirs.ckpt, files_of_a_checkpoint())

    def agent_round(attempt: int):
        client, calls = counting_client()
        s = GcsCheckpointStore("gs://ckpt/job1", client=client, timeout_s=5, run_id="77")
        report = agent_sync(s, dirs.ckpt, index=0, node="n1", attempt=attempt, state_file=dirs.state, deadline_s=30)
        assert report.ok, report.error
        store().commit(Manifest(attempt=attempt, files=report.files))  # the batch step's commit
        return report, [c for c in calls if "blobs" in c and c.startswith("GET")]

    agent_round(0)
    _, checks = agent_round(0)  # same run, new process: objects it saw are not checked again
    assert checks == []
    delete_objects_of("job1", "model.pt", "config.json")
    report, checks = agent_round(1)  # the next attempt: checked once, the missing ones sent again
    assert len(checks) == 2 and report.files_sent == 3
    assert all_objects_exist("job1")
    store().restore(dirs.restore)
    assert read_tree(dirs.restore) == read_tree(dirs.ckpt)


TRAINER = """
import os, sys
d = os.environ["SLURMAGENT_CKPT_DIR"]
if sys.argv[1] == "first":
    os.makedirs(os.path.join(d, "tok"), exist_ok=True)
    for name, size in (("config.json", 40), ("tok/vocab.txt", 3000), ("model.pt", 2 << 20)):
        with open(os.path.join(d, name), "wb") as f:
            f.write(os.urandom(size))
else:  # a later attempt: a new step; config.json, vocab.txt and model.pt stay as they are
    with open(os.path.join(d, "step2.pt"), "wb") as f:
        f.write(os.urandom(300 << 10))
"""


def run_wrapper(tmp_path: Path, emu, attempt: int, step: str) -> subprocess.CompletedProcess:
    """`slurmagent run` of a Cloud Run task's attempt: the trainer writes its files and exits 0."""
    from test_wrapper import write_config

    config = write_config(tmp_path / "c.toml", "gs://ckpt/jobs", tmp_path / "state", sync_interval_s=60.0)
    trainer = tmp_path / "t.py"
    trainer.write_text(TRAINER)
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url,
               CLOUD_RUN_JOB="train", CLOUD_RUN_EXECUTION="train-x1", CLOUD_RUN_TASK_INDEX="0",
               CLOUD_RUN_TASK_ATTEMPT=str(attempt))
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ckpt"),
                           "--remote", "gs://ckpt/lost", "--", sys.executable, str(trainer), step],
                          env=env, capture_output=True, text=True, timeout=60)


def test_wrapper_a_later_attempt_uploads_again_what_the_bucket_lost_and_the_checkpoint_restores(emu, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_wrapper(tmp_path, emu, 0, "first")
    assert first.returncode == 0, first.stderr
    deleted = delete_objects_of("lost", "model.pt", "config.json")  # a lifecycle rule on blobs/ ran
    assert any("/pack-" in n for n in deleted)
    later = run_wrapper(tmp_path, emu, 1, "later")
    assert later.returncode == 0, later.stderr
    assert "kept the local checkpoint" in later.stderr  # no restore: the sync alone must notice
    assert "missing from gs://ckpt/lost" in later.stderr, later.stderr
    assert all_objects_exist("lost")
    store("lost").restore(tmp_path / "elsewhere")
    assert read_tree(tmp_path / "elsewhere") == read_tree(ckpt)
