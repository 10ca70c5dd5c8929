"""Fixtures for every test. Helpers (paths, snapshots, the cluster's config) are in
tests/support/ and imported as `support`; the cluster's fixtures are in tests/cluster/conftest.py."""

from __future__ import annotations

import pytest

from slurmagent.core.snapshot import NodeSnapshot
from support import healthy_snapshot_dict


@pytest.fixture
def healthy_snapshot() -> NodeSnapshot:
    return NodeSnapshot.from_dict(healthy_snapshot_dict())
