#!/usr/bin/env python3
"""A hung 2-rank job: stall -> job ended, slurmagent's hang watch beside gloo's own timeout.

    python bench/hang.py [--gloo-timeout 120] [--hang-timeout 15]

The same job twice on this host (no Slurm: outside a job the wrapper exits 143 where under
Slurm it requeues): two torch.distributed ranks (gloo, CPU) all-reduce every 0.1 s and call
`trainer.progress`; at step 30 rank 1 stops itself (SIGSTOP), so rank 0 blocks in its next
all-reduce. (a) bare: the time from the stop until gloo's timeout (`--gloo-timeout`, set to a
few minutes so the baseline is measured, not assumed; PyTorch's default is 30 min) fails
rank 0. (b) under `slurmagent run --hang-timeout N`: the time from the stop until the wrapper
has collected the evidence, stopped both ranks and exited 143 (the requeue under Slurm). The
stop time is the one rank 1 writes just before it stops. Needs torch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

JOB = r"""
import datetime, os, signal, socket, subprocess, sys, time
stamp, timeout = sys.argv[1], float(sys.argv[2])
if len(sys.argv) == 3:  # the launcher: two ranks, done when rank 0 is done (rank 1 may stay stopped)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, "-c", CODE, stamp, str(timeout), str(r)], env=dict(env, RANK=str(r)))
             for r in range(2)]
    code = ranks[0].wait()
    ranks[1].kill()
    print(f"rank 0 ended: exit {code}", flush=True)
    sys.exit(code)
import torch, torch.distributed as dist
from slurmagent import trainer
rank = int(sys.argv[3])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
t = torch.ones(1)
for step in range(10_000):
    dist.all_reduce(t)
    trainer.progress(step)
    if rank == 1 and step == 30:
        with open(stamp, "w") as fh:
            fh.write(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.1)
"""


def run(cmd: list[str], stamp: Path, env: dict, cwd: Path) -> tuple[float, int, str]:
    """Until the command itself exits (into a file: a rank it left behind keeps no pipe open)."""
    with open(cwd / f"{stamp.name}.out", "w+") as out:
        code = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).wait(3600)
        ended = time.time()
        out.seek(0)
        return ended - float(stamp.read_text()), code, out.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gloo-timeout", type=float, default=120.0)
    ap.add_argument("--hang-timeout", type=float, default=15.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    script = tmp / "job.py"
    script.write_text(f"CODE = {JOB!r}\n" + JOB)
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp / "none.toml"))
    for key in ("SLURM_JOB_ID", "SLURMAGENT_PROGRESS_DIR"):
        env.pop(key, None)
    (tmp / "none.toml").write_text(f'state_dir = "{tmp}/state"\n')
    job = [sys.executable, str(script)]
    bare_s, bare_code, _ = run([*job, str(tmp / "stop-a"), str(a.gloo_timeout)], tmp / "stop-a", env, tmp)
    wrapped = [sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp / "ck"), "--hang-timeout",
               str(a.hang_timeout), "--", *job, str(tmp / "stop-b"), str(a.gloo_timeout)]
    ours_s, ours_code, out = run(wrapped, tmp / "stop-b", dict(env, TMPDIR=str(tmp)), tmp)
    line = next((x for x in out.splitlines() if "hang: no progress" in x), "(no hang line)")
    print(f"{'':34}{'stall -> job ended':>20}  exit")
    print(f"{'gloo timeout ' + format(a.gloo_timeout, 'g') + ' s (bare)':34}{bare_s:>18.1f} s  {bare_code}")
    print(f"{'slurmagent --hang-timeout ' + format(a.hang_timeout, 'g') + ' s':34}{ours_s:>18.1f} s  {ours_code}")
    print(f"wrapper said: {line[:400]}")
    left = subprocess.run(["pgrep", "-f", str(tmp / "stop-")], capture_output=True, text=True).stdout.split()
    print(f"ranks left behind: {len(left)}")


if __name__ == "__main__":
    main()
