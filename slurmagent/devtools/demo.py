"""`slurmagent demo`: the end-to-end scenario on a local Slurm cluster with emulated GCP.

A real slurmctld + three slurmd on 127.0.0.1 whose Prolog/Epilog are slurmagent, a Cloud
Storage emulator, and the fake Compute/metadata server of the test suite (so the demo runs
from a source checkout: the product itself never contains a fake). Scenes:

1. a GPU breaks while n3 is idle: `slurmagent watch` drains n3 before any job lands there;
2. GPU 3 of n1 shows XID 79 when a job lands: the prolog drains n1 with a precise reason, the
   job goes back to PENDING and completes on another node;
3. repair: one recreateInstances call for the MIG of n1 and n3, the "new" VMs check
   themselves with `resume-if-healthy` and take jobs again;
4. maintenance: a training job under `slurmagent run` gets SIGTERM, checkpoints to the
   bucket, is requeued and resumes on another node from the bucket;
5. flex-start expiry: the VM under a training job will be terminated in 75 s; the expiry
   watch drains it ahead, the job flushes at the lead and resumes elsewhere in time;
6. `slurmagent report`: ETTR and every interruption (with its cause) of the wrapped jobs, joined
   with the root side's decision logs and the repair history, and the same as an HTML page.

Everything started is stopped at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_STEPS = 300


def _healthy_snapshot(node: str, gpus: int = 8) -> dict:
    return {
        "schema": 1, "hostname": node, "driver_version": "550.90.07", "nvml_error": None,
        "gpus": [
            {"index": i, "uuid": f"GPU-demo-{node}-{i}", "name": "NVIDIA H100 80GB HBM3",
             "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "lost": False, "temperature_c": 38,
             "persistence_mode": True,
             "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0, "volatile_corrected": 0},
             "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
             "clocks_event_reasons": [], "recovery_action": 0}
            for i in range(gpus)
        ],
    }


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.rows: list[tuple[str, str, str]] = []
        self.tty = sys.stdout.isatty()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    def wait(self, what: str, pred, timeout: float, interval: float = 0.5):
        """Wait with a one-line progress display; raise with a clear message at the deadline."""
        start = time.monotonic()
        while True:
            value = pred()
            if value:
                if self.tty:
                    print("\r\033[K", end="")
                return value
            waited = time.monotonic() - start
            if waited > timeout:
                raise RuntimeError(f"demo: gave up waiting for {what} after {timeout:.0f} s")
            if self.tty:
                print(f"\r          ... {what} ({waited:4.0f} s)", end="", flush=True)
            time.sleep(interval)

    def result(self, scene: str, check: str, outcome: str) -> None:
        self.rows.append((scene, check, outcome))

    def summary(self) -> None:
        widths = [max(len(r[i]) for r in [("scene", "what was checked", "result"), *self.rows]) for i in range(3)]
        line = "+".join("-" * (w + 2) for w in widths)
        print(f"\n+{line}+")
        for i, row in enumerate([("scene", "what was checked", "result"), *self.rows]):
            print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
            if i == 0:
                print(f"+{line}+")
        print(f"+{line}+")


def trainer_main(argv: list[str]) -> int:
    """The demo's training job: counts steps, checkpoints on the signal (see slurmagent.trainer)."""
    from .. import trainer

    total, ledger, step_s = int(argv[0]), Path(argv[1]), float(argv[2])
    with trainer.checkpoint_handler():
        state = trainer.ckpt_dir() / "state.json"
        step = json.loads(state.read_text())["step"] if trainer.resumed() else 0
        with ledger.open("a") as fh:
            fh.write(f"start {step} {os.environ.get('SLURMD_NODENAME', '?')}\n")
        while step < total:
            time.sleep(step_s)
            step += 1
            with ledger.open("a") as fh:
                fh.write(f"step {step}\n")
            if step % 25 == 0 or trainer.checkpoint_requested():
                trainer.atomic_write(state, json.dumps({"step": step}))
            if trainer.checkpoint_requested():
                return 0
    return 0


MIG = "demo-gpu-mig"
ZONE = "us-central1-a"


