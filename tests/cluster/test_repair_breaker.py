"""The drain circuit breaker on a real 8-node Slurm cluster: a burst of 4 failing nodes with
the limit at 25% leaves exactly 2 drained and 2 suppressed (and visible); so does slurmagent's
own internal error on 4 nodes with `on_internal_error = "closed"` (the suppressed prologs let
their jobs run); a flex cohort of 4 nodes expiring together is drained 4 of 4 and counts
nothing toward the limit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from support import REPO, cluster_config_text, healthy_snapshot_dict, hook_shim, need_slurm, wait_for, write_json
from slurmagent.slurm.model import node_from_kv, parse_kv
from slurmagent.devtools.localcluster import LocalSlurmCluster

pytestmark = pytest.mark.slurm

NODES = [f"n{i}" for i in range(1, 9)]
POWER_BRAKE = "hw_power_brake_slowdown"


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    need_slurm()
    root = tmp_path_factory.mktemp("breaker")
    root.chmod(0o755)
    (root / "kern").mkdir()
    for n in NODES:
        write_json(root / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
        (root / "kern" / f"{n}.log").touch()
    config = root / "config.toml"
    write_config(config, root)
    (root / "hooks").mkdir()
    cluster = LocalSlurmCluster(root / "slurm", nodes=NODES, prolog=str(hook_shim(root / "hooks" / "prolog", "prolog", config)))
    cluster.start()
    yield cluster, root, config
    cluster.stop()


def write_config(config, root, **hooks: str) -> None:
    """The cluster's one config (the prolog shim reads it too); `hooks` adds `[hooks]` keys."""
    extra = "".join(f'{k} = "{v}"\n' for k, v in hooks.items())
    text = cluster_config_text(root).replace("[hooks]\nsyslog = false\n", f"[hooks]\nsyslog = false\n{extra}")
    config.write_text(text + '[expiry]\npublish_run_file = false\n'
                      '[repair]\nmax_drained_fraction = 0.25\nstrategy = "none"\n')


def prologs_at_once(cluster, config, nodes):
    env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO))
    procs = {n: subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "prolog"],
                                 env=dict(env, SLURMD_NODENAME=n, SLURM_JOB_ID=str(880000 + i)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, n in enumerate(nodes)}
    results = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=60)
        results[n] = (p.returncode, err)
    return results


