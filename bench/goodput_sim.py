#!/usr/bin/env python3
"""Work saved, measured: ETTR of a 16k-GPU fleet's multi-node jobs over a simulated month,
with slurmagent and without any agent, under the interruption mix of the Llama 3 report.

    python bench/goodput_sim.py [--days 30] [--seed 7] [--out DIR] [--inputs FILE]   (as root)

1. Measure (same run, local cluster): slurmagent's reactions to a GPU fault under a wrapped
   job. A LocalSlurmCluster (n1..n3), a Cloud Storage emulator and `slurmagent watch` on n1;
   a wrapped toy trainer (tests/support/toy_trainer.py) lands on n1, an XID 79 line goes into
   n1's kernel log; timed: XID -> n1 DRAIN (detect + drain), and from the job's own ledger
   records (run/ledger.py): the flush, XID -> the wrapper done, PENDING until the next
   attempt started, its restore and its startup (restore -> first progress). Then a hang on
   n2 and n3 (tests/support/toy_gloo_silent.py, `sleep-forever`, under the default rule):
   silence -> the wrapper done, and PENDING until the next attempt. `--inputs FILE`
   reuses a JSON of such figures instead (what this script prints as "inputs").
2. Simulate (deterministic, seeded): 16,384 GPUs in multi-node jobs (1 x 8192, 4 x 1024,
   16 x 128, 64 x 32 GPUs), each training for the whole month. Interruptions per job are
   Poisson at GPUs / 16,384 per 3 h (Llama 3: 419 unexpected interruptions in 54 days on 16k
   GPUs), by cause: GPU 58.7 %, host 14.6 % (half of it planned maintenance with notice),
   software 14.4 %, network 12.3 %. Both policies see the same faults at the same running
   times (common random numbers), restart from the same 30-minute periodic checkpoint, and
   pay the same measured restore and startup, so they differ only by the reactions:

   cause        no agent                                        slurmagent
   GPU          hangs until the framework's timeout (30 min),   watch: detect + drain (measured), the fault flush
                then a person requeues it (15..105 min, mean    (measured; assumed to fail: a dead GPU hangs the
                1 h)                                            collective, so the work since the last commit is lost)
                                                                and the wrapper's requeue: PENDING (measured)
   maintenance  the VM stops under the job: Slurm requeues it   the flush at the notice commits everything;
                after SlurmdTimeout (300 s), work since the     requeue (measured PENDING)
                last commit lost
   host (other) as maintenance without an agent                  the same (no notice: nothing to flush)
   network      hangs until the timeout (30 min), crash, a      the hang watch's default rule sees every rank
                person requeues it                              still (measured: a 2-node gloo job whose rank 1
                                                                sleeps before the all-reduce rank 0 waits in,
                                                                silence -> the wrapper done), then its requeue
                                                                (measured PENDING); work since the commit lost
   software     crashes at once, a person requeues it           the same

Output: per policy a `slurmagent report --json`-shaped document (core/goodput.build_report
over one ledger record per simulated attempt) and its page (core/goodput_html.py) under
--out, and ETTR for both. The measured PENDING includes this cluster's `cred_expire` (5 s: a
requeued job waits 6 s before it may start again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

H = 3600.0
FLEET_GPUS = 16384
MTBI_FLEET_S = 3 * H  # one interruption per 3 h per 16k GPUs
JOBS = ((8192, 1), (1024, 4), (128, 16), (32, 64))  # (GPUs per job, jobs)
CAUSES = (("gpu", 0.587), ("host-maintenance", 0.073), ("host", 0.073), ("software", 0.144), ("network", 0.123))
PERIODIC_S = 30 * 60.0  # the trainer's own checkpoint period, both policies
FRAMEWORK_TIMEOUT_S = 30 * 60.0  # NCCL watchdog / collective timeout
MANUAL_REQUEUE_S = (0.25 * H, 1.75 * H)  # a person notices and requeues: uniform, mean 1 h
T0 = 1793491200.0  # 2026-11-01T00:00:00Z: the simulated month's start
SLURMD_TIMEOUT_S = 300.0  # Slurm's default: a dead node's jobs are requeued after this
XID_LINE = "[ 8123.456789] NVRM: Xid (PCI:0000:48:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


# --- 1. measure ------------------------------------------------------------------------------


def wait(pred, timeout: float, what: str, interval: float = 0.05):
    from support import wait_for  # the tests' poll, finer-grained here

    return wait_for(pred, timeout, what, interval)


def measure() -> dict[str, float]:
    """One GPU fault under a wrapped job on the local cluster: slurmagent's reaction times."""
    from support import cluster_config_text, healthy_snapshot_dict, write_json
    from slurmagent.checkpoint.gcs.ledger import LedgerBucket
    from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available
    from slurmagent.devtools.localgcs import GcsEmulator

    why = slurm_available()
    if why:
        raise SystemExit(f"goodput_sim: cannot start a local Slurm cluster: {why} (or pass --inputs FILE)")
    base = Path(tempfile.mkdtemp(prefix="goodput-sim-"))
    for d in ("kern", "snap", "state"):
        (base / d).mkdir()
    for n in ("n1", "n2", "n3"):
        (base / "kern" / f"{n}.log").touch()
        write_json(base / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
    config = base / "c.toml"
    config.write_text(cluster_config_text(base) + '[checkpoint]\nremote = "gs://ckpt/sim"\n'
                      'sync_interval_s = 1.0\ngrace_s = 300.0\n[expiry]\npublish_run_file = false\n')
    cluster = LocalSlurmCluster(base / "slurm", nodes=["n1", "n2", "n3"])
    emu = GcsEmulator(data_dir=base / "gcs")
    watcher = None
    try:
        cluster.start()
        emu.start()
        emu.create_bucket("ckpt")
        env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
        env.pop("SLURMD_NODENAME", None)
        watcher = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "watch", "--node", "n1", "--no-nvml"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        steps = base / "steps"
        cluster.run(["scontrol", "update", "nodename=n2,n3", "state=drain", "reason=bench: hold"])
        sub = subprocess.run(
            [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(base / "out"), "--",
             "--ckpt-dir", str(base / "ckpt-%n"), "--", sys.executable, str(REPO / "tests/support/toy_trainer.py"),
             "300", str(steps), "0.05"], env=env, capture_output=True, text=True, timeout=60)
        if sub.returncode != 0:
            raise RuntimeError(f"sbatch failed: {sub.stderr.strip()}")
        job = sub.stdout.strip().split(";")[0]
        wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 60, "the job to start")
        cluster.resume("n2", "n3")
        wait(lambda: steps.exists() and steps.read_text().count("step ") >= 20, 60, "20 steps")
        t_xid = time.time()
        with (base / "kern" / "n1.log").open("a") as fh:
            fh.write(XID_LINE)
        wait(lambda: "DRAIN" in cluster.node("n1").get("State", ""), 60, "n1 drained", interval=0.01)
        t_drain = time.time()
        wait(lambda: cluster.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 240, "the job's end", 0.5)
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url  # this process reads the ledger from the emulator too
        records, errors = LedgerBucket(f"gs://ckpt/sim/{job}").read_all(deadline_s=60)
        by = {r["attempt"]: r for r in records}
        if sorted(by) != [0, 1] or by[0].get("end") != "gpu-fault":
            raise RuntimeError(f"unexpected ledger {records} {errors}: {(base / 'out').read_text()[-2000:]}")
        first, second = by[0], by[1]
        return {"detect_drain_s": round(t_drain - t_xid, 3), "flush_s": round(float(first["flush_s"]), 3),
                "fault_to_wrapper_done_s": round(float(first["ended"]) - t_xid, 3),
                "pending_s": round(float(second["started"]) - float(first["ended"]), 3),
                "restore_s": round(float(second["restore_s"]), 3),
                "startup_s": round(float(second["first_progress"]) - float(second["started"])
                                   - float(second["restore_s"]), 3),
                **measure_hang(cluster, base, env)}
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait(15)
        cluster.stop()
        emu.stop()
        shutil.rmtree(base, ignore_errors=True)


