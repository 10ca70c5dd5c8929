"""Expiry watch on the real local Slurm cluster (n1..n3) with the fake Compute API/metadata
server (tests/support/fake_gcp_expiry.py) and the GCS emulator: drain ahead, the wrapper's own flush
at the lead, an immediate flush on a maintenance notice, the prolog guard.

Timing (parallel lanes): the flush at the lead has 100 s of lead to resume in; the notice's
flush must come well before the loop's next check (--interval 120), not within seconds. The
flush-at-lead test runs in the serial group: in four whole CI runs (stop 43 and 44) its job was
not restarted within 150 s in the forky lane's parallel part, while it passed alone, in a
loaded subset and in a whole forky lane run by hand; its failure now says the job's and the
nodes' state and the wrapper's words (the cause is still open)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from support import REPO, SUPPORT, cluster_config_text, wait_for
from support.fake_gcp_expiry import FakeGcpExpiry
from slurmagent.state.host import boot_id as current_boot_id

pytestmark = pytest.mark.slurm

TOY = str(SUPPORT / "toy_trainer.py")
ZONE = "us-central1-a"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def clean_expiry(env) -> None:
    for d in (env.root / "state").glob("*"):
        (d / "expiry.json").unlink(missing_ok=True)


@pytest.fixture
def env(slurm):
    """The session cluster with no expiry state anywhere before and after (the cluster's own
    prolog reads <state_dir>/expiry.json: a leftover would requeue other tests' jobs)."""
    clean_expiry(slurm)
    yield slurm
    clean_expiry(slurm)


@pytest.fixture
def gcp(serve_metadata):
    fake = serve_metadata(FakeGcpExpiry())
    for n in ("n1", "n2", "n3"):
        fake.add_instance(n, ZONE)
    fake.set_identity("n1", ZONE)
    return fake


def gcp_section(gcp) -> str:
    return f'[gcp]\nproject = "{gcp.project}"\nzone = "{ZONE}"\ncompute_endpoint = "{gcp.url}"\n'


def ledger_steps(ledger: Path) -> list[int]:
    return [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("step ")]


def node_reason(c, name: str) -> str:
    return re.sub(r" \[[^\]]*@[^\]]*\]$", "", c.node(name).get("Reason", ""))  # without "[user@time]"


def submit_wrapped(c, env: dict, out: Path, ckpt: Path, ledger: Path, total: int, *sbatch_opts: str) -> str:
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--open-mode=append",
         *sbatch_opts, "--", "--ckpt-dir", str(ckpt), "--", sys.executable, TOY, str(total), str(ledger), "0.05"],
        env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def test_watch_drains_10_min_left_not_3_h_and_keeps_admin_reason(env, gcp, tmp_path, monkeypatch, capsys):
    from slurmagent.cli import main

    c = env.cluster
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    now = time.time()
    gcp.set_scheduling("n1", termination=iso(now + 600))
    gcp.set_scheduling("n2", termination=iso(now + 3 * 3600), field_name="scheduling")
    gcp.set_scheduling("n3", termination=iso(now + 600))
    c.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=admin: swap PSU"])
    config = tmp_path / "w.toml"
    config.write_text(cluster_config_text(env.root) + gcp_section(gcp) + "[expiry]\npublish_run_file = false\n")
    for node in ("n1", "n2", "n3"):
        assert main(["--config", str(config), "expiry-watch", "--once", "--node", node]) == 0
    out, err = capsys.readouterr()
    assert err == "", err
    assert node_reason(c, "n1") == f"slurmagent: expiry: flex expiry at {iso(now + 600)}"
    assert "DRAIN" in c.node("n1")["State"]
    assert "DRAIN" not in c.node("n2")["State"]
    assert node_reason(c, "n3").startswith("admin: swap PSU")
    states = {n: json.loads((env.state_dir(n) / "expiry.json").read_text()) for n in ("n1", "n2", "n3")}
    assert states["n1"]["drained"] and states["n1"]["drain"] == "drained" and states["n1"]["source"] == "compute-api"
    assert not states["n2"].get("drained") and states["n2"]["termination_time"] == iso(now + 3 * 3600)
    assert states["n3"]["drain"] == "kept-admin-drain"
    status = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(config), "status", "--json"],
                            env=dict(c.env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert 300 <= json.loads(status.stdout)["expiry"]["n1"]["in_s"] <= 600  # minutes left (the runs above may take one), not hours


@pytest.mark.slow
@pytest.mark.serial
def test_wrapped_job_flushes_at_lead_and_resumes_elsewhere_before_termination(env, gcs_emulator, tmp_path):
    """Termination 120 s away, flush lead 100 s: the wrapper flushes on its own from the state
    file 20 s from now, requeues; the job restarts on another node (cred_expire 5 s + 1) before
    the end. At load average 12 on 2 cores it resumed 28-34 s after the watch ran (86-92 s
    before the end); the rest of the lead is room for a more loaded machine."""
    c = env.cluster
    base = (cluster_config_text(env.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 1.0\n'
            'grace_s = 10.0\n[expiry]\nflush_lead_s = 100.0\npublish_run_file = false\n')
    job_config = tmp_path / "job.toml"
    job_config.write_text(base)
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    env_job = dict(c.env, SLURMAGENT_CONFIG=str(job_config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=gcs_emulator.url)
    job_id = submit_wrapped(c, env_job, out, tmp_path / "ckpt-%n", ledger, 800)
    first = c.wait_job(job_id, ("RUNNING",), 60)["NodeList"]
    wait_for(lambda: ledger.exists() and len(ledger_steps(ledger)) >= 10, 60, "10 steps")

    end = time.time() + 120
    watch_config = tmp_path / "watch.toml"
    watch_config.write_text(base + f'termination_time = "{iso(end)}"\n')
    w = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(watch_config), "expiry-watch",
                        "--once", "--node", first], env=dict(c.env, PYTHONPATH=str(REPO), GCE_METADATA_HOST="127.0.0.1:9"),
                       capture_output=True, text=True, timeout=60)
    assert w.returncode == 0 and "drained (slurmagent: expiry: flex expiry at" in w.stdout, w.stdout + w.stderr
    assert node_reason(c, first).startswith("slurmagent: expiry: flex expiry at")

    def restarted():
        j = c.job(job_id)
        return j if j["JobState"] == "RUNNING" and int(j.get("Restarts", 0)) >= 1 else None

    try:
        resumed = wait_for(restarted, 150, "the restart on another node")
    except AssertionError:  # say where it stands: the job, the nodes, the wrapper's words
        raise AssertionError(f"no restart: job {c.job(job_id)}; nodes {[c.node(n) for n in c.nodes]}; "
                             f"wrapper: {out.read_text()[-3000:] if out.exists() else ''}") from None
    resumed_at = time.time()
    assert resumed["NodeList"] != first
    assert resumed_at < end, f"resumed {resumed_at - end:.1f} s after the termination time"
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 90,
                   "job end")
    log = out.read_text()
    assert job["JobState"] == "COMPLETED", log
    assert "VM expiry in" in log and "requeued job" in log and "restored checkpoint of attempt 0" in log, log
    assert ledger_steps(ledger) == list(range(1, 801))  # none lost, none done twice
    ckpts = [line for line in ledger.read_text().splitlines() if line.startswith("ckpt")]
    assert len(ckpts) == 1  # the flush checkpoint