def views(cluster):
    proc = cluster.run(["scontrol", "-o", "show", "node"], check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    return {v.name: v for v in (node_from_kv(parse_kv(line)) for line in out.splitlines() if line)}


def reset(cluster, root):
    write_config(root / "config.toml", root)
    for n in NODES:
        write_json(root / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
        (root / "state" / n / "expiry.json").unlink(missing_ok=True)
    cluster.run(["scontrol", "update", "nodename=n[1-8]", "comment="], check=False)
    cluster.reset_nodes()


def slurmagent(cluster, config, *args, **env):
    e = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=e, capture_output=True, text=True,
                          timeout=60)


def set_fault(root, node, fault):
    snap = healthy_snapshot_dict(hostname=node)
    if fault == "power-brake":
        snap["gpus"][0]["clocks_event_reasons"] = [POWER_BRAKE]
    elif fault == "gpu-lost":
        snap["gpus"][2] = {"index": 2, "lost": True}
    write_json(root / "snap" / f"{node}.json", snap)


def test_burst_of_four_with_limit_25_percent_drains_exactly_two(eight, capfd):
    cluster, root, config = eight
    reset(cluster, root)
    bad = ["n2", "n4", "n5", "n7"]
    for n in bad:
        set_fault(root, n, "power-brake")  # e.g. a facility power event: the same fault everywhere

    results = prologs_at_once(cluster, config, bad)

    v = views(cluster)
    drained = sorted(n for n in bad if v[n].ours)
    suppressed = sorted(n for n in bad if v[n].marks.suppressed_at is not None)
    assert len(drained) == 2, (results, {n: (v[n].state, v[n].reason, v[n].comment) for n in bad})
    assert len(suppressed) == 2 and not set(drained) & set(suppressed)
    assert all(v[n].reason.startswith("slurmagent: hw-slowdown: gpu 0") for n in drained)
    assert not any(v[n].drained for n in suppressed)  # still in service
    assert not any(v[n].drained for n in NODES if n not in bad)
    for n in drained:
        assert results[n][0] == 1
    for n in suppressed:  # power brake: the GPUs work, slower; the job may run (breaker open)
        assert results[n][0] == 0, results[n]
        assert "CIRCUIT BREAKER" in results[n][1]

    # visible cluster-wide: status and the journal of each node
    env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO))
    st = subprocess.run([sys.executable, "-m", "slurmagent.entry", "status", "--json"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 1, st.stderr  # problems found: the faults, the breaker
    data = json.loads(st.stdout)
    assert data["breaker"]["state"] == "open" and data["exit_code"] == 1
    assert "the drain circuit breaker is OPEN" in data["problems"]
    assert data["breaker"]["drained"] == drained and data["breaker"]["suppressed"] == suppressed
    rows = {r["node"]: r for r in data["nodes"]}
    assert all(rows[n]["repair"].startswith("suppressed by breaker") and rows[n]["rule"] == "hw-slowdown"
               for n in suppressed)
    table = subprocess.run([sys.executable, "-m", "slurmagent.entry", "status"], env=env, capture_output=True,
                           text=True, timeout=60).stdout
    assert "breaker: OPEN: 2 of 8 nodes drained by slurmagent, limit 2 (25%)" in table
    # repairs are held back too (strategy none here: the plan is what counts)
    rep = subprocess.run([sys.executable, "-m", "slurmagent.entry", "repair", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "CIRCUIT BREAKER OPEN" in rep.stderr

    # an admin who knows better overrides the breaker for one node
    forced = suppressed[1]
    rep = subprocess.run([sys.executable, "-m", "slurmagent.entry", "repair", "--force", forced], env=env,
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    assert f"{forced}: drained (breaker overridden) (--force)" in rep.stdout
    after = views(cluster)[forced]
    assert after.ours and after.reason.startswith("slurmagent: hw-slowdown: gpu 0") and after.marks.empty

    # a suppressed node that turns healthy clears its mark on its next (healthy) prolog
    n = suppressed[0]
    write_json(root / "snap" / f"{n}.json", healthy_snapshot_dict(hostname=n))
    assert prologs_at_once(cluster, config, [n])[n][0] == 0
    assert views(cluster)[n].marks.suppressed_at is None


def test_suppressed_node_with_a_lost_gpu_still_keeps_the_job_off(eight):
    cluster, root, config = eight
    reset(cluster, root)
    bad = ["n1", "n3", "n6"]
    for n in bad:
        set_fault(root, n, "gpu-lost")

    results = prologs_at_once(cluster, config, bad)

    # a lost GPU keeps the job off whatever the breaker says: the prologs exit at once and leave
    # the breaker's second read to a detached process, which undoes a drain beyond the limit
    v = wait_for(lambda: (lambda v: v if sum(v[n].ours for n in bad) <= 2 else None)(views(cluster)), 30,
                 "the breaker's detached checks to undo the drains beyond the limit")
    assert sorted(n for n in bad if v[n].ours).__len__() == 2
    assert all(code == 1 for code, _ in results.values())  # no job runs on a lost GPU, breaker or not
    [loser] = [n for n in bad if not v[n].ours]
    assert v[loser].marks.suppressed_at is not None and "gpu-lost" in v[loser].marks.suppressed_summary


def test_internal_error_on_half_the_cluster_drains_only_the_limit_and_lets_the_others_run(eight):
    """A bad rollout (the agent itself fails on 4 of 8 nodes) with fail-closed hooks must not
    drain the cluster: the breaker holds it to 2, and the other prologs pass, so their jobs run."""
    cluster, root, config = eight
    reset(cluster, root)
    write_config(config, root, on_internal_error="closed")
    bad = ["n1", "n3", "n6", "n8"]
    for n in bad:
        (root / "snap" / f"{n}.json").write_bytes(b'{"schema": 1, "gpus": [{"index": "zero"')  # agent bug, not a GPU
    jobs = {n: cluster.sbatch("-w", n, "-J", f"ie-{n}", "-o", "/dev/null", "--wrap", "true") for n in bad}

    def decision(n):
        """The prolog's record of its job: written last, after its drain and any undo of it."""
        mine = [d for d in read_decisions(root, n) if d.get("job") == jobs[n] and d.get("verdict") == "internal-error"]
        return mine[-1] if mine else None

    def settled():
        # Slurm shows a drain before the prolog is done: a drain that lost the breaker's race is
        # undone ~1 s later. Done means every prolog logged its decision and each job it let run ran.
        decided = {n: decision(n) for n in bad}
        if not all(decided.values()):
            return None
        let_run = [n for n, d in decided.items() if "suppressed-by-breaker" in d["action"]]
        return decided if all(cluster.job(jobs[n]).get("JobState") == "COMPLETED" for n in let_run) else None

    decisions = wait_for(settled, 90, "every prolog to log its decision and the jobs it let run to complete")
    v = views(cluster)
    drained = [n for n in bad if v[n].ours]
    assert len(drained) == 2, {n: (v[n].state, v[n].reason, v[n].comment, decisions[n]["action"]) for n in bad}
    assert all(v[n].reason.startswith("slurmagent: internal error: ") for n in drained)
    ran = [n for n in bad if n not in drained]
    for n in ran:  # suppressed: not drained, the prolog passed, the job ran on it
        job = cluster.job(jobs[n])
        assert job["JobState"] == "COMPLETED" and job["NodeList"] == n, job
        assert not v[n].drained and v[n].marks.suppressed_at is not None
        assert "internal error" in v[n].marks.suppressed_summary
    assert not any(v[n].drained for n in NODES if n not in bad)
    for n in drained:
        assert decisions[n]["action"] == "drain (fail closed)"
    for n in ran:
        assert decisions[n]["action"].startswith("drain (fail closed) suppressed-by-breaker")
    st = json.loads(slurmagent(cluster, config, "status", "--json").stdout)
    assert st["breaker"]["drained"] == sorted(drained) and st["breaker"]["suppressed"] == sorted(ran)


def test_a_flex_cohort_expiring_together_is_drained_whole_and_counts_nothing(eight):
    cluster, root, config = eight
    reset(cluster, root)
    cohort = ["n2", "n3", "n4", "n5"]
    end = time.time() + 600  # inside the 30 min drain lead
    write_config(config, root)
    config.write_text(config.read_text().replace("[expiry]\n", f'[expiry]\ntermination_time = "{iso(end)}"\n'
                                                                 "metadata_timeout_s = 0.5\n"))
    before = json.loads(slurmagent(cluster, config, "status", "--json").stdout)["breaker"]
    env = dict(cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), GCE_METADATA_HOST="127.0.0.1:9")
    procs = [subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "expiry-watch", "--once", "--node", n],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in cohort]
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == 0
    v = views(cluster)
    assert all(v[n].drained and v[n].reason == f"slurmagent: expiry: flex expiry at {iso(end)}" for n in cohort), \
        {n: (v[n].state, v[n].reason) for n in cohort}
    after = json.loads(slurmagent(cluster, config, "status", "--json").stdout)["breaker"]
    assert before["drained"] == after["drained"] == [] and after["state"] == "closed"
    # the breaker's two slots are still free: two GPU faults elsewhere are both drained
    for n in ("n7", "n8"):
        set_fault(root, n, "power-brake")
    results = prologs_at_once(cluster, config, ["n7", "n8"])
    v = views(cluster)
    assert all(v[n].ours and v[n].reason.startswith("slurmagent: hw-slowdown") for n in ("n7", "n8")), results
    assert json.loads(slurmagent(cluster, config, "status", "--json").stdout)["breaker"]["drained"] == ["n7", "n8"]
    for n in cohort:
        (root / "state" / n / "expiry.json").unlink(missing_ok=True)


def read_decisions(root, node):
    from slurmagent.state.decisionlog import read_records

    return read_records(root / "state" / node / "hooks.log")


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
