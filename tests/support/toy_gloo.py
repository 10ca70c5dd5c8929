"""A toy 2-rank trainer in lockstep over torch.distributed (CPU gloo), for the multi-node hang tests.

argv: TOTAL_STEPS LEDGER_DIR STEP_SECONDS [every-N]
Every step ends in an all-reduce, so when one rank stops the others block in the next one (a
hung collective). Each rank reports `trainer.progress(step)`, logs every finished step to
LEDGER_DIR/rank<r>.log (outside the checkpoint) and writes its pid to LEDGER_DIR/rank<r>.pid;
every N steps (default 50) it writes `rank<r>.json` into SLURMAGENT_CKPT_DIR (rank 0 also
`.metadata`). A resumed run starts from the lowest step among the rank files it holds (the
restore puts every node's files on every node), and goes at 5 ms a step.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from slurmagent import trainer

total, ledger_dir, step_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
every = next((int(a.split("-")[-1]) for a in sys.argv[4:] if a.startswith("every-")), 50)
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
node = os.environ.get("SLURMD_NODENAME", "?")


def log(line: str) -> None:
    with open(os.path.join(ledger_dir, f"rank{rank}.log"), "a") as fh:
        fh.write(line + "\n")


def save(step: int) -> None:
    d = trainer.ckpt_dir()
    trainer.atomic_write(d / f"rank{rank}.json", json.dumps({"rank": rank, "step": step}))
    if rank == 0:
        trainer.atomic_write(d / ".metadata", json.dumps({"world": world, "step": step}))


if trainer.restart_count() > 0:
    step_s = min(step_s, 0.005)
with open(os.path.join(ledger_dir, f"rank{rank}.pid"), "w") as fh:
    fh.write(str(os.getpid()))
dist.init_process_group("gloo", rank=rank, world_size=world)
with trainer.checkpoint_handler():
    d = trainer.ckpt_dir()
    held = [json.loads(p.read_text())["step"] for p in d.glob("rank*.json")] if trainer.resumed() else []
    step = min(held, default=0)
    log(f"start {step} node={node} resumed={int(trainer.resumed())} restart={trainer.restart_count()}")
    while step < total:
        time.sleep(step_s)
        t = torch.ones(1)
        dist.all_reduce(t)  # lockstep: a stopped rank blocks the others here
        step += 1
        log(f"step {step}")
        trainer.progress(step)
        if step % every == 0:
            save(step)
        if trainer.any_rank(trainer.checkpoint_requested()):
            save(step)
            sys.exit(0)
log("done")
dist.destroy_process_group()
