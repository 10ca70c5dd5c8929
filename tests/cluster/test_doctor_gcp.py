"""`slurmagent doctor` against the fake metadata server + Compute API (tests/support/fake_gcp.py) and a
Cloud Storage emulator: one table of ok/FAIL/skip lines, each failure with its fix, exit 1 on
any failure, every line present even when an endpoint is down or hangs, in bounded time.

The same subject without a cluster, emulator or fake server: tests/unit/test_doctor.py.

Timing (parallel lanes): nothing here is in the serial group; "bounded time" is DOCTOR_BOUND_S,
the doctor's own deadline plus room for a loaded machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict, hook_shim, write_json
from support.fake_gcp import FakeGcp
from support.fake_systemd import SHOW_CONFIG_2411, FakeSystemd, fake_scontrol
from slurmagent.commands.doctor import EXTERNAL_DEADLINE_S

# A doctor run: the interpreter's start and the local checks, then the external checks side by
# side under one deadline (EXTERNAL_DEADLINE_S, 7 s). Idle 2-8 s in all; a loaded machine (the
# lanes' 4 workers on 2 cores) stretches the part outside the deadline. A check that outlived the
# deadline would hold the command until the hung endpoint let go (never: the subprocess timeout).
DOCTOR_BOUND_S = EXTERNAL_DEADLINE_S + 20

ZONE = "us-central1-a"
NAMES = ["version", "config", "slurm.conf Prolog", "slurm.conf Epilog", "slurm.conf HealthCheckProgram", "slurm.conf PrologFlags",
         "slurm.conf nohold_on_prolog_fail", "slurm.conf PrologEpilogTimeout", "GPUs", "state dir",
         "metadata server", "compute API", "permission compute.instances.get",
         "permission compute.instances.reportHostAsFaulty", "permission compute.instances.list",
         "permission compute.instanceGroupManagers.update", "permission compute.zoneOperations.get",
         "permission compute.regionOperations.get", "checkpoint bucket", "clock", "job channel", "slurm controller", "slurm 25.11+ features",
         "slurmagent-watch", "expiry timer", "metrics file"]
PERMISSIONS = [n for n in NAMES if n.startswith("permission ")]
GOOD_SLURM_CONF = ("Prolog={hooks}/prolog\nEpilog={hooks}/epilog\nPrologFlags=Alloc\n"
                   "SchedulerParameters=nohold_on_prolog_fail,bf_interval=2\nPrologEpilogTimeout=120\n"
                   "NodeName=n1 Gres=gpu:8 CPUs=2\n")


@pytest.fixture
def gcp(serve_metadata, monkeypatch, tmp_path):
    fake = serve_metadata(FakeGcp())
    fake.add_instance("n1", ZONE, mig="mig-a")
    fake.set_identity("n1", ZONE, created_by=fake.mig_path("mig-a", zone=ZONE))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    systemd = FakeSystemd(tmp_path / "fake-bin")
    monkeypatch.setenv("PATH", f"{systemd.dir}:{os.environ['PATH']}")  # the units' states: a healthy node
    return fake


@pytest.fixture
def blackhole():
    """A TCP port that accepts connections (kernel backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def make_config(tmp_path: Path, *, compute_endpoint: str, remote: str = "gs://ckpt/jobs",
                slurm_conf: str = GOOD_SLURM_CONF, gcp_extra: str = "") -> Path:
    d = tmp_path / "etc"
    d.mkdir(exist_ok=True)
    (d / "hooks").mkdir(exist_ok=True)
    for hook in ("prolog", "epilog"):  # doctor reads the shims Prolog=/Epilog= name
        hook_shim(d / "hooks" / hook, hook, d / "config.toml")
    (d / "slurm.conf").write_text(slurm_conf.replace("{hooks}", str(d / "hooks")))
    write_json(d / "n1.json", healthy_snapshot_dict(hostname="n1"))
    fake_scontrol(d / "scontrol", SHOW_CONFIG_2411)  # a controller that answers (the cluster tests ask a real one)
    cfg = d / "config.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state/%n"\n'
                   f'[health]\nsnapshot = "{d}/n1.json"\nexpected_gpus = 8\n'
                   f'[slurm]\nconf = "{d}/slurm.conf"\nscontrol = "{d}/scontrol"\n'
                   f'[gcp]\ncompute_endpoint = "{compute_endpoint}"\n{gcp_extra}'
                   f'[checkpoint]\nremote = "{remote}"\n[watch]\nchannel_socket = "{tmp_path}/run/%n/channel.sock"\n')
    cfg.chmod(0o644)
    return cfg


