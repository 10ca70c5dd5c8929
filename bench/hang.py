#!/usr/bin/env python3
"""The hang watch's default rule on real 2-rank gloo jobs: how soon a hung job leaves, and that
no healthy silence is ever taken for a hang.

    python bench/hang.py [--minutes 2,5,10] [--gloo-timeout 600] [--parallel 8]
                         [--modes eval-all,eval-rank0,compile,save-nofile] [--no-hangs] [--no-matrix]

Every job is tests/support/toy_gloo_silent.py on this host (no Slurm: outside a job the wrapper
exits 143 where under Slurm it requeues): two ranks all-reduce every 50 ms and call
`trainer.progress`, then at step 30 go silent one way (its docstring), under `slurmagent run`
with the default rule (`hang_timeout_s = -1`: floor 120 s, ceiling 30 min, stack samples by
py-spy `--nonblocking`; without stacks the blind floor).

- Hangs: rank 1 stopped (SIGSTOP) and rank 1 asleep before the all-reduce rank 0 waits in, each
  timed from the moment it went silent (the rank's own stamp) to the wrapper's exit 143; beside
  the same asleep rank run bare, ended by gloo's own collective timeout (`--gloo-timeout`,
  PyTorch's NCCL default of 10 minutes; its gloo default is 30).
- False positives: each mode for each duration, with stacks and without (`[run]
  hang_stack_samples = false`): a job that ends 0 was left alone, 143 was killed (a false hang).

The jobs run side by side (`--parallel`), so the ranks' evaluations share the cores: a loaded
machine is the harder case for the samples. Needs torch and py-spy (the `hang` extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "tests" / "support" / "toy_gloo_silent.py"
AT, AFTER = 30, 20  # the silence's step, steps after it

# Two ranks of the toy, done when both are (a stopped or asleep rank 1 is killed when rank 0 failed).
LAUNCHER = r"""
import os, socket, subprocess, sys
toy, total, ledger, mode, at, secs = sys.argv[1:7]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_NTASKS="2")
ranks = [subprocess.Popen([sys.executable, toy, total, ledger, mode, at, secs], env=dict(env, SLURM_PROCID=str(r)))
         for r in range(2)]
code = ranks[0].wait()
try:
    other = ranks[1].wait(60 if code == 0 else 0.1)  # a healthy rank 1 ends beside rank 0
except subprocess.TimeoutExpired:
    ranks[1].kill()  # stopped or asleep, rank 0 failed without it
    other = 1
