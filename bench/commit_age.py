#!/usr/bin/env python3
"""How old is the checkpoint a hard kill leaves? The real wrapper against the emulator, per writer.

    python bench/commit_age.py [--period 1.0] [--sync 0.5] [--settle 0.25] [--seconds 24] [--kills 20]
                               [--size-kib 256] [--only WRITER ...] [--declare] [--seed 1]

For each writer below, once without and once with a log appended beside the checkpoint (a
line every 50 ms), `slurmagent run` (Cloud Run mode: no Slurm needed) runs a trainer that saves
every `--period` seconds, with `--sync-interval` = `--sync` and `[checkpoint] settle_s` =
`--settle`. At `--kills` random moments a hard kill (the VM gone: no signal, no final sync)
would leave what the bucket's manifest.json holds then; the bench reads it at each moment,
and afterwards restores each of those commits into an empty folder (the real restore, hashes
checked) and inspects the files:

* **age**: the moment minus when the newest whole save in that commit ended (the trainer
  logs each save's end); before any commit, the moment minus the trainer's start;
* **bound**: one save period + two sync rounds + the upload of one checkpoint. A round is
  `--sync` of waiting plus the round's own work (the wrapper waits the interval after each
  round); both are measured in the same run on the same emulator: the upload as a cold
  `GcsCheckpointStore.sync` of one checkpoint of that shape, a round's work as a second sync
  of it after one file changed (hashing, upload, commit, clean-up);
* **torn**: a restored file that is not one save's whole bytes (an in-place save cut short),
  or a step folder the framework's restore would load (HF's highest `checkpoint-N/`, DCP's
  `.metadata`) holding files of another step or missing some;
* **mixed**: files of one save (model + optimizer) from different saves.

Writers (no `trainer.saved` unless `--declare`: the evidence is the files alone):
  atomic   ckpt.pt written to a temporary name, fsynced, renamed
  inplace  model.pt rewritten in place (open "wb"), in 8 writes over 0.2 s, as torch.save writes a big state
  two      model.pt then optim.pt, each atomic, 0.1 s apart
  hf       checkpoint-N/ {model.safetensors, optimizer.pt, rng_state.pth, then trainer_state.json}, last 2 kept
  dcp      step-N/ {__0_0.distcp, __1_0.distcp, then .metadata renamed into place}, last 2 kept
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WRITERS = ("atomic", "inplace", "two", "hf", "dcp")

TRAINER = r'''
import json, os, shutil, sys, threading, time
kind, period, with_log, side, seconds, size, declare = (sys.argv[1], float(sys.argv[2]), sys.argv[3] == "log",
                                                       sys.argv[4], float(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1")
from slurmagent import trainer
d = os.environ["SLURMAGENT_CKPT_DIR"]

def data(step, n=size):
    return (b"%08d" % step) * (n // 8)

def atomic(path, b):
    with open(path + ".tmp", "wb") as f:
        f.write(b); f.flush(); os.fsync(f.fileno())
    os.replace(path + ".tmp", path)

def plain(path, b):
    with open(path, "wb") as f:
        f.write(b)

def inplace(path, b, chunks=8, spread=0.2):
    with open(path, "wb") as f:
        for i in range(chunks):
            f.write(b[i * len(b) // chunks:(i + 1) * len(b) // chunks]); f.flush(); time.sleep(spread / chunks)

def keep_last(prefix, k=2):
    for old in sorted((p for p in os.listdir(d) if p.startswith(prefix)), key=lambda p: int(p.split("-")[1]))[:-k]:
        shutil.rmtree(os.path.join(d, old), ignore_errors=True)

def save(step):
    if kind == "atomic":
        atomic(os.path.join(d, "ckpt.pt"), data(step)); done = [os.path.join(d, "ckpt.pt")]
    elif kind == "inplace":
        inplace(os.path.join(d, "model.pt"), data(step)); done = [os.path.join(d, "model.pt")]
    elif kind == "two":
        atomic(os.path.join(d, "model.pt"), data(step)); time.sleep(0.1)
        atomic(os.path.join(d, "optim.pt"), data(step, size // 2))
        done = [os.path.join(d, "model.pt"), os.path.join(d, "optim.pt")]
    elif kind == "hf":
        f = os.path.join(d, f"checkpoint-{step}"); os.makedirs(f, exist_ok=True)
        plain(os.path.join(f, "model.safetensors"), data(step)); plain(os.path.join(f, "optimizer.pt"), data(step, size // 2))
        plain(os.path.join(f, "rng_state.pth"), data(step, 64))
        with open(os.path.join(f, "trainer_state.json"), "w") as fh:
            json.dump({"global_step": step}, fh)
        keep_last("checkpoint-"); done = [f]
    else:
        f = os.path.join(d, f"step-{step}"); os.makedirs(f, exist_ok=True)
        plain(os.path.join(f, "__0_0.distcp"), data(step)); plain(os.path.join(f, "__1_0.distcp"), data(step))
        plain(os.path.join(f, ".metadata.tmp"), data(step, 64)); os.replace(os.path.join(f, ".metadata.tmp"), os.path.join(f, ".metadata"))
        keep_last("step-"); done = [f]
    if declare:
        trainer.saved(done, step=step)

def log():
    with open(os.path.join(d, "train.log"), "a") as fh:
        while True:
            fh.write("loss %.4f\n" % time.time()); fh.flush(); time.sleep(0.05)

if with_log:
    threading.Thread(target=log, daemon=True).start()
start, step = time.time(), 0
with open(side, "a") as out:
    out.write(f"0 {start:.6f}\n"); out.flush()  # step 0: the trainer's start (an age before any commit)
    while time.time() - start < seconds:
        time.sleep(max(0.0, start + (step + 1) * period - time.time()))
        step += 1
        save(step)
        out.write(f"{step} {time.time():.6f}\n"); out.flush()
'''


def steps_of(b: bytes) -> set[int]:
    """The save steps a file's bytes come from (one, when whole)."""
    return {int(b[i:i + 8]) for i in range(0, len(b) - len(b) % 8, 8)} if b and len(b) % 8 == 0 else {-1}