def doctor(capsys, cfg: Path) -> tuple[int, dict[str, tuple[str, str, str]], str]:
    """Run `slurmagent --config CFG doctor` in this process: (exit code, {name: (mark, detail, fix)}, output).

    The Google client libraries are loaded first: a cold import of google.cloud.compute_v1 costs
    ~4 s of CPU (12-18 s on a busy 2-core machine) inside the compute check's thread, where it
    would count against the external checks' 7 s deadline. These tests judge the endpoints'
    answers; the cold start is the subprocess tests' (they bound only a hung endpoint's cost)."""
    from slurmagent.cli import main

    capsys.readouterr()
    code = main(["--config", str(cfg), "doctor"])
    out, err = capsys.readouterr()
    return code, parse_table(out), out + err


def parse_table(out: str) -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    last = None
    for line in out.splitlines():
        if line.startswith("     ") and "fix: " in line:
            mark, detail, _ = rows[last]
            rows[last] = (mark, detail, line.split("fix: ", 1)[1])
            continue
        mark, rest = line[:4].strip(), line[5:]
        name = next(n for n in sorted([*NAMES, "slurm.conf"], key=len, reverse=True) if rest.startswith(n + " "))
        rows[name] = (mark, rest[len(name):].strip(), "")
        last = name
    return rows


def test_all_checks_pass_and_nothing_is_written(gcp, emu, tmp_path, capsys):
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    code, rows, out = doctor(capsys, cfg)
    assert code == 0, out
    assert list(rows) == NAMES, out
    regional_ops = "permission compute.regionOperations.get"  # the MIG is zonal: not needed
    not_set = "slurm.conf HealthCheckProgram"
    assert rows.pop("job channel")[:2] == ("skip", f"no channel at {tmp_path}/run/n1/channel.sock (slurmagent-watch "
                                                   "is not running on this node)")
    assert rows.pop("slurm 25.11+ features")[:2] == ("skip", "Slurm 24.11.1: none (the expedited requeue and the "
                                                              "metrics endpoint came in 25.11)"), out
    assert rows.pop("metrics file")[:2] == ("skip", f"{tmp_path}/state/n1 does not exist yet: the first check "
                                                    "writes slurmagent.prom there"), out  # doctor creates nothing
    assert {name: mark for name, (mark, _, _) in rows.items()} == {
        name: "skip" if name in (regional_ops, not_set) else "ok" for name in NAMES
        if name not in ("job channel", "slurm 25.11+ features", "metrics file")}, out
    assert rows["slurm controller"][1] == "slurmctld 127.0.0.1 answers (Slurm 24.11.1)"
    assert rows["slurmagent-watch"][1] == "enabled, active (running)"
    assert rows[regional_ops][1] == "not needed: the MIG is zonal"
    assert "project test-proj, zone us-central1-a, instance n1" in rows["metadata server"][1]
    assert "instances.get test-proj/us-central1-a/n1: in MIG projects/123456789/zones/us-central1-a/" \
        "instanceGroupManagers/mig-a" in rows["compute API"][1]
    assert rows["permission compute.instanceGroupManagers.update"][1].startswith(
        "held (instanceGroupManagers.testIamPermissions (beta) on zones/us-central1-a/mig-a)")
    # fake-gcs-server has no bucket testIamPermissions: the line says what it could not check
    assert rows["checkpoint bucket"][1] == ("listed gs://ckpt/jobs; its write permissions not checked: this "
                                            "endpoint has no bucket testIamPermissions (HTTP 404: an emulator?)")
    assert "within 2 s of the metadata server" in rows["clock"][1]
    # read-only calls to Compute, never a mutation; nothing written to the bucket
    assert sorted(c.kind for c in gcp.calls if c.kind != "metadata") == [
        "instanceGroupManagers.testIamPermissions", "instances.get", "instances.list",
        "instances.testIamPermissions", "zoneOperations.get"]
    assert not gcp.mutations
    from google.cloud import storage

    left = list(storage.Client(project="test").list_blobs("ckpt"))
    assert left == []


