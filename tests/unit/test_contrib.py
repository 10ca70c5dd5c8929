"""contrib/: the Ops Agent snippet reads what slurmagent writes. Its receiver watches the files
logrotate rotates, its time format parses the decision log's `time`, its severity comes from the
field every line carries (in one of Cloud Logging's names). The Ops Agent's keys are those of its
config reference (receivers `files`, processors `parse_json` and `modify_fields`)."""

from __future__ import annotations

import re
from datetime import datetime

import yaml

from support import REPO
from slurmagent.state.decisionlog import SEVERITIES, DecisionLog, read_records

OPS = REPO / "contrib/ops-agent/config.yaml"
LOGROTATE = REPO / "contrib/logrotate/slurmagent"


def test_ops_agent_snippet_parses_the_decision_log(tmp_path):
    cfg = yaml.safe_load(OPS.read_text())["logging"]
    (pipeline,) = cfg["service"]["pipelines"].values()
    (receiver,) = [cfg["receivers"][r] for r in pipeline["receivers"]]
    processors = [cfg["processors"][p] for p in pipeline["processors"]]
    assert receiver["type"] == "files" and [p["type"] for p in processors] == ["parse_json", "modify_fields"]

    rotated = LOGROTATE.read_text().split("{")[0].split("\n")[-1].split()
    assert sorted(receiver["include_paths"]) == sorted(rotated)  # the same files, rotated and shipped

    DecisionLog(tmp_path / "hooks.log", use_syslog=False).write("prolog", node="n1", verdict="unhealthy", rule="xid")
    (record,) = read_records(tmp_path / "hooks.log")
    parse = processors[0]
    strptime = parse["time_format"].replace("%L", "%f")  # fluent-bit's %L: the fraction of a second
    assert datetime.strptime(record[parse["time_key"]], strptime).year >= 2024
    (target, rule), = processors[1]["fields"].items()
    assert target == "severity" and rule == {"move_from": "jsonPayload.severity"}
    assert record["severity"] in SEVERITIES and record["severity"] == "WARNING"


def test_logrotate_names_the_decision_log_where_the_agent_writes_it():
    from slurmagent.state.config import Config
    from slurmagent.state.decisionlog import path_for

    paths = LOGROTATE.read_text().split("{")[0].split("\n")[-1].split()
    assert str(path_for(Config(), "n1")) in paths  # the default state dir
    assert any(re.fullmatch(r".*/\*/hooks\.log", p) for p in paths)  # a per-node state dir (%n)


def test_the_observability_page_shows_the_snippet_as_shipped():
    page = (REPO / "docs/admin/observability.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", page, re.S)
    shipped = "".join(line + "\n" for line in OPS.read_text().splitlines() if not line.startswith("#"))
    assert yaml.safe_load(block) == yaml.safe_load(shipped) and block == shipped
