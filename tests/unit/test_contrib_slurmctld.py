"""contrib/prometheus's scrape config and the alerts on slurmctld's own metrics (Slurm >= 25.11),
checked and unit-tested with Debian's promtool. That each `slurm_*` name they use is one a real
slurmctld exports: tests/cluster/test_expedite_metrics_slurm.py (forky lane, Slurm 26.05)."""

from __future__ import annotations

import re

import yaml

from support import REPO
from test_observability_prometheus import _run, _tool

PROM = REPO / "contrib" / "prometheus"


def test_promtool_checks_the_scrape_config_and_unit_tests_the_slurmctld_alerts():
    promtool = _tool("promtool")
    for argv in (["check", "config", str(PROM / "scrape.yml")], ["check", "rules", str(PROM / "slurmctld_alerts.yml")],
                 ["test", "rules", str(PROM / "slurmctld_alerts_test.yml")]):
        proc = _run([promtool, *argv])
        assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    tested = (PROM / "slurmctld_alerts_test.yml").read_text()
    for alert in re.findall(r"^\s*- alert: (\w+)", (PROM / "slurmctld_alerts.yml").read_text(), re.M):
        blocks = re.findall(rf"alertname: {alert}\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n\s*- name|\Z)", tested, re.S)
        assert any(b.strip() == "[]" for b in blocks), f"{alert}: no evaluation where it does not fire"
        assert any("exp_labels" in b for b in blocks), f"{alert}: no evaluation where it fires"


def test_the_scrape_config_asks_slurmctld_for_the_bounded_endpoints_only():
    jobs = {j["job_name"]: j for j in yaml.safe_load((PROM / "scrape.yml").read_text())["scrape_configs"]}
    paths = {j.get("metrics_path") for name, j in jobs.items() if name.startswith("slurmctld")}
    assert paths == {"/metrics/jobs", "/metrics/nodes", "/metrics/partitions", "/metrics/scheduler"}
    assert not any(j.get("honor_labels") for j in jobs.values())  # a textfile's labels never replace the scrape's
