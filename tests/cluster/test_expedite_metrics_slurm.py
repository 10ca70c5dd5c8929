"""What Slurm 25.11+ does for slurmagent, on a real local cluster with it switched on
(`SlurmctldParameters=enable_expedited_requeue`, `MetricsType=metrics/openmetrics`): the forky
lane's Slurm 26.05. Skipped, with the reason, on older Slurm (the host's 22.05, trixie's 24.11).

* `slurmagent sbatch` submits `--requeue=expedite`: when the batch node dies (its slurmd and
  every process of the job killed) Slurm requeues the job and starts it on another node at once,
  where a plain `--requeue` job first waits `requeue_delay` (= cred_expire, 20 s here; 120 s by
  default) with Reason=BeginTime; the wrapper's own `scontrol requeue` skips that wait too.
* slurmctld's OpenMetrics endpoint on 127.0.0.1:SlurmctldPort parses with prometheus_client's
  parser, and every `slurm_*` metric our contrib/ files name is there; `doctor` says both are on.

The seconds each restart took are printed (`pytest -s`); bench/expedite_requeue.py measures them.
The decisions without a cluster: tests/unit/test_slurm_features.py, tests/unit/test_cli.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from slurmagent.devtools.localcluster import LocalSlurmCluster, _sbin
from slurmagent.slurm.features import METRICS_PATHS, SINCE, SlurmFeatures, parse_version
from support import REPO, cluster_config_text, need_slurm, wait_for

pytestmark = pytest.mark.slurm

CONTRIB = [REPO / "contrib/prometheus/scrape.yml", REPO / "contrib/prometheus/slurmctld_alerts.yml",
           REPO / "contrib/prometheus/slurmctld_alerts_test.yml"]
LEDGER_CMD = 'echo "start ${SLURM_RESTART_COUNT:-0} $SLURMD_NODENAME" >> "$0"; exec sleep 600'


def running_slurm_version() -> tuple[int, ...]:
    """slurmctld -V's version ("slurm-wlm 22.05.8" -> (22, 5, 8)). One that cannot be read fails
    the tests: only a version read, and older than 25.11, skips them."""
    proc = subprocess.run([_sbin("slurmctld"), "-V"], capture_output=True, text=True, timeout=10)
    version = parse_version(proc.stdout.split()[-1] if proc.stdout.split() else "")
    if len(version) < 2:
        pytest.fail(f"cannot read the Slurm version from `slurmctld -V` (rc {proc.returncode}): "
                    f"{proc.stdout.strip()[:200]!r} {proc.stderr.strip()[:200]!r}", pytrace=False)
    return version


@pytest.fixture(scope="module")
def c2511(tmp_path_factory):
    need_slurm()
    version = running_slurm_version()
    if version < SINCE:
        pytest.skip(f"Slurm {SlurmFeatures(version=version).version_text} has neither --requeue=expedite nor slurmctld's "
                    "metrics endpoint (both came in 25.11)")
    root = tmp_path_factory.mktemp("s2511")
    root.chmod(0o755)
    (root / "config.toml").write_text(cluster_config_text(root) + "[checkpoint]\ngrace_s = 10.0\n")
    # SlurmdTimeout=12: a dead slurmd is noticed in seconds, not the default 300
    cluster = LocalSlurmCluster(root / "slurm", nodes=["n1", "n2", "n3"], ctld_params=["enable_expedited_requeue"],
                                extra_conf=["MetricsType=metrics/openmetrics", "SlurmdTimeout=12"])
    cluster.start()
    yield cluster, root
    cluster.stop()


def submit(c2511, tmp_path: Path, *sbatch_opts: str) -> tuple[str, Path, str]:
    """`slurmagent sbatch [opts] -- CMD`, CMD logging each start; (job id, its ledger, sbatch's stderr)."""
    cluster, root = c2511
    ledger = tmp_path / "ledger"
    env = dict(cluster.env, SLURMAGENT_CONFIG=str(root / "config.toml"), PYTHONPATH=str(REPO))
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", *sbatch_opts,
                          "-o", str(tmp_path / "out"), "--open-mode=append", "--", "--ckpt-dir",
                          str(tmp_path / "ckpt-%n"), "--", "sh", "-c", LEDGER_CMD, str(ledger)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0], ledger, sub.stderr


def starts(ledger: Path) -> list[str]:
    return [line.split()[2] for line in ledger.read_text().splitlines()] if ledger.exists() else []


def restart_after(cluster: LocalSlurmCluster, job_id: str, ledger: Path, event) -> tuple[float, str, set[str]]:
    """`event()`, then until the job's second attempt has started: (seconds, its node, reasons seen)."""
    reasons: set[str] = set()
    t0 = time.monotonic()
    event()

    def second_start() -> bool:
        job = cluster.job(job_id)
        if job.get("JobState") == "PENDING":
            reasons.add(job.get("Reason", ""))
        return len(starts(ledger)) >= 2

    wait_for(second_start, 180, f"job {job_id}'s second attempt", interval=0.1)
    return time.monotonic() - t0, starts(ledger)[1], reasons


