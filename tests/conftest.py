"""Fixtures for every test. Helpers (paths, snapshots, the cluster's config) are in
tests/support/ and imported as `support`; the cluster's fixtures are in tests/cluster/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmagent.core.snapshot import NodeSnapshot
from support import healthy_snapshot_dict


@pytest.fixture
def healthy_snapshot() -> NodeSnapshot:
    return NodeSnapshot.from_dict(healthy_snapshot_dict())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """On xdist workers, the longest first: the `slow` scenarios, then the rest of the cluster
    folder, then the unit tests, so the lane's last minutes are short tests spread over every
    worker, not one long scenario started last. Stable within each group; every worker sorts
    the same way (xdist requires one order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cluster = Path(__file__).resolve().parent / "cluster"

    def weight(item) -> int:
        in_cluster = cluster in Path(item.fspath).resolve().parents
        return 0 if item.get_closest_marker("slow") else 1 if in_cluster else 2

    items.sort(key=weight)
