"""22.1 done-when with the real Hugging Face Trainer (examples/hf_train.py: transformers, a tiny
GPT-2 built from a config, random token ids): a single-node job saving `checkpoint-N/` every
~2 s (HF's own writer: the folder filled in place, file by file) under `slurmagent run
--sync-interval 1`, its VM lost 10 times at random moments (SIGKILL to the wrapper's and the
trainer's process groups at once), 1-8 s after its first step, every other attempt only once it
has committed a save of its own (so that the restores move on on a loaded machine too). Every restore holds only whole `checkpoint-N/` folders, and
the next attempt's `Trainer.train(resume_from_checkpoint=...)` continues at the restored step."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, kill_process_tree, need_module, wait_for

need_module("torch")
need_module("transformers")
need_module("accelerate")

HF_TRAIN = str(REPO / "examples" / "hf_train.py")
# Model width: ~75 MB per checkpoint-N/ (model, optimizer, rng, scheduler, args, state), so HF's
# save lasts long enough (~0.2 s, file by file) that sync rounds land inside it: without the
# quiet-for-a-round cut, half-written folders were committed in 3 runs out of 3 (~19 MB: 0 of 2).
N_EMBD = "512"


def ledger(path: Path, word: str) -> list[str]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.split(" ", 1)[1] for line in lines if line.startswith(word + " ")]


def newest_committed(store) -> int:
    """The highest checkpoint-N/ in the newest commit (0: none)."""
    seen = store.latest_manifest(deadline_s=10)
    names = seen.files if seen is not None else {}
    return max((int(n.split("/")[0].split("-")[1]) for n in names if n.startswith("checkpoint-")), default=0)


def steps_in(d: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in d.glob("checkpoint-*"))


def not_whole(files: dict, expected: set[str], local: Path) -> list[str]:
    """The checkpoint-N/ folders of a committed file list that are not whole: a file missing
    or extra, or one whose size differs from HF's finished file (`local`, where still there)."""
    folders: dict[str, dict[str, int]] = {}
    for name, entry in files.items():
        folder, _, rest = name.partition("/")
        if folder.startswith("checkpoint-"):
            folders.setdefault(folder, {})[rest] = entry["size"]
    bad = []
    for folder, sizes in sorted(folders.items()):
        here = {p.name: p.stat().st_size for p in (local / folder).iterdir()} if (local / folder).is_dir() else {}
        if set(sizes) != expected or (set(here) == expected and sizes != here):
            bad.append(f"{folder}: {sorted(sizes)}")
    return bad


@pytest.mark.slow
def test_hf_trainer_killed_hard_at_ten_random_moments_restores_whole_folders_and_resumes(emu, tmp_path):
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/hf"\n')
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), CLOUD_RUN_JOB="hf",
               CLOUD_RUN_TASK_INDEX="0")
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED"):
        env.pop(key, None)
    store = GcsCheckpointStore("gs://ckpt/hf/hf-task-0")
    rng = random.Random(22)
    expected: set[str] = set()  # what a whole checkpoint-N/ holds: a folder HF finished in this run
    resume_at, resumed_steps = 0, []
    for attempt in range(11):  # 10 kills; the 11th attempt shows the last restore resumes
        vm, log, err_path = tmp_path / f"vm{attempt}", tmp_path / f"log{attempt}", tmp_path / f"err{attempt}"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(vm), "--sync-interval", "1",
                 "--", sys.executable, HF_TRAIN, "--max-steps", "100000", "--save-steps", "10", "--step-seconds",
                 "0.2", "--n-embd", N_EMBD, "--save-total-limit", "2", "--log", str(log)],
                env={**env, "CLOUD_RUN_TASK_ATTEMPT": str(attempt)}, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True)
        commits: dict[frozenset, dict] = {}  # every commit seen while this attempt ran
        try:
            wait_for(lambda: ledger(log, "start") or proc.poll() is not None, 120, "the Trainer to start")
            why = (attempt, err_path.read_text()[-3000:])
            # (b) Trainer.train(resume_from_checkpoint=...) took the restored folder: global_step goes on from it
            assert ledger(log, "start") == [f"{resume_at} resumed={int(resume_at > 0)}"], why
            wait_for(lambda: any(int(s) > resume_at for s in ledger(log, "step")) or proc.poll() is not None, 60,
                     "a step after the start")
            assert proc.poll() is None, why  # every file of the restored checkpoint loaded, training went on
            resumed_steps.append(resume_at)
            if attempt == 10:
                break
            if attempt % 2 == 0:  # every other attempt commits a save of its own first: commits go on
                # however loaded the machine (a kill 1-8 s after a step can come before any upload)
                wait_for(lambda: newest_committed(store) > resume_at or proc.poll() is not None, 120,
                         "a commit past the restored step")
            kill_at = time.monotonic() + rng.uniform(1.0, 8.0)  # the VM is lost at a random moment
            while time.monotonic() < kill_at:
                seen = store.latest_manifest(deadline_s=10)
                if seen is not None:
                    commits[frozenset((n, e["size"]) for n, e in seen.files.items())] = seen.files
                time.sleep(max(0.0, min(0.2, kill_at - time.monotonic())))
        finally:
            kill_process_tree(proc.pid)  # every process at once
            proc.wait(10)
        saved = [int(s) for s in ledger(log, "save")]
        expected = expected or ({p.name for p in (vm / f"checkpoint-{saved[-1]}").iterdir()} if saved else set())
        assert expected, "no save finished before the first kill"
        for files in commits.values():  # no commit, periodic or last, ever held a half-written folder
            assert not_whole(files, expected, vm) == [], (attempt, err_path.read_text()[-3000:])
        restored = tmp_path / f"restored{attempt}"
        manifest = store.restore(restored, deadline_s=120)
        steps = steps_in(restored)
        assert manifest is not None and steps, (attempt, err_path.read_text()[-3000:])
        # (a) every checkpoint-N/ restored is whole: HF's full set of files, each as HF wrote it
        assert not_whole(manifest.files, expected, vm) == [], attempt
        for step in steps:
            folder, local = restored / f"checkpoint-{step}", vm / f"checkpoint-{step}"
            assert {p.name for p in folder.iterdir()} == expected, (attempt, step)
            if local.is_dir() and {p.name for p in local.iterdir()} == expected:  # not rotated away
                for name in expected:
                    assert (folder / name).read_bytes() == (local / name).read_bytes(), (attempt, step, name)
        resume_at = steps[-1]  # the next attempt restores this commit (nothing commits in between)
        for done in (vm, restored):
            shutil.rmtree(done)  # ~150 MB each
    assert resumed_steps == sorted(resumed_steps) and len(set(resumed_steps)) >= 3, resumed_steps  # commits went on
