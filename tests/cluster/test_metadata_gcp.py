"""Identity from the metadata server (fake on 127.0.0.1), config overrides, fast failure off GCP.

The same subject without a cluster, emulator or fake server: tests/unit/test_metadata.py.
"""

from __future__ import annotations


import pytest

from support.fake_gcp import FakeGcp
from slurmagent.state.config import parse
from slurmagent.gcp import metadata
from slurmagent.gcp.metadata import MigRef


@pytest.fixture
def fake(serve_metadata):
    return serve_metadata(FakeGcp())


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
