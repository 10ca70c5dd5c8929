"""What the tests share besides fixtures: paths, replay snapshots, the cluster's config and
hook shims, `wait_for`, and the "skip, or fail in CI" checks: `need_slurm` before starting a
cluster, `need_tool` for a program CI installs, `need_module` for the training frameworks.

Tests import it as `support` (pyproject puts `tests/` on sys.path); the fakes, emulators, toy
trainers and data files live beside this file. Nothing here imports pytest or google at import
time, so bench/ and `slurmagent demo` can use it too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from slurmagent.devtools.localcluster import LocalSlurmCluster

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
DATA = SUPPORT / "data"
TOY_TRAINER = str(SUPPORT / "toy_trainer.py")
TOY_RANKS = str(SUPPORT / "toy_ranks.py")


def healthy_gpu(i: int) -> dict:
    return {
        "index": i,
        "uuid": f"GPU-{i:08x}-0000-0000-0000-000000000000",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
        "lost": False,
        "temperature_c": 38,
        "power_w": 71.2,
        "persistence_mode": True,
        "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0, "volatile_corrected": 0},
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
        "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
        "nvlink": [{"link": k, "active": True, "replay_errors": 0, "recovery_errors": 0, "crc_errors": 0} for k in range(18)],
        "clocks_event_reasons": [],
        "recovery_action": 0,
    }


def healthy_snapshot_dict(n: int = 8, hostname: str = "n1") -> dict:
    return {"schema": 1, "hostname": hostname, "driver_version": "550.90.07", "nvml_error": None,
            "gpus": [healthy_gpu(i) for i in range(n)]}


def xid_snapshot_dict(xid: int = 79, gpu: int = 3, n: int = 8) -> dict:
    d = healthy_snapshot_dict(n)
    d["gpus"][gpu]["xid_events"] = [{"xid": xid, "time": "2026-11-30T05:00:00Z"}]
    return d


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid`, its descendants and their process groups at once, as a lost VM would: a
    wrapper's trainer runs in a session of its own, so killing the wrapper's group alone leaves
    it running (writing, taking CPU) for the rest of the lane."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    groups, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            continue
        todo += children.get(p, [])
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def manifest(prefix: str) -> dict | None:
    """The newest manifest under gs://ckpt/PREFIX in the emulator STORAGE_EMULATOR_HOST names."""
    from google.cloud import storage

    blob = storage.Client(project="test").bucket("ckpt").blob(f"{prefix}/manifest.json")
    return json.loads(blob.download_as_bytes()) if blob.exists() else None


def need_slurm() -> None:
    """Before starting a local Slurm cluster: skip where none can run, but fail in CI (`CI` set),
    so that a lane never passes by skipping its cluster tests."""
    import pytest

    from slurmagent.devtools.localcluster import slurm_available

    why = slurm_available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"local Slurm cluster unavailable in CI: {why}")
        pytest.skip(why)


CHROOT_LANES = ("trixie", "forky")  # ci/debian-lane.sh's suites: neither installs Chromium, Prometheus, torch


def chroot_lane() -> str:
    """The Debian suite of ci/debian-lane.sh's chroot this runs in ("trixie", "forky"), else "":
    known by the marker the lane writes at the chroot's root or by os-release's codename."""
    name = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    if name in CHROOT_LANES:
        return name
    return (name or "chroot") if Path("/.slurmagent-ci-complete").exists() else ""


def find_tool(*names: str) -> str | None:
    """The first of `names` on PATH, else beside this interpreter (a venv's bin/, where pip puts
    py-spy and which PATH need not hold)."""
    import shutil

    for name in names:
        found = shutil.which(name) or shutil.which(str(Path(sys.executable).parent / name))
        if found:
            return found
    return None


def need_tool(*names: str, install: str, chroot_lanes_lack: bool = False) -> str:
    """The path of the first of `names` that is installed. Missing: skip for a developer, but
    fail in CI (`CI` set), which installs it (`install` says how, e.g. "apt-get install
    logrotate"), so that a lane never passes by skipping what it must run. `chroot_lanes_lack`:
    ci/debian-lane.sh's chroots (trixie, forky) do not install it, so there it skips, saying so;
    the host lane runs the test. May be called at a test module's top level."""
    found = find_tool(*names)
    if found:
        return found
    why = f"{' or '.join(names)} not installed ({install})"
    lane = chroot_lane()
    if lane and chroot_lanes_lack:
        _skip(f"{why}: the Debian {lane} chroot lane does not install it; the host lane runs this test")
    if os.environ.get("CI"):
        _fail(f"{why}: CI installs it, so this test must run there, not skip")
    _skip(why)


FRAMEWORKS_PYTHON = (3, 11)  # pyproject's `frameworks` extra (torch, lightning, transformers) installs only there


