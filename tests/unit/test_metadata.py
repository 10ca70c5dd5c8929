"""Identity from the metadata server (fake on 127.0.0.1), config overrides, fast failure off GCP.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_metadata_gcp.py.

Timing (parallel lanes): nothing here is in the serial group; "fails fast" is asserted as one
request with the caller's timeout and none after it, not as wall seconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from support import REPO
from slurmagent.state.config import parse
from slurmagent.gcp import metadata
from slurmagent.gcp.metadata import MetadataError, MigRef, parse_created_by


@pytest.mark.parametrize("value,expected", [
    ("projects/123/zones/us-central1-a/instanceGroupManagers/gpu-mig",
     MigRef("123", "zones", "us-central1-a", "gpu-mig")),
    ("projects/123/regions/europe-west4/instanceGroupManagers/a3-mig",
     MigRef("123", "regions", "europe-west4", "a3-mig")),
    ("https://www.googleapis.com/compute/v1/projects/p/zones/z/instanceGroupManagers/m", MigRef("p", "zones", "z", "m")),
    ("", None),
    ("projects/123/zones/z/instances/x", None),
    (None, None),
])
def test_parse_created_by(value, expected):
    assert parse_created_by(value) == expected


def test_off_google_cloud_fails_fast_with_one_line(monkeypatch):
    """One wait of the given timeout, then the host is remembered as unreachable: the zone and
    any later value fail at once, without a second request (counted at `_open`, which every
    request goes through: wall seconds would not hold on a loaded machine)."""
    # A port that accepts connections but never answers: the deadline must hold.
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(5)
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{sink.getsockname()[1]}")
    metadata.reset_cache()
    opened: list[tuple[str, float]] = []
    real_open = metadata._open
    monkeypatch.setattr(metadata, "_open", lambda path, timeout_s, *a: opened.append((path, timeout_s))
                        or real_open(path, timeout_s, *a))
    try:
        start = time.monotonic()
        with pytest.raises(MetadataError) as info:
            metadata.project_and_zone(parse({}), timeout_s=0.5)
        assert time.monotonic() - start < 0.5 + 10  # the wait ends (a lost timeout would hang)
        assert opened == [("project/project-id", 0.5)]  # one request, with the caller's timeout
        assert "not on Google Cloud?" in str(info.value) and "within 0.5 s" in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(MetadataError):  # remembered: no second wait
            metadata.get("instance/zone", timeout_s=0.5)
        assert opened == [("project/project-id", 0.5)]
    finally:
        sink.close()
        metadata.reset_cache()


def test_identity_off_gcp_in_a_fresh_process_is_one_line(tmp_path, monkeypatch):
    """The command line maps a missing metadata server to one clear line (no traceback)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # connection refused
    env = {"GCE_METADATA_HOST": f"127.0.0.1:{port}", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    code = ("import sys; from slurmagent.gcp import metadata; from slurmagent.state.config import parse\n"
            "try:\n    metadata.identity(parse({}))\nexcept metadata.MetadataError as e:\n    print(e); sys.exit(1)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1
    assert proc.stdout.count("\n") == 1 and "not on Google Cloud?" in proc.stdout and not proc.stderr
