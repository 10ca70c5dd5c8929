"""A toy trainer for the wrapper tests: counts steps, checkpoints on the signal.

argv: TOTAL_STEPS LEDGER STEP_SECONDS [ignore|progress] [bigfile_mib]
Every finished step is appended to LEDGER (outside the checkpoint dir), so a test can
check that no step is lost after the last checkpoint and none is done twice. `progress`:
`trainer.progress(step)` every step, and the process id in LEDGER.pid (a test stops it).
"""

import json
import os
import signal
import socket
import sys
import time

from slurmagent import trainer

total, ledger, step_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
ignore = "ignore" in sys.argv[4:]
report = "progress" in sys.argv[4:]
big_mib = int(sys.argv[5]) if len(sys.argv) > 5 else 0


def log(line: str) -> None:
    with open(ledger, "a") as fh:
        fh.write(line + "\n")


def save(step: int) -> None:
    d = trainer.ckpt_dir()
    if big_mib:  # a large shard whose content names the step, written before the state
        trainer.atomic_write(d / "shard.bin", (f"{step:08d}".encode() * 128 * 1024) * big_mib)
    trainer.atomic_write(d / "state.json", json.dumps({"step": step}))


with trainer.checkpoint_handler():
    if ignore:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state = trainer.ckpt_dir() / "state.json"
    step = json.loads(state.read_text())["step"] if trainer.resumed() else 0
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    log(f"start {step} node={node} resumed={int(trainer.resumed())} restart={trainer.restart_count()}")
    if report:
        with open(ledger + ".pid", "w") as fh:
            fh.write(f"{os.getpid()}\n")
    while step < total:
        time.sleep(step_s)
        step += 1
        if report:
            trainer.progress(step)
        log(f"step {step}")
        if step % 5 == 0:
            save(step)
        if trainer.checkpoint_requested():
            save(step)
            log(f"ckpt {step}")
            sys.exit(0)
log("done")