def whole_step(kind: str, root: Path, size: int) -> tuple[int | None, str]:
    """(the newest whole save in a restored folder, what is wrong with it: "", "torn" or "mixed")."""
    def one(p: Path, n: int) -> int | None:
        if not p.is_file():
            return None
        b = p.read_bytes()
        s = steps_of(b)
        return next(iter(s)) if len(s) == 1 and len(b) == n and -1 not in s else -1

    if kind in ("atomic", "inplace"):
        s = one(root / ("ckpt.pt" if kind == "atomic" else "model.pt"), size)
        return (None, "torn") if s == -1 else (s, "")
    if kind == "two":
        a, b = one(root / "model.pt", size), one(root / "optim.pt", size // 2)
        if -1 in (a, b):
            return None, "torn"
        if a is None or b is None:
            return None, "mixed" if (a, b) != (None, None) else ""
        return (a, "") if a == b else (None, "mixed")
    prefix, mark = ("checkpoint-", "trainer_state.json") if kind == "hf" else ("step-", ".metadata")
    folders = sorted((p for p in root.glob(prefix + "*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    if kind == "dcp":  # DCP/torchtitan load only folders holding .metadata
        folders = [p for p in folders if (p / mark).is_file()]
    if not folders:
        return None, ""
    newest = folders[-1]  # what HF's get_last_checkpoint / torchtitan would load
    n = int(newest.name.split("-")[1])
    if kind == "hf":
        files = {"model.safetensors": size, "optimizer.pt": size // 2, "rng_state.pth": 64}
        if not (newest / mark).is_file() or json.loads((newest / mark).read_text())["global_step"] != n:
            return None, "torn"
    else:
        files = {"__0_0.distcp": size, "__1_0.distcp": size, ".metadata": 64}
    got = {name: one(newest / name, want) for name, want in files.items()}
    return (n, "") if all(v == n for v in got.values()) else (None, "torn")


def upload_seconds(kind: str, size: int, url: str, work: Path) -> tuple[float, float]:
    """(a cold sync of one checkpoint of this shape, hashing included: the bound's upload term;
    a sync after one file of it changed, commit and clean-up included: a round's own work)."""
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore

    d = work / f"upload-{kind}"
    d.mkdir()
    shapes = {"atomic": {"ckpt.pt": size}, "inplace": {"model.pt": size}, "two": {"model.pt": size, "optim.pt": size // 2},
              "hf": {"c/model.safetensors": size, "c/optimizer.pt": size // 2, "c/rng_state.pth": 64, "c/trainer_state.json": 20},
              "dcp": {"s/__0_0.distcp": size, "s/__1_0.distcp": size, "s/.metadata": 64}}[kind]
    for rel, n in shapes.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(os.urandom(n))
    store = GcsCheckpointStore(f"{url}-{kind}", keep_commits=10000, gc_grace_s=86400)
    t = time.monotonic()
    store.sync(d, 0, work / f"upload-{kind}.json")
    cold = time.monotonic() - t
    first = sorted(shapes)[0]
    (d / first).write_bytes(os.urandom(shapes[first]))
    t = time.monotonic()
    store.sync(d, 0, work / f"upload-{kind}.json")
    return cold, time.monotonic() - t


def run_one(kind: str, with_log: bool, args, emu_url: str, work: Path) -> dict:
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
    from slurmagent.checkpoint.manifest import Manifest

    name = f"age-{kind}-{'log' if with_log else 'nolog'}"
    case = work / name
    case.mkdir()
    (case / "trainer.py").write_text(TRAINER)
    (case / "c.toml").write_text(f'state_dir = "{case}/state"\n[checkpoint]\nremote = "gs://ckpt/{name}"\n'
                                 f"settle_s = {args.settle}\nkeep_commits = 10000\ngc_grace_s = 86400\n")
    env = dict(os.environ, SLURMAGENT_CONFIG=str(case / "c.toml"), PYTHONPATH=str(REPO), CLOUD_RUN_JOB=name,
               CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_ATTEMPT="0", STORAGE_EMULATOR_HOST=emu_url)
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED"):
        env.pop(key, None)
    side = case / "saves"
    store = GcsCheckpointStore(f"gs://ckpt/{name}/{name}-task-0")
    rng = random.Random(f"{args.seed}-{name}")
    moments = sorted(rng.uniform(1.0, args.seconds) for _ in range(args.kills))
    with open(case / "wrapper.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(case / "vm"), "--sync-interval",
             str(args.sync), "--", sys.executable, str(case / "trainer.py"), kind, str(args.period),
             "log" if with_log else "nolog", str(side), str(args.seconds), str(args.size_kib * 1024),
             "1" if args.declare else "0"], env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=case)
        start = time.time()
        samples = []  # (moment, manifest text or None)
        for m in moments:
            time.sleep(max(0.0, start + m - time.time()))
            blob = store.objects.bucket.blob(store.objects.manifest_name)
            try:
                text = blob.download_as_bytes(timeout=10)
            except Exception:  # noqa: BLE001 (no commit yet)
                text = None
            samples.append((time.time(), text))
        proc.wait(timeout=args.seconds + 120)
    saved = {int(a): float(b) for a, b in (line.split() for line in side.read_text().splitlines())}
    ages, torn, mixed, none, checked = [], 0, 0, 0, {}
    samples = [(t, text) for t, text in samples if t > saved[0]]  # a kill before the trainer ran: nothing to lose
    for i, (t, text) in enumerate(samples):
        if text is None:
            ages.append(t - saved[0])
            none += 1
            continue
        if text not in checked:
            dest = case / f"restore-{i}"
            GcsCheckpointStore(store.url).restore_manifest(dest, Manifest.from_json(text))
            checked[text] = whole_step(kind, dest, args.size_kib * 1024)
        step, wrong = checked[text]
        torn += wrong == "torn"
        mixed += wrong == "mixed"
        if step is None:
            ages.append(t - saved[0])
            none += 1
        else:
            ages.append(t - saved[step])
    worst = max(range(len(ages)), key=ages.__getitem__)
    return {"worst_at_s": samples[worst][0] - saved[0], "writer": kind, "log": with_log, "saves": len(saved) - 1, "commits": len({s[1] for s in samples if s[1]}),
            "kills": len(samples), "no_whole": none, "age_p50": statistics.median(ages), "age_max": max(ages),
            "torn": torn, "mixed": mixed, "wrapper_rc": proc.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--period", type=float, default=1.0, help="save period (s)")
    ap.add_argument("--sync", type=float, default=0.5, help="the wrapper's --sync-interval (s)")
    ap.add_argument("--settle", type=float, default=0.25, help="[checkpoint] settle_s")
    ap.add_argument("--seconds", type=float, default=24.0, help="each run's length")
    ap.add_argument("--kills", type=int, default=20, help="hard-kill moments per run")
    ap.add_argument("--size-kib", type=int, default=256, help="model file size (KiB)")
    ap.add_argument("--only", nargs="*", choices=WRITERS, default=list(WRITERS))
    ap.add_argument("--declare", action="store_true", help="the trainer calls trainer.saved after each save")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from slurmagent.devtools.localgcs import GcsEmulator

    work = Path(tempfile.mkdtemp(prefix="commit-age-"))
    emu = GcsEmulator(data_dir=work / "gcs")
    emu.start()
    rows = []
    try:
        emu.create_bucket("ckpt")
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        for kind in args.only:
            upload, work_s = upload_seconds(kind, args.size_kib * 1024, "gs://ckpt/upload", work)
            bound = args.period + 2 * (args.sync + work_s) + upload
            for with_log in (False, True):
                row = run_one(kind, with_log, args, emu.url, work)
                row.update(upload_s=upload, round_work_s=work_s, bound_s=bound, within=row["age_max"] <= bound)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        emu.stop()
    print(f"commit age at {args.kills} hard kills per run; save period {args.period:g} s, sync {args.sync:g} s, "
          f"settle {args.settle:g} s, {args.seconds:g} s per run, model {args.size_kib} KiB"
          + (", trainer.saved after each save" if args.declare else ", no trainer.saved"))
    print(f"{'writer':8} {'log':4} {'saves':>5} {'commits':>7} {'no whole':>8} {'age p50':>8} {'age max':>8} "
          f"{'bound':>6} {'upload':>7} {'round':>6} {'torn':>4} {'mixed':>5}  ok")
    bad = 0
    for r in rows:
        ok = r["within"] and not r["torn"] and not r["mixed"] and r["wrapper_rc"] == 0
        bad += not ok
        print(f"{r['writer']:8} {'yes' if r['log'] else 'no':4} {r['saves']:5d} {r['commits']:7d} {r['no_whole']:8d} "
              f"{r['age_p50']:7.2f}s {r['age_max']:7.2f}s {r['bound_s']:5.2f}s {r['upload_s']:6.3f}s {r['round_work_s']:5.3f}s {r['torn']:4d} "
              f"{r['mixed']:5d}  {'yes' if ok else 'NO'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
