"""The metrics of a default install reach Prometheus: Debian's real prometheus-node-exporter,
run as the package runs it (user `prometheus`), reads the textfile of an installed staging
root, and a real Prometheus scrapes it with the shipped alerts loaded. Before: the default
textfile sat in the 0750 root state dir (`permission denied`, node_textfile_scrape_error 1),
and no alert said so for one node (`absent()` sees only the whole fleet).

The staging root is a 0755 directory under /tmp: pytest's tmp_path sits under a 0700 directory
that `prometheus` cannot enter. Needs root (to run node_exporter as `prometheus`), Debian's
`prometheus` and `prometheus-node-exporter` (test_observability_prometheus's rules for them)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict, wait_for, write_json
from test_observability_prometheus import ALERTS, _free_port, _query, _tool

NODE = "n1"
DEBIAN_TEXTFILE_DIR = "var/lib/prometheus/node-exporter"  # what the package ships, root:root 0755

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run node_exporter as `prometheus`")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", ""), **(env or {})})


def _as_prometheus(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, user="prometheus", group="prometheus")


@pytest.fixture
def staging_root():
    root = Path(tempfile.mkdtemp(prefix="slurmagent-metrics-", dir="/tmp"))
    try:
        root.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root)


def _installed_node(root: Path, tmp_path: Path) -> Path:
    """`install --root` over a root that has Debian's textfile dir, then one real healthcheck
    run with the installed config (its paths inside the root); returns the textfile."""
    textdir = root / DEBIAN_TEXTFILE_DIR
    textdir.mkdir(parents=True)
    for d in [textdir, *textdir.parents]:
        if d == root.parent:
            break
        d.chmod(0o755)
    out = _cli("install", "--root", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    installed = (root / "etc/slurmagent/config.toml").read_text()
    textfile = tomllib.loads(installed)["metrics"]["textfile"]
    assert textfile == f"/{DEBIAN_TEXTFILE_DIR}/slurmagent.prom"  # chosen by what exists under the root
    snapshot = write_json(root / "snap.json", healthy_snapshot_dict())
    config = root / "etc/slurmagent/test.toml"
    config.write_text(f'state_dir = "{root}/var/lib/slurmagent"\n'
                      + installed.replace(f'textfile = "{textfile}"', f'textfile = "{root}{textfile}"')
                      + f'\n[health]\nsnapshot = "{snapshot}"\nexpected_gpus = 8\ntimeout_s = 5\n'
                      + '[hooks]\nsyslog = false\n')
    config.chmod(0o644)
    run = _cli("healthcheck", "--node", NODE, env={"SLURMAGENT_CONFIG": str(config)})
    assert run.returncode == 0, run.stdout + run.stderr
    written = Path(f"{root}{textfile}")
    assert written.is_file() and (written.stat().st_mode & 0o777) == 0o644
    return written


def test_default_install_metrics_reach_prometheus_and_a_node_without_them_alerts(staging_root, tmp_path):
    prom, exporter = _tool("prometheus"), _tool("prometheus-node-exporter", "node_exporter")
    try:
        pwd.getpwnam("prometheus")
    except KeyError:
        pytest.fail("no `prometheus` user: Debian's prometheus-node-exporter package creates it")
    textfile = _installed_node(staging_root, tmp_path)
    # what the default was: the state dir, closed to node_exporter's user
    old = _as_prometheus(["cat", str(staging_root / "var/lib/slurmagent/metrics.json")])
    assert old.returncode != 0 and "Permission denied" in old.stderr
    assert _as_prometheus(["cat", str(textfile)]).returncode == 0

    exporter_port, prom_port = _free_port(), _free_port()
    instance = f"127.0.0.1:{exporter_port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": [instance]}]}]}))
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    try:
        procs.append(subprocess.Popen(  # as Debian's unit runs it: User=prometheus
            [exporter, f"--web.listen-address={instance}", "--collector.disable-defaults", "--collector.textfile",
             f"--collector.textfile.directory={textfile.parent}"],
            stdout=subprocess.DEVNULL, stderr=(logs / "node-exporter.log").open("w"), user="prometheus",
            group="prometheus", cwd="/"))
        procs.append(subprocess.Popen(
            [prom, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=(logs / "prometheus.log").open("w")))

        def answer(expr: str):
            for p in procs:
                assert p.poll() is None, f"{p.args[0]} exited {p.returncode}: " + \
                    "".join(f.read_text()[-2000:] for f in logs.iterdir())
            try:
                return _query(prom_port, expr)
            except OSError:  # not listening yet, or 503 while starting
                return None

        wait_for(lambda: answer("slurmagent_build_info"), 60, "slurmagent's series scraped")
        assert answer(f'node_textfile_scrape_error{{instance="{instance}"}}')[0]["value"][1] == "0"
        names = {s["metric"]["__name__"] for s in answer('{__name__=~"slurmagent_.+"}')}
        assert {"slurmagent_build_info", "slurmagent_node_healthy", "slurmagent_gpu_healthy",
                "slurmagent_last_check_timestamp_seconds", "slurmagent_last_run_timestamp_seconds"} <= names
        beat = answer("slurmagent_last_run_timestamp_seconds")
        assert [(s["metric"]["component"], s["metric"]["job"]) for s in beat] == [("healthcheck", "node")]
        missing = '(up{job="node"} == 1) unless on(instance) slurmagent_build_info'
        assert answer(missing) == []

        textfile.unlink()  # the node's slurmagent series go (stale at the next scrape)
        gone = wait_for(lambda: answer(missing), 30, "the node without slurmagent series")
        assert [s["metric"]["instance"] for s in gone] == [instance]
        up = answer(f'up{{instance="{instance}"}}')[0]["metric"]
        info = next(s["metric"] for s in answer('last_over_time(slurmagent_build_info[1h])'))
        pending = wait_for(lambda: _pending(prom_port, "SlurmagentMetricsMissing"), 30,
                           "SlurmagentMetricsMissing pending in the real Prometheus")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # promtool, with that scrape's series and the labels and text the real Prometheus gave the
    # pending alert: fires once `for: 15m` has passed, not before
    target = {k: v for k, v in up.items() if k != "__name__"}
    assert pending["labels"] == {**target, "alertname": "SlurmagentMetricsMissing", "severity": "warning"}
    tests = tmp_path / "missing_test.yml"
    tests.write_text(json.dumps({
        "rule_files": [str(ALERTS)], "evaluation_interval": "1m",
        "tests": [{"interval": "1m",
                   "input_series": [{"series": _series(up), "values": "1x30"},
                                    {"series": _series({**info, "__name__": "slurmagent_build_info"}),
                                     "values": "1x5 stale"}],
                   "alert_rule_test": [
                       {"eval_time": "20m", "alertname": "SlurmagentMetricsMissing", "exp_alerts": []},
                       {"eval_time": "21m", "alertname": "SlurmagentMetricsMissing", "exp_alerts": [
                           {"exp_labels": {k: v for k, v in pending["labels"].items() if k != "alertname"},
                            "exp_annotations": pending["annotations"]}]}]}]}))
    run = subprocess.run([_tool("promtool"), "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def _pending(port: int, name: str) -> dict | None:
    alerts = [a for a in _query_alerts(port) if a["labels"].get("alertname") == name]
    return alerts[0] if alerts else None


def _query_alerts(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=10) as resp:
        return json.load(resp)["data"]["alerts"]


def _series(labels: dict[str, str]) -> str:
    name = labels["__name__"]
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{inner}}}"
