"""pytest fixtures around slurmagent.devtools.localgcs.GcsEmulator (a Cloud Storage emulator on 127.0.0.1).

    tests/cluster/conftest.py imports the fixtures, so every test module can ask for them.
"""

from __future__ import annotations

from slurmagent.devtools.localgcs import DEFAULT_BUCKET, GcsEmulator

try:
    import pytest
except ImportError:  # a bench without pytest still gets GcsEmulator
    pytest = None

if pytest is not None:

    @pytest.fixture
    def gcs_emulator_factory(tmp_path_factory):
        """``make(kind="fake-gcs-server", bucket="ckpt") -> GcsEmulator``, started, stopped at teardown."""
        started: list[GcsEmulator] = []

        def make(kind: str = "fake-gcs-server", bucket: str | None = DEFAULT_BUCKET) -> GcsEmulator:
            emu = GcsEmulator(kind, data_dir=tmp_path_factory.mktemp(kind))
            started.append(emu)
            emu.start()
            if bucket:
                emu.create_bucket(bucket)
            return emu

        yield make
        for emu in started:
            emu.stop()

    @pytest.fixture
    def gcs_emulator(gcs_emulator_factory):
        """A fake-gcs-server with bucket ``ckpt`` (STORAGE_EMULATOR_HOST is NOT set)."""
        return gcs_emulator_factory()