def test_metadata_unreachable_fails_with_fix_and_the_rest_still_run(gcp, emu, tmp_path, blackhole):
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    env = dict(os.environ, GCE_METADATA_HOST=blackhole, PYTHONPATH=str(REPO), SLURMD_NODENAME="n1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(cfg), "doctor"], env=env,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    rows = parse_table(proc.stdout)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # no answer: an outage, not a verdict
    assert elapsed < DOCTOR_BOUND_S, elapsed
    assert list(rows) == NAMES
    mark, detail, fix = rows["metadata server"]
    assert mark == "FAIL" and "did not answer within 2 s" in detail
    assert fix == "run on a GCE VM or set [gcp] project/zone"
    assert rows["compute API"][0] == "skip" and "instance name unknown" in rows["compute API"][1]
    assert all(rows[p] == ("skip", "not checked: the VM is unknown", "") for p in PERMISSIONS)
    assert rows["checkpoint bucket"][0] == "ok"  # the other lines ran
    assert rows["clock"][0] == "ok" and "the Compute endpoint" in rows["clock"][1]
    assert rows["config"][0] == rows["GPUs"][0] == rows["state dir"][0] == "ok"
    assert proc.stderr == ""  # a table, never a traceback


def test_metadata_unreachable_but_project_and_zone_configured_is_ok(gcp, emu, tmp_path, blackhole, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("GCE_METADATA_HOST", blackhole)
    cfg = make_config(tmp_path, compute_endpoint=gcp.url, gcp_extra=f'project = "test-proj"\nzone = "{ZONE}"\n')
    code, rows, out = doctor(capsys, cfg)
    assert rows["metadata server"][0] == "ok", out
    assert "using [gcp] project 'test-proj' and zone 'us-central1-a' from the config" in rows["metadata server"][1]
    assert code == 0, out


def test_hung_compute_and_storage_fail_within_the_deadline(gcp, tmp_path, blackhole, monkeypatch):
    cfg = make_config(tmp_path, compute_endpoint=f"http://{blackhole}")
    env = dict(os.environ, GCE_METADATA_HOST=gcp.host, STORAGE_EMULATOR_HOST=f"http://{blackhole}",
               PYTHONPATH=str(REPO), SLURMD_NODENAME="n1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(cfg), "doctor"], env=env,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    rows = parse_table(proc.stdout)
    assert proc.returncode == 3 and elapsed < DOCTOR_BOUND_S, (elapsed, proc.stdout, proc.stderr)
    assert list(rows) == NAMES
    assert rows["metadata server"][0] == "ok"
    assert rows["compute API"][0] == "FAIL" and rows["compute API"][2]
    assert rows["checkpoint bucket"][0] == "FAIL" and \
        rows["checkpoint bucket"][1].startswith("objects.list on gs://ckpt failed: ")
    assert rows["clock"][0] == "ok"  # measured against the metadata server that did answer


def test_bucket_missing_fails_with_fix(gcp, emu, tmp_path, capsys):
    cfg = make_config(tmp_path, compute_endpoint=gcp.url, remote="gs://no-such-bucket/jobs")
    code, rows, out = doctor(capsys, cfg)
    assert code == 1
    mark, detail, fix = rows["checkpoint bucket"]
    assert mark == "FAIL" and detail == "bucket gs://no-such-bucket does not exist (remote gs://no-such-bucket/jobs)"
    assert fix.startswith("create it (gcloud storage buckets create gs://no-such-bucket)")
    assert [n for n, (m, _, _) in rows.items() if m == "FAIL"] == ["checkpoint bucket"], out
    for line in out.splitlines():  # `MARK NAME  DETAIL` or an indented `fix:` line: scripts can grep FAIL
        assert line[:5] in ("ok   ", "FAIL ", "skip ") or line.startswith("     ") and "fix: " in line, line


def test_bucket_permissions_are_asked_not_tried(gcp, tmp_path, capsys, monkeypatch):
    """The bucket's testIamPermissions (here the fake's storage routes) names what the account
    lacks; doctor lists and asks, and writes no object to find out."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcp.url)
    gcp.buckets.add("ckpt")
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    code, rows, out = doctor(capsys, cfg)
    assert code == 0, out
    assert rows["checkpoint bucket"] == ("ok", "listed gs://ckpt/jobs; holds create, get, list, delete, update on gs://ckpt "
                                               "(testIamPermissions)", ""), out
    asked = gcp.calls_of("storage.buckets.testIamPermissions")[0].query["permissions"]
    assert sorted(asked) == ["storage.objects.create", "storage.objects.delete", "storage.objects.get",
                             "storage.objects.list", "storage.objects.update"]
    gcp.denied |= {"storage.objects.delete", "storage.objects.create"}
    code, rows, out = doctor(capsys, cfg)
    assert code == 1, out
    assert rows["checkpoint bucket"] == (
        "FAIL", "this VM's account lacks storage.objects.create, storage.objects.delete on gs://ckpt",
        "grant this VM's service account roles/storage.objectUser on the bucket"), out
    assert not [c for c in gcp.calls if c.kind.startswith("storage.") and c.method != "GET"]


def test_no_remote_configured_is_a_skip_not_a_failure(gcp, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    cfg = make_config(tmp_path, compute_endpoint=gcp.url, remote="")
    code, rows, out = doctor(capsys, cfg)
    assert rows["checkpoint bucket"] == ("skip", "not configured ([checkpoint] remote is empty)", "")
    assert code == 0, out


def test_compute_permission_denied_fails_with_the_iam_fix(gcp, emu, tmp_path, capsys):
    gcp.fail("instances.get", 403)
    gcp.denied.add("compute.instances.get")
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    code, rows, out = doctor(capsys, cfg)
    assert code == 1
    assert rows["compute API"][0] == "ok" and "instances.get n1 refused" in rows["compute API"][1], out
    mark, detail, fix = rows["permission compute.instances.get"]
    assert mark == "FAIL" and detail.startswith("MISSING (instances.testIamPermissions on n1)"), out
    assert "repair, expiry-watch cannot read the VM" in detail
    assert fix.startswith("grant this VM's service account compute.instances.get (")
    # the MIG still came from the metadata server's created-by: its permission was asked too
    assert rows["permission compute.instanceGroupManagers.update"][0] == "ok", out
    assert [n for n, (m, _, _) in rows.items() if m == "FAIL"] == ["permission compute.instances.get"], out
    assert not gcp.mutations  # 403 is not retried, nothing is changed


@pytest.mark.parametrize("how", ["testIamPermissions leaves it out", "its read answers 403"])
def test_each_missing_permission_is_named_with_its_fix_and_the_json_agrees(gcp, emu, tmp_path, capsys, how):
    """The permissions repair needs beyond `instances.get`: one missing one fails its own line."""
    import json

    from slurmagent.cli import main

    if how == "testIamPermissions leaves it out":
        gcp.denied.add("compute.instanceGroupManagers.update")
        missing = "compute.instanceGroupManagers.update"
    else:
        gcp.fail("zoneOperations.get", 403)
        missing = "compute.zoneOperations.get"
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    code, rows, out = doctor(capsys, cfg)
    assert code == 1, out
    assert [n for n, (m, _, _) in rows.items() if m == "FAIL"] == [f"permission {missing}"], out
    mark, detail, fix = rows[f"permission {missing}"]
    assert detail.startswith("MISSING (") and "repair cannot" in detail
    assert fix == f"grant this VM's service account {missing} (roles/compute.instanceAdmin.v1 has every one " \
                  "repair and expiry-watch use)"
    if how == "its read answers 403":
        gcp.fail("zoneOperations.get", 403)
    capsys.readouterr()
    assert main(["--config", str(cfg), "doctor", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert [c["name"] for c in doc["checks"]] == NAMES
    got = {c["name"]: (c["status"].replace("fail", "FAIL"), c["detail"], c["fix"]) for c in doc["checks"]}
    assert got.pop("clock")[0] == rows.pop("clock")[0]  # its detail holds a measured offset
    assert got == rows


def test_slurm_conf_without_nohold_fails_with_fix(gcp, emu, tmp_path, capsys):
    conf = GOOD_SLURM_CONF.replace("nohold_on_prolog_fail,", "")
    cfg = make_config(tmp_path, compute_endpoint=gcp.url, slurm_conf=conf)
    code, rows, out = doctor(capsys, cfg)
    assert code == 1
    assert rows["slurm.conf nohold_on_prolog_fail"] == (
        "FAIL", "missing: jobs would be requeued HELD", "add nohold_on_prolog_fail to SchedulerParameters")
    assert [n for n, (m, _, _) in rows.items() if m == "FAIL"] == ["slurm.conf nohold_on_prolog_fail"], out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown and the root-only config check")
@pytest.mark.parametrize("how", ["group-writable", "owned by nobody"])
def test_unsafe_config_file_fails_with_fix(gcp, emu, tmp_path, capsys, how):
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    if how == "group-writable":
        cfg.chmod(0o664)
    else:
        os.chown(cfg, 65534, 65534)
    code, rows, out = doctor(capsys, cfg)
    assert code == 1
    mark, detail, fix = rows["config"]
    assert mark == "FAIL" and "refused" in detail and str(cfg) in detail
    assert fix == f"chown root:root {cfg} and chmod go-w it and every directory above it"
    assert rows["GPUs"][0] == "ok"  # the rest still judged with the file's settings


@pytest.mark.parametrize("offset,word", [(30.0, "ahead of"), (-30.0, "behind")])
def test_clock_off_by_more_than_2_s_fails(gcp, emu, tmp_path, offset, word):
    from slurmagent.commands.doctor import run_doctor

    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    clock = next(r for r in run_doctor(str(cfg), clock=lambda: time.time() + offset) if r.name == "clock")
    assert not clock.ok and f"{word} the metadata server" in clock.detail and clock.fix.startswith("enable NTP")
    assert abs(float(clock.detail.split()[2]) - abs(offset)) < 1.5, clock.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown and the root-only state dir check")
def test_a_state_dir_a_user_created_fails_with_fix(gcp, emu, tmp_path, capsys):
    """A `%n` state dir under a world-writable directory that a user made first: root ignores
    every file in it (expiry state, journal, cursor, decision log), so doctor says so."""
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    state = tmp_path / "state" / "n1"
    state.mkdir(parents=True)
    os.chown(state, 65534, 65534)
    code, rows, out = doctor(capsys, cfg)
    assert code == 1
    mark, detail, fix = rows["state dir"]
    assert mark == "FAIL" and detail == f"{state} is owned by uid 65534: root would ignore the files in {state}", out
    assert fix.startswith(f"rm -r {state} and let root create it")
    os.chown(state, 0, 0)
    assert doctor(capsys, cfg)[1]["state dir"][0] == "ok"


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under root: (mode, size, mtime_ns), the root's own entry included."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def test_doctor_under_a_read_only_root_changes_nothing_and_exits_1(gcp, tmp_path, capsys, monkeypatch):
    """A diagnostic writes nothing: the state dir under a read-only directory is judged, not made,
    and no file appears or changes anywhere under the root (the snapshot before and after)."""
    import json

    from slurmagent.cli import main

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcp.url)
    gcp.buckets.add("ckpt")
    cfg = make_config(tmp_path, compute_endpoint=gcp.url)
    ro = tmp_path / "ro"
    ro.mkdir()
    cfg.write_text(cfg.read_text().replace(f'state_dir = "{tmp_path}/state/%n"', f'state_dir = "{ro}/state/%n"'))
    ro.chmod(0o555)
    before = _tree(tmp_path)
    try:
        code, rows, out = doctor(capsys, cfg)
        capsys.readouterr()
        json_code = main(["--config", str(cfg), "doctor", "--json"])
        doc = json.loads(capsys.readouterr().out)
    finally:
        ro.chmod(0o755)
    ro.chmod(0o555)
    assert _tree(tmp_path) == before
    assert not (ro / "state").exists()
    state = ro / "state" / "n1"
    if os.geteuid() == 0:  # root may create it: the line says what the first run will do
        assert rows["state dir"][0] == "ok" and rows["state dir"][1].startswith(f"{state} does not exist yet"), out
        assert code == json_code == 0, out
    else:
        assert rows["state dir"] == ("FAIL", f"{state} does not exist and {ro} is not writable by this user",
                                     f"mkdir -p {state} (as root)"), out
        assert code == json_code == 1, out
    assert doc["exit_code"] == code and doc["ok"] is (code == 0)
    assert rows["checkpoint bucket"][0] == "ok", out
    assert not gcp.mutations and all(c.method == "GET" for c in gcp.calls_of("storage.objects.list"))


def test_no_config_file_every_line_true_and_the_default_state_dir_is_not_created(gcp, tmp_path, capsys,
                                                                                  monkeypatch):
    """Without a config file the config line says so (not "root-owned"), and the default state dir
    (/var/lib/slurmagent) stays as it was: absent stays absent."""
    import json

    from slurmagent.cli import main
    from slurmagent.state import config as config_mod

    monkeypatch.delenv("SLURMAGENT_CONFIG", raising=False)
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(tmp_path / "no-such" / "config.toml"))
    default_state = Path(config_mod.Config().state_dir)
    existed = default_state.exists()
    capsys.readouterr()
    code = main(["doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["config"] == {"name": "config", "ok": True, "status": "ok", "fix": "",
                                "detail": f"no config file at {tmp_path}/no-such/config.toml: the built-in defaults "
                                          "apply"}
    assert default_state.exists() is existed
    assert doc["exit_code"] == code and code in (0, 1, 3)  # 3: no metadata server here


def test_a_named_config_that_is_missing_or_invalid_exits_2(gcp, tmp_path, capsys):
    import json

    from slurmagent.cli import main

    missing = tmp_path / "missing.toml"
    code, rows, out = doctor(capsys, missing)
    assert code == 2, out
    assert rows["config"] == ("FAIL", f"config {missing}: file not found",
                              f"fix {missing} (see docs/admin/configuration.md)")
    bad = tmp_path / "bad.toml"
    bad.write_text("state_dir = [\n")
    bad.chmod(0o644)
    capsys.readouterr()
    assert main(["--config", str(bad), "doctor", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 2 and doc["ok"] is False
    assert [c["name"] for c in doc["checks"][:2]] == ["version", "config"]  # which slurmagent, then its config
    assert "not valid TOML" in doc["checks"][1]["detail"]
