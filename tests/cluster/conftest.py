"""The cluster tests' fixtures: one real local Slurm cluster per session, the Cloud Storage
emulator, the fake metadata server. Every test collected here is marked `cluster` (the folder
is the mark); the ones that need Slurm carry `slurm` too, so `-m "not slurm"` still leaves Slurm out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slurmagent.devtools.localcluster import LocalSlurmCluster
from support import SlurmEnv, cluster_config_text, healthy_snapshot_dict, hook_shim, need_slurm, write_json
from support.gcs_emulator import GcsEmulator, gcs_emulator, gcs_emulator_factory  # noqa: F401 (fixtures)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture
def emu(gcs_emulator, monkeypatch) -> GcsEmulator:
    """A fresh fake-gcs-server with bucket `ckpt`, named by STORAGE_EMULATOR_HOST for this test."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


@pytest.fixture
def serve_metadata(monkeypatch):
    """`serve_metadata(FakeGcp())`: start the fake as this test's metadata server (GCE_METADATA_HOST,
    the metadata cache cleared) and return it; stopped, and the cache cleared, after the test."""
    from slurmagent.gcp import metadata

    started = []

    def serve(fake):
        started.append(fake.start())
        monkeypatch.setenv("GCE_METADATA_HOST", fake.host)
        monkeypatch.delenv("GCE_METADATA_ROOT", raising=False)
        metadata.reset_cache()
        return fake

    yield serve
    for fake in started:
        fake.stop()
    metadata.reset_cache()


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory) -> SlurmEnv:
    need_slurm()
    root = tmp_path_factory.mktemp("cluster")
    root.chmod(0o755)
    config = root / "config.toml"
    config.write_text(cluster_config_text(root))
    for node in ("n1", "n2", "n3"):
        write_json(root / "snap" / f"{node}.json", healthy_snapshot_dict(hostname=node))
        (root / "kern").mkdir(exist_ok=True)
        (root / "kern" / f"{node}.log").touch()
    hooks = root / "hooks"
    hooks.mkdir()
    cluster = LocalSlurmCluster(
        root / "slurm",
        nodes=["n1", "n2", "n3"],
        prolog=str(hook_shim(hooks / "prolog", "prolog", config)),
        epilog=str(hook_shim(hooks / "epilog", "epilog", config)),
    )
    cluster.start()
    env = SlurmEnv(cluster, root, config)
    yield env
    cluster.stop()


@pytest.fixture
def slurm(slurm_env: SlurmEnv) -> SlurmEnv:
    """The session cluster, reset to all nodes idle and healthy before each test."""
    slurm_env.reset()
    return slurm_env


# --- the 4-node cluster of the multi-node tests: each node's ROOT/localssd its own directory


@pytest.fixture(scope="module")  # one per module that uses it, as when each module built its own
def multinode_cluster(tmp_path_factory):
    need_slurm()
    root = tmp_path_factory.mktemp("multinode")
    root.chmod(0o755)
    c = LocalSlurmCluster(root / "slurm", nodes=["n1", "n2", "n3", "n4"], node_local=root)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def cl(multinode_cluster):
    """The module's cluster, every node idle and its node-local disk empty, as a fresh VM's:
    a file left by an earlier test's job is, to the next job, a checkpoint to start from."""
    cluster = multinode_cluster
    cluster.reset_nodes()
    for n in cluster.nodes:
        for p in cluster.node_dir(n).iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    return cluster
