"""A plain training loop under `slurmagent run -- python examples/plain_loop.py`."""

import json
import sys
import time

from slurmagent import trainer

TOTAL = 1000

with trainer.checkpoint_handler():
    state_file = trainer.ckpt_dir() / "state.json"
    step = json.loads(state_file.read_text())["step"] if trainer.resumed() else 0
    print(f"starting at step {step} (restart {trainer.restart_count()})", flush=True)
    while step < TOTAL:
        time.sleep(0.1)  # one training step
        step += 1
        if step % 100 == 0 or trainer.checkpoint_requested():
            trainer.atomic_write(state_file, json.dumps({"step": step}))
        if trainer.checkpoint_requested():
            print(f"checkpointed at step {step}, exiting for requeue", flush=True)
            sys.exit(0)
print("done", flush=True)
