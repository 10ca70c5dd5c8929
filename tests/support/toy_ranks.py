"""A toy multi-rank trainer for the multi-node tests: one rank per node, node-local checkpoints.

argv: TOTAL_STEPS LEDGER_DIR STEP_SECONDS [every-N] [poison-rank-N] [bulk-N]
Rank r (SLURM_PROCID) writes `rank<r>.json` into SLURMAGENT_CKPT_DIR; rank 0 also writes the
index `.metadata` (DCP's name) naming every rank's step, after its own file. Every finished
step goes to LEDGER_DIR/rank<r>.log (outside the checkpoint), so a test can check that no step
is lost and none is done twice. At start a rank logs the files its node holds and their
SHA-256, so a test can compare what was restored with what was committed. With
`every-N` the periodic checkpoint is every N steps (default 5); with `poison-rank-N`, rank N's
checkpoint at the flush carries the marker `POISON-UPLOAD`; with `bulk-N` a fresh rank also
writes N small files once into `bulk/` (large node reports). A restarted run goes at 5 ms a
step, so a test can give the first run all the time it needs and still end soon.
"""

import hashlib
import json
import os
import sys
import time

from slurmagent import trainer

total, ledger_dir, step_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
every = next((int(a.split("-")[-1]) for a in sys.argv[4:] if a.startswith("every-")), 5)
poison = next((int(a.split("-")[-1]) for a in sys.argv[4:] if a.startswith("poison-rank-")), None)
bulk = next((int(a.split("-")[-1]) for a in sys.argv[4:] if a.startswith("bulk-")), 0)
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
node = os.environ.get("SLURMD_NODENAME", "?")


def log(line: str) -> None:
    with open(os.path.join(ledger_dir, f"rank{rank}.log"), "a") as fh:
        fh.write(line + "\n")


def save(step: int, final: bool = False) -> None:
    d = trainer.ckpt_dir()
    body = {"rank": rank, "step": step}
    if final and poison == rank:
        body["marker"] = "POISON-UPLOAD"
    trainer.atomic_write(d / f"rank{rank}.json", json.dumps(body))
    if rank == 0:
        trainer.atomic_write(d / ".metadata", json.dumps({"world": world, "step": step}))


if trainer.restart_count() > 0:
    step_s = min(step_s, 0.005)

with trainer.checkpoint_handler():
    d = trainer.ckpt_dir()
    held = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    digests = ",".join(f"{name}:{hashlib.sha256((d / name).read_bytes()).hexdigest()}" for name in held)
    step = json.loads((d / f"rank{rank}.json").read_text())["step"] if trainer.resumed() else 0
    if bulk and not trainer.resumed():
        (d / "bulk").mkdir(exist_ok=True)
        for k in range(bulk):
            (d / "bulk" / f"rank{rank}-{k:05d}.bin").write_bytes(os.urandom(32))
    log(f"start {step} node={node} resumed={int(trainer.resumed())} restart={trainer.restart_count()} "
        f"files={','.join(held)} sha256={digests}")
    while step < total:
        time.sleep(step_s)
        step += 1
        log(f"step {step}")
        if step % every == 0:
            save(step)
        if trainer.checkpoint_requested():
            save(step, final=True)
            log(f"ckpt {step}")
            sys.exit(0)
log("done")
