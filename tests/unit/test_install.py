"""`slurmagent install --root DIR`: a staging tree, idempotent, never overwriting an edited config."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from support import REPO, need_tool
from slurmagent.state.config import Config, parse
from slurmagent.commands.install import InstallError, config_template, install, run_systemctl, uninstall


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


def test_install_into_staging_root_is_idempotent(tmp_path):
    first = cli("install", "--root", str(tmp_path))
    assert first.returncode == 0, first.stderr
    shim = tmp_path / "etc/slurmagent/hooks/prolog"
    assert os.access(shim, os.X_OK) and (shim.stat().st_mode & 0o777) == 0o755
    assert re.search(r"exec \S+/slurmagent prolog", shim.read_text())
    assert (tmp_path / "etc/slurmagent/config.toml").exists()
    units = sorted(p.name for p in (tmp_path / "usr/lib/systemd/system").iterdir())
    assert "slurmagent-watch.service" in units
    binary = f"{sys.prefix}/bin/slurmagent"
    if os.path.exists(binary):  # units and shims point at this installation
        assert f"exec {binary} prolog" in shim.read_text()
        for unit in units:
            text = (tmp_path / "usr/lib/systemd/system" / unit).read_text()
            assert all(line.startswith(f"ExecStart={binary}") for line in text.splitlines() if line.startswith("ExecStart="))
    assert "slurm.conf" in first.stdout  # it says which slurm.conf lines are still missing
    second = cli("install", "--root", str(tmp_path))
    assert second.returncode == 0
    actions = [line.split()[0] for line in second.stdout.splitlines() if line.startswith(("install", "update", "unchanged", "kept"))]
    assert actions and set(actions) == {"unchanged"}, second.stdout


def test_edited_config_is_never_overwritten(tmp_path):
    install(tmp_path)
    config = tmp_path / "etc/slurmagent/config.toml"
    config.write_text("[health]\ntimeout_s = 5\n")
    steps = {str(s.path): s.action for s in install(tmp_path)}
    assert steps[str(config)] == "kept"
    assert config.read_text() == "[health]\ntimeout_s = 5\n"


def test_dry_run_writes_nothing(tmp_path):
    out = cli("install", "--root", str(tmp_path / "r"), "--dry-run")
    assert out.returncode == 0 and "would install" in out.stdout
    assert not (tmp_path / "r").exists()


def test_config_template_parses_and_uncommented_gives_the_defaults():
    text = config_template()
    assert tomllib.loads(text) == {}  # all commented out: a valid, empty config
    uncommented = "\n".join(line[1:].split("    # ")[0] if line.startswith("#") and "=" in line or line.startswith("#[") else ""
                            for line in text.splitlines())
    cfg = parse(tomllib.loads(uncommented))
    assert cfg == Config(source=cfg.source)


def test_missing_slurm_conf_lines_are_listed(tmp_path):
    (tmp_path / "etc/slurm").mkdir(parents=True)
    (tmp_path / "etc/slurm/slurm.conf").write_text("ClusterName=x\nPrologFlags=Alloc\n")
    out = cli("install", "--root", str(tmp_path))
    assert "nohold_on_prolog_fail" in out.stdout and "Prolog=" in out.stdout


RECORDING_BINARY = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/ran-with"
exit 3
"""


