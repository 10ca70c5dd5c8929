"""A toy data-parallel trainer with a straggler, over torch.distributed (CPU gloo).

argv: TOTAL_STEPS LEDGER_DIR STEP_SECONDS SLOW_RANK [after]
Each step every rank "computes" (sleeps STEP_SECONDS, SLOW_RANK three times that), reports
`trainer.progress(step)` after its compute and before the step's all-reduce, then meets the
others in the all-reduce: every rank goes at the slow rank's pace (lockstep), and only when each
reaches the step tells the straggler. With `after`, `progress` comes after the all-reduce:
every rank reaches each step together, and nothing tells the straggler. Logs its start and end to LEDGER_DIR/rank<r>.log.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from slurmagent import trainer

total, ledger_dir, step_s, slow = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
after = sys.argv[5:] == ["after"]
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])


def log(line: str) -> None:
    with open(os.path.join(ledger_dir, f"rank{rank}.log"), "a") as fh:
        fh.write(line + "\n")


dist.init_process_group("gloo", rank=rank, world_size=world)
log(f"start 0 node={os.environ.get('SLURMD_NODENAME', '?')} at={time.time():.3f}")
for step in range(1, total + 1):
    time.sleep(step_s * (3 if rank == slow else 1))  # the compute
    if not after:
        trainer.progress(step)  # before the collective: the straggler reaches each step last
    dist.all_reduce(torch.ones(1))
    if after:
        trainer.progress(step)
log(f"done {total} at={time.time():.3f}")
dist.destroy_process_group()
