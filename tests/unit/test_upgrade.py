"""The documented upgrade (docs/admin/install.md, "Upgrades"): each version in its own venv,
`/opt/slurmagent/current` a symlink to one of them, swapped atomically (`ln -sfn NEW current.new`
then `mv -T current.new current`, a rename). The shims and units name `current/bin/slurmagent`.

A prolog that starts while the link is swapped runs one version or the other, whole: never a
traceback, never "slurmagent missing" (the shim's fail-open path), every run logged. Here two
venv-like trees hold a copy of this package each (with its own dist-info version), and the link
flips back and forth while the installed prolog shim is started again and again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from support import REPO, healthy_snapshot_dict
from slurmagent.commands.install import install
from slurmagent.state.decisionlog import read_records

RUNS = 16


def venv_like(base: Path, version: str) -> Path:
    """`base/lib/slurmagent` (+ its dist-info) and `base/bin/slurmagent`, as pip lays out a venv."""
    lib = base / "lib"
    shutil.copytree(REPO / "slurmagent", lib / "slurmagent", ignore=shutil.ignore_patterns("__pycache__"))
    info = lib / f"slurmagent-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: slurmagent\nVersion: {version}\n\n")
    script = base / "bin/slurmagent"
    script.parent.mkdir()
    # pip's console script names the venv's own python (its real path, not the link): a process
    # that started stays in the tree it started from
    script.write_text(f"#!{sys.executable} -I\nimport sys\nsys.path.insert(0, {str(lib)!r})\n"
                      "from slurmagent.entry import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return base


def swap(link: Path, target: Path) -> None:
    """The documented swap: a new link beside the old one, renamed over it (atomic)."""
    tmp = link.with_name(link.name + ".new")
    subprocess.run(["ln", "-sfn", str(target), str(tmp)], check=True)
    subprocess.run(["mv", "-T", str(tmp), str(link)], check=True)


def test_a_prolog_started_during_the_swap_runs_one_whole_version(tmp_path):
    opt = tmp_path / "opt/slurmagent"
    v1, v2 = venv_like(opt / "venvs/1.0", "1.0"), venv_like(opt / "venvs/2.0", "2.0")
    current = opt / "current"
    swap(current, v1)
    root = tmp_path / "root"
    install(root, binary=str(current / "bin/slurmagent"))
    shim = root / "etc/slurmagent/hooks/prolog"

    (tmp_path / "snap.json").write_text(json.dumps(healthy_snapshot_dict(8)))
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[health]\nsnapshot = "{tmp_path}/snap.json"\n'
                                     'expected_gpus = 8\n[hooks]\nsyslog = false\n')
    env = {"PATH": "/usr/bin:/bin", "SLURMAGENT_CONFIG": str(tmp_path / "c.toml"), "SLURMD_NODENAME": "n1",
           "SLURM_JOB_ID": "7"}

    done, swaps = threading.Event(), [0]

    def flip() -> None:
        while not done.is_set():
            swap(current, v2 if swaps[0] % 2 == 0 else v1)
            swaps[0] += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        runs = [subprocess.run([str(shim)], env=env, capture_output=True, text=True, timeout=120) for _ in range(RUNS)]
    finally:
        done.set()
        flipper.join(30)
    for run in runs:
        assert run.returncode == 0 and "Traceback" not in run.stderr and "missing" not in run.stderr, run.stderr
    records = read_records(tmp_path / "state/hooks.log")
    assert len(records) == RUNS and {r["verdict"] for r in records} == {"healthy"}  # every prolog ran, whole
    assert swaps[0] > RUNS and {r["version"] for r in records} <= {"1.0", "2.0"}
    assert not os.path.lexists(current.with_name("current.new")) and current.is_symlink()
