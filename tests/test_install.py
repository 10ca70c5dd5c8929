"""`slurmagent install --root DIR`: a staging tree, idempotent, never overwriting an edited config."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from conftest import REPO
from slurmagent.config import Config, parse
from slurmagent.doctor import missing_slurm_conf_lines
from slurmagent.install import config_template, install


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


def test_install_into_staging_root_is_idempotent(tmp_path):
    first = cli("install", "--root", str(tmp_path))
    assert first.returncode == 0, first.stderr
    shim = tmp_path / "etc/slurmagent/hooks/prolog"
    assert os.access(shim, os.X_OK) and (shim.stat().st_mode & 0o777) == 0o755
    assert re.search(r"exec \S+/slurmagent prolog", shim.read_text())
    assert (tmp_path / "etc/slurmagent/config.toml").exists()
    units = sorted(p.name for p in (tmp_path / "etc/systemd/system").iterdir())
    assert "slurmagent-watch.service" in units
    binary = f"{sys.prefix}/bin/slurmagent"
    if os.path.exists(binary):  # units and shims point at this installation
        assert f"exec {binary} prolog" in shim.read_text()
        for unit in units:
            text = (tmp_path / "etc/systemd/system" / unit).read_text()
            assert all(line.startswith(f"ExecStart={binary}") for line in text.splitlines() if line.startswith("ExecStart="))
    assert "slurm.conf" in first.stdout  # it says which slurm.conf lines are still missing
    second = cli("install", "--root", str(tmp_path))
    assert second.returncode == 0
    actions = [line.split()[0] for line in second.stdout.splitlines() if line.startswith(("install", "update", "unchanged", "kept"))]
    assert actions and set(actions) == {"unchanged"}, second.stdout


def test_edited_config_is_never_overwritten(tmp_path):
    install(tmp_path)
    config = tmp_path / "etc/slurmagent/config.toml"
    config.write_text("[health]\ntimeout_s = 5\n")
    steps = {str(s.path): s.action for s in install(tmp_path)}
    assert steps[str(config)] == "kept"
    assert config.read_text() == "[health]\ntimeout_s = 5\n"


def test_dry_run_writes_nothing(tmp_path):
    out = cli("install", "--root", str(tmp_path / "r"), "--dry-run")
    assert out.returncode == 0 and "would install" in out.stdout
    assert not (tmp_path / "r").exists()


def test_config_template_parses_and_uncommented_gives_the_defaults():
    text = config_template()
    assert tomllib.loads(text) == {}  # all commented out: a valid, empty config
    uncommented = "\n".join(line[1:].split("    # ")[0] if line.startswith("#") and "=" in line or line.startswith("#[") else ""
                            for line in text.splitlines())
    cfg = parse(tomllib.loads(uncommented))
    assert cfg == Config(source=cfg.source)


def test_missing_slurm_conf_lines_are_listed(tmp_path):
    (tmp_path / "etc/slurm").mkdir(parents=True)
    (tmp_path / "etc/slurm/slurm.conf").write_text("ClusterName=x\nPrologFlags=Alloc\n")
    out = cli("install", "--root", str(tmp_path))
    assert "nohold_on_prolog_fail" in out.stdout and "Prolog=" in out.stdout
