#!/usr/bin/env python3
"""Mass failure bench: a quarter of the nodes fail at once while jobs land on them.

    python bench/mass_failure.py [--nodes 16] [--mig-size 8] [--fail-fraction 0.25]

Starts a LocalSlurmCluster of N slurmd (needs root, munge, slurmctld, slurmd) and the
fake Compute API (tests/support/fake_gcp.py). Then, in the same run:

(a) slurmagent: the failing nodes' replay snapshots say XID 79; one whole-node job is
    submitted per node; the prologs on the failing nodes drain them (journal + breaker).
    Measured: wall time from submission until every failing node is drained and every
    affected job is PENDING (or running elsewhere), scontrol calls per failed node (a
    counting wrapper is `[slurm] scontrol`), then `slurmagent repair`: Compute calls
    and scontrol calls per failed node.
(b) baseline: the same burst with a plain `exit 1` prolog (what Slurm does on its own:
    drains with `Prolog error`, no precise reason, no repair), and a naive per-node
    repair loop (show node, instances.get, set reason, recreateInstances of ONE
    instance, poll its operation) on the same nodes.
(c) floor: the plain `exit 1` prolog on the failing nodes, slurmagent's healthy prolog on
    the others. Here every slurmd shares this host's CPUs, so N Python prologs (~0.1 CPU-s
    each) queue behind each other, which a real cluster (one VM per node) never sees: the
    floor is the baseline plus that cost, and slurmagent/floor is what the failure
    handling itself (journal, breaker, 3 scontrol calls per failed node) adds.
(d) per-node CPU model: (a) and (c) again with the healthy nodes' prologs under SCHED_IDLE
    (`chrt --idle 0`): they still run and pass, but only on CPU time nothing else wants, as on
    a real cluster where each runs on its own VM and takes nothing from the failing nodes,
    slurmd or slurmctld. The failing nodes' prologs, every slurmd, slurmctld, scontrol and this
    harness keep normal priority. Both figures are printed; the model is what a cluster of
    separate VMs sees, the shared one what this host sees.

Targets: one recreateInstances per MIG; scontrol calls for reasons batched by hostlist.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support import healthy_snapshot_dict, write_json, xid_snapshot_dict  # noqa: E402
from support.fake_gcp import FakeGcp  # noqa: E402

from slurmagent.core import reasons  # noqa: E402
from slurmagent.devtools.localcluster import LocalSlurmCluster, slurm_available  # noqa: E402
from slurmagent.slurm.model import NodeInfo, node_from_kv, parse_kv  # noqa: E402

ZONE = "us-central1-a"
XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"


def counting_scontrol(path: Path, log: Path) -> Path:
    real = shutil.which("scontrol") or "/usr/bin/scontrol"
    path.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    path.chmod(0o755)
    return path


def prolog_shim(path: Path, config: Path, mode_file: Path, bad_dir: Path, sick_dir: Path) -> Path:
    """The Prolog every slurmd runs. `sick_dir` names the failing nodes in every mode; with the
    `per-node-cpu` marker the healthy nodes' prologs run under SCHED_IDLE (see the module doc)."""
    floor_file = mode_file.with_name("floor-mode")
    model_file = mode_file.with_name("per-node-cpu")
    path.write_text(
        "#!/bin/sh\n"
        f"if [ -e {mode_file} ]; then  # baseline: a plain health-check prolog\n"
        f'  [ -e {bad_dir}/"$SLURMD_NODENAME" ] && exit 1\n'
        "  exit 0\n"
        "fi\n"
        f"if [ -e {floor_file} ]; then  # floor: plain on the failing nodes, slurmagent on the rest\n"
        f'  [ -e {bad_dir}/"$SLURMD_NODENAME" ] && exit 1\n'
        "fi\n"
        f"export SLURMAGENT_CONFIG='{config}' PYTHONPATH='{REPO}'\n"
        f'if [ -e {model_file} ] && [ ! -e {sick_dir}/"$SLURMD_NODENAME" ]; then\n'
        f"  exec chrt --idle 0 {sys.executable} -m slurmagent.entry prolog\n"
        "fi\n"
        f"exec {sys.executable} -m slurmagent.entry prolog\n")
    path.chmod(0o755)
    return path


def query(cluster, argv: list[str]) -> str:
    """The harness's own reads, retried over a transient failure (e.g. a munge hiccup)."""
    for attempt in range(5):
        proc = cluster.run(argv, check=False)
        if proc.returncode == 0:
            return proc.stdout
        print(f"  (harness: {' '.join(argv)}: {proc.stderr.strip()}; retrying)", file=sys.stderr)
        time.sleep(0.5)
    raise RuntimeError(f"{argv}: {proc.stderr.strip()}")