def need_module(name: str):
    """`import name` for a test with real training code (torch, numpy, lightning, transformers,
    accelerate: pyproject's `frameworks` extra, which `make` installs). Missing: skip for a
    developer, in ci/debian-lane.sh's chroots (never given torch) and on a Python the extra does
    not install on, each saying so; fail in CI's host lane (`CI` set, Python 3.11), which must
    run these tests. May be called at a test module's top level."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        why = f"{name} is not importable ({exc}; pip install -e '.[frameworks]' on Python 3.11)"
    lane = chroot_lane()
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if lane:
        _skip(f"{why}: the Debian {lane} chroot lane never installs torch or the frameworks; "
              "the host lane runs this test")
    if sys.version_info[:2] != FRAMEWORKS_PYTHON:
        _skip(f"{why}: the frameworks extra installs only on Python {'.'.join(map(str, FRAMEWORKS_PYTHON))}, "
              f"this is {py}")
    if os.environ.get("CI"):
        _fail(f"{why}: CI's host lane (Python {py}) installs the frameworks extra, so this test must run there, "
              "not skip")
    _skip(why)


def _skip(why: str) -> NoReturn:
    import pytest

    pytest.skip(why, allow_module_level=True)


def _fail(why: str) -> NoReturn:
    import pytest

    pytest.fail(why, pytrace=False)


def need_py_spy() -> None:
    """py-spy comes with the test extra in every lane (in the venv's bin/, where the wrapper finds
    it beside its interpreter): the evidence must hold real stacks, so CI may not skip this."""
    need_tool("py-spy", install="pip install -e '.[test]'")


def assert_py_spy_stack(text: str, pid: int, source: str) -> None:
    """`text` is py-spy's dump of process `pid` with a Python frame in the file `source`, not a
    line saying why there is none. py-spy 0.4.3 reads every lane's Python (3.11, trixie's 3.13,
    forky's 3.14; checked by hand in both chroots) and a stopped (SIGSTOP, `T`) process too."""
    assert text.startswith(f"Process {pid}: "), text
    assert re.search(r"^Thread \d+ ", text, re.M), text
    assert re.search(rf"^ +\S.* \((?:\S*/)?{re.escape(source)}:\d+\)$", text, re.M), text  # py-spy may shorten the path


class SlurmEnv:
    """The session cluster plus the per-node files its hooks read."""

    def __init__(self, cluster: LocalSlurmCluster, root: Path, config: Path):
        self.cluster = cluster
        self.root = root
        self.config = config

    def snapshot_path(self, node: str) -> Path:
        return self.root / "snap" / f"{node}.json"

    def kernel_log(self, node: str) -> Path:
        return self.root / "kern" / f"{node}.log"

    def state_dir(self, node: str) -> Path:
        return self.root / "state" / node

    def set_snapshot(self, node: str, data: dict) -> None:
        write_json(self.snapshot_path(node), data)

    def decisions(self, node: str) -> list[dict]:
        from slurmagent.state.decisionlog import read_records

        return read_records(self.state_dir(node) / "hooks.log")

    def reset(self) -> None:
        for node in self.cluster.nodes:
            self.set_snapshot(node, healthy_snapshot_dict(hostname=node))
        self.cluster.reset_nodes()


def hook_shim(path: Path, hook: str, config: Path, extra_env: dict[str, str] | None = None) -> Path:
    """A Prolog/Epilog shim as an admin would install it, pointing at this checkout."""
    env = {"SLURMAGENT_CONFIG": str(config), "PYTHONPATH": str(REPO), **(extra_env or {})}
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    path.write_text(f"#!/bin/sh\n{exports}exec {sys.executable} -m slurmagent.entry {hook}\n")
    path.chmod(0o755)
    return path


def cluster_config_text(root: Path, **health: object) -> str:
    """The test cluster's config; keyword arguments override `[health]` keys (None drops one)."""
    keys = {"snapshot": f"{root}/snap/%n.json", "kernel_log": f"{root}/kern/%n.log", "expected_gpus": 8,
            "timeout_s": 5, **health}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items() if v is not None)
    return (f'state_dir = "{root}/state/%n"\n[health]\n{lines}[hooks]\nsyslog = false\n'
            f'[watch]\nchannel_socket = "{root}/run/%n/channel.sock"\nhang_count_min_run_s = 5.0\n')


def uncommitted_sets(ckpt_dir: Path) -> list[dict[str, str]]:
    """The sets of `<ckpt_dir>.uncommitted/` (one per start that moved files aside), oldest
    first: each {path inside the set: text}."""
    aside = Path(str(ckpt_dir) + ".uncommitted")
    if not aside.is_dir():
        return []
    return [{p.relative_to(s).as_posix(): p.read_text() for p in sorted(s.rglob("*")) if p.is_file()}
            for s in sorted(aside.iterdir()) if s.is_dir()]


def uncommitted_tree(ckpt_dir: Path) -> dict[str, str]:
    """Every file moved aside from `ckpt_dir`, by its path in the checkpoint (a newer set's copy wins)."""
    out: dict[str, str] = {}
    for s in uncommitted_sets(ckpt_dir):
        out.update(s)
    return out