def _fake_gcp_class():
    """The fake Compute + metadata server lives with the tests, never in the product."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "support" / "fake_gcp_expiry.py").exists():
        return None
    sys.path.insert(0, str(tests))
    from support.fake_gcp_expiry import FakeGcpExpiry

    return FakeGcpExpiry


def run_demo(keep: bool = False) -> int:
    from .localcluster import LocalSlurmCluster, slurm_available
    from .localgcs import GcsEmulator

    why = slurm_available()
    if why:
        print(f"slurmagent demo: cannot start a local Slurm cluster: {why}", file=sys.stderr)
        return 2
    fake_gcp = _fake_gcp_class()
    if fake_gcp is None:
        print("slurmagent demo: needs a source checkout (tests/support/fake_gcp_expiry.py emulates Compute)", file=sys.stderr)
        return 2
    tl = Timeline()
    root = Path(tempfile.mkdtemp(prefix="slurmagent-demo-"))
    root.chmod(0o755)
    (root / "snap").mkdir()
    (root / "kern").mkdir()
    for node in ("n1", "n2", "n3"):
        (root / "snap" / f"{node}.json").write_text(json.dumps(_healthy_snapshot(node)))
        (root / "kern" / f"{node}.log").touch()
    gcp = fake_gcp()
    for node in ("n1", "n2", "n3"):
        gcp.add_instance(node, zone=ZONE, mig=MIG)
    gcp.set_identity("n1", zone=ZONE, created_by=gcp.mig_path(MIG, zone=ZONE))
    gcp.start()
    config = root / "config.toml"
    config.write_text(
        f'state_dir = "{root}/state/%n"\n'
        f'[health]\nsnapshot = "{root}/snap/%n.json"\nkernel_log = "{root}/kern/%n.log"\nexpected_gpus = 8\n'
        f'[hooks]\nsyslog = false\n'
        f'[gcp]\nproject = "{gcp.project}"\nzone = "{ZONE}"\ncompute_endpoint = "{gcp.url}"\n'
        f'[repair]\nstrategy = "recreate"\nmax_drained_fraction = 0.7\n'
        f'[checkpoint]\nremote = "gs://demo-ckpt/jobs"\nsync_interval_s = 2.0\ngrace_s = 20.0\n'
        f'[expiry]\ndrain_lead_s = 60.0\nflush_lead_s = 40.0\npublish_run_file = false\n'
        f'[watch]\nchannel_socket = "{root}/run/%n/channel.sock"\n'
    )
    hooks = {}
    for hook in ("prolog", "epilog"):
        shim = root / hook
        shim.write_text(f"#!/bin/sh\nexport SLURMAGENT_CONFIG='{config}'\nexec {sys.executable} -m slurmagent.entry {hook}\n")
        shim.chmod(0o755)
        hooks[hook] = str(shim)
    cluster = LocalSlurmCluster(root / "slurm", prolog=hooks["prolog"], epilog=hooks["epilog"])
    emu = GcsEmulator(data_dir=root / "gcs")
    try:
        tl.say("starting a local Slurm cluster (slurmctld + slurmd n1, n2, n3 on 127.0.0.1, munge auth)")
        cluster.start()
        tl.say("starting a Cloud Storage emulator on 127.0.0.1 with bucket gs://demo-ckpt")
        emu.start()
        emu.create_bucket("demo-ckpt")
        env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), STORAGE_EMULATOR_HOST=emu.url,
                   GCE_METADATA_HOST=gcp.host)
        env.pop("SLURMD_NODENAME", None)
        _scene_idle_break(tl, cluster, root, env)
        _scene_sick_gpu(tl, cluster, root)
        _scene_repair(tl, cluster, root, env, gcp)
        _scene_interrupted_training(tl, cluster, root, env)
        _scene_flex_expiry(tl, cluster, root, env, gcp)
        shown = _scene_report(tl, root, env)
        tl.summary()
        ok = all(r[2].startswith("ok") for r in tl.rows)
        print("\nAll scenes passed." if ok else "\nSome scenes FAILED (see above).")
        if shown:
            print(f"\nThe goodput report of the demo's wrapped jobs (`slurmagent report`):\n\n{shown[0]}\n")
            print(f"The same as one page: {shown[1]}")
        return 0 if ok else 1
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        tl.say(f"FAILED: {exc}")
        tl.summary()
        return 1
    finally:
        tl.say("stopping the cluster, the emulator and the fake Compute server")
        cluster.stop()
        emu.stop()
        gcp.stop()
        if not keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def _cli(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _drained(cluster, node: str) -> dict | None:
    info = cluster.node(node)
    return info if "DRAIN" in info.get("State", "") else None


def _finished(cluster, job: str) -> dict | None:
    info = cluster.job(job)
    return info if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") else None


def _scene_idle_break(tl: Timeline, cluster, root: Path, env: dict) -> None:
    tl.say("scene 1: `slurmagent watch` follows n3's kernel log (NVML XID events on a real node)")
    watcher = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "watch", "--node", "n3", "--no-nvml"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        line = ("NVRM: Xid (PCI:0000:28:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
                "error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.\n")
        t0 = time.monotonic()
        with (root / "kern" / "n3.log").open("a") as fh:
            fh.write(line)
        tl.say("GPU 1 of idle n3 reports XID 48 (double-bit ECC error) in the kernel log")
        node = tl.wait("the watcher to drain n3", lambda: _drained(cluster, "n3"), 30, interval=0.05)
        took = time.monotonic() - t0
        tl.say(f"n3 drained {took:.2f} s later: \"{node.get('Reason', '').split(' [')[0]}\"")
        job = cluster.sbatch("-o", "/dev/null", "--wrap", "true")
        final = tl.wait(f"job {job}", lambda: _finished(cluster, job), 60)
        tl.say(f"a job submitted right after ran on {final['NodeList']} with {final['Restarts']} restarts")
    finally:
        watcher.terminate()
        watcher.wait(15)
    tl.result("idle break", "watch drained n3 before any job landed",
              f"ok ({took:.2f} s)" if node.get("Reason", "").startswith("slurmagent: xid 48 on gpu 1") else "FAILED")
    tl.result("idle break", "next job ran elsewhere, never requeued",
              "ok" if final["NodeList"] != "n3" and final["Restarts"] == "0" and final["JobState"] == "COMPLETED"
              else "FAILED")


def _scene_repair(tl: Timeline, cluster, root: Path, env: dict, gcp) -> None:
    recreated: list[str] = []
    gcp.on_recreate = lambda mig, names: recreated.extend(names)
    tl.say(f"scene 3: `slurmagent repair`: n1 and n3 are drained by slurmagent; both VMs are in MIG {MIG}")
    proc = _cli(env, "repair")
    for line in proc.stdout.strip().splitlines():
        tl.say("  " + line)
    calls = [c for c in gcp.mutations if "recreateInstances" in c.path]
    reasons = {n: cluster.node(n).get("Reason", "").split(" [")[0] for n in ("n1", "n3")}
    for n, r in reasons.items():
        tl.say(f"  {n}: {r}")
    tl.say("the MIG recreates the VMs: slurmd stops, comes back on a healthy machine, and checks itself at boot")
    for node in sorted(set(recreated)):
        cluster.stop_node(node)
        (root / "snap" / f"{node}.json").write_text(json.dumps(_healthy_snapshot(node)))
        (root / "kern" / f"{node}.log").write_text("")
        cluster.start_node(node)
    resumed = []
    for node in sorted(set(recreated)):
        out = _cli(dict(env, SLURMD_NODENAME=node), "resume-if-healthy", "--node", node)
        tl.say(f"  resume-if-healthy on {node}: {out.stdout.strip() or out.stderr.strip()}")
        if out.returncode == 0 and "resumed" in out.stdout:
            resumed.append(node)
    jobs = [cluster.sbatch("-w", node, "-o", "/dev/null", "--wrap", "true") for node in resumed]
    done = [tl.wait(f"job {j}", lambda j=j: _finished(cluster, j), 60) for j in jobs]
    tl.result("repair", "one recreateInstances call for the MIG of both nodes",
              f"ok ({len(calls)} call, {','.join(sorted(recreated))})" if len(calls) == 1 and sorted(recreated) == ["n1", "n3"]
              else f"FAILED ({len(calls)} calls, {recreated})")
    tl.result("repair", "recreated VMs resumed themselves and ran jobs",
              "ok" if resumed == ["n1", "n3"] and all(d["JobState"] == "COMPLETED" for d in done) else f"FAILED {resumed}")


def _submit_trainer(env: dict, root: Path, name: str, steps: int, step_s: float, ledger: Path, out: Path) -> str:
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-J", name, "-o", str(out),
         "--open-mode=append", "--", "--ckpt-dir", str(root / f"ckpt-{name}-%n"), "--",
         sys.executable, "-m", "slurmagent.devtools.demo", "trainer", str(steps), str(ledger), str(step_s)],
        env=env, capture_output=True, text=True, timeout=30,
    )
    if sub.returncode != 0:
        raise RuntimeError(f"sbatch failed: {sub.stderr.strip()}")
    return sub.stdout.strip().split(";")[0]


def _steps(ledger: Path) -> list[int]:
    if not ledger.exists():
        return []
    return [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("step ")]


def _scene_flex_expiry(tl: Timeline, cluster, root: Path, env: dict, gcp) -> None:
    from datetime import datetime, timedelta, timezone

    ledger, out, total = root / "ledger-flex", root / "flex.out", 900
    tl.say(f"scene 5: a flex-start VM will be terminated; a wrapped training job of {total} steps runs on it")
    job = _submit_trainer(env, root, "flex-demo", total, 0.1, ledger, out)
    running = tl.wait(f"job {job} to start", lambda: (lambda j: j if j.get("JobState") == "RUNNING" else None)(cluster.job(job)), 60)
    node = running["NodeList"]
    tl.wait("training to reach step 30", lambda: len(_steps(ledger)) >= 30, 60)
    end = datetime.now(timezone.utc) + timedelta(seconds=75)
    gcp.set_scheduling(node, termination=end.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z")
    tl.say(f"the Compute API now says {node} terminates at {end:%H:%M:%S} UTC (in 75 s); drain lead 60 s, flush lead 40 s")
    tl.say("the expiry timer runs `slurmagent expiry-watch --once` (every 3 s here, 30 s in production)")
    drained_at = None
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        _cli(dict(env, SLURMD_NODENAME=node), "expiry-watch", "--once", "--node", node)
        info = cluster.node(node)
        if drained_at is None and "DRAIN" in info.get("State", ""):
            drained_at = datetime.now(timezone.utc)
            tl.say(f"{node} drained {(end - drained_at).total_seconds():.0f} s before termination: "
                   f"\"{info.get('Reason', '').split(' [')[0]}\"")
        if "requeued job" in (out.read_text() if out.exists() else ""):
            break
        time.sleep(3)
    flushed_at = datetime.now(timezone.utc)
    for line in out.read_text().splitlines() if out.exists() else []:
        if line.startswith("slurmagent run:") and ("checkpoint" in line or "requeued" in line or "sync" in line):
            tl.say("  " + line)
    resumed = tl.wait(f"job {job} to resume on another node",
                      lambda: (lambda j: j if j.get("JobState") == "RUNNING" and j.get("NodeList") != node else None)(cluster.job(job)), 90)
    resumed_at = datetime.now(timezone.utc)
    tl.say(f"job {job} resumed on {resumed['NodeList']} {(end - resumed_at).total_seconds():.0f} s before {node} terminates")
    final = tl.wait(f"job {job} to finish", lambda: _finished(cluster, job), 240)
    tl.result("flex expiry", "node drained ahead of termination with the expiry reason",
              "ok" if drained_at and drained_at < end else "FAILED")
    tl.result("flex expiry", "job flushed and resumed elsewhere before the VM died",
              f"ok ({node} -> {resumed['NodeList']}, {(end - resumed_at).total_seconds():.0f} s to spare)"
              if resumed_at < end and flushed_at < end else "FAILED")
    tl.result("flex expiry", f"all {total} steps, none lost, none repeated",
              "ok" if final["JobState"] == "COMPLETED" and _steps(ledger) == list(range(1, total + 1)) else "FAILED")


def _scene_report(tl: Timeline, cluster_root: Path, env: dict) -> tuple[str, Path] | None:
    """`slurmagent report` over the demo's bucket, the nodes' decision logs and the repair
    history: ETTR and one line per interruption of each wrapped job, and the HTML page."""
    from ..core.goodput import format_text

    state = cluster_root / "state"
    page = Path(tempfile.gettempdir()) / f"slurmagent-demo-report-{time.strftime('%Y%m%d-%H%M%S')}.html"
    args = ["report", "--json", "--html", str(page)]
    for log in sorted(state.glob("*/hooks.log")):
        args += ["--decision-log", str(log)]
    for repair_state in sorted(state.glob("*/repair-state.json"))[:1]:
        args += ["--state-dir", str(repair_state.parent)]
    tl.say("scene 6: `slurmagent report`: where each wrapped job's time went, from the ledger in the bucket")
    proc = _cli(env, *args)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        tl.result("report", "ETTR and every interruption of each wrapped job", f"FAILED ({proc.stderr.strip()[-200:]})")
        return None
    jobs = {j["job"]: j for j in report["jobs"]}
    causes = sorted(i["cause"] for j in jobs.values() for i in j["interruptions"])
    tl.result("report", "ETTR and every interruption of each wrapped job",
              f"ok ({len(jobs)} jobs, interruptions: {', '.join(causes)})"
              if len(jobs) >= 2 and all(j["ettr"] for j in jobs.values()) and "sigterm" in causes
              and any(c in ("expiry", "maintenance", "preemption") for c in causes) else f"FAILED ({causes})")
    tl.result("report", "one self-contained HTML page", "ok" if page.exists() else "FAILED")
    return format_text(report), page


def _scene_sick_gpu(tl: Timeline, cluster, root: Path) -> None:
    snap = _healthy_snapshot("n1")
    snap["gpus"][3]["xid_events"] = [{"xid": 79, "time": "2026-11-30T05:00:00Z"}]
    (root / "snap" / "n1.json").write_text(json.dumps(snap))
    tl.say("scene 2: GPU 3 of n1 falls off the bus (XID 79 in its replay snapshot); n1 still looks idle to Slurm")
    cluster.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=demo: hold until n1 met the job"])
    job = cluster.sbatch("-o", "/dev/null", "-J", "sick-gpu-demo", "--wrap", "echo hello from $SLURMD_NODENAME")
    tl.say(f"submitted job {job}; Slurm schedules it on n1 (n2 is held back for a moment so it must)")
    node = tl.wait("n1 to be drained by the prolog", lambda: _drained(cluster, "n1"), 60)
    cluster.resume("n2")
    tl.say(f"n1 drained by the prolog: reason \"{node.get('Reason', '').split(' [')[0]}\"")
    held_seen = []

    def done():
        j = cluster.job(job)
        if "held" in j.get("Reason", "").lower():
            held_seen.append(j["Reason"])
        return j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") else None

    tl.say(f"job {job} is back to PENDING (never held); it may start again after cred_expire + 1 s (~6 s here)")
    final = tl.wait(f"job {job} to finish elsewhere", done, 120)
    tl.say(f"job {job} {final['JobState']} on {final['NodeList']} after {final['Restarts']} restart(s)")
    reason_ok = node.get("Reason", "").startswith("slurmagent: xid 79 on gpu 3")
    tl.result("sick GPU", "n1 drained, reason names xid 79 and gpu 3", "ok" if reason_ok else "FAILED")
    tl.result("sick GPU", "job requeued PENDING, never held",
              "ok" if int(final.get("Restarts", 0)) >= 1 and not held_seen else f"FAILED {held_seen}")
    tl.result("sick GPU", "job completed on a healthy node",
              f"ok ({final['NodeList']})" if final["JobState"] == "COMPLETED" and final["NodeList"] != "n1" else "FAILED")


def _scene_interrupted_training(tl: Timeline, cluster, root: Path, env: dict) -> None:
    ledger, out = root / "ledger", root / "train.out"
    tl.say(f"scene 4: `slurmagent sbatch -- python train.py`: {DEMO_STEPS} steps, checkpoints every 25 steps, synced to the bucket")
    job = _submit_trainer(env, root, "train-demo", DEMO_STEPS, 0.05, ledger, out)
    running = tl.wait(f"job {job} to start", lambda: (lambda j: j if j.get("JobState") == "RUNNING" else None)(cluster.job(job)), 60)
    first = running["NodeList"]
    tl.wait("training to reach step 60", lambda: len(_steps(ledger)) >= 60, 60)
    tl.say(f"job {job} is training on {first} (step {len(_steps(ledger))}); the platform announces maintenance: SIGTERM")
    cluster.run(["scancel", "--batch", "--signal=TERM", job])
    cluster.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=demo: VM stopped for maintenance"])
    tl.wait("the flush and requeue", lambda: "requeued job" in (out.read_text() if out.exists() else ""), 60)
    for line in out.read_text().splitlines():
        if line.startswith("slurmagent run:"):
            tl.say("  " + line)
    final = tl.wait(f"job {job} to resume on another node and finish", lambda: _finished(cluster, job), 180)
    restored = [line for line in out.read_text().splitlines() if "restored checkpoint" in line]
    tl.say(f"job {job} {final['JobState']} on {final['NodeList']}: {restored[0] if restored else 'no restore'}")
    done = _steps(ledger)
    tl.result("maintenance", "checkpoint flushed to the bucket, job requeued", "ok" if restored else "FAILED")
    tl.result("maintenance", "resumed on another node from the bucket",
              f"ok ({first} -> {final['NodeList']})" if final["NodeList"] != first and restored else "FAILED")
    tl.result("maintenance", f"all {DEMO_STEPS} steps, none lost, none repeated",
              "ok" if done == list(range(1, DEMO_STEPS + 1)) else f"FAILED ({len(done)} steps)")
    cluster.resume(first)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        sys.exit(trainer_main(sys.argv[2:]))
    sys.exit(run_demo())
