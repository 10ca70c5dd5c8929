"""Identity from the metadata server (fake on 127.0.0.1), config overrides, fast failure off GCP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from fake_gcp import FakeGcp
from slurmagent.state.config import parse
from slurmagent.gcp import metadata
from slurmagent.gcp.metadata import MetadataError, MigRef, parse_created_by


@pytest.fixture
def fake(monkeypatch):
    f = FakeGcp().start()
    monkeypatch.setenv("GCE_METADATA_HOST", f.host)
    monkeypatch.delenv("GCE_METADATA_ROOT", raising=False)
    metadata.reset_cache()
    yield f
    f.stop()
    metadata.reset_cache()


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


def test_identity_from_metadata_server(fake):
    fake.set_identity("n7", zone="us-east5-b",
                      created_by="projects/123456789/regions/us-east5/instanceGroupManagers/gpu-mig")
    ident = metadata.identity(parse({}))
    assert (ident.project, ident.zone, ident.instance, ident.region) == ("test-proj", "us-east5-b", "n7", "us-east5")
    assert ident.mig == MigRef("123456789", "regions", "us-east5", "gpu-mig") and ident.mig.regional
    assert all(c.kind == "metadata" for c in fake.calls)


def test_instance_not_in_a_mig(fake):
    fake.set_identity("login1")
    assert metadata.identity(parse({})).mig is None


def test_config_overrides_metadata(fake):
    fake.set_identity("n1", zone="us-east5-b")
    cfg = parse({"gcp": {"project": "other", "zone": "asia-south1-c"}})
    assert metadata.project_and_zone(cfg) == ("other", "asia-south1-c")
    assert fake.calls == []  # nothing asked when the config says it all


def test_requires_metadata_flavor_header(fake):
    fake.set_identity("n1")
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{fake.url}/computeMetadata/v1/instance/name", timeout=2)
    assert info.value.code == 403
    assert metadata.get("instance/name") == "n1"  # we send it


def test_off_google_cloud_fails_fast_with_one_line(monkeypatch):
    # A port that accepts connections but never answers: the deadline must hold.
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(5)
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{sink.getsockname()[1]}")
    metadata.reset_cache()
    try:
        start = time.monotonic()
        with pytest.raises(MetadataError) as info:
            metadata.project_and_zone(parse({}), timeout_s=0.5)
        assert time.monotonic() - start < 2
        assert "not on Google Cloud?" in str(info.value) and "\n" not in str(info.value)
        start = time.monotonic()
        with pytest.raises(MetadataError):  # remembered: no second wait
            metadata.get("instance/zone", timeout_s=0.5)
        assert time.monotonic() - start < 0.2
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
