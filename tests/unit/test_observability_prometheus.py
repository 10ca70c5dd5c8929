"""The shipped alert rules and Grafana dashboard against Debian's real Prometheus.

`promtool` checks and unit-tests contrib/prometheus/alerts.yml; then a Prometheus and a
node_exporter (textfile collector only) on 127.0.0.1 scrape a textfile that slurmagent's own
code wrote, and every expression of contrib/grafana/slurmagent.json must return data: a
renamed metric or label (e.g. a series' own `job` label, which Prometheus stored as
`exported_job` until it became `job_id`) shows up as an empty panel here, not in front of an admin.

Needs Debian's `prometheus` (with promtool) and `prometheus-node-exporter`: skipped where
they are missing, failed in CI (`CI` set) except in ci/debian-lane.sh's chroots (trixie, forky),
which do not install them (the host lane runs these tests). A chroot is recognised by the marker
file the lane writes at its root, `/.slurmagent-ci-complete`, or by its os-release codename
(`support.chroot_lane`).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from support import REPO, need_tool, wait_for, xid_snapshot_dict
from support.fakes.slurm import FakeSlurm
from slurmagent import __version__
from slurmagent.commands.expiry import ExpiryWatch
from slurmagent.core.checks import run_checks
from slurmagent.core.snapshot import NodeSnapshot
from slurmagent.core.timefmt import from_epoch
from slurmagent.gcp.compute import SchedulingInfo
from slurmagent.gcp.events import Events
from slurmagent.slurm.commands import Slurm
from slurmagent.run.main import _record_goodput
from slurmagent.state import metrics
from slurmagent.state.config import parse

ALERTS = REPO / "contrib" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "contrib" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "slurmagent.json"
NODE = "n1"
# What Grafana would put in for its built-in variables; the data covers a few seconds, so
# ranges only need two scrapes (1 s apart).
BUILTINS = {"__range": "1m", "__rate_interval": "1m", "__interval": "15s"}


def _tool(*names: str) -> str:
    return need_tool(*names, install="apt-get install prometheus prometheus-node-exporter", chroot_lanes_lack=True)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = _tool("promtool")
    check = _run([promtool, "check", "rules", str(ALERTS)])
    assert check.returncode == 0, check.stdout + check.stderr
    unit = _run([promtool, "test", "rules", str(ALERTS_TEST)])
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    # every alert has a test that fires it and one evaluation where it does not
    alerts = set(re.findall(r"^\s*- alert: (\w+)", ALERTS.read_text(), re.M))
    tested = ALERTS_TEST.read_text()
    for alert in alerts:
        blocks = re.findall(rf"alertname: {alert}\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n\s*- name|\Z)",
                            tested, re.S)
        assert any(b.strip() == "[]" for b in blocks), f"{alert}: no evaluation where it does not fire"
        assert any("exp_labels" in b for b in blocks), f"{alert}: no evaluation where it fires"


def test_dashboard_and_alerts_name_only_metrics_slurmagent_exports_and_filter_by_node():
    """No Prometheus needed: every metric the two files name is one slurmagent writes (or the
    build info another part adds), every panel asks the chosen data source, and every query
    honours the `node` variable."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["node"]["includeAll"] and variables["node"]["allValue"] == ".*"
    known = set(metrics.HELP) | {"slurmagent_build_info"}
    named = set(re.findall(r"slurmagent_[a-z_]+", ALERTS.read_text() + DASHBOARD.read_text()))
    assert named - known == set() and len(named) >= 15
    ids, cells = set(), set()
    for title, expr in _dashboard_queries():
        assert 'instance=~"$node"' in expr, f"{title}: {expr} ignores the node variable"
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