def measure_hang(cluster, base: Path, env: dict) -> dict[str, float]:
    """A 2-node gloo job on n2 and n3 whose rank 1 sleeps before the all-reduce rank 0 waits in,
    under the default rule (a 120 s short limit, stack samples): silence -> the wrapper done,
    and PENDING until the next attempt started (a network fault hangs every rank the same way)."""
    from slurmagent.checkpoint.gcs.ledger import LedgerBucket
    from slurmagent.devtools.localcluster import free_ports

    ranks = base / "ranks"
    ranks.mkdir()
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-w", "n2,n3",
         "-o", str(base / "hang.out"), "--", "--ckpt-dir", str(base / "hang-ckpt"), "--", "srun",
         sys.executable, str(REPO / "tests/support/toy_gloo_silent.py"), "60", str(ranks), "sleep-forever", "30", "0"],
        env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), TMPDIR=str(base)),
        capture_output=True, text=True, timeout=60)
    if sub.returncode != 0:
        raise RuntimeError(f"sbatch failed: {sub.stderr.strip()}")
    job = sub.stdout.strip().split(";")[0]
    def next_attempt() -> bool:
        j = cluster.job(job)
        if int(j.get("Restarts", 0)) >= 1 and j.get("JobState") in ("RUNNING", "COMPLETED"):
            return True  # the next attempt started (and may have finished its few steps already)
        if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            raise RuntimeError(f"the hung job ended {j.get('JobState')}: {(base / 'hang.out').read_text()[-2000:]}")
        return int(j.get("Restarts", 0)) >= 1 and j.get("JobState") == "RUNNING"

    wait(next_attempt, 900, "the hung job's next attempt", 0.5)
    silent = min(float(p.read_text()) for p in ranks.glob("rank*.silent"))
    wait(lambda: len(LedgerBucket(f"gs://ckpt/sim/{job}").read_all(deadline_s=30)[0]) >= 2, 60, "its ledger", 0.5)
    records, _ = LedgerBucket(f"gs://ckpt/sim/{job}").read_all(deadline_s=60)
    by = {r["attempt"]: r for r in records}
    cluster.run(["scancel", job])
    if by.get(0, {}).get("end") != "hang":
        raise RuntimeError(f"the hung job did not end as a hang: {records}: {(base / 'hang.out').read_text()[-2000:]}")
    return {"hang_to_wrapper_done_s": round(float(by[0]["ended"]) - silent, 3),
            "hang_pending_s": round(float(by[1]["started"]) - float(by[0]["ended"]), 3)}


