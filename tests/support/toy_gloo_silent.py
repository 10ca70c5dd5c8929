"""A toy 2-rank trainer over CPU gloo that goes silent at one step, the healthy ways and the hung one.

argv: TOTAL_STEPS LEDGER_DIR MODE AT SECONDS
Steps every 50 ms in lockstep (an all-reduce each), `trainer.progress` each step. At step AT,
in the first attempt, for SECONDS, without a progress call:

- `eval-all`: every rank evaluates (a CPU-busy loop through its own code);
- `eval-rank0`: rank 0 evaluates, rank 1 waits for it at a barrier;
- `eval-phase`: every rank sleeps in a blocking call inside `trainer.phase("eval")`;
- `save-nofile`: rank 0 serialises a model to memory (busy, writes no file), rank 1 at a barrier;
- `compile`: every rank compiles fresh functions with `torch.compile` (dynamo and AOT autograd,
  backend `aot_eager`: no C++ compiler needed), one after the other, as a recompilation does;
- `sleep-forever`: rank 1 sleeps (forever: SECONDS is ignored) before the all-reduce rank 0 waits in;
- `stop`: rank 1 stops itself (SIGSTOP; SECONDS is ignored) before that all-reduce.

Logs `start`/`step N`/`done` to LEDGER_DIR/rank<r>.log, its pid to rank<r>.pid and the wall time
its silence began to rank<r>.silent; every 20 steps (TOY_SAVE_EVERY) `rank<r>.json` into the checkpoint; a resumed
run starts from the lowest step held. TOY_GLOO_TIMEOUT_S: gloo's collective timeout (torch's
default otherwise: 30 minutes), for the bench's baseline (bench/hang.py).
"""

import datetime
import io
import json
import os
import pickle
import signal
import sys
import time

import torch
import torch.distributed as dist

from slurmagent import trainer

total, ledger_dir, mode, at, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
save_every = int(os.environ.get("TOY_SAVE_EVERY", "20"))


def log(line: str) -> None:
    with open(os.path.join(ledger_dir, f"rank{rank}.log"), "a") as fh:
        fh.write(line + "\n")


# an evaluation: many small steps through distinct functions, as a model's forward goes
def f0(x): return sum(i * x for i in range(3000))
def f1(x): return sum(i ^ x for i in range(3000))
def f2(x): return max(i + x for i in range(3000))
def f3(x): return min(i - x for i in range(3000))
def f4(x): return sum(i % 7 for i in range(3000)) + x
def f5(x): return len([i for i in range(3000) if i & x])
def f6(x): return sum(divmod(i, 3)[1] for i in range(3000))
def f7(x): return sum(abs(i - x) for i in range(3000))
def f8(x): return sum(i * i for i in range(3000)) % (x + 2)
def f9(x): return sum(1 for i in range(3000) if i > x)
LAYERS = [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9]


def evaluate(secs: float) -> None:
    end, x = time.monotonic() + secs, 1
    while time.monotonic() < end:
        for layer in LAYERS:
            x = layer(x) % 1000 + 1


def save_to_memory(secs: float) -> None:
    end = time.monotonic() + secs
    while time.monotonic() < end:
        buf = io.BytesIO()
        pickle.dump([list(range(2000)) for _ in range(50)], buf)
        for layer in LAYERS[:5]:
            layer(len(buf.getvalue()) % 100)


def compile_for(secs: float) -> None:
    import torch._dynamo  # only this mode pays for it
    end, i = time.monotonic() + secs, 0
    while time.monotonic() < end:
        torch._dynamo.reset()  # a recompilation: every function traced and lowered again
        fn = torch.compile(lambda x, k=i: ((x * k + 1).relu() @ x.T).softmax(-1).sum(), backend="aot_eager")
        fn(torch.randn(16, 16, requires_grad=True)).backward()
        i += 1


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


with open(os.path.join(ledger_dir, f"rank{rank}.pid"), "w") as fh:
    fh.write(str(os.getpid()))
timeout = os.environ.get("TOY_GLOO_TIMEOUT_S")
dist.init_process_group("gloo", rank=rank, world_size=world,
                        **({"timeout": datetime.timedelta(seconds=float(timeout))} if timeout else {}))
first = trainer.restart_count() == 0
with trainer.checkpoint_handler():
    d = trainer.ckpt_dir()
    held = [json.loads(p.read_text())["step"] for p in d.glob("rank*.json")] if trainer.resumed() else []
    step = min(held, default=0)
    log(f"start {step} node={os.environ.get('SLURMD_NODENAME', '?')} restart={trainer.restart_count()}")
    while step < total:
        time.sleep(0.05)
        if first and step == at:
            log(f"silent {mode}")
            with open(os.path.join(ledger_dir, f"rank{rank}.silent"), "w") as fh:
                fh.write(f"{time.time()}\n")
            if mode == "eval-all":
                evaluate(seconds)
            elif mode == "eval-rank0":
                evaluate(seconds) if rank == 0 else dist.barrier()
            elif mode == "eval-phase":
                with trainer.phase("eval"):
                    time.sleep(seconds)
            elif mode == "save-nofile":
                save_to_memory(seconds) if rank == 0 else dist.barrier()
            elif mode == "compile":
                compile_for(seconds)
            elif mode == "sleep-forever" and rank == 1:
                sleep_forever()
            elif mode == "stop" and rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode in ("eval-rank0", "save-nofile") and rank == 0:
                dist.barrier()
            log("talking again")
        t = torch.ones(1)
        dist.all_reduce(t)
        step += 1
        log(f"step {step}")
        trainer.progress(step)
        if step % save_every == 0:
            trainer.atomic_write(d / f"rank{rank}.json", json.dumps({"rank": rank, "step": step}))
            trainer.saved(d / f"rank{rank}.json", step=step)
        if trainer.any_rank(trainer.checkpoint_requested()):
            sys.exit(0)
log("done")
dist.destroy_process_group()