# --- the dashboard against a real Prometheus ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_node_metrics(tmp_path: Path) -> Path:
    """One node's textfile as slurmagent writes it: a health check that drained on an XID,
    the expiry watch's termination countdown, and the other series by the Metrics API."""
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "test-proj", "zone": "us-central1-a"}, "expiry": {"publish_run_file": False}})
    now = time.time()

    def scheduling(cfg, node):
        return SchedulingInfo(from_epoch(now + 3 * 3600), "FLEX_START", "DELETE", 3600.0,
                              "resourceStatus.scheduling.terminationTimestamp")

    ExpiryWatch(cfg, NODE, Slurm(runner=FakeSlurm([NODE])), clock=time.time, boot_id="boot-a",
                scheduling_reader=scheduling).check(Events())
    m = metrics.for_node(cfg, NODE)
    m.record_check(run_checks(NodeSnapshot.from_dict(xid_snapshot_dict(79, gpu=3)), expected_gpus=8),
                   drained_rule="xid", component="healthcheck")
    m.update(set_={("slurmagent_breaker_open", ()): 0, ("slurmagent_journal_pending", ()): 2,
                   ("slurmagent_flush_seconds", ()): 12.5, ("slurmagent_fault_to_leave_seconds", ()): 3.25,
                   ("slurmagent_checkpoint_lag_seconds", (("job_id", "7"),)): 42},
             add={("slurmagent_repairs_total", (("action", "recreate"), ("result", "requested"))): 1,
                  ("slurmagent_repairs_total", (("action", "report-faulty"), ("result", "refused"))): 1,
                  ("slurmagent_checkpoint_sync_errors_total", ()): 1, ("slurmagent_bytes_synced_total", ()): 2 ** 40,
                  ("slurmagent_requeues_total", ()): 1,
                  ("slurmagent_jobs_requeued_on_fault_total", (("by", "slurmagent"),)): 1,
                  ("slurmagent_jobs_cancelled_on_fault_total", ()): 1})
    # one wrapped attempt that ended here, counted as the wrapper counts it (goodput panel), a hang
    _record_goodput(m, {"started": now - 700, "restore_s": 10.0, "first_progress": now - 670,
                        "last_commit": now - 100, "ended": now, "flush_s": 5.0, "end": "hang"})
    textdir = m.textfile.parent
    if "slurmagent_build_info" in metrics.HELP:
        m.update(set_={("slurmagent_build_info", (("version", __version__),)): 1})
    else:  # not exported yet by this checkout: the versions panel still needs a series
        (textdir / "build_info.prom").write_text(
            f'# TYPE slurmagent_build_info gauge\nslurmagent_build_info{{version="{__version__}"}} 1\n')
    assert (textdir / "slurmagent.prom").is_file()
    return textdir


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as exc:  # a 400 carries PromQL's error
        if exc.code == 503:  # "Service Unavailable" while its TSDB starts: not ready, no answer yet
            raise
        body = json.load(exc)
    assert body.get("status") == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels too."""
    out = []

    def walk(panels):
        for p in panels:
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def _substitute(expr: str, variables: dict[str, str]) -> str:
    done = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], expr)
    assert "$" not in done, done
    return done


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Prometheus scraping a node_exporter whose textfile slurmagent wrote, every second, with
    the alert rules loaded; yields (Prometheus port, node_exporter's instance label). One for
    the module: starting Prometheus takes most of the time."""
    prom, exporter = _tool("prometheus"), _tool("prometheus-node-exporter", "node_exporter")
    tmp_path = tmp_path_factory.mktemp("prometheus")
    textdir = _write_node_metrics(tmp_path)
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
        procs.append(subprocess.Popen(
            [exporter, f"--web.listen-address={instance}", "--collector.disable-defaults", "--collector.textfile",
             f"--collector.textfile.directory={textdir}"],
            stdout=subprocess.DEVNULL, stderr=(logs / "node-exporter.log").open("w")))
        procs.append(subprocess.Popen(
            [prom, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=(logs / "prometheus.log").open("w")))

        def scraped_twice():
            for p in procs:
                assert p.poll() is None, f"{p.args[0]} exited {p.returncode}: " + \
                    "".join(f.read_text()[-2000:] for f in logs.iterdir())
            try:
                got = _query(prom_port, "count_over_time(slurmagent_node_healthy[1m])")
            except OSError:  # not listening yet, or 503 while starting
                return False
            return got and float(got[0]["value"][1]) >= 2

        wait_for(scraped_twice, 60, "two scrapes of slurmagent's textfile")
        yield prom_port, instance
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(prometheus):
    port, instance = prometheus
    assert _query(port, f'node_textfile_scrape_error{{instance="{instance}"}}')[0]["value"][1] == "0"
    # the `node` variable's query: label_values(slurmagent_node_healthy, instance)
    variable = json.loads(DASHBOARD.read_text())["templating"]["list"]
    node_var = next(v for v in variable if v["name"] == "node")
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", node_var["query"]["query"]).groups()
    assert {s["metric"][label] for s in _query(port, metric)} == {instance}

    queries = _dashboard_queries()
    assert len(queries) >= 15
    empty = []
    for title, expr in queries:
        for node in (instance, node_var["allValue"]):  # one node, and "All"
            if not _query(port, _substitute(expr, {**BUILTINS, "node": node})):
                empty.append(f"{title}: {expr} (node={node})")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    # what the panels show is what slurmagent wrote
    gpus = {s["metric"]["UUID"]: s["value"][1] for s in _query(port, "slurmagent_gpu_healthy")}
    assert len(gpus) == 8 and gpus["GPU-00000003-0000-0000-0000-000000000000"] == "0"
    lag = _query(port, "slurmagent_checkpoint_lag_seconds")
    assert [(s["metric"]["job_id"], s["metric"]["job"], s["value"][1]) for s in lag] == [("7", "node", "42")]
    assert not any("exported_job" in s["metric"] for s in lag)  # Prometheus's own `job` label left alone
    left = float(_query(port, "slurmagent_termination_timestamp_seconds - time()")[0]["value"][1])
    assert 2 * 3600 < left <= 3 * 3600


def test_prometheus_evaluates_every_alert_rule_without_error(prometheus):
    port, _ = prometheus
    url = f"http://127.0.0.1:{port}/api/v1/rules?type=alert"

    def evaluated():
        with urllib.request.urlopen(url, timeout=10) as resp:
            rules = [r for g in json.load(resp)["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_for(evaluated, 30, "one evaluation of every alert rule")
    assert len(rules) == len(re.findall(r"^\s*- alert: ", ALERTS.read_text(), re.M))
    assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # the drained GPU (gpu 3) is pending or firing; the node has a termination only 3 h away
    active = {a["labels"]["alertname"] for r in rules for a in r.get("alerts", [])}
    assert "SlurmagentGPUUnhealthy" in active and "SlurmagentTerminationSoon" not in active
    # the node exports its series and node_exporter reads them: neither per-node alert is pending
    assert {"SlurmagentMetricsMissing", "SlurmagentTextfileScrapeError"} & active == set()
    beats = _query(port, 'slurmagent_last_run_timestamp_seconds{component="healthcheck"}')
    assert len(beats) == 1 and _query(port, '(up{job="node"} == 1) unless on(instance) slurmagent_build_info') == []
