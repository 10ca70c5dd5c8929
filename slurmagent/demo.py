"""`slurmagent demo`: the end-to-end scenario on a local Slurm cluster with emulated GCP.

A real slurmctld + three slurmd on 127.0.0.1 whose Prolog/Epilog are slurmagent, and a
Cloud Storage emulator. Scene 1: GPU 3 of n1 shows XID 79; a job lands there, n1 is
drained with a precise reason, the job goes back to PENDING and completes on another node.
Scene 2: a training job under `slurmagent run` gets a maintenance SIGTERM; it checkpoints,
the checkpoint reaches the bucket, the job is requeued and resumes on another node from the
bucket. Everything started is stopped at the end.
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
    from . import trainer

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


def run_demo(keep: bool = False) -> int:
    from .localcluster import LocalSlurmCluster, slurm_available
    from .localgcs import GcsEmulator

    why = slurm_available()
    if why:
        print(f"slurmagent demo: cannot start a local Slurm cluster: {why}", file=sys.stderr)
        return 2
    tl = Timeline()
    root = Path(tempfile.mkdtemp(prefix="slurmagent-demo-"))
    root.chmod(0o755)
    (root / "snap").mkdir()
    (root / "kern").mkdir()
    for node in ("n1", "n2", "n3"):
        (root / "snap" / f"{node}.json").write_text(json.dumps(_healthy_snapshot(node)))
        (root / "kern" / f"{node}.log").touch()
    config = root / "config.toml"
    config.write_text(
        f'state_dir = "{root}/state/%n"\n'
        f'[health]\nsnapshot = "{root}/snap/%n.json"\nkernel_log = "{root}/kern/%n.log"\nexpected_gpus = 8\n'
        f'[hooks]\nsyslog = false\n'
        f'[checkpoint]\nremote = "gs://demo-ckpt/jobs"\nsync_interval_s = 2.0\ngrace_s = 20.0\n'
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
        env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), STORAGE_EMULATOR_HOST=emu.url)
        _scene_sick_gpu(tl, cluster, root)
        _scene_interrupted_training(tl, cluster, root, env)
        tl.summary()
        ok = all(r[2].startswith("ok") for r in tl.rows)
        print("\nAll scenes passed." if ok else "\nSome scenes FAILED (see above).")
        return 0 if ok else 1
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        tl.say(f"FAILED: {exc}")
        tl.summary()
        return 1
    finally:
        tl.say("stopping the cluster and the emulator")
        cluster.stop()
        emu.stop()
        if not keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def _scene_sick_gpu(tl: Timeline, cluster, root: Path) -> None:
    snap = _healthy_snapshot("n1")
    snap["gpus"][3]["xid_events"] = [{"xid": 79, "time": "2026-11-30T05:00:00Z"}]
    (root / "snap" / "n1.json").write_text(json.dumps(snap))
    tl.say("scene 1: GPU 3 of n1 falls off the bus (XID 79 in its replay snapshot); n1 still looks idle to Slurm")
    job = cluster.sbatch("-o", "/dev/null", "-J", "sick-gpu-demo", "--wrap", "echo hello from $SLURMD_NODENAME")
    tl.say(f"submitted job {job}; Slurm schedules it on n1 first")
    node = tl.wait("n1 to be drained by the prolog", lambda: (lambda n: n if "DRAIN" in n.get("State", "") else None)(cluster.node("n1")), 60)
    tl.say(f"n1 drained by the prolog: reason \"{node.get('Reason', '').split(' [')[0]}\"")
    held_seen = []

    def done():
        j = cluster.job(job)
        if "held" in j.get("Reason", "").lower():
            held_seen.append(j["Reason"])
        return j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") else None

    tl.say(f"job {job} is back to PENDING (never held); it may start again after cred_expire + 1 s (~21 s here)")
    final = tl.wait(f"job {job} to finish elsewhere", done, 120)
    tl.say(f"job {job} {final['JobState']} on {final['NodeList']} after {final['Restarts']} restart(s)")
    reason_ok = node.get("Reason", "").startswith("slurmagent: xid 79 on gpu 3")
    tl.result("sick GPU", "n1 drained, reason names xid 79 and gpu 3", "ok" if reason_ok else "FAILED")
    tl.result("sick GPU", "job requeued PENDING, never held",
              "ok" if int(final.get("Restarts", 0)) >= 1 and not held_seen else f"FAILED {held_seen}")
    tl.result("sick GPU", "job completed on a healthy node",
              f"ok ({final['NodeList']})" if final["JobState"] == "COMPLETED" and final["NodeList"] != "n1" else "FAILED")
    cluster.resume("n1")


def _scene_interrupted_training(tl: Timeline, cluster, root: Path, env: dict) -> None:
    ledger = root / "ledger"
    out = root / "train.out"
    tl.say(f"scene 2: `slurmagent sbatch -- python train.py`: {DEMO_STEPS} steps, checkpoints every 25 steps, synced to the bucket")
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-J", "train-demo", "-o", str(out),
         "--open-mode=append", "--", "--ckpt-dir", str(root / "ckpt-%n"), "--",
         sys.executable, "-m", "slurmagent.demo", "trainer", str(DEMO_STEPS), str(ledger), "0.05"],
        env=env, capture_output=True, text=True, timeout=30,
    )
    if sub.returncode != 0:
        raise RuntimeError(f"sbatch failed: {sub.stderr.strip()}")
    job = sub.stdout.strip().split(";")[0]
    running = tl.wait(f"job {job} to start", lambda: (lambda j: j if j.get("JobState") == "RUNNING" else None)(cluster.job(job)), 60)
    first = running["NodeList"]

    def steps() -> list[int]:
        if not ledger.exists():
            return []
        return [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("step ")]

    tl.wait("training to reach step 60", lambda: len(steps()) >= 60, 60)
    tl.say(f"job {job} is training on {first} (step {len(steps())}); the platform announces maintenance: SIGTERM")
    cluster.run(["scancel", "--batch", "--signal=TERM", job])
    cluster.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=demo: VM stopped for maintenance"])
    tl.wait("the flush and requeue", lambda: "requeued job" in (out.read_text() if out.exists() else ""), 60)
    for line in out.read_text().splitlines():
        if line.startswith("slurmagent run:"):
            tl.say("  " + line)
    final = tl.wait(f"job {job} to resume on another node and finish", lambda: (lambda j: j if j.get("JobState") in ("COMPLETED", "FAILED") else None)(cluster.job(job)), 180)
    restored = [line for line in out.read_text().splitlines() if "restored checkpoint" in line]
    tl.say(f"job {job} {final['JobState']} on {final['NodeList']}: {restored[0] if restored else 'no restore'}")
    done = steps()
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
