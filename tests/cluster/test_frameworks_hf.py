"""The Hugging Face Trainer (examples/hf_train.py: real transformers, a tiny GPT-2 built from a
config, random token ids) under the wrapper on the Slurm cluster: SIGTERMed mid-training, the
recipe's callback saves `checkpoint-N/` and stops, the job is requeued onto another node and
`resume_from_checkpoint` continues at global step N."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, cluster_config_text, manifest, need_module, wait_for

need_module("torch")
need_module("transformers")
need_module("accelerate")

HF_TRAIN = str(REPO / "examples" / "hf_train.py")


def ledger(path: Path, word: str) -> list[int]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[1]) for line in lines if line.startswith(word + " ")]


@pytest.mark.slurm
@pytest.mark.slow
def test_hf_trainer_sigtermed_saves_and_resumes_at_its_global_step_on_another_node(slurm, emu, tmp_path):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 1.0\ngrace_s = 120.0\n")
    out, log = tmp_path / "out", tmp_path / "log"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out),
                          "--open-mode=append", "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", sys.executable,
                          HF_TRAIN, "--max-steps", "150", "--save-steps", "50", "--step-seconds", "0.1",
                          "--log", str(log)], env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    first = c.wait_job(job_id, ("RUNNING",), 60)["NodeList"]
    wait_for(lambda: ledger(log, "step") and max(ledger(log, "step")) >= 15, 180, "15 steps")
    c.run(["scancel", "--batch", "--signal=TERM", job_id])
    c.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=test: node gone"])
    c.wait_job(job_id, ("PENDING",), 60)
    at_flush = manifest(f"jobs/{job_id}")["files"]  # what the flush committed, before the second run
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 300,
                   "job end")
    text = out.read_text()
    assert job["JobState"] == "COMPLETED", text
    assert job["Restarts"] == "1" and job["NodeList"] != first, text
    assert "Killed" not in text and "User defined signal" not in text, text  # the signal did not kill HF
    saved = ledger(log, "save")
    flushed = saved[0]
    assert 15 <= flushed < 50, saved  # saved at the signal, before the first periodic save
    assert ledger(log, "start") == [0, flushed]  # global_step continued from the restored checkpoint
    assert saved[1:] == [50, 100, 150]
    assert {f"checkpoint-{flushed}/trainer_state.json", f"checkpoint-{flushed}/model.safetensors",
            f"checkpoint-{flushed}/optimizer.pt"} <= set(at_flush)
    final = manifest(f"jobs/{job_id}")["files"]
    assert {n.split("/")[0] for n in final if n.startswith("checkpoint-")} == {"checkpoint-100", "checkpoint-150"}
