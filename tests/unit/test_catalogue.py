"""The check catalogue: `check --list`, docs/admin/health.md's table and the [checks] switches agree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO
from slurmagent.core import catalogue
from slurmagent.core.catalogue import CATALOGUE, LAYERS, RULE_CHECK, enabled
from slurmagent.core.checks import RULE_ORDER
from slurmagent.errors import ConfigError
from slurmagent.state.config import parse

HEALTH_MD = REPO / "docs" / "admin" / "health.md"


def cli(*args: str, tmp_path: Path, config: str = "") -> subprocess.CompletedProcess:
    cfg = tmp_path / "config.toml"
    cfg.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURMAGENT_CONFIG=str(cfg), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def doc_rows() -> list[list[str]]:
    text = HEALTH_MD.read_text()
    table = text.split("<!-- BEGIN catalogue -->\n", 1)[1].split("<!-- END catalogue -->", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_check_list_and_health_md_agree(tmp_path) -> None:
    proc = cli("check", "--list", "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)["checks"]
    rows = doc_rows()
    assert [f"`{c['name']}`" for c in listed] == [r[0] for r in rows]
    names = ("CTK", "GCM", "CycleCloud", "NHC")
    for check, row in zip(listed, rows):
        assert row[1] == ", ".join(check["layers"]) and row[2] == check["severity"], check["name"]
        assert row[3] == ("on" if check["default_on"] else "off") and row[4] == check["what"], check["name"]
        assert [n for n, mark in zip(names, row[5:]) if mark == "yes"] == check["anchors"], check["name"]
    text = cli("check", "--list", tmp_path=tmp_path)
    assert text.returncode == 0
    assert [line.split()[0] for line in text.stdout.splitlines()[1:]] == [c["name"] for c in listed]


def test_catalogue_is_well_formed() -> None:
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", spec.name)
        assert spec.layers and set(spec.layers) <= set(LAYERS)
        assert spec.severity in ("drain", "warn")
        assert set(spec.anchors) <= {"CTK", "GCM", "CycleCloud", "NHC"}
    # every rule that can drain has its check, and its place in the drain reason's order
    assert set(RULE_CHECK.values()) <= set(names)
    assert set(RULE_ORDER) <= set(RULE_CHECK)


def test_enabled_follows_on_and_off() -> None:
    assert enabled("gpu-leftover-processes", (), ())
    assert not enabled("gpu-leftover-processes", (), ("gpu-leftover-processes",))
    assert catalogue.runs("cuda-init", "healthcheck", (), ())
    assert not catalogue.runs("cuda-init", "prolog", (), ())
    assert catalogue.runs("cuda-init", None, (), ())


def test_a_name_that_is_no_check_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"'checks.off' names no check: 'gpu-leftovers'"):
        parse({"checks": {"off": ["gpu-leftovers"]}}, "test")
    assert parse({"checks": {"off": ["nvswitch-fabric"]}}, "test").checks.off == ("nvswitch-fabric",)
    proc = cli("check", "--snapshot", str(tmp_path / "none.json"), tmp_path=tmp_path,
               config='[checks]\non = ["no-such-check"]\n')
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"slurmagent: config {tmp_path / 'config.toml'}: 'checks.on' names no check: 'no-such-check' "
        "(slurmagent check --list)"]