def first_start(cluster: LocalSlurmCluster, job_id: str, ledger: Path) -> str:
    cluster.wait_job(job_id, ("RUNNING",), 60)
    wait_for(lambda: starts(ledger), 60, "the first attempt")
    return starts(ledger)[0]


def bring_back(cluster: LocalSlurmCluster, node: str, job_id: str) -> None:
    cluster.run(["scancel", job_id], check=False)
    cluster.start_node(node)
    cluster.reset_nodes(90)


def test_a_dead_node_restarts_the_expedited_job_elsewhere_without_the_requeue_delay(c2511, tmp_path):
    cluster, _ = c2511
    figures = {}
    for how, opts in (("expedite", ()), ("plain", ("--requeue",))):  # the user's own --requeue wins
        job_id, ledger, said = submit(c2511, tmp_path / how, *opts)
        job = cluster.job(job_id)
        assert (job.get("ExpeditedRequeue") == "Yes") is (how == "expedite"), job
        assert ("--requeue=expedite" in said) is (how == "expedite"), said
        first = first_start(cluster, job_id, ledger)
        seconds, second, reasons = restart_after(cluster, job_id, ledger, lambda: cluster.kill_node(first, job_id))
        try:
            assert second != first
            assert cluster.job(job_id)["Restarts"] == "1"
            # a plain requeue waits requeue_delay (cred_expire) as BeginTime; the expedited one never does
            assert ("BeginTime" in reasons) is (how == "plain"), reasons
        finally:
            bring_back(cluster, first, job_id)
        figures[how] = seconds
    print(f"\nnode death -> running again elsewhere (SlurmdTimeout=12, cred_expire=20): "
          f"--requeue=expedite {figures['expedite']:.1f} s, --requeue {figures['plain']:.1f} s")


def test_the_wrappers_own_requeue_of_an_expedited_job_restarts_at_once(c2511, tmp_path):
    cluster, _ = c2511
    job_id, ledger, said = submit(c2511, tmp_path)
    assert "--requeue=expedite" in said
    first_start(cluster, job_id, ledger)
    # the end-of-time signal: the wrapper flushes, then runs `scontrol requeue` on its own job
    seconds, _, reasons = restart_after(cluster, job_id, ledger,
                                        lambda: cluster.run(["scancel", "--batch", "--signal=TERM", job_id]))
    try:
        assert "requeued job" in (tmp_path / "out").read_text()
        assert "BeginTime" not in reasons, reasons
    finally:
        cluster.run(["scancel", job_id], check=False)
        cluster.reset_nodes(60)
    print(f"\nthe wrapper's own requeue of an expedited job -> running again in {seconds:.1f} s")


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Every endpoint of slurmctld parsed by prometheus_client: {metric: {labels: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for path in METRICS_PATHS:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_slurmctlds_own_metrics_parse_and_hold_every_name_contrib_uses(c2511):
    cluster, _ = c2511
    port = cluster.ctld_port
    cluster.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=test: drained"])
    try:
        got = wait_for(lambda: (lambda m: m if m["slurm_nodes_drain"][()] == 1 else None)(scrape(port)), 30,
                       "n3 counted as drained")
    finally:
        cluster.resume("n3")
    assert got["slurm_nodes"][()] == 3
    assert got["slurm_node_cpus"][(("node", "n1"),)] == 2
    assert got["slurm_partition_nodes"][(("partition", "gpu"),)] == 3
    named = set()
    for path in CONTRIB:
        named |= set(re.findall(r"\bslurm_[a-z_]+", path.read_text()))
    assert named and named <= set(got), f"not exported by slurmctld: {sorted(named - set(got))}"


def test_doctor_says_what_the_running_slurm_does_for_us(c2511):
    cluster, root = c2511
    cfg = root / "doctor.toml"
    cfg.write_text(cluster_config_text(root) + f'[slurm]\nconf = "{cluster.conf}"\n')
    env = dict(cluster.env, PYTHONPATH=str(REPO), SLURMD_NODENAME="n1", GCE_METADATA_HOST="127.0.0.1:9")
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(cfg), "doctor", "--json"],
                          capture_output=True, text=True, timeout=60, env=env)
    row = next(c for c in json.loads(proc.stdout)["checks"] if c["name"] == "slurm 25.11+ features")
    assert row["status"] == "ok", row
    assert "expedited requeue on: slurmagent sbatch submits --requeue=expedite" in row["detail"]
    assert f"slurmctld metrics on at http://127.0.0.1:{cluster.ctld_port}/metrics " in row["detail"]
