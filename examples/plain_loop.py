"""A plain training loop under `slurmagent run -- python examples/plain_loop.py [TOTAL [STEP_S]]`."""

import json
import sys
import time

from slurmagent import trainer

TOTAL = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
STEP_S = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1

# recipe: loop
with trainer.checkpoint_handler():  # SIGUSR1/SIGTERM only set a flag
    state_file = trainer.ckpt_dir() / "state.json"
    step = json.loads(state_file.read_text())["step"] if trainer.resumed() else 0
    print(f"starting at step {step} (restart {trainer.restart_count()})", flush=True)
    while step < TOTAL:
        time.sleep(STEP_S)  # one training step
        step += 1
        trainer.progress(step)  # the hang watch sees the job advance (rate-limited: every step)
        stop = trainer.any_rank(trainer.checkpoint_requested())  # every rank stops at the same step
        if step % 100 == 0 or stop:
            with trainer.phase("save"):  # a long save (or an evaluation) is a phase, not a hang
                trainer.atomic_write(state_file, json.dumps({"step": step}))
            trainer.saved(state_file, step=step)  # whole: the next sync round commits it
        if stop:
            print(f"checkpointed at step {step}, exiting for requeue", flush=True)
            sys.exit(0)
# recipe: end
print(f"done at step {step}", flush=True)