def test_shims_and_units_quote_an_install_path_with_spaces(tmp_path):
    """Unquoted, `[ -x /opt/my venv/bin/slurmagent ]` was a test error: the prolog exited 0, node unchecked."""
    venv_bin = tmp_path / "my venv $HOME %n" / "bin"
    venv_bin.mkdir(parents=True)
    binary = venv_bin / "slurmagent"
    binary.write_text(RECORDING_BINARY)
    binary.chmod(0o755)
    root = tmp_path / "staging root"
    install(root, binary=str(binary))
    for hook in ("prolog", "epilog", "healthcheck"):
        (venv_bin / "ran-with").unlink(missing_ok=True)
        proc = subprocess.run([str(root / "etc/slurmagent/hooks" / hook)], env={}, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 3, proc.stderr  # the binary's own code: it ran (exec), the shim did not fall through
        assert (venv_bin / "ran-with").read_text() == f"{hook}\n"
    unit = (root / "usr/lib/systemd/system/slurmagent-watch.service").read_text()
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    quoted = str(binary).replace("%", "%%").replace("$", "$$")
    assert exec_start == f'ExecStart="{quoted}" watch'


@pytest.mark.parametrize("edited", [False, True])
def test_a_config_narrowed_to_0600_is_never_widened(tmp_path, edited):
    install(tmp_path)
    config = tmp_path / "etc/slurmagent/config.toml"
    if edited:
        config.write_text("[health]\ntimeout_s = 5\n")
    config.chmod(0o600)
    steps = {str(s.path): s.action for s in install(tmp_path)}
    assert steps[str(config)] == ("kept" if edited else "unchanged")
    assert (config.stat().st_mode & 0o777) == 0o600


def read_only(root) -> list[str]:
    """argv prefix: run the rest in a private mount namespace where `root` is a read-only bind mount
    (as root, permission bits do not stop a write; a read-only mount does). Needs unshare (util-linux,
    which CI installs: missing there is a failure) and a kernel that lets root make the namespace
    (not so in some containers: a skip, but a failure in CI, which runs as root on a VM)."""
    unshare = need_tool("unshare", install="apt-get install util-linux")
    proc = subprocess.run([unshare, "-m", "true"], capture_output=True, text=True)
    if proc.returncode != 0:
        why = f"unshare -m cannot make a mount namespace here: {proc.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI runs as root on a VM)", pytrace=False)
        pytest.skip(why)
    return [unshare, "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"',
            str(root)]


needs_mount_ns = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a read-only bind mount")


@needs_mount_ns
@pytest.mark.parametrize("state", ["empty", "installed, a shim's mode changed"])
def test_install_on_a_read_only_root_is_one_line_exit_2(tmp_path, state):
    root = tmp_path / "root"
    root.mkdir()
    if state != "empty":
        install(root)
        (root / "etc/slurmagent/hooks/prolog").chmod(0o700)
        (root / "etc/slurmagent/config.toml").chmod(0o600)
    before = {p: p.stat().st_mode for p in root.rglob("*")}
    proc = subprocess.run([*read_only(root), sys.executable, "-m", "slurmagent.entry", "install", "--root", str(root)],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(rf"slurmagent: cannot write {re.escape(str(root))}/\S+: Read-only file system\n", proc.stderr)
    assert {p: p.stat().st_mode for p in root.rglob("*")} == before  # nothing changed, nothing lost


def test_prolog_and_epilog_dirs_get_our_shim_as_one_script_among_others(tmp_path):
    """The Cluster Toolkit layout: `Prolog=/slurm/custom_scripts/prolog.d/*` runs every script there."""
    args = ("install", "--root", str(tmp_path), "--prolog-dir", "/slurm/custom_scripts/prolog.d",
            "--epilog-dir", "/slurm/custom_scripts/epilog.d")
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    for hook in ("prolog", "epilog"):
        shim = tmp_path / f"slurm/custom_scripts/{hook}.d/zz-slurmagent"
        assert (shim.stat().st_mode & 0o777) == 0o755
        assert re.search(rf"exec \S+/slurmagent {hook}$", shim.read_text(), re.M)
        assert re.search(rf"^install\s+{re.escape(str(shim))}$", first.stdout, re.M), first.stdout
    assert (tmp_path / "etc/slurmagent/hooks/prolog").exists()  # the classic path stays for Prolog= one file
    second = cli(*args)
    assert re.search(rf"^unchanged\s+{re.escape(str(tmp_path))}/slurm/custom_scripts/prolog.d/zz-slurmagent$",
                     second.stdout, re.M), second.stdout


def test_a_relative_prolog_dir_is_refused_in_one_line(tmp_path):
    out = cli("install", "--root", str(tmp_path), "--prolog-dir", "custom_scripts/prolog.d")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "slurmagent: --prolog-dir 'custom_scripts/prolog.d': give an absolute path (slurmd runs Prolog= paths as written)"]
    assert not (tmp_path / "etc").exists()