@pytest.mark.slow
def test_maintenance_notice_flushes_at_once_and_requeues_unwrapped(env, gcp, gcs_emulator, tmp_path):
    c = env.cluster
    gcp.set_scheduling("n3", model="STANDARD")  # no termination time: only the notice
    vm = gcp.instances[(ZONE, "n3")]
    vm.gpus, vm.machine_type = 0, "n2-standard-8"  # no GPU: the notice means T = now + 60 s, flush at once
    base = (cluster_config_text(env.root) + gcp_section(gcp) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
            'sync_interval_s = 1.0\ngrace_s = 10.0\n[expiry]\npublish_run_file = false\n')
    config = tmp_path / "c.toml"
    config.write_text(base)
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    env_job = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=gcs_emulator.url)
    wrapped = submit_wrapped(c, env_job, out, tmp_path / "ckpt-%n", ledger, 100000, "-w", "n3")
    plain = c.sbatch("-w", "n3", "-o", "/dev/null", "--wrap", "sleep 300")
    c.wait_job(wrapped, ("RUNNING",), 60)
    c.wait_job(plain, ("RUNNING",), 60)
    wait_for(lambda: ledger.exists() and len(ledger_steps(ledger)) >= 10, 60, "10 steps")

    watch_env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), GCE_METADATA_HOST=gcp.host)
    err = open(tmp_path / "watch.err", "w+")
    # --interval 120: a check at start, the next only 2 minutes later; the notice must not wait for it
    proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "expiry-watch", "--node", "n3", "--interval", "120"],
                            env=watch_env, stdout=err, stderr=subprocess.STDOUT)
    state_file = env.state_dir("n3") / "expiry.json"
    try:
        wait_for(lambda: state_file.exists() and gcp.waits.count("instance/maintenance-event") >= 1, 30,
                 "the watch long-polling")
        assert "DRAIN" not in c.node("n3")["State"]
        gcp.set_event("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        # at once (the long poll wakes the loop): idle within a second; 30 s is room for a loaded
        # machine, and far from the loop's next check (--interval 120)
        wait_for(lambda: json.loads(state_file.read_text()).get("flushed"), 30, "the flush, at once")
        wait_for(lambda: "requeued job" in out.read_text(), 40, "the wrapper's flush and requeue")
        wait_for(lambda: int(c.job(plain).get("Restarts", 0)) >= 1, 30, "the unwrapped job requeued")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
    assert code == 0
    log = out.read_text()
    assert "SIGUSR1: asking the job to checkpoint" in log, log
    assert node_reason(c, "n3").startswith("slurmagent: maintenance: TERMINATE_ON_HOST_MAINTENANCE")
    state = json.loads(state_file.read_text())
    assert state["source"] == "maintenance-event" and state["flush_cause"] == "TERMINATE_ON_HOST_MAINTENANCE notice"
    assert state["flushed_jobs"] == [wrapped] and state["requeued_jobs"] == [plain]
    assert c.job(plain)["JobState"] in ("PENDING", "REQUEUED", "RUNNING", "CONFIGURING")  # requeued, not FAILED
    err.seek(0)
    watch_log = err.read()
    assert "TERMINATE_ON_HOST_MAINTENANCE notice" in watch_log, watch_log


def test_prolog_guard_requeues_job_longer_than_the_lifetime(env, tmp_path):
    c = env.cluster
    state = env.state_dir("n1") / "expiry.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    end = time.time() + 300
    state.write_text(json.dumps({"schema": 1, "boot_id": current_boot_id(), "termination_time": iso(end),
                                 "source": "config"}))
    short = c.sbatch("-w", "n1", "-t", "1", "-o", "/dev/null", "--wrap", "true")  # 1 min + 120 s lead < 5 min
    assert c.wait_job(short, ("COMPLETED", "FAILED"), 60)["JobState"] == "COMPLETED"
    assert "DRAIN" not in c.node("n1")["State"]

    for n in ("n2", "n3"):
        c.run(["scontrol", "update", f"nodename={n}", "state=drain", "reason=test: keep off"])
    out = tmp_path / "out"
    long = c.sbatch("-t", "60", "-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
    wait_for(lambda: [d for d in env.decisions("n1") if d.get("job") == long and d.get("verdict") == "expiry"], 30,
             "the guard's decision")
    job = c.wait_job(long, ("PENDING",), 30)  # COMPLETING for a moment after the prolog failed
    assert "held" not in job["Reason"].lower() and int(job["Restarts"]) >= 1, job
    assert node_reason(c, "n1") == f"slurmagent: expiry: flex expiry at {iso(end)}"
    decision = [d for d in env.decisions("n1") if d.get("job") == long and d.get("verdict") == "expiry"][0]
    assert decision["action"] == "drained,requeue" and "time limit 01:00:00" in decision["detail"]
    c.resume("n2", "n3")
    job = c.wait_job(long, ("COMPLETED", "FAILED"), 90)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] in ("n2", "n3") and int(job["Restarts"]) >= 1
    assert "ran on n" in out.read_text()


@pytest.mark.slow
def test_gpu_vm_hour_notice_drains_at_the_lead_flushes_only_at_the_flush_lead(env, gcp, gcs_emulator, tmp_path,
                                                                              monkeypatch):
    """A GPU VM whose metadata says TERMINATE_ON_HOST_MAINTENANCE with a window 60 min away, the
    watch on a compressed clock: drained at T - drain lead with the wrapped job still training,
    not flushed until T - flush lead; then flushed, requeued, and running again elsewhere."""
    from slurmagent.state.config import load
    from slurmagent.commands.expiry import ExpiryWatch
    from slurmagent.gcp.events import probe_events
    from slurmagent.slurm.commands import Slurm

    c = env.cluster
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    start = time.time()
    window = start + 3600
    gcp.set_scheduling("n3", model="STANDARD")  # a GPU VM (a3-highgpu-8g, 8 GPUs) without an end of its own
    gcp.set_maintenance("n3", iso(window))
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(env.root) + gcp_section(gcp) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      'sync_interval_s = 1.0\ngrace_s = 10.0\n[expiry]\npublish_run_file = false\n')
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    env_job = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=gcs_emulator.url)
    for n in ("n1", "n2"):  # both jobs start on n3; the restarts may go anywhere
        c.run(["scontrol", "update", f"nodename={n}", "state=drain", "reason=test: keep off"])
    wrapped = submit_wrapped(c, env_job, out, tmp_path / "ckpt-%n", ledger, 100000)
    plain = c.sbatch("-o", "/dev/null", "--wrap", "sleep 300")
    assert c.wait_job(wrapped, ("RUNNING",), 60)["NodeList"] == "n3"
    assert c.wait_job(plain, ("RUNNING",), 60)["NodeList"] == "n3"
    c.resume("n1", "n2")
    wait_for(lambda: ledger.exists() and len(ledger_steps(ledger)) >= 10, 60, "10 steps")

    class Clock:
        t = start

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    cfg = load(str(config))
    watch = ExpiryWatch(cfg, "n3", Slurm.from_config(cfg), clock=clock)
    gcp.set_event("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")

    res = watch.check(probe_events(2.0))  # T - 60 min
    assert res.state["termination_time"] == iso(window) and res.state["source"] == "maintenance-event"
    assert "DRAIN" not in c.node("n3")["State"] and not res.state.get("flushed")

    clock.t = window - 1800 + 1  # T - drain lead
    res = watch.check(probe_events(2.0))
    assert node_reason(c, "n3") == f"slurmagent: maintenance: TERMINATE_ON_HOST_MAINTENANCE (VM stops at about {iso(window)})"
    assert "DRAIN" in c.node("n3")["State"] and not res.state.get("flushed")
    steps = len(ledger_steps(ledger))
    wait_for(lambda: len(ledger_steps(ledger)) >= steps + 10, 60, "the job training on while drained")
    assert c.job(wrapped)["JobState"] == "RUNNING" and c.job(plain)["JobState"] == "RUNNING"
    assert "ckpt" not in ledger.read_text() and "SIGUSR1" not in out.read_text()

    clock.t = window - 120 + 1  # T - flush lead
    res = watch.check(probe_events(2.0))
    assert res.state["flushed"] and res.state["flush_cause"] == "TERMINATE_ON_HOST_MAINTENANCE notice"
    assert res.state["flushed_jobs"] == [wrapped] and res.state["requeued_jobs"] == [plain]
    wait_for(lambda: "requeued job" in out.read_text(), 60, "the wrapper's flush and requeue")

    def restarted():
        j = c.job(wrapped)
        return j if j["JobState"] == "RUNNING" and int(j.get("Restarts", 0)) >= 1 else None

    again = wait_for(restarted, 90, "the wrapped job running again")
    assert again["NodeList"] != "n3"
    assert int(c.job(plain).get("Restarts", 0)) >= 1
    wait_for(lambda: "resumed=1" in ledger.read_text(), 60, "the restart from the checkpoint")
    ckpt = [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("ckpt")]
    resumed = [line for line in ledger.read_text().splitlines() if line.startswith("start ") and "resumed=1" in line]
    assert ckpt and resumed and int(resumed[0].split()[1]) == ckpt[0]  # no step lost after the flush
