"""`slurmagent run`: flush on signal, sync to a GCS emulator, requeue, restore on restart.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_wrapper_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from support import REPO


def write_config(path: Path, remote: str, state_dir: Path, **checkpoint) -> Path:
    keys = {"remote": remote, "sync_interval_s": 1.0, "grace_s": 10.0, **checkpoint}
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path.write_text(f'state_dir = "{state_dir}"\n[checkpoint]\n{body}')
    return path


def test_bad_wrapper_input_is_exit_2_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(write_config(tmp_path / "c.toml", "", tmp_path)))
    for args in (["run", "--ckpt-signal", "NOPE", "--", "true"], ["run", "--remote", "s3://x/y", "--", "true"]):
        proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
