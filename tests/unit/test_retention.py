"""The retention rule, pure: which commits are kept, which objects may go (no bucket).

On the emulator (records, fencing, the commands): tests/cluster/test_retention_gcs.py.
"""

from __future__ import annotations

import pytest

from slurmagent.checkpoint.gcs.retention import (Commit, StoredObject, collectable, garbage_marks, manifest_objects,
                                                 record_marks, split_commits)
from slurmagent.checkpoint.gcs.bucket import BucketObjects
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.errors import ConfigError
from slurmagent.state.config import parse

NOW = 10_000.0
HEX = "ab" * 32


def commits(*created: float) -> list[Commit]:
    return [Commit(f"{i:020d}", t) for i, t in enumerate(created, start=1)]


def ids(cs: list[Commit]) -> list[int]:
    return [int(c.id) for c in cs]


def test_the_newest_keep_commits_are_kept_in_any_order():
    cs = commits(100, 200, 300, 400, 500)
    kept, lingering, dropped = split_commits(list(reversed(cs)), keep=2, grace_s=0, now=NOW)
    assert ids(kept) == [4, 5] and lingering == [] and ids(dropped) == [1, 2, 3]


def test_a_commit_protects_its_objects_for_the_grace_after_it_dropped_out():
    # commit 1 dropped out when commit 3 was written (keep 2): 9,500 s ago; commit 2 when commit 4 was: 50 s ago
    cs = commits(100, 200, 500, NOW - 50, NOW - 10)
    kept, lingering, dropped = split_commits(cs, keep=2, grace_s=600, now=NOW)
    assert ids(kept) == [4, 5]
    assert ids(lingering) == [2, 3]  # 3 dropped out at commit 5, 10 s ago
    assert ids(dropped) == [1]


def test_fewer_commits_than_keep_keeps_them_all():
    kept, lingering, dropped = split_commits(commits(1), keep=3, grace_s=0, now=NOW)
    assert ids(kept) == [1] and not lingering and not dropped
    with pytest.raises(ValueError):
        split_commits(commits(1), keep=0, grace_s=0, now=NOW)


def obj(name: str, age: float) -> StoredObject:
    return StoredObject(f"p/blobs/{name}", 7, 10, NOW - age)


def test_an_object_goes_when_unreferenced_and_older_than_the_grace():
    blobs = [obj("referenced-old", 9000), obj("orphan-old", 9000), obj("orphan-young", 5), obj("referenced-young", 5)]
    doomed, waiting = collectable(blobs, {"p/blobs/referenced-old", "p/blobs/referenced-young"}, 600, NOW)
    assert [o.name for o in doomed] == ["p/blobs/orphan-old"]
    assert waiting == 1  # the young orphan: a sync's upload whose manifest is not written yet


def test_a_referenced_object_never_goes_whatever_its_age():
    doomed, waiting = collectable([obj("a", 10**9)], {"p/blobs/a"}, 0, NOW)
    assert doomed == [] and waiting == 0


def test_manifest_objects_names_blobs_packs_and_legacy_sha256_not_links():
    m = Manifest(attempt=0, files={
        "a.pt": {"blake3": HEX, "size": 1, "crc32c": "AAAAAA=="},
        "b.json": {"blake3": "cd" * 32, "size": 1, "crc32c": "AAAAAA==", "pack": "ef" * 32, "offset": 0},
        "old.pt": {"sha256": "12" * 32, "size": 1, "crc32c": "AAAAAA=="},
        "last": {"link": "a.pt"},
    })
    objects = BucketObjects("gs://bkt/p")
    assert manifest_objects(objects, m) == {f"p/blobs/blake3-{HEX}", f"p/blobs/pack-{'ef' * 32}", f"p/blobs/{'12' * 32}"}
    assert manifest_objects(objects, None) == set()


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_keep_commits_must_be_an_integer_of_at_least_one(bad):
    with pytest.raises(ConfigError) as err:
        parse({"checkpoint": {"keep_commits": bad}}, "/etc/slurmagent/config.toml")
    assert "keep_commits" in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_retention_defaults():
    ck = parse({}, "x").checkpoint
    assert ck.keep_commits == 2 and ck.gc_grace_s == 600.0
    assert parse({"checkpoint": {"keep_commits": 5, "gc_grace_s": 0}}, "x").checkpoint.keep_commits == 5


def test_the_job_store_gets_the_retention_keys_from_the_config():
    from slurmagent.run.main import store_tunables

    kw = store_tunables(parse({"checkpoint": {"keep_commits": 4, "gc_grace_s": 30}}, "x"))
    assert kw["keep_commits"] == 4 and kw["gc_grace_s"] == 30


def test_garbage_is_marked_with_the_moment_the_rule_would_delete_it_and_marks_never_move():
    young = obj("orphan-young", 5)
    named_by_lingering = obj("lingering", 9000)
    already = StoredObject("p/blobs/marked-before", 7, 10, NOW - 5, custom_time=NOW - 1)
    kept_but_marked = StoredObject("p/blobs/kept", 7, 10, NOW - 5, custom_time=NOW - 1)
    marks, revive = garbage_marks([young, named_by_lingering, already, kept_but_marked, obj("kept-clean", 5)],
                                  {"p/blobs/kept", "p/blobs/kept-clean"}, {"p/blobs/lingering": NOW + 300}, 600)
    assert [(o.name, when) for o, when in marks] == [("p/blobs/lingering", NOW + 300),  # its last commit's grace
                                                     ("p/blobs/orphan-young", NOW - 5 + 600)]  # written + grace
    assert [o.name for o in revive] == ["p/blobs/kept"]  # a kept commit needs it: rewritten without the mark


def test_a_record_beyond_the_window_is_marked_for_when_it_dropped_out_plus_the_grace():
    cs = commits(100, 200, 500, NOW - 50, NOW - 10)
    got = record_marks(cs[:3], cs, keep=2, grace_s=600)
    assert [(int(c.id), until) for c, until in got] == [(1, 500 + 600), (2, NOW - 50 + 600), (3, NOW - 10 + 600)]
    assert record_marks(cs[3:], cs, keep=2, grace_s=600) == []  # kept ones are never marked