# --- 2. simulate -----------------------------------------------------------------------------


def fault_stream(rng: random.Random, gpus: int, horizon_s: float) -> list[tuple[float, str, float]]:
    """(running seconds before the fault, cause, manual-requeue delay) until past the horizon:
    the same list drives both policies."""
    rate = gpus / FLEET_GPUS / MTBI_FLEET_S
    causes, weights = [c for c, _ in CAUSES], [w for _, w in CAUSES]
    out, total = [], 0.0
    while total < horizon_s:
        run = rng.expovariate(rate)
        out.append((run, rng.choices(causes, weights)[0], rng.uniform(*MANUAL_REQUEUE_S)))
        total += run
    return out


def reaction(policy: str, cause: str, manual_s: float, m: dict[str, float]) -> tuple[float, float, bool, float, str]:
    """(seconds from the fault to the attempt's end, flush seconds in it, committed at the end,
    PENDING seconds until the next attempt, why)."""
    if cause == "software":
        return 0.0, 0.0, False, manual_s, "the trainer crashed (software); requeued by a person"
    if cause == "network" and (policy == "no-agent" or "hang_to_wrapper_done_s" not in m):
        return FRAMEWORK_TIMEOUT_S, 0.0, False, manual_s, "network: hung until the framework's timeout; requeued by a person"
    if cause == "network":
        return (m["hang_to_wrapper_done_s"], 0.0, False, m["hang_pending_s"],
                "network: hung; slurmagent's hang watch saw every rank still and requeued the job")
    if cause == "host" or (cause == "host-maintenance" and policy == "no-agent"):
        return 0.0, 0.0, False, SLURMD_TIMEOUT_S, f"{cause}: the VM went away; Slurm requeued after SlurmdTimeout"
    if cause == "host-maintenance":
        return m["flush_s"], m["flush_s"], True, m["pending_s"], "maintenance notice: flushed and requeued by slurmagent"
    if policy == "no-agent":
        return FRAMEWORK_TIMEOUT_S, 0.0, False, manual_s, "GPU fault: hung until the framework's timeout; requeued by a person"
    end = max(m["fault_to_wrapper_done_s"], m["detect_drain_s"] + m["flush_s"])  # XID -> the wrapper done
    return end, m["flush_s"], False, m["pending_s"], "GPU fault: watch drained the node, the wrapper requeued the job"


def shifted(records: list[dict], t0: float) -> list[dict]:
    """Times from the month's start to epoch seconds (the page shows dates)."""
    for r in records:
        for k in ("started", "first_progress", "last_commit", "ended"):
            if r.get(k) is not None:
                r[k] += t0
    return records