def nodes_now(cluster) -> dict[str, NodeInfo]:
    out = query(cluster, ["scontrol", "-o", "show", "node"])
    return {v.name: v for v in (node_from_kv(parse_kv(line)) for line in out.splitlines() if line)}


def jobs_now(cluster) -> dict[str, tuple[str, str, int]]:
    """job id -> (state, node list, restarts) from one `scontrol -o show job`."""
    out = query(cluster, ["scontrol", "-o", "show", "job"])
    jobs = {}
    for line in out.splitlines():
        kv = parse_kv(line)
        if "JobId" in kv:
            nodes = kv.get("NodeList", "")
            jobs[kv["JobId"]] = (kv.get("JobState", ""), "" if nodes == "(null)" else nodes,
                                 int(kv.get("Restarts", "0") or 0))
    return jobs


def burst(cluster, bad: list[str], drained_pred, timeout: float = 120.0) -> dict:
    """Submit one whole-node job per node; wait until every bad node is drained and every
    job that landed on one (requeued: Restarts >= 1) is PENDING or running elsewhere."""
    n = len(cluster.nodes)
    t0 = time.monotonic()
    job_ids = [cluster.sbatch("-c", "2", "-o", "/dev/null", "--wrap", "sleep 120") for _ in range(n)]
    end = t0 + timeout
    polls = 0
    views: dict = {}
    while time.monotonic() < end:
        polls += 1
        views = nodes_now(cluster)
        jobs = jobs_now(cluster)
        affected = [j for j in job_ids if jobs.get(j, ("", "", 0))[2] >= 1]
        all_drained = all(drained_pred(views[b]) for b in bad)
        # no job left on a bad node and every requeued one PENDING or running elsewhere (a
        # requeued job may land on a second bad node before that node's own job does, so
        # fewer jobs than bad nodes may be affected)
        off_bad = all(jobs.get(j, ("", "", 0))[1] not in bad for j in job_ids)
        settled = all(jobs[j][0] == "PENDING" or (jobs[j][0] == "RUNNING" and jobs[j][1] not in bad) for j in affected)
        if all_drained and settled and off_bad and affected:
            return {"seconds": time.monotonic() - t0, "affected_jobs": len(affected), "polls": polls}
        time.sleep(0.05)
    raise TimeoutError(f"burst did not settle in {timeout:g} s: {[(b, views[b].state, views[b].reason) for b in bad]}")