sys.exit(code or (1 if other < 0 else other))
"""


@dataclass
class Job:
    name: str
    mode: str
    seconds: float
    wrapped: bool = True
    stacks: bool = True


@dataclass
class Outcome:
    job: Job
    code: int
    stall_to_end_s: float | None
    said: str


def run_job(job: Job, tmp: Path, env: dict, gloo_timeout: float) -> Outcome:
    here = tmp / job.name
    (here / "ledger").mkdir(parents=True)
    config = here / "c.toml"
    config.write_text(f'state_dir = "{here}/state"\n[run]\nhang_stack_samples = {str(job.stacks).lower()}\n')
    launcher = [sys.executable, str(tmp / "launch.py"), str(TOY), str(AT + AFTER), str(here / "ledger"), job.mode,
                str(AT), str(job.seconds)]
    cmd = ([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(here / "ck"), "--", *launcher]
           if job.wrapped else launcher)
    job_env = dict(env, SLURMAGENT_CONFIG=str(config), TMPDIR=str(here))
    if not job.wrapped:
        job_env["TOY_GLOO_TIMEOUT_S"] = str(gloo_timeout)
    with open(here / "out", "w+") as out:
        code = subprocess.Popen(cmd, env=job_env, cwd=here, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True).wait(4 * 3600)
        ended = time.time()
        out.seek(0)
        text = out.read()
    stamps = [float(p.read_text()) for p in (here / "ledger").glob("rank*.silent")]
    lines = text.splitlines()
    said = next((x for x in lines if "hang: " in x), next((x for x in lines if "hang watch" in x), ""))
    subprocess.run(["pkill", "-KILL", "-f", str(here / "ledger")], check=False)  # a stopped rank left behind
    return Outcome(job, code, ended - min(stamps) if stamps else None, said)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", default="2,5,10", help="the silences' lengths, comma-separated")
    ap.add_argument("--modes", default="eval-all,eval-rank0,compile,save-nofile")
    ap.add_argument("--gloo-timeout", type=float, default=600.0)
    ap.add_argument("--parallel", type=int, default=8, help="jobs at once")
    ap.add_argument("--no-hangs", action="store_true", help="skip the hung jobs and the baseline")
    ap.add_argument("--no-matrix", action="store_true", help="skip the false-positive matrix")
    a = ap.parse_args()
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        sys.exit("bench/hang.py: py-spy is not installed (pip install -e '.[hang]')")
    tmp = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    (tmp / "launch.py").write_text(LAUNCHER)
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for key in [k for k in env if k.startswith("SLURM") or k.startswith("CLOUD_RUN")]:
        env.pop(key)
    jobs: list[Job] = []
    if not a.no_hangs:
        jobs += [Job("hang-stop", "stop", 0), Job("hang-asleep", "sleep-forever", 0),
                 Job("gloo-timeout-asleep", "sleep-forever", 0, wrapped=False)]
    if not a.no_matrix:
        for minutes in (float(m) for m in a.minutes.split(",")):
            for mode in a.modes.split(","):
                for stacks in (True, False):
                    jobs.append(Job(f"{mode}-{minutes:g}min-{'stacks' if stacks else 'blind'}", mode, minutes * 60,
                                    stacks=stacks))
    # the longest first (the baseline waits out gloo's timeout, a hang about 2.5 minutes): the whole
    # run is then about as long as its longest job
    jobs.sort(key=lambda j: -(a.gloo_timeout if not j.wrapped else 150 if j.mode in ("stop", "sleep-forever")
                              else j.seconds))
    started = time.monotonic()
    with ThreadPoolExecutor(a.parallel) as pool:
        outcomes = list(pool.map(lambda j: run_job(j, tmp, env, a.gloo_timeout), jobs))
    print(f"{len(jobs)} jobs, {a.parallel} at once, {time.monotonic() - started:.0f} s; {os.cpu_count()} cores; "
          f"work files in {tmp}")
    hangs = [o for o in outcomes if o.job.mode in ("stop", "sleep-forever")]
    if hangs:
        print(f"\n{'hung job':44}{'silent -> ended':>16}  exit")
        for o in hangs:
            how = "slurmagent, default rule" if o.job.wrapped else f"bare, gloo timeout {a.gloo_timeout:g} s"
            took = f"{o.stall_to_end_s:.1f} s" if o.stall_to_end_s is not None else "?"
            print(f"{o.job.mode + ' (' + how + ')':44}{took:>16}  {o.code}")
            if o.said:
                print(f"    wrapper said: {o.said[:300]}")
    matrix = [o for o in outcomes if o not in hangs]
    if matrix:
        killed = [o for o in matrix if o.code != 0]
        print(f"\n{'healthy silence':36}{'stacks':>10}{'blind':>10}   (ended 0 = left alone; else the exit)")
        for minutes in sorted({o.job.seconds for o in matrix}):
            for mode in a.modes.split(","):
                row = {o.job.stacks: o.code for o in matrix if o.job.mode == mode and o.job.seconds == minutes}
                cells = ["ok" if row.get(s) == 0 else f"exit {row.get(s)}" for s in (True, False)]
                print(f"{mode + ' ' + format(minutes / 60, 'g') + ' min':36}{cells[0]:>10}{cells[1]:>10}")
        print(f"\nfalse hangs: {len(killed)} of {len(matrix)} healthy jobs")
        for o in killed:
            print(f"  {o.job.name}: exit {o.code}: {o.said[:300]}")


if __name__ == "__main__":
    main()
