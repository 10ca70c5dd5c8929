"""examples/cluster-toolkit/ deploys on the Cluster Toolkit release it names: every module comes
from that release, every setting is a variable of that module there, and what it hands slurmd is
what slurmagent needs (doctor's shim reader, the slurm.conf lines of docs/admin/install.md).

The release's variable names are a fixture (tests/support/data/cluster_toolkit_v1.95.0.json, read
from GoogleCloudPlatform/cluster-toolkit at the tag: its "how" says from which files), so the test
runs offline; moving the blueprint to another release means regenerating that fixture.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml  # the test extra has it (pyproject.toml)

from slurmagent.commands.install import shim_text
from slurmagent.slurm.hookfiles import read_shim

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cluster-toolkit"
BLUEPRINT = EXAMPLE / "slurmagent-gpu.yaml"
RELEASE = json.loads((ROOT / "tests/support/data/cluster_toolkit_v1.95.0.json").read_text())
CONTROLLER = "community/modules/scheduler/schedmd-slurm-gcp-v6-controller"
BIN = "/opt/slurmagent/current/bin/slurmagent"
STAGE = re.compile(r'^\$\(ghpc_stage\("([^"]+)"\)\)$')


def blueprint() -> dict:
    return yaml.safe_load(BLUEPRINT.read_text())


def modules() -> list[dict]:
    return [m for g in blueprint()["deployment_groups"] for m in g["modules"]]


def controller() -> dict:
    (c,) = [m for m in modules() if m["source"] == CONTROLLER]
    return c["settings"]


def test_blueprint_pins_the_release_of_the_fixture():
    bp = blueprint()
    assert bp["toolkit_modules_url"] == "github.com/" + RELEASE["repo"]
    assert bp["toolkit_modules_version"] == RELEASE["tag"]


def test_every_module_source_is_a_module_of_that_release():
    """toolkit_modules_version pins embedded sources only: a local or foreign source would not be."""
    for m in modules():
        assert m["source"] in RELEASE["modules"], (m["id"], m["source"])


def test_every_setting_is_a_variable_of_its_module_in_that_release():
    used = 0
    for m in modules():
        known = set(RELEASE["modules"][m["source"]]["variables"])
        unknown = sorted(set(m.get("settings", {})) - known)
        assert not unknown, f"{m['id']} ({m['source']} {RELEASE['tag']}): no variable {unknown}"
        used += len(m.get("settings", {}))
    assert used > 20


def test_object_settings_use_only_their_fields():
    fields = RELEASE["object_fields"][CONTROLLER]
    settings = controller()
    for name, allowed in fields.items():
        value = settings.get(name)
        items = value if isinstance(value, list) else [value] if value else []
        for item in items:
            assert set(item) <= set(allowed), (name, sorted(set(item) - set(allowed)))
    runners = [r for m in modules() if m["source"] == "modules/scripts/startup-script"
               for r in m["settings"]["runners"]]
    for r in runners:
        assert set(r) <= set(RELEASE["runner_keys"]) and {"type", "destination"} <= set(r), r


def test_the_checkpoint_bucket_deletes_what_jobs_mark_and_nothing_else():
    """The lifecycle rule docs/admin/install.md gives (Delete on daysSinceCustomTime: 1), in the
    module's own fields; no age rule (a blob's age says nothing of whether a commit needs it)."""
    bucket = "modules/file-system/cloud-storage-bucket"
    (m,) = [m for m in modules() if m["source"] == bucket]
    fields = RELEASE["object_fields"][bucket]
    rules = m["settings"]["lifecycle_rules"]
    for r in rules:
        assert set(r) <= set(fields["lifecycle_rules"])
        assert set(r["action"]) <= set(fields["lifecycle_rules.action"])
        assert set(r["condition"]) <= set(fields["lifecycle_rules.condition"])
    assert rules == [{"action": {"type": "Delete"}, "condition": {"days_since_custom_time": 1}}]
    install = (ROOT / "docs/admin/install.md").read_text()
    assert '"daysSinceCustomTime": 1' in install
    assert all("checkpoint_bucket" not in g.get("use", []) for g in modules())  # never mounted on a node


def test_slurm_conf_parameters_slurmagent_needs():
    """PrologFlags=Alloc and nohold_on_prolog_fail through cloud_parameters, the Toolkit's own
    SchedulerParameters kept (the list replaces them); the rest in the template."""
    cloud = controller()["cloud_parameters"]
    assert "Alloc" in cloud["prolog_flags"].split(",")
    sched = cloud["scheduler_parameters"]
    assert "nohold_on_prolog_fail" in sched
    assert set(RELEASE["scheduler_parameters_default"]) <= set(sched)
    tpl = staged(controller()["slurm_conf_tpl"]).read_text()
    conf = dict(line.split("=", 1) for line in tpl.splitlines() if re.match(r"^[A-Za-z]+=", line))
    assert int(conf["PrologEpilogTimeout"]) >= 60
    assert conf["HealthCheckProgram"] == "/etc/slurmagent/hooks/healthcheck"
    assert int(conf["HealthCheckInterval"]) > 0 and conf["HealthCheckNodeState"] == "ANY,CYCLE"
    assert "Prolog" not in conf and "PrologFlags" not in conf  # the Toolkit writes those


def test_template_is_the_release_template_plus_one_block():
    """Outside `# BEGIN slurmagent` .. `# END slurmagent` it is byte for byte the release's
    slurm.conf.tpl (the Toolkit fills it with str.format: no brace in our block)."""
    tpl = staged(controller()["slurm_conf_tpl"]).read_text()
    m = re.search(r"\n# BEGIN slurmagent.*?# END slurmagent\n\n", tpl, re.S)
    assert m and "{" not in m.group(0) and "}" not in m.group(0)
    rest = tpl[:m.start()] + "\n" + tpl[m.end():]
    assert hashlib.sha256(rest.encode()).hexdigest() == RELEASE["slurm_conf_tpl"]["sha256"]


@pytest.mark.parametrize("hook", ["prolog", "epilog"])
def test_shipped_hook_is_slurmagents_shim_and_runs_in_the_glob(hook, tmp_path):
    """The Toolkit installs `filename` as <stem>.<ext> (no extension: a hidden file the `*` glob
    skips) and runs prolog.d/* in reverse order: ours must sort last to run first."""
    (script,) = controller()[f"{hook}_scripts"]
    stem, _, ext = re.sub(r"[^a-zA-Z0-9-_]", "_", script["filename"]).rpartition("_")
    landed = f"{stem}.{ext}"
    assert stem and not landed.startswith("."), landed
    others = ["a_chs_gpu_health_check.sh", "z_external_prolog.sh", "z_external_epilog.sh"]
    assert sorted(others + [landed])[-1] == landed
    exec_line = [line for line in shim_text(hook, BIN).splitlines() if "exec" in line]
    assert exec_line[0] in script["content"].splitlines()
    path = tmp_path / landed
    path.write_text(script["content"])
    shim = read_shim(path)
    assert shim is not None and shim.hook == hook and shim.program == BIN


def test_wheel_and_scripts_exist_and_name_this_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = f"slurmagent-{version}-py3-none-any.whl"
    (image,) = [m for m in modules() if m["id"] == "slurmagent_image_script"]
    data, shell = image["settings"]["runners"]
    assert data["type"] == "data" and data["source"] == f'$(ghpc_stage("wheel/{wheel}"))'
    assert data["destination"].endswith("/" + wheel) and shell["args"] == data["destination"]
    assert shell["type"] == "shell" and staged(shell["source"]).is_file()
    script = staged(shell["source"]).read_text()
    assert f'--binary "$BIN"' in script and f"BIN=$BASE/current/bin/slurmagent" in script
    assert "BASE=/opt/slurmagent" in script


def test_units_are_enabled_on_the_nodes_and_the_controller():
    (nodeset,) = [m for m in modules() if m["id"] == "gpu_nodeset"]
    node = nodeset["settings"]["startup_script"]
    units = {p.name for p in (ROOT / "systemd").iterdir()}
    for unit in ("slurmagent-watch.service", "slurmagent-expiry.timer", "slurmagent-resume.service"):
        assert unit in units and unit in node
    assert "slurmagent-repair.timer" in controller()["controller_startup_script"]
    assert "slurmagent-repair" not in node


def staged(value: str) -> Path:
    m = STAGE.match(value)
    assert m, value
    return EXAMPLE / m.group(1)
