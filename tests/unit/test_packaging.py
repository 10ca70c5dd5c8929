"""The wheel an admin installs: built without a deprecation warning, Apache-2.0 with its LICENSE,
every package of the tree in it, hooks/ and systemd/ inside the package (install reads them from
there), and one version: pyproject's, the same in METADATA, `--version` and the decision log.

The build runs on a copy whose pyproject says another version, so a second literal anywhere
would show."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict

VERSION = "9.8.7"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for name in ("slurmagent", "hooks", "systemd", "contrib"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pyproject = (src / "pyproject.toml").read_text()
    assert len(re.findall(r'(?m)^version = "[^"]+"', pyproject)) == 1
    (src / "pyproject.toml").write_text(re.sub(r'(?m)^version = "[^"]+"', f'version = "{VERSION}"', pyproject))
    out = src / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("slurmagent-*.whl")
    return whl, proc.stdout + proc.stderr


def test_the_wheel_builds_without_a_deprecation_warning(wheel):
    _, log = wheel
    assert not [line for line in log.splitlines() if re.search(r"deprecat", line, re.I)]


def test_the_wheel_is_apache_2_with_its_license_and_has_every_package(wheel):
    whl, _ = wheel
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        metadata = z.read(f"slurmagent-{VERSION}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert f"slurmagent-{VERSION}.dist-info/licenses/LICENSE" in names
    tree = {str(p.relative_to(REPO)) for p in (REPO / "slurmagent").rglob("*.py") if "__pycache__" not in p.parts}
    assert tree - names == set()  # a new package not listed in pyproject would be missing here
    for name in ("hooks/prolog", "hooks/epilog", "hooks/slurm.conf.example", "systemd/slurmagent-watch.service",
                 "logrotate/slurmagent"):
        assert f"slurmagent/data/{name}" in names
    assert not [n for n in names if n.startswith(("share/", "slurmagent-" + VERSION + ".data/"))]  # no data-files


def test_installed_wheel_version_and_install_agree(wheel, tmp_path):
    """Unpacked (what pip does for a pure wheel), away from the checkout: `--version`, a prolog's
    decision log, its build_info metric and `install` (its files from the package data)."""
    whl, _ = wheel
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    metadata = (site / f"slurmagent-{VERSION}.dist-info/METADATA").read_text()
    (meta_version,) = re.findall(r"(?m)^Version: (.+)$", metadata)
    env = dict(os.environ, PYTHONPATH=str(site))
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "slurmagent.entry", *a], capture_output=True,  # noqa: E731
                                          text=True, timeout=120, cwd=tmp_path, **kw)
    shown = run("--version", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"slurmagent, version {meta_version}\n" and meta_version == VERSION

    (tmp_path / "snap.json").write_text(json.dumps(healthy_snapshot_dict(8)))
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[health]\nsnapshot = "{tmp_path}/snap.json"\n'
                                     'expected_gpus = 8\n[hooks]\nsyslog = false\n')
    hook_env = dict(env, SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), SLURMD_NODENAME="n1", SLURM_JOB_ID="5")
    prolog = run("prolog", env=hook_env)
    assert prolog.returncode == 0, prolog.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "state/hooks.log").read_text().splitlines()]
    assert record["version"] == VERSION and record["severity"] == "INFO"
    assert f'slurmagent_build_info{{version="{VERSION}"}} 1' in (tmp_path / "state/slurmagent.prom").read_text()

    installed = run("install", "--root", str(tmp_path / "root"), env=env)
    assert installed.returncode == 0, installed.stderr
    unit = tmp_path / "root/usr/lib/systemd/system/slurmagent-watch.service"
    assert unit.read_text().startswith((REPO / "systemd/slurmagent-watch.service").read_text()[:40])