def tree(root) -> dict[str, bytes | None]:
    """Every path under `root`: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in root.rglob("*")}


def seeded_root(tmp_path):
    """A root as an image has it before slurmagent: other packages' files in the same directories."""
    root = tmp_path / "root"
    for rel, text in {"etc/slurm/slurm.conf": "ClusterName=x\n", "etc/logrotate.d/rsyslog": "/var/log/syslog {}\n",
                      "usr/lib/systemd/system/slurmd.service": "[Service]\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_reinstall_after_admin_edits_keeps_them_and_writes_the_new_version_beside(tmp_path):
    root = seeded_root(tmp_path)
    install(root, binary="/opt/slurmagent/v1/bin/slurmagent")
    unit = root / "usr/lib/systemd/system/slurmagent-watch.service"
    shim = root / "etc/slurmagent/hooks/prolog"
    config = root / "etc/slurmagent/config.toml"
    unit.write_text(unit.read_text() + "# admin: edited in place\n")
    config.write_text("[health]\ntimeout_s = 5\n")
    edited = {p: p.read_text() for p in (unit, config)}

    out = cli("install", "--root", str(root), env={})  # this venv's binary: every shim and unit changes
    assert out.returncode == 0, out.stderr
    for p, text in edited.items():
        assert p.read_text() == text  # the admin's edit survives
    assert f"kept           {unit}  (edited since install wrote it; the new version is beside it: " \
           f"slurmagent-watch.service.slurmagent-new)" in out.stdout.splitlines()
    new = unit.with_name(unit.name + ".slurmagent-new")
    assert "/opt/slurmagent/v1/" not in new.read_text() and "ExecStart=" in new.read_text()
    assert not config.with_name("config.toml.slurmagent-new").exists()  # the template did not change: nothing new
    assert "/opt/slurmagent/v1/" not in shim.read_text()  # not edited: updated
    assert f"update         {shim}" in out.stdout.splitlines()

    # the admin takes the new version: the next install sees it current, the stale copy goes
    unit.write_text(new.read_text())
    again = cli("install", "--root", str(root))
    assert f"remove         {new}  (stale: the file is current again)" in again.stdout.splitlines()
    assert not new.exists() and not [line for line in again.stdout.splitlines() if line.startswith("kept ") and "watch" in line]


def test_uninstall_removes_exactly_what_install_wrote(tmp_path):
    root = seeded_root(tmp_path)
    before = tree(root)
    install(root)
    install(root)
    out = cli("install", "--root", str(root), "--uninstall")
    assert out.returncode == 0, out.stderr
    assert tree(root) == before  # install then uninstall: the tree as it was, directories included
    again = cli("install", "--root", str(root), "--uninstall")
    assert again.returncode == 2 and "nothing to uninstall" in again.stderr


def test_uninstall_keeps_an_edited_file_and_what_the_agent_wrote(tmp_path):
    root = seeded_root(tmp_path)
    before = tree(root)
    install(root, binary="/opt/slurmagent/v1/bin/slurmagent")
    unit = root / "usr/lib/systemd/system/slurmagent-watch.service"
    unit.write_text(unit.read_text() + "# edited\n")
    install(root)  # a .slurmagent-new beside the edited unit, the rest updated
    (root / "var/lib/slurmagent/n1").mkdir()  # what the agent wrote at run time is not install's
    (root / "var/lib/slurmagent/n1/hooks.log").write_text("{}\n")

    dry = cli("install", "--root", str(root), "--uninstall", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout and (root / "var/lib/slurmagent/installed.json").exists()
    out = cli("install", "--root", str(root), "--uninstall")
    assert out.returncode == 0, out.stderr
    assert f"kept           {unit}  (edited since install wrote it: remove it by hand)" in out.stdout.splitlines()
    left = tree(root)
    assert set(left) - set(before) == {"usr/lib/systemd/system/slurmagent-watch.service", "var", "var/lib",
                                       "var/lib/slurmagent", "var/lib/slurmagent/n1", "var/lib/slurmagent/n1/hooks.log"}
    assert {k: v for k, v in left.items() if k in before} == before  # the image's own files untouched


def test_a_full_unit_copy_in_etc_that_hides_the_vendor_unit_is_said(tmp_path):
    old = tmp_path / "etc/systemd/system/slurmagent-watch.service"
    old.parent.mkdir(parents=True)
    old.write_text("[Service]\nExecStart=/old/slurmagent watch\n")
    steps = {(s.action, str(s.path)) for s in install(tmp_path)}
    assert ("shadowed", str(old)) in steps and old.read_text().endswith("/old/slurmagent watch\n")


def test_the_installed_logrotate_file_rotates_the_decision_log_and_logging_goes_on(tmp_path):
    from slurmagent.state.decisionlog import DecisionLog, read_records

    # CI's host lane installs logrotate (.ci/run); ci/debian-lane.sh's chroots do not (yet)
    logrotate = need_tool("logrotate", install="Debian: apt-get install logrotate", chroot_lanes_lack=True)
    install(tmp_path / "root")
    text = (tmp_path / "root/etc/logrotate.d/slurmagent").read_text()
    state = tmp_path / "state"
    conf = tmp_path / "logrotate.conf"
    conf.write_text(text.replace("/var/lib/slurmagent", str(state)))
    (state / "n1").mkdir(parents=True)
    DecisionLog(state / "n1/hooks.log", use_syslog=False).write("prolog", node="n1", verdict="healthy")
    proc = subprocess.run([logrotate, "--force", "--state", str(tmp_path / "lr.state"), str(conf)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (state / "n1/hooks.log").exists() and (state / "n1/hooks.log.1").exists()
    DecisionLog(state / "n1/hooks.log", use_syslog=False).write("prolog", node="n1", verdict="healthy")
    assert len(read_records(state / "n1/hooks.log")) == 1  # the next line starts the new file


def test_binary_option_points_shims_and_units_at_the_current_link(tmp_path):
    out = cli("install", "--root", str(tmp_path), "--binary", "/opt/slurmagent/current/bin/slurmagent")
    assert out.returncode == 0, out.stderr
    assert "exec /opt/slurmagent/current/bin/slurmagent prolog" in (tmp_path / "etc/slurmagent/hooks/prolog").read_text()
    unit = (tmp_path / "usr/lib/systemd/system/slurmagent-watch.service").read_text()
    assert "ExecStart=/opt/slurmagent/current/bin/slurmagent watch" in unit.splitlines()


# A systemctl that records its argv, and whether the watch unit was still on disk when it ran.
FAKE_SYSTEMCTL = """#!/bin/sh
if [ -e "$WATCH_UNIT" ]; then there=yes; else there=no; fi
echo "$* | unit on disk: $there" >> "$SYSTEMCTL_LOG"
[ -z "$SYSTEMCTL_FAILS" ] || { echo "$SYSTEMCTL_FAILS" >&2; exit 1; }
"""


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bindir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SYSTEMCTL_LOG", str(tmp_path / "systemctl.log"))
    monkeypatch.setenv("WATCH_UNIT", str(tmp_path / "root/usr/lib/systemd/system/slurmagent-watch.service"))
    return tmp_path / "systemctl.log"


UNITS = sorted(p.name for p in (REPO / "systemd").iterdir() if p.suffix in (".service", ".timer"))


def test_uninstall_disables_and_stops_the_units_before_removing_them(tmp_path, fake_systemctl):
    root = tmp_path / "root"
    install(root)
    dry = uninstall(root, dry_run=True, systemctl=run_systemctl)
    assert (dry[0].action, dry[-1].action) == ("would run", "would run") and not fake_systemctl.exists()
    steps = uninstall(root, systemctl=run_systemctl)
    assert fake_systemctl.read_text().splitlines() == [
        f"disable --now {' '.join(UNITS)} | unit on disk: yes",  # stopped while its file is still there
        "daemon-reload | unit on disk: no"]  # systemd forgets the removed units
    said = [(s.action, str(s.path)) for s in steps]
    assert said[0] == ("ran", f"systemctl disable --now {' '.join(UNITS)}") and said[-1] == ("ran", "systemctl daemon-reload")
    assert not (root / "usr/lib/systemd/system/slurmagent-watch.service").exists()


def test_uninstall_removes_nothing_when_the_units_do_not_stop(tmp_path, fake_systemctl, monkeypatch):
    root = tmp_path / "root"
    install(root)
    before = tree(root)
    monkeypatch.setenv("SYSTEMCTL_FAILS", "Failed to disable unit: Access denied")
    with pytest.raises(InstallError, match="failed: Failed to disable unit: Access denied; nothing removed"):
        uninstall(root, systemctl=run_systemctl)
    assert tree(root) == before and len(fake_systemctl.read_text().splitlines()) == 1


def test_uninstall_with_root_prints_the_systemctl_commands_in_their_order(tmp_path, fake_systemctl):
    root = tmp_path / "root"
    install(root)
    out = cli("install", "--root", str(root), "--uninstall")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    removes = [i for i, line in enumerate(lines) if line.startswith("remove ")]
    assert lines[0] == f"run by hand    systemctl disable --now {' '.join(UNITS)}  (on the node, before the units go)"
    assert lines[max(removes) + 1] == "run by hand    systemctl daemon-reload  (on the node, after the units went)"
    assert min(removes) == 1 and not fake_systemctl.exists()  # --root changes no live system
    assert not (root / "usr/lib/systemd/system/slurmagent-watch.service").exists()


@pytest.mark.parametrize("node_exporter", [True, False], ids=["debian-node-exporter", "no-node-exporter"])
def test_install_points_the_metrics_at_a_directory_node_exporter_can_read(tmp_path, node_exporter):
    """Before: the textfile defaulted to the 0750 root state dir, which node_exporter (user
    `prometheus`) cannot read, and no unit could write anywhere else under ProtectSystem=strict."""
    from test_unit_hardening import service, under, writable

    root = tmp_path / "r"
    if node_exporter:  # what Debian's prometheus-node-exporter package creates
        (root / "var/lib/prometheus/node-exporter").mkdir(parents=True)
    steps = install(root, binary="/opt/slurmagent/venv/bin/slurmagent")
    textfile = tomllib.loads((root / "etc/slurmagent/config.toml").read_text())["metrics"]["textfile"]
    want = "/var/lib/prometheus/node-exporter" if node_exporter else "/var/lib/slurmagent-metrics"
    assert textfile == f"{want}/slurmagent.prom"
    textdir = root / want.lstrip("/")
    assert textdir.is_dir() and textdir.stat().st_mode & 0o005 == 0o005  # others may list and enter it
    assert textdir.stat().st_mode & 0o022 == 0 and textdir.stat().st_uid == os.getuid()  # only its owner writes
    assert (root / "var/lib/slurmagent").stat().st_mode & 0o007 == 0  # the state dir stays closed
    said = {s.path: s for s in steps}[textdir]
    assert ("--collector.textfile.directory" in said.note) is not node_exporter
    units = sorted((root / "usr/lib/systemd/system").glob("*.service"))
    assert len(units) == 4
    for unit in units:  # every unit that writes metrics may write the textfile
        keys = service(unit)
        assert under(textfile, writable(keys)), (unit.name, keys.get("ReadWritePaths"))
        assert f"-{want}" in [p for v in keys["ReadWritePaths"] for p in v.split()]  # a missing dir never stops the unit
    parse(tomllib.loads((root / "etc/slurmagent/config.toml").read_text()))  # a valid config


def test_a_node_exporter_installed_later_moves_an_untouched_config_there(tmp_path):
    install(tmp_path, binary="/opt/slurmagent/venv/bin/slurmagent")
    conf = tmp_path / "etc/slurmagent/config.toml"
    assert tomllib.loads(conf.read_text())["metrics"]["textfile"] == "/var/lib/slurmagent-metrics/slurmagent.prom"
    (tmp_path / "var/lib/prometheus/node-exporter").mkdir(parents=True)
    install(tmp_path, binary="/opt/slurmagent/venv/bin/slurmagent")
    assert tomllib.loads(conf.read_text())["metrics"]["textfile"] == \
        "/var/lib/prometheus/node-exporter/slurmagent.prom"


@pytest.mark.parametrize("node_exporter", [True, False], ids=["debian-node-exporter", "no-node-exporter"])
def test_uninstall_removes_the_metrics_node_exporter_would_serve_for_ever(tmp_path, node_exporter):
    """The units wrote slurmagent.prom at run time (not install's file): left behind, node_exporter
    would serve an uninstalled node's last heartbeat as if it were watched."""
    root = tmp_path / "r"
    textdir = root / ("var/lib/prometheus/node-exporter" if node_exporter else "var/lib/slurmagent-metrics")
    if node_exporter:
        textdir.mkdir(parents=True)
        (textdir / "other.prom").write_text("other_exporter_up 1\n")  # another collector's file stays
    install(root)
    (textdir / "slurmagent.prom").write_text('slurmagent_last_run_timestamp_seconds{component="watch"} 1.7e9\n')
    dry = cli("install", "--root", str(root), "--uninstall", "--dry-run")
    assert f"would remove   {textdir / 'slurmagent.prom'}" in " ".join(dry.stdout.splitlines()) and (textdir / "slurmagent.prom").exists()
    out = cli("install", "--root", str(root), "--uninstall")
    assert out.returncode == 0, out.stderr
    assert not (textdir / "slurmagent.prom").exists()
    if node_exporter:
        assert (textdir / "other.prom").exists()
    else:
        assert not textdir.exists()  # our own directory, empty again, goes with the install
