"""A node laid out as on Cluster Toolkit / slurm-gcp v6, on a real local cluster: configless slurmd
(`--conf-server`, no slurm.conf of its own), `Gres=gpu:8` from a gres.conf with `File=`, and
`Prolog=.../prolog.d/*` running our shim (written by `install --prolog-dir`) beside another script.

The same subjects without a cluster: tests/unit/test_doctor.py (the glob), tests/unit/test_install.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmagent.commands import health
from slurmagent.commands.install import HOOK_DIR_NAME, install
from slurmagent.devtools.localcluster import SLURMD_RUN_DIR, LocalSlurmCluster
from support import REPO, cluster_config_text, healthy_snapshot_dict, need_slurm, wait_for, write_json
from support.fake_systemd import FakeSystemd

pytestmark = pytest.mark.slurm

PROLOG_D, EPILOG_D = "/slurm/custom_scripts/prolog.d", "/slurm/custom_scripts/epilog.d"  # slurm-gcp's dirs


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory):
    need_slurm()
    root = tmp_path_factory.mktemp("toolkit")
    root.chmod(0o755)
    config = root / "config.toml"
    config.write_text(cluster_config_text(root, expected_gpus=None))  # the count: gres.conf in the conf cache
    for node in ("n1", "n2"):
        write_json(root / "snap" / f"{node}.json", healthy_snapshot_dict(hostname=node))
        (root / "kern").mkdir(exist_ok=True)
        (root / "kern" / f"{node}.log").touch()
    binary = root / "venv/bin/slurmagent"  # this checkout, with the test's config, as the shims' slurmagent
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\nexport SLURMAGENT_CONFIG='{config}' PYTHONPATH='{REPO}'\n"
                      f'exec {sys.executable} -m slurmagent.entry "$@"\n')
    binary.chmod(0o755)
    node_root = root / "node"
    install(node_root, binary=str(binary), prolog_dir=PROLOG_D, epilog_dir=EPILOG_D)
    other = node_root / PROLOG_D.lstrip("/") / "a_chs_gpu_health_check.sh"  # the Toolkit's own prolog, a stand-in
    other.write_text(f'#!/bin/sh\necho "$SLURMD_NODENAME $SLURM_CONF" >> {root}/other-prolog.log\nexit 0\n')
    other.chmod(0o755)
    cluster = LocalSlurmCluster(root / "slurm", nodes=["n1", "n2"], configless=True, gpus=8,
                                prolog=f"{node_root}{PROLOG_D}/*", epilog=f"{node_root}{EPILOG_D}/*")
    cluster.start()
    yield cluster, root
    cluster.stop()


def test_doctor_passes_the_prolog_and_epilog_of_the_toolkit_layout(toolkit):
    cluster, root = toolkit
    cache = cluster.conf_cache("n1") / "slurm.conf"  # what a configless node has
    assert not any(arg == "-f" for arg in _cmdline(cluster.procs["n1"].pid)), "slurmd got a slurm.conf of its own"
    cfg = root / "doctor.toml"
    cfg.write_text(cluster_config_text(root, expected_gpus=None) + f'[slurm]\nconf = "{cache}"\n')
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env.update(PYTHONPATH=str(REPO), SLURMD_NODENAME="n1", GCE_METADATA_HOST="127.0.0.1:9")
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(cfg), "doctor", "--json"],
                          capture_output=True, text=True, timeout=60, env=env)
    rows = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    for name in ("slurm.conf Prolog", "slurm.conf Epilog", "slurm.conf PrologFlags", "slurm.conf nohold_on_prolog_fail"):
        assert rows[name]["status"] == "ok", rows[name]
    assert f"{PROLOG_D}/{HOOK_DIR_NAME} (runs {root}/venv/bin/slurmagent prolog)" in rows["slurm.conf Prolog"]["detail"]
    # the count comes from the gres the controller sent this configless node (its conf cache)
    assert rows["GPUs"]["detail"] == f"8 GPU(s) seen, 8 expected (gres of n1 in {cache})", rows["GPUs"]


def _doctor_as_on_the_node(cluster, root, tmp_path, monkeypatch, capsys) -> tuple[int, dict[str, dict]]:
    """`slurmagent doctor --json` on n1 with no `[slurm] conf` and no SLURM_CONF: slurm.conf is
    searched as the hooks search it, the configless cache where Slurm keeps it. The cluster keeps
    that cache in the slurmd's own namespace, so the search is pointed at it (health.SOURCES,
    what the hooks consult); the rest of the search order is the real one."""
    from slurmagent.cli import main

    cfg = tmp_path / "doctor.toml"
    cfg.write_text(cluster_config_text(root, expected_gpus=None)
                   + '[gcp]\nproject = "p"\nzone = "z"\ncompute_endpoint = "http://127.0.0.1:9"\n')
    cfg.chmod(0o644)
    search = (cluster.conf_cache("n1") / "slurm.conf", *[p for p in health.SOURCES.conf_search
                                                         if "conf-cache" not in str(p) and "/run/" not in str(p)])
    monkeypatch.setattr(health, "SOURCES", health.CountSources(conf_search=search))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no metadata server: [gcp] project/zone say it
    monkeypatch.setenv("PATH", f"{FakeSystemd(tmp_path / 'bin').dir}:{os.environ['PATH']}")
    capsys.readouterr()
    code = main(["--config", str(cfg), "doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    return code, {c["name"]: c for c in doc["checks"]}


def test_doctor_finds_the_configless_cache_and_says_when_slurmctld_is_down(toolkit, tmp_path, monkeypatch, capsys):
    cluster, root = toolkit
    code, rows = _doctor_as_on_the_node(cluster, root, tmp_path, monkeypatch, capsys)
    assert "slurm.conf" not in rows, rows.get("slurm.conf")  # read: no "cannot read /etc/slurm/slurm.conf"
    for name in ("slurm.conf Prolog", "slurm.conf Epilog", "slurm.conf PrologFlags", "slurm.conf nohold_on_prolog_fail"):
        assert rows[name]["status"] == "ok", rows[name]
    assert rows["slurm controller"]["status"] == "ok" and code != 3, rows["slurm controller"]
    cluster.stop_ctld()
    try:
        code, rows = _doctor_as_on_the_node(cluster, root, tmp_path, monkeypatch, capsys)
    finally:
        cluster.restart_ctld()
    assert code == 3, rows
    assert rows["slurm controller"]["status"] == "fail", rows["slurm controller"]
    assert rows["slurm controller"]["detail"].startswith("slurmctld did not answer") or \
        "no answer within" in rows["slurm controller"]["detail"], rows["slurm controller"]
    assert "start slurmctld" in rows["slurm controller"]["fix"] or rows["slurm controller"]["fix"]
    assert rows["slurm.conf Prolog"]["status"] == "ok"  # the cache stays readable without its controller


def test_a_configless_node_leaves_no_config_link_on_the_host(toolkit):
    """Newer slurmd links /run/slurm/conf to its conf cache, and every Slurm client on the host
    without SLURM_CONF reads it: the local cluster keeps that link in the slurmd's own mount
    namespace, so another cluster (a parallel test worker's) never reads this one's config."""
    cluster, _ = toolkit
    link = Path(SLURMD_RUN_DIR) / "conf"
    assert not (link.is_symlink() and str(cluster.base) in os.readlink(link)), os.readlink(link)
    for name in cluster.nodes:  # where the slurmd sees /run/slurm: this node's own folder
        seen = Path(f"/proc/{cluster.procs[name].pid}/root{SLURMD_RUN_DIR}")
        own = cluster.base / "d" / name / "run-slurm"
        assert os.stat(seen).st_ino == os.stat(own).st_ino, f"{name}: /run/slurm is not its own folder"


def test_seven_of_eight_gpus_drains_n1_and_the_job_completes_on_n2(toolkit):
    cluster, root = toolkit
    snap = healthy_snapshot_dict(hostname="n1")
    snap["gpus"] = snap["gpus"][:7]
    write_json(root / "snap" / "n1.json", snap)
    out = root / "job.out"
    cluster.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=test: hold"])  # meet n1 first
    job_id = cluster.sbatch("-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
    wait_for(lambda: "DRAIN" in cluster.node("n1")["State"], 60, "the prolog to drain n1")
    assert cluster.node("n1")["Reason"].startswith("slurmagent: gpu-count: found 7 of 8"), cluster.node("n1")
    seen = {cluster.job(job_id)["JobState"]}
    cluster.resume("n2")
    end = time.monotonic() + 120
    while time.monotonic() < end and (state := cluster.job(job_id)["JobState"]) not in ("COMPLETED", "FAILED"):
        seen.add(state)
        time.sleep(0.3)
    job = cluster.job(job_id)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] == "n2", job
    assert "PENDING" in seen and int(job["Restarts"]) >= 1, seen
    assert out.read_text().strip() == "ran on n2"
    # the other script of prolog.d ran on n2 with slurmd's SLURM_CONF: its conf cache, not a slurm.conf of its own
    ran = (root / "other-prolog.log").read_text().split("\n")
    conf_of = dict(line.split(" ", 1) for line in ran if line)
    expected = str(cluster.conf_cache("n2") / "slurm.conf")
    assert conf_of.get("n2") == expected, f"slurmd handed the prolog SLURM_CONF={conf_of.get('n2')!r}, not {expected}"
    # slurmd runs a glob's scripts in reverse order and stops at the first failure: ours ran first on n1
    assert "n1" not in conf_of, ran


def _cmdline(pid: int) -> list[str]:
    """The slurmd's own argv (under `unshare ... python -c` that exec'd it)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]
