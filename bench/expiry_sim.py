#!/usr/bin/env python3
"""GPU-hours lost to flex-start VM expiry: no agent vs periodic checkpoints vs slurmagent.

    python bench/expiry_sim.py [--trials 2000] [--seed 7] [--gpus 8]

A discrete-event model of one 8-GPU flex-start VM from boot to its hard termination at
`flex_start_max_duration` (1 h .. 7 d). Whole-node jobs come from an endless queue with a
realistic mix of time limits (1, 4, 12, 24, 72 h); a job's run time is 50-95 % of its limit;
each class has its own checkpoint write time (its state size over local-disk bandwidth).
What the VM's GPU-hours are lost to, per policy:

(a) no agent: the job running at the termination loses everything since it started
    (a job started near the end that cannot finish loses all of it), and pays a restart.
(b) periodic checkpoints every 30 min (synchronous save): the work since the last complete
    checkpoint, every save's GPU stall over the whole life, a restore and a restart.
(c) slurmagent: the expiry watch drains the node `drain_lead` (30 min) before the end (no
    new job starts: idle GPUs), the running job is flushed at `flush_lead` (120 s) and
    requeued: one checkpoint write, a restore and a restart elsewhere; no periodic saves.
(d) (c) + the prolog guard applied to every job (`prolog_guard = "requeue-all"`): the first
    job whose time limit does not fit before `termination - flush_lead` drains the node (the
    job runs elsewhere), so the node idles from then on, but never flushes a job.

A second table takes jobs that are NOT wrapped (they cannot flush): (a) again; (c') the drain
ahead, and at the flush `scontrol requeue` (`unwrapped_jobs = "requeue"`), which loses the
work since the job started; (d) the guard, which keeps such jobs off (the default
`prolog_guard = "requeue"` does this for unwrapped jobs only); (e) what a guard that skips a
misfit job but keeps the node for shorter ones would give (e.g. a Slurm maintenance
reservation from `termination - flush_lead`: backfill starts only jobs that end before it).

Lost = idle GPUs + work redone + checkpoint stalls + restore/restart time, in GPU-hours of
this VM (restore and restart happen on the next node but are caused here). Normal job
starts cost the same in every policy and are not counted. Same seeded job stream for every
policy (common random numbers), so the columns differ only by policy. Deterministic.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

H = 3600.0
DURATIONS_H = (1, 4, 12, 24, 72, 168)
# (time limit h, share of jobs, checkpoint write s): e.g. 8B..70B models + optimizer state
# over ~5-10 GB/s to local NVMe; the restore reads the same bytes back.
JOB_MIX = ((1, 0.30, 15.0), (4, 0.25, 30.0), (12, 0.20, 45.0), (24, 0.15, 60.0), (72, 0.10, 90.0))
RESTART_S = 60.0  # scheduling, container start, data-loader warm-up of a requeued job
PERIODIC_S = 30 * 60.0
DRAIN_LEAD_S = 1800.0
FLUSH_LEAD_S = 120.0


@dataclass(frozen=True)
class Job:
    limit_s: float
    run_s: float
    ckpt_s: float


def job_stream(rng: random.Random, n: int) -> list[Job]:
    limits = [c[0] for c in JOB_MIX]
    weights = [c[1] for c in JOB_MIX]
    ckpt = {c[0]: c[2] for c in JOB_MIX}
    out = []
    for _ in range(n):
        lim = rng.choices(limits, weights)[0]
        out.append(Job(lim * H, lim * H * rng.uniform(0.5, 0.95), ckpt[lim]))
    return out


@dataclass
class Loss:
    idle: float = 0.0
    work: float = 0.0
    stall: float = 0.0
    restart: float = 0.0
    flushed: int = 0

    @property
    def total(self) -> float:
        return self.idle + self.work + self.stall + self.restart


def periodic_wall(run_s: float, ckpt_s: float) -> float:
    """Wall time of a job that stalls ckpt_s every PERIODIC_S of work (no save at the very end)."""
    saves = max(0, int(run_s // PERIODIC_S) - (1 if run_s % PERIODIC_S == 0 else 0))
    return run_s + saves * ckpt_s


def simulate(life_s: float, jobs: list[Job], policy: str, drain_lead_s: float = DRAIN_LEAD_S,
             flush_lead_s: float = FLUSH_LEAD_S, wrapped: bool = True, window: int = 50) -> Loss:
    """policy: a | b | c | d (drain-guard) | e (backfill-guard); `wrapped`: the job can flush."""
    loss = Loss()
    t = 0.0
    agent = policy in ("c", "d", "e")
    drain_at = life_s - drain_lead_s if agent else life_s
    flush_at = life_s - flush_lead_s
    pending = list(jobs)
    while pending and t < life_s:
        if t >= drain_at:
            loss.idle += life_s - t
            break
        job = pending.pop(0)
        if policy in ("d", "e") and job.limit_s > flush_at - t:
            if policy == "d":
                loss.idle += life_s - t  # the guard drained the node: nothing starts here again
                break
            fits = [j for j in pending[:window] if j.limit_s <= flush_at - t]
            if not fits:
                loss.idle += life_s - t  # nothing in the queue fits the time left
                break
            pending.remove(fits[0])
            job = fits[0]
        if policy == "b":
            wall = periodic_wall(job.run_s, job.ckpt_s)
            if t + wall <= life_s:
                loss.stall += wall - job.run_s
                t += wall
                continue
            elapsed = life_s - t
            segment = PERIODIC_S + job.ckpt_s
            done = int(elapsed // segment)
            rest = elapsed - done * segment
            loss.stall += done * job.ckpt_s
            loss.work += rest  # since the last complete save (a save cut short counts too)
            loss.restart += (job.ckpt_s + RESTART_S) if done else RESTART_S
            break
        if t + job.run_s <= (flush_at if agent else life_s):
            t += job.run_s
            continue
        if policy == "a":
            loss.work += life_s - t
            loss.restart += RESTART_S
            break
        # the flush at the lead; an unwrapped job is requeued (its work since start is lost),
        # a checkpoint write longer than the lead cannot finish
        if wrapped and job.ckpt_s <= flush_lead_s:
            loss.stall += job.ckpt_s
            loss.restart += job.ckpt_s + RESTART_S
            loss.idle += flush_lead_s - job.ckpt_s
            loss.flushed += 1
        else:
            loss.work += flush_at - t
            loss.restart += RESTART_S
            loss.idle += flush_lead_s
        break
    return loss


def run(trials: int, seed: int, gpus: int) -> dict[tuple[int, str], list[Loss]]:
    results: dict[tuple[int, str], list[Loss]] = {}
    for dur in DURATIONS_H:
        rng = random.Random(f"{seed}/{dur}")
        for _ in range(trials):
            jobs = job_stream(rng, int(dur * 2) + 20)
            for policy in "abcd":
                results.setdefault((dur, policy), []).append(simulate(dur * H, jobs, policy))
            for policy in "acde":
                results.setdefault((dur, "u" + policy), []).append(simulate(dur * H, jobs, policy, wrapped=False))
    return results


def label(dur: int) -> str:
    return f"{dur} h" if dur < 24 else f"{dur // 24} d"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000, help="VM lifetimes simulated per duration")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    started = time.perf_counter()
    res = run(args.trials, args.seed, args.gpus)
    g = args.gpus / H

    print(f"GPU-hours lost per {args.gpus}-GPU flex-start VM (mean of {args.trials} lifetimes, seed {args.seed})")
    print("job mix: " + ", ".join(f"{lim} h x{share:.0%} (ckpt {c:.0f} s)" for lim, share, c in JOB_MIX)
          + f"; run time 50-95 % of the limit; restart {RESTART_S:.0f} s")
    print(f"(a) no agent  (b) periodic checkpoints every {PERIODIC_S / 60:.0f} min  "
          f"(c) slurmagent: drain {DRAIN_LEAD_S / 60:.0f} min + flush at {FLUSH_LEAD_S:.0f} s  "
          "(d) (c) + prolog guard on every job")
    head = f"{'flex duration':>13} {'VM GPU-h':>9} | {'(a) none':>15} {'(b) periodic':>15} {'(c) slurmagent':>15} " \
           f"{'(d) c+guard':>15} | {'c saves vs a':>12} {'vs b':>6}"
    print(head)
    print("-" * len(head))
    for dur in DURATIONS_H:
        cap = dur * args.gpus
        means = {p: statistics.fmean(x.total for x in res[(dur, p)]) * g for p in "abcd"}
        cells = " ".join(f"{means[p]:7.2f} ({means[p] / cap:5.1%})" for p in "abcd")
        print(f"{label(dur):>13} {cap:9.0f} | {cells} | {means['a'] - means['c']:9.2f} GPU-h"
              f" {means['b'] - means['c']:6.2f}")
    print()
    print("jobs NOT wrapped (cannot flush): (a) none  (c') drain ahead + requeue at the flush  "
          "(d) + guard (drains the node)  (e) guard that backfills shorter jobs")
    cols = ("(a) none", "(c') requeue", "(d) guard", "(e) backfill")
    head2 = f"{'flex duration':>13} {'VM GPU-h':>9} | " + " ".join(f"{col:>15}" for col in cols)
    print(head2)
    print("-" * len(head2))
    for dur in DURATIONS_H:
        cap = dur * args.gpus
        means = {p: statistics.fmean(x.total for x in res[(dur, "u" + p)]) * g for p in "acde"}
        print(f"{label(dur):>13} {cap:9.0f} | " + " ".join(f"{means[p]:7.2f} ({means[p] / cap:5.1%})" for p in "acde"))
    print()
    print("where (c) loses it, GPU-h per VM: idle after the drain / flush stall / restore+restart; share of VMs "
          "whose running job was flushed")
    for dur in DURATIONS_H:
        xs = res[(dur, "c")]
        print(f"{label(dur):>13}: idle {statistics.fmean(x.idle for x in xs) * g:6.2f}  "
              f"stall {statistics.fmean(x.stall for x in xs) * g:5.2f}  "
              f"restart {statistics.fmean(x.restart for x in xs) * g:5.2f}  "
              f"flushed {statistics.fmean(x.flushed for x in xs):5.1%}")
    print()
    print("(c) by drain lead (GPU-h lost per VM): the drain lead trades idle GPUs for jobs not started "
          "just before the flush")
    leads = (0.0, 300.0, 900.0, 1800.0, 3600.0)
    print(f"{'flex duration':>13} | " + " ".join(f"{f'{lead / 60:.0f} min':>8}" for lead in leads))
    for dur in DURATIONS_H:
        rng = random.Random(f"{args.seed}/{dur}")
        row = []
        streams = [job_stream(rng, int(dur * 2) + 20) for _ in range(min(args.trials, 1000))]
        for lead in leads:
            lead_eff = max(lead, FLUSH_LEAD_S)
            row.append(statistics.fmean(simulate(dur * H, js, "c", drain_lead_s=lead_eff).total for js in streams) * g)
        print(f"{label(dur):>13} | " + " ".join(f"{v:8.2f}" for v in row))
    print(f"\n{sum(len(v) for v in res.values())} VM lifetimes simulated in {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