def simulate_job(policy: str, job: str, gpus: int, faults, m: dict[str, float], horizon_s: float) -> list[dict]:
    """One job's ledger records over the horizon (t=0 at the month's start)."""
    records, t, attempt = [], 0.0, 0
    restore, startup = m["restore_s"], m["startup_s"]
    for run_s, cause, manual_s in faults:
        started = t
        progress_from = started + restore + startup
        fault_at = progress_from + run_s
        base = {"schema": 1, "job": job, "attempt": attempt, "started": started, "restore_s": restore,
                "first_progress": progress_from, "gpus": gpus, "node_count": gpus // 8, "nodes": f"{gpus // 8} nodes",
                "state": "ended", "prefix": policy}
        if fault_at >= horizon_s:
            records.append({**base, "ended": horizon_s, "last_commit": horizon_s, "flush_s": 0.0, "end": "completed",
                            "why": "the month ended"})
            return records
        to_end, flush_s, committed, pending_s, why = reaction(policy, cause, manual_s, m)
        periodic = progress_from + math.floor(run_s / PERIODIC_S) * PERIODIC_S if run_s >= PERIODIC_S else None
        ended = fault_at + to_end
        last_commit = fault_at if committed else periodic
        end = {"gpu": "gpu-fault", "host-maintenance": "maintenance"}.get(cause, "lost" if cause == "host" else "failed"
                                                                          if cause == "software" else "hang")
        records.append({**base, "ended": ended, "last_commit": last_commit, "flush_s": flush_s, "end": end,
                        "why": why, "requeued": True, "cause": cause})
        t = ended + pending_s
        attempt += 1
        if t >= horizon_s:
            return records
        if not committed and periodic is None:
            pass  # no commit in this attempt: the next restores the one before (the ledger counts none as progress)
    return records


def interruptible(report: dict) -> dict:
    """build_report counts `failed`/`lost` ends as no interruption: here each is one (its cause says which)."""
    for j in report["jobs"]:
        for a in j["attempts"]:
            a["interruption"] = a["end"] != "completed"
        j["interruptions"] = [{"attempt": a["attempt"], "at": a["until"], "cause": a["end"], "why": a["why"]}
                              for a in j["attempts"] if a["interruption"]]
    report["totals"]["interruptions"] = sum(len(j["interruptions"]) for j in report["jobs"])
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "slurmagent-goodput-sim"))
    ap.add_argument("--inputs", help="a JSON of measured reaction times instead of measuring now")
    args = ap.parse_args()
    from slurmagent.core.goodput import build_report, pct
    from slurmagent.core.goodput_html import render_html

    if args.inputs:
        m = json.loads(Path(args.inputs).read_text())
        print(f"inputs (from {args.inputs}): {json.dumps(m)}")
    else:
        t0 = time.monotonic()
        m = measure()
        print(f"inputs (measured on the local cluster in {time.monotonic() - t0:.0f} s): {json.dumps(m)}")
    horizon = args.days * 86400
    rng = random.Random(args.seed)
    streams = [(f"{g}gpu-{i + 1}", g, fault_stream(rng, g, horizon)) for g, n in JOBS for i in range(n)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in ("no-agent", "slurmagent"):
        records = [r for job, g, faults in streams for r in shifted(simulate_job(policy, job, g, faults, m, horizon), T0)]
        report = interruptible(build_report(records, now=T0 + horizon))
        gpu_s = sum(j["gpus"] * j["wall_s"] for j in report["jobs"])  # the fleet's ETTR: weighted by GPUs
        report["totals"]["ettr"] = round(sum(j["gpus"] * j["progress_s"] for j in report["jobs"]) / gpu_s, 4)
        report["simulation"] = {"policy": policy, "days": args.days, "seed": args.seed, "fleet_gpus": FLEET_GPUS,
                                "inputs": m, "jobs": [[g, n] for g, n in JOBS], "causes": dict(CAUSES)}
        (out / f"{policy}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        (out / f"{policy}.html").write_text(render_html(report))
        results[policy] = report
    gpu_h = {p: sum(j["progress_gpu_hours"] for j in r["jobs"]) for p, r in results.items()}
    wall_gpu_h = sum(g * n for g, n in JOBS) * horizon / H
    print(f"\n{args.days:g} simulated days, {FLEET_GPUS} GPUs in {sum(n for _, n in JOBS)} multi-node jobs "
          f"({' + '.join(f'{n} x {g}' for g, n in JOBS)} GPUs), seed {args.seed}")
    print(f"{'':<12}{'ETTR':>8}{'GPU-h making progress':>24}{'interruptions':>15}  lost GPU-h by cause")
    for p, r in results.items():
        ettr = gpu_h[p] / wall_gpu_h
        lost = ", ".join(f"{c} {v['gpu_hours']:.0f}" for c, v in r["totals"]["lost"].items() if v["gpu_hours"] >= 0.5)
        print(f"{p:<12}{pct(ettr):>8}{gpu_h[p]:>24,.0f}{r['totals']['interruptions']:>15}  {lost}")
    print("(the same faults by running time: a job that runs longer meets more of them)")
    print(f"saved by slurmagent: {gpu_h['slurmagent'] - gpu_h['no-agent']:,.0f} GPU-hours "
          f"({pct((gpu_h['slurmagent'] - gpu_h['no-agent']) / wall_gpu_h)} of the fleet's month)")
    print(f"reports: {out}/no-agent.json, {out}/slurmagent.json; pages: {out}/no-agent.html, {out}/slurmagent.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
