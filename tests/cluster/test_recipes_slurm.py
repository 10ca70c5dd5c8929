"""Every recipe runs as written: each example a page of docs/user/recipes/ includes (the pages'
code is the examples' own, tests/unit/test_recipes.py) runs under `slurmagent sbatch` on the
4-node cluster with node-local disks, the multi-node ones on 2 nodes, and ends COMPLETED with
a committed checkpoint holding what the trainer said it saved.

Each case is small (tens of steps); the frameworks' interruptions, requeues and resumes are
tested in test_frameworks_*.py and test_multinode.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, need_module, wait_for
from test_recipes import recipe_examples  # tests/unit (on the path: tests/conftest.py)
from slurmagent.devtools.localcluster import LocalSlurmCluster, free_ports

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# example -> [(nodes, argv (OUT: a folder of the test), modules it needs, a file the last commit holds)]
RUNS = {
    "examples/plain_loop.py": [(1, ["200", "0.01"], (), "state.json")],
    "examples/pytorch_loop.py": [(1, ["600"], ("torch",), "model.pt")],
    "examples/dcp_train.py": [(2, ["--steps", "40", "--every", "20"], ("torch", "numpy"), "step-00000040/.metadata")],
    "examples/ddp_dcp_train.py": [(2, ["40", "OUT", "0"], ("torch", "numpy"), "step_0000040/.metadata")],
    "examples/hf_train.py": [(2, ["--max-steps", "20", "--save-steps", "10"], ("torch", "transformers", "accelerate"),
                              "checkpoint-20/trainer_state.json")],
    "examples/lightning_train.py": [(1, ["--auto-requeue", "off", "--max-steps", "20"], ("torch", "lightning"), ""),
                                    (1, ["--auto-requeue", "on", "--max-steps", "20"], ("torch", "lightning"), "")],
}
CASES = [pytest.param(ex, i, id=f"{Path(ex).stem}-{i}") for ex in recipe_examples() for i in range(len(RUNS.get(ex, [()])))]


def test_every_recipe_example_has_a_run():
    assert set(recipe_examples()) == set(RUNS), "a recipe page includes an example with no run here, or the reverse"


def config(tmp_path: Path, prefix: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f'state_dir = "{tmp_path}/state/%n"\n[checkpoint]\nremote = "gs://ckpt/{prefix}"\n'
                    "sync_interval_s = 1.0\ngrace_s = 30.0\n")
    return path


def bucket_manifest(prefix: str) -> dict | None:
    from google.cloud import storage

    blob = storage.Client(project="test").bucket("ckpt").blob(f"{prefix}/manifest.json")
    return json.loads(blob.download_as_bytes()) if blob.exists() else None


@pytest.mark.parametrize("example,case", CASES)
def test_recipe_runs_to_completed(cl: LocalSlurmCluster, emu, tmp_path, example, case):
    nodes, argv, modules, committed = RUNS[example][case]
    for m in modules:
        need_module(m)
    out = tmp_path / "out"
    argv = [str(out) if a == "OUT" else a for a in argv]
    cmd = [sys.executable, str(REPO / example), *argv]
    layout = ["-N2", "--ntasks-per-node=1"] if nodes == 2 else ["-N1", "-n1"]
    env = {**cl.env, "SLURMAGENT_CONFIG": str(config(tmp_path, "recipes")), "PYTHONPATH": str(REPO),
           "STORAGE_EMULATOR_HOST": emu.url, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    sub = subprocess.run(
        [sys.executable, "-P", "-m", "slurmagent.entry", "sbatch", "--parsable", *layout, "-o", str(tmp_path / "log"),
         "--", "--ckpt-dir", str(cl.local_path / "ckpt"), "--", *(["srun"] if nodes == 2 else []), *cmd],
        env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    end = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None)(
        cl.job(job)), 240, f"job {job} to end")
    log = (tmp_path / "log").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", log
    assert "Traceback" not in log, log
    if committed:  # Lightning's example saves only when signalled
        m = bucket_manifest(f"recipes/{job}")
        assert m is not None and committed in m["files"], (sorted(m["files"]) if m else None, log)
