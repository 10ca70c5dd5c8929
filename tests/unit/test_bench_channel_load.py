"""bench/channel_load.py runs (a short, small run): the figures in docs/admin/security.md come
from it, and a rename in the channel's modules broke it once without any test noticing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="the flood runs as nobody: needs root")
def test_the_channel_bench_runs_both_rounds_and_counts_the_flood():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "channel_load.py"), "--seconds", "2", "--wrappers", "4",
                           "--flooders", "1", "--idle", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    alone, flooded = json.loads(lines[-1])
    answered = int(lines[2].split()[2]), int(lines[3].split()[1])  # 4 wrappers, once a second for 2 s
    assert lines[2].startswith("no flood") and lines[3].startswith("flood"), proc.stdout
    assert 8 <= answered[0] <= 12 and 8 <= answered[1] <= 12, proc.stdout
    assert alone["refused"] == 0 and alone["granted"] == answered[0]
    assert flooded["refused"] > 0 and flooded["granted"] == answered[1]  # every wrapper answered beside the flood
