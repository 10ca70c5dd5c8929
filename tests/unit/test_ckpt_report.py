"""The job's owner sees their checkpoint: the wrapper says the last commit, the sync's
duration and the lag on the job's stderr at a low rate (and when the bucket falls behind or
catches up), and `slurmagent status --job ID` shows the committed checkpoint (from the
bucket) and the running attempt's view (from the wrapper's record).

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_ckpt_report_slurm.py.
"""

from __future__ import annotations

import json


from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.report import CheckpointReport, read_record


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_report_says_the_first_commit_state_changes_and_then_only_every_interval(tmp_path):
    said: list[str] = []
    clock = Clock()
    rep = CheckpointReport(said.append, job="77", attempt=1, remote="gs://b/p", ckpt_dir="/d", record=tmp_path / "r.json",
                           interval_s=600, behind_s=60, clock=clock, wall=lambda: 1.8e9)
    m = Manifest(attempt=1, files={"a": {"blake3": "0" * 64, "size": 2_000_000, "crc32c": "AAAAAA=="}})
    rep.synced(None, 0.4, 0, 0, lag_s=0.0)
    assert said == []  # nothing committed yet: nothing to say
    rep.synced(m, 1.25, 1, 2_000_000, lag_s=0.0)
    assert len(said) == 1 and said[0].startswith("checkpoint: last commit: attempt 1, 1 file(s), 2.0 MB")
    assert "last sync 1.2 s (1 file(s), 2.0 MB sent); lag 0 s" in said[0]
    for _ in range(20):  # commits every few seconds: no line each time
        clock.t += 5
        rep.synced(m, 0.5, 1, 10, lag_s=3.0)
    assert len(said) == 1
    clock.t += 5
    rep.synced(None, 30.0, 0, 0, lag_s=90.0, held_back=["step-300"])  # falls behind: said at once
    assert len(said) == 2 and "lag 90 s (behind: the bucket is not keeping up); held back: step-300" in said[1]
    clock.t += 5
    rep.synced(m, 0.5, 1, 10, lag_s=1.0)  # caught up: said at once
    assert len(said) == 3 and "behind" not in said[2]
    clock.t += 600
    rep.synced(m, 0.5, 1, 10, lag_s=1.0)
    assert len(said) == 4  # and every interval otherwise
    rec = read_record(tmp_path / "r.json")
    assert rec["last_commit"]["bytes"] == 2_000_000 and rec["lag_s"] == 1.0 and rec["attempt"] == 1
    assert oct((tmp_path / "r.json").stat().st_mode & 0o777) == "0o600"


def test_a_record_that_is_not_ours_is_not_read(tmp_path):
    (tmp_path / "target.json").write_text('{"job": "77"}')
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    (tmp_path / "big.json").write_text(json.dumps({"job": "77", "x": "y" * 100_000}))
    (tmp_path / "list.json").write_text("[1]")
    assert [read_record(tmp_path / n) for n in ("link.json", "big.json", "list.json", "none.json")] == [None] * 4