def reset(cluster, root: Path, mode_file: Path, bad_dir: Path, sick_dir: Path) -> None:
    cluster.run(["scancel", "--full", "-u", "root"], check=False)
    cluster.run(["scontrol", "update", f"nodename={','.join(cluster.nodes)}", "comment="], check=False)
    for n in cluster.nodes:
        write_json(root / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
        state = root / "state" / n
        shutil.rmtree(state, ignore_errors=True)
    mode_file.unlink(missing_ok=True)
    mode_file.with_name("floor-mode").unlink(missing_ok=True)
    mode_file.with_name("per-node-cpu").unlink(missing_ok=True)
    for f in [*bad_dir.glob("*"), *sick_dir.glob("*")]:
        f.unlink()
    time.sleep(1)
    cluster.reset_nodes()


def count(log: Path) -> int:
    try:
        return len(log.read_text().splitlines())
    except OSError:
        return 0


def naive_repair(cluster, gcp: FakeGcp, bad: list[str], scontrol_log: Path, scontrol: Path) -> dict:
    """One node at a time: show node, instances.get, set reason, recreate ONE, poll its op."""
    from slurmagent.gcp.compute import Compute
    from slurmagent.slurm.commands import Slurm

    before_s = count(scontrol_log)
    before_c = len(gcp.calls)
    os.environ["SLURM_CONF"] = str(cluster.conf)
    slurm = Slurm(str(scontrol))
    compute = Compute(gcp.project, gcp.url)
    t0 = time.monotonic()
    for node in bad:
        view = [v for v in (node_from_kv(parse_kv(line)) for line in
                            slurm._scontrol("-o", "show", "node", node).stdout.splitlines()) if v.name == node][0]
        mig = compute.instance_mig(ZONE, node)
        slurm.set_reason([node], reasons.repairing_reason(view.reason or XID79))
        for op in compute.recreate(mig, [(ZONE, node)], str(uuid.uuid4())):
            compute.wait(op)
    return {"seconds": time.monotonic() - t0, "scontrol": count(scontrol_log) - before_s,
            "compute": len(gcp.calls) - before_c,
            "recreate": sum(1 for c in gcp.calls[before_c:] if c.kind.endswith("recreateInstances"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--mig-size", type=int, default=8)
    ap.add_argument("--fail-fraction", type=float, default=0.25)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    why = slurm_available()
    if why:
        print(f"mass_failure: cannot run a local Slurm cluster: {why}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="sa-bench-mass-"))
    root.chmod(0o755)
    names = [f"n{i}" for i in range(1, args.nodes + 1)]
    n_bad = max(1, round(args.nodes * args.fail_fraction))
    step = args.nodes / n_bad
    bad = [names[int(i * step + step - 1)] for i in range(n_bad)]  # spread over the MIGs
    gcp = FakeGcp().start()
    for i, n in enumerate(names):
        gcp.add_instance(n, ZONE, mig=f"mig-{i // args.mig_size}")
    scontrol_log = root / "scontrol.log"
    scontrol = counting_scontrol(root / "scontrol-count", scontrol_log)
    mode_file = root / "baseline-mode"
    bad_dir = root / "bad"
    bad_dir.mkdir()
    sick_dir = root / "sick"
    sick_dir.mkdir()
    (root / "kern").mkdir()
    for n in names:
        (root / "kern" / f"{n}.log").touch()
        write_json(root / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
    config = root / "config.toml"
    cluster = LocalSlurmCluster(root / "slurm", nodes=names, prolog=str(prolog_shim(root / "prolog", config,
                                                                                    mode_file, bad_dir, sick_dir)))
    config.write_text(
        f'state_dir = "{root}/state/%n"\n[health]\nsnapshot = "{root}/snap/%n.json"\nkernel_log = "{root}/kern/%n.log"\n'
        f'expected_gpus = 8\ntimeout_s = 10\n[hooks]\nsyslog = false\n'
        f'[slurm]\nscontrol = "{scontrol}"\nconf = "{cluster.conf}"\ntimeout_s = 20\n'
        f'[gcp]\nproject = "{gcp.project}"\nzone = "{ZONE}"\ncompute_endpoint = "{gcp.url}"\n'
        f'[repair]\nstrategy = "recreate"\nmax_drained_fraction = {args.fail_fraction}\n')
    t_start = time.monotonic()
    try:
        cluster.start()
        print(f"cluster of {args.nodes} slurmd up in {time.monotonic() - t_start:.1f} s; failing at once: "
              f"{','.join(bad)} ({n_bad}/{args.nodes}) in {len({i // args.mig_size for i, n in enumerate(names) if n in bad})} MIGs "
              f"of {args.mig_size}", flush=True)

        # (a) slurmagent: twice, the second time with the MIG cache warm
        import subprocess

        def setup(mode: str | None, per_node_cpu: bool) -> None:
            reset(cluster, root, mode_file, bad_dir, sick_dir)
            if mode:
                mode_file.with_name(mode).touch()
            if per_node_cpu:
                mode_file.with_name("per-node-cpu").touch()
            for b in bad:
                (sick_dir / b).touch()
                if mode:
                    (bad_dir / b).touch()

        def slurmagent_round(per_node_cpu: bool = False) -> tuple[dict, dict, list]:
            setup(None, per_node_cpu)
            for b in bad:
                write_json(root / "snap" / f"{b}.json", xid_snapshot_dict(79, gpu=3))
            scontrol_log.write_text("")
            sa = burst(cluster, bad, lambda v: v.ours and v.reason == XID79)
            sa["scontrol"] = count(scontrol_log)
            calls = [line.split()[0:3] for line in scontrol_log.read_text().splitlines()]
            if per_node_cpu:  # the burst only: repair was measured (and counted) by the shared rounds
                return sa, {}, calls
            before_c = len(gcp.calls)
            scontrol_log.write_text("")
            t0 = time.monotonic()
            rep = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(config), "repair"],
                                 env=dict(cluster.env, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                                 timeout=300)
            repair_s = time.monotonic() - t0
            if rep.returncode != 0:
                print(rep.stdout, rep.stderr, file=sys.stderr)
                raise SystemExit("slurmagent repair failed")
            new_calls = gcp.calls[before_c:]
            sa_rep = {"seconds": repair_s, "scontrol": count(scontrol_log), "compute": len(new_calls),
                      "recreate": sum(1 for c in new_calls if c.kind.endswith("recreateInstances")),
                      "get": sum(1 for c in new_calls if c.kind == "instances.get"),
                      "ops": sum(1 for c in new_calls if "Operations" in c.kind)}
            views = nodes_now(cluster)
            assert all(views[b].repairing for b in bad), [(b, views[b].reason) for b in bad]
            return sa, sa_rep, calls

        sa, sa_rep, sa_calls = slurmagent_round()
        sa2, sa_rep2, _ = slurmagent_round()
        sam = [slurmagent_round(per_node_cpu=True)[0] for _ in range(2)]

        # (b) baseline
        setup(mode_file.name, False)
        scontrol_log.write_text("")
        base = burst(cluster, bad, lambda v: v.drained)
        base["scontrol"] = count(scontrol_log)
        base_rep = naive_repair(cluster, gcp, bad, scontrol_log, scontrol)

        # (c) floor, shared CPUs and per-node CPUs
        setup("floor-mode", False)
        floor = burst(cluster, bad, lambda v: v.drained)
        setup("floor-mode", True)
        floor_m = burst(cluster, bad, lambda v: v.drained)
        reset(cluster, root, mode_file, bad_dir, sick_dir)
    finally:
        cluster.run(["scancel", "--full", "-u", "root"], check=False)
        time.sleep(0.5)
        cluster.stop()
        gcp.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"work directory kept: {root}")

    per = lambda x: x / n_bad  # noqa: E731
    rows = [
        ("burst: all failed nodes drained + affected jobs PENDING", f"{sa['seconds']:.2f} s", f"{base['seconds']:.2f} s"),
        ("  same, 2nd round", f"{sa2['seconds']:.2f} s", "-"),
        ("  floor: baseline + slurmagent's healthy prolog elsewhere", "-", f"{floor['seconds']:.2f} s"),
        ("  slurmagent / baseline, slurmagent / floor (best round)",
         f"{min(sa['seconds'], sa2['seconds']) / base['seconds']:.2f}x",
         f"{min(sa['seconds'], sa2['seconds']) / floor['seconds']:.2f}x"),
        ("same burst, per-node CPU model (healthy prologs SCHED_IDLE)",
         " / ".join(f"{r['seconds']:.2f}" for r in sam) + " s", f"{base['seconds']:.2f} s"),
        ("  floor, per-node CPU model", "-", f"{floor_m['seconds']:.2f} s"),
        ("  slurmagent / baseline, slurmagent / floor (best round)",
         f"{min(r['seconds'] for r in sam) / base['seconds']:.2f}x",
         f"{min(r['seconds'] for r in sam) / floor_m['seconds']:.2f}x"),
        ("  affected jobs (requeued PENDING)", str(sa["affected_jobs"]), str(base["affected_jobs"])),
        ("  drain reason", "precise (xid 79 on gpu 3)", "Slurm's 'Prolog error'"),
        ("  scontrol calls per failed node (hooks)", f"{per(sa['scontrol']):.1f}", f"{per(base['scontrol']):.1f}"),
        ("repair: wall time (one run)", f"{sa_rep['seconds']:.2f} s", f"{base_rep['seconds']:.2f} s"),
        ("  Compute calls per failed node (all, MIG cache cold)", f"{per(sa_rep['compute']):.2f}",
         f"{per(base_rep['compute']):.2f}"),
        ("  Compute calls per failed node (all, MIG cache warm)", f"{per(sa_rep2['compute']):.2f}", "-"),
        ("  recreateInstances calls (per MIG / total)", f"{sa_rep['recreate']}", f"{base_rep['recreate']}"),
        ("  scontrol calls per failed node", f"{per(sa_rep['scontrol']):.2f}", f"{per(base_rep['scontrol']):.2f}"),
    ]
    print(f"\nmass failure: {n_bad} of {args.nodes} nodes at once, MIGs of {args.mig_size}, "
          f"[repair] max_drained_fraction = {args.fail_fraction}")
    w = max(len(r[0]) for r in rows)
    print(f"{'':<{w}}  {'slurmagent':>26}  {'baseline':>24}")
    for label, a, b in rows:
        print(f"{label:<{w}}  {a:>26}  {b:>24}")
    print(f"\nslurmagent repair: {sa_rep['get']} instances.get (MIG cache cold), {sa_rep['recreate']} recreateInstances, "
          f"{sa_rep['ops']} operation polls; hook scontrol calls by kind: "
          + json.dumps(_kinds(sa_calls)))
    print("baseline: plain `exit 1` prolog (Slurm drains with 'Prolog error'); naive repair = per node: "
          "show node, instances.get, set reason, recreateInstances of one instance, poll its operation")
    ok = sa_rep["recreate"] <= len({i // args.mig_size for i, n in enumerate(names) if n in bad})
    print(f"\ntarget one recreateInstances per MIG: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


def _kinds(calls: list[list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        key = " ".join(w for w in c if not w.startswith("NodeName=") and not w.startswith("-"))[:20]
        key = "show node" if "show" in c else ("update" if "update" in c else key)
        out[key] = out.get(key, 0) + 1
    return out


if __name__ == "__main__":
    sys.exit(main())
